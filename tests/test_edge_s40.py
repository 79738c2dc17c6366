"""Edge gaps of session 40: meta checkpoints into quantized models, DDP's ignore list at prepare / convert, ONNX
export of per-channel QTensors through averages and bilinear upsampling."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit.qtensor import QTensor
from lowbit.qtensor.factories import quantize_per_channel, quantize_per_tensor

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


# ---- 1. ONNX: per-channel QTensors through averages and bilinear upsampling ---------------------------------------

S = torch.tensor([0.01, 0.05, 0.1, 0.3])
Z = torch.tensor([3, 128, 100, 7])
OPS = {"avg_pool2d": lambda x: F.avg_pool2d(x, 2), "avg_pool2d_ceil": lambda x: F.avg_pool2d(x, 3, 2, 1, True),
       "adaptive": lambda x: F.adaptive_avg_pool2d(x, 2), "global": lambda x: F.adaptive_avg_pool2d(x, 1),
       "mean": lambda x: torch.mean(x, (2, 3)), "mean_keep": lambda x: x.mean(2, keepdim=True),
       "bilinear": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
       "bilinear_ac": lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear", align_corners=True)}


class Mixed(nn.Module):
    """A user's per-channel QTensor (``quantize_per_channel`` in forward, axis 1) through ``op``, then the converted
    model's per-tensor QTensor through ``op`` (straight from its Quantize: a conv before it would add the conv twin's
    float accumulation, one step off on a few codes): the second call's record must still line up."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.quant, self.dequant = op, Q.QuantStub(), Q.DeQuantStub()

    def forward(self, x):
        pc = self.op(quantize_per_channel(x, S, Z, 1, Q.quint8))
        return pc.int_repr(), self.dequant(self.op(self.quant(x)))


@pytest.mark.parametrize("name", list(OPS))
def test_onnx_per_channel_qtensor_average_and_bilinear_every_code(name, tmp_path):
    """lowbit's int8 model runs these ops on a per-channel QTensor's codes (axis not among the averaged / resampled
    dims: each channel's zero point, no float fallback); the export traces that same QTensor op (the twin keeps the
    user's QTensor), so ORT gives every code, for both the per-channel and the per-tensor call of one model."""
    pytest.importorskip("onnxruntime")
    from lowbit.export import run_onnx, to_onnx
    torch.manual_seed(0)
    m = Mixed(OPS[name])
    m.qconfig = Q.get_default_qconfig()
    x = torch.randn(16, 4, 8, 8) * (S * 40).view(1, 4, 1, 1)
    p = Q.prepare(m)
    p(x)
    c = Q.convert(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float fallback warning from the QTensor op
        pc = OPS[name](quantize_per_channel(x, S, Z, 1, Q.quint8))
    assert isinstance(pc, QTensor) and pc.q_per_channel_axis() == 1
    codes, y = c(x)
    path = tmp_path / "m.onnx"
    to_onnx(c, x, path)
    got_codes, got_y = run_onnx(path, x)
    s, z = float(c.quant.scale), int(c.quant.zero_point)
    assert torch.equal(got_codes.to(torch.int64), codes.to(torch.int64))
    assert torch.equal(torch.round(got_y / s) + z, torch.round(y / s) + z)
