"""QTensor: accessors against torch's quantized tensors, integer shape ops, the float fallback, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import lowbit as Q

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")


def pair(shape=(2, 3, 4, 4), scale=0.05, zp=3, dtype=Q.quint8, seed=0):
    """A lowbit QTensor and the torch quantized tensor with the same grid."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return Q.quantize_per_tensor(x, scale, zp, dtype), torch.quantize_per_tensor(x, scale, zp, dtype.torch_dtype)


def pair_pc(axis=0, dtype=Q.qint8):
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1))
    n = x.shape[axis]
    s, z = torch.linspace(0.01, 0.05, n), torch.arange(n) - 1
    ours = Q.quantize_per_channel(x, s, z, axis, dtype)
    return ours, torch.quantize_per_channel(x, s.double(), z, axis % x.dim(), dtype.torch_dtype)



# ---- accessors ----
def test_per_tensor_accessors_match_torch():
    qt, ref = pair()
    assert torch.equal(qt.int_repr(), ref.int_repr()) and torch.equal(qt.dequantize(), ref.dequantize())
    assert (qt.q_scale(), qt.q_zero_point()) == (pytest.approx(ref.q_scale()), ref.q_zero_point())
    assert qt.qscheme() is Q.per_tensor_affine and qt.shape == ref.shape and qt.dtype == Q.quint8
    assert qt.device == ref.device and qt.int_repr().dtype == torch.uint8
    assert (qt.dim(), qt.numel(), len(qt), qt.size(1)) == (4, 96, 2, 3) and qt.is_quantized


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_channel_accessors_match_torch(axis):
    qt, ref = pair_pc(axis)
    assert torch.equal(qt.int_repr(), ref.int_repr()) and torch.equal(qt.dequantize(), ref.dequantize())
    assert torch.equal(qt.q_per_channel_scales().double(), ref.q_per_channel_scales().float().double())
    assert torch.equal(qt.q_per_channel_zero_points(), ref.q_per_channel_zero_points())
    assert qt.q_per_channel_axis() == ref.q_per_channel_axis() and qt.qscheme() is Q.per_channel_affine
    with pytest.raises(RuntimeError, match="q_scale"):
        qt.q_scale()
    with pytest.raises(RuntimeError, match="q_per_channel_axis"):
        pair()[0].q_per_channel_axis()


def test_to_moves_devices_and_a_dtype_gives_the_dequantized_values():
    qt = pair()[0]
    moved = qt.to("cpu")
    assert isinstance(moved, Q.QTensor) and torch.equal(moved.int_repr(), qt.int_repr()) and moved.device.type == "cpu"
    half = qt.to(torch.float16)  # an explicit float request: the float fallback (as .half())
    assert half.dtype == torch.float16 and torch.equal(half, qt.dequantize().half())
    assert "scale=0.05" in repr(qt) and "lowbit.quint8" in repr(qt)


# ---- integer shape ops ----
def stays_integer(out, expected_float):
    assert isinstance(out, Q.QTensor) and not out.int_repr().is_floating_point()
    assert torch.equal(out.dequantize(), expected_float)


@pytest.mark.parametrize("op", [
    lambda t: t.view(2, -1), lambda t: t.reshape(6, 16), lambda t: t.flatten(1), lambda t: torch.flatten(t, 1),
    lambda t: t.permute(0, 2, 3, 1), lambda t: t.transpose(1, 2), lambda t: t[:, 1:], lambda t: t.contiguous(),
    lambda t: t.relu(), lambda t: torch.relu(t), lambda t: F.relu(t),
    lambda t: F.max_pool2d(t, 2), lambda t: F.adaptive_max_pool2d(t, 1), lambda t: torch.cat([t, t], 1),
    lambda t: -t, lambda t: torch.neg(t), lambda t: t.neg(),  # (graphops44: the mirrored codes, exact)
])
def test_shape_ops_stay_integer(op):
    qt, ref = pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may fall back to float
        out = op(qt)
    stays_integer(out, op(ref.dequantize()))


def test_relu_per_channel_stays_integer():
    qt, _ = pair_pc(1)
    stays_integer(qt.relu(), torch.relu(qt.dequantize()))
    assert qt.relu().q_per_channel_axis() == 1


def test_cat_of_different_grids_falls_back_to_float():
    a, b = pair(scale=0.05)[0], pair(scale=0.1)[0]
    with pytest.warns(UserWarning, match="torch.cat"):
        out = torch.cat([a, b])
    assert torch.equal(out, torch.cat([a.dequantize(), b.dequantize()]))


# ---- float fallback: warns once naming the op, gives dequantized-result values ----
@pytest.mark.parametrize("op, name", [
    (lambda t: t + 1.0, "torch.add"), (lambda t: torch.sigmoid(t), "torch.sigmoid"),
    (lambda t: t * t, "torch.mul"), (lambda t: F.gelu(t), "gelu"),
    (lambda t: torch.abs(t), "torch.abs"),
])
def test_float_op_warns_once_and_runs_on_dequantized_values(op, name):
    qt, _ = pair()
    with pytest.warns(UserWarning, match=name) as rec:
        out = op(qt)
    assert len([w for w in rec if name in str(w.message)]) == 1
    assert not isinstance(out, Q.QTensor) and torch.equal(out, op(qt.dequantize()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(qt)  # second time: silent


def test_per_channel_shape_op_falls_back_with_a_warning():
    qt, _ = pair_pc(0)
    with pytest.warns(UserWarning, match="QTensor.reshape"):
        out = qt.reshape(2, -1)  # merges the channel dim (size 4) with the others
    assert torch.equal(out, qt.dequantize().reshape(2, -1))


# ---- bad input ----
def test_qtensor_rejects_bad_construction():
    with pytest.raises(TypeError, match="float32"):
        Q.QTensor(torch.zeros(3), 0.1, 0, Q.qint8)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        Q.QTensor(torch.zeros(3, 2, dtype=torch.int8), torch.ones(2), torch.zeros(2), Q.qint8, axis=0)
    with pytest.raises(ValueError, match="scalar qparams"):
        Q.QTensor(torch.zeros(3, dtype=torch.int8), torch.ones(3), torch.zeros(3), Q.qint8)
    with pytest.raises(ValueError, match="axis=2|ch_axis=2"):
        Q.quantize_per_channel(torch.ones(3, 2), torch.ones(2), torch.zeros(2), 2, Q.qint8)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        Q.quantize_per_channel(torch.ones(3, 2), torch.ones(4), torch.zeros(4), 0, Q.qint8)
    with pytest.raises(TypeError, match="int64"):
        Q.quantize_per_tensor(torch.arange(3), 0.1, 0, Q.qint8)
    with pytest.raises(ValueError, match="scale"):
        Q.quantize_per_tensor(torch.ones(3), float("nan"), 0, Q.qint8)
    with pytest.raises(TypeError, match="float64"):
        Q.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_codes_equal_cpu_codes():
    qt, _ = pair()
    x = qt.dequantize() + 0.3 * qt.q_scale()  # off the grid, away from ties
    on_gpu = Q.quantize_per_tensor(x.cuda(), qt.q_scale(), qt.q_zero_point(), Q.quint8)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.int_repr().cpu(), Q.quantize_per_tensor(
        x, qt.q_scale(), qt.q_zero_point(), Q.quint8).int_repr())
    moved = qt.to("cuda")
    assert moved.scale.device.type == "cuda" and torch.equal(moved.dequantize().cpu(), qt.dequantize())
    pc, _ = pair_pc(1)
    assert torch.equal(pc.to("cuda").relu().int_repr().cpu(), pc.relu().int_repr())
