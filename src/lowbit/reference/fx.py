"""Graph-mode reference models: ``convert_to_reference_fx`` and their lowering to int8.

``convert_to_reference_fx(prepared)`` rewrites each calibrated graph of a ``prepare_fx`` /
``prepare_qat_fx`` model into float ops on explicit grids:

- every activation observer node becomes a pair of call_function nodes
  ``q = quantize_per_tensor(x, s, z, qmin, qmax, storage)`` → ``dequantize_per_tensor(q, s, z)``
  with the measured grid as literals (graph inputs of int regions included);
- a weight observer on the weight edge of ``F.linear``/``F.conv*`` becomes
  ``quantize_per_channel`` → ``dequantize_per_channel`` (scales / zero points as buffers ``<name>_scale``,
  ``<name>_zero_point``);
- weighted modules (``Linear``/``ConvNd``, fused, QAT, QAT conv-BN folded) and embeddings become
  ``lowbit.reference`` modules (weight quantize → dequantize inside, per call).

``model.code`` then reads as the int8 program in float, the form exporters and backends pattern
match (torch.ao's reference representation). ``lower_reference_fx(ref)`` (also reached through
``lower_reference`` and ``convert_fx``) turns the pairs back into ``FrozenObserver`` nodes and the
reference modules into float stand-ins with their recorded weight grids, then runs ``convert_fx``:
the lowered model equals ``convert_fx(prepared)`` code for code.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
>>> p = Q.prepare_fx(m, Q.QConfigMapping().set_global(Q.get_minmax_qconfig()), (torch.randn(2, 4),))
>>> _ = p(torch.randn(16, 4))
>>> from lowbit.reference import Linear
>>> ref = convert_to_reference_fx(p)
>>> "quantize_per_tensor" in ref.code, [n for n, c in ref.named_modules() if isinstance(c, Linear)]
(True, ['0.0'])
>>> q = lower_reference_fx(ref)
>>> torch.equal(q(torch.ones(1, 4)), Q.convert_fx(p)(torch.ones(1, 4)))
True
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from ..fx.convert import convert_fx
from ..fx.prepare import STATE_KEY, is_prepared
from ..fake_quant.base import holds_grid
from .convert import _frozen_weight_qconfig, _move_state, _weighted_reference
from .modules import FrozenObserver, QuantDeQuant, _WeightQDQ
from .ops import dequantize_per_channel, dequantize_per_tensor, quantize_per_channel, quantize_per_tensor

__all__ = ["convert_to_reference_fx", "lower_reference_fx", "is_reference_fx"]

_REF = "lowbit_ref"  # node meta: the observer a quantize/dequantize pair stands for (name, qscheme, qdtype, axis)


def _graphs(model: nn.Module) -> list[fx.GraphModule]:
    return [m for m in model.modules() if isinstance(m, fx.GraphModule) and STATE_KEY in m.meta]


def _top(model: nn.Module) -> dict[str, Any]:
    return model.meta[STATE_KEY] if isinstance(model, fx.GraphModule) else model.__dict__[STATE_KEY]


def is_reference_fx(model: Any) -> bool:
    """Whether ``model`` came from ``convert_to_reference_fx`` (and was not lowered yet)."""
    return is_prepared(model) and bool(_top(model).get("reference"))


def _set_module(gm: fx.GraphModule, path: str, mod: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, mod)


def _qdq_pair(gm: fx.GraphModule, node: fx.Node, obs: nn.Module) -> fx.Node:
    """Replace observer ``node`` (reading ``src``) by ``dequantize(quantize(src))`` on ``obs``'s grid."""
    src, graph = node.args[0], gm.graph
    scale, zero_point = obs.calculate_qparams()
    qdtype = obs.qdtype
    per_channel = scale.dim() == 1 and node.meta.get("lowbit_kind") == "obs_w"
    with graph.inserting_before(node):
        if per_channel:
            axis = getattr(obs, "ch_axis", 0)
            names = (f"{node.target}_scale", f"{node.target}_zero_point")
            gm.register_buffer(names[0], scale.detach().to(torch.float32).clone())
            gm.register_buffer(names[1], zero_point.detach().clone())
            s, z = graph.get_attr(names[0]), graph.get_attr(names[1])
            q = graph.call_function(quantize_per_channel,
                                    (src, s, z, axis, qdtype.quant_min, qdtype.quant_max, qdtype.storage))
            dq = graph.call_function(dequantize_per_channel, (q, s, z, axis))
            meta = (node.target, obs.qscheme, qdtype, axis)
        else:
            s_f, z_i = float(scale.reshape(())), int(zero_point.reshape(()))
            q = graph.call_function(quantize_per_tensor,
                                    (src, s_f, z_i, qdtype.quant_min, qdtype.quant_max, qdtype.storage))
            dq = graph.call_function(dequantize_per_tensor, (q, s_f, z_i))
            meta = (node.target, obs.qscheme, qdtype, None)
    q.meta.update(lowbit_kind="ref_quantize", lowbit_domain="other", lowbit_ftensor=False)
    dq.meta.update(node.meta)
    dq.meta[_REF] = meta
    node.replace_all_uses_with(dq)
    graph.erase_node(node)
    return dq


def convert_to_reference_fx(model: nn.Module, inplace: bool = False) -> nn.Module:
    """The reference form of a calibrated ``prepare_fx`` / ``prepare_qat_fx`` model (module docstring); eval mode."""
    if not is_prepared(model) or _top(model).get("converted") or _top(model).get("reference"):
        raise TypeError("convert_to_reference_fx: expects a calibrated model returned by prepare_fx or prepare_qat_fx "
                        f"(not converted yet), got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"convert_to_reference_fx: inplace must be a bool, got {inplace!r}")
    if not inplace:
        model = copy.deepcopy(model)
    for gm in _graphs(model):
        for node in list(gm.graph.nodes):
            kind = node.meta.get("lowbit_kind")
            if kind in ("obs_out", "obs_in", "obs_w"):
                obs = gm.get_submodule(node.target)
                if not holds_grid(obs):
                    raise RuntimeError(f"convert_to_reference_fx: the observer '{node.target}' after "
                                       f"'{node.args[0].name}' saw no data; run calibration batches first")
                _qdq_pair(gm, node, obs)
            elif kind in ("module", "wonly") and node.op == "call_module":
                mod = gm.get_submodule(node.target)
                if getattr(mod, "qconfig", None) is None or isinstance(mod, _WeightQDQ):
                    continue
                new = _weighted_reference(mod, node.target)
                if new is not None:
                    _set_module(gm, node.target, new)
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
        gm.meta[STATE_KEY] = {**gm.meta[STATE_KEY], "reference": True}
    _top(model)["reference"] = True
    return model.eval()


def lower_reference_fx(model: nn.Module, inplace: bool = False) -> nn.Module:
    """The int8 model of a ``convert_to_reference_fx`` model: equal to ``convert_fx`` of its prepared model."""
    if not is_reference_fx(model):
        raise TypeError(f"lower_reference_fx: expects a model returned by convert_to_reference_fx, got "
                        f"{type(model).__name__}")
    if not isinstance(inplace, bool):  # a truthy "no" rewrote the caller's model
        raise TypeError(f"lower_reference_fx: inplace must be a bool, got {inplace!r}")
    if not inplace:
        model = copy.deepcopy(model)
    for gm in _graphs(model):
        graph = gm.graph
        for dq in list(graph.nodes):
            if _REF not in dq.meta:
                continue
            name, qscheme, qdtype, axis = dq.meta[_REF]
            q = dq.args[0]
            src, s, z = q.args[0], q.args[1], q.args[2]
            if axis is None:
                obs = FrozenObserver(torch.tensor(s), torch.tensor(z), qscheme, qdtype)
            else:
                obs = FrozenObserver(gm.get_buffer(s.target), gm.get_buffer(z.target), qscheme, qdtype, axis)
            gm.add_submodule(name, obs)
            with graph.inserting_before(dq):
                new = graph.call_module(name, (src,))
            new.meta.update({k: v for k, v in dq.meta.items() if k != _REF})
            dq.replace_all_uses_with(new)
            graph.erase_node(dq)
            graph.erase_node(q)
            for attr in (s, z):
                if isinstance(attr, fx.Node) and not attr.users:
                    graph.erase_node(attr)
                    delattr(gm, attr.target)
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            mod = gm.get_submodule(node.target)
            if isinstance(mod, _WeightQDQ):
                stand = _move_state(mod, mod.to_float())  # type: ignore[attr-defined]
                stand.qconfig = _frozen_weight_qconfig(mod, getattr(mod, "qconfig", None))
                _set_module(gm, node.target, stand)
            elif isinstance(mod, nn.Sequential) and len(mod) and isinstance(mod[0], _WeightQDQ):
                mod.qconfig = _frozen_weight_qconfig(mod[0], getattr(mod, "qconfig", None))
                mod[0] = mod[0].to_float()
            elif isinstance(mod, QuantDeQuant):  # not produced here; kept for hand-edited graphs
                _set_module(gm, node.target, mod.as_observer())
        graph.lint()
        gm.recompile()
        gm.meta[STATE_KEY] = {k: v for k, v in gm.meta[STATE_KEY].items() if k != "reference"}
    _top(model).pop("reference", None)
    return convert_fx(model, inplace=True)
