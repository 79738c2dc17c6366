"""Edge gaps of session 40: meta checkpoints into quantized models, DDP's ignore list at prepare / convert, ONNX
export of per-channel QTensors through averages and bilinear upsampling."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit.qtensor.factories import quantize_per_tensor

IGNORE = "_ddp_params_and_buffers_to_ignore"


def on_meta(sd: dict) -> dict:
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def net() -> nn.Module:
    torch.manual_seed(0)
    return Q.QuantWrapper(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5)))


def converted() -> nn.Module:
    p = Q.prepare(net(), Q.get_default_qconfig())
    p(torch.randn(8, 3, 6, 6))
    return Q.convert(p)


# ---- 2. meta checkpoints -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["converted", "prepared", "qat", "dynamic", "embedding"])
def test_meta_state_dict_loads_with_assign(kind):
    """Before: ``Tensor.item() cannot be called on meta tensors`` from the value checks (state_check, observer eps,
    the weighted modules' input grid)."""
    if kind == "converted":
        m = converted()
    elif kind == "prepared":
        m = Q.prepare(net(), Q.get_default_qconfig())
        m(torch.randn(4, 3, 6, 6))
    elif kind == "qat":
        m = Q.prepare_qat(net().train(), Q.get_default_qat_qconfig())
        m(torch.randn(4, 3, 6, 6))
    elif kind == "dynamic":
        m = Q.quantize_dynamic(nn.Sequential(nn.Linear(4, 4)))
    else:
        m = nn.Sequential(nnq.Embedding(10, 4))
    real = m.state_dict()
    m.load_state_dict(on_meta(real), assign=True)
    assert all(v.is_meta for v in m.state_dict().values() if isinstance(v, torch.Tensor))


def test_meta_values_assigned_refuse_forward_then_reload_real():
    m = converted()
    x = torch.randn(2, 3, 6, 6)
    ref, sd = m(x), m.state_dict()
    m.load_state_dict(on_meta(sd), assign=True)
    with pytest.raises(RuntimeError, match="meta device"):
        m(x)
    m.to_empty(device="cpu").load_state_dict(sd)
    assert torch.equal(m(x), ref)


def test_meta_state_dict_into_real_model_names_the_key():
    """Without assign torch copies: a meta value has no data, torch's error names the key (no item() from lowbit)."""
    m = converted()
    with pytest.raises(RuntimeError, match='named "quant.scale".*Cannot copy out of meta tensor'):
        m.load_state_dict(on_meta(m.state_dict()))


def test_meta_checkpoint_still_checks_shapes():
    m = converted()
    sd = on_meta(m.state_dict())
    key = next(k for k in sd if k.endswith("weight_scale"))
    sd[key] = torch.empty(7, device="meta")
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}"):
        m.load_state_dict(sd, assign=True)


@pytest.mark.parametrize("index, cls, args, shape", [(3, nnq.Linear, (64, 5), (3, 64)),
                                                     (0, nnq.Conv2d, (3, 4, 3), (2, 3, 6, 6))])
def test_meta_construction_to_empty_load_real(index, cls, args, shape):
    """``with torch.device("meta")`` construction of an int8 layer, ``to_empty``, then a real checkpoint: the same
    layer as the converted one (codes, grids, outputs)."""
    real = converted().module[index]
    assert type(real) is cls
    with torch.device("meta"):
        empty = cls(*args)
    empty = empty.to_empty(device="cpu")
    empty.load_state_dict(real.state_dict())
    x = quantize_per_tensor(torch.randn(*shape), 0.05, 128, torch.quint8)
    assert torch.equal(empty(x).int_repr(), real(x).int_repr())


# ---- 3. DDP's ignore list -----------------------------------------------------------------------------------------

def test_ignore_list_str_is_one_name():
    """Before: ``"module.0.weight"`` became ``['m', 'o', 'd', 'u', 'l', ...]`` (list() of the str)."""
    m = Q.QuantWrapper(nn.Sequential(nn.Linear(4, 4)))
    m._ddp_params_and_buffers_to_ignore = "module.0.weight"
    p = Q.prepare(m, Q.get_default_qconfig())
    names = getattr(p, IGNORE)
    assert names[0] == "module.0.weight" and all(len(n) > 1 for n in names)


def test_ignore_list_not_names_refused():
    m = Q.QuantWrapper(nn.Sequential(nn.Linear(4, 4)))
    m._ddp_params_and_buffers_to_ignore = 3
    with pytest.raises(TypeError, match="_ddp_params_and_buffers_to_ignore must be a str or an iterable of str.*3"):
        Q.prepare(m, Q.get_default_qconfig())


def test_convert_drops_removed_observer_buffers_keeps_user_names():
    """Before: 32 of the 33 names were buffers convert had removed (the observers')."""
    m = Q.QuantWrapper(nn.Sequential(nn.Linear(4, 4)))
    m._ddp_params_and_buffers_to_ignore = ["module.0.bias", "not.a.buffer"]
    p = Q.prepare(m, Q.get_default_qconfig())
    assert len(getattr(p, IGNORE)) > 2
    p(torch.randn(8, 4))
    c = Q.convert(p)
    assert getattr(c, IGNORE) == ["module.0.bias", "not.a.buffer"]


def test_convert_fx_drops_removed_observer_buffers():
    f = nn.Sequential(nn.Linear(4, 4))
    p = Q.prepare_fx(f, Q.get_default_qconfig_mapping(), (torch.randn(2, 4),))
    added = list(getattr(p, IGNORE))
    assert added
    getattr(p, IGNORE).append("0.bias")  # a user's own name, set on the prepared model
    p(torch.randn(8, 4))
    c = Q.convert_fx(p)
    alive = {n for n, _ in c.named_buffers()} | {n for n, _ in c.named_parameters()}
    assert getattr(c, IGNORE) == ["0.bias"] and not set(added) & alive
