"""QTensor ops that stay quantized: pooling, mean, nearest resampling, padding, clamping, chunk/split/unbind
and per-channel axis bookkeeping; oracle: the same op on ``torch.quantize_per_tensor`` tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit import native

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")



def data(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2


def pieces(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_codes(ours, ref, averaging=False):
    """Codes equal torch's; an averaging op may differ by one code, and only on an exact .5 tie."""
    assert isinstance(ours, Q.QTensor) and ours.shape == ref.shape
    assert ours.q_scale() == pytest.approx(ref.q_scale(), rel=1e-7) and ours.q_zero_point() == ref.q_zero_point()
    diff = (ours.int_repr().int() - ref.int_repr().int()).abs()
    assert diff.numel() == 0 or int(diff.max()) <= (1 if averaging else 0)
    return diff


def helper(op, shape=(2, 3, 7, 8), dtype=Q.quint8, scale=0.05, zp=10, averaging=False, seed=0):
    """``op`` on a lowbit QTensor vs on torch's quantized tensor of the same grid, without any fallback."""
    x = data(shape, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a float fallback would warn
        ours = pieces(op(Q.quantize_per_tensor(x, scale, zp, dtype)))
    refs = pieces(op(torch.quantize_per_tensor(x, scale, zp, dtype.torch_dtype)))
    assert len(ours) == len(refs)
    return [check_codes(o, r, averaging) for o, r in zip(ours, refs)]


EXACT = [
    (lambda t: F.avg_pool2d(t, 2), (2, 3, 7, 8)),
    (lambda t: F.avg_pool2d(t, 3, 2, 1), (2, 3, 7, 8)),
    (lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 7, 8)),
    (lambda t: F.avg_pool2d(t, 2, divisor_override=3), (2, 3, 7, 8)),
    (lambda t: F.avg_pool1d(t, 3, 1, 1), (4, 3, 9)),
    (lambda t: F.avg_pool3d(t, 2), (2, 3, 4, 6, 6)),
    (lambda t: F.adaptive_avg_pool1d(t, 4), (4, 3, 9)),
    (lambda t: F.adaptive_avg_pool2d(t, (3, 5)), (2, 3, 7, 8)),
    (lambda t: F.adaptive_avg_pool3d(t, 2), (2, 3, 4, 6, 6)),
    (lambda t: torch.mean(t, (2, 3), keepdim=True), (2, 3, 7, 8)),
    (lambda t: t.mean(1), (2, 3, 7, 8)),
    (lambda t: F.interpolate(t, scale_factor=2), (2, 3, 7, 8)),
    (lambda t: F.interpolate(t, size=(5, 11), mode="nearest"), (2, 3, 7, 8)),
    (lambda t: F.pad(t, (1, 2, 0, 1)), (2, 3, 7, 8)),
    (lambda t: F.pad(t, (1, 2), value=0.33), (2, 3, 7, 8)),
    (lambda t: F.hardtanh(t, -0.3, 0.4), (2, 3, 7, 8)),
    (lambda t: F.relu6(t), (2, 3, 7, 8)),
    (lambda t: torch.clamp(t, -0.3, 0.4), (2, 3, 7, 8)),
    (lambda t: t.clamp(min=0.123), (2, 3, 7, 8)),
    (lambda t: t.chunk(3, 3), (2, 3, 7, 8)),
    (lambda t: torch.chunk(t, 2, 1), (2, 3, 7, 8)),
    (lambda t: t.split(3, 2), (2, 3, 7, 8)),
    (lambda t: torch.split(t, [2, 5], 2), (2, 3, 7, 8)),
    (lambda t: t.unbind(1), (2, 3, 7, 8)),
    (lambda t: torch.unbind(t, -1), (2, 3, 7, 8)),
]


@pytest.mark.parametrize("dtype, zp", [(Q.quint8, 10), (Q.qint8, -3)])
@pytest.mark.parametrize("op, shape", EXACT)
def test_ops_stay_quantized_and_match_torch(op, shape, dtype, zp):
    helper(op, shape, dtype, zp=zp)


def test_global_average_differs_from_torch_only_on_ties():
    """torch scales the window sum by a float32 1/count, so an exact .5 tie can round up (documented)."""
    for seed in range(40):
        x = data((2, 3, 7, 8), seed)
        codes = Q.quantize_per_tensor(x, 0.05, 10, Q.quint8).int_repr().double()
        diff = helper(lambda t: F.adaptive_avg_pool2d(t, 1), averaging=True, seed=seed)[0]
        mean = codes.mean((2, 3), keepdim=True)
        assert torch.all((diff == 0) | (mean - mean.floor() == 0.5))


def test_nn_modules_stay_quantized():
    mods = [nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.AdaptiveAvgPool1d(2), nn.Upsample(scale_factor=2),
            nn.ZeroPad2d(1), nn.ConstantPad2d((1, 0), 0.0), nn.ReLU6(), nn.Hardtanh(-0.5, 0.5)]
    for m in mods:
        shape = (2, 3, 8) if isinstance(m, nn.AdaptiveAvgPool1d) else (2, 3, 7, 8)
        helper(m, shape, averaging=isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool1d)))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(Q.quint8, 0, 255), (Q.qint8, -128, 127)]), st.integers(0, 1 << 16),
       st.floats(0.005, 0.5), st.integers(1, 3), st.integers(1, 3), st.integers(0, 1), st.booleans(),
       st.booleans(), st.integers(2, 9), st.integers(2, 9))
def test_avg_pool_property(grid, zp_seed, scale, k, stride, pad, ceil, include_pad, h, w):
    dtype, lo, hi = grid
    zp = lo + zp_seed % (hi - lo + 1)
    k, pad = min(k, h, w), min(pad, min(k, h, w) // 2)
    op = lambda t: F.avg_pool2d(t, k, stride, pad, ceil, include_pad)  # noqa: E731
    diff = helper(op, (1, 2, h, w), dtype, scale, zp, averaging=True, seed=zp_seed)[0]
    exact = op(Q.quantize_per_tensor(data((1, 2, h, w), zp_seed), scale, zp, dtype).int_repr().double() - zp) + zp
    assert torch.all((diff == 0) | (exact - exact.floor() == 0.5))  # a 1-code difference only on a tie


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([Q.quint8, Q.qint8]), st.integers(0, 1 << 16), st.floats(0.005, 0.5),
       st.integers(1, 6), st.integers(1, 6), st.floats(-3, 3), st.floats(0, 3),
       st.lists(st.integers(0, 2), min_size=4, max_size=4))
def test_selection_ops_property(dtype, seed, scale, oh, ow, lo, width, pad):
    zp = seed % 256 + dtype.quant_min
    shape = (2, 2, 4, 5)
    ops = [lambda t: F.interpolate(t, size=(oh, ow)), lambda t: F.pad(t, pad),
           lambda t: F.adaptive_avg_pool2d(t, (min(oh, 4), min(ow, 5)))]
    for i, op in enumerate(ops):
        helper(op, shape, dtype, scale, zp, averaging=i == 2, seed=seed)
    s = float(torch.tensor(scale))  # (float32, as stored)
    top, bottom = (dtype.quant_max - zp) * s, (dtype.quant_min - zp) * s
    for op in (lambda t: t.clamp(lo, lo + width), lambda t: F.hardtanh(t, lo, lo + width)):
        if lo - top > 0.5001 * s or bottom - (lo + width) > 0.5001 * s:  # every output off the grid: float values
            qt = Q.quantize_per_tensor(data(shape, seed), scale, zp, dtype)  # (torch's codes saturate at its end)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y = op(qt)
            assert not isinstance(y, Q.QTensor) and torch.equal(y, op(qt.dequantize()))
        else:
            helper(op, shape, dtype, scale, zp, seed=seed)


# ---- per-channel QTensors ----
def pc(shape=(2, 3, 6, 5), axis=1, dtype=Q.quint8):
    x = data(shape, 7)
    n = shape[axis]
    s, z = torch.linspace(0.02, 0.06, n), torch.arange(n) * 7 % 19 + (0 if dtype == Q.quint8 else -9)
    return x, Q.quantize_per_channel(x, s, z, axis, dtype)


def same_values(out, expected, axis):
    assert isinstance(out, Q.QTensor) and out.axis == axis
    assert torch.equal(out.dequantize(), expected)


@pytest.mark.parametrize("op, axis", [
    (lambda t: t.permute(0, 2, 3, 1), 3), (lambda t: torch.permute(t, (1, 0, 2, 3)), 0),
    (lambda t: t.transpose(1, 3), 3), (lambda t: t.transpose(0, 2), 1), (lambda t: torch.transpose(t, 3, 2), 1),
    (lambda t: t.reshape(2, 3, 30), 1), (lambda t: t.view(1, 2, 3, 30), 2), (lambda t: t.flatten(2), 1),
    (lambda t: torch.flatten(t, 0, 0), 1), (lambda t: t.unsqueeze(0), 2), (lambda t: t.unsqueeze(-1), 1),
    (lambda t: t[1], 0), (lambda t: t[:, 1:], 1), (lambda t: t[..., 2], 1), (lambda t: t[None, :, ::2], 2),
    (lambda t: t[:, 1], None), (lambda t: t[0, -1, 2:], None),
])
def test_per_channel_shape_ops_move_the_axis(op, axis):
    x, qt = pc()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        same_values(op(qt), op(qt.dequantize()), axis)


@pytest.mark.parametrize("op, copies", [
    (lambda t: torch.flatten(t, 1), True), (lambda t: t.flatten(), True), (lambda t: t.flatten(0, 1), True),
    (lambda t: t.flatten(1, 2), True), (lambda t: t.flatten(-3, -1), True), (lambda t: t.reshape(2, -1), True),
    (lambda t: t.reshape((-1, 30)), True), (lambda t: t.flatten(2), False), (lambda t: t.reshape(2, 3, 30), False),
])
@pytest.mark.parametrize("qdtype", [Q.quint8, Q.qint8])
def test_flatten_of_channels_last_codes_is_torchs(op, copies, qdtype):
    """A flatten / 2-d reshape merging the channels of channels-last per-tensor codes with another dim copies them
    to NCHW order in one native pass (``native.to_contiguous``); the codes and grid are torch's (and the float
    tensor's) either way; a merge of H and W alone stays a view."""
    qt = Q.quantize_per_tensor(data((2, 3, 6, 5), 3), 0.05, 7, qdtype)
    cl = Q.QTensor(qt.int_repr().contiguous(memory_format=torch.channels_last), qt.scale, qt.zero_point, qt.qdtype,
                   qt.axis)
    before = native.counts["to_nchw"]
    out, ref = op(cl), op(qt)
    assert torch.equal(out.int_repr(), ref.int_repr()) and out.axis == ref.axis and out.shape == ref.shape
    assert torch.equal(out.dequantize(), op(qt.dequantize()))
    assert native.counts["to_nchw"] - before == (1 if copies and native.available() else 0)


def test_per_channel_getitem_and_unbind_match_torch():
    x, qt = pc()
    ref = torch.quantize_per_channel(x, qt.scale.double(), qt.zero_point, 1, torch.quint8)
    for op in (lambda t: t[:, 2], lambda t: t[1], lambda t: t.unbind(1)[0], lambda t: t.unbind(0)[1]):
        o, r = op(qt), op(ref)
        assert torch.equal(o.int_repr(), r.int_repr()) and o.qscheme().value == str(r.qscheme()).split(".")[-1]
        if r.qscheme() == torch.per_tensor_affine:
            assert (o.q_scale(), o.q_zero_point()) == (pytest.approx(r.q_scale()), r.q_zero_point())
        else:
            assert o.q_per_channel_axis() == r.q_per_channel_axis()


@pytest.mark.parametrize("name, args, axes", [
    ("chunk", (2, 1), [1, None]), ("split", ([1, 2], 1), [None, 1]), ("unbind", (1,), [None] * 3),  # (one channel:
    # its per-tensor grid, as torch's; since session 37)
    ("chunk", (3, 2), [1] * 3), ("unbind", (0,), [0, 0]), ("unbind", (3,), [1] * 5), ("split", (2, -1), [1] * 3),
])
def test_per_channel_splits_slice_the_qparams(name, args, axes):
    x, qt = pc()
    outs, expected = getattr(qt, name)(*args), getattr(qt.dequantize(), name)(*args)
    assert [o.axis for o in outs] == axes
    for o, e in zip(outs, expected):
        assert torch.equal(o.dequantize(), e)
    if name != "unbind" and args[-1] == 1:  # split along the channel axis: qparams are split too
        assert torch.equal(torch.cat([o.scale.reshape(-1) for o in outs]), qt.scale)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=4), st.data())
def test_per_channel_shape_ops_property(shape, draw):
    """Any permute / transpose / split / unbind / basic index / unsqueeze keeps the values; with distinct
    per-channel scales, equal dequantized values mean the qparams follow the channel dim."""
    nd = len(shape)
    axis = draw.draw(st.integers(0, nd - 1))
    x = data(shape, seed=nd)
    qt = Q.quantize_per_channel(x, torch.linspace(0.02, 0.07, shape[axis]), torch.arange(shape[axis]) % 5, axis, Q.qint8)
    d = draw.draw(st.integers(-nd, nd - 1))
    i = draw.draw(st.integers(-shape[d], shape[d] - 1))
    perm = draw.draw(st.permutations(range(nd)))
    ops = [lambda t: t.permute(*perm), lambda t: t.transpose(d, nd - 1),
           lambda t: t.chunk(2, d)[-1], lambda t: t.split(1, d)[i], lambda t: t.unbind(d)[i], lambda t: t.unsqueeze(d),
           lambda t: t[(slice(None),) * (d % nd) + (i,)], lambda t: t[(slice(None),) * (d % nd) + (slice(i, None),)],
           lambda t: t[..., None, ::2]]
    op = draw.draw(st.sampled_from(ops))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = op(qt)
    assert isinstance(out, Q.QTensor) and torch.equal(out.dequantize(), op(qt.dequantize()))


def per_channel_oracle(op, x, qt):
    """Channel by channel: torch's op on a per-tensor quantized slice with that channel's grid."""
    outs = [op(torch.quantize_per_tensor(x[:, c:c + 1], float(qt.scale[c]), int(qt.zero_point[c]), torch.quint8))
            for c in range(x.shape[1])]
    return torch.cat([o.int_repr() for o in outs], 1)


@pytest.mark.parametrize("op", [
    lambda t: F.avg_pool2d(t, 2), lambda t: F.avg_pool2d(t, 3, 1, 1), lambda t: F.adaptive_avg_pool2d(t, (2, 3)),
    lambda t: F.interpolate(t, scale_factor=2), lambda t: F.pad(t, (1, 1, 2, 0)),
    lambda t: torch.mean(t, (2, 3), keepdim=True), lambda t: F.hardtanh(t, -0.2, 0.3), lambda t: F.relu6(t),
])
def test_per_channel_pooling_keeps_the_grid(op):
    x, qt = pc()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = op(qt)
    assert out.axis == 1 and torch.equal(out.scale, qt.scale) and torch.equal(out.zero_point, qt.zero_point)
    assert (out.int_repr().int() - per_channel_oracle(op, x, qt).int()).abs().max() <= 1


def test_per_channel_mean_moves_the_axis():
    x, qt = pc(axis=1)
    out = qt.mean((0, 2))
    assert out.axis == 0 and out.shape == (3, 5)
    ref = torch.stack([torch.quantize_per_tensor(x[:, c], float(qt.scale[c]), int(qt.zero_point[c]),
                                                 torch.quint8).mean((0, 1)).int_repr() for c in range(3)])
    assert (out.int_repr().int() - ref.int()).abs().max() <= 1


# ---- what falls back to float (with one warning naming the op) ----
@pytest.mark.parametrize("op, name", [
    (lambda t: F.avg_pool2d(t, 2), "avg_pool2d"),              # pools over the channel axis (3)
    (lambda t: t.mean(3), "mean"),
    (lambda t: F.pad(t, (1, 1)), "pad"),
    (lambda t: t.reshape(2, -1), "QTensor.reshape"),            # merges the channel dim
    (lambda t: t[..., torch.tensor([[0, 1], [1, 0]])], "QTensor.__getitem__"),  # advanced indexing mixing channels
])
def test_per_channel_ops_touching_the_axis_fall_back(op, name):
    x, qt = pc(axis=3)
    with pytest.warns(UserWarning, match=name):
        out = op(qt)
    assert not isinstance(out, Q.QTensor) and torch.equal(out, op(qt.dequantize()))


@pytest.mark.parametrize("op, name", [
    (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", antialias=True), "interpolate"),  # (plain: int8)
    (lambda t: F.pad(t, (1, 1, 1, 1), mode="reflect"), "pad"),
    (lambda t: torch.clamp(t, torch.tensor(0.1)), "clamp"),
    (lambda t: torch.mean(t, dtype=torch.float64), "mean"),
])
def test_unsupported_variants_fall_back(op, name):
    qt = Q.quantize_per_tensor(data((1, 2, 4, 4)), 0.05, 10, Q.quint8)
    with pytest.warns(UserWarning, match=name):
        out = op(qt)
    assert not isinstance(out, Q.QTensor) and torch.allclose(out, op(qt.dequantize()).to(out.dtype))


def test_bad_arguments_raise():
    qt = Q.quantize_per_tensor(data((1, 2, 4, 4)), 0.05, 10, Q.quint8)
    with pytest.raises(ValueError, match="min=None and max=None"):
        qt.clamp()
    with pytest.raises(RuntimeError, match="chunk"):
        qt.chunk(0)
    with pytest.raises(RuntimeError):
        F.avg_pool2d(qt, 5)  # kernel larger than the input: torch's own error, not a silent result
