"""QAT under DDP (2 gloo processes): a fused, prepare_qat'ed CNN (ConvBnReLU2d with live BN statistics,
FakeQuantize everywhere) trains in lockstep on different shards — parameters agree bit for bit, buffers
(BN statistics, fake-quant grids) follow rank 0 through DDP's broadcast — and converts to int8."""

import torch
import torch.nn.functional as F
from dist_helpers import needs_gloo, run_ranks
from torch import nn

import lowbit.nn.intrinsic.qat as nniqat
from lowbit.fake_quant import disable_observer
from lowbit.fuse import fuse_modules_qat
from lowbit.qconfig import get_default_qat_qconfig
from lowbit.workflow import convert, prepare_qat
from lowbit.stubs import DeQuantStub, QuantStub

pytestmark = needs_gloo
WORLD = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.bn, self.relu = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.dequant(self.fc(self.relu(self.bn(self.conv(self.quant(x)))).flatten(1)))


def worker(rank):
    torch.manual_seed(0)  # same initial model on every rank
    qat = prepare_qat(fuse_modules_qat(Net(), [["conv", "bn", "relu"]]), get_default_qat_qconfig())
    ddp = nn.parallel.DistributedDataParallel(qat)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    for _ in range(3):
        x = torch.randn(8, 1, 6, 6, generator=g)
        loss = F.cross_entropy(ddp(x), (x.mean((1, 2, 3)) > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.apply(nniqat.freeze_bn_stats)
    qat.apply(disable_observer)
    with torch.no_grad():
        ddp(torch.randn(8, 1, 6, 6, generator=g))  # broadcasts rank 0's buffers; nothing updates them
    state = {k: v.detach().clone() for k, v in qat.state_dict().items()}
    q = convert(qat.eval())
    out = q(torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(5)))
    return {"state": state, "bn_type": type(qat.conv.bn).__name__, "out": out, "qtype": type(q.conv).__name__}


def test_qat_trains_in_lockstep_under_ddp():
    r0, r1 = run_ranks(worker, world=WORLD, pg_timeout_s=30)
    assert r0["bn_type"] == "BatchNorm2d" and r0["qtype"] == "ConvReLU2d"
    assert r0["state"].keys() == r1["state"].keys()
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k  # weights, BN running stats, fake-quant scales
    assert int(r0["state"]["conv.bn.num_batches_tracked"]) == 3  # frozen: the last forward did not count
    assert torch.equal(r0["out"], r1["out"])
