"""Block reconstruction (``lowbit.algorithms.block``, BRECQ): residual spans found in graph-mode models,
their layers' codes learned together, exact through ``convert_fx``; bad input raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms.block import LearnedGrid, block_codes, find_blocks
from lowbit.algorithms.layers import is_weighted, split
from lowbit.algorithms.layerwise import reconstruct
from lowbit.nn.intrinsic import ClampedReLU
from lowbit.observer.fixed import FixedQParamsObserver

from helpers import Inverted, inverted_net, one_thread  # noqa: F401  (autouse: which blocks keep learned grids depends on the summation order)


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _sqnr(ref, out):
    """In float64, as ``quantize_ptq``'s report computes it (float32 sums differ from it by ~1e-6 dB at 44 dB)."""
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def test_find_blocks_returns_the_residual_spans():
    model = inverted_net()
    prepared = Q.prepare_fx(model, Q.get_default_qconfig(), example_inputs=(torch.randn(2, 3, 8, 8),))
    nodes, mods = list(prepared.graph.nodes), dict(prepared.named_modules())
    spans = find_blocks(nodes, mods)
    assert len(spans) == 2, spans
    layers = [[str(n.target) for n in nodes[i + 1: j + 1] if n.op == "call_module" and is_weighted(mods[n.target])]
              for i, j in sorted(spans.items())]
    assert layers == [["2.expand.0", "2.dw.0", "2.project"], ["4.expand.0", "4.dw.0", "4.project"]], layers


def test_quantize_ptq_blocks_learns_codes_per_block_and_converts_exactly():
    model = inverted_net()
    calib = [torch.randn(8, 3, 10, 10) for _ in range(4)]
    x = torch.randn(32, 3, 10, 10)
    with torch.no_grad():
        ref = model(x)
    qd, _ = Q.quantize_ptq(model, calib, recipe="default", progress=False)
    qb, rep = Q.quantize_ptq(model, calib, recipe="accurate", iters=60, blocks=True, progress=False)
    blocked = [c.name for c in rep.layers if any(n.startswith("block ") for n in c.notes)]
    assert blocked == ["2.expand.0", "2.dw.0", "2.project", "4.expand.0", "4.dw.0", "4.project"], blocked
    with torch.no_grad():
        # at ~40 dB on this toy net, held-out gains are noise: the sums' order per CPU decides the sign (AVX2 EPYC:
        # 40.34 accurate vs 40.52 default held out, 39.66 vs 39.58 on the calibration data); learning must not hurt
        assert _sqnr(ref, qb(x)) > _sqnr(ref, qd(x)) - 0.5
        # the converted int8 model runs the frozen codes: its output on a calibration batch is the report's
        assert abs(_sqnr(model(calib[0]), qb(calib[0])) - rep.sqnr_db) < 1e-6


def test_block_codes_bad_input():
    w = [torch.randn(4, 4)]
    s = [torch.ones(4, 1)]
    with pytest.raises(ValueError, match="iters=-1"):
        block_codes(w, s, [torch.zeros(4, 1)], -8, 7, lambda: None, iters=-1)
    with pytest.raises(ValueError, match="one grid per weight"):
        block_codes(w, s, [], -8, 7, lambda: None, iters=1)


def test_find_blocks_through_observer_takes_the_output_grid():
    prepared = Q.prepare_fx(inverted_net(), Q.get_default_qconfig(), example_inputs=(torch.randn(2, 3, 8, 8),))
    nodes, mods = list(prepared.graph.nodes), dict(prepared.named_modules())
    plain, through = find_blocks(nodes, mods), find_blocks(nodes, mods, through_observer=True)
    assert list(plain) == list(through)
    observed = 0
    for i, j in plain.items():  # one node further: the add's observer (since session 44 the last add, read only by
        # the float average pool, stays float (fx.islands) and has none: the span ends at the add itself)
        if nodes[j + 1].op == "call_module" and isinstance(mods.get(nodes[j + 1].target), Q.ObserverBase):
            assert through[i] == j + 1 and nodes[j + 1].args == (nodes[j],)
            observed += 1
        else:
            assert through[i] == j
    assert observed == 1


def test_learned_grid_is_lsq_and_checks_its_grid():
    gr = LearnedGrid(0.5, 10, 0, 255, cap=6.0 / 245)  # cap above s0 * ... : never below the calibrated step
    assert gr.cap == 0.5
    x = torch.tensor([-5.0, 0.3, 0.76, 200.0])
    torch.testing.assert_close(gr(x), torch.tensor([-5.0, 0.5, 1.0, 122.5]))
    gr(torch.tensor([0.74])).sum().backward()  # LSQ: d/ds of s * (round(x / s)) = round(x / s) - x / s
    torch.testing.assert_close(gr.t.grad, torch.tensor((1.0 - 0.74 / 0.5) * 0.5))
    assert gr(torch.tensor([1, 2])).dtype == torch.int64  # integer values pass through
    with pytest.raises(ValueError, match="zero_point=300"):
        LearnedGrid(0.1, 300, 0, 255)
    with pytest.raises(ValueError, match="scale=0.0"):
        LearnedGrid(0.0, 0, 0, 255)


def test_learn_grids_pins_learned_scales_and_converts_exactly():
    model = inverted_net()
    torch.manual_seed(1)
    calib = [torch.randn(8, 3, 10, 10) for _ in range(4)]
    prepared = Q.prepare_fx(model, Q.get_default_qconfig(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            prepared(b)
    before = {n: m.calculate_qparams() for n, m in prepared.named_modules() if isinstance(m, Q.ObserverBase)}
    reconstruct(prepared, [(b,) for b in calib], iters=100, blocks=True, learn_grids=True, progress=False)
    fixed = {n: m for n, m in prepared.named_modules() if isinstance(m, FixedQParamsObserver)}
    # a block keeps its learned codes and grids (expand, depthwise, project outputs and the add's) together,
    # where they beat round-to-nearest on the calibrated grids (the second block's add, read only by the float
    # pool, stays float since session 44 (fx.islands): 3 grids there, 4 in the first block)
    assert len(fixed) in (3, 4, 7), sorted(fixed)
    assert any(float(m.scale) != float(before[n][0]) for n, m in fixed.items())
    for n, m in fixed.items():
        assert int(m.zero_point) == int(before[n][1])  # zero points stay where calibration put them
        src = next(node.args[0] for node in prepared.graph.nodes if node.target == n)
        act = split(dict(prepared.named_modules()).get(src.target, nn.Identity()))[1] if src.op == "call_module" else None
        if isinstance(act, ClampedReLU):  # the ReLU6 grid stays inside the clamp (or where calibration put it)
            top = float(m.scale) * (m.quant_max - int(m.zero_point))
            assert top <= max(6.0, float(before[n][0]) * (m.quant_max - int(before[n][1]))) + 1e-5
    qmodel = Q.convert_fx(prepared)
    x = torch.randn(4, 3, 10, 10)
    with torch.no_grad():
        assert _sqnr(model(x), qmodel(x)) > 20



def test_simulated_grids_round_as_the_int8_model():
    """The reconstruction's fake-quantized grids (observers, learned steps) give the int8 model's codes
    ``round(x / s + z)`` also where the float32 add of ``z`` lands on a tie (``round(x / s) + z`` differs there)."""
    from lowbit.algorithms.layerwise import _fq

    s, z = 0.018555499613285065, 114  # MobileNetV2's input grid, where the two roundings first differ
    x = (torch.arange(-114, 141, dtype=torch.float32) + 0.5) * s
    x = torch.cat([x, *(torch.nextafter(x, torch.full_like(x, d * 1e9)) for d in (-1, 1))])
    for _ in range(3):  # a few ulps either side of every half step
        x = torch.cat([x, torch.nextafter(x, torch.full_like(x, 1e9)), torch.nextafter(x, torch.full_like(x, -1e9))])
    ref = Q.quantize_per_tensor(x, s, z, Q.quint8).dequantize()
    naive = (torch.clamp(torch.round(x * torch.reciprocal(torch.tensor(s))) + z, 0, 255) - z) * s
    assert not torch.equal(naive, ref)  # the case exists on this grid
    sim = _fq(FixedQParamsObserver(s, z))
    assert torch.equal(sim(x), ref)
    assert torch.equal(LearnedGrid(s, z, 0, 255)(x), ref)


class PaddedInverted(Inverted):
    """EfficientNet-Lite0's block: TF-"same" zero padding (asymmetric) before the depthwise conv, in the block."""

    def __init__(self, c: int):
        super().__init__(c)
        self.dw[0].padding = (0, 0)

    def forward(self, x):
        y = torch.nn.functional.pad(self.expand(x), (0, 2, 1, 1))
        return x + self.project(self.dw(y))


def test_blocks_span_zero_pads_and_convert_exactly():
    """A residual block with a zero pad inside (graph mode runs it on the codes) is rounded as one block, and
    the int8 model reproduces the report's figure: the pad runs the same way in the pass and after convert."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6(), PaddedInverted(8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
    calib = [torch.randn(8, 3, 10, 10) for _ in range(4)]
    q, rep = Q.quantize_ptq(model, calib, recipe="accurate", iters=20, blocks=True, progress=False)
    blocked = [c.name for c in rep.layers if any(n.startswith("block ") for n in c.notes)]
    assert blocked == ["2.expand.0", "2.dw.0", "2.project"], blocked
    with torch.no_grad():
        assert abs(_sqnr(model(calib[0]), q(calib[0])) - rep.sqnr_db) < 1e-6
