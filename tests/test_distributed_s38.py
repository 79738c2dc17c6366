"""Session 38, distributed calibration: 2 gloo processes under a timeout, each compared with one process (the oracle).

1. Ranks holding different observers at one place (another class, qscheme, ``ch_axis``, percentile) raise a
   ``ValueError`` on every rank naming both (``agree_observer``); they reduced unrelated statistics into silently
   different qparams, or called different collectives and hung until the group's timeout.
2. The clipping-range observers (Percentile / MSE / Entropy) forgot their last reduction on ``reset_min_max_vals``
   (the next reduction subtracted the forgotten union: mass lost) and on ``load_state_dict`` (the loaded union was
   summed once per rank).
3. ``LearnableFakeQuantize`` in its static phase converted to each rank's own last-step grid, and to the initial
   ``scale=1.0`` on a rank whose shard was empty; its parameters now take the observer's reduced grid.
4. ``quantize_llm`` with a rank holding no (or refused) calibration batches raised on that rank alone, leaving the
   others in the first collective until the timeout; every rank now raises at once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from dist_helpers import error_of, needs_gloo, run_ranks

import lowbit as Q

pytestmark = needs_gloo
WORLD = 2
TIMEOUT_S = 20


def x(rank: int, i: int) -> torch.Tensor:
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(10 * rank + i)) * (1 + rank) + 0.3 * rank


MISMATCHED = {  # reduced into silently different (or unrelated) statistics
    "qscheme": (lambda: Q.MinMaxObserver(), lambda: Q.MinMaxObserver(Q.per_tensor_symmetric, Q.qint8)),
    "ch_axis": (lambda: Q.PerChannelMinMaxObserver(ch_axis=0), lambda: Q.PerChannelMinMaxObserver(ch_axis=1)),
    "percentile": (lambda: Q.PercentileObserver(99.0), lambda: Q.PercentileObserver(99.9)),
}

DESYNCED = {  # ran different collectives: a hang until the timeout
    "class": (lambda: Q.MinMaxObserver(), lambda: Q.HistogramObserver(bins=64)),
    "averaging": (lambda: Q.MinMaxObserver(), lambda: Q.MovingAverageMinMaxObserver()),
}

CLIP = {
    "percentile": lambda: Q.PercentileObserver(bins=64),
    "percentile_pc": lambda: Q.PercentileObserver(qscheme=Q.per_channel_affine, ch_axis=1, bins=64),
    "mse": lambda: Q.MSEObserver(bins=64),
}


def lfq_model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = Q.QuantWrapper(torch.nn.Sequential(torch.nn.Linear(6, 4)))
    qc = Q.QConfig(activation=Q.LearnableFakeQuantize.with_args(observer=Q.MovingAverageMinMaxObserver),
                   weight=Q.get_default_qat_qconfig().weight)
    return Q.prepare_qat(m.train(), qc)


def lfq_convert(batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    m = lfq_model()
    for b in batches:
        m(b)
    return {k: v.clone() for k, v in Q.convert(m.eval()).state_dict().items() if k.startswith("quant.")}


def llm_calib(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (1, 16), generator=g) for _ in range(n)]


def mismatches(rank: int, cases: dict) -> dict[str, object]:  # type: ignore[type-arg]
    out: dict[str, object] = {}
    for key, makers in cases.items():               # 1. (each a ValueError on both ranks, the group still in step)
        obs = makers[rank]()
        obs(torch.randn(8, 8, generator=torch.Generator().manual_seed(rank)))
        out[f"mismatch_{key}"] = error_of(obs.calculate_qparams)
    step = torch.tensor([1.0])
    dist.all_reduce(step)
    out["in_step"] = step.item()
    return out


def worker(rank: int) -> dict[str, object]:
    warnings.simplefilter("ignore")
    out = mismatches(rank, MISMATCHED)
    for key, make in CLIP.items():                  # 2.
        o = make()
        o(x(rank, 0))
        o.calculate_qparams()                       # reduced once
        o.reset_min_max_vals()
        o(x(rank, 1))
        out[f"reset_{key}"] = (o.calculate_qparams(), float(o.histogram.sum()))
        src = make()
        src(x(0, 5))
        o = make()
        o.load_state_dict(src.state_dict())         # the same checkpoint on every rank
        o(x(rank, 1))
        out[f"load_{key}"] = (o.calculate_qparams(), float(o.histogram.sum()))
    out["lfq_empty"] = lfq_convert([x(0, i) for i in range(3)] if rank == 0 else [])   # 3.
    out["lfq_both"] = lfq_convert([x(rank, i) for i in range(2 + rank)])
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return run_ranks(worker, world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=4 * TIMEOUT_S + 60)


def check_mismatch(ranks, cases, key):  # type: ignore[no-untyped-def]
    for r in ranks:
        msg = r[f"mismatch_{key}"]
        assert msg.startswith("ValueError: ") and "ranks hold different observers" in msg, msg
        assert "rank 0: " in msg and "rank 1: " in msg
        assert type(cases[key][0]()).__name__ in msg and type(cases[key][1]()).__name__ in msg
    assert ranks[0]["in_step"] == ranks[1]["in_step"] == 2.0          # the next collective still pairs up


@pytest.mark.parametrize("key", list(MISMATCHED))
def test_mismatched_observers_raise_on_every_rank(ranks, key):
    check_mismatch(ranks, MISMATCHED, key)


def test_matching_observers_are_described_alike():
    from lowbit.observer.distributed import describe_observer
    a, b = Q.PercentileObserver(99.9, bins=64), Q.PercentileObserver(99.9, bins=64)
    assert describe_observer(a) == describe_observer(b)
    assert "percentile=99.9" in describe_observer(a) and "bins=64" in describe_observer(a)
    assert describe_observer(Q.PercentileObserver(99.0)) != describe_observer(a)


@pytest.mark.parametrize("key", list(CLIP))
@pytest.mark.parametrize("case", ["reset", "load"])
def test_clip_range_observers_count_the_union_once(ranks, key, case):
    one = CLIP[key]()
    feed = ([x(0, 5)] if case == "load" else []) + [x(0, 1), x(1, 1)]
    for b in feed:
        one(b)
    (s_one, z_one), mass = one.calculate_qparams(), float(one.histogram.sum())
    assert mass == pytest.approx(16 * 6 * len(feed))
    for r in ranks:
        (s, z), got_mass = r[f"{case}_{key}"]
        assert got_mass == pytest.approx(mass, rel=1e-6)               # was 53 (reset) / 384 (load) of 192 / 288
        torch.testing.assert_close(s, s_one, rtol=1e-3, atol=0)        # (the ranks' rebinning: not bit-exact)
        assert torch.equal(z, z_one)


def test_learnable_fake_quantize_converts_to_the_reduced_grid(ranks):
    want = lfq_convert([x(0, i) for i in range(3)])                  # one process on the only data there was
    for r in ranks:
        for k in want:
            assert torch.equal(r["lfq_empty"][k], want[k]), k         # rank 1 had scale=1.0, zero_point=0
    for k in ranks[0]["lfq_both"]:
        assert torch.equal(ranks[0]["lfq_both"][k], ranks[1]["lfq_both"][k]), k   # one grid (was one per rank)


def hang_worker(rank: int, llm: bool) -> dict[str, object]:
    """The cases that hung before their fix (a pytest failure after the group's timeout)."""
    warnings.simplefilter("ignore")
    out = mismatches(rank, DESYNCED)
    if not llm:
        return out
    model = Q.llm.toy_llama(layers=1, hidden=32)
    calib = llm_calib(2)
    mine = calib if rank == 0 else []
    out["empty"] = error_of(lambda: Q.quantize_llm(model, mine, bits=4, group_size=16, progress=False))
    bad = [calib[0]] if rank == 0 else [torch.full((1, 4), 10_000)]    # an id past the vocabulary on rank 1
    out["refused"] = error_of(lambda: Q.quantize_llm(model, bad, bits=4, group_size=16, progress=False))
    step = torch.tensor([1.0])
    dist.all_reduce(step)
    out["llm_in_step"] = step.item()
    return out


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def hang_ranks() -> list[dict[str, object]]:
    return run_ranks(hang_worker, has_transformers(), world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=3 * TIMEOUT_S + 60)


@pytest.mark.parametrize("key", list(DESYNCED))
def test_observers_calling_different_collectives_raise_on_every_rank(hang_ranks, key):
    check_mismatch(hang_ranks, DESYNCED, key)


def test_quantize_llm_without_batches_on_one_rank_raises_on_every_rank(hang_ranks):
    if "empty" not in hang_ranks[0]:
        pytest.skip("needs transformers")
    ranks = hang_ranks
    for r in ranks:
        assert "rank 0: 2, rank 1: 0" in r["empty"] and r["empty"].startswith("ValueError"), r["empty"]
        assert r["llm_in_step"] == 2.0
    assert "10000" in ranks[1]["refused"] or "vocab" in ranks[1]["refused"], ranks[1]["refused"]
    assert "rank(s) [1] were refused" in ranks[0]["refused"], ranks[0]["refused"]


def test_single_process_agree_calibration_is_the_check_itself():
    from lowbit.llm.dist import agree_calibration
    assert agree_calibration("f", lambda: [1]) == [1]
    with pytest.raises(ValueError, match="boom"):
        agree_calibration("f", lambda: (_ for _ in ()).throw(ValueError("boom")))
