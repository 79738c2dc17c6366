"""Node classification for graph mode: kind, QFunctional op, qconfig and domain of every node.

Kinds (see ``lowbit.fx.patterns``): ``input`` (placeholder / get_attr), ``module``, ``functional``,
``act``, ``weighted`` (``F.linear``/``F.conv*`` on the model's own parameters, see
``lowbit.fx.weighted``; ``meta["lowbit_wspec"]`` holds its arguments), ``wonly`` (a weight-only
module: ``nn.Embedding``/``nn.EmbeddingBag``, float out), ``dynamic`` (a node whose qconfig is
dynamic, ``get_dynamic_qconfig()``: a Linear/LSTM/GRU module or ``F.linear`` on parameters, float
in and out, activations quantized per call; any other op under a dynamic qconfig is ``float``
and reported), ``share``, ``float``, ``opaque`` (an untraceable submodule) and ``output``.
Domains (what a value is after ``convert_fx``): ``int`` (a ``QTensor``) for
``module``/``functional``/``act``/``weighted`` nodes and for ``share`` ops of an int value,
``other`` for non-float values (sizes, masks), ``float`` otherwise.

>>> import torch
>>> from torch import fx, nn
>>> import lowbit as Q
>>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.Softmax(-1)))
>>> for n in gm.graph.nodes:
...     n.meta["lowbit_ftensor"], n.meta["lowbit_scalar"] = n.op != "output", False
>>> mapping = Q.QConfigMapping().set_global(Q.get_minmax_qconfig())
>>> _ = Q.propagate_qconfig_(gm, mapping)
>>> classify(gm, gm, mapping, set(), {nn.Linear}, Q.FxReport(), "")
>>> [(n.meta["lowbit_kind"], n.meta["lowbit_domain"]) for n in gm.graph.nodes]
[('input', 'float'), ('module', 'int'), ('float', 'float'), ('output', 'other')]
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch
from torch import fx, nn

from ..mappings import get_default_dynamic_quant_module_mappings
from ..nn.quantized.normalization import batchnorm_float_reason
from ..observer.fixed import FixedQParamsObserver
from ..qconfig import QConfig, QConfigMapping, get_default_qat_qconfig, get_default_qconfig
from ..workflow import _is_table_recipe, is_dynamic_qconfig
from ..workflow.propagate import join_name as join
from ..workflow.shared_grids import bilinear_on_shared_grid
from .patterns import (WEIGHT_ONLY_TYPES, as_number, bilinear_call_args, canonical_binary, func_activation,
                       is_bilinear_resample, is_constant_clamp, is_share_op)
from .islands import assign_domains, demote_float_islands, wants_int
from .masks import keep_masks_float
from .report import FxReport
from .scalar_ops import scalar_op
from .weighted import input_of, parse

__all__ = ["classify", "wants_int", "int_inputs", "join", "input_observer_qconfig", "share_bilinear_grids",
           "drop_grid_blends"]



_METHOD_FUNCS = {"add": torch.add, "mul": torch.mul, "matmul": torch.matmul, "bmm": torch.bmm, "div": torch.div,
                 "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def apply_call_order(gm: fx.GraphModule, mapping: QConfigMapping, prefix: str, seen: dict[str, dict[Any, int]],
                     used: set[tuple[str, Any, int]]) -> None:
    """torch.ao's ``set_module_name_object_type_order`` on a freshly traced graph (before fusion and QAT swaps), in node
    order: the ``i``-th ``call_function`` of target ``f`` traced in module ``p``'s ``forward`` has key ``(p, f, i)``;
    the ``i``-th call of a child module of type ``T`` whose path's parent is ``p`` has ``(p, T, i)``. A matching
    entry sets that module's ``.qconfig``, or the function node's ``meta["lowbit_order_qconfig"]`` (``_node_qconfig``
    reads it first). ``seen`` (path → {object: calls so far}) and ``used`` (the keys matched) span one prepare call's
    graphs; paths are full (``prefix`` joined). Every function node records its key in ``meta["lowbit_call_order"]``
    (carried onto the ``qfunctional_N`` node ``convert_fx`` makes of it: the mixed-precision search names it by it);
    a method call (``x.add(y)``, no torch.ao key) records ``(p, "Tensor.add", i)`` in ``meta["lowbit_method_order"]``,
    the ``i``-th call of that method in ``p`` (the fast search follows it when the island rule keeps it float)."""
    order = mapping.module_name_object_type_order_qconfigs
    for node in gm.graph.nodes:
        if node.meta.get("lowbit_inserted"):  # (a node graph mode added: fx/inplace.py's copies and replayed views)
            continue
        if node.op == "call_function":  # (`torch.relu_(x)` made out of place counts as torch.relu_, as traced)
            scope = node.meta.get("lowbit_scope", "")  # (a child graph's own forward: the child's path, no "attn.")
            path, obj, mod = join(prefix, scope) if scope else prefix, node.meta.get("lowbit_target", node.target), None
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)  # type: ignore[arg-type]
            path, obj = join(prefix, node.target).rpartition(".")[0], type(mod)  # type: ignore[arg-type]
        elif node.op == "call_method":  # (no torch.ao key; lowbit's own, for the fast search: `Tensor.add#0`)
            scope = node.meta.get("lowbit_scope", "")
            path = join(prefix, scope) if scope else prefix
            counts = seen.setdefault(path, {})
            index = counts.get(("method", node.target), 0)
            counts[("method", node.target)] = index + 1
            node.meta["lowbit_method_order"] = (path, f"Tensor.{node.target}", index)
            continue
        else:
            continue
        counts = seen.setdefault(path, {})
        try:
            index = counts.get(obj, 0)
        except TypeError:  # an unhashable call target: no key can name it
            continue
        counts[obj] = index + 1
        key = (path, obj, index)
        if mod is None:
            node.meta["lowbit_call_order"] = key
        if key not in order:
            continue
        used.add(key)
        if mod is not None:
            mod.qconfig = order[key]
        else:
            node.meta["lowbit_order_qconfig"] = order[key]


def _node_qconfig(node: fx.Node, root: nn.Module, mapping: QConfigMapping) -> QConfig | None:
    """The call-order setting when one matched (``apply_call_order``), else ``object_type[function]`` when set, else
    the qconfig of the enclosing (or own) module."""
    if "lowbit_order_qconfig" in node.meta:
        return node.meta["lowbit_order_qconfig"]  # type: ignore[no-any-return]
    if node.op in ("call_function", "call_method"):
        # the function as traced (torch.ao's key: `a + b` is operator.add, torch.add(a, b) is torch.add, each its own
        # setting); a node fusion rewrote (add_relu, linear_relu) keeps it in meta; `x.add(y)` has torch.ao's key,
        # the method name "add" (also after fusion made it an add_relu), and failing that counts as torch.add
        # (an in-place op made out of place, `x.sigmoid_()`, falls back to its twin's setting: the fixed sigmoid grid)
        traced = node.meta.get("lowbit_target", node.target)
        keys = [k for k in (traced, node.target) if k is traced or k != traced]
        keys += [_METHOD_FUNCS[k] for k in keys if isinstance(k, str) and k in _METHOD_FUNCS]
        for key in keys:
            try:
                if key in mapping.object_type_qconfigs:
                    return mapping.object_type_qconfigs[key]
            except TypeError:  # unhashable target
                pass
    scope = node.meta.get("lowbit_scope", "")
    try:
        mod = root.get_submodule(scope) if scope else root
    except AttributeError:
        mod = root
    return getattr(mod, "qconfig", None)


def _ftensor(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and bool(arg.meta.get("lowbit_ftensor", False))


_SUB = {("call_function", operator.sub), ("call_function", torch.sub), ("call_function", torch.subtract),
        ("call_method", "sub"), ("call_method", "subtract")}
_ALPHA = {("call_function", torch.add), ("call_method", "add")} | _SUB  # (operator.add / sub take no alpha)


def _alpha(node: fx.Node) -> tuple[float | None, str]:
    """The factor ``c`` of the second operand of an add / sub of two tensors (``a + c · b``: ``torch.add(a, b,
    alpha=k)`` has ``c = k``, ``torch.sub(a, b, alpha=k)`` / ``a - b`` ``c = -k``), with ``(None, why)`` for an
    alpha that is not a finite nonzero number, ``(None, "")`` for any other node."""
    if (node.op, node.target) not in _ALPHA or len(node.args) != 2 or set(node.kwargs) - {"alpha"}:
        return None, ""
    raw = node.kwargs.get("alpha", 1)
    k = as_number(raw)
    if k is None or not math.isfinite(k) or k == 0.0:
        return None, f"alpha={raw!r} is not a finite nonzero number"
    return (-k if (node.op, node.target) in _SUB else k), ""


def _functional_op(node: fx.Node) -> str | None:
    """The QFunctional method for a binary node (``add``, ``add_scalar``, ``cat`` ...), or ``None``. An add / sub of
    two tensors with an ``alpha`` (``_alpha``) is an ``add`` whose second operand ``convert_fx`` scales on its codes
    (``scaled_operand``): its factor is in ``meta["lowbit_alpha"]``."""
    if not node.meta.get("lowbit_ftensor", False):
        return None
    c, _ = _alpha(node)
    if c is not None and all(_ftensor(a) for a in node.args):
        if c != 1.0:
            node.meta["lowbit_alpha"] = c
        return "add"
    qop, _ = scalar_op(node)  # (x ± c, c - x, x · c, x / c: fx/scalar_ops.py)
    if qop is not None:
        return qop
    op = canonical_binary(node.op, node.target)
    if op is None:
        return None
    args, kwargs = node.args, dict(node.kwargs)
    if op == "cat":
        tensors = args[0] if args else kwargs.pop("tensors", None)
        dim_ok = set(kwargs) <= {"dim"} and len(args) <= 2
        ok = isinstance(tensors, (list, tuple)) and len(tensors) > 0 and all(_ftensor(t) for t in tensors)
        return "cat" if ok and dim_ok else None
    if kwargs or len(args) != 2:
        return None
    a, b = args
    if op == "add_relu":
        return op if _ftensor(a) and _ftensor(b) else None
    if _ftensor(a) and _ftensor(b):
        return op if op != "div" else None
    return None


def _act_ok(node: fx.Node) -> bool:
    """A functional activation whose extra arguments the quantized module can take."""
    if not node.args or not _ftensor(node.args[0]):
        return False
    extra = set(node.kwargs) - {"inplace", "negative_slope", "alpha"}
    return not extra and all(isinstance(a, (numbers.Real, bool)) for a in node.args[1:])


def _dynamic_kind(node: fx.Node, mod: nn.Module | None, gm: fx.GraphModule,
                  dynamic_types: set[type]) -> tuple[str, str]:
    """``("dynamic", "")`` for a node a dynamic qconfig quantizes, else ``("float", why)``."""
    if node.op == "call_module" and type(mod) in dynamic_types:
        if node.args and _ftensor(node.args[0]):
            return "dynamic", ""
        return "float", "dynamic qconfig, but its input is not a float tensor"
    spec, reason = parse(node, gm)
    if spec is not None and spec.module_type is nn.Linear:
        node.meta["lowbit_wspec"] = spec
        return "dynamic", ""
    names = ", ".join(t.__name__ for t in dynamic_types)
    return "float", reason or f"dynamic qconfig, but no dynamic kernel for it (dynamic: {names}, F.linear)"


def classify(gm: fx.GraphModule, root: nn.Module, mapping: QConfigMapping, opaque: set[str],
             module_types: set[type], report: FxReport, prefix: str,
             dynamic_types: set[type] | None = None) -> None:
    """Set ``meta["lowbit_kind"]``, ``["lowbit_qop"]``, ``["lowbit_domain"]`` and ``["lowbit_qconfig"]``.

    ``dynamic_types`` (default: the keys of ``get_default_dynamic_quant_module_mappings()``): the
    module types a dynamic qconfig quantizes."""
    if dynamic_types is None:
        dynamic_types = set(get_default_dynamic_quant_module_mappings())
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        mod = modules.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        qc = getattr(mod, "qconfig", None) if mod is not None else _node_qconfig(node, root, mapping)
        kind, qop, why = "float", None, "no integer implementation in graph mode"
        if node.op in ("placeholder", "get_attr"):
            kind = "input"
        elif node.op == "output":
            kind = "output"
        elif node.op == "call_module" and node.target in opaque:
            kind = "opaque"
        elif node.meta.get("lowbit_writes_part"):  # (it must write into its float argument: fx/inplace.py)
            why = "writes into a part of a tensor, replayed on a float copy"
        elif is_share_op(node, mod):
            kind = "share"
        elif node.op == "call_module" and type(mod) in WEIGHT_ONLY_TYPES and _is_table_recipe(mod, qc):
            kind = "wonly"  # an embedding recipe under a dynamic activation entry (torch.ao's QConfigDynamic)
        elif is_dynamic_qconfig(qc):
            kind, why = _dynamic_kind(node, mod, gm, dynamic_types)
        elif qc is not None and node.meta.get("lowbit_ftensor", False):
            spec, reason = parse(node, gm)
            if node.op == "call_module" and type(mod) in module_types:
                # (a BN without running statistics stays float; one in training mode is int8, as torch.ao)
                kind, why = ("float", bn_why) if (bn_why := batchnorm_float_reason(mod)) else ("module", why)
            elif node.op == "call_module" and type(mod) in WEIGHT_ONLY_TYPES:
                kind = "wonly"
            elif spec is not None:
                kind = "weighted"
                node.meta["lowbit_wspec"] = spec
            elif reason is not None:
                why = reason
            elif (qop := _functional_op(node)) is not None:
                kind = "functional"
            elif _alpha(node)[1] or scalar_op(node)[1]:
                why = _alpha(node)[1] or scalar_op(node)[1]
            elif func_activation(node.op, node.target) is not None and _act_ok(node):
                kind = "act"
        node.meta.update(lowbit_kind=kind, lowbit_qop=qop, lowbit_qconfig=qc)
        if kind == "float" and qc is not None and node.meta.get("lowbit_ftensor", False):
            what = type(mod).__name__ if mod is not None else getattr(node.target, "__name__", str(node.target))
            report.left_float[join(prefix, node.name)] = f"{what} ({why})"
    keep_masks_float(gm, report, prefix)  # (attention masks and the sums they enter: float, fx/masks.py)
    assign_domains(gm)
    while demote_float_islands(gm, report, prefix):
        assign_domains(gm)


def _has_fixed_grid(qc: QConfig | None) -> bool:
    """Whether ``qc``'s activation is a fixed grid (a ``FixedQParamsObserver``, or a fake-quant around one)."""
    if qc is None or is_dynamic_qconfig(qc):
        return False
    obs = qc.activation()
    return isinstance(obs, FixedQParamsObserver) or isinstance(getattr(obs, "activation_post_process", None),
                                                               FixedQParamsObserver)


def _input_grid_source(qc: QConfig | None) -> bool:
    """Whether ``qc``'s activation may give a float value's input observer: static and not a fixed grid (a
    ``NoopObserver`` / ``PlaceholderObserver`` a user set is kept, so ``convert_fx`` names it)."""
    return qc is not None and not is_dynamic_qconfig(qc) and not _has_fixed_grid(qc)


def input_observer_qconfig(node: fx.Node, int_users: list[fx.Node]) -> QConfig:
    """The qconfig of the observer (``Quantize`` after convert) between float ``node`` and the int ops reading it:
    ``node``'s own when it pins a fixed output grid (a float ``nn.Softmax`` under torch.ao's fixed 1/256 grid, as
    torch.ao's quantized softmax gives its consumers), else the first static int consumer's without a fixed grid,
    else ``node``'s own, else the default static / QAT recipe: a consumer's fixed grid (tanh's ``[-1, 1)``) is its
    output's, never its input's (torch.ao puts it there: a LayerNorm's ``±3`` clipped to ``[-1, 1)``)."""
    own = node.meta.get("lowbit_qconfig")
    if _has_fixed_grid(own):
        return own
    qcs = [u.meta["lowbit_qconfig"] for u in int_users]
    for qc in (*qcs, own):
        if _input_grid_source(qc):
            return qc
    qat = hasattr(qcs[0].activation(), "activation_post_process")  # (a FixedQParamsFakeQuantize)
    return get_default_qat_qconfig() if qat else get_default_qconfig()


def int_inputs(user: fx.Node) -> list[fx.Node]:
    """The inputs of an int op that are activations (a functional layer's weight and bias are not)."""
    if user.meta.get("lowbit_kind") == "weighted":
        return [input_of(user)]
    return list(user.all_input_nodes)


def share_bilinear_grids(gm: fx.GraphModule) -> None:
    """After each bilinear resample of an int value, its input's observer called again (``obs_share``), as torch.ao's
    shared observers: calibration sees the averaged values; then a ``grid_blend`` node,
    ``bilinear_on_shared_grid(x, obs_share, <get_attr of that observer>, size, scale_factor, align_corners,
    recompute_scale_factor)``, which in QAT (an enabled fake-quant) gives the int8 kernel's codes on that grid rather
    than the rounded float blend (one step apart at the kernel's near-ties) and otherwise passes ``obs_share`` on.
    ``convert_fx`` drops both (the QTensor op keeps the grid and runs the kernel); ``convert_to_reference_fx`` makes
    the blend a ``bilinear_on_grid`` call on the reference grid. After a constant clamp of an int value
    (``is_constant_clamp``, ``nn.Hardtanh``) only ``obs_share``: the prepared model's clamp bounds land on the grid
    as the int8 clamp of the codes puts them (the simulation and the reference equal the int8 model)."""
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        mod = modules.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        if node.meta.get("lowbit_kind") != "share" or node.meta.get("lowbit_domain") != "int":
            continue
        bilinear = is_bilinear_resample(node, mod)
        if not (bilinear or is_constant_clamp(node) or type(mod) is nn.Hardtanh):
            continue
        src = node.args[0] if node.args else None
        while isinstance(src, fx.Node) and src.meta.get("lowbit_kind") in ("share", "grid_blend") and src.args:
            src = src.args[1 if src.meta["lowbit_kind"] == "grid_blend" else 0]  # (an upsample of an upsample)
        if not isinstance(src, fx.Node) or src.meta.get("lowbit_kind") not in ("obs_out", "obs_in", "obs_share"):
            continue  # (a quantized graph input: no observer holds its grid)
        with gm.graph.inserting_after(node):
            obs = gm.graph.call_module(src.target, (node,))
        obs.meta.update({**src.meta, "lowbit_kind": "obs_share"})  # (src: the first observer node, for the names)
        if not bilinear:  # a clamp's bound rounded onto the grid, as its int8 clamp of the codes rounds it
            node.replace_all_uses_with(obs, delete_user_cb=lambda u, obs=obs: u is not obs)
            continue
        with gm.graph.inserting_after(obs):
            attr = gm.graph.get_attr(src.target)  # type: ignore[arg-type]
        with gm.graph.inserting_after(attr):
            x, *args = bilinear_call_args(node, mod)
            blend = gm.graph.call_function(bilinear_on_shared_grid, (x, obs, attr, *args))
        attr.meta.update(lowbit_kind="grid_attr", lowbit_domain="other", lowbit_ftensor=False, lowbit_scalar=False)
        blend.meta.update({**src.meta, "lowbit_kind": "grid_blend"})
        node.replace_all_uses_with(blend, delete_user_cb=lambda u, obs=obs: u is not obs)


def drop_grid_blends(gm: fx.GraphModule) -> None:
    """Each ``grid_blend`` node (``share_bilinear_grids``) replaced by the value it refines (its second argument), and
    the ``get_attr`` nodes only it read removed: ``convert_fx`` runs the upsample on the codes itself."""
    for node in list(gm.graph.nodes):
        if node.meta.get("lowbit_kind") != "grid_blend":
            continue
        attrs = [a for a in node.all_input_nodes if a.op == "get_attr"]
        node.replace_all_uses_with(node.args[1])  # type: ignore[arg-type]
        gm.graph.erase_node(node)
        for a in attrs:
            if not a.users:
                gm.graph.erase_node(a)
