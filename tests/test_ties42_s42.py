"""The rounding algorithms' codes are ``convert``'s, bit for bit (session 42, ties42).

``convert`` quantizes a weight as ``clamp(round(W · fl(1/s) + z))`` (``lowbit.rounding.round_codes``); the rounding
passes used ``round(W / s) + z``, which differs at exact ties (a symmetric per-channel grid's extreme weight sits at
±127.5 steps; an odd zero point sends every exact tie the other way) and next to them (the quotient and the product
with the reciprocal differ by an ulp). Checked here:

- ``weight_codes`` equals the converted layer's ``weight_int8`` on constructed ties and random layers, per tensor and
  per channel, symmetric and affine, eager and graph mode;
- round to nearest in ``reconstruct`` (which freezes its codes) converts to exactly the codes ``convert`` gives the
  untouched model; AdaRound's round-to-nearest fallback is convert's code; distillation's "before" error on an
  unrounded model is the converted model's;
- ``freeze_weight`` round-trips through ``convert`` for odd, huge and tiny scales, and refuses (``ValueError`` naming
  the scale) a grid whose codes float32 cannot carry.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import reconstruct
from lowbit.algorithms.adaround import adaround_codes
from lowbit.algorithms.distill import distill
from lowbit.algorithms.layers import freeze_weight, is_weighted, split, weight_codes
from lowbit.observer import MinMaxObserver, PerChannelMinMaxObserver
from lowbit.qconfig import QConfig
from helpers import bn_depthwise_net


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


_ACT = Q.get_default_qconfig().activation
QCONFIGS = {
    "per_channel_symmetric": Q.get_default_qconfig(),
    "per_tensor_symmetric": Q.get_default_qconfig("qnnpack"),
    "per_channel_affine": QConfig(activation=_ACT, weight=PerChannelMinMaxObserver.with_args(
        ch_axis=0, qscheme=Q.per_channel_affine, qdtype=Q.qint8)),
    "per_tensor_affine": QConfig(activation=_ACT, weight=MinMaxObserver.with_args(
        qscheme=Q.per_tensor_affine, qdtype=Q.qint8)),
}


class _Net(nn.Module):
    def __init__(self, first: torch.Tensor | None = None) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 32)
        if first is not None:
            with torch.no_grad():
                self.a.weight.zero_()
                self.a.weight[: first.shape[0], : first.shape[1]] = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.b(torch.relu(self.a(self.quant(x)))))


def _prepared(model: nn.Module, qc: QConfig, mode: str, x: torch.Tensor) -> nn.Module:
    if mode == "graph":
        p = Q.prepare_fx(copy.deepcopy(model), Q.QConfigMapping().set_global(qc), example_inputs=(x,))
    else:
        m = copy.deepcopy(model)
        m.qconfig = qc
        p = Q.prepare(m)
    with torch.no_grad():
        p(x)
    return p


def _convert(p: nn.Module, mode: str) -> nn.Module:
    return Q.convert_fx(copy.deepcopy(p)) if mode == "graph" else Q.convert(copy.deepcopy(p))


def _layers(p: nn.Module) -> dict[str, nn.Module]:
    mods = dict(p.named_modules())
    return {n: m for n, m in mods.items() if is_weighted(m) and not is_weighted(mods.get(n.rpartition(".")[0], p))}


def _codes_off(p: nn.Module, q: nn.Module) -> int:
    """How many of ``weight_codes``' codes differ from the converted layers' int8 weights."""
    layers = _layers(p)
    assert len(layers) == 2
    return sum(int((q.get_submodule(n).weight_int8.float() != weight_codes(m)[0]).sum()) for n, m in layers.items())


def _tie_rows() -> torch.Tensor:
    """Rows whose weights land on exact ties of their own min/max grid (step 1/16 on [-7, 248] steps):
    odd zero point -121 (affine) puts 0.5 and 1.5 steps on ties, and the symmetric grid's extremes too."""
    step = 0.0625
    row = torch.tensor([-7.0, 248.0, 0.5, 1.5, 2.5, -3.5, 100.5, -6.5]) * step
    return torch.stack([row, row.flip(0), row.roll(3), row * 0.5])


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("scheme", list(QCONFIGS))
def test_weight_codes_are_the_converted_codes_on_ties_and_random_layers(mode, scheme):
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    for model in (_Net(), _Net(_tie_rows())):
        p = _prepared(model.eval(), QCONFIGS[scheme], mode, x)
        assert _codes_off(p, _convert(p, mode)) == 0, (mode, scheme)


def test_the_constructed_tie_is_a_tie():
    """The tie rows do meet ``round(W / s) + z`` and convert differently (the formula the old code used)."""
    w = _tie_rows()
    obs = PerChannelMinMaxObserver(ch_axis=0, qscheme=Q.per_channel_affine, qdtype=Q.qint8)
    obs(w)
    s, z = obs.calculate_qparams()
    assert int(z[0]) == -121 and float(s[0]) == 0.0625
    old = torch.clamp(torch.round(w / s[:, None]) + z[:, None], -128, 127)
    new = Q.quantize_per_channel(w, s, z, 0, Q.qint8).int_repr().float()
    assert int((old != new).sum()) > 4


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("scheme", ["per_channel_symmetric", "per_channel_affine"])
def test_round_to_nearest_in_reconstruct_converts_to_convert_alone(mode, scheme):
    torch.manual_seed(1)
    x = torch.randn(8, 64)
    p = _prepared(_Net(_tie_rows() if scheme.endswith("affine") else None).eval(), QCONFIGS[scheme], mode, x)
    plain = _convert(p, mode)
    changes = reconstruct(p, [x], adaround=False, bias_correction=False, progress=False)
    assert len(changes) == 2 and all(c.codes_changed == 0.0 for c in changes)
    rounded = _convert(p, mode)
    for n in _layers(p):
        assert torch.equal(rounded.get_submodule(n).weight_int8, plain.get_submodule(n).weight_int8), n


def test_adaround_falls_back_to_convert_round_to_nearest():
    """With an objective that only round to nearest (convert's) meets, AdaRound returns exactly convert's codes."""
    w = _tie_rows()
    obs = PerChannelMinMaxObserver(ch_axis=0, qscheme=Q.per_channel_affine, qdtype=Q.qint8)  # odd zero points
    obs(w)
    s, z = obs.calculate_qparams()
    conv = Q.quantize_per_channel(w, s, z, 0, Q.qint8).int_repr().float()
    s2, z2 = s[:, None], z[:, None].float()
    target = (conv - z2) * s2
    q = adaround_codes(w, s2, z2, -128, 127, lambda: ((lambda wh: wh), target), iters=0,
                       error=lambda wh: float((wh - target).abs().sum()))
    assert torch.equal(q, conv)


def _distill_net() -> nn.Module:
    return bn_depthwise_net()


def test_distill_on_an_unrounded_model_starts_from_the_converted_model():
    model = _distill_net()
    torch.manual_seed(1)
    calib = [torch.randn(16, 3, 6, 6) for _ in range(2)]
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            p(b)
    q = Q.convert_fx(copy.deepcopy(p))
    with torch.no_grad():
        before = sum(float((q(b) - model(b)).pow(2).sum(1).mean()) for b in calib)
    r = distill(p, model, calib, iters=1, batch_size=8, progress=False)
    assert r.error_before == pytest.approx(before, rel=1e-6)


# scales from float32's smallest normal reciprocal range to where (q - z) * s still fits: odd mantissas throughout
_SCALES = [m * 2.0 ** e for e in (-126, -100, -60, -30, -8, -1, 0, 7, 30, 60, 100, 119)
           for m in (1.0, 1.0000001, 1.2345678, 1.5, 1.9999999, 1.0 / 3.0 * 4)]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_frozen_codes_survive_convert_for_any_scale(mode):
    torch.manual_seed(2)
    x = torch.randn(8, 64)
    p = _prepared(_Net().eval(), QCONFIGS["per_channel_affine"], mode, x)
    layers = _layers(p)
    g = torch.Generator().manual_seed(3)
    want = {}
    for n, m in layers.items():
        c = split(m)[0].weight.shape[0]
        s = torch.tensor([_SCALES[i % len(_SCALES)] for i in range(c)], dtype=torch.float32).view(c, 1)
        z = torch.randint(-128, 128, (c, 1), generator=g).float()
        q = torch.randint(-128, 128, tuple(split(m)[0].weight.shape), generator=g).float()
        freeze_weight(m, q, s, z)
        want[n] = q
        assert torch.equal(weight_codes(m)[0], q), n
    conv = _convert(p, mode)
    for n, q in want.items():
        assert torch.equal(conv.get_submodule(n).weight_int8.float(), q), n


@pytest.mark.parametrize("scale", [1e-40, 2.0 ** -129, 3.0e38])
def test_freeze_weight_refuses_a_scale_float32_cannot_carry(scale):
    lin = nn.Linear(4, 2)
    lin.qconfig = Q.get_default_qconfig()
    before = lin.weight.detach().clone()
    q = torch.tensor([[-128.0, -3.0, 5.0, 127.0], [1.0, 0.0, -1.0, 2.0]])
    s, z = torch.full((2, 1), scale), torch.zeros(2, 1)
    with pytest.raises(ValueError, match=r"freeze_weight: Linear's weight code .* scale="):
        freeze_weight(lin, q, s, z)
    assert torch.equal(lin.weight, before)  # nothing changed


def test_freeze_weight_refuses_codes_off_the_grid():
    lin = nn.Linear(4, 2)
    lin.qconfig = Q.get_default_qconfig()
    q = torch.tensor([[0.5, 0.0, 1.0, 2.0], [1.0, 0.0, -1.0, 300.0]])
    with pytest.raises(ValueError, match=r"weight code q=0\.5 at \(0, 0\)"):
        freeze_weight(lin, q, torch.full((2, 1), 0.01), torch.zeros(2, 1))
