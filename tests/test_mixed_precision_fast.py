"""``auto_mixed_precision(..., search="fast")``: one calibration, layers swapped back to float in the converted model.

Checked against ``search="exact"`` (a new prepare/calibrate/convert per candidate): same layers kept float and
the same metric where the swap is exact (a layer with its own input Quantize, a one-layer graph of an
untraceable parent); ``finalize`` runs on every converted model; evaluations are counted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.debug import auto_mixed_precision


@pytest.fixture(autouse=True)
def _seed():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


def _outlier_case():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(128, 8)
    x[0, 0] = 200.0  # one outlier input: layer 0's input grid suffers
    with torch.no_grad():
        ref = model(x)
    calls = []

    def score(m: nn.Module) -> float:
        calls.append(1)
        with torch.no_grad():
            return -float(((m(x) - ref) ** 2).mean())
    return model, x, score, calls


def test_fast_search_agrees_with_exact_search():
    model, x, score, calls = _outlier_case()
    with kernels.use_backend("reference"):
        _, exact = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=1, mode="fx",
                                        progress=False)
        calls.clear()
        mapping, fast = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=1, mode="fx",
                                             progress=False, search="fast")
    assert fast.float_layers == exact.float_layers == ["0"]
    assert fast.final_metric == pytest.approx(exact.final_metric, rel=1e-6)
    assert fast.all_quantized_metric == pytest.approx(exact.all_quantized_metric, rel=1e-6)
    assert len(calls) == 1 + 1 + 3 + 1  # float, all int8, one per layer, one greedy step
    assert [r.name for r in fast.rows][0] == "0" and "only this layer float" in str(fast)
    # the returned mapping rebuilt from scratch gives the metric the search reported
    p = Q.prepare_fx(model, mapping, example_inputs=(x,))
    p(x)
    with kernels.use_backend("reference"):
        assert -score(Q.convert_fx(p)) == pytest.approx(-fast.final_metric, rel=1e-5)


class _Untraceable(nn.Module):
    """torch.fx cannot trace the data-dependent branch: each Linear becomes a one-layer graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if float(h.sum()) > -1e9:
            h = torch.tanh(self.b(h))
        return self.c(h)


def test_one_layer_graphs_are_swapped_whole_and_finalize_runs_on_each_model():
    model = _Untraceable().eval()
    x = torch.randn(64, 8)
    with torch.no_grad():
        model.b.weight[:, 0] *= 40.0  # a wide weight range: b costs most
        ref = model(x)
    seen = []

    def finalize(q: nn.Module) -> None:
        seen.append(Q.fuse_dequantize(q))

    def score(m: nn.Module) -> float:
        with torch.no_grad():
            return -float(((m(x) - ref) ** 2).mean())

    kw = dict(max_float_layers=1, mode="fx", progress=False, finalize=finalize)
    with pytest.warns(UserWarning, match="cannot be traced"):
        assert "<root>" in Q.prepare_fx(model, None, example_inputs=(x,)).lowbit_report.untraceable
    with kernels.use_backend("reference"):
        _, exact = auto_mixed_precision(model, Q.get_default_qconfig(), x, score, **kw)
    n_exact = len(seen)
    with kernels.use_backend("reference"):
        _, fast = auto_mixed_precision(model, Q.get_default_qconfig(), x, score, search="fast", **kw)
    assert len(seen) - n_exact == 1 and n_exact >= 2  # fast: one converted model
    assert fast.float_layers == exact.float_layers
    assert fast.final_metric == pytest.approx(exact.final_metric, rel=1e-5)
    assert sorted(r.name for r in fast.rows) == ["a", "b", "c"]


def test_bad_search_arguments():
    model, x, score, _ = _outlier_case()
    with pytest.raises(ValueError, match="search='quick'"):
        auto_mixed_precision(model, None, x, score, max_float_layers=1, search="quick")
    with pytest.raises(TypeError, match="finalize"):
        auto_mixed_precision(model, None, x, score, max_float_layers=1, finalize="fuse_dequantize")


def test_prediction_matches_the_model_built_from_the_mapping_with_adjacent_float_layers():
    """Two float layers in a row: the model built from the mapping does not round between them, so neither may
    the search (a float twin drops its output grid while every reader is float too); before, the first twin
    still rounded onto its int8 output grid and the search's metric differed from the real model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(128, 8)
    x[0, 0] = 200.0  # layer 0's input grid suffers
    with torch.no_grad():
        model[2].weight[:, 3] *= 30.0  # layer 2's output range: a coarse grid for its reader
        ref = model(x)

    def score(m: nn.Module) -> float:
        with torch.no_grad():
            return -float(((m(x) - ref) ** 2).mean())

    with kernels.use_backend("reference"):
        mapping, fast = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=2, mode="fx",
                                             progress=False, search="fast")
        assert sorted(fast.float_layers) == ["0", "2"]  # adjacent: 0 -> relu -> 2
        p = Q.prepare_fx(model, mapping, example_inputs=(x,))
        p(x)
        real = score(Q.convert_fx(p))
    assert fast.final_metric == pytest.approx(real, rel=1e-5)


def test_ranking_by_metric_when_the_float_model_scores_infinite():
    """An SQNR-vs-float metric gives the float model +inf: every drop is inf, so the ranking sorts by the metric."""
    model, x, _, _ = _outlier_case()
    with torch.no_grad():
        ref = model(x)

    def sqnr(m: nn.Module) -> float:
        with torch.no_grad():
            noise = float(((m(x) - ref) ** 2).sum())
        return float("inf") if noise == 0 else 10 * torch.log10(ref.pow(2).sum() / noise).item()

    with kernels.use_backend("reference"):
        _, fast = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, sqnr, max_float_layers=1, mode="fx",
                                       progress=False, search="fast")
    metrics = [r.metric for r in fast.rows]
    assert metrics == sorted(metrics, reverse=True) and fast.float_layers == ["0"]
