"""QAT and prepared models under PyTorch 2: ``torch.compile(fullgraph=True)`` training steps, ``torch.export`` of the
inference model, and a meta-device forward, for every fake-quant variant (session 40).

Before: ``FakeQuantize.forward`` branched on its ``observer_enabled`` / ``fake_quant_enabled`` buffers (a data-dependent
branch: a graph break, an export error, ``Tensor.item() cannot be called on meta tensors``), the observers' NaN check
and the grid-overflow check read tensors into Python, the prepare hooks called ``is_inference()`` (untraceable) and the
small-tensor path used torch's fused kernel (no fake implementation with an int32 zero point).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.fake_quant import (
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FusedMovingAvgObsFakeQuantize,
    LearnableFakeQuantize,
    disable_fake_quant,
    disable_observer,
    enable_observer,
)
from lowbit.fuse import fuse_modules_qat
from lowbit.nn.intrinsic.qat import freeze_bn_stats
from lowbit.qconfig import get_default_qat_qconfig
from lowbit.stubs import DeQuantStub, QuantStub
from lowbit.workflow import prepare, prepare_qat

torch._dynamo.config.cache_size_limit = 64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4, 3)
        self.dequant = DeQuantStub()

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc(x.mean((2, 3))))


QCONFIGS = {
    "fake_quantize": lambda: get_default_qat_qconfig(),
    "fused": lambda: get_default_qat_qconfig("x86"),          # FusedMovingAvgObsFakeQuantize
    "learnable": lambda: Q.get_lsq_qat_qconfig(),              # LearnableFakeQuantize
}


def _qat(kind, fuse=True):
    torch.manual_seed(0)
    net = Net()
    if fuse:
        net = fuse_modules_qat(net, [["conv", "bn", "relu"]])
    return prepare_qat(net, QCONFIGS[kind]())


def _x(seed=1):
    return torch.randn(8, 1, 6, 6, generator=torch.Generator().manual_seed(seed))


def _step(model, x):
    loss = F.mse_loss(model(x), torch.ones(x.shape[0], 3))
    loss.backward()
    return loss.detach()


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("kind", sorted(QCONFIGS))
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "convbn_frozen"])
def test_compiled_qat_step_equals_eager(kind, fuse):
    """Forward + backward of a compiled (fullgraph) QAT model, observers on then off: loss, gradients and every
    buffer (observer statistics, scales, zero points, BN statistics) equal eager's, bit for bit."""
    torch._dynamo.reset()
    model = _qat(kind, fuse)
    model(_x(0))  # sizes the per-channel grids (the first batch, eager)
    if fuse:
        model.apply(freeze_bn_stats)  # (live BN statistics hit a torch bug: see test_compiled_convbn_live_bn_note)
    eager, traced = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(traced, fullgraph=True, backend="aot_eager")
    for step in range(4):
        if step == 2:
            eager.apply(disable_observer)
            traced.apply(disable_observer)
        x = _x(step + 1)
        la, lb = _step(eager, x), _step(compiled, x)
        assert torch.equal(la, lb), step
        for (name, p), q in zip(eager.named_parameters(), traced.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
        _same_state(eager, traced)


@pytest.mark.parametrize("kind", sorted(QCONFIGS))
def test_export_eval_qat_model_equals_eager(kind):
    model = _qat(kind)
    for i in range(3):
        _step(model, _x(i))
    model.eval()
    model.apply(disable_observer)
    ep = torch.export.export(model, (_x(5),))
    for seed in (5, 6):
        assert torch.equal(ep.module()(_x(seed)), model(_x(seed)))


def test_export_prepared_model_after_calibration():
    """A QAT-prepared model calibrated with fake quantization off (observers only), then frozen: exports and
    equals eager; a PTQ-prepared model with min/max observers (they record while it runs) exports too."""
    model = _qat("fake_quantize")
    model.apply(disable_fake_quant)
    for i in range(3):
        model(_x(i))
    model.apply(Q.enable_fake_quant)
    model.apply(disable_observer)
    model.eval()
    ep = torch.export.export(model, (_x(7),))
    assert torch.equal(ep.module()(_x(7)), model(_x(7)))
    torch.manual_seed(0)
    ptq = prepare(Net().eval(), Q.get_minmax_qconfig())  # (histogram observers read values into Python)
    ptq(_x(0))
    ep = torch.export.export(ptq, (_x(8),))
    assert torch.equal(ep.module()(_x(8)), ptq(_x(8)))


@pytest.mark.parametrize("kind", sorted(QCONFIGS))
def test_meta_forward_shapes(kind):
    model = _qat(kind)
    model(_x(0))
    meta = copy.deepcopy(model).to("meta")
    y = meta(torch.empty(5, 1, 6, 6, device="meta"))
    assert y.shape == (5, 3) and y.is_meta
    fresh = _qat(kind).to("meta")  # never run: the per-channel grids keep their scalar seed
    if kind == "learnable":  # its per-channel parameters get their channels from an observed batch, never from meta
        with pytest.raises(ValueError, match="per-channel scale/zero_point have no channels yet"):
            fresh(torch.empty(2, 1, 6, 6, device="meta"))
    else:
        assert fresh(torch.empty(2, 1, 6, 6, device="meta")).shape == (2, 3)


@pytest.mark.parametrize("make", [
    lambda: FakeQuantize(),
    lambda: FakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0),
    lambda: FusedMovingAvgObsFakeQuantize(),
    lambda: LearnableFakeQuantize(qdtype=Q.quint8),
    lambda: FixedQParamsFakeQuantize(Q.FixedQParamsObserver.with_args(scale=1.0 / 256, zero_point=0)),
], ids=["fq", "fq_per_channel", "fused", "learnable", "fixed"])
def test_fake_quant_modules_compile_export_meta(make):
    fq = make()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)) * 3
    fq(x)
    # meta: shapes only, no values observed
    m = copy.deepcopy(fq).to("meta")
    assert m(torch.empty(4, 3, device="meta")).shape == (4, 3)
    assert "scale=<meta>" in repr(m) and "observer_enabled=1" in repr(m).replace("static_enabled", "observer_enabled")
    # compile (observers on, then off), fullgraph
    torch._dynamo.reset()
    a, b = copy.deepcopy(fq), copy.deepcopy(fq)
    cb = torch.compile(b, fullgraph=True, backend="aot_eager")
    for step in range(3):
        if step == 2:
            a.disable_observer()
            b.disable_observer()
        xi = (torch.randn(4, 3, generator=torch.Generator().manual_seed(step + 1)) * 3).requires_grad_()
        xj = xi.detach().clone().requires_grad_()
        ya, yb = a(xi), cb(xj)
        assert torch.equal(ya, yb)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(xi.grad, xj.grad)
        _same_state(a, b)
    # export with the observer off
    ep = torch.export.export(a.eval(), (x,))
    assert torch.equal(ep.module()(x), a(x))


def test_switch_mirror_follows_buffers_and_state_dict():
    """The Python mirror the traced forward reads follows the switch methods, ``load_state_dict`` and writes in
    place seen by an eager forward; the state dict keeps torch.ao's keys and values."""
    import torch.ao.quantization as tq

    fq = FakeQuantize()
    ref = tq.FakeQuantize()
    assert set(fq.state_dict()) == set(ref.state_dict())  # the switches stay buffers, as torch.ao's
    for m in (fq, ref):
        m(torch.tensor([-1.0, 2.0]))
        m.disable_observer()
    for name in ("observer_enabled", "fake_quant_enabled"):
        assert torch.equal(fq.state_dict()[name], ref.state_dict()[name])
    assert fq._switch_mirror["observer_enabled"] is False and int(fq.observer_enabled[0]) == 0
    other = FakeQuantize()
    other.load_state_dict(fq.state_dict())
    assert other._switch_mirror["observer_enabled"] is False
    other.observer_enabled[0] = 1  # in place: the next eager forward reads the buffer and refreshes the mirror
    other(torch.tensor([0.5]))
    assert other._switch_mirror["observer_enabled"] is True
    model = _qat("learnable")
    model.apply(disable_observer)
    model.apply(enable_observer)
    fqs = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    assert fqs and all(m._switch_mirror["observer_enabled"] for m in fqs)
    assert all(m._switch_mirror["learning_enabled"] is False for m in fqs)


def test_prepare_qat_fx_model_compiles_exports_and_runs_on_meta():
    """A graph-mode QAT model (prepare_qat_fx, Conv + BN + ReLU folded, BN statistics frozen): compiled steps equal
    eager's (observers on, then off), the eval model exports and equals eager, the meta forward gives shapes."""
    from lowbit.fx.prepare import prepare_qat_fx

    class G(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = prepare_qat_fx(G().train(), Q.get_default_qat_qconfig_mapping(), (_x(0),))
    model(_x(0))
    model.apply(freeze_bn_stats)
    eager, traced = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(traced, fullgraph=True, backend="aot_eager")
    for step in range(3):
        if step == 2:
            eager.apply(disable_observer)
            traced.apply(disable_observer)
        assert torch.equal(_step(eager, _x(step + 1)), _step(compiled, _x(step + 1)))
        for p, q in zip(eager.parameters(), traced.parameters()):
            assert torch.equal(p.grad, q.grad)
        _same_state(eager, traced)
    eager.eval()
    ep = torch.export.export(eager, (_x(4),))
    assert torch.equal(ep.module()(_x(4)), eager(_x(4)))
    assert copy.deepcopy(eager).to("meta")(torch.empty(3, 1, 6, 6, device="meta")).shape == (3, 3)
