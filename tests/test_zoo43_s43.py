"""Session 43: small real-model code patterns through ``quantize_ptq``, graph mode and eager mode, as written.

A forward with control flow on a shape (``if x.shape[1] == 1``) under the ``"accurate"`` recipe; old-style in-place
ops (``x.relu_()``, ``y.add_(x)``, ``z.clamp_(0, 6)``) in graph mode; an eager ``QuantWrapper`` around a model that
returns a dict or a tuple. Oracles: the float model (SQNR), the same model written out of place (exact codes).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lowbit as Q


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach(), out.detach()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


# ---- "accurate" on a model whose own forward torch.fx cannot trace ----
class _ShapeBranch(nn.Module):
    """grayscale-to-RGB on the input's channel count: control flow on a shape, so the root is not traceable."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.repeat(1, 3, 1, 1)
        return self.fc(self.body(x).mean((2, 3)))


def _shape_branch() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return _ShapeBranch().eval(), [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]


def test_accurate_recipe_runs_on_a_model_whose_forward_cannot_be_traced():
    # before: TypeError "equalize_prepared: expects a prepare_fx model (fx.GraphModule), got _ShapeBranch"
    # (with equalize=False: "refine_grids: needs a graph-mode prepared model"), an internal function's name
    model, calib = _shape_branch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, report = Q.quantize_ptq(model, calib, recipe="accurate", iters=2, refine=2, progress=False)
        out = q(calib[0])
    steps = dict(report.steps)
    assert steps["equalize"].startswith("skipped: _ShapeBranch.forward cannot be traced by torch.fx")
    assert "if x.shape[1] == 1" in steps["equalize"] and steps["refine grids"].startswith("skipped")
    assert "round" in steps and "convert" in steps
    assert _sqnr(model(calib[0]), out) > 30


@pytest.mark.parametrize("opt", ["tune", "distill"])
def test_tune_and_distill_on_an_untraceable_forward_are_refused_by_name(opt):
    # before: TypeError "tune_biases: prepared must be a graph-mode prepared model (prepare_fx), got _ShapeBranch"
    model, calib = _shape_branch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=rf"quantize_ptq: {opt}=2 .*_ShapeBranch.forward cannot be traced"):
            Q.quantize_ptq(model, calib, recipe="accurate", iters=2, progress=False, **{opt: 2})
