"""Session 39, distributed calibration / QAT robustness: 2 gloo processes under a short group timeout.

1. A ``FakeQuantize`` over a histogram-type observer (Histogram / Percentile / MSE / Entropy) reduced its statistics
   across ranks on every training step, so ranks with uneven batch counts (3 steps on one, 5 on the other) left one
   rank's step collectives unpaired (a hang until the group's timeout, or collectives paired with the wrong ones).
   The steps now use the rank's local statistics; the merge waits for ``calculate_qparams`` / ``convert`` /
   ``sync_observers``, so the result equals the observer-calibration path (bit for bit) on every rank.
2. Ranks with different model structure paired observers by position: ``sync_observers`` / ``convert`` merged the
   statistics of differently named observers silently, or (one observer more on a rank) hung. The ranks now agree on
   the ordered module paths and observer kinds first: a ``ValueError`` on every rank names the first differing path,
   before any statistics are merged.
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
TIMEOUT_S = 10          # a collective one rank never joins fails after this, instead of hanging CI
STEPS = (3, 5)          # training steps of rank 0 and rank 1


def x(rank: int, i: int) -> torch.Tensor:
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(10 * rank + i)) * (1 + rank) + 0.3 * rank


FQ = {  # histogram-type observers: FakeQuantize.forward reduced them on every step
    "histogram": lambda: Q.FakeQuantize(Q.HistogramObserver, bins=64),
    "percentile": lambda: Q.FakeQuantize(Q.PercentileObserver, percentile=99.0, bins=64),
    "percentile100": lambda: Q.FakeQuantize(Q.PercentileObserver, percentile=100.0, bins=64),
    "mse": lambda: Q.FakeQuantize(Q.MSEObserver, bins=64),
    "entropy": lambda: Q.FakeQuantize(Q.EntropyObserver, bins=256),
    "percentile_pc": lambda: Q.FakeQuantize(Q.PercentileObserver, percentile=99.0, bins=64,
                                            qscheme=Q.per_channel_affine, ch_axis=1),
    "learnable": lambda: Q.LearnableFakeQuantize(observer=Q.HistogramObserver, bins=64),
}


def qat_model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = Q.QuantWrapper(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)))
    qc = Q.QConfig(activation=Q.FakeQuantize.with_args(observer=Q.HistogramObserver, bins=64),
                   weight=Q.get_default_qat_qconfig().weight)
    return Q.prepare_qat(m.train(), qc)


def train(m: torch.nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.0)    # (no DDP here: weights stay equal, activations differ)
    for i in range(STEPS[rank]):
        opt.zero_grad()
        m(x(rank, i)).square().mean().backward()
        opt.step()


def qstate(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}


def in_step() -> float:
    step = torch.tensor([1.0])
    dist.all_reduce(step)
    return step.item()


def uneven_worker(rank: int) -> dict[str, object]:
    warnings.simplefilter("ignore")
    out: dict[str, object] = {}
    for key, make in FQ.items():
        fq = make()
        for i in range(STEPS[rank]):
            fq(x(rank, i))
        out[f"fq_{key}"] = [t.clone() for t in fq.calculate_qparams()]
        obs = make().activation_post_process          # the observer-calibration path on the same shard
        for i in range(STEPS[rank]):
            obs(x(rank, i))
        out[f"obs_{key}"] = [t.clone() for t in obs.calculate_qparams()]
    # a QAT model: train unevenly, then convert on every rank ...
    m = qat_model()
    train(m, rank)
    out["convert_all"] = qstate(Q.convert(m.eval()))
    # ... or sync_observers on every rank, then rank 0 alone converts
    m = qat_model()
    train(m, rank)
    D.sync_observers(m)
    if rank == 0:
        out["convert_rank0"] = qstate(Q.convert(m.eval()))
    out["in_step"] = in_step()
    return out


@pytest.fixture(scope="module")
def uneven() -> list[dict[str, object]]:
    return run_ranks(uneven_worker, world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=6 * TIMEOUT_S + 60)


@pytest.mark.parametrize("key", list(FQ))
def test_uneven_steps_finish_and_agree_with_the_observer_path(uneven, key):
    r0, r1 = uneven
    for r in (r0, r1):
        for a, b in zip(r[f"fq_{key}"], r[f"obs_{key}"]):
            assert torch.equal(a, b), (key, a, b)        # the observer-calibration path, bit for bit
    for a, b in zip(r0[f"fq_{key}"], r1[f"fq_{key}"]):
        assert torch.equal(a, b), (key, a, b)            # the same grid on every rank
    assert r0["in_step"] == r1["in_step"] == 2.0


def test_percentile_100_equals_one_process_on_all_the_data(uneven):
    one = FQ["percentile100"]()
    for rank in range(WORLD):
        for i in range(STEPS[rank]):
            one(x(rank, i))
    for a, b in zip(uneven[0]["fq_percentile100"], one.calculate_qparams()):
        assert torch.equal(a, b)


def test_uneven_qat_converts_alike_on_every_rank(uneven):
    r0, r1 = uneven
    assert r0["convert_all"].keys() == r1["convert_all"].keys()
    for k, v in r0["convert_all"].items():
        assert torch.equal(v, r1["convert_all"][k]), k
    assert r0["convert_rank0"].keys() == r0["convert_all"].keys()
    for k, v in r0["convert_rank0"].items():
        assert torch.equal(v, r0["convert_all"][k]), k


def named(rank: int, names: list[str]) -> torch.nn.ModuleDict:
    d = torch.nn.ModuleDict({n: Q.HistogramObserver(bins=32) for n in names})
    for i, o in enumerate(d.values()):
        o(x(rank, i))
    return d


STRUCTURES = {  # rank 0's observer paths, rank 1's, the first differing path on each
    "renamed": ((["a", "b"], ["a", "c"]), ("'b'", "'c'")),          # merged silently into the wrong observer
    "extra": ((["a"], ["extra", "a"]), ("'a'", "'extra'")),         # one more observer: a hang
}


def prepared(rank: int) -> torch.nn.Module:
    layers = [torch.nn.Linear(6, 4)] + ([torch.nn.ReLU(), torch.nn.Linear(4, 4)] if rank else [])
    m = Q.prepare(Q.QuantWrapper(torch.nn.Sequential(*layers)).eval(), Q.get_default_qconfig())
    m(x(rank, 0))
    return m


def structure_worker(rank: int) -> dict[str, object]:
    warnings.simplefilter("ignore")
    out: dict[str, object] = {}
    for key, (names, _) in STRUCTURES.items():
        d = named(rank, names[rank])
        before = {n: o.histogram.clone() for n, o in d.items()}
        out[key] = error_of(lambda: D.sync_observers(d))  # noqa: B023
        out[f"{key}_untouched"] = all(torch.equal(o.histogram, before[n]) for n, o in d.items())
        out[f"{key}_in_step"] = in_step()
    out["convert"] = error_of(lambda: Q.convert(prepared(rank)))
    out["convert_in_step"] = in_step()
    same = named(rank, ["a", "b"])                      # the same structure still merges
    D.sync_observers(same)
    out["same"] = [o.histogram.clone() for o in same.values()]
    return out


@pytest.fixture(scope="module")
def structure() -> list[dict[str, object]]:
    return run_ranks(structure_worker, world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=4 * TIMEOUT_S + 60)


@pytest.mark.parametrize("key", list(STRUCTURES))
def test_different_structure_raises_on_every_rank_naming_the_first_differing_path(structure, key):
    (_, (p0, p1)) = STRUCTURES[key]
    for r in structure:
        msg = r[key]
        assert msg.startswith("ValueError: ") and "different observers" in msg, msg
        assert f"rank 0: {p0}" in msg and f"rank 1: {p1}" in msg, msg
        assert r[f"{key}_untouched"]                   # refused before any statistics were merged
        assert r[f"{key}_in_step"] == 2.0              # the next collective still pairs up


def test_convert_with_different_structure_raises_on_every_rank(structure):
    for r in structure:
        msg = r["convert"]
        assert msg.startswith("ValueError: ") and "different observers" in msg, msg
        assert "rank 0: <none>" in msg and "rank 1: 'module.2" in msg, msg
        assert r["convert_in_step"] == 2.0


def test_same_structure_still_merges(structure):
    for a, b in zip(structure[0]["same"], structure[1]["same"]):
        assert torch.equal(a, b) and abs(float(a.sum()) - 192) < 1e-3


def test_single_process_structure_check_is_local():
    assert D.sync_observers(named(0, ["a", "b"])) == 2


def prepared_fx(rank: int) -> torch.nn.Module:
    layers = [torch.nn.Linear(6, 4)] + ([torch.nn.ReLU(), torch.nn.Linear(4, 4)] if rank else [])
    m = Q.prepare_fx(torch.nn.Sequential(*layers).eval(), Q.get_default_qconfig_mapping(), (x(rank, 0),))
    m(x(rank, 0))
    return m


def fx_structure_worker(rank: int) -> dict[str, object]:
    warnings.simplefilter("ignore")
    out: dict[str, object] = {}
    for key, fn in (("convert_fx", Q.convert_fx), ("reference_fx", Q.convert_to_reference_fx),
                    ("reference", lambda m: Q.reference.to_reference(m))):
        make = prepared if key == "reference" else prepared_fx
        out[key] = error_of(lambda: fn(make(rank)))  # noqa: B023
        out[f"{key}_in_step"] = in_step()
    torch.manual_seed(0)
    same = Q.prepare_fx(torch.nn.Sequential(torch.nn.Linear(6, 4)).eval(), Q.get_default_qconfig_mapping(),
                        (x(rank, 0),))
    same(x(rank, 0))
    q = Q.convert_fx(same)                              # the same structure still merges: one grid on every rank
    out["same"] = {k: v for k, v in q.state_dict().items() if isinstance(v, torch.Tensor)}
    return out


@pytest.fixture(scope="module")
def fx_structure() -> list[dict[str, object]]:
    return run_ranks(fx_structure_worker, world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=4 * TIMEOUT_S + 60)


@pytest.mark.parametrize("key", ["convert_fx", "reference_fx", "reference"])
def test_graph_and_reference_converts_check_structure_on_every_rank(fx_structure, key):
    for r in fx_structure:
        msg = r[key]
        assert msg.startswith("ValueError: ") and "different observers" in msg and "rank 0: <none>" in msg, msg
        assert r[f"{key}_in_step"] == 2.0


def test_graph_convert_with_the_same_structure_agrees_across_ranks(fx_structure):
    a, b = fx_structure[0]["same"], fx_structure[1]["same"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
