"""Cross-rank observer reduction: 2 gloo processes on 127.0.0.1 calibrating half the data each give
the qparams of one process on the union (MinMax, PerChannel exactly; moving averages as the mean of
the ranks' averages)."""

import pytest
import torch
from dist_helpers import needs_gloo, run_ranks

import lowbit as Q
from lowbit.observer import distributed as D

pytestmark = needs_gloo
WORLD = 2


def shards(rank):
    g = torch.Generator().manual_seed(7)
    acts = [torch.randn(16, 10, generator=g) * (1 + i) for i in range(4)]           # rank r gets batches r, r+2
    weights = [torch.randn(6, 5, generator=g) * torch.linspace(0.1, 3, 6)[:, None] for _ in range(4)]
    return acts[rank::WORLD], weights[rank::WORLD], acts, weights


def observers():
    return {
        "minmax": Q.MinMaxObserver(),
        "minmax_sym": Q.MinMaxObserver(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8),
        "ema": Q.MovingAverageMinMaxObserver(averaging_constant=0.3),
        "per_channel": Q.PerChannelMinMaxObserver(),
        "per_channel_affine": Q.PerChannelMinMaxObserver(qscheme=Q.per_channel_affine, qdtype=Q.quint8),
        "ema_per_channel": Q.MovingAveragePerChannelMinMaxObserver(averaging_constant=0.3),
        "late": Q.PerChannelMinMaxObserver(),            # only rank 1 sees data: rank 0 keeps the scalar seed
    }


def feed(obs, acts, weights, rank=None):
    for name, o in obs.items():
        if name == "late" and rank == 0:
            continue
        for b in (weights if "channel" in name or name == "late" else acts):
            o(b)


def worker(rank):
    acts, weights, _, _ = shards(rank)
    assert D.is_distributed()
    # 1. automatic reduction at calculate_qparams time, on every rank
    obs = observers()
    feed(obs, acts, weights, rank)
    local_ema = {k: (obs[k].min_val.clone(), obs[k].max_val.clone()) for k in ("ema", "ema_per_channel")}
    result = {name: o.calculate_qparams() for name, o in obs.items()}
    result["local_ema"] = local_ema
    # 2. sync_observers on every rank, then qparams on rank 0 only (no collective, no hang)
    obs2 = torch.nn.ModuleDict(observers())
    feed(obs2, acts, weights, rank)
    assert D.sync_observers(obs2) == len(obs2)
    if rank == 0:
        result["after_sync"] = {name: o.calculate_qparams() for name, o in obs2.items()}
    # 3. FakeQuantize.forward is collective-free: rank 0 alone runs extra steps
    fq = Q.FakeQuantize()
    if rank == 0:
        for b in acts:
            fq(b)
    # 4. QAT under DDP: FakeQuantize (per tensor and a per-channel weight grid) trains; parameters stay in step
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 6), Q.FakeQuantize(), torch.nn.ReLU(),
                              Q.FakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=1))
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for b in acts:
        opt.zero_grad()
        ddp(b).square().mean().backward()
        opt.step()
    result["ddp_weight"] = net[0].weight.detach().clone()
    result["ddp_scale_shape"] = tuple(net[3].scale.shape)
    result["mean"] = D.all_reduce_mean(torch.tensor([float(rank), float("inf") if rank else 1.0]))
    result["sum"] = D.all_reduce_sum(torch.tensor([1.0, float(rank)]))
    return result


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker, world=WORLD, pg_timeout_s=30)


def single_process():
    _, _, acts, weights = shards(0)
    obs = observers()
    feed(obs, acts, weights)
    late = Q.PerChannelMinMaxObserver()
    for w in weights[1::WORLD]:                          # only rank 1's shard reached "late"
        late(w)
    obs["late"] = late
    return {name: o.calculate_qparams() for name, o in obs.items() if "ema" not in name}


@pytest.mark.parametrize("name", ["minmax", "minmax_sym", "per_channel", "per_channel_affine", "late"])
def test_cumulative_observers_equal_one_process_on_the_union(ranks, name):
    expected = single_process()[name]
    for r in ranks:
        for got in (r[name], ranks[0]["after_sync"][name]):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("name", ["ema", "ema_per_channel"])
def test_moving_averages_reduce_to_the_mean_of_the_ranks(ranks, name):
    lo = (ranks[0]["local_ema"][name][0] + ranks[1]["local_ema"][name][0]) / 2
    hi = (ranks[0]["local_ema"][name][1] + ranks[1]["local_ema"][name][1]) / 2
    scheme = Q.per_tensor_affine if name == "ema" else Q.per_channel_symmetric
    qdtype = Q.quint8 if name == "ema" else Q.qint8
    expected = Q.calculate_qparams(lo, hi, scheme, qdtype)
    for r in ranks:
        torch.testing.assert_close(r[name][0], expected[0], rtol=1e-6, atol=0)
        assert torch.equal(r[name][1], expected[1])
        assert torch.equal(r[name][0], ranks[0][name][0])      # every rank agrees bit for bit


def test_fake_quantize_trains_under_ddp(ranks):
    assert torch.equal(ranks[0]["ddp_weight"], ranks[1]["ddp_weight"])
    assert ranks[0]["ddp_scale_shape"] == (6,)


def test_helpers(ranks):
    for r in ranks:
        assert r["mean"].tolist() == [0.5, 1.0]                  # the rank holding inf is left out
        assert r["sum"].tolist() == [2.0, 1.0]


def test_single_process_helpers_are_identity():
    t = torch.tensor([1.0, 2.0])
    assert not D.is_distributed()
    assert D.all_reduce_mean(t) is t and D.all_reduce_sum(t) is t
    lo, hi = D.all_reduce_min_max(t, t)
    assert lo is t and hi is t
