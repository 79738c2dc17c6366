"""Session 36, fake-quant sweep: FakeQuantize / fused / learnable (LSQ) / fixed against torch.ao as the oracle.

Each test failed before its fix (the compiled fused training step, torch.ao LSQ checkpoints, a learning-phase
LSQ checkpoint loaded into a fresh module, an empty first batch on an unsized per-channel LSQ module).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.ao.quantization import FakeQuantize as AoFakeQuantize
from torch.ao.quantization import MovingAverageMinMaxObserver as AoMovingAverageMinMaxObserver
from torch.ao.quantization import MovingAveragePerChannelMinMaxObserver as AoPerChannelObserver
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize as AoLearnable

import lowbit as Q


def _qat_mlp(qconfig: Q.QConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).train()
    m.qconfig = qconfig
    return Q.prepare_qat(m)


@pytest.mark.parametrize("qconfig", [Q.get_fused_qat_qconfig, lambda: Q.get_default_qat_qconfig("x86")],
                         ids=["fused", "x86"])
def test_fused_fake_quant_trains_under_torch_compile(qconfig) -> None:
    # before: torch's fused kernel was traced with lowbit's int64 zero point and failed ("Zero-point must be
    # Int32, Float or Half, found Long"); now the traced step takes the composite, same numbers as eager
    eager = _qat_mlp(qconfig())
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="eager")
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.01)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            if step == 2:
                eager.apply(Q.disable_observer)
                model.apply(Q.disable_observer)
            x = torch.randn(16, 8)
            loss_e, loss_c = eager(x).pow(2).sum(), compiled(x).pow(2).sum()
            opt_e.zero_grad()
            opt_c.zero_grad()
            loss_e.backward()
            loss_c.backward()
            opt_e.step()
            opt_c.step()
            assert torch.equal(loss_e, loss_c)
    for key, value in eager.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


def _ao_learnable(per_channel: bool) -> AoLearnable:
    if per_channel:
        return AoLearnable(AoPerChannelObserver, quant_min=0, quant_max=255, ch_axis=0, channel_len=4,
                           qscheme=torch.per_channel_affine)
    return AoLearnable(AoMovingAverageMinMaxObserver, quant_min=0, quant_max=255)


def _lowbit_learnable(per_channel: bool) -> Q.LearnableFakeQuantize:
    if per_channel:
        return Q.LearnableFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0, qscheme="per_channel_affine",
                                       qdtype=Q.quint8)
    return Q.LearnableFakeQuantize(qdtype=Q.quint8)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_learnable_loads_torch_ao_checkpoint(per_channel: bool) -> None:
    # before: "Unexpected key(s) in state_dict: static_enabled, eps"
    torch.manual_seed(0)
    x = torch.randn(4, 5) * 2
    ao = _ao_learnable(per_channel)
    ao(x)
    ao.toggle_observer_update(False)
    mine = _lowbit_learnable(per_channel)
    mine.load_state_dict(ao.state_dict())
    assert int(mine.observer_enabled[0]) == 0                       # torch.ao's static_enabled
    assert mine.scale.shape == ((4,) if per_channel else ())        # torch.ao's per-tensor (1,) made 0-d
    assert torch.equal(mine(x), ao(x))
    s, z = mine.calculate_qparams()
    assert torch.equal(s, ao.scale.detach().reshape(s.shape))


def test_learnable_refuses_bad_torch_ao_eps() -> None:
    ao = _ao_learnable(False)
    ao(torch.randn(10))
    state = ao.state_dict()
    state["eps"] = torch.tensor([float("nan")])
    mine = _lowbit_learnable(False)
    with pytest.raises(RuntimeError, match="eps: expected one positive finite"):
        mine.load_state_dict(state)


def test_fake_quantize_loads_torch_ao_per_tensor_grid_as_0d() -> None:
    # before: a torch.ao checkpoint left a per-tensor FakeQuantize with (1,) scale / zero_point (lowbit's are 0-d)
    ao = AoFakeQuantize()
    ao(torch.randn(20))
    mine = Q.FakeQuantize()
    mine.load_state_dict(ao.state_dict())
    assert mine.scale.shape == () and mine.zero_point.shape == ()
    assert mine.scale.item() == ao.scale.item() and mine.zero_point.item() == ao.zero_point.item()


def test_learning_phase_checkpoint_keeps_learning() -> None:
    # before: learning_enabled=1 was loaded but scale / zero_point stayed requires_grad=False: no gradient,
    # the optimizer never moved them (torch.ao's parameters always require grad)
    torch.manual_seed(0)
    src = Q.LearnableFakeQuantize(qdtype=Q.quint8)
    src(torch.randn(20))
    src.enable_param_learning()
    dst = Q.LearnableFakeQuantize(qdtype=Q.quint8)
    dst.load_state_dict(src.state_dict())
    assert int(dst.learning_enabled[0]) == 1
    assert dst.scale.requires_grad and dst.zero_point.requires_grad
    x = torch.randn(30) * 5
    src(x).sum().backward()
    dst(x).sum().backward()
    assert dst.scale.grad is not None and torch.equal(dst.scale.grad, src.scale.grad)
    assert torch.equal(dst.zero_point.grad, src.zero_point.grad)
    # and the other way: a static checkpoint loaded into a learning module stops its learning
    static = Q.LearnableFakeQuantize(qdtype=Q.quint8)
    static(torch.randn(20))
    src.load_state_dict(static.state_dict())
    assert int(src.learning_enabled[0]) == 0 and not src.scale.requires_grad


def test_learnable_per_channel_empty_first_batch() -> None:
    # before: an empty first batch raised "its per-channel scale/zero_point have no channels yet" (FakeQuantize
    # and the fused module return the empty tensor); the next batch sizes the parameters
    fq = Q.LearnableFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=1)
    y = fq(torch.empty(0, 3))
    assert y.shape == (0, 3)
    fq(torch.randn(2, 3))
    assert fq.scale.shape == (3,)
