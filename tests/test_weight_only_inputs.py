"""Weight-only quantization on bad input: a NaN weight or NaN calibration data is a clear error naming the layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.nn.quantized import WeightOnlyLinear
from lowbit.nn.quantized.weight_only import gptq_quantize


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("method", ["rtn", "mse", "gptq"])
def test_a_non_finite_weight_names_the_layer(bad: float, method: str) -> None:
    m = model()
    with torch.no_grad():
        m[2].weight[3, 5] = bad
    calib = [torch.randn(4, 32)] if method == "gptq" else None
    with pytest.raises(ValueError, match=r"layer '2' has 1 NaN/Inf weight values \(of 256\)"):
        Q.quantize_weight_only(m, bits=4, group_size=16, method=method, calib=calib)
    with pytest.raises(ValueError, match="from_float: the weight holds 1 NaN/Inf values"):
        WeightOnlyLinear.from_float(m[2], 4, 16, method="rtn")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gptq_with_non_finite_calibration_is_a_clear_error(bad: float) -> None:
    calib = [torch.randn(4, 32), torch.randn(4, 32)]
    calib[1][2, 7] = bad
    with pytest.raises(ValueError, match=r"calibration inputs reaching layer '0' hold NaN/Inf .*finite calibration"):
        Q.quantize_weight_only(model(), bits=4, group_size=16, method="gptq", calib=calib)
    w, x = torch.randn(8, 32), torch.randn(16, 32)
    h = x.T @ x
    h[0, 0] = bad
    with pytest.raises(ValueError, match="gptq_quantize: the hessian XᵀX holds NaN/Inf"):
        gptq_quantize(w, h, 16, Q.qint4, True)
    w[1, 1] = bad
    with pytest.raises(ValueError, match="gptq_quantize: the weight holds 1 NaN/Inf values"):
        gptq_quantize(w, x.T @ x, 16, Q.qint4, True)


def test_finite_inputs_still_quantize() -> None:
    out = Q.quantize_weight_only(model(), bits=4, group_size=16, method="gptq", calib=[torch.randn(8, 32)])
    assert isinstance(out[0], WeightOnlyLinear) and bool(torch.isfinite(out(torch.randn(2, 32))).all())
