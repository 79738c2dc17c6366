"""QAT modules: weight fake-quant, parameter sharing, Conv+BN fold with live BN statistics, the QAT workflow."""

import copy

import pytest
import torch
import torch.ao.nn.intrinsic as tnni
import torch.ao.nn.intrinsic.qat as tnniqat
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn

import lowbit.nn.intrinsic as nni
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
import lowbit.nn.intrinsic.qat as nniqat
import lowbit.nn.qat as nnqat
from lowbit.nn.quantized import conv as nnq_conv, linear as nnq_linear
from lowbit.fake_quant import disable_observer
from lowbit.fuse import fuse_modules_qat
from lowbit.qconfig import get_default_qat_qconfig
from lowbit.workflow import convert, freeze_bn_stats, prepare_qat
from lowbit.qtensor import QTensor
from lowbit.stubs import DeQuantStub, QuantStub


torch.manual_seed(0)
QC = get_default_qat_qconfig()
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
SIZE = {1: (4, 3, 9), 2: (4, 3, 7, 7), 3: (4, 3, 5, 5, 5)}


def _with_qc(m):
    m.qconfig = QC
    return m


@pytest.mark.parametrize("make, x, qcls", [
    (lambda: nn.Linear(5, 4), torch.randn(3, 5), nnqat.Linear),
    (lambda: nn.Conv1d(3, 4, 3), torch.randn(SIZE[1]), nnqat.Conv1d),
    (lambda: nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect"), torch.randn(SIZE[2]), nnqat.Conv2d),
    (lambda: nn.Conv3d(3, 4, 3, padding=1, padding_mode="circular"), torch.randn(SIZE[3]), nnqat.Conv3d),
])
def test_qat_module_is_float_op_on_fake_quantized_weight(make, x, qcls):
    f = _with_qc(make())
    q = qcls.from_float(f)
    assert q.weight is f.weight and q.bias is f.bias  # shared Parameters
    y = q(x)
    wq = q.weight_fake_quant(f.weight)
    ref = F.linear(x, wq, f.bias) if isinstance(f, nn.Linear) else f._conv_forward(x, wq, f.bias)
    torch.testing.assert_close(y, ref)
    assert (y - f(x)).abs().max() > 0  # the weight really went through the int8 grid
    back = q.to_float()
    assert type(back) is type(f) and torch.equal(back(x), f(x))
    if not isinstance(f, nn.Linear):
        assert (back.padding, back.padding_mode) == (f.padding, f.padding_mode)


def test_qat_embedding_and_errors():
    emb = _with_qc(nn.Embedding(10, 4, padding_idx=0))
    q = nnqat.Embedding.from_float(emb)
    idx = torch.tensor([[0, 3, 9]])
    torch.testing.assert_close(q(idx), q.weight_fake_quant(emb.weight)[idx])
    assert q.padding_idx == 0 and q.weight is emb.weight
    with pytest.raises(ValueError, match="needs a qconfig"):
        nnqat.Linear.from_float(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a qconfig"):
        nnqat.Conv2d(1, 1, 1)
    with pytest.raises(TypeError, match="expects Linear, got Conv2d"):
        nnqat.Linear.from_float(_with_qc(nn.Conv2d(1, 1, 1)))
    with pytest.raises(TypeError, match="qconfig must be a lowbit QConfig"):
        nnqat.Linear(2, 2, qconfig=(1, 2))
    with pytest.raises(TypeError, match="ConvBn2d expects"):
        nniqat.ConvBn2d(nn.Conv1d(1, 1, 1), nn.BatchNorm2d(1), qconfig=QC)
    with pytest.raises(ValueError, match="output channels"):
        nniqat.ConvBn2d(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(3), qconfig=QC)


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("relu", [False, True])
def test_conv_bn_qat_matches_float_and_folds(d, relu):
    conv, bn = CONV[d](3, 4, 3, padding="same", padding_mode="reflect", bias=(d == 2)), BN[d](4)
    ref = nn.Sequential(conv, bn, nn.ReLU()) if relu else nn.Sequential(conv, bn)
    ref_copy = copy.deepcopy(ref)
    cls = getattr(nniqat, f"ConvBnReLU{d}d" if relu else f"ConvBn{d}d")
    q = cls(conv, bn, qconfig=QC)
    x = torch.randn(SIZE[d])
    # with fake-quant off, the train-mode forward is exactly conv -> bn(batch stats) (-> relu)
    q.weight_fake_quant.disable_fake_quant()
    torch.testing.assert_close(q(x), ref_copy(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.running_mean, ref_copy[1].running_mean)  # BN statistics updated
    assert int(bn.num_batches_tracked) == 1
    # eval: equals the folded QAT conv that convert uses, fake-quant on
    q.weight_fake_quant.enable_fake_quant()
    q.eval()
    folded = q.fold()
    assert type(folded) is (getattr(nniqat, f"ConvReLU{d}d") if relu else getattr(nnqat, f"Conv{d}d"))
    assert folded.padding == "same" and folded.padding_mode == "reflect"
    torch.testing.assert_close(q(x), folded(x), atol=1e-5, rtol=1e-5)
    float_fold = q.to_float()
    q.weight_fake_quant.disable_fake_quant()
    torch.testing.assert_close(q(x), float_fold(x), atol=1e-5, rtol=1e-5)


def test_linear_bn_qat_and_freeze():
    lin, bn = nn.Linear(5, 4), nn.BatchNorm1d(4)
    q = nniqat.LinearBn1d.from_float(_with_qc(nni.LinearBn1d(lin, bn)))
    x = torch.randn(16, 5)
    q(x)
    mean = bn.running_mean.clone()
    q.apply(freeze_bn_stats)
    assert not q.bn.training and q.training
    q.train()  # train() keeps a frozen BN in eval
    q(x)
    assert torch.equal(bn.running_mean, mean) and not q.bn.training
    q.apply(nniqat.update_bn_stats)
    q(x)
    assert not torch.equal(bn.running_mean, mean)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.bn, self.relu = nn.Conv2d(1, 8, 3, padding="same"), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        x = self.bn2(self.conv2(x))
        return self.dequant(self.fc(self.pool(x).flatten(1)))


@pytest.mark.filterwarnings("ignore:lowbit. torch.adaptive_avg_pool2d")  # the pool runs float, by design
def test_qat_workflow_trains_freezes_and_converts():
    torch.manual_seed(1)
    x = torch.randn(64, 1, 8, 8)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    net = fuse_modules_qat(Net(), [["conv", "bn", "relu"], ["conv2", "bn2"]])
    qat = prepare_qat(net, QC)
    assert type(qat.conv) is nniqat.ConvBnReLU2d and type(qat.conv2) is nniqat.ConvBn2d
    assert type(qat.fc) is nnqat.Linear and qat.training
    assert type(qat.fc.activation_post_process).__name__ == "FakeQuantize"
    assert not hasattr(qat.conv.conv, "activation_post_process")  # children of fused modules unobserved
    opt = torch.optim.SGD(qat.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(30):
        if step == 20:
            qat.apply(disable_observer)
            qat.apply(freeze_bn_stats)
            frozen = qat.conv.bn.running_mean.clone()
        loss = F.cross_entropy(qat(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] * 0.9
    assert torch.equal(qat.conv.bn.running_mean, frozen)  # frozen BN stats stay
    assert qat.conv.bn.num_batches_tracked.item() == 20
    qat.eval()
    ref = qat(x)
    q = convert(qat)
    assert type(q.conv) is nnq_conv.ConvReLU2d and type(q.conv2) is nnq_conv.Conv2d and type(q.fc) is nnq_linear.Linear
    assert q.conv.padding_str == "same" and q.conv2.padding_mode == "reflect"
    seen = {}
    q.conv2.register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    out = q(x)
    assert isinstance(seen["out"], QTensor)
    # converted int8 model tracks the fake-quant model it came from
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    assert (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.95


def test_prepare_qat_swaps_and_inplace():
    m = nn.Sequential(nn.Linear(4, 4), nni.LinearReLU(nn.Linear(4, 4), nn.ReLU()), nn.Embedding(5, 4))
    p = prepare_qat(m)
    assert p is not m and type(m[0]) is nn.Linear
    assert [type(c) for c in p] == [nnqat.Linear, nniqat.LinearReLU, nnqat.Embedding]
    assert not hasattr(p[2], "activation_post_process")  # embedding output stays float
    p2 = prepare_qat(m, inplace=True)
    assert type(m[0]) is nnqat.Linear and p2 is m
    # a qconfig given at fusion covers the fused module only; the rest gets the default recipe
    qc = get_default_qat_qconfig()
    f = prepare_qat(fuse_modules_qat(nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU(), nn.Linear(2, 2)), ["0", "1"],
                                     qconfig=qc))
    assert f[0].qconfig is qc and type(f[2]) is nnqat.Linear and f[2].qconfig is not qc
    lb = prepare_qat(nn.Sequential(nni.LinearBn1d(nn.Linear(4, 4), nn.BatchNorm1d(4))), QC)
    assert type(lb[0]) is nniqat.LinearBn1d
    x = torch.randn(16, 4)
    lb(x)
    q = convert(lb.eval())
    assert type(q[0]) is nnq_linear.Linear
    assert (q(x).dequantize() - lb(x)).abs().max() < 3 * q[0].scale


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("relu", [False, True])
def test_conv_bn_qat_parity_with_torch_ao(d, relu):
    """Same conv/BN and weight fake-quant → bit-equal outputs, BN statistics and gradients as torch.ao's."""
    torch.manual_seed(d)
    conv, bn = CONV[d](3, 4, 3, padding=1), BN[d](4)
    name = f"ConvBnReLU{d}d" if relu else f"ConvBn{d}d"
    mods = (copy.deepcopy(conv), copy.deepcopy(bn)) + ((nn.ReLU(),) if relu else ())
    marker = getattr(tnni, name)(*mods)
    marker.qconfig = tq.QConfig(
        activation=tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver),
        weight=tq.FakeQuantize.with_args(observer=tq.PerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                         dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0))
    theirs = getattr(tnniqat, name).from_float(marker)
    ours = getattr(nniqat, name)(conv, bn, qconfig=QC)
    for step in range(3):
        if step == 2:
            ours.freeze_bn_stats()
            theirs.freeze_bn_stats()
        x = torch.randn(SIZE[d])
        a, b = ours(x), theirs(x)
        assert torch.equal(a, b) and torch.equal(ours.bn.running_var, theirs.bn.running_var)
        a.square().sum().backward()
        b.square().sum().backward()
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.bn.weight.grad, theirs.bn.weight.grad, rtol=1e-5, atol=1e-6)
    ours.eval(), theirs.eval()
    x = torch.randn(SIZE[d])
    assert torch.equal(ours(x), theirs(x))
