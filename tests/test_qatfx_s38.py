"""Graph-mode QAT sweep (session 38): prepare_qat_fx / convert_fx against torch.ao's step by step; each test fails
before its fix."""

import copy

import pytest
import torch
import torch.ao.nn.intrinsic.qat as tnniqat
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization.quantize_fx import prepare_qat_fx as ao_prepare_qat_fx

import lowbit as Q
import lowbit.nn.intrinsic.qat as nniqat
from helpers import one_thread, sgd_steps  # noqa: F401  (one_thread: autouse, this module runs on 1 thread)
from lowbit.qscheme import per_channel_symmetric, per_tensor_affine, qint8, quint8


class _Net(nn.Module):
    """conv-bn-relu, conv-bn + residual add-relu, an SE gate (sigmoid-mul), hardswish, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.se, self.c3, self.hs = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 3, stride=2), nn.Hardswish()
        self.fc1, self.fc2 = nn.Linear(3, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.b1(self.c1(x)))
        b = F.relu(self.b2(self.c2(a)) + a)
        b = b * torch.sigmoid(self.se(b))
        return self.fc2(F.relu(self.fc1(self.hs(self.c3(b)))))  # (N, 4, 3, 4): the Linears on the last dim


def _bns(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("version", [0, 1])
def test_frozen_bn_stays_frozen_across_eval_train_and_bn_kept_once(version, monkeypatch):
    """prepare_qat_fx / prepare_fx / fuse_fx left each fused-away BN (and ReLU) attached under its old name too: the
    usual epoch loop `model.eval()` ... `model.train()` after `freeze_bn_stats` put the BN back in training mode
    through that alias, so its running statistics kept updating silently (torch.ao: frozen), and state_dict carried
    every BN twice (`b1.*` and `c1.bn.*`)."""
    monkeypatch.setattr(torch.backends.quantized, "engine", "x86")  # (the previous engine comes back)
    torch.manual_seed(0)
    m, ex = _Net().train(), (torch.randn(4, 3, 8, 8),)
    a = ao_prepare_qat_fx(copy.deepcopy(m), tq.get_default_qat_qconfig_mapping("x86", version), ex)
    b = Q.prepare_qat_fx(copy.deepcopy(m), Q.get_default_qat_qconfig_mapping("x86", version), ex)
    conv_layout = {"c1.conv.weight": "c1.weight", "c1.conv.bias": "c1.bias", "c2.conv.weight": "c2.weight",
                   "c2.conv.bias": "c2.bias"}  # (lowbit's ConvBn keeps its conv as a child: another layout)
    # (lowbit's QAT conv-BN modules also save freeze_bn / bn_fold as `_extra_state`, session 40; torch.ao's lose them)
    assert sorted(conv_layout.get(k, k) for k in b.state_dict() if not k.endswith("_extra_state")) == sorted(a.state_dict())
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9), torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    steps = {1: (lambda k: k.apply(tnniqat.freeze_bn_stats), lambda k: k.apply(nniqat.freeze_bn_stats)),
             2: (lambda k: k.eval(),) * 2, 3: (lambda k: k.train(),) * 2,
             4: (lambda k: k.apply(tq.disable_observer), lambda k: k.apply(Q.disable_observer))}
    torch.manual_seed(1)
    for step in range(6):
        if step in steps:
            steps[step][0](a), steps[step][1](b)
        x = torch.randn(4, 3, 8, 8)
        ya, yb = a(x), b(x)
        assert torch.equal(ya, yb), step
        if a.training:
            sgd_steps((ya, oa), (yb, ob))
        for p, q in zip(_bns(a), _bns(b), strict=True):
            assert torch.equal(p.running_mean, q.running_mean) and torch.equal(p.running_var, q.running_var), step
            assert p.training == q.training, step
    frozen = b.c1.bn.running_mean.clone()
    b.eval().train()(torch.randn(4, 3, 8, 8))
    assert torch.equal(b.c1.bn.running_mean, frozen)  # frozen through every eval() / train()
    for fused in (Q.fuse_fx(copy.deepcopy(m)), Q.prepare_fx(copy.deepcopy(m).eval(), Q.get_minmax_qconfig(), ex)):
        assert not {"b1", "b2"} & {n for n, _ in fused.named_modules(remove_duplicate=False)}
    # a checkpoint saved before the fix (each BN under its old name too) still loads strictly, its BNs the fused ones
    old = {**b.state_dict(), **{"b1." + k[len("c1.bn."):]: v for k, v in b.state_dict().items() if k.startswith("c1.bn.")}}
    old["b1.running_mean"] = old["c1.bn.running_mean"] = torch.full((8,), 0.5)
    fresh = Q.prepare_qat_fx(copy.deepcopy(m), Q.get_default_qat_qconfig_mapping("x86", version), ex)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.c1.bn.running_mean, torch.full((8,), 0.5))


def _axis_qconfig(axis: int, qat: bool) -> Q.QConfig:
    if qat:
        return Q.QConfig(activation=Q.FakeQuantize.with_args(observer=Q.MovingAverageMinMaxObserver,
                                                             qscheme=per_tensor_affine, qdtype=quint8),
                         weight=Q.FakeQuantize.with_args(observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=axis,
                                                         qscheme=per_channel_symmetric, qdtype=qint8))
    return Q.QConfig(activation=Q.MinMaxObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8),
                     weight=Q.PerChannelMinMaxObserver.with_args(ch_axis=axis, qscheme=per_channel_symmetric,
                                                                 qdtype=qint8))


@pytest.mark.parametrize("axis", [1, -1])
def test_weight_grids_off_the_output_channel_axis_are_refused(axis):
    """A per-channel weight fake-quant along ch_axis 1 / -1 trained the whole QAT run on grids the int8 layer cannot
    keep; convert_fx then refused a non-square weight, and on a square one (4 in, 4 out) took the input-channel
    scales for the output channels: the converted model was off by ~3 on outputs of ~5, silently (PTQ alike).
    prepare_qat / prepare_qat_fx now refuse the qconfig naming the module; convert / convert_fx refuse the observer."""
    m = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 4)).train()
    ex = (torch.randn(2, 4, 5, 5),)
    with pytest.raises(ValueError, match=rf"prepare_qat_fx: module '0' \(ConvReLU2d\): .*ch_axis={axis}, .*one grid "
                                         r"per output channel, axis 0 of its weight of shape \(4, 4, 3, 3\)"):
        Q.prepare_qat_fx(copy.deepcopy(m), _axis_qconfig(axis, True), ex)
    with pytest.raises(ValueError, match=rf"prepare_qat: module 'module.0' .*ch_axis={axis}"):
        Q.prepare_qat(Q.QuantWrapper(copy.deepcopy(m)), _axis_qconfig(axis, True))
    torch.manual_seed(0)
    for layer, x in ((nn.Conv2d(4, 4, 3), torch.randn(2, 4, 5, 5)), (nn.Linear(4, 4), torch.randn(3, 4))):
        p = Q.prepare_fx(nn.Sequential(layer).eval(), _axis_qconfig(axis, False), (x,))
        p(x)
        with pytest.raises(ValueError, match=rf"convert_fx: module '0' .*ch_axis={axis}, but the quantized weight"):
            Q.convert_fx(p)
    # a transposed conv's output channels are its weight's axis 1: ch_axis=1 there is the same grid as 0
    x, outs = torch.randn(2, 4, 5, 5), []
    for ax in (0, 1):
        torch.manual_seed(0)
        p = Q.prepare_fx(nn.Sequential(nn.ConvTranspose2d(4, 4, 3)).eval(), _axis_qconfig(ax, False), (x,))
        p(x)
        outs.append(Q.convert_fx(p)(x))
    assert torch.equal(outs[0], outs[1])
