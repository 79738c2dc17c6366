"""``prepare_fx`` / ``prepare_qat_fx``: trace, fuse, and insert observers on graph edges.

Steps: (1) every module gets its resolved ``.qconfig`` (``lowbit.workflow.propagate_qconfig_``:
own attribute > module name > regex > type > parent); (2) ``torch.fx`` traces the model. A
submodule it cannot trace stays a leaf of the graph (float in, float out) and each of *its*
children is prepared the same way, as a graph of its own (recursively, down to single layers,
which become ``Quantize -> layer -> DeQuantize`` graphs); an untraceable root is handled alike
and returned as itself with prepared children. With ``example_inputs``, one run records every
submodule's inputs, so these child graphs know their tensors and ``None`` arguments too;
(3) module runs and add-relu are fused (``lowbit.fx.fusion``); for QAT, modules are swapped for
their ``lowbit.nn.qat`` twins; (4) every node is classified (``lowbit.fx.classify``: ``module``,
``functional``, ``act``, ``share``, ``float``) and gets its *domain* after convert: ``int`` (a
``QTensor``), ``float`` or ``other`` (not a float tensor); an elementwise int op between a float
input and only float consumers stays float (it would only add roundings). Observers
(``qconfig.activation()``) are inserted as ``activation_post_process_<i>`` call_module nodes:

- after each int-producing node (all users read the observer: in QAT they see fake-quantized values);
- after each float-domain tensor that an int op consumes as an activation (graph inputs, outputs
  of float ops): only the int consumers read it; ``convert_fx`` turns it into a ``Quantize`` node;
- on the weight edge of ``F.linear``/``F.conv*`` on a model parameter (``lowbit.fx.weighted``):
  ``qconfig.weight()`` as ``weight_post_process_<i>`` (in QAT the layer sees fake-quantized weights).

Embeddings (``nn.Embedding``/``nn.EmbeddingBag``) get no observer: their output stays float and
``convert_fx`` quantizes their table per row with ``qconfig.weight()``, as the eager ``convert``.

Dynamic qconfigs (``get_dynamic_qconfig()``, alone or mixed with static settings in one mapping):
a ``Linear``/``LSTM``/``GRU`` module (a leaf) or an ``F.linear`` on model parameters under one is a
``dynamic`` node: no observers, float in and float out (a ``DeQuantize`` before it when a static
int region feeds it), not fused with a following ReLU, never swapped for a QAT module;
``convert_fx`` makes it a ``lowbit.nn.quantized.dynamic`` module, as ``quantize_dynamic`` with that
qconfig would. Other ops under a dynamic qconfig (convs, adds, activations) have no dynamic
kernel: they stay float and are listed in ``lowbit_report.left_float`` (not an error, so a global
dynamic recipe on a CNN works, as in ``torch.ao``).

A functional op's qconfig is ``object_type[function]`` when set, else the qconfig of the module
whose ``forward`` it was traced in.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import fx, nn

from ..custom_config import PrepareCustomConfig
from ..observer.ddp import keep_statistics_local
from ..mappings import get_default_dynamic_quant_module_mappings, get_default_qat_module_mappings
from ..qconfig.config import build
from ..qconfig import QConfig, QConfigMapping, get_default_qat_qconfig_mapping, get_default_qconfig_mapping
from ..workflow import is_dynamic_qconfig, propagate_qconfig_
from ..workflow.kinds import model_kind
from ..workflow.propagate import refuse_lazy
from .classify import apply_call_order, classify, input_observer_qconfig, int_inputs, join, share_bilinear_grids, wants_int
from .custom import declare_non_traceable, preserve, swap_custom
from .padding import attach, hook_observers
from .fusion import fuse_graph
from .legacy import baked_copy, warn_user_hooks
from .patterns import WEIGHT_ONLY_TYPES, graph_module_types
from .report import FxReport
from .state import STATE_KEY, carry, is_prepared
from .child_reads import keep_child_reads
from .trace import RootNotTraceable, keep_buffers, record_tensor_kinds, restore_buffers, trace
from .transformer import swap_attention
from .weighted import arg_of
from ..state_check import guard_loading

__all__ = ["prepare_fx", "prepare_qat_fx", "STATE_KEY", "is_prepared"]


def _check_args(fn: str, model: Any, example_inputs: Any, inplace: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}")
    if is_prepared(model):
        state = model.meta[STATE_KEY] if isinstance(model, fx.GraphModule) else model.__dict__[STATE_KEY]
        if state.get("converted") or state.get("reference"):  # (it said "calibrate it and call convert_fx")
            raise ValueError(f"{fn}: this model was already converted by convert_fx or convert_to_reference_fx; "
                             "pass the float model")
        raise ValueError(f"{fn}: this model was already prepared by prepare_fx/prepare_qat_fx; "
                         "calibrate it and call convert_fx")
    found = model_kind(model)
    if found is not None:  # (eager prepare / prepare_qat / convert: graph mode would trace its parts as opaque leaves)
        raise TypeError(f"{fn}: model is already {found[0]} in eager mode ({found[1]} is not a float module); pass the "
                        "float model (graph mode inserts its own observers)")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError(f"{fn}: example_inputs must be a tuple of positional inputs (e.g. (x,)), "
                        f"got {type(example_inputs).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"{fn}: inplace must be a bool, got {inplace!r}")
    refuse_lazy(fn, model)


def _kinds_in_eval(gm: fx.GraphModule, example_inputs: tuple[Any, ...] | None) -> None:
    """``record_tensor_kinds`` with every module in eval mode (no BN statistics or observer updates)."""
    modes, kept = {m: m.training for m in gm.modules()}, keep_buffers(gm)
    gm.eval()
    try:
        record_tensor_kinds(gm, example_inputs)
    except Exception as err:
        raise ValueError(f"prepare_fx: running the traced model on example_inputs failed: "
                         f"{type(err).__name__}: {err}") from err
    finally:
        restore_buffers(kept)  # a forward that updates a buffer (a running mean, a step count) ran once
        for m, mode in modes.items():
            m.training = mode


def _half_tensor(model: nn.Module) -> tuple[str, torch.dtype] | None:
    """The first float16 / bfloat16 parameter or buffer: static grids need a float32 model (the int8 layers return
    float32, which a half / bfloat16 float op next to them refused deep inside the converted model's forward,
    ``LayerNorm``'s "mixed dtype (CPU)")."""
    return next(((n, t.dtype) for n, t in (*model.named_parameters(), *model.named_buffers())
                 if t.dtype in (torch.float16, torch.bfloat16)), None)


def _insert_observers(gm: fx.GraphModule) -> int:
    """Insert the observer nodes described in the module docstring; return how many (weight-only
    modules count as one each)."""
    graph, count = gm.graph, 0
    per_module: dict[str, str] = {}  # a module called at several sites: one observer sees them all

    def add_observer(node: fx.Node, qconfig: QConfig, role: str) -> fx.Node:
        nonlocal count
        shared = node.op == "call_module" and role == "obs_out"
        name = per_module.get(node.target) if shared else None  # type: ignore[arg-type]
        if name is None:
            name = f"activation_post_process_{count}"
            count += 1
            gm.add_submodule(name, build(qconfig, "activation", f"prepare_fx: node {node.name!r}"))
            if shared:
                per_module[node.target] = name  # type: ignore[index]
        with graph.inserting_after(node):
            obs = graph.call_module(name, (node,))
        obs.meta.update(lowbit_kind=role, lowbit_domain="int", lowbit_ftensor=True, lowbit_scalar=False,
                        lowbit_qconfig=qconfig, lowbit_scope=node.meta.get("lowbit_scope", ""))
        return obs

    def add_weight_observer(node: fx.Node) -> None:
        nonlocal count
        weight, name = arg_of(node, "weight"), f"weight_post_process_{count}"
        count += 1
        gm.add_submodule(name, node.meta["lowbit_qconfig"].weight())
        with graph.inserting_before(node):
            obs = graph.call_module(name, (weight,))
        obs.meta.update(lowbit_kind="obs_w", lowbit_domain="other", lowbit_ftensor=True, lowbit_scalar=False)
        node.replace_input_with(weight, obs)

    for node in list(graph.nodes):
        kind = node.meta.get("lowbit_kind")
        if kind == "weighted":
            add_weight_observer(node)
        if kind in ("module", "functional", "act", "weighted"):
            obs = add_observer(node, node.meta["lowbit_qconfig"], "obs_out")
            node.replace_all_uses_with(obs, delete_user_cb=lambda u, obs=obs: u is not obs)
        elif node.meta.get("lowbit_domain") == "float":
            int_users = [u for u in node.users if wants_int(u) and node in int_inputs(u)]
            if int_users:
                obs = add_observer(node, input_observer_qconfig(node, int_users), "obs_in")
                for u in int_users:
                    u.replace_input_with(node, obs)
    share_bilinear_grids(gm)
    # weight-only (embedding) and dynamic layers are quantized at convert with no observer: keep the graph
    return count + sum(1 for n in graph.nodes if n.meta.get("lowbit_kind") in ("wonly", "dynamic"))


def _swap_qat(gm: fx.GraphModule, opaque: set[str]) -> None:
    """Replace float / fused-marker modules by their QAT twins (``get_default_qat_module_mappings``)."""
    qat_map = get_default_qat_module_mappings()
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in opaque:
            continue
        mod = gm.get_submodule(node.target)
        qc = getattr(mod, "qconfig", None)
        if type(mod) in qat_map and qc is not None and not is_dynamic_qconfig(qc):  # dynamic: trains in float
            parent, _, name = node.target.rpartition(".")
            try:
                new = qat_map[type(mod)].from_float(mod)
            except (ValueError, TypeError, RuntimeError) as e:  # (as prepare_qat: the error names the module)
                raise type(e)(f"prepare_qat_fx: module '{node.target}' ({type(mod).__name__}): {e}") from e
            setattr(gm.get_submodule(parent) if parent else gm, name, new)


_MIXED = ("<called with None and with a value for one argument>",)  # _capture_inputs' mark for such a module


def _prepare_children(mod: nn.Module, ctx: _Ctx, prefix: str) -> None:
    """Graph-prepare each child of a module whose own ``forward`` cannot be traced (in place)."""
    for name, child in list(mod.named_children()):
        captured = ctx.captured.get(child)
        if captured is _MIXED:  # one graph cannot follow both an `if arg is None` branch and the other one
            ctx.untraceable(join(prefix, name), child, "it is called both with and without an optional argument "
                            "(None in one call, a value in another), which one traced graph cannot follow")
            _prepare_children(child, ctx, join(prefix, name))
            continue
        new = _prepare_module(child, ctx, join(prefix, name), captured)
        if new is not child:
            keep_child_reads(mod, name, new, f"{ctx.fn}: '{join(prefix, name)}'")  # (self.proj.weight in mod's forward)
            mod._modules[name] = new


def _capture_inputs(model: nn.Module, example_inputs: tuple[Any, ...]) -> dict[nn.Module, tuple[Any, ...]]:
    """Each submodule's first call on ``example_inputs``, as positional arguments (defaults filled in); ``_MIXED``
    for a module called again with ``None`` where a call passed a value, or the other way round (an argument
    ``None`` in the example is traced as that constant: the other calls would not fit the graph)."""
    calls: dict[nn.Module, tuple[Any, ...]] = {}

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if calls.get(mod) is _MIXED:
            return
        try:
            sig = inspect.signature(mod.forward)
            if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
                return
            bound = sig.bind(*args, **kwargs)
        except (TypeError, ValueError):
            return
        bound.apply_defaults()
        values = tuple(bound.arguments.values())
        first = calls.setdefault(mod, values)
        if first is not values and any((a is None) != (b is None) for a, b in zip(first, values)):
            calls[mod] = _MIXED

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]
    modes, kept = {m: m.training for m in model.modules()}, keep_buffers(model)
    try:
        with torch.no_grad():
            model.eval()(*example_inputs)
    except Exception as err:
        raise ValueError(f"prepare_fx: running the model on example_inputs failed: "
                         f"{type(err).__name__}: {err}") from err
    finally:
        restore_buffers(kept)  # (its buffers as they were: the prepared model starts from the float model's state)
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return calls


def _prepare_module(mod: nn.Module, ctx: _Ctx, prefix: str, example_inputs: tuple[Any, ...] | None,
                    top: bool = False) -> nn.Module:
    """A prepared ``GraphModule`` for ``mod``, or ``mod`` itself with its children prepared."""
    if type(mod).forward is nn.Module.forward:  # ModuleList / ModuleDict: no forward of its own
        _prepare_children(mod, ctx, prefix)
        return mod
    try:
        gm, opaque = trace(mod, example_inputs, ctx.leaves)
    except RootNotTraceable as err:
        cause = err.cause or f"{type(err.__cause__).__name__}: {err.__cause__}".splitlines()[0]
        ctx.untraceable(prefix, mod, cause)
        _prepare_children(mod, ctx, prefix)
        return mod
    _kinds_in_eval(gm, example_inputs)
    for n in gm.graph.nodes:  # a number a parent's code passes to its child, not the user (fx/scalar_ops.py)
        if n.op == "placeholder" and not top:
            n.meta["lowbit_child_input"] = True
    apply_call_order(gm, ctx.mapping, prefix, ctx.order_seen, ctx.order_used)
    absorbed: dict[str, list[str]] = {}
    ctx.report.fused += [join(prefix, f) for f in fuse_graph(gm, ctx.is_qat, absorbed=absorbed)]
    ctx.report.absorbed.update({join(prefix, k): [v if v == "relu" or v.startswith("clamp:") else join(prefix, v) for v in vs]
                                for k, vs in absorbed.items()})
    if ctx.is_qat:
        _swap_qat(gm, set(opaque))
    swap_custom(gm, ctx.custom)
    for path, cause in opaque.items():
        sub = gm.get_submodule(path)
        ctx.untraceable(join(prefix, path), sub, cause)
        _prepare_children(sub, ctx, join(prefix, path))
    if top:  # prepare_custom_config's quantized inputs: QTensors after convert, so no input observer
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        past = [i for i in ctx.input_quantized if i >= len(placeholders)]
        if past:  # (a typo was silently ignored)
            raise ValueError(f"{ctx.fn}: input_quantized_indexes {past} are past the model's {len(placeholders)} inputs")
        for i in ctx.input_quantized:
            if i < len(placeholders):
                placeholders[i].meta["lowbit_qinput"] = True
        outputs = returned_values(gm.graph)
        past = [i for i in ctx.output_quantized if i >= len(outputs)]
        if past:  # (refused only at convert_fx before: after the whole QAT run)
            raise ValueError(f"{ctx.fn}: output_quantized_indexes {past} are past the model's {len(outputs)} outputs")
    classify(gm, mod, ctx.mapping, set(opaque), ctx.module_types, ctx.report, prefix, ctx.dynamic_types)
    if _insert_observers(gm) == 0 and not top:
        return mod  # nothing to quantize here: keep the module as it was
    gm.graph.lint()
    gm.recompile()
    gm.meta[STATE_KEY] = {"is_qat": ctx.is_qat, "report": ctx.report, "prefix": prefix}
    return gm


def returned_values(graph: fx.Graph) -> list[Any]:
    """What the graph's ``output`` node returns, one entry per ``output_quantized_idxs`` index (a single
    value, a tuple or a list)."""
    outputs = [n for n in graph.nodes if n.op == "output"]
    if not outputs:
        return []
    args = outputs[0].args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


class _Ctx:
    """What one prepare_fx call shares across the graphs it builds."""

    def __init__(self, fn: str, mapping: QConfigMapping, is_qat: bool, custom: PrepareCustomConfig) -> None:
        self.fn, self.mapping, self.is_qat = fn, mapping, is_qat
        self.report = FxReport()
        self.captured: dict[nn.Module, tuple[Any, ...]] = {}
        self.custom = custom.float_to_observed_mapping
        self.input_quantized = list(custom.input_quantized_indexes)
        self.output_quantized = list(custom.output_quantized_indexes)
        # leaves of the trace: declared non-traceable modules (by id) and classes, custom float classes
        self.leaves: tuple[set[int], set[type]] = (set(), set(custom.non_traceable_module_classes) | set(self.custom))
        self.module_types = graph_module_types() | set(self.custom.values())
        self.dynamic_types = set(get_default_dynamic_quant_module_mappings())
        self.order_seen: dict[str, dict[Any, int]] = {}  # set_module_name_object_type_order: calls counted so far
        self.order_used: set[tuple[str, Any, int]] = set()
        if is_qat:
            # QAT embeddings stay weight-only nodes (no output observer), as their float forms
            self.module_types |= set(get_default_qat_module_mappings().values()) - WEIGHT_ONLY_TYPES

    def untraceable(self, path: str, mod: nn.Module, cause: str) -> None:
        how = ("its children are prepared one by one" if any(True for _ in mod.children())
               else "left float (no children to quantize)")
        self.report.untraceable[path or "<root>"] = f"{how}; torch.fx could not trace its forward: {cause}"
        warnings.warn(f"{self.fn}: '{path or '<root>'}' ({type(mod).__name__}) cannot be traced by torch.fx "
                      f"({cause}); {how}", stacklevel=5)


def _prepare(fn: str, model: Any, qconfig_mapping: Any, example_inputs: Any, inplace: Any,
             is_qat: bool, prepare_custom_config: Any = None) -> nn.Module:
    _check_args(fn, model, example_inputs, inplace)
    cfg = PrepareCustomConfig.coerce(prepare_custom_config, fn)
    default = get_default_qat_qconfig_mapping() if is_qat else get_default_qconfig_mapping()
    mapping = QConfigMapping.from_qconfig(qconfig_mapping, default)
    half = _half_tensor(model)
    qconfigs = [mapping.global_qconfig, *mapping.object_type_qconfigs.values(), *mapping.module_name_qconfigs.values(),
                *mapping.module_name_regex_qconfigs.values(), *mapping.module_name_object_type_order_qconfigs.values(),
                *(m.__dict__.get("qconfig") for m in model.modules())]
    if half is not None and any(q is not None and not is_dynamic_qconfig(q) for q in qconfigs):
        raise TypeError(f"{fn}: static int8 needs a float32 model, but {half[0]!r} is {half[1]} (the int8 layers "
                        "return float32 to the float ops between them); call model.float() before preparing")
    model = baked_copy(model, fn, is_qat, inplace)  # (legacy weight / spectral norm hooks baked: fx/legacy.py)
    ctx = _Ctx(fn, mapping, is_qat, cfg)
    declare_non_traceable(model, ctx, cfg)
    model = swap_attention(model, mapping, ctx.leaves, fn)  # nn.MultiheadAttention, Transformer*: traceable twins
    propagate_qconfig_(model, mapping)
    declare_non_traceable(model, ctx, cfg)  # (again: a legacy "exact" mapping ignores the qconfig None it set)
    warn_user_hooks(model, fn, ctx.leaves[0], ctx.module_types)
    if example_inputs is not None:
        ctx.captured = _capture_inputs(model, example_inputs)
    out = _prepare_module(model, ctx, "", example_inputs, top=True)
    for (name, obj, index) in mapping.module_name_object_type_order_qconfigs.keys() - ctx.order_used:
        what = getattr(obj, "__name__", repr(obj))
        calls = ctx.order_seen.get(name, {}).get(obj, 0)
        warnings.warn(f"{fn}: QConfigMapping.set_module_name_object_type_order({name!r}, {what}, {index}) matches no "
                      f"call: the traced graph calls {what} {calls} time(s) in {name or '<root>'!r} (indexes count from "
                      "0; method calls such as x.add(y) do not count)", stacklevel=3)
    prepared = [m for m in out.modules() if isinstance(m, fx.GraphModule) and STATE_KEY in m.meta]
    if not prepared or sum(1 for m in prepared for n in m.graph.nodes if n.meta.get("lowbit_kind", "")
                           .startswith("obs_") or n.meta.get("lowbit_kind") in ("wonly", "dynamic")) == 0:
        warnings.warn(f"{fn}(): no quantizable op got a qconfig; convert_fx() will leave this model float",
                      stacklevel=3)
    state = {"is_qat": is_qat, "report": ctx.report, "prefix": "", "preserved": list(cfg.preserved_attributes),
             "input_quantized_idxs": list(cfg.input_quantized_indexes),
             "output_quantized_idxs": list(cfg.output_quantized_indexes)}
    preserve(model, out, cfg.preserved_attributes, fn)
    if isinstance(out, fx.GraphModule):
        out.meta[STATE_KEY] = state
    else:
        out.__dict__[STATE_KEY] = state
    out.lowbit_report = ctx.report
    for m in prepared:  # (pickle keeps what the Carry snapshots: fx/state.py)
        carry(m)
    if not is_qat and attach(out):  # calibration skips the tokens whose attention_mask is 0 (fx/padding.py)
        hook_observers(out)
    keep_statistics_local(out)  # DDP(broadcast_buffers=True) must not overwrite the ranks' statistics (observer.ddp)
    return guard_loading(out).train(is_qat)  # (load_state_dict: all or nothing)


def prepare_fx(model: nn.Module, qconfig_mapping: Any = None, example_inputs: tuple[Any, ...] | None = None,
               inplace: bool = False, prepare_custom_config: Any = None) -> fx.GraphModule:
    """Trace ``model`` and insert observers for static post-training quantization (eval mode).

    ``qconfig_mapping``: ``None`` (``get_default_qconfig_mapping()``), a ``QConfig``, a
    ``QConfigMapping`` or a qconfig dict. ``example_inputs`` (a tuple, recommended): one forward
    pass tells tensors from sizes and scalars (without it a heuristic decides). The model must be
    in eval mode when it has conv/linear-BN runs (they are folded). Returns a ``GraphModule``
    whose ``lowbit_report`` lists fused runs, float ops and untraceable submodules (a model whose
    own ``forward`` cannot be traced is returned as itself, its children prepared). ``inplace=True``
    skips the deep copy: the model's own modules are reused (and given ``.qconfig`` attributes).
    ``prepare_custom_config`` (a ``lowbit.custom_config.PrepareCustomConfig``, torch.ao's, or its
    dict form): custom observed modules, non-traceable modules, quantized input/output indexes and
    preserved attributes (see ``lowbit.custom_config``).
    """
    return _prepare("prepare_fx", model, qconfig_mapping, example_inputs, inplace, False, prepare_custom_config)


def prepare_qat_fx(model: nn.Module, qconfig_mapping: Any = None, example_inputs: tuple[Any, ...] | None = None,
                   inplace: bool = False, prepare_custom_config: Any = None) -> fx.GraphModule:
    """``prepare_fx`` for quantization-aware training: BN runs stay trainable (``nni.qat.ConvBn2d`` ...),
    layers become ``lowbit.nn.qat`` modules, observers are ``FakeQuantize`` (default
    ``get_default_qat_qconfig_mapping()``). Returns the ``GraphModule`` in train mode."""
    return _prepare("prepare_qat_fx", model, qconfig_mapping, example_inputs, inplace, True, prepare_custom_config)
