"""Session 40, distributed observers: 2 gloo processes under a short group timeout.

1. ``DistributedDataParallel(broadcast_buffers=True)`` (DDP's default) copied rank 0's observer statistics onto every
   rank before each forward: the merge at convert counted rank 0's histogram once per rank and kept only the last batch
   of the others (uneven data: scale 0.0793 / zero point 125 where one process on all the data gives 0.0896 / 111).
   The prepared model now lists its histogram observers' statistics in DDP's ``_ddp_params_and_buffers_to_ignore``, so the merge
   equals ``broadcast_buffers=False``; DDP around a parent of the prepared model is detected (the statistics changed
   between forwards) and the merge adopts rank 0's statistics with a warning naming ``broadcast_buffers``.
2. An observer that saw data since the last ``sync_observers`` on some ranks only (a mixture-of-experts expert) made
   ``convert`` on every rank fail with a wrong "ranks hold different observers (their models differ)" error (the
   pending lists differed); the ranks now OR their pending flags over the whole model and reduce that observer on
   every rank.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from dist_helpers import error_of, needs_gloo, run_ranks

import lowbit as Q
from lowbit.observer import distributed as D

pytestmark = needs_gloo
WORLD = 2
TIMEOUT_S = 10
STEPS = 4


def xb(rank: int, i: int) -> torch.Tensor:
    """Uneven rank data: rank 1's values 4x as wide and shifted."""
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(10 * rank + i)) * (1 + 3 * rank) + rank


OBSERVERS = {
    "histogram": Q.FakeQuantize.with_args(observer=Q.HistogramObserver, bins=64),
    "percentile": Q.FakeQuantize.with_args(observer=Q.PercentileObserver, percentile=99.0, bins=64),
}


def qat_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = Q.QuantWrapper(torch.nn.Sequential(torch.nn.Linear(6, 4)))
    return Q.prepare_qat(m.train(), Q.QConfig(activation=OBSERVERS[kind], weight=Q.get_default_qat_qconfig().weight))


def input_observer(m: torch.nn.Module) -> torch.nn.Module:
    return m.quant.activation_post_process.activation_post_process


def ddp_worker(rank: int) -> dict[str, object]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    warnings.filterwarnings("ignore", category=FutureWarning)   # (torch 2.13: broadcast_buffers is deprecated)
    out: dict[str, object] = {}
    for kind in OBSERVERS:
        for mode in ("default", "no_broadcast", "parent"):
            m = qat_model(kind)
            wrapped = torch.nn.Sequential(m) if mode == "parent" else m
            d = DDP(wrapped, broadcast_buffers=mode != "no_broadcast")
            for i in range(STEPS):
                d(xb(rank, i)).sum().backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                D.sync_observers(m)
            out[f"{kind}_{mode}"] = [t.clone() for t in input_observer(m).calculate_qparams()]
            out[f"{kind}_{mode}_warnings"] = [str(w.message) for w in caught if "overwritten" in str(w.message)]
    return out


@pytest.fixture(scope="module")
def ddp() -> list[dict[str, object]]:
    return run_ranks(ddp_worker, world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=6 * TIMEOUT_S + 60)


def one_process(kind: str, ranks: tuple[int, ...]) -> list[torch.Tensor]:
    obs = input_observer(qat_model(kind))
    for r in ranks:
        for i in range(STEPS):
            obs(xb(r, i))
    return list(obs.calculate_qparams())


@pytest.mark.parametrize("kind", list(OBSERVERS))
def test_ddp_default_broadcast_merges_every_ranks_data_once(ddp, kind):
    for r in ddp:
        for a, b in zip(r[f"{kind}_default"], r[f"{kind}_no_broadcast"]):
            assert torch.equal(a, b), (kind, a, b)        # before: rank 0's data twice, rank 1's last batch only
        assert r[f"{kind}_default_warnings"] == []
    for a, b in zip(ddp[0][f"{kind}_default"], ddp[1][f"{kind}_default"]):
        assert torch.equal(a, b)
    s, z = ddp[0][f"{kind}_default"]
    s1, z1 = one_process(kind, (0, 1))
    assert abs(float(s) / float(s1) - 1) < 0.01 and abs(int(z) - int(z1)) <= 1, (kind, s, z, s1, z1)


@pytest.mark.parametrize("kind", list(OBSERVERS))
def test_ddp_around_a_parent_warns_and_adopts_rank0_statistics(ddp, kind):
    s0, z0 = one_process(kind, (0,))                       # what DDP made every rank follow
    for r in ddp:
        msgs = r[f"{kind}_parent_warnings"]
        assert msgs and all("rank(s) [1]" in m and "broadcast_buffers" in m for m in msgs), msgs
        s, z = r[f"{kind}_parent"]
        assert torch.equal(s, s0) and torch.equal(z, z0), (kind, s, z, s0, z0)


def test_prepare_keeps_observer_statistics_out_of_ddp_broadcast():
    m = qat_model("histogram")
    ignored = set(m._ddp_params_and_buffers_to_ignore)
    assert "quant.activation_post_process.activation_post_process.histogram" in ignored
    assert "quant.activation_post_process.scale" not in ignored           # a frozen grid still follows rank 0
    fx = Q.prepare_fx(torch.nn.Linear(3, 3).eval(), Q.get_default_qconfig_mapping(), (torch.randn(2, 3),))
    assert any(n.endswith("min_val") for n in fx._ddp_params_and_buffers_to_ignore)
    kept = torch.nn.Linear(2, 2)
    kept._ddp_params_and_buffers_to_ignore = ["mine"]
    m = Q.prepare(Q.QuantWrapper(kept), Q.get_default_qconfig())
    assert m.module._ddp_params_and_buffers_to_ignore == ["mine"]         # (the root's list is the one DDP reads)
    m._ddp_params_and_buffers_to_ignore = ["mine"]
    from lowbit.observer.ddp import keep_statistics_local
    assert keep_statistics_local(m)._ddp_params_and_buffers_to_ignore[0] == "mine"


class MoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(6, 6)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor, route: tuple[int, ...] = (0, 1)) -> torch.Tensor:
        y = self.shared(x)
        return sum(self.experts[e](y) for e in route)


def moe_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Q.prepare(MoE().eval(), Q.QConfig(activation=Q.HistogramObserver.with_args(bins=64),
                                              weight=Q.get_default_qconfig().weight))


def state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}


def in_step() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def moe_worker(rank: int) -> dict[str, object]:
    warnings.simplefilter("ignore")
    out: dict[str, object] = {}
    m = moe_model()
    m(xb(rank, 0))
    D.sync_observers(m)
    m(xb(rank, 1), (0, 1) if rank == 0 else (0,))     # expert 1 sees new data on rank 0 only
    hist = m.experts[1].activation_post_process
    out["convert"] = error_of(lambda: out.__setitem__("q", state(Q.convert(m))))
    out["in_step"] = in_step()
    D.sync_pending(m)
    out["expert1"] = (hist.histogram.clone(), hist.min_val.clone(), hist.max_val.clone())
    # the observers are listed over the whole model, pending or not: a model without an observer is still refused
    d = torch.nn.ModuleDict({"a": Q.HistogramObserver(bins=32), **({"b": Q.HistogramObserver(bins=32)} if rank == 0
                                                                   else {})})
    for o in d.values():
        o(xb(rank, 2))
    out["missing"] = error_of(lambda: D.sync_pending(d))
    out["missing_in_step"] = in_step()
    return out


@pytest.fixture(scope="module")
def moe() -> list[dict[str, object]]:
    return run_ranks(moe_worker, world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=4 * TIMEOUT_S + 60)


def test_expert_seen_on_one_rank_converts_alike_on_every_rank(moe):
    r0, r1 = moe
    assert r0["convert"] == r1["convert"] == "no error", (r0["convert"], r1["convert"])  # before: "models differ"
    assert r0["in_step"] == r1["in_step"] == 2.0
    assert r0["q"].keys() == r1["q"].keys()
    for k, v in r0["q"].items():
        assert torch.equal(v, r1["q"][k]), k


def test_expert_merge_counts_the_one_rank_data_once(moe):
    ref = moe_model()                                    # one process: rank 0's and rank 1's first batch, rank 0's 2nd
    for rank, i in ((0, 0), (1, 0), (0, 1)):
        ref(xb(rank, i), (0, 1))
    hist0, lo0, hi0 = moe[0]["expert1"]
    ref_obs = ref.experts[1].activation_post_process
    assert torch.equal(lo0, ref_obs.min_val) and torch.equal(hi0, ref_obs.max_val)
    assert abs(float(hist0.sum()) - 3 * 16 * 6) < 1e-3 and float((hist0 - ref_obs.histogram).abs().max()) < 3
    for a, b in zip(moe[0]["expert1"], moe[1]["expert1"]):
        assert torch.equal(a, b)


def test_an_observer_on_one_rank_only_is_refused_on_every_rank(moe):
    for r in moe:
        msg = r["missing"]
        assert msg.startswith("ValueError: ") and "rank 0: 'b' (HistogramObserver); rank 1: <none>" in msg, msg
        assert r["missing_in_step"] == 2.0


def test_single_process_is_unchanged():
    m = moe_model()
    m(xb(0, 0))
    D.sync_pending(m)                                   # no process group: nothing runs, nothing raises
    assert D.agree_structure([("a", Q.MinMaxObserver())], pending=[False]) == [False]
    assert Q.convert(m) is not None
