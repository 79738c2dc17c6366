"""Session 36: observer state, fixed-qparams mappings, KL on one-sided data, prepare_qat's qconfigs, graph-mode
chunk / split (each test fails before its fix; torch.ao.quantization is the oracle where it has a behaviour)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.ao.quantization.observer as tao
from torch import nn

import lowbit as Q

# -- 1. eps travels in state_dict, as torch.ao's eps buffer --------------------------------------------------------

_PAIRS = [
    (Q.MinMaxObserver, tao.MinMaxObserver),
    (Q.PerChannelMinMaxObserver, tao.PerChannelMinMaxObserver),
    (Q.HistogramObserver, tao.HistogramObserver),
    (Q.MovingAverageMinMaxObserver, tao.MovingAverageMinMaxObserver),
    (Q.MovingAveragePerChannelMinMaxObserver, tao.MovingAveragePerChannelMinMaxObserver),
]


@pytest.mark.parametrize("ours, theirs", _PAIRS, ids=[p[0].__name__ for p in _PAIRS])
def test_observer_state_dict_keys_are_torch_aos(ours, theirs):
    sd, tsd = ours().state_dict(), theirs().state_dict()
    assert list(sd) == list(tsd)
    assert sd["eps"].shape == tsd["eps"].shape == (1,) and sd["eps"].dtype == torch.float64  # exact round trip
    # torch.ao's strict load of a lowbit checkpoint finds every key, and adopts the eps
    o = ours(eps=1e-3)
    o(torch.randn(4, 8))
    t = theirs()
    t.load_state_dict(o.state_dict())
    assert float(t.eps) == pytest.approx(1e-3)


def test_fixed_and_placeholder_observers_save_what_torch_aos_save():
    assert list(Q.FixedQParamsObserver(1 / 256, 0).state_dict()) == ["scale", "zero_point"]
    assert list(Q.PlaceholderObserver().state_dict()) == list(tao.PlaceholderObserver().state_dict()) == []
    assert list(Q.FakeQuantize().state_dict()) == sorted(tq.FakeQuantize().state_dict(), key=list(
        Q.FakeQuantize().state_dict()).index)  # same key set
    assert set(Q.FakeQuantize().state_dict()) == set(tq.FakeQuantize().state_dict())


@pytest.mark.parametrize("cls", [Q.MinMaxObserver, Q.MovingAverageMinMaxObserver, Q.HistogramObserver,
                                 Q.EntropyObserver, Q.PercentileObserver, Q.MSEObserver])
def test_non_default_eps_survives_save_and_load(cls):
    """A checkpoint of an observer with eps=1e-2 on a range below it, loaded into a default observer, gave the
    default eps's scale (1e-8 floor) silently: the eps was not saved."""
    obs = cls(eps=1e-2)
    obs(torch.linspace(0, 1e-4, 100))
    fresh = cls()
    fresh.load_state_dict(obs.state_dict())
    assert fresh.eps == pytest.approx(1e-2)
    for a, b in zip(fresh.calculate_qparams(), obs.calculate_qparams()):
        assert torch.equal(a, b)
    assert float(fresh.calculate_qparams()[0]) >= 1e-2 * (1 - 1e-6)  # the floor holds (the default gives ~4e-7)


def test_per_channel_eps_and_default_eps_round_trip_exactly():
    obs = Q.PerChannelMinMaxObserver(eps=0.5)
    obs(torch.randn(3, 5) * 1e-3)
    fresh = Q.PerChannelMinMaxObserver()
    fresh.load_state_dict(obs.state_dict())
    assert torch.equal(fresh.calculate_qparams()[0], torch.full((3,), 0.5))
    d = Q.MinMaxObserver()
    d.load_state_dict(Q.MinMaxObserver().state_dict())
    assert d.eps == 1e-8  # the default's float32 value keeps the exact Python float


def test_checkpoints_without_eps_still_load():
    """lowbit's checkpoints before session 36 have no eps key: a strict load keeps the observer's own eps."""
    obs = Q.MinMaxObserver()
    obs(torch.randn(16))
    old = {k: v for k, v in obs.state_dict().items() if k != "eps"}
    fresh = Q.MinMaxObserver(eps=1e-4)
    fresh.load_state_dict(old)  # strict
    assert fresh.eps == 1e-4 and torch.equal(fresh.max_val, obs.max_val)
    model = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), Q.DeQuantStub())
    prepared = Q.prepare(model, Q.get_minmax_qconfig())
    prepared(torch.randn(8, 4))
    stats = Q.get_observer_state_dict(prepared)
    assert any(k.endswith(".eps") for k in stats)
    old_stats = {k: v for k, v in stats.items() if not k.endswith(".eps")}
    again = Q.prepare(model, Q.get_minmax_qconfig())
    Q.load_observer_state_dict(again, old_stats)
    Q.load_observer_state_dict(again, stats)


def test_learnable_fake_quant_floor_follows_a_loaded_eps():
    f = Q.LearnableFakeQuantize(observer=Q.MovingAverageMinMaxObserver.with_args(eps=1e-2))
    g = Q.LearnableFakeQuantize()
    g.load_state_dict(f.state_dict())
    assert g.eps == pytest.approx(1e-2)


# -- 2. the default mappings pin torch.ao's fixed grids for sigmoid / tanh / hardsigmoid / softmax --------------------

def _fixed_entries(mapping) -> dict:
    """``{object type: (scale, zero_point)}`` for the mapping's fixed-qparams entries (lowbit's or torch.ao's)."""
    out = {}
    for op, qc in mapping.to_dict()["object_type"]:
        if isinstance(op, str) or qc is None:
            continue  # torch.ao's method names ("sigmoid_"): lowbit resolves a method call through its function
        obs = qc.activation()
        obs = getattr(obs, "activation_post_process", obs)
        if "FixedQParams" in type(obs).__name__:
            out[op] = (float(obs.scale), int(obs.zero_point))
    return out


@pytest.mark.parametrize("qat", [False, True])
def test_default_mappings_have_torch_aos_fixed_qparams_entries(qat):
    ours = Q.get_default_qat_qconfig_mapping() if qat else Q.get_default_qconfig_mapping()
    theirs = tq.get_default_qat_qconfig_mapping() if qat else tq.get_default_qconfig_mapping()
    assert _fixed_entries(ours) == _fixed_entries(theirs)
    assert _fixed_entries(ours)[torch.tanh] == (2 / 256, 128) and _fixed_entries(ours)[nn.Sigmoid] == (1 / 256, 0)
    kind = Q.FixedQParamsFakeQuantize if qat else Q.FixedQParamsObserver
    assert isinstance(ours.object_type_qconfigs[nn.Softmax].activation(), kind)


class _Fixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(7))
        self.sig, self.hs, self.sm = nn.Sigmoid(), nn.Hardsigmoid(), nn.Softmax(-1)

    def forward(self, x):
        lin = self.lins
        return (self.sig(lin[0](x)), torch.tanh(lin[1](x)), self.hs(lin[2](x)), lin[3](x).sigmoid(),
                torch.nn.functional.hardsigmoid(lin[4](x)), lin[6](self.sm(lin[5](x))))


def test_prepare_fx_default_mapping_fixed_grids_match_torch_ao():
    """Before, sigmoid / tanh / hardsigmoid outputs were observed (a histogram grid, e.g. 0.0027 for a sigmoid seen in
    [0.03, 0.97]) and the Linear after a softmax quantized its input on the observed range; torch.ao pins 1/256 and
    2/256 grids. With min/max everywhere else, lowbit's int8 outputs are torch.ao's within one step of the grid."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = _Fixed().eval()
    x = torch.randn(64, 8) * 3
    tqc = tq.QConfig(activation=tao.MinMaxObserver.with_args(dtype=torch.quint8),
                     weight=tao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = prepare_fx(copy.deepcopy(model), tq.get_default_qconfig_mapping().set_global(tqc), (x,))
        tp(x)
        ours = Q.prepare_fx(model, Q.get_default_qconfig_mapping().set_global(Q.get_minmax_qconfig()), (x,))
        ours(x)
        converted = Q.convert_fx(ours)
        t_out, l_out = convert_fx(tp)(x), converted(x)
    steps = [1 / 256, 2 / 256, 1 / 256, 1 / 256, 1 / 256]
    for i, (t, mine, step) in enumerate(zip(t_out, l_out, steps)):
        t, mine = t.dequantize(), mine.dequantize() if hasattr(mine, "dequantize") else mine
        assert torch.equal(torch.round(mine / step) * step, mine), i  # on the fixed grid
        assert (t - mine).abs().max().item() <= step + 1e-6, i
    t, mine = t_out[5].dequantize(), l_out[5].dequantize() if hasattr(l_out[5], "dequantize") else l_out[5]
    assert (t - mine).abs().max().item() <= 1.01 * float(converted.get_submodule("lins.6").scale)
    sm_obs = [m for m in converted.modules() if type(m).__name__ == "Quantize"]
    assert any(abs(float(q.scale) - 1 / 256) < 1e-9 and int(q.zero_point) == 0 for q in sm_obs), sm_obs
