"""Session 38: the accuracy-recovery algorithms on hostile but legitimate models.

Found and fixed:
- cross-layer equalization paired a layer with a next layer that reads another axis of its output (a Linear after a
  Conv1d reads the length axis; a Conv1d after a Linear on 3-D inputs reads the token axis) whenever the sizes
  happened to match, and rescaled them: the float model changed;
- bias absorption (and the clamp stretch's maxima) reduced a Linear's 3-D output over every dim but 1, the token
  axis: a crash when tokens != channels, a silently changed float model when equal;
- ``refine_grids`` searched an observer that quantizes at two nodes (a reused module's output grid) at one of them
  with the other float, then pinned the shrunk step for both: the int8 model lost ~16 dB;
- the rounding walk rounded and bias-corrected a module called twice at each call (the second call overwrote the
  first's codes and shifted the shared bias again, against a "float" target computed with the rounded weight), and a
  tied weight's second holder re-rounded the already-rounded weight onto its own grid: the recovery recipes lost to
  round-to-nearest on such models (graph and eager mode).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import reconstruct
from lowbit.algorithms.equalize import equalize_prepared
from lowbit.algorithms.grid_search import refine_grids
from lowbit.observer import MinMaxObserver, PerChannelMinMaxObserver

from helpers import one_thread  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _equalized(model: nn.Module, x: torch.Tensor, **kw) -> tuple[list, torch.Tensor]:
    model.eval()
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    recs = equalize_prepared(p, [(x,)], **kw)
    with torch.no_grad():
        return recs, p(x)


def _f64(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double()(x.double())


@pytest.mark.parametrize("kind", ["conv1d_then_linear", "linear3d_then_conv1d"])
def test_equalization_pairs_only_layers_that_share_the_channel_axis(kind):
    torch.manual_seed(0)
    if kind == "conv1d_then_linear":  # (N, 8, 8): the Linear reads the length axis, the conv writes channels
        model, x = nn.Sequential(nn.Conv1d(4, 8, 1), nn.ReLU(), nn.Linear(8, 3)), torch.randn(5, 4, 8)
    else:  # (N, 6, 6): the conv reads the token axis as channels, the Linear writes its last axis
        model, x = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Conv1d(6, 3, 1)), torch.randn(2, 6, 4)
    with torch.no_grad():
        model[0].weight.mul_(torch.logspace(-2, 1, model[0].weight.shape[0]).view(-1, *[1] * (model[0].weight.dim() - 1)))
    ref = _f64(model, x)
    recs, y = _equalized(model, x)
    assert recs == []  # before: one pair, the output moved by up to 5.1
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [5, 6])
def test_bias_absorption_of_a_linear_on_3d_inputs_keeps_the_function(tokens):
    """Linear(4, 6) with a large bias → ReLU → Linear on (2, T, 4): every channel's pre-activation stays above 4, so
    all 6 are absorbed, per channel (before: T != 6 crashed, T == 6 absorbed per-token minima, output off by 1e-3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        model[0].bias.fill_(5.0)
    x = torch.randn(2, tokens, 4) * 0.1
    ref = _f64(model, x)
    recs, y = _equalized(model, x)
    assert [(r.first, r.second, r.absorbed) for r in recs] == [("0", "2", 6)]
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_clamp_stretch_into_a_float_linear_reads_channel_maxima_on_3d_inputs():
    """An int8 Linear + ReLU6 feeding a float Linear (mixed precision) on (N, T, C) inputs: the stretch measures the
    maxima per channel (the last axis), so the float function is kept and channels get stretched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU6(), nn.Linear(6, 3)).eval()
    with torch.no_grad():
        model[0].weight.mul_(torch.logspace(-2, 0, 6).view(6, 1))
    x = torch.randn(2, 6, 4) * torch.logspace(-3, 0, 6).view(1, 6, 1)  # tokens of unlike scale
    ref = _f64(model, x)
    with torch.no_grad():
        m = model[0].double()(x.double()).amax((0, 1)) * 1.5  # per channel (before: per token, channels clipped)
        model[0].float()
    mapping = Q.get_default_qconfig_mapping().set_module_name("2", None)
    p = Q.prepare_fx(model, mapping, example_inputs=(x,))
    recs = equalize_prepared(p, [(x,)], relu6="range", weights=False)
    with torch.no_grad():
        y = p(x)
    assert [(r.first, r.second) for r in recs] == [("0", "2")]
    assert recs[0].stretched == int(((m > 0) & (m < 6)).sum()) > 0
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


class Reuse(nn.Module):
    """One conv / Linear called twice: prepare_fx gives both calls' outputs one observer module (as torch.ao)."""

    def __init__(self, conv: bool = True):
        super().__init__()
        self.a = nn.Conv2d(4, 4, 1) if conv else nn.Linear(16, 16)
        self.b = nn.Conv2d(4, 4, 3, padding=1) if conv else nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def test_refine_grids_leaves_an_observer_shared_by_two_nodes_alone():
    torch.manual_seed(0)
    model = Reuse().eval()
    calib = [torch.randn(2, 4, 6, 6) for _ in range(2)]
    p = Q.prepare_fx(model, Q.QConfigMapping().set_global(Q.get_accurate_qconfig()), example_inputs=(calib[0],))
    calls: dict[str, int] = {}
    for n in p.graph.nodes:
        if n.op == "call_module":
            calls[str(n.target)] = calls.get(str(n.target), 0) + 1
    with torch.no_grad():
        for b in calib:
            p(b)
    plain = Q.convert_fx(copy.deepcopy(p))
    changes = refine_grids(p, calib, progress=False)
    assert changes and all(calls[c.name] == 1 for c in changes)
    q = Q.convert_fx(p)
    with torch.no_grad():
        ref = model(calib[0])
        # before: the shared grid pinned at 0.6 of its step from one node's view: 37.5 -> 21.3 dB
        assert _sqnr(ref, q(calib[0])) >= _sqnr(ref, plain(calib[0])) - 0.01


_QC = Q.QConfig(activation=MinMaxObserver.with_args(qdtype=Q.quint8.with_range(0, 127)),  # 4-bit weights: visible
                weight=PerChannelMinMaxObserver.with_args(qdtype=Q.qint8.with_range(-8, 7)))


def test_reused_layer_bias_is_corrected_once_at_its_first_call():
    """``a`` runs twice; with round-to-nearest codes its bias moves by the first call's mean pre-activation error
    (computed here from the calibrated input grid), not by the sum of both calls' (before)."""
    torch.manual_seed(3)
    model = Reuse(conv=False).eval()
    calib = [torch.randn(32, 16) for _ in range(2)]
    p = Q.prepare_fx(model, Q.QConfigMapping().set_global(_QC), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            p(b)
    s, z = p.activation_post_process_0.calculate_qparams()
    w = model.a.weight.detach()
    ws = w.abs().amax(1, keepdim=True) / 7.5
    w_hat = torch.clamp(torch.round(w * torch.reciprocal(ws)), -8, 7) * ws  # convert's codes (ties42: not w / ws)
    xq = [torch.clamp(torch.round(x / s + z), 0, 127).sub(z).mul(s) for x in calib]
    expect = torch.cat([x @ w.T - xq_ @ w_hat.T for x, xq_ in zip(calib, xq)]).mean(0)
    changes = reconstruct(p, calib, adaround=False, bias_correction=True, progress=False)
    assert [c.name for c in changes] == ["a", "a", "b"]
    assert any("shared" in note for note in changes[1].notes)
    torch.testing.assert_close(p.a.bias.detach() - model.a.bias.detach(), expect, rtol=1e-4, atol=1e-7)


class Tied(nn.Module):
    def __init__(self, tie: bool = True, eager: bool = False):
        super().__init__()
        self.a, self.b, self.h = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.b.weight = self.a.weight if tie else nn.Parameter(self.a.weight.detach().clone())
        self.q, self.d = (Q.QuantStub(), Q.DeQuantStub()) if eager else (nn.Identity(), nn.Identity())

    def forward(self, x):
        return self.d(self.h(torch.relu(self.b(torch.relu(self.a(self.q(x)))))))


def _tied_pair(eager: bool, iters: int) -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    """The tied model and its untied twin (b's weight a copy), each through rounding + bias correction, converted."""
    torch.manual_seed(3)
    tied = Tied(eager=eager).eval()
    sep = Tied(tie=False, eager=eager).eval()
    sep.load_state_dict(tied.state_dict())
    calib = [torch.randn(32, 16) for _ in range(2)]
    out = []
    for m in (tied, sep):
        if eager:
            p = Q.prepare(copy.deepcopy(m), _QC)
            with torch.no_grad():
                for b in calib:
                    p(b)
            reconstruct(p, calib, adaround=iters > 0, iters=iters, progress=False)
            out.append(Q.convert(p))
        else:
            q, _ = Q.quantize_ptq(m, calib, "accurate", qconfig_mapping=Q.QConfigMapping().set_global(_QC),
                                  iters=iters, refine=0, equalize=False, blocks=False, float_output=False,
                                  progress=False)
            out.append(q)
    return out[0], out[1], calib


@pytest.mark.parametrize("eager", [False, True])
def test_tied_weight_rounds_as_an_untied_copy_would_with_nearest_codes(eager):
    """Round-to-nearest + bias correction: a weight tied between ``a`` and ``b`` gives the int8 model the untied copy
    gives (before: ``b`` re-rounded ``a``'s rounded weight onto its own grid and took it as its float target: the
    calibration error 1.2-1.3x round-to-nearest's where the copy's is 0.7x)."""
    q_tied, q_sep, calib = _tied_pair(eager, iters=0)
    with torch.no_grad():
        for x in calib:
            torch.testing.assert_close(q_tied(x), q_sep(x), rtol=0, atol=1e-6)


def test_tied_weight_keeps_the_codes_adaround_learned_for_its_first_holder():
    q_tied, _, calib = _tied_pair(False, iters=20)
    wa, wb = q_tied.a.weight(), q_tied.b.weight()
    assert torch.equal(wa.int_repr(), wb.int_repr())
    assert torch.equal(wa.q_per_channel_scales(), wb.q_per_channel_scales())
