"""Graph-mode reference models: ``convert_to_reference_fx`` and their lowering to int8.

``convert_to_reference_fx(prepared)`` rewrites each calibrated graph of a ``prepare_fx`` /
``prepare_qat_fx`` model into float ops on explicit grids:

- every activation observer node becomes a pair of call_function nodes
  ``q = quantize_per_tensor(x, s, z, qmin, qmax, storage)`` → ``dequantize_per_tensor(q, s, z)``
  (graph inputs of int regions included);
- a weight observer on the weight edge of ``F.linear``/``F.conv*`` becomes
  ``quantize_per_channel`` → ``dequantize_per_channel``;
- a bilinear upsample of an int value (its output on its input's grid) is followed by
  ``bilinear_per_tensor(x, dq, s, z, qmin, qmax, size, ...)``: the int8 kernel's codes of ``x`` on that grid, not the
  rounded float op (one step apart at the kernel's near-ties); lowering drops it (the QTensor op runs the kernel);
- weighted modules (``Linear``/``ConvNd``, fused, QAT, QAT conv-BN folded) and embeddings become
  ``lowbit.reference`` modules (weight quantize → dequantize inside, per call).

Each grid ``(s, z)`` is a pair of root buffers (float32 scale, int64 zero point: 0-d, or ``(C,)`` per
channel) read by ``get_attr`` nodes, named as torch.ao's ``convert_to_reference_fx`` names them:
``<scope>_scale_<i>`` / ``<scope>_zero_point_<i>`` for the output of the node at module path ``scope``
(dots as ``_``; ``_scale_0`` at the top level), ``<scope>_input_scale_<i>`` for an input observer (the scope of
its first user, an ``F.linear`` preferred). So ``state_dict`` carries every grid: loading it into a freshly
converted reference model (another calibration) gives the same outputs, and lowering reads the loaded grids.

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
import torch.nn.functional as F
from torch import fx, nn

from ..fx.convert import convert_fx
from ..fx.custom import preserved_value
from ..fx.prepare import STATE_KEY, is_prepared
from ..fake_quant.base import holds_grid
from ..fx.classify import drop_grid_blends
from ..observer.ddp import drop_removed
from ..nn.quantized.stubs import region_dtype
from ..observer.distributed import sync_pending
from .convert import _frozen_weight_qconfig, _move_state, _weighted_reference
from .modules import FrozenObserver, QuantDeQuant, _WeightQDQ
from .ops import (bilinear_per_tensor, check_grid_dtype, dequantize_per_channel, dequantize_per_tensor,
                  quantize_per_channel, quantize_per_tensor)

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


def _grid_prefix(node: fx.Node) -> str:
    """torch.ao's name stem for observer ``node``'s grid buffers (``_get_module_path_and_prefix``): the module path
    of the observed node (a weight: of the layer reading it), or for an input observer that of its first user (an
    ``F.linear`` first) plus ``_input``."""
    kind, own = node.meta.get("lowbit_kind"), node.meta.get("lowbit_scope", "")
    if kind == "obs_out":
        return own
    users = list(node.users)
    user = next((u for u in users if u.op == "call_function" and u.target is F.linear), users[0] if users else None)
    scope = user.meta.get("lowbit_scope", own) if user is not None else own
    return scope + "_input" if kind == "obs_in" else scope


def _register_grid(gm: fx.GraphModule, prefix: str, scale: torch.Tensor,
                   zero_point: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[fx.Node, fx.Node]:
    """Root buffers ``<prefix>_scale_<i>`` / ``<prefix>_zero_point_<i>`` (the first free ``i``) and their get_attr
    nodes (inserted at the graph's current insert point). ``dtype``: the scale's (float64 for a float64 model: its
    float32 grid exactly, and its dequantized values float64, as the float ops after them take)."""
    stem, i = prefix.replace(".", "_"), 0
    while hasattr(gm, f"{stem}_scale_{i}") or hasattr(gm, f"{stem}_zero_point_{i}"):
        i += 1
    names = (f"{stem}_scale_{i}", f"{stem}_zero_point_{i}")
    gm.register_buffer(names[0], scale.detach().to(torch.float32).to(dtype, copy=True))
    gm.register_buffer(names[1], zero_point.detach().clone())
    return gm.graph.get_attr(names[0]), gm.graph.get_attr(names[1])


def _qdq_pair(gm: fx.GraphModule, node: fx.Node, obs: nn.Module, dtype: torch.dtype = torch.float32) -> fx.Node:
    """Replace observer ``node`` (reading ``src``) by ``dequantize(quantize(src))`` on ``obs``'s grid (buffers)."""
    src, graph = node.args[0], gm.graph
    scale, zero_point = obs.calculate_qparams()
    qdtype = obs.qdtype
    per_channel = scale.dim() == 1 and node.meta.get("lowbit_kind") == "obs_w"
    with graph.inserting_before(node):
        if per_channel:
            axis = getattr(obs, "ch_axis", 0)
            s, z = _register_grid(gm, _grid_prefix(node), scale, zero_point, dtype)
            q = graph.call_function(quantize_per_channel,
                                    (src, s, z, axis, qdtype.quant_min, qdtype.quant_max, qdtype.storage))
            dq = graph.call_function(dequantize_per_channel, (q, s, z, axis))
            meta = (node.target, obs.qscheme, qdtype, axis)
        else:
            s, z = _register_grid(gm, _grid_prefix(node), scale.reshape(()),
                                  zero_point.reshape(()).to(torch.int64), dtype)
            q = graph.call_function(quantize_per_tensor,
                                    (src, s, z, qdtype.quant_min, qdtype.quant_max, qdtype.storage))
            dq = graph.call_function(dequantize_per_tensor, (q, s, z))
            meta = (node.target, obs.qscheme, qdtype, None)
    q.meta.update(lowbit_kind="ref_quantize", lowbit_domain="other", lowbit_ftensor=False)
    dq.meta.update(node.meta)
    dq.meta[_REF] = meta
    node.replace_all_uses_with(dq)
    graph.erase_node(node)
    return dq


def _blend_on_grid(gm: fx.GraphModule, node: fx.Node) -> None:
    """A shared-grid bilinear upsample's ``grid_blend`` node (``bilinear_on_shared_grid(x, y, observer, ...)``, its
    ``y`` already the reference pair ``dequantize(quantize(upsample, s, z, qmin, qmax))``) as
    ``bilinear_per_tensor(x, y, s, z, qmin, qmax, ...)`` on that pair's grid buffers: the int8 kernel's codes, not
    the rounded float blend."""
    x, dq, attr, *args = node.args
    s, z, qmin, qmax = dq.args[0].args[1:5]  # type: ignore[union-attr]
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(bilinear_per_tensor, (x, dq, s, z, qmin, qmax, *args))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    if isinstance(attr, fx.Node) and not attr.users:
        gm.graph.erase_node(attr)


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy with the attributes ``prepare_custom_config`` preserved (a GraphModule's copy drops them, and
    lowering the copy then failed: "preserved attribute ... is not an attribute of the prepared model")."""
    new = copy.deepcopy(model)
    for name in _top(model).get("preserved", []):
        if hasattr(model, name):
            setattr(new, name, preserved_value(model, new, name))
    return new


def convert_to_reference_fx(model: nn.Module, inplace: bool = False) -> nn.Module:
    """The reference form of a calibrated ``prepare_fx`` / ``prepare_qat_fx`` model (module docstring); eval mode."""
    if not is_prepared(model) or _top(model).get("converted") or _top(model).get("reference"):
        raise TypeError("convert_to_reference_fx: expects a calibrated model returned by prepare_fx or prepare_qat_fx "
                        f"(not converted yet), got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"convert_to_reference_fx: inplace must be a bool, got {inplace!r}")
    source = model
    if not inplace:
        model = _copy(model)
    sync_pending(model)  # under torch.distributed: the ranks agree on the observers' paths, then reduce
    dtype = region_dtype(model) or torch.float32  # (a float64 model: float64 out of every dequantize)
    for gm in _graphs(model):
        for node in list(gm.graph.nodes):
            kind = node.meta.get("lowbit_kind")
            if kind in ("obs_out", "obs_in", "obs_w", "obs_share"):
                obs = gm.get_submodule(node.target)
                if not holds_grid(obs):
                    raise RuntimeError(f"convert_to_reference_fx: the observer '{node.target}' after "
                                       f"'{node.args[0].name}' saw no data (or only NaN/Inf values, which "
                                       "observers ignore); run calibration batches first")
                _qdq_pair(gm, node, obs, dtype)
            elif kind == "grid_blend":
                _blend_on_grid(gm, node)
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
    drop_removed(model, source)  # DDP's ignore list (a GraphModule copy lost it): the user's names, no observer's
    return model.eval()


def lower_reference_fx(model: nn.Module, inplace: bool = False) -> nn.Module:
    """The int8 model of a ``convert_to_reference_fx`` model: equal to ``convert_fx`` of its prepared model."""
    if not is_reference_fx(model):
        raise TypeError(f"lower_reference_fx: expects a model returned by convert_to_reference_fx, got "
                        f"{type(model).__name__}")
    if not isinstance(inplace, bool):  # a truthy "no" rewrote the caller's model
        raise TypeError(f"lower_reference_fx: inplace must be a bool, got {inplace!r}")
    source = model
    if not inplace:
        model = _copy(model)
    for gm in _graphs(model):
        graph = gm.graph
        drop_grid_blends(gm)  # (convert_fx runs the upsample on the codes)
        for dq in list(graph.nodes):
            if _REF not in dq.meta:
                continue
            name, qscheme, qdtype, axis = dq.meta[_REF]
            q = dq.args[0]
            src, s, z = q.args[0], q.args[1], q.args[2]
            # the grid as the model holds it now (a loaded state_dict's); literals: a graph written before the buffers
            grid = [gm.get_buffer(a.target) if isinstance(a, fx.Node) else torch.tensor(a) for a in (s, z)]
            check_grid_dtype("lower_reference_fx", grid[0])  # a .half() model's grids are not the calibrated ones
            obs = FrozenObserver(*grid, qscheme, qdtype, *(() if axis is None else (axis,)))
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
    return drop_removed(convert_fx(model, inplace=True), source)  # (the copy lost DDP's ignore list)
