"""What an untraceable forward reads of its children, kept on their prepared graphs.

A module whose own ``forward`` torch.fx cannot trace keeps that forward and has each child prepared one by one
(``prepare.py``): the child becomes a ``GraphModule``, a leaf layer (``nn.Linear``) one that calls it as ``module``.
Such a graph holds only what it runs, so the parent's own reads of the child, ``F.linear(x, self.proj.weight * 0.5)``,
tied weights ``x @ self.emb.weight.t()``, ``self.proj.weight.shape[0]`` or ``self.proj.out_features``, failed when the
prepared model first ran (``AttributeError: '_LeafRoot' object has no attribute 'weight'``), and after ``convert_fx``
the child's ``weight`` would be the int8 module's method. ``keep_child_reads`` gives the graph the attributes the
parent's class reads, ``self.<child>.<attr>`` in its source (every tensor and plain attribute when the source
cannot be read): a parameter / buffer as the same tensor (the parent reads the float parameter, the child's own
call is quantized; ``convert_fx`` leaves it float), read by a ``get_attr`` node no value depends on so that
``deepcopy`` and ``pickle`` (which keep what the graph reads) keep it; a number, string or tuple as a preserved
attribute.

>>> import torch
>>> from torch import fx, nn
>>> class Parent(nn.Module):
...     def forward(self, x):
...         return x @ self.proj.weight.t() * self.proj.out_features
>>> parent = Parent()
>>> parent.proj = nn.Linear(2, 3)
>>> gm = fx.symbolic_trace(nn.Sequential(parent.proj))
>>> keep_child_reads(parent, "proj", gm)  # (a doctest's class has no source to read: every attribute)
['bias', 'in_features', 'out_features', 'weight']
>>> gm.weight is parent.proj.weight, gm.out_features
(True, 3)
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import warnings
import torch
from torch import fx, nn
from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY

from .state import STATE_KEY

__all__ = ["keep_child_reads", "read_attributes"]

_PLAIN = (bool, int, float, str, tuple, torch.Size, torch.dtype, type(None))


def read_attributes(cls: type, name: str) -> set[str] | None:
    """The attributes ``attr`` that methods of ``cls`` (and its bases below ``nn.Module``) read as
    ``self.<name>.<attr>``; ``None`` when a source cannot be read.

    >>> from lowbit.nn.intrinsic.qat.modules import BnFoldedBase  # (self.layer.weight, self.layer._conv_forward(...))
    >>> sorted(read_attributes(BnFoldedBase, "layer"))
    ['_conv_forward', 'bias', 'weight']
    >>> class M(nn.Module):  # (a class typed in a doctest or a REPL has no source file)
    ...     def forward(self, x):
    ...         return x * self.fc.weight.shape[0]
    >>> read_attributes(M, "fc") is None
    True
    """
    reads = _class_reads(cls)
    return None if reads is None else set(reads.get(name, ()))


@functools.lru_cache(maxsize=256)
def _class_reads(cls: type) -> dict[str, frozenset[str]] | None:
    """``{child name: the attributes read of it}`` over the methods of ``cls`` (``"child.sub"``: of its submodule
    ``sub``, ``self.child.sub.attr``); ``None`` without a source."""
    found: dict[str, set[str]] = {}
    for base in cls.__mro__:
        if base in (nn.Module, object) or not issubclass(base, nn.Module) or base.__module__.startswith("torch."):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            return None
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
                continue
            me = fn.args.args[0].arg
            for node in ast.walk(fn):
                inner = node.value if isinstance(node, ast.Attribute) else None
                if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == me:
                    found.setdefault(inner.attr, set()).add(node.attr)  # type: ignore[union-attr]
                outer = inner.value if isinstance(inner, ast.Attribute) else None
                if isinstance(outer, ast.Attribute) and isinstance(outer.value, ast.Name) and outer.value.id == me:
                    found.setdefault(f"{outer.attr}.{inner.attr}", set()).add(node.attr)  # type: ignore[union-attr]
    return {k: frozenset(v) for k, v in found.items()}


def keep_child_reads(parent: nn.Module, name: str, new: nn.Module, where: str = "prepare_fx") -> list[str]:
    """Give ``new``, the prepared graph of ``parent``'s child ``name`` (``parent``'s forward is not traced; called
    before ``new`` replaces the child), the attributes of the child the parent's class reads that ``new`` lacks
    (module doc); their names, sorted. A read of a tensor of the child's own submodule, ``self.block.fc.weight``,
    cannot be kept (the graph fuses, observes and converts ``fc``): warned, naming it (``where``: who prepares)."""
    child = parent._modules[name]
    if not isinstance(new, fx.GraphModule) or new is child or child is None:
        return []
    _warn_deep_reads(parent, name, child, where)
    wanted = read_attributes(type(parent), name)
    if wanted is None:
        wanted = {*child._parameters, *child._buffers, *(k for k, v in vars(child).items()
                                                         if not k.startswith("_") and isinstance(v, _PLAIN))}
    kept = []
    for attr in sorted(wanted):
        if attr.startswith("__") or _has(new, attr):
            continue
        try:
            value = getattr(child, attr)
        except AttributeError:
            continue
        if isinstance(value, nn.Parameter):
            new.register_parameter(attr, value)
        elif isinstance(value, torch.Tensor) and attr in child._buffers:
            new.register_buffer(attr, value, persistent=attr not in child._non_persistent_buffers_set)
        elif isinstance(value, _PLAIN) and attr in vars(child):
            setattr(new, attr, value)  # (deepcopy sets the preserved ones again; a pickled prepared graph's are put
            new.meta.setdefault(_USER_PRESERVED_ATTRIBUTES_KEY, {})[attr] = value  # back from its state by restore)
            new.meta.get(STATE_KEY, {}).setdefault("kept_reads", {})[attr] = value
            kept.append(attr)
            continue
        else:
            continue
        first = next((n for n in new.graph.nodes if n.op != "placeholder"), None)
        with new.graph.inserting_before(first):
            node = new.graph.get_attr(attr)
        node.meta.update(lowbit_inserted=True, lowbit_kind="float", lowbit_domain="float", lowbit_kept_read=True)
        kept.append(attr)
    if kept:
        new.recompile()
    return kept


def _has(gm: nn.Module, attr: str) -> bool:
    return attr in gm._modules or attr in gm._parameters or attr in gm._buffers or attr in vars(gm) or hasattr(
        type(gm), attr)


def _warn_deep_reads(parent: nn.Module, name: str, child: nn.Module, where: str) -> None:
    cls = type(parent).__name__
    for key, attrs in sorted((_class_reads(type(parent)) or {}).items()):
        head, _, sub = key.partition(".")
        inner = child._modules.get(sub) if head == name and sub else None
        for attr in sorted(attrs):
            if inner is not None and isinstance(getattr(inner, attr, None), torch.Tensor):
                warnings.warn(f"{where}: the forward of {cls} (not traced) reads self.{name}.{sub}.{attr}, which "
                              f"graph mode cannot keep: the prepared '{name}' fuses, observes and converts '{sub}' "
                              f"(the read fails or meets the int8 module's method); read it from a child of {cls} "
                              f"itself, make {cls}'s forward traceable, or declare '{name}' non-traceable",
                              stacklevel=7)
