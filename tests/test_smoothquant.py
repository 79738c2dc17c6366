"""SmoothQuant: function preserved, outliers migrated, folds only where nothing else reads the producer,
int8 kernels kept in eager and graph mode, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.debug
import lowbit.nn.quantized as nnq
from lowbit.algorithms.smoothquant import SmoothedLinear, smooth_quant_scales


class PreNorm(nn.Module):
    """Pre-norm block: the LayerNorm output feeds two Linears only (foldable), a GELU feeds the third."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(16, 32)
        self.act, self.down = nn.GELU(), nn.Linear(32, 16)

    def forward(self, x):
        h = self.norm(x)
        return self.down(self.act(self.a(h) * self.b(h)))


class PostNorm(nn.Module):
    """Post-norm (BERT): the LayerNorm output is also the residual, so 1/s must not go into it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        return h + self.fc(h)


def _outlier_model(cls):
    torch.manual_seed(0)
    model = cls().eval()
    with torch.no_grad():
        model.norm.weight[5] = 25.0  # an outlier channel, as BERT's
    return model


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.85, 1.0])
def test_function_is_preserved_and_folds_are_chosen_right(alpha):
    model = _outlier_model(PreNorm)
    x = torch.randn(4, 10, 16)
    smoothed, report = Q.smooth_quant(model, [x, x * 2], alpha=alpha)
    torch.testing.assert_close(smoothed(x), model(x), rtol=1e-4, atol=1e-4)
    where = {r.name: r.folded_into for r in report.layers}
    assert where == {"a": "norm", "b": "norm", "down": "down.scale"}
    assert isinstance(smoothed.down, SmoothedLinear) and isinstance(model.down, nn.Linear)  # model untouched
    if alpha > 0:
        assert report.layers[0].act_absmax_after < report.layers[0].act_absmax_before / 2
    assert "3 Linear smoothed" in str(report)


def test_post_norm_residual_gets_an_explicit_scale():
    model = _outlier_model(PostNorm)
    x = torch.randn(8, 16)
    smoothed, report = Q.smooth_quant(model, x)
    torch.testing.assert_close(smoothed(x), model(x), rtol=1e-4, atol=1e-4)
    assert [r.folded_into for r in report.layers] == ["fc.scale"]


def test_scales_formula():
    act = torch.tensor([16.0, 1.0, 0.0])
    w = torch.tensor([[1.0, 4.0, 1.0], [0.5, 1.0, 0.0]])
    s = smooth_quant_scales(act, [w], 0.5)
    torch.testing.assert_close(s, torch.tensor([4.0, 0.5, 1.0]))  # sqrt(16/1), sqrt(1/4); no activation: 1


@pytest.mark.parametrize("mode", ["eager", "fx"])
def test_int8_kernels_kept_and_error_drops(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64)).eval()
    with torch.no_grad():
        model[0].weight[5] = 25.0
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 12, 64, generator=g) for _ in range(4)]
    x = torch.randn(8, 12, 64, generator=g)

    def quantize(m):
        if mode == "fx":
            prepared = Q.prepare_fx(m, Q.get_default_qconfig(), example_inputs=(calib[0],))
        else:
            prepared = Q.prepare(m, Q.get_default_qconfig())
        for b in calib:
            prepared(b)
        return Q.convert_fx(prepared) if mode == "fx" else Q.convert(prepared)

    def out(m):
        y = m(x)
        return y.dequantize() if isinstance(y, Q.QTensor) else y

    smoothed_float, report = Q.smooth_quant(model, calib, alpha=0.5)
    assert [r.folded_into for r in report.layers] == ["0"]
    plain, smoothed = quantize(model), quantize(smoothed_float)
    assert sum(isinstance(m, nnq.Linear) for m in smoothed.modules()) == 1
    ref = model(x)
    assert lowbit.debug.sqnr(ref, out(smoothed)) > lowbit.debug.sqnr(ref, out(plain)) + 5  # measured 27.3 -> 36.2 dB


def test_bad_input():
    model = _outlier_model(PreNorm)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="alpha=1.5"):
        Q.smooth_quant(model, x, alpha=1.5)
    with pytest.raises(ValueError, match="'norm', which is not an nn.Linear"):
        Q.smooth_quant(model, x, layers=["norm"])
    with pytest.raises(ValueError, match="inputs is empty"):
        Q.smooth_quant(model, [])
    with pytest.raises(TypeError, match="must be an nn.Module"):
        Q.smooth_quant("model", x)
    # NaN / Inf in calibration data do not poison the scales
    dirty = torch.cat([x, torch.full((1, 16), float("nan")), torch.full((1, 16), float("inf"))])
    smoothed, report = Q.smooth_quant(model, [x, dirty])
    assert all(r.max_scale < float("inf") for r in report.layers)
    torch.testing.assert_close(smoothed(x), model(x), rtol=1e-4, atol=1e-4)
