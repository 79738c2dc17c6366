"""Block reconstruction (``lowbit.algorithms.block``, BRECQ): residual spans found in graph-mode models,
their layers' codes learned together, exact through ``convert_fx``; bad input raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms.block import block_codes, find_blocks
from lowbit.algorithms.layers import is_weighted


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


class Inverted(nn.Module):
    """MobileNetV2's inverted residual: expand 1x1 + ReLU6, depthwise 3x3 + ReLU6, project 1x1, + input."""

    def __init__(self, c: int):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, 4 * c, 1), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=4 * c), nn.ReLU6())
        self.project = nn.Conv2d(4 * c, c, 1)

    def forward(self, x):
        return x + self.project(self.dw(self.expand(x)))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6(), Inverted(8), nn.Conv2d(8, 12, 1), Inverted(12),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5)).eval()


def _sqnr(ref, out):
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def test_find_blocks_returns_the_residual_spans():
    model = _net()
    prepared = Q.prepare_fx(model, Q.get_default_qconfig(), example_inputs=(torch.randn(2, 3, 8, 8),))
    nodes, mods = list(prepared.graph.nodes), dict(prepared.named_modules())
    spans = find_blocks(nodes, mods)
    assert len(spans) == 2, spans
    layers = [[str(n.target) for n in nodes[i + 1: j + 1] if n.op == "call_module" and is_weighted(mods[n.target])]
              for i, j in sorted(spans.items())]
    assert layers == [["2.expand.0", "2.dw.0", "2.project"], ["4.expand.0", "4.dw.0", "4.project"]], layers


def test_quantize_ptq_blocks_learns_codes_per_block_and_converts_exactly():
    model = _net()
    calib = [torch.randn(8, 3, 10, 10) for _ in range(4)]
    x = torch.randn(32, 3, 10, 10)
    with torch.no_grad():
        ref = model(x)
    qd, _ = Q.quantize_ptq(model, calib, recipe="default", progress=False)
    qb, rep = Q.quantize_ptq(model, calib, recipe="accurate", iters=60, blocks=True, progress=False)
    blocked = [c.name for c in rep.layers if any(n.startswith("block ") for n in c.notes)]
    assert blocked == ["2.expand.0", "2.dw.0", "2.project", "4.expand.0", "4.dw.0", "4.project"], blocked
    with torch.no_grad():
        assert _sqnr(ref, qb(x)) > _sqnr(ref, qd(x))
        # the converted int8 model runs the frozen codes: its output on a calibration batch is the report's
        assert abs(_sqnr(model(calib[0]), qb(calib[0])) - rep.sqnr_db) < 1e-6


def test_block_codes_bad_input():
    w = [torch.randn(4, 4)]
    s = [torch.ones(4, 1)]
    with pytest.raises(ValueError, match="iters=-1"):
        block_codes(w, s, [torch.zeros(4, 1)], -8, 7, lambda: None, iters=-1)
    with pytest.raises(ValueError, match="one grid per weight"):
        block_codes(w, s, [], -8, 7, lambda: None, iters=1)
