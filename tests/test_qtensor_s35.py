"""QTensor against torch's quantized tensors (session 35 sweep): each test failed before its fix."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lowbit as Q
from lowbit.qtensor import _warned_ops

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")


def _pt() -> Q.QTensor:
    return Q.quantize_per_tensor(torch.linspace(-1, 1, 6), 0.01, 128, Q.quint8)  # grid [-1.28, 1.27]


def _pc() -> Q.QTensor:
    return Q.quantize_per_channel(torch.linspace(-1, 1, 6).reshape(2, 3), torch.tensor([0.01, 0.02]),
                                  torch.tensor([0, 10]), 0, Q.qint8)  # grids [-1.28, 1.27], [-2.76, 2.34]


@pytest.mark.parametrize("op, value", [
    (lambda a: torch.clamp(a, min=5.0), 5.0),             # was 1.27 everywhere (torch's quantized clamp: the same)
    (lambda a: torch.clamp(a, max=-5.0), -5.0),           # was -1.28
    (lambda a: F.hardtanh(a, 2.0, 3.0), 2.0),             # was 1.27
    (lambda a: a.clamp(min=float("inf")), float("inf")),
    (lambda a: torch.clip(a, -9.0, -8.0), -8.0),
])
@pytest.mark.parametrize("make", [_pt, _pc])
def test_a_clamp_bound_past_the_grids_far_end_runs_on_float(op, value, make):
    qt = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = op(qt)
    assert not isinstance(y, Q.QTensor)  # the grid cannot hold the result: float values, as F.pad with such a value
    assert torch.equal(y, torch.full(qt.shape, value))


@pytest.mark.parametrize("lo, hi", [(0.0, 6.0), (-1.0, 1.0), (-5.0, 5.0), (0.3, 0.5), (-5.0, None), (None, 5.0),
                                    (1.27, None), (None, -1.28), (0.5, -0.5)])
def test_a_clamp_bound_the_grid_can_hold_keeps_torchs_codes(lo, hi):
    x = torch.linspace(-1, 1, 6)
    ref = torch.clamp(torch.quantize_per_tensor(x, 0.01, 128, torch.quint8), lo, hi)
    y = torch.clamp(_pt(), lo, hi)
    assert isinstance(y, Q.QTensor) and torch.equal(y.int_repr(), ref.int_repr()) and y.q_zero_point() == 128
    pc = torch.clamp(_pc(), lo, hi)
    expect = Q.quantize_per_channel(torch.clamp(_pc().dequantize(), lo, hi), _pc().scale, _pc().zero_point, 0, Q.qint8)
    assert isinstance(pc, Q.QTensor) and torch.equal(pc.int_repr(), expect.int_repr())


def _custom() -> Q.QTensor:
    return Q.QTensor(torch.tensor([[0, 3], [-7, 7]], dtype=torch.int8), 0.5, -1, Q.qint8.with_range(-7, 7))


@pytest.mark.parametrize("make", [
    _pt, _pc, _custom,
    lambda: Q.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([1.5, -2.0]), 0, Q.quint8),
    lambda: Q.quantize_per_tensor(torch.randn(3, 4), 0.001, 7, Q.qint32)[:, ::2],
    lambda: Q.quantize_per_tensor(torch.randn(2, 3, 4, 4), 0.1, 3, Q.quint8).contiguous(memory_format=torch.channels_last),
])
def test_torch_load_reads_a_saved_qtensor_with_its_default_weights_only(make):
    qt = make()
    buf = io.BytesIO()
    torch.save({"x": qt, "w": torch.ones(2)}, buf)
    buf.seek(0)
    back = torch.load(buf)["x"]  # weights_only=True: was "Weights only load failed ... Unsupported global"
    for r in (back, pickle.loads(pickle.dumps(qt))):
        assert isinstance(r, Q.QTensor) and r.qdtype == qt.qdtype and r.axis == qt.axis
        assert torch.equal(r.int_repr(), qt.int_repr()) and r.int_repr().stride() == qt.int_repr().stride()
        assert torch.equal(r.scale, qt.scale) and torch.equal(r.zero_point, qt.zero_point)
        assert r.zero_point.dtype == qt.zero_point.dtype
    assert back.qdtype is Q.quint8 or qt.qdtype is not Q.quint8  # a builtin grid comes back as the builtin


def test_a_tampered_qtensor_file_is_refused_naming_the_value():
    qt = _pt()
    qt._scale = torch.tensor(float("nan"))  # what a hand-edited file could hold
    buf = io.BytesIO()
    torch.save(qt, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="scale=nan"):
        torch.load(buf)


@pytest.mark.parametrize("fn, args", [(torch.relu_, ()), (F.relu_, ()), (F.hardtanh_, (-0.5, 0.5)),
                                      (torch.clamp_, (0.0, 0.5)), (F.leaky_relu_, (0.1,)), (torch.sigmoid_, ())])
def test_torchs_inplace_functions_on_a_qtensor_are_refused_like_its_inplace_methods(fn, args):
    qt = _pt()
    before = qt.int_repr().clone()
    with pytest.raises(TypeError, match="in-place ops are not supported on a QTensor"):
        fn(qt, *args)  # was: ran on a dequantized copy, returned float, and left qt unchanged (torch changes it)
    assert torch.equal(qt.int_repr(), before)


def test_inplace_argument_names_stay_supported():
    qt = _pt()
    assert torch.equal(F.relu(qt, inplace=True).int_repr(), torch.relu(qt).int_repr())  # nn.ReLU(inplace=True)
    assert torch.equal(F.hardtanh(qt, -0.5, 0.5, inplace=True).int_repr(), F.hardtanh(qt, -0.5, 0.5).int_repr())
    t = torch.zeros(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.clamp_(t, min=_pt())  # a QTensor as another argument of a float tensor's in-place op: float values
    assert torch.equal(t, torch.clamp(torch.zeros(6), min=_pt().dequantize()))


@pytest.mark.parametrize("scale, zp", [(np.float32(0.1), 3), (0.1, np.int64(3)), (np.float32(0.1), np.int32(3)),
                                       (np.float16(0.125), np.uint8(3))])
@pytest.mark.parametrize("dtype", ["quint8", "qint8", "qint32"])
def test_numpy_scalar_qparams_quantize_as_torchs(scale, zp, dtype):
    x = torch.randn(5, 4)
    ref = torch.quantize_per_tensor(x, scale, zp, getattr(torch, dtype))
    qt = Q.quantize_per_tensor(x, scale, zp, dtype)  # was TypeError "scale=np.float32(0.1) must be a float"
    assert torch.equal(qt.int_repr(), ref.int_repr())
    assert qt.q_scale() == pytest.approx(ref.q_scale()) and qt.q_zero_point() == ref.q_zero_point()


@pytest.mark.parametrize("scale, zp, match", [(np.float32(-0.1), 3, "scale=-0.1"), (np.float32(np.nan), 0, "scale=nan"),
                                              (0.1, np.int64(300), "zero_point=300"),
                                              (np.float32(0.1), np.bool_(True), "zero_point=")])
def test_bad_numpy_scalar_qparams_are_refused_naming_them(scale, zp, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Q.quantize_per_tensor(torch.randn(3), scale, zp, Q.quint8)


def _float_zp(dtype=Q.quint8) -> Q.QTensor:  # per_channel_affine_float_qparams, as torch.ao's embeddings
    x = torch.linspace(-1, 1, 30).reshape(3, 10)
    zp = torch.tensor([127.3, -3.6, 260.5]) if dtype == Q.quint8 else torch.tensor([-0.4, 5.5, -130.2])
    return Q.quantize_per_channel(x, torch.tensor([0.01, 0.02, 0.005]), zp, 0, dtype)


@pytest.mark.parametrize("dtype", [Q.quint8, Q.qint8])
def test_relu_and_zero_padding_on_float_zero_points_put_zero_on_its_code(dtype):
    qt = _float_zp(dtype)
    expect = Q.quantize_per_channel(torch.relu(qt.dequantize()), qt.scale, qt.zero_point, 0, dtype)
    r = torch.relu(qt)  # was max(q, z truncated / wrapped to the storage): z = -3.6 gave 5.13 everywhere on quint8
    assert r.qscheme() == Q.per_channel_affine_float_qparams
    assert torch.equal(r.int_repr(), expect.int_repr())
    zero = Q.quantize_per_channel(torch.zeros(3, 1), qt.scale, qt.zero_point, 0, dtype).int_repr()
    p = F.pad(qt, (2, 1))
    assert torch.equal(p.int_repr()[:, 2:-1], qt.int_repr())
    assert torch.equal(p.int_repr()[:, :2], zero.expand(3, 2)) and torch.equal(p.int_repr()[:, -1:], zero)


def test_equal_compares_grid_and_codes_as_torch_does():
    x = torch.tensor([0.2, 0.4, -0.2])
    grids = [(0.1, 0, "qint8"), (0.2, 0, "qint8"), (0.1, 10, "quint8"), (0.1, 0, "qint32")]
    ts = [torch.quantize_per_tensor(x, s, z, getattr(torch, d)) for s, z, d in grids]
    ls = [Q.quantize_per_tensor(x, s, z, d) for s, z, d in grids]
    for i in range(len(grids)):
        for j in range(len(grids)):  # the same values on another grid: False (was True: equal ran on the values)
            assert torch.equal(ls[i], ls[j]) == torch.equal(ts[i], ts[j]) == ls[i].equal(ls[j]) == (i == j)
        assert torch.equal(ls[i], x) is torch.equal(ts[i], x) is False  # a float tensor is never equal
        assert torch.equal(ls[i], Q.quantize_per_tensor(x.clone(), *grids[i]))
    pc = Q.quantize_per_channel(x.reshape(3, 1), torch.tensor([0.1, 0.2, 0.1]), torch.tensor([0, 0, 1]), 0, Q.qint8)
    other = Q.QTensor(pc.int_repr(), torch.tensor([0.1, 0.2, 0.2]), pc.zero_point, Q.qint8, 0)  # same codes
    assert torch.equal(pc, pc.clone()) and not torch.equal(pc, other) and not torch.equal(pc, pc.transpose(0, 1))


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_stack_of_one_grid_stays_quantized_as_torchs(dim):
    x = torch.randn(2, 3)
    t = torch.quantize_per_tensor(x, 0.05, 3, torch.qint8)
    qt = Q.quantize_per_tensor(x, 0.05, 3, Q.qint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was the float fallback, warned
        y = torch.stack([qt, qt[1:].expand(2, 3)], dim)
    ref = torch.stack([t, t[1:].expand(2, 3)], dim)
    assert isinstance(y, Q.QTensor) and torch.equal(y.int_repr(), ref.int_repr()) and y.q_scale() == pytest.approx(0.05)
    with pytest.raises(IndexError):
        torch.stack([qt, qt], 3)


@pytest.mark.parametrize("size, sf", [(None, 2.0), (None, 1.5), ((3, 11), None), ((7, 2), None)])
def test_nearest_exact_interpolation_stays_quantized_with_torchs_codes(size, sf):
    x = torch.randn(2, 3, 5, 6)
    ref = F.interpolate(torch.quantize_per_tensor(x, 0.05, 128, torch.quint8), size, sf, mode="nearest-exact")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was the float fallback, warned
        y = F.interpolate(Q.quantize_per_tensor(x, 0.05, 128, Q.quint8), size, sf, mode="nearest-exact")
    assert isinstance(y, Q.QTensor) and torch.equal(y.int_repr(), ref.int_repr())


def test_the_clip_method_stays_quantized_as_torch_clip():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was the float fallback (torch.clip and .clamp kept the grid), warned
        y = _pt().clip(-0.3, 0.4)
    ref = torch.quantize_per_tensor(torch.linspace(-1, 1, 6), 0.01, 128, torch.quint8).clip(-0.3, 0.4)
    assert isinstance(y, Q.QTensor) and torch.equal(y.int_repr(), ref.int_repr())


@pytest.mark.parametrize("axis", [0, 1, 3])
@pytest.mark.parametrize("op", [
    lambda a: a.narrow(0, 1, 1), lambda a: a.narrow(1, 1, 2), lambda a: torch.narrow(a, -1, -3, 2),
    lambda a: a.select(0, 1), lambda a: a.select(1, -1), lambda a: torch.select(a, 3, 2),
    lambda a: a.view_as(torch.empty(2, 3, 4, 5)), lambda a: a.reshape_as(torch.empty(2, 3, 4, 5)),
    lambda a: a.swapaxes(0, 2), lambda a: a.swapdims(-1, 1), lambda a: a[0, 0].t(), lambda a: a[:, :, 0, 0].t(),
])
def test_per_channel_narrow_select_and_views_keep_the_grid(op, axis):
    x = torch.randn(2, 3, 4, 5)
    n = x.shape[axis]
    qt = Q.quantize_per_channel(x, torch.linspace(0.01, 0.05, n), torch.arange(n) - 1, axis, Q.qint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was a float tensor, silently (no fallback warning either)
        y = op(qt)
    assert isinstance(y, Q.QTensor) and torch.equal(y.dequantize(), op(qt.dequantize()))


def test_per_channel_views_without_an_integer_form_warn_and_bad_ranges_raise_torchs_error():
    qt = Q.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, Q.qint8)
    mixed = torch.tensor([[1, 0, 1], [0, 1, 0]])  # (expand stays integer since session 37: tests/test_qtensor_ops_s37.py)
    _warned_ops.discard("QTensor.gather on a per-channel QTensor (its codes mix channels)")  # (warned once per process)
    with pytest.warns(UserWarning, match="QTensor.gather on a per-channel QTensor"):  # was silent
        assert not isinstance(qt.gather(0, mixed), Q.QTensor)
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        qt.narrow(1, 2, 5)
    with pytest.raises(IndexError):
        qt.select(2, 0)


def test_to_a_quantized_or_integer_dtype_is_torchs_noop_or_a_clear_error():
    qt = _pt()
    same = qt.to(torch.quint8)  # was "empty_strided not supported on quantized tensors" from inside torch
    assert isinstance(same, Q.QTensor) and torch.equal(same.int_repr(), qt.int_repr())
    assert torch.equal(qt.to(torch.quint8, copy=True).int_repr(), qt.int_repr())
    assert qt.to(dtype=torch.quint8, copy=True).int_repr().data_ptr() != qt.int_repr().data_ptr()
    with pytest.raises(TypeError, match=r"dtype=torch.qint8\): a lowbit.quint8 QTensor cannot change"):
        qt.to(torch.qint8)
    for d in (torch.uint8, torch.int8, torch.int64, torch.bool):  # was the values truncated, silently
        with pytest.raises(TypeError, match=rf"dtype={d}\): the values .* int_repr\(\) gives its codes"):
            qt.to("cpu", d)
    assert torch.equal(qt.to(torch.float64), qt.dequantize().double())  # float: the values, as documented
    assert torch.equal(qt.to(torch.empty(0, dtype=torch.half)), qt.dequantize().half())


def test_to_without_a_device_keeps_the_qtensors_device():
    meta = Q.quantize_per_tensor(torch.randn(1, 3, 2, 2), 0.1, 3, Q.qint8).to("meta")  # (stands for CUDA here)
    for moved in (meta.to(memory_format=torch.channels_last), meta.to(non_blocking=True)):  # was: moved to the CPU
        assert moved.device.type == "meta"  # ("Cannot copy out of meta tensor"; a CUDA QTensor went to the CPU)
    assert meta.to(memory_format=torch.channels_last).int_repr().is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("op", [lambda a: F.max_pool2d(a, 2), lambda a: F.max_pool2d(a, 2, 1, 1),
                                lambda a: F.max_pool1d(a[0], 2), lambda a: F.max_pool3d(a[None], (1, 2, 2))])
def test_max_pooling_of_qint32_codes_past_2_24_is_exact(op):
    codes = torch.tensor([[16777217, 16777219, 33554433, 33554435], [1, 2, 3, 4],
                          [2**30 + 1, 2**30 + 3, -(2**31), 6], [7, 8, 2**31 - 1, 2**31 - 2]], dtype=torch.int32)
    codes = codes.reshape(1, 1, 4, 4)
    ref = op(torch._make_per_tensor_quantized_tensor(codes, 1e-6, 0)).int_repr()
    y = op(Q.QTensor(codes, 1e-6, 0, Q.qint32))  # was max over float32 codes: 16777219 -> 16777220, 2**30 + 3 -> 2**30
    assert isinstance(y, Q.QTensor) and torch.equal(y.int_repr(), ref)
    assert torch.equal(y.int_repr(), op(codes.double()).to(torch.int32))
    amp = F.adaptive_max_pool2d(Q.QTensor(codes, 1e-6, 0, Q.qint32), 2)  # (torch has no quantized kernel for it)
    assert torch.equal(amp.int_repr(), F.adaptive_max_pool2d(codes.double(), 2).to(torch.int32))


def test_a_meta_qtensor_still_deep_copies():
    for qt in (_pt(), _pc()):
        meta = qt.to("meta")
        for c in (copy.deepcopy(meta), pickle.loads(pickle.dumps(meta))):
            assert c.device.type == "meta" and c.shape == qt.shape and c.axis == qt.axis
