"""Hostile but valid-looking inputs at the numerics / observer / fake-quant / qtensor entry points.

Each case ends in a clear error naming the value (``ValueError``/``TypeError``/``RuntimeError``) or in a
documented safe result — never a NaN scale, an out-of-grid code or a crash deep inside torch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as Q

BAD_SCALES = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-46, 1e39]  # the last two: 0 / inf in float32
X = torch.tensor([-1.0, 0.0, 0.26, 3.0])
F32_MAX = torch.finfo(torch.float32).max


# ---- qparams: ranges at the ends of float32 ----
@pytest.mark.parametrize("qscheme", [Q.per_tensor_affine, Q.per_tensor_symmetric])
@pytest.mark.parametrize("qdtype", [Q.quint8, Q.qint8, Q.quint4])
def test_range_up_to_float32_max_gives_a_finite_scale_and_round_trips(qscheme, qdtype):
    big = torch.finfo(torch.float32).max
    scale, zp = Q.calculate_qparams(-big, big, qscheme, qdtype)
    assert torch.isfinite(scale) and scale > 0 and qdtype.quant_min <= int(zp) <= qdtype.quant_max
    x = torch.tensor([-big, -1e38, 0.0, 1e38, big])
    y = Q.fake_quantize(x, scale, zp, qdtype.quant_min, qdtype.quant_max)
    assert torch.isfinite(y).all() and float((y - x).abs().max()) <= 1.01 * float(scale)  # within a step (clipped ends)


def test_a_two_level_grid_over_the_whole_float32_range_stays_finite():
    scale, zp = Q.calculate_qparams(-3.4e38, 3.4e38, Q.per_tensor_affine, Q.quint8.with_range(0, 1))
    assert torch.isfinite(scale) and torch.isfinite(Q.dequantize(torch.tensor([0, 1], dtype=torch.uint8), scale, zp)).all()


@settings(max_examples=40, deadline=None)
@given(st.floats(-F32_MAX, 0.0, width=32), st.floats(0.0, F32_MAX, width=32))
def test_calculate_qparams_never_returns_inf_or_nan(lo, hi):
    for qscheme in (Q.per_tensor_affine, Q.per_tensor_symmetric):
        scale, zp = Q.calculate_qparams(lo, hi, qscheme, Q.quint8)
        assert torch.isfinite(scale) and scale > 0 and 0 <= int(zp) <= 255
        ends = Q.dequantize(torch.tensor([0, 255], dtype=torch.uint8), scale, zp)
        assert torch.isfinite(ends).all()


# ---- tensor qparams are checked exactly as Python numbers ----
@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_bad_scales_are_rejected_by_every_entry_point(bad, as_tensor):
    s = torch.tensor(bad) if as_tensor else bad
    codes = torch.zeros(4, dtype=torch.int8)
    calls = {
        "quantize": lambda: Q.quantize(X, s, 0, Q.qint8),
        "fake_quantize": lambda: Q.fake_quantize(X, s, 0, -128, 127),
        "dequantize": lambda: Q.dequantize(codes, s, 0),
        "quantize_per_tensor": lambda: Q.quantize_per_tensor(X, s, 0, Q.qint8),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name}: scale"):
            call()


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_one_bad_per_channel_scale_is_rejected(bad):
    x, scales, zps = torch.ones(2, 3), torch.tensor([0.1, bad]), torch.zeros(2, dtype=torch.long)
    for call in (lambda: Q.quantize(x, scales, zps, Q.qint8, 0), lambda: Q.fake_quantize(x, scales, zps, -128, 127, 0),
                 lambda: Q.dequantize(torch.zeros(2, 3, dtype=torch.int8), scales, zps, 0),
                 lambda: Q.quantize_per_channel(x, scales, zps, 0, Q.qint8)):
        with pytest.raises(ValueError, match="scale"):
            call()


@pytest.mark.parametrize("zp", [3.7, 300, -1, float("nan")])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_off_grid_or_fractional_zero_points_are_rejected(zp, as_tensor):
    z = torch.tensor(zp) if as_tensor else zp
    for call in (lambda: Q.quantize(X, 0.1, z, Q.quint8), lambda: Q.fake_quantize(X, 0.1, z, 0, 255),
                 lambda: Q.quantize_per_tensor(X, 0.1, z, Q.quint8)):
        with pytest.raises(ValueError, match="zero_point"):
            call()


def test_fractional_zero_point_never_truncated_silently():
    # main accepted 3.7: the codes used 3.7, the QTensor kept 3, and dequantize() was off by 0.07
    with pytest.raises(ValueError, match="zero_point=3.7"):
        Q.quantize_per_tensor(torch.tensor([1.0]), 0.1, 3.7, Q.quint8)
    with pytest.raises(ValueError, match="zero_point"):
        Q.QTensor(torch.zeros(2, dtype=torch.uint8), 0.1, 3.7, Q.quint8)
    with pytest.raises(ValueError, match="zero_point"):
        Q.QTensor(torch.zeros(2, dtype=torch.uint8), 0.1, torch.tensor(3.7), Q.quint8)
    # an integral float zero point is fine, and codes and QTensor agree
    qt = Q.quantize_per_tensor(torch.tensor([1.0]), 0.1, 3.0, Q.quint8)
    assert qt.q_zero_point() == 3 and torch.allclose(qt.dequantize(), torch.tensor([1.0]))


def test_non_tensor_and_wrong_dtype_inputs_are_type_errors():
    with pytest.raises(TypeError, match="floating-point"):
        Q.quantize(torch.ones(2, dtype=torch.int32), 0.1, 0, Q.qint8)
    with pytest.raises(TypeError, match="floating-point"):
        Q.fake_quantize([1.0, 2.0], 0.1, 0, 0, 255)
    with pytest.raises(TypeError, match="scale"):
        Q.quantize(X, "0.1", 0, Q.qint8)
    with pytest.raises(TypeError, match="scale"):
        Q.quantize(X, torch.tensor(True), 0, Q.qint8)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(BAD_SCALES), st.integers(0, 7), st.booleans())
def test_property_a_bad_channel_anywhere_is_caught(bad, where, fake):
    scales = torch.full((8,), 0.1, dtype=torch.float64)  # holds 1e39 / 1e-46: inf / 0 only in float32
    scales[where] = bad
    x, zps = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ValueError, match="scale"):
        (Q.fake_quantize(x, scales, zps, -128, 127, 0) if fake else Q.quantize(x, scales, zps, Q.qint8, 0))


# ---- HistogramObserver: denormal / huge / lattice data ----
@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("data", [[0.0, 1e-40], [0.0, 1e-45], [1e-40, 2e-40, 3e-40], [-3e38, 3e38],
                                  [-3.4e38, 0.0, 1.0, 3.4e38], [5.0] * 4])
def test_histogram_observer_handles_denormal_and_huge_ranges(data, sync_free):
    obs = Q.HistogramObserver()
    obs.sync_free = sync_free
    obs(torch.tensor(data))
    assert float(obs.histogram.sum()) == len(data)
    scale, zp = obs.calculate_qparams()
    assert torch.isfinite(scale) and scale > 0 and 0 <= int(zp) <= 255


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 64), st.sampled_from([0.1, 0.25, 1 / 3, 0.7, 1.0, 2.0]), st.integers(-50, 0),
       st.integers(1, 50), st.integers(0, 2**31), st.booleans())
def test_histogram_binning_equals_histc_on_lattice_data(bins, step, k_lo, k_span, seed, sync_free):
    """Values on interior bin edges go where torch.histc puts them (main put them one bin lower)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(k_lo, k_lo + k_span + 1, (200,), generator=g)
    x = torch.cat([torch.tensor([k_lo, k_lo + k_span]), k]).float() * step
    obs = Q.HistogramObserver(bins=bins)
    obs.sync_free = sync_free
    obs(x)
    assert torch.equal(obs.histogram, torch.histc(x, bins, float(x.min()), float(x.max())))


def test_histogram_issue_example():
    obs = Q.HistogramObserver(bins=3)
    obs(torch.tensor([2.0, 3.0, 4.0, 5.0]))
    assert obs.histogram.tolist() == [1.0, 1.0, 2.0]


def test_default_qconfig_calibration_on_a_denormal_batch():
    from torch import nn
    model = nn.Sequential(Q.QuantStub(), nn.Linear(2, 2), Q.DeQuantStub())
    prepared = Q.prepare(model)  # the default recipe: HistogramObserver activations
    prepared(torch.tensor([[0.0, 1e-40]]))
    Q.convert(prepared)(torch.randn(3, 2))


# ---- QTensor: every torch.Tensor method / attribute ----
def _qt(per_channel: bool = False) -> Q.QTensor:
    x = torch.tensor([[0.5, -1.0, 0.25], [2.0, 4.0, -0.75]])
    if per_channel:
        return Q.quantize_per_channel(x, torch.tensor([0.01, 0.05]), torch.tensor([0, 0]), 0, Q.qint8)
    return Q.quantize_per_tensor(x, 0.05, 0, Q.qint8)


@pytest.mark.parametrize("per_channel", [False, True])
def test_every_public_tensor_attribute_exists_on_a_qtensor(per_channel):
    qt, ref = _qt(per_channel), _qt(per_channel).dequantize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in (n for n in dir(torch.Tensor) if not n.startswith("_")):
            try:
                getattr(qt, name)
            except AttributeError as err:
                raise AssertionError(f"QTensor.{name}: {err}") from err
            except Exception as err:  # only where the float tensor fails the same way (e.g. .imag of real)
                with pytest.raises(type(err)):
                    getattr(ref, name)


NO_ARG_METHODS = ["sum", "argmax", "argmin", "abs", "exp", "float", "double", "clone", "numpy", "tolist",
                  "max", "min", "std", "norm", "sigmoid", "tanh", "softmax", "cumsum", "sort", "isnan", "nonzero",
                  "t", "flip", "contiguous", "detach", "cpu", "half"]
ARGS = {"softmax": (-1,), "cumsum": (0,), "flip": (0,)}


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("name", NO_ARG_METHODS)
def test_methods_equal_the_float_tensor_on_dequantized_values(name, per_channel):
    qt = _qt(per_channel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = getattr(qt, name)(*ARGS.get(name, ()))
    want = getattr(qt.dequantize(), name)(*ARGS.get(name, ()))
    got = got.dequantize() if isinstance(got, Q.QTensor) else got
    if isinstance(got, tuple):  # (sort / max ...: values on the grid since session 37, with the float op's indices)
        got = type(got)([g.dequantize() if isinstance(g, Q.QTensor) else g for g in got])
    if isinstance(want, torch.Tensor):
        assert torch.equal(torch.as_tensor(got), want)
    else:
        assert str(got) == str(want)


def test_attributes_and_operators():
    qt, ref = _qt(), _qt().dequantize()
    assert (qt.ndim, qt.is_nested, qt.requires_grad, qt.grad, qt.is_leaf) == (2, False, False, None, True)
    assert torch.equal(qt.T.int_repr(), qt.int_repr().T) and isinstance(qt.T, Q.QTensor)
    assert torch.equal(qt.mT.dequantize(), ref.mT) and qt.data is qt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(qt.masked_fill(ref < 0, 0.0).dequantize(), ref.masked_fill(ref < 0, 0.0))  # (codes: s37)
        assert torch.equal(qt < 0, ref < 0) and torch.equal(abs(qt), ref.abs()) and torch.equal(qt ** 2, ref ** 2)
        assert torch.equal(2.0 / qt, 2.0 / ref) and float(qt[0, 0]) == float(ref[0, 0])
        assert all(isinstance(r, Q.QTensor) for r in qt) and [r.tolist() for r in qt] == ref.tolist()
    assert torch.equal(qt.float(), ref) and qt.numpy().tolist() == ref.tolist()
    assert {qt: 1}[qt] == 1  # hashable by identity, as torch.Tensor


def test_fallback_warns_once_naming_the_op():
    with pytest.warns(UserWarning, match="QTensor.cumprod"):
        _qt().cumprod(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _qt().cumprod(0)  # once
        _qt().float()  # an explicit conversion never warns


@pytest.mark.parametrize("call", [lambda qt: qt.add_(1), lambda qt: qt.masked_fill_(qt.float() > 0, 0.0),
                                  lambda qt: qt.zero_(), lambda qt: qt.__setitem__(0, 1.0),
                                  lambda qt: qt.requires_grad_()])
def test_in_place_ops_are_refused_not_lost(call):
    qt = _qt()
    before = qt.int_repr().clone()
    with pytest.raises(TypeError, match="in-place"):
        call(qt)
    assert torch.equal(qt.int_repr(), before)


def test_copies_stay_qtensors():
    import copy
    qt = _qt(per_channel=True)
    for c in (copy.copy(qt), copy.deepcopy(qt), qt.clone()):
        assert isinstance(c, Q.QTensor) and torch.equal(c.int_repr(), qt.int_repr()) and c.axis == 0


def test_multihead_attention_after_a_quantized_layer():
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(Q.QuantStub(), nn.Linear(8, 8))
    model.qconfig = Q.get_minmax_qconfig()
    prepared = Q.prepare(model)
    prepared(torch.randn(4, 5, 8))
    y = Q.convert(prepared)(torch.randn(4, 5, 8))
    assert isinstance(y, Q.QTensor)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = mha(y, y, y)
    d = y.dequantize()  # one tensor, as the fallback dequantizes one QTensor once: torch's packed self-attention path
    ref, _ = mha(d, d, d)
    assert torch.equal(out, ref)


# ---- every observer / fake-quant entry point against hostile data ----
OBSERVERS = {
    "MinMaxObserver": lambda: Q.MinMaxObserver(),
    "MovingAverageMinMaxObserver": lambda: Q.MovingAverageMinMaxObserver(),
    "PerChannelMinMaxObserver": lambda: Q.PerChannelMinMaxObserver(ch_axis=0),
    "MovingAveragePerChannelMinMaxObserver": lambda: Q.MovingAveragePerChannelMinMaxObserver(ch_axis=0),
    "HistogramObserver": lambda: Q.HistogramObserver(bins=64),
    "FakeQuantize": lambda: Q.FakeQuantize(),
    "FakeQuantize(per channel)": lambda: Q.FakeQuantize(observer=Q.PerChannelMinMaxObserver, ch_axis=0),
    "LearnableFakeQuantize": lambda: Q.LearnableFakeQuantize(),
    "FusedMovingAvgObsFakeQuantize": lambda: Q.FusedMovingAvgObsFakeQuantize(),
    "FusedMovingAvgObsFakeQuantize(per channel)": lambda: Q.FusedMovingAvgObsFakeQuantize(
        observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0),
}
DATA = {
    "nan": torch.full((2, 3), float("nan")), "inf": torch.tensor([[float("inf"), 1.0, 2.0], [0.0, 1.0, 2.0]]),
    "-inf": torch.full((2, 3), -float("inf")), "denormal": torch.full((2, 3), 1e-42),
    "huge": torch.tensor([[-3.4e38, 3.4e38, 0.0], [1.0, 2.0, 3.0]]), "empty": torch.zeros(0, 3),
    "constant": torch.full((2, 3), 5.0), "int": torch.ones(2, 3, dtype=torch.int32),
    "half": torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.0, 1.0]]).half(), "list": [1.0, 2.0],
}


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("name", list(OBSERVERS))
def test_observers_and_fake_quants_on_hostile_data(name, data):
    """A clear error naming the class (or 'floating-point'/'observed'), or finite positive qparams and a
    fake-quantized output that is finite wherever the input is."""
    mod, x = OBSERVERS[name](), DATA[data]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            y = mod(x)
            scale, zp = mod.calculate_qparams()
        except (TypeError, ValueError, RuntimeError) as err:
            assert type(mod).__name__ in str(err) or "floating-point" in str(err) or "Observer" in str(err), err
            return
    assert torch.isfinite(scale).all() and (scale > 0).all() and torch.isfinite(zp.float()).all()
    if isinstance(y, torch.Tensor) and y.shape == x.shape and x.numel():
        assert torch.isfinite(y[torch.isfinite(x)]).all()


# ---- wrong shapes / axes / dtypes at the qtensor and functional entry points ----
@pytest.mark.parametrize("call", [
    lambda: Q.quantize(torch.ones(2, 3), torch.ones(3), torch.zeros(3, dtype=torch.long), Q.qint8, 0),  # C mismatch
    lambda: Q.quantize(torch.ones(2, 3), torch.ones(2), torch.zeros(2, dtype=torch.long), Q.qint8, 2),  # axis
    lambda: Q.fake_quantize(torch.ones(2, 3), torch.ones(2), torch.zeros(2), -128, 127, -3),
    lambda: Q.quantize(torch.ones(2, 3), torch.ones(2), 0, Q.qint8),  # per-tensor with (C,) scales
    lambda: Q.quantize_per_channel(torch.ones(2, 3), torch.ones(2), torch.zeros(2, dtype=torch.long), 5, Q.qint8),
    lambda: Q.QTensor(torch.zeros(2, 3, dtype=torch.int8), torch.ones(3), torch.zeros(3, dtype=torch.long), Q.qint8, 0),
    lambda: Q.QTensor(torch.zeros(2, 3), 0.1, 0, Q.qint8),  # float codes
    lambda: Q.QTensor(torch.zeros(2, dtype=torch.int8), float("nan"), 0, Q.qint8),
    lambda: Q.fake_quantize(torch.ones(2), 0.1, 0, 5, 5),  # empty grid
    lambda: Q.quantize(torch.ones(2), 0.1, 0, "int7"),
])
def test_wrong_shapes_axes_and_dtypes_are_clear_errors(call):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert any(w in str(info.value) for w in ("shape", "ch_axis", "axis", "dtype", "scale", "quant_min", "qdtype"))
