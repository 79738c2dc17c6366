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
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)


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
def test_frozen_bn_stays_frozen_across_eval_train_and_bn_kept_once(version):
    """prepare_qat_fx / prepare_fx / fuse_fx left each fused-away BN (and ReLU) attached under its old name too: the
    usual epoch loop `model.eval()` ... `model.train()` after `freeze_bn_stats` put the BN back in training mode
    through that alias, so its running statistics kept updating silently (torch.ao: frozen), and state_dict carried
    every BN twice (`b1.*` and `c1.bn.*`)."""
    torch.backends.quantized.engine = "x86"
    torch.manual_seed(0)
    m, ex = _Net().train(), (torch.randn(4, 3, 8, 8),)
    a = ao_prepare_qat_fx(copy.deepcopy(m), tq.get_default_qat_qconfig_mapping("x86", version), ex)
    b = Q.prepare_qat_fx(copy.deepcopy(m), Q.get_default_qat_qconfig_mapping("x86", version), ex)
    conv_layout = {"c1.conv.weight": "c1.weight", "c1.conv.bias": "c1.bias", "c2.conv.weight": "c2.weight",
                   "c2.conv.bias": "c2.bias"}  # (lowbit's ConvBn keeps its conv as a child: another layout)
    assert sorted(conv_layout.get(k, k) for k in b.state_dict()) == sorted(a.state_dict())
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
            for y, opt in ((ya, oa), (yb, ob)):
                y.square().mean().backward()
                opt.step()
                opt.zero_grad()
        for p, q in zip(_bns(a), _bns(b), strict=True):
            assert torch.equal(p.running_mean, q.running_mean) and torch.equal(p.running_var, q.running_var), step
            assert p.training == q.training, step
    frozen = b.c1.bn.running_mean.clone()
    b.eval().train()(torch.randn(4, 3, 8, 8))
    assert torch.equal(b.c1.bn.running_mean, frozen)  # frozen through every eval() / train()
    for fused in (Q.fuse_fx(copy.deepcopy(m)), Q.prepare_fx(copy.deepcopy(m).eval(), Q.get_minmax_qconfig(), ex)):
        assert not {"b1", "b2"} & {n for n, _ in fused.named_modules(remove_duplicate=False)}
