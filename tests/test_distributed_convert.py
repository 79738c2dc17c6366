"""The documented distributed conversion patterns, 2 gloo processes, each under a timeout:

1. ``sync_observers`` on every rank, then rank 0 alone calls ``convert`` (PTQ, QAT, graph mode): conversion
   is local — no collective (the weight observers built or re-fed during conversion never reduce).
2. ``convert`` on every rank when one rank's calibration data was all NaN: no rank dies; every rank
   gets the model one process calibrated on the finite data gets.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import needs_gloo, rank_store, run_ranks

import lowbit as Q

pytestmark = needs_gloo
WORLD = 2
TIMEOUT_S = 20          # a collective that one rank never joins fails after this instead of hanging for 30 min


def data(rank: int) -> torch.Tensor:
    return torch.randn(32, 10, generator=torch.Generator().manual_seed(11 + rank)) * (1 + rank)


def net(kind: str = "ptq") -> torch.nn.Module:
    torch.manual_seed(0)
    float_net = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    if kind == "fx":
        return Q.prepare_fx(float_net.eval(), Q.get_default_qconfig_mapping(), (torch.randn(2, 10),))
    m = Q.QuantWrapper(float_net)
    if kind == "qat":
        return Q.prepare_qat(m.train(), Q.get_default_qat_qconfig())
    return Q.prepare(m.eval(), Q.get_default_qconfig())


def convert(prepared: torch.nn.Module, kind: str) -> torch.nn.Module:
    return Q.convert_fx(prepared) if kind == "fx" else Q.convert(prepared.eval())


def calibrate(prepared: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    with torch.no_grad():
        for chunk in x.split(8):
            prepared(chunk)
    return prepared


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def worker(rank: int) -> dict[str, object]:
    store = rank_store()
    result: dict[str, object] = {}
    # 1. sync on every rank, then rank 0 alone converts (a PTQ and a QAT model)
    for kind in ("ptq", "qat", "fx"):
        prepared = calibrate(net(kind), data(rank))
        Q.sync_observers(prepared)
        if rank == 0:
            result[f"rank0_{kind}"] = quantized_state(convert(copy.deepcopy(prepared), kind))
            store.set(f"converted_{kind}", "1")
        else:
            store.wait([f"converted_{kind}"])       # stays alive (and out of any collective) meanwhile
    # 2. convert on every rank; rank 1 calibrated on all-NaN data
    x = data(0) if rank == 0 else torch.full((32, 10), float("nan"))
    prepared = calibrate(net(), x)
    result["all_ranks_nan"] = quantized_state(Q.convert(prepared))
    dist.barrier()
    return result


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker, world=WORLD, pg_timeout_s=TIMEOUT_S, timeout_s=3 * TIMEOUT_S + 60)


def single_process(x: torch.Tensor, kind: str = "ptq") -> dict[str, torch.Tensor]:
    return quantized_state(convert(calibrate(net(kind), x), kind))


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if want[k].is_floating_point():
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)
        else:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("kind", ["ptq", "qat", "fx"])
def test_sync_then_rank0_alone_converts(ranks, kind):
    union = torch.cat([data(0), data(1)])
    # the union's min/max is exact; the histogram of the union is the sum of the ranks' rebinned histograms,
    # so compare the weights (exact: same parameters on every rank) and check the activation grids are sane
    got = ranks[0][f"rank0_{kind}"]
    want = single_process(union, kind)
    for k in want:
        if "weight" in k or "bias" in k:
            assert torch.equal(got[k], want[k]), k
    scales = [v for k, v in got.items() if k.endswith("scale") and v.dim() == 0 and "input_" not in k]
    assert scales and all(float(s) > 0 and torch.isfinite(s) for s in scales)


def test_convert_on_all_ranks_with_one_all_nan_rank(ranks):
    assert_same_state(ranks[0]["all_ranks_nan"], ranks[1]["all_ranks_nan"])       # every rank, one model
    assert_same_state(ranks[0]["all_ranks_nan"], single_process(data(0)))         # = calibrating the finite data


def test_single_process_bad_input_and_local_block():
    from lowbit.observer import distributed as D

    with pytest.raises(TypeError, match="sync_observers: model must be an nn.Module, got dict"):
        Q.sync_observers({})
    with D.local_statistics(), D.local_statistics():     # nests; the flag is restored on exit
        assert not D.is_distributed()
    assert D._LOCAL.depth == 0
