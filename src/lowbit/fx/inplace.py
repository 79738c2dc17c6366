"""In-place ops in a traced graph: make the values they change visible to the ops that read them later.

A graph node's value is what it returned; a tensor an in-place op changed keeps its old node. So after tracing
``y.relu_(); return conv(y)``, ``conv`` reads ``y``'s node, and graph mode quantizes the tensor before the ReLU (the
ReLU's result is dropped; torch.ao has the same flaw). ``reroute_inplace`` makes every later reader of a changed
tensor read the in-place op's result instead (the same tensor in eager mode), for:

- ``x.relu_()``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)(x)``: ``x`` changed;
- ``torch.add(a, b, out=a)``: the ``out`` tensor changed (its readers read the result);
- an in-place op on a view of the whole tensor, ``a.view(n, c, -1).mul_(3)``, ``a.flatten(1).add_(1)``
  (``view`` / ``reshape`` / ``flatten`` / ``unflatten`` / ``squeeze`` / ``unsqueeze`` / ``view_as`` /
  ``reshape_as``, chained): the base's later readers read ``result.reshape(base.size())``.

An in-place op on a part of a tensor (``a[:, :4].mul_(2)``, ``a.narrow(1, 0, 4).zero_()``, ``a.t().add_(1)``)
changes values no node holds: it is named in a warning (the quantized model reads ``a`` as it was; 3.6 dB).

>>> import torch
>>> from torch import fx
>>> def f(x):
...     x.view(-1).mul_(2)
...     return x + 1
>>> gm = fx.symbolic_trace(f)
>>> reroute_inplace(gm)
1
>>> bool(torch.equal(gm(torch.ones(2, 2)), f(torch.ones(2, 2))))
True
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch import fx, nn

__all__ = ["reroute_inplace"]

_WHOLE_VIEWS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_WHOLE_VIEW_FUNCS = {torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze}
_PART_VIEWS = {"narrow", "select", "t", "transpose", "permute", "diagonal", "expand", "unfold", "as_strided",
               "movedim", "swapaxes"}
_PART_VIEW_FUNCS = {operator.getitem, torch.narrow, torch.select, torch.transpose, torch.permute, torch.t,
                    torch.diagonal, torch.movedim, torch.swapaxes}


def _mutates_first_arg(node: fx.Node, mods: dict[str, nn.Module]) -> bool:
    """An in-place op on ``node.args[0]``: ``x.relu_()``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)``,
    ``nn.ReLU(inplace=True)(x)`` (each returns the tensor it changed)."""
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return node.kwargs.get("inplace") is True or (name.endswith("_") and not name.startswith("_")
                                                      and getattr(node.target, "__module__", "") in ("torch",
                                                                                                      "torch._C._VariableFunctions"))
    if node.op == "call_module":
        return getattr(mods.get(str(node.target)), "inplace", False) is True
    return False


def _changed(node: fx.Node, mods: dict[str, nn.Module]) -> fx.Node | None:
    """The node whose tensor ``node`` changes in place (its ``out=`` tensor or its first argument), else ``None``."""
    out = node.kwargs.get("out") if node.op == "call_function" else None
    if isinstance(out, fx.Node):
        return out
    src = node.args[0] if node.args else None
    return src if isinstance(src, fx.Node) and _mutates_first_arg(node, mods) else None


def _view_of(node: fx.Node, names: set[str], funcs: set[object]) -> fx.Node | None:
    """The tensor ``node`` is a view of, when it is one of the listed ops, else ``None``."""
    hit = (node.op == "call_method" and node.target in names) or (node.op == "call_function" and node.target in funcs)
    base = node.args[0] if hit and node.args else None
    return base if isinstance(base, fx.Node) else None


def _part_base(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` is a partial view of (through a chunk / split / unbind it indexes), else ``None``; an int
    index of anything else may be a tuple's item (``out, state = lstm(x)``), not a view: ``None``."""
    base = _view_of(node, _PART_VIEWS, _PART_VIEW_FUNCS)
    if base is None:
        return None
    if node.target is operator.getitem:
        if _view_of(base, {"chunk", "split", "unbind", "tensor_split"},
                    {torch.chunk, torch.split, torch.unbind, torch.tensor_split}) is not None:
            return base.args[0]  # type: ignore[return-value]
        if isinstance(node.args[1], int):
            return None
    return base


def _reroute(src: fx.Node, new: fx.Node, after: int, order: dict[fx.Node, int], skip: set[fx.Node]) -> int:
    """Readers of ``src`` placed after position ``after`` read ``new``; return how many."""
    moved = 0
    for user in list(src.users):
        if user not in skip and order.get(user, len(order)) > after:
            user.replace_input_with(src, new)
            moved += 1
    return moved


def reroute_inplace(gm: fx.GraphModule) -> int:
    """Make every later reader of a tensor an in-place op changed read the op's result instead (module doc); warn for
    an in-place op on a part of a tensor. Returns how many inputs it rerouted."""
    mods = dict(gm.named_modules())
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    moved = 0
    for node in nodes:
        target = _changed(node, mods)
        if target is None:
            continue
        moved += _reroute(target, node, order[node], order, {node})
        value, cur = node, target
        while (base := _view_of(cur, _WHOLE_VIEWS, _WHOLE_VIEW_FUNCS)) is not None:
            if any(order.get(u, -1) > order[node] for u in base.users):
                with gm.graph.inserting_after(value):
                    size = gm.graph.call_method("size", (base,))
                with gm.graph.inserting_after(size):
                    whole = gm.graph.call_method("reshape", (value, size))
                moved += _reroute(base, whole, order[node], order, {size, whole, cur})
                value = whole
            cur = base
        part = _part_base(cur)
        if part is not None and any(order.get(u, -1) > order[node] for u in part.users):
            warnings.warn(f"prepare_fx: the in-place '{node.name}' ({node.target if node.op != 'call_module' else 'module'}"
                          f") changes a part of '{part.name}' ('{cur.name}'), which graph mode cannot follow: its later "
                          f"readers read '{part.name}' as it was; write it out of place (e.g. torch.cat)", stacklevel=2)
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved
