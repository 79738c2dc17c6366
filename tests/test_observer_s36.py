"""Session 36: observer state, fixed-qparams mappings, KL on one-sided data, prepare_qat's qconfigs, graph-mode
chunk / split (each test fails before its fix; torch.ao.quantization is the oracle where it has a behaviour)."""

from __future__ import annotations

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
