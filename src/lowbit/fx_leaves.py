"""lowbit modules as one ``call_module`` node in any torch.fx trace (``FxLeaf``, ``leaf_method``).

torch.fx's default ``Tracer.is_leaf_module`` keeps only ``torch.nn`` / ``torch.ao.nn`` classes whole and runs the
``forward`` of any other module on proxies: an observer's or a quantized module's Python (type checks, scales read
with ``float()``, in-place statistics) broke there, so ``torch.fx.symbolic_trace`` of a prepared or converted model
failed where lowbit's own tracer (``fx/trace.py``) keeps these classes whole.

Each subclass of ``FxLeaf`` defined under ``LOWBIT_LEAVES`` (or with ``_lowbit_fx_leaf = True``: the classes
lowbit's tracer keeps whole) has its ``forward`` wrapped: while a ``Tracer.trace`` runs (torch.fx's
``_is_fx_tracing_flag``) and an argument holds a ``Proxy``, the call is
``tracer.create_proxy("call_module", tracer.path_of_module(self), args, kwargs)`` (what ``Tracer.call_module``
records for a leaf), whatever the tracer's class, and the re-traced GraphModule runs the same module object. The
``forward`` runs as before when called on values, as the traced root (its forward is the graph), from a module not
under the root, or through ``super().forward`` from a subclass's own ``forward`` (a class outside ``LOWBIT_LEAVES``:
traced through, as torch.fx does for any non-``torch.nn`` class).

The wrapper is generated with the ``forward``'s own signature (defaults, keyword names), so an eager call pays one
plain Python call and one attribute read: +35 ns per module call against +260 ns for a ``*args, **kwargs``
wrapper (identity module, 1 thread).

>>> import torch
>>> from torch import fx, nn
>>> class Scale(FxLeaf, nn.Module):
...     _lowbit_fx_leaf = True
...     def forward(self, x, k=2):
...         return x * k if float(x.abs().max()) > 0 else x  # (data-dependent: not traceable)
>>> gm = fx.symbolic_trace(nn.Sequential(Scale(), nn.ReLU()))
>>> [n.op for n in gm.graph.nodes], gm(torch.ones(1)).tolist(), Scale()(torch.ones(1), k=3).tolist()
(['placeholder', 'call_module', 'call_module', 'output'], [2.0], [3.0])
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

from . import compile_state
from .compile_state import _proxy_in

__all__ = ["FxLeaf", "leaf_method", "LOWBIT_LEAVES"]

LOWBIT_LEAVES = ("lowbit.nn.", "lowbit.observer", "lowbit.fake_quant", "lowbit.stubs")  # (module paths of leaf classes)

_F = TypeVar("_F", bound=Callable[..., Any])
_FX = compile_state._fx_trace if not compile_state._NO_FX_FLAG else types.SimpleNamespace(_is_fx_tracing_flag=True)


class FxLeaf:
    """Mixin: see the module docstring (the subclasses' ``forward`` become leaf forwards)."""

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = getattr(cls, "forward", None)
        if (callable(forward) and not getattr(forward, "__isabstractmethod__", False)
                and not getattr(forward, "_lowbit_leaf_forward", False)
                and (cls.__module__.startswith(LOWBIT_LEAVES) or getattr(cls, "_lowbit_fx_leaf", False))):
            cls.forward = _leaf(forward, None)  # type: ignore[attr-defined]


def leaf_method(method: _F) -> _F:
    """A method of an ``FxLeaf`` module whose ``forward(name, *args, **kwargs)`` calls ``getattr(self, name)``
    (``QFunctional.add`` ...): while torch.fx traces, a call with a proxy argument is the module's ``call_module``
    node with ``(name, *args)``, as a converted graph writes it; otherwise the method runs."""
    return _leaf(method, method.__name__)  # type: ignore[return-value]


def _leaf(fn: Callable[..., Any], method: str | None) -> Callable[..., Any]:
    """``fn`` behind the trace check, generated with ``fn``'s signature (``_generic`` where it has none to copy)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - a builtin forward
        return _generic(fn, method)
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return _generic(fn, method)
    heads: list[str] = []  # the def's parameters
    pos: list[str] = []  # fn's positional arguments (the call's and the node's)
    kws: list[str] = []  # its keyword arguments, as `name=name` / `**name`
    env: dict[str, Any] = {}
    for i, p in enumerate(params):
        head = p.name
        if p.default is not p.empty:
            env[f"_d{i}"] = p.default
            head += f"=_d{i}"
        if p.kind is p.KEYWORD_ONLY and not any(h.startswith("*") for h in heads):
            heads.append("*")
        if p.kind is p.VAR_POSITIONAL:
            heads.append(f"*{p.name}")
            pos.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            heads.append(f"**{p.name}")
            kws.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            heads.append(head)
            kws.append(f"{p.name}={p.name}")
        else:
            heads.append(head)
            pos.append(p.name)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            heads.append("/")
    self_name = pos[0]
    node_args = "".join(f"{a}, " for a in ([repr(method)] if method else []) + pos[1:])
    guard = "" if method else f" and type({self_name}).forward is leaf"
    src = (f"def leaf({', '.join(heads)}):\n"
           f"    if _FX._is_fx_tracing_flag{guard}:\n"
           f"        node = _module_node({self_name}, ({node_args}), dict({', '.join(kws)}))\n"
           f"        if node is not None:\n"
           f"            return node\n"
           f"    return _fn({', '.join(pos + kws)})\n")
    scope = {"_FX": _FX, "_module_node": _module_node, "_fn": fn, **env}
    exec(compile(src, f"<lowbit leaf {fn.__qualname__}>", "exec"), scope)  # noqa: S102 (our own source text)
    return _marked(functools.wraps(fn)(scope["leaf"]))


def _generic(fn: Callable[..., Any], method: str | None) -> Callable[..., Any]:
    @functools.wraps(fn)
    def leaf(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _FX._is_fx_tracing_flag and (method or type(self).forward is leaf):
            node = _module_node(self, (method, *args) if method else args, kwargs)
            if node is not None:
                return node
        return fn(self, *args, **kwargs)
    return _marked(leaf)


def _marked(leaf: Callable[..., Any]) -> Callable[..., Any]:
    leaf._lowbit_leaf_forward = True  # type: ignore[attr-defined]
    return leaf


def _module_node(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``call_module`` proxy of ``module(*args, **kwargs)`` in the running trace, or ``None`` (the body runs):
    no proxy among the arguments, or the module is the traced root (its forward is the graph) or not under it."""
    proxy = _proxy_in(args) if not kwargs else _proxy_in((*args, *kwargs.values()))
    if proxy is None:
        return None
    tracer = proxy.tracer
    try:
        path = tracer.path_of_module(module)
    except (NameError, AttributeError):  # (not installed under the root; a tracer without a root)
        return None
    return tracer.create_proxy("call_module", path, args, kwargs) if path else None
