"""``convert(use_precomputed_fake_quant=True)``: a QAT layer's weight grid as its ``weight_fake_quant`` holds it.

By default convert observes each weight once more (torch.ao too): after the last optimizer step the weight has moved
since its fake-quant last saw it, so a moving-average grid moves and a cumulative min/max grid widens. With the flag
the converted layer keeps the grid training used. torch.ao's eager ``convert`` is the oracle.
"""

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.qat as nnqat
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.nn.quantized import Embedding as QEmbedding
from lowbit.nn.quantized import linear as nnq_linear
from lowbit.nn.quantized.dynamic import Linear as DLinear


class Net(nn.Module):
    def __init__(self, ao: bool = False) -> None:
        super().__init__()
        stubs = (tq.QuantStub, tq.DeQuantStub) if ao else (Q.QuantStub, Q.DeQuantStub)
        self.quant, self.dequant = stubs[0](), stubs[1]()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()
        self.fc1, self.fc2 = nn.Linear(6 * 8 * 8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc2(F.relu(self.fc1(x.flatten(1)))))


def _trained(qconfig: Q.QConfig, steps: int = 3) -> nn.Module:
    """A QAT model after ``steps`` SGD steps: its weights moved after their fake-quants last saw them."""
    torch.manual_seed(0)
    net = Q.fuse_modules_qat(Net().train(), [["conv", "bn", "relu"]])
    qat = Q.prepare_qat(net, qconfig)
    opt = torch.optim.SGD(qat.parameters(), lr=0.5)
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,))
    for _ in range(steps):
        loss = F.cross_entropy(qat(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return qat.eval()


def _fq_scale(fq: nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The fake-quant's scale as it stands, or (``weight``) after one more observation on a copy."""
    fq = copy.deepcopy(fq)
    if weight is not None:
        with torch.no_grad():
            fq(weight.detach())
    return fq.calculate_qparams()[0].float()


@pytest.mark.parametrize("backend", [None, "x86"])
def test_precomputed_keeps_the_fake_quant_grid_and_the_default_observes_again(backend):
    """lowbit's recipe (cumulative min/max weights) and torch.ao's x86 recipe (moving average): with the flag every
    layer's scale is its fake-quant's, conv-BN folded included; without it, that of one more observation."""
    qat = _trained(Q.get_default_qat_qconfig(backend))
    layers = {"conv": qat.conv, "fc1": qat.fc1, "fc2": qat.fc2}
    folded = {"conv": qat.conv.fold().weight}  # what the conv-BN's fake-quant sees: the BN-folded weight
    held = {n: _fq_scale(m.weight_fake_quant) for n, m in layers.items()}
    again = {n: _fq_scale(m.weight_fake_quant, folded.get(n, m.weight)) for n, m in layers.items()}
    pre = Q.convert(qat, use_precomputed_fake_quant=True)
    default = Q.convert(qat)
    for n in layers:
        torch.testing.assert_close(getattr(pre, n).weight_scale, held[n], rtol=0, atol=0)
        torch.testing.assert_close(getattr(default, n).weight_scale, again[n], rtol=0, atol=0)
    ref = Q.convert(qat, is_reference=True, use_precomputed_fake_quant=True)  # the reference model's grids too
    for n in ("fc1", "fc2"):
        torch.testing.assert_close(getattr(ref, n).weight_scale.float(), held[n], rtol=0, atol=0)
    # the steps moved the weights: the two conversions differ (else this test could not tell them apart)
    assert any(not torch.equal(held[n], again[n]) for n in layers)
    assert type(pre.fc1) is nnq_linear.Linear and qat.training is False
    x = torch.randn(4, 3, 8, 8)
    assert pre(x).shape == default(x).shape == (4, 4)


@pytest.mark.parametrize("flag", [True, False])
def test_weight_scales_match_torch_ao_with_and_without_precomputed(flag):
    """Same weights, same x86 QAT recipe on ``FakeQuantize`` (``version=0``), one observed forward then a weight
    update: the converted weight scales and codes are torch.ao's (its ``convert(use_precomputed_fake_quant=...)``).
    (On the fused module, ``version=1``, torch.ao converts with its observer's ``max / 127.5`` grid while training ran
    on the fused kernel's; lowbit's fused module converts with the grid training used.)"""
    torch.manual_seed(1)
    lin = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 5))

    def build(ao: bool) -> nn.Module:
        m = nn.Sequential(tq.QuantStub() if ao else Q.QuantStub(), copy.deepcopy(lin),
                          tq.DeQuantStub() if ao else Q.DeQuantStub()).train()
        if ao:
            m.qconfig = tq.get_default_qat_qconfig("x86", version=0)
            return tq.prepare_qat(m)
        return Q.prepare_qat(m, Q.get_default_qat_qconfig("x86", version=0))

    ours, theirs = build(False), build(True)
    x = torch.randn(16, 12)
    ours(x), theirs(x)
    with torch.no_grad():  # an optimizer step after the last observation, the same on both sides
        for m in (ours, theirs):
            for i in (0, 2):
                m[1][i].weight.mul_(1.25).add_(0.03)
    ours.eval(), theirs.eval()
    q_ours = Q.convert(ours, use_precomputed_fake_quant=flag)
    q_theirs = tq.convert(theirs, use_precomputed_fake_quant=flag)
    for i in (0, 2):
        want = q_theirs[1][i].weight().q_per_channel_scales().float()
        torch.testing.assert_close(q_ours[1][i].weight_scale, want, rtol=1e-6, atol=0)
        assert torch.equal(q_ours[1][i].weight().int_repr(), q_theirs[1][i].weight().int_repr())


def test_from_float_takes_the_flag_as_torch_ao_does():
    """Module ``from_float(mod, use_precomputed_fake_quant=True)``: static, dynamic and embedding layers."""
    torch.manual_seed(2)
    qc = Q.get_default_qat_qconfig("x86")
    fc = nnqat.Linear.from_float(_qc(nn.Linear(6, 3), qc))
    fc(torch.randn(4, 6))
    fc.activation_post_process = qc.activation()
    fc.activation_post_process(torch.randn(4, 3))
    held = _fq_scale(fc.weight_fake_quant)
    with torch.no_grad():
        fc.weight.mul_(2.0)
    assert torch.equal(nnq_linear.Linear.from_float(fc, use_precomputed_fake_quant=True).weight_scale, held)
    assert not torch.equal(nnq_linear.Linear.from_float(copy.deepcopy(fc)).weight_scale, held)
    assert torch.equal(DLinear.from_float(fc, use_precomputed_fake_quant=True).weight().q_per_channel_scales().float(),
                       held)
    emb = nnqat.Embedding.from_float(_qc(nn.Embedding(10, 4), Q.get_embedding_qconfig()))
    emb(torch.arange(10))
    rows = _fq_scale(emb.weight_fake_quant)
    with torch.no_grad():
        emb.weight.mul_(3.0)
    assert torch.equal(QEmbedding.from_float(emb, use_precomputed_fake_quant=True).weight().q_per_channel_scales(),
                       rows)


def _qc(m: nn.Module, qc: Q.QConfig) -> nn.Module:
    m.qconfig = qc
    return m


def test_precomputed_bad_inputs():
    qat = _trained(Q.get_default_qat_qconfig(), steps=1)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=f"use_precomputed_fake_quant must be a bool, got {bad!r}"):
            Q.convert(qat, use_precomputed_fake_quant=bad)
        with pytest.raises(TypeError, match="Linear.from_float: use_precomputed_fake_quant must be a bool"):
            nnq_linear.Linear.from_float(qat.fc1, use_precomputed_fake_quant=bad)
    # a fake-quant that never saw a weight holds no grid: torch.ao would quantize with scale 1, lowbit names it
    fresh = nnqat.Linear.from_float(_qc(nn.Linear(4, 2), Q.get_default_qat_qconfig()))
    fresh.activation_post_process = copy.deepcopy(qat.fc1.activation_post_process)
    with pytest.raises(ValueError, match=r"weight_fake_quant of Linear \(FakeQuantize\) has seen no weight"):
        nnq_linear.Linear.from_float(fresh, use_precomputed_fake_quant=True)
    # a post-training model has no fake-quant grid: observed as usual, with a warning that the flag did nothing
    ptq = Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(4, 3), Q.DeQuantStub()), Q.get_minmax_qconfig())
    ptq(torch.randn(8, 4))
    with pytest.warns(UserWarning, match="no converted layer has a weight_fake_quant"):
        a = Q.convert(ptq, use_precomputed_fake_quant=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = Q.convert(ptq)
    assert torch.equal(a[1].weight_int8, b[1].weight_int8) and torch.equal(a[1].weight_scale, b[1].weight_scale)
