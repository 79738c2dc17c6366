"""Hostile grids and observer states found by session 23's probes (each was silent garbage or a crash inside torch):
qint32 codes past float32's reach, an ``eps`` or a stored scale that float32 rounds to 0 or inf, float-qparams ranges
too wide for a float32 scale, histogram observers over a range past float32's max, the functional fused observer
writing its buffers before failing, per-tensor observers loading per-channel ranges, and QTensor / QDtype arguments
off their grid."""

from __future__ import annotations

import pytest
import torch

import lowbit as Q

t = torch.tensor


@pytest.mark.parametrize("per_channel", [False, True])
def test_qint32_codes_saturate_at_the_grid_not_wrap(per_channel):
    x = t([1e10, 3e9, 2147483647.0, -1e10, 5.0, -5.0])
    q = (Q.quantize(x.reshape(1, -1), t([1.0]), t([0]), Q.qint32, 0).reshape(-1) if per_channel
         else Q.quantize(x, 1.0, 0, Q.qint32))
    assert q.dtype == torch.int32
    assert q.tolist() == [2**31 - 1, 2**31 - 1, 2**31 - 1, -(2**31), 5, -5]  # was -2**31 for every large positive
    assert Q.quantize(t([5e9]), 1.0, 0, Q.qint32.with_range(0, 2**31 - 1)).tolist() == [2**31 - 1]


@pytest.mark.parametrize("eps", [1e-50, float("inf"), 0.0, -1e-8, True])
def test_eps_must_be_positive_and_finite_in_float32(eps):
    with pytest.raises(ValueError, match=rf"eps={eps!r} must be a positive float"):
        Q.calculate_qparams(0.0, 0.0, eps=eps)
    with pytest.raises(ValueError, match=rf"MinMaxObserver: eps={eps!r}"):
        Q.MinMaxObserver(eps=eps)


@pytest.mark.parametrize("scale", [1e-50, 1e39])
def test_stored_scales_that_float32_rounds_to_0_or_inf_are_refused(scale):
    with pytest.raises(ValueError, match="FixedQParamsObserver: scale="):
        Q.FixedQParamsObserver(scale=scale, zero_point=0)
    with pytest.raises(ValueError, match="QTensor: scale="):
        Q.QTensor(t([5], dtype=torch.int8), scale, 0, Q.qint8)
    with pytest.raises(ValueError, match="LearnableFakeQuantize: scale="):
        Q.LearnableFakeQuantize(scale=scale)


def test_float_qparams_range_too_wide_for_float32_is_an_error_like_the_other_schemes():
    with pytest.raises(ValueError, match="too wide for a float32 scale"):
        Q.calculate_qparams(t([-3e38]), t([3e38]), Q.per_channel_affine_float_qparams, Q.quint8)
    s, z = Q.calculate_qparams(t([-3.0]), t([1.0]), Q.per_channel_affine_float_qparams, Q.quint8)
    assert torch.isfinite(s).all() and s.item() == pytest.approx(4 / 255)


@pytest.mark.parametrize("cls", [Q.PercentileObserver, Q.EntropyObserver, Q.MSEObserver, Q.HistogramObserver])
def test_histogram_observers_take_a_range_past_float32_max(cls):
    obs = cls()
    obs(t([2e38, -1.5e38, 0.0, 1.0]))  # max - min overflows float32 (was an index of -2**63 inside torch)
    s, z = obs.calculate_qparams()
    assert torch.isfinite(s).all() and s.item() > 0 and 0 <= z.item() <= 255


@pytest.mark.parametrize(("args", "match"), [
    ((float("nan"), 0, 255), "averaging_const=nan"), ((5.0, 0, 255), "averaging_const=5.0"),
    ((0.0, 0, 255), "averaging_const=0.0"), (("a", 0, 255), "averaging_const='a'"),
    ((0.01, 255, 0), "quant_min=255 must be < quant_max=0"), ((0.01, 0.5, 255), "quant_min=0.5 must be an int"),
])
def test_functional_fused_observer_checks_everything_before_writing_its_buffers(args, match):
    lo, hi, s, z, on = t(-1.0), t(1.0), t([1.0]), t([0]), t([1])
    with pytest.raises((ValueError, TypeError), match=match):
        Q.fused_moving_avg_obs_fake_quant(t([-1.0, 3.0]), on, on, lo, hi, s, z, *args, 0)
    assert (lo.item(), hi.item(), s.item(), z.item()) == (-1.0, 1.0, 1.0, 0)  # untouched (NaN stuck there before)


def test_functional_fused_observer_names_a_buffer_of_the_wrong_size():
    lo, hi, on = t(-1.0), t(1.0), t([1])
    with pytest.raises(ValueError, match=r"scale must be a tensor of 1 value\(s\) \(per tensor\), got shape \(3,\)"):
        Q.fused_moving_avg_obs_fake_quant(t([-1.0, 3.0]), on, on, lo, hi, torch.ones(3), t([0]), 0.01, 0, 255, 0)
    n = 3  # per row: one value per slice
    lo, hi = torch.full((n,), float("inf")), torch.full((n,), float("-inf"))
    y = Q.fused_moving_avg_obs_fake_quant(torch.randn(n, 4), on, on, lo, hi, torch.ones(n), torch.zeros(n, dtype=torch.long),
                                          0.01, 0, 255, 0, True)
    assert y.shape == (n, 4) and torch.isfinite(lo).all()


@pytest.mark.parametrize(("state", "match"), [
    ({"min_val": t([-1.0, -2.0, -3.0]), "max_val": t([1.0, 2.0, 3.0])}, "a per-tensor observer keeps one range"),
    ({"min_val": t(-1.0), "max_val": t([1.0, 2.0])}, r"min_val shape \(\) != max_val shape \(2,\)"),
])
def test_an_observer_state_of_the_wrong_shape_is_refused_naming_the_key(state, match):
    obs = Q.MinMaxObserver()
    with pytest.raises(RuntimeError, match=match):
        obs.load_state_dict(state)
    ok = Q.MinMaxObserver()
    ok.load_state_dict({"min_val": t(-1.0), "max_val": t(1.0)})
    assert ok.calculate_qparams()[0].shape == ()


@pytest.mark.parametrize(("make", "exc", "match"), [
    (lambda: Q.QTensor(t([5], dtype=torch.int8), 0.1, 1000, Q.qint8), ValueError, "zero_point=1000 is outside"),
    (lambda: Q.QTensor(t([300], dtype=torch.int32), 0.1, 0, Q.qint8), ValueError, "holds codes outside"),
    (lambda: Q.QTensor(t([5], dtype=torch.int8), True, 0, Q.qint8), TypeError, "not bools"),
    (lambda: Q.QTensor([1, 2], 0.1, 0, Q.qint8), TypeError, "got list"),
    (lambda: Q.QTensor(t([True]), 0.1, 0, Q.qint8), TypeError, "got dtype torch.bool"),
    (lambda: Q.QDtype("q16", 16, True, -32768, 32767, torch.int8), ValueError, "does not fit its storage"),
    (lambda: Q.QDtype("qint8", 8, True, -127.5, 127, torch.int8), TypeError, "quant_min=-127.5 must be an int"),
    (lambda: Q.qint8.with_range("a", 3), TypeError, "quant_min='a' must be an int"),
    (lambda: Q.qint8.with_range(-127.9, 127.9), TypeError, "quant_min=-127.9 must be an int"),
])
def test_qtensor_and_qdtype_arguments_off_their_grid_are_refused(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_codes_in_a_wider_integer_dtype_on_the_grid_still_make_a_qtensor():
    q = Q.QTensor(t([100, -128], dtype=torch.int32), 0.1, 0, Q.qint8)
    assert q.dequantize().tolist() == pytest.approx([10.0, -12.8])
    assert Q.qint8.with_range(-127.0, 127) == Q.qint8.with_range(-127, 127)
