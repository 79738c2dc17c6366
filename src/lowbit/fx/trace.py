"""Symbolic tracing for graph mode, robust to submodules that cannot be traced.

``trace(model)`` runs ``torch.fx`` symbolic tracing with ``torch.nn`` and ``lowbit`` modules as
leaves. When tracing fails inside a submodule (data-dependent control flow such as
``if x.sum() > 0``, ``len(proxy)``, ...), that innermost submodule becomes a leaf and tracing is
retried; the paths of such *opaque* submodules are returned so graph mode can prepare their
children one by one. A failure in the root's own ``forward`` raises ``RootNotTraceable`` (a
``ValueError``). A root that is itself a leaf type (a bare ``nn.Linear``) is traced as a
wrapper's child ``module``.

A forward that changes one of its buffers (``self.n += 1``, ``self.running.mul_(0.9)``) is not traceable either:
torch.fx runs such an update once, on the real buffer, while tracing, and records neither it nor the reads after it
(they become frozen constants, or the buffer is dropped from the graph module); the module whose buffer changed
becomes an opaque leaf the same way (the root: ``RootNotTraceable``) and the buffer is restored.

Every node records the dotted path of the module whose ``forward`` produced it in
``node.meta["lowbit_scope"]`` (a leaf module's node records its own path).

>>> import torch
>>> from torch import nn
>>> class Branchy(nn.Module):
...     def forward(self, x):
...         return x * 2 if x.sum() > 0 else x
>>> m = nn.Sequential(nn.Linear(2, 2), Branchy())
>>> gm, opaque = trace(m)
>>> list(opaque), [n.op for n in gm.graph.nodes]
(['1'], ['placeholder', 'call_module', 'call_module', 'output'])
"""

from __future__ import annotations

import inspect
import operator
import os
import traceback
from typing import Any

import torch
from torch import fx, nn

from ..fx_leaves import LOWBIT_LEAVES
from .inplace import AUGMENTED_OPS, reroute_inplace
from .none_args import name_specialised
from .masks import mask_facts

__all__ = ["trace", "record_tensor_kinds", "float_layout", "RootNotTraceable", "keep_buffers", "restore_buffers"]

_MAX_RETRIES = 64
Leaves = tuple[set[int], set[type]]  # (ids of leaf modules, leaf module types)
_LOWBIT_LEAVES = LOWBIT_LEAVES  # (the classes fx_leaves.FxLeaf keeps whole in any torch.fx trace)


class RootNotTraceable(ValueError):
    """The model's own ``forward`` cannot be traced (its children may still be); ``cause``: why, in one line."""

    cause = ""


_ITERATED = "Proxy object cannot be iterated"  # torch.fx's TraceError for `a, *rest = t.chunk(n)` / `for p in t.split(k)`


def _user_line(err: BaseException) -> str:
    """`` at file.py:LINE `code` ``: the last frame of ``err``'s traceback outside torch and lowbit's graph mode (the
    model's line that failed to trace), or ``""``."""
    torch_dir = os.path.dirname(torch.__file__)
    user = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(torch_dir)
            and "/lowbit/fx/" not in f.filename.replace(os.sep, "/")]
    if not user:
        return ""
    return f" at {os.path.basename(user[-1].filename)}:{user[-1].lineno} `{(user[-1].line or '').strip()}`"


def describe_trace_error(err: BaseException, graph: fx.Graph | None = None) -> str:
    """``err`` in one line with the model's source line that raised it (control flow on a traced value names the
    ``if``); for a traced tensor that was iterated (star-unpacking, a ``for`` loop over the parts of ``chunk`` /
    ``split`` / ``unbind``), also the node that produced it (the last one traced) and the traceable spellings."""
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    if _ITERATED not in str(err):
        return text + _user_line(err)
    text = f"{type(err).__name__}: {_ITERATED}"
    last = next((n for n in reversed(graph.nodes) if n.op in ("call_function", "call_method")), None) if graph else None
    if last is not None:
        target = last.target if isinstance(last.target, str) else getattr(last.target, "__name__", str(last.target))
        text += f" (the result of node '{last.name}', {target})"
    return (text + _user_line(err) + ": a traced tensor's parts must be unpacked into a fixed number of names "
            "(`a, b = x.chunk(2)`) or indexed (`parts[i]` for i in range(n)), not star-unpacked or looped over")


class _LeafRoot(nn.Module):
    """Wraps a leaf-type root (``nn.Linear`` ...) so the traced graph holds one ``call_module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Any) -> Any:
        return self.module(x)


class _Proxy(fx.Proxy):
    """A traced value whose item assignment, ``x[i] = v``, is recorded as an ``operator.setitem(x, i, v)`` node
    (torch.fx's ``Proxy`` has no ``__setitem__``: the statement raised ``TypeError`` and the module, or the whole
    model, was not traced); ``fx/inplace.py`` then replays the write on a float copy for the later readers of ``x``."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __getattr__(self, k: str) -> Any:  # (``x.T[0] = v``: an attribute's proxy takes item assignment too)
        return _Attribute(self, k)


def _augmented(op: Any) -> Any:
    def method(self: _Proxy, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", op, (self, other), {})
    method.__name__ = f"__{op.__name__}__"
    return method


# ``h += c`` is recorded as ``operator.iadd(h, c)`` (torch.fx's Proxy has no ``__iadd__``: Python fell back to
# ``h = h + c``, so a second name for ``h``, ``g = h``, kept the old values where eager sees the write);
# fx/inplace.py reroutes the later readers of ``h`` and makes the node ``operator.add`` (``h @= w`` rebinds: no
# ``Tensor.__imatmul__``)
for _op in AUGMENTED_OPS:
    setattr(_Proxy, f"__{_op.__name__}__", _augmented(_op))


class _Attribute(fx.proxy.Attribute, _Proxy):
    pass


class _LeafTracer(fx.Tracer):
    """``torch.nn`` / ``lowbit`` modules (and classes with ``_lowbit_fx_leaf = True``) and the given
    ``opaque`` paths are leaves."""

    def __init__(self, opaque: set[str] | None = None, leaves: Leaves | None = None) -> None:
        # torch.fx re-creates the tracer class with no arguments when a GraphModule is unpickled
        super().__init__()
        self.opaque = opaque if opaque is not None else set()
        self.leaf_modules, self.leaf_types = leaves if leaves is not None else (set(), set())

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        if id(m) in self.leaf_modules or type(m) in self.leaf_types:  # prepare_custom_config's leaves
            return True
        if type(m).__module__.startswith(_LOWBIT_LEAVES) or getattr(type(m), "_lowbit_fx_leaf", False):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as err:
            if not hasattr(err, "_lowbit_culprit"):
                err._lowbit_culprit = self.path_of_module(m)  # type: ignore[attr-defined]
            raise

    def create_arg(self, a: Any) -> Any:
        # a NumPy scalar (``scores / np.sqrt(d)``: ``np.float64``) as the Python number it holds: torch.fx writes
        # its repr, ``np.float64(8.0)``, into the generated code, where ``np`` is no name (``NameError`` on the
        # first call)
        if type(a).__module__ == "numpy" and getattr(a, "shape", None) == () and hasattr(a, "item"):
            a = a.item()
        return super().create_arg(a)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["lowbit_scope"] = target if kind == "call_module" else self.scope.module_path
        return node


def trace(model: nn.Module, example_inputs: tuple[Any, ...] | None = None,
          leaves: Leaves | None = None) -> tuple[fx.GraphModule, dict[str, str]]:
    """``(GraphModule, {opaque submodule path: trace error})``; see the module docstring.

    Arguments of ``example_inputs`` that are ``None`` are traced as constants
    (``concrete_args``), so ``if mask is None:`` branches follow the example call. ``leaves``:
    ``(ids of modules, module types)`` traced as leaves besides ``torch.nn``/``lowbit`` ones (the
    non-traceable and custom modules of ``prepare_custom_config``).
    """
    opaque: set[str] = set()
    order: dict[str, str] = {}
    concrete: dict[str, Any] | None = None
    names: list[str] = []
    if _LeafTracer(opaque, leaves).is_leaf_module(model, ""):
        model = _LeafRoot(model)
    elif example_inputs is not None:
        sig = inspect.signature(model.forward)
        names = list(sig.parameters)
        concrete = {k: v for k, v in zip(names, example_inputs) if v is None}
        for k, p in list(sig.parameters.items())[len(example_inputs):]:  # left out: a None default is that
            if p.default is None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):  # constant (as the call)
                concrete[k] = None
        concrete = concrete or None
    kept = keep_buffers(model)
    for _ in range(_MAX_RETRIES):
        tracer = _LeafTracer(opaque, leaves)
        try:
            graph = tracer.trace(model, concrete)
        except Exception as err:
            restore_buffers(kept)
            culprit = getattr(err, "_lowbit_culprit", None)
            cause = describe_trace_error(err, getattr(tracer, "graph", None))
            if culprit is None or culprit == "" or culprit in opaque:
                raise _root_error(model, cause) from err
            opaque.add(culprit)
            order[culprit] = cause
            continue
        changed = restore_buffers(kept)
        if changed:  # (the graph would hold a frozen copy of the buffer, or lose it, and never update it)
            culprit = _mutating_module(model, changed[0], tracer, opaque)
            cause = (f"its forward changes buffer {changed[0]!r} (in place or by assignment), which torch.fx runs "
                     "once while tracing instead of recording it")
            if culprit == "":
                raise _root_error(model, cause)
            opaque.add(culprit)
            order[culprit] = cause
            continue
        if concrete:  # fx renames a specialised placeholder (mask -> mask_1): keep the keyword callable
            for n in graph.nodes:
                if n.op == "placeholder" and n.target not in names and n.target.rpartition("_")[0] in concrete:
                    n.target = n.target.rpartition("_")[0]
            name_specialised(graph, type(model).__name__)
        for n in graph.nodes:  # `from __future__ import annotations` leaves string annotations, which fx's code
            if isinstance(n.type, str):  # generator makes into a global that torch.save / pickle cannot import
                n.type = None
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        reroute_inplace(gm)
        pin_attribute_reads(gm)
        return gm, order
    raise ValueError(f"prepare_fx: gave up tracing {type(model).__name__} after {_MAX_RETRIES} untraceable submodules")


def _root_error(model: nn.Module, cause: str) -> RootNotTraceable:
    err = RootNotTraceable(
        f"prepare_fx: the forward of {type(model).__name__} itself cannot be traced by torch.fx "
        f"({cause}); move data-dependent control flow into a submodule "
        "(its children are then prepared one by one) or use the eager prepare()/convert()")
    err.cause = cause
    return err


Kept = list[tuple[str, nn.Module, str, torch.Tensor, torch.Tensor]]  # (path, owner, name, buffer, its copy)


def keep_buffers(model: nn.Module) -> Kept:
    """Every buffer of ``model`` with a copy, for ``restore_buffers`` after a run that may update them."""
    return [(f"{path}.{name}" if path else name, mod, name, buf, buf.detach().clone())
            for path, mod in model.named_modules(remove_duplicate=False)
            for name, buf in mod._buffers.items() if buf is not None]


def restore_buffers(kept: Kept) -> list[str]:
    """Put back the buffers ``keep_buffers`` saw (object and value); the paths of those that had changed."""
    changed = []
    for path, mod, name, buf, copy in kept:
        now = mod._buffers.get(name)
        if now is buf and buf.shape == copy.shape and (torch.equal(buf, copy) or (
                buf.is_floating_point() and torch.equal(buf.isnan(), copy.isnan())
                and torch.equal(buf.nan_to_num(), copy.nan_to_num()))):
            continue
        changed.append(path)
        mod._buffers[name] = buf
        with torch.no_grad():
            if buf.shape == copy.shape:
                buf.copy_(copy)
            else:
                buf.data = copy.clone()
    return changed


def _mutating_module(model: nn.Module, buffer: str, tracer: _LeafTracer, opaque: set[str]) -> str:
    """The module to make opaque for a buffer changed while tracing: the buffer's owner, or the first traced
    ancestor (a leaf, such as a BatchNorm changed by its parent's forward, or one already opaque, is not run)."""
    path = buffer.rpartition(".")[0]
    while path and (path in opaque or tracer.is_leaf_module(model.get_submodule(path), path)):
        path = path.rpartition(".")[0]
    return path


def pin_attribute_reads(gm: fx.GraphModule) -> None:
    """A ``get_attr`` of a parameter / buffer of a module the graph calls (``self.conv.weight.shape``,
    ``F.linear(h, self.emb.weight)``) reads the same tensor under a root alias (``conv_weight``): prepare may fuse
    that module (a fused conv has no ``weight``, a BN-folded one another value) and convert swaps it for an int8
    module whose ``weight`` is a method, so the read failed (in prepare_fx, or when the converted model ran)."""
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    aliases: dict[str, str] = {}
    for node in gm.graph.nodes:
        owner, _, attr = str(node.target).rpartition(".")
        if node.op != "get_attr" or owner not in called:
            continue
        if node.target not in aliases:
            value = getattr(gm.get_submodule(owner), attr)
            if not isinstance(value, torch.Tensor):
                continue
            alias = base = str(node.target).replace(".", "_")
            i = 0
            while hasattr(gm, alias):
                i += 1
                alias = f"{base}_{i}"
            if isinstance(value, nn.Parameter):
                gm.register_parameter(alias, value)
            else:
                gm.register_buffer(alias, value)
            aliases[node.target] = alias
        node.meta["lowbit_attr"] = node.target  # (what it reads: an embedding whose table is read stays float)
        node.target = aliases[node.target]
    if aliases:
        gm.recompile()


def float_layout(t: torch.Tensor) -> str | None:
    """The name of the ``torch`` memory format ``t`` is dense in (row-major first; ``None``: a strided view): what a
    layout read (``as_strided``, ``stride()``) of the float model's value assumes, where an int8 kernel's codes may be
    channels-last (``meta["lowbit_layout"]``, a name: ``torch.save`` pickles no ``torch.memory_format``; read by
    ``convert_fx``'s ``dequantize`` step).

    >>> float_layout(torch.ones(2, 3, 4, 4)), float_layout(torch.ones(2, 3, 4, 4).permute(0, 2, 3, 1))
    ('contiguous_format', None)
    """
    names = ["contiguous_format"] + ["channels_last"] * (t.dim() == 4) + ["channels_last_3d"] * (t.dim() == 5)
    return next((f for f in names if t.is_contiguous(memory_format=getattr(torch, f))), None)


def record_tensor_kinds(gm: fx.GraphModule, example_inputs: tuple[Any, ...] | None) -> None:
    """Set ``node.meta["lowbit_ftensor"]`` (the value is a floating-point tensor) and ``["lowbit_scalar"]``.

    With ``example_inputs`` the graph is run once and the values are inspected; without, a
    heuristic says every node is a float tensor except size/shape queries and arithmetic on them.
    """
    if example_inputs is not None:
        class _Rec(fx.Interpreter):
            def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
                if str(target).startswith("**"):  # ``forward(x, **kw)``: the Interpreter gave the positional rest,
                    return {}  # a list (``'list' object has no attribute 'get'``); example_inputs pass no keywords
                return super().placeholder(target, args, kwargs)

            def run_node(self, n: fx.Node) -> Any:
                out = super().run_node(n)
                n.meta["lowbit_ftensor"] = isinstance(out, torch.Tensor) and out.is_floating_point()
                n.meta["lowbit_scalar"] = isinstance(out, (int, float)) and not isinstance(out, bool)
                n.meta["lowbit_ftuple"] = isinstance(out, (tuple, list)) and len(out) > 0 and all(
                    isinstance(t, torch.Tensor) and t.is_floating_point() for t in out)  # chunk / split
                if isinstance(out, torch.Tensor):
                    n.meta["lowbit_rank"] = out.dim()
                    n.meta["lowbit_layout"] = float_layout(out)
                    n.meta.update(mask_facts(out))  # (fx/masks.py: 0 / -1e4 values, a 0 / c operand, zeros)
                elif n.meta["lowbit_scalar"]:
                    n.meta["lowbit_number"] = float(out)
                return out

        with torch.no_grad():
            _Rec(gm).run(*example_inputs)
        for n in gm.graph.nodes:  # nodes not reached (none in a straight-line graph)
            n.meta.setdefault("lowbit_ftensor", False)
            n.meta.setdefault("lowbit_scalar", False)
        return
    for n in gm.graph.nodes:
        inputs = [a for a in n.all_input_nodes]
        if n.op == "placeholder" and n.args:  # has a default (often None): not assumed to be a tensor
            n.meta["lowbit_ftensor"] = n.meta["lowbit_scalar"] = False
            continue
        if n.op == "call_method" and n.target in ("size", "dim", "numel"):
            val = False
        elif n.op == "call_function" and (n.target in (getattr, len) or _is_scalar_math(n, inputs)):
            val = False
        elif _non_float_result(n):  # comparisons, argmax, masks, integer / bool casts: no activation grid
            n.meta["lowbit_ftensor"] = n.meta["lowbit_scalar"] = False
            continue
        elif n.op == "output":
            val = False
        else:
            val = True
        n.meta["lowbit_ftensor"] = val
        n.meta["lowbit_scalar"] = not val and n.op != "output"


_NON_FLOAT = {"gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal", "less_equal", "not_equal",
              "argmax", "argmin", "argsort", "isnan", "isinf", "isfinite", "isclose", "logical_and", "logical_or",
              "logical_not", "logical_xor", "bool", "long", "int", "byte", "char", "short", "nonzero", "bucketize",
              "searchsorted", "eq_", "any", "all", "count_nonzero"}


def _non_float_result(n: fx.Node) -> bool:
    """Whether ``n`` (without example inputs to run) yields a bool / integer tensor by its op alone."""
    if n.op == "call_method":
        return n.target in _NON_FLOAT or (n.target == "to" and any(a in (torch.bool, torch.long, torch.int)
                                                                  for a in (*n.args[1:], *n.kwargs.values())))
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        return name in _NON_FLOAT or name in ("not_", "and_", "or_", "invert")
    return False


def _is_scalar_math(n: fx.Node, inputs: list[fx.Node]) -> bool:
    """``operator`` arithmetic whose node inputs are all non-tensors (``x.size(-1) ** 0.5``)."""
    mod = getattr(n.target, "__module__", None)
    return mod == "_operator" and bool(inputs) and not any(a.meta.get("lowbit_ftensor", True) for a in inputs)
