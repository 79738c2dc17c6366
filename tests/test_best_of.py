"""best_of_ranges: per-layer range methods chosen on the layer's output error, eager and graph mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.debug


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    g = torch.Generator().manual_seed(1)
    lap = lambda n: torch.randn(n, 16, generator=g).sign() * torch.rand(n, 16, generator=g).log().neg()  # noqa: E731
    return model, [lap(128) for _ in range(4)], lap(256)


def _quantized(model, mapping, calib, mode):
    if mode == "fx":
        prepared = Q.prepare_fx(model, mapping, example_inputs=(calib[0],))
    else:
        prepared = Q.prepare(model, mapping)
    for b in calib:
        prepared(b)
    q = Q.convert_fx(prepared) if mode == "fx" else Q.convert(prepared)
    return lambda x: (lambda y: y.dequantize() if isinstance(y, Q.QTensor) else y)(q(x))


@pytest.mark.parametrize("mode", ["eager", "fx"])
def test_choices_minimise_the_output_error_and_do_not_lose_to_the_default(mode):
    model, calib, x = _model_and_data()
    mapping, choices = Q.best_of_ranges(model, calib, progress=False)
    assert [c.name for c in choices] == ["0", "2", "4"]
    for c in choices:
        assert c.weight_errors[c.weight] == min(c.weight_errors.values())
        assert c.activation_errors[c.activation] == min(c.activation_errors.values())
        assert set(c.activation_errors) == {"histogram", "minmax", "percentile", "entropy", "mse"}
    ref = model(x)
    best = lowbit.debug.sqnr(ref, _quantized(model, mapping, calib, mode)(x))
    default = lowbit.debug.sqnr(ref, _quantized(model, Q.get_default_qconfig(), calib, mode)(x))
    minmax = lowbit.debug.sqnr(ref, _quantized(model, Q.get_minmax_qconfig(), calib, mode)(x))
    assert best > 30 and best >= default - 0.5 and best >= minmax - 0.5, (best, default, minmax)


def test_fused_markers_and_bad_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    fused = Q.fuse_modules(model, [["0", "1", "2"]])
    x = torch.randn(8, 3, 8, 8)
    mapping, choices = Q.best_of_ranges(fused, x, weights=["minmax"], activations=["minmax", "mse"], progress=False)
    assert [c.name for c in choices] == ["0", "4"] and all(c.weight == "minmax" for c in choices)
    with pytest.raises(ValueError, match="activations=\\['kl'\\]"):
        Q.best_of_ranges(model, x, activations=["kl"])
    with pytest.raises(ValueError, match="max_rows=0"):
        Q.best_of_ranges(model, x, max_rows=0)
    with pytest.raises(ValueError, match="no Linear/Conv layer"):
        Q.best_of_ranges(nn.Sequential(nn.ReLU()), x)
