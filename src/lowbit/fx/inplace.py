"""In-place ops in a traced graph: make the values they change visible to the ops that read them later.

A graph node's value is what it returned; a tensor an in-place op changed keeps its old node. So after tracing
``y.relu_(); return conv(y)``, ``conv`` reads ``y``'s node, and graph mode quantizes the tensor before the ReLU (the
ReLU's result is dropped; torch.ao has the same flaw). ``reroute_inplace`` makes every later reader of a changed
tensor read the in-place op's result instead (the same tensor in eager mode), for:

- ``x.relu_()``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)(x)``, ``F.hardtanh_(x)``:
  ``x`` changed; ``torch.add(a, b, out=a)``: the ``out`` tensor changed (its readers read the result);
- ``h += c``, ``h *= c``, ``h -= t`` ... (``operator.iadd`` / ``imul`` / ``isub`` ... as ``fx/trace.py`` records
  them): ``h`` changed, so ``g = h`` before it reads the sum as in eager; then ``operator.add`` / ``mul`` ... (torch.ao's
  key: it traces ``h = h + c``) unless ``h`` is a graph input; on a number, size or tuple just the out-of-place op;
- an in-place op on a view of the whole tensor, ``a.view(n, c, -1).mul_(3)``, ``a.flatten(1).add_(1)``
  (``view`` / ``reshape`` / ``flatten`` / ``unflatten`` / ``squeeze`` / ``unsqueeze`` / ``view_as`` /
  ``reshape_as``, chained): the base's later readers read ``result.reshape(base.size())``.

A write to a *part* of a tensor ``a`` (``a[:, :4].mul_(2)``, ``a.narrow(1, 0, 4).zero_()``, ``a.t()[0].add_(1)``,
``a.__setitem__(0, b)``, ``a[:, 2].index_put_(...)``, ``F.relu(a[:, 4:], inplace=True)``, a chunk item) changes
values no node holds. It is replayed on a float copy, in eager order: ``a2 = writable_copy(a)`` (a clone; a
``QTensor`` is dequantized), the views from ``a`` to the written part taken again on ``a2``, the write on that view
(``meta["lowbit_writes_part"]``: it stays float), then ``written(a2, write)`` (``a2`` once the write ran). Every
later reader of ``a`` reads ``written``; of a view of ``a`` made before the write (unless an int index tells it
apart: ``out, h = lstm(x)``), that view taken on ``written``; of the write's result, the replayed write. So
``a[:, :4] ← 2·a[:, :4]`` is computed in float and the observers of the readers see the written values; readers
before the write read ``a`` as it was (a graph input is no longer changed for the caller).

``x.relu_()`` / ``torch.relu_(x)`` / ``x.squeeze_()`` / ``x.unsqueeze_(d)`` / ``x.detach_()`` on a whole tensor that
is not a graph input or attribute become their out-of-place twins once their readers are rerouted (torch.ao runs
them on the quantized tensor; ``meta["lowbit_target"]`` keeps the in-place target for the qconfig mapping's keys);
so do ``y.add_(x)`` / ``mul_`` / ``sub_`` / ``div_`` / ``clamp_`` / ``sigmoid_`` / ``tanh_`` / ``torch.clamp_`` /
``F.hardtanh_`` / ``F.leaky_relu_`` / ``F.elu_``, which graph mode then runs in int8 (left float as in-place ops).

>>> import torch
>>> from torch import fx
>>> def f(x):
...     x.view(-1).mul_(2)
...     y = x + 1
...     y[:, :1].zero_()
...     return y * 3
>>> gm = fx.symbolic_trace(f)
>>> reroute_inplace(gm)
3
>>> bool(torch.equal(gm(torch.ones(2, 2)), f(torch.ones(2, 2))))
True
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..compile_state import graph_leaf
from ..qtensor import QTensor

__all__ = ["AUGMENTED_OPS", "reroute_inplace", "writable_copy", "written"]

_WHOLE_VIEWS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_WHOLE_VIEW_FUNCS = {torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze}
# every other op whose result may share the tensor's memory (a copy where torch copies: replayed as written)
_PART_VIEWS = {"narrow", "select", "t", "transpose", "permute", "diagonal", "expand", "expand_as", "unfold",
               "as_strided", "movedim", "moveaxis", "swapaxes", "swapdims", "contiguous", "detach", "unbind", "chunk",
               "split", "tensor_split", "split_with_sizes", "view_as_real", "view_as_complex",
               # the tensor itself when nothing changes (a float32 CPU tensor's .float() / .to(torch.float32)), a
               # view of a contiguous one (ravel): replayed, so a copy stays a copy and self stays self
               "float", "to", "type", "type_as", "cpu", "ravel"}
_PART_VIEW_FUNCS = {operator.getitem, torch.narrow, torch.select, torch.transpose, torch.permute, torch.t,
                    torch.diagonal, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims, torch.chunk,
                    torch.split, torch.tensor_split, torch.unbind, torch.detach, torch.view_as_real, torch.ravel,
                    torch.atleast_1d, torch.atleast_2d, torch.atleast_3d}
_LAYOUT_READS = {"stride", "storage_offset"}  # (a QTensor's: its codes' layout; re-read on the float copy)
_VIEW_ATTRS = {"T", "mT", "H", "mH", "real", "imag", "data"}
_F_MODULES = ("torch", "torch._C._VariableFunctions", "torch._C._nn", "torch.nn.functional")  # F.hardtanh_: _C._nn
_METHOD_TWINS = {"relu_": "relu", "squeeze_": "squeeze", "unsqueeze_": "unsqueeze", "detach_": "detach",
                 # old-style elementwise writes with an int8 twin (session 43 zoo: y.add_(x), z.clamp_(0, 6))
                 "add_": "add", "mul_": "mul", "sub_": "sub", "div_": "div", "clamp_": "clamp",
                 "clamp_min_": "clamp_min", "clamp_max_": "clamp_max", "sigmoid_": "sigmoid", "tanh_": "tanh"}
# ``h += c`` ... (fx/trace.py records them): in place on a tensor, a new value on a number / tuple (``n += 1``)
AUGMENTED_OPS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                 operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
                 operator.ipow: operator.pow, operator.iand: operator.and_, operator.ior: operator.or_,
                 operator.ixor: operator.xor, operator.ilshift: operator.lshift, operator.irshift: operator.rshift}
_FUNC_TWINS = {**AUGMENTED_OPS, torch.relu_: torch.relu, torch.sigmoid_: torch.sigmoid, torch.tanh_: torch.tanh,
               torch.clamp_: torch.clamp, F.hardtanh_: F.hardtanh, F.leaky_relu_: F.leaky_relu, F.elu_: F.elu}


@graph_leaf
def writable_copy(x: Any) -> Any:
    """A float copy of ``x`` to write into: ``x.clone()`` in row-major order (a ``QTensor`` dequantized first), a
    tuple / list item by item.

    >>> a = torch.ones(2)
    >>> b = writable_copy(a)
    >>> _ = b.mul_(3)
    >>> a.tolist(), b.tolist()
    ([1.0, 1.0], [3.0, 3.0])
    """
    if isinstance(x, QTensor):
        x = x.dequantize()
    if isinstance(x, torch.Tensor):  # (row-major as the float model's tensor: an int8 kernel's may be channels-last)
        return x.clone(memory_format=torch.contiguous_format)
    if isinstance(x, (tuple, list)):
        return type(x)(writable_copy(v) for v in x)
    return x


def _is_setitem(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "__setitem__") or (
        node.op == "call_function" and node.target is operator.setitem)


def _mutates_first_arg(node: fx.Node, mods: dict[str, nn.Module]) -> bool:
    """An in-place op on ``node.args[0]``: ``x.relu_()``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)``,
    ``nn.ReLU(inplace=True)(x)``, ``F.hardtanh_(x)``, ``x.__setitem__(i, v)``."""
    if _is_setitem(node):
        return True
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        if node.target in AUGMENTED_OPS:
            return True
        name = getattr(node.target, "__name__", "")
        return node.kwargs.get("inplace") is True or (name.endswith("_") and not name.startswith("_")
                                                      and getattr(node.target, "__module__", "") in _F_MODULES)
    if node.op == "call_module":
        return getattr(mods.get(str(node.target)), "inplace", False) is True
    return False


_NUMBER_METHODS = {"size", "dim", "numel", "nelement", "item", "tolist", "stride", "storage_offset", "element_size",
                   "__len__"}


def _number_like(arg: Any) -> bool:
    """Whether ``arg`` holds a number, ``torch.Size`` or tuple rather than a tensor, by how it was made (sizes,
    ``x.shape``, ``len``, arithmetic on those; a placeholder annotated ``int`` / ``float`` / ``bool``): ``n += 1`` on
    it makes a new value, as in Python, and changes nothing another name holds."""
    if not isinstance(arg, fx.Node):
        return True
    if arg.op == "placeholder":
        return arg.type in (int, float, bool)
    if arg.op == "call_method":
        return arg.target in _NUMBER_METHODS
    if arg.op != "call_function":
        return False
    if arg.target in (getattr, len):
        return arg.target is len or arg.args[1] in ("shape", "ndim", "dtype", "device", "is_cuda")
    inputs = arg.all_input_nodes
    return getattr(arg.target, "__module__", None) == "_operator" and bool(inputs) and all(map(_number_like, inputs))


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


def _step_base(node: fx.Node) -> fx.Node | None:
    """The node ``node`` is a view of (whole or part, an indexed item, ``.T`` / ``.data`` ...), else ``None``."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return node.args[0] if node.args[1] in _VIEW_ATTRS and isinstance(node.args[0], fx.Node) else None
    return _view_of(node, _WHOLE_VIEWS | _PART_VIEWS, _WHOLE_VIEW_FUNCS | _PART_VIEW_FUNCS)


def _aliases(root: fx.Node, before: int, order: dict[fx.Node, int],
             mods: dict[str, nn.Module]) -> dict[fx.Node, fx.Node]:
    """Nodes placed before position ``before`` that may share ``root``'s memory (views of it, views of those, in-place
    ops on them), each mapped to the node it is a view of / writes into."""
    parent: dict[fx.Node, fx.Node] = {}
    todo = [root]
    while todo:
        cur = todo.pop()
        for u in cur.users:
            if u in parent or order.get(u, before) >= before:
                continue
            if _step_base(u) is cur or _changed(u, mods) is cur:
                parent[u] = cur
                todo.append(u)
    return parent


def _path(node: fx.Node, parent: dict[fx.Node, fx.Node]) -> list[fx.Node]:
    out = [node]
    while out[-1] in parent:
        out.append(parent[out[-1]])
    return out[::-1]


def _disjoint(a: fx.Node, b: fx.Node, parent: dict[fx.Node, fx.Node]) -> bool:
    """Whether the views ``a`` and ``b`` of one root part at two different int indexes (``x[0]`` / ``x[1]``, the two
    items of an ``out, h = lstm(x)`` tuple), so a write to one leaves the other as it was."""
    for x, y in zip(_path(a, parent), _path(b, parent)):
        if x is not y:
            return all(n.op == "call_function" and n.target is operator.getitem and type(n.args[1]) is int
                       for n in (x, y)) and x.args[0] is y.args[0] and x.args[1] != y.args[1]
    return False


def _read_after(node: fx.Node, after: int, order: dict[fx.Node, int]) -> bool:
    return any(order.get(u, len(order)) > after for u in node.users)


def _needs_copy(write: fx.Node, target: fx.Node, order: dict[fx.Node, int], mods: dict[str, nn.Module]) -> bool:
    """Whether the write must be replayed on a copy: a ``__setitem__``, or a view of the written tensor other than
    the whole-view chain that ``_reroute_whole`` follows is read after it."""
    if _is_setitem(write):
        return True
    handled, cur = {target}, target
    while (base := _view_of(cur, _WHOLE_VIEWS, _WHOLE_VIEW_FUNCS)) is not None:
        handled.add(base)
        cur = base
    root = cur
    while (base := _step_base(root)) is not None:
        root = base
    parent = _aliases(root, order[write], order, mods)
    parent.pop(write, None)
    return any(n not in handled and _read_after(n, order[write], order) and not _disjoint(n, target, parent)
               for n in (root, *parent))


@graph_leaf
def written(x: Any, *writes: Any) -> Any:
    """``x`` itself, once ``writes`` ran (a graph node after an in-place write into ``x``: the later readers read it,
    so the observers between them and ``x`` see the written values).

    >>> a = torch.zeros(2)
    >>> written(a, a[:1].fill_(1)).tolist()
    [1.0, 0.0]
    """
    return x


def _write_on_copy(gm: fx.GraphModule, write: fx.Node, target: fx.Node, order: dict[fx.Node, int],
                   mods: dict[str, nn.Module]) -> int:
    """Replay ``write`` on a float copy of the tensor it writes into (module doc); return the inputs rerouted."""
    graph, at = gm.graph, order[write]
    root = target
    while (base := _step_base(root)) is not None:
        root = base
    parent = _aliases(root, at, order, mods)
    parent.pop(write, None)
    readers = {n: [u for u in n.users if order[u] > at] for n in (root, *parent)}
    readers = {n: us for n, us in readers.items() if us}

    def replay(node: fx.Node, rep: dict[fx.Node, fx.Node]) -> fx.Node:
        """``node``'s view of ``root`` taken on ``rep[root]`` (the same ops, inserted where the graph inserts)."""
        if node not in rep:
            base = parent[node]
            new = replay(base, rep)
            if _step_base(node) is base:  # (an earlier in-place write aliases what it wrote into)
                new = graph.node_copy(node, lambda a: new if a is base else layout(a, rep))
                new.meta["lowbit_inserted"] = True
            rep[node] = new
        return rep[node]

    def layout(arg: fx.Node, rep: dict[fx.Node, fx.Node]) -> fx.Node:
        """``arg`` read again on the copy when it is a layout read of ``root`` or a view of it (``a.stride()``,
        ``a.stride(1)``, ``a.stride()[2]``, ``a.storage_offset()``): a QTensor's strides are its codes' (channels-last
        after an int8 conv), the copy's are row-major as the float model's tensor; the view must be taken with the
        copy's (``a.as_strided(a.size(), a.stride())[:, :4].mul_(2)`` wrote the wrong elements: 7.7 dB)."""
        if arg.op == "call_function" and arg.target is operator.getitem and isinstance(arg.args[0], fx.Node):
            inner = layout(arg.args[0], rep)
            if inner is arg.args[0]:
                return arg
            item = graph.call_function(operator.getitem, (inner, *arg.args[1:]))
            item.meta["lowbit_inserted"] = True
            return item
        src = arg.args[0] if arg.op == "call_method" and arg.target in _LAYOUT_READS and arg.args else None
        if not isinstance(src, fx.Node) or (src is not root and src not in parent):
            return arg
        key = (id(rep), arg)
        if key not in reads:
            reads[key] = graph.call_method(str(arg.target), (replay(src, rep), *arg.args[1:]), dict(arg.kwargs))
            reads[key].meta["lowbit_inserted"] = True
        return reads[key]

    reads: dict[tuple[int, fx.Node], fx.Node] = {}

    scope = write.meta.get("lowbit_scope", "")
    with graph.inserting_before(write):
        copy = graph.call_function(writable_copy, (root,))
        before = {root: copy}  # (held: ``reads`` is keyed by its id)
        part = replay(target, before)
        new = graph.node_copy(write, lambda a: part if a is target else a)
        done = graph.call_function(written, (copy, new))
        after = {root: done}
        for n in readers:
            replay(n, after)
    for n in (copy, done):
        n.meta.update(lowbit_inserted=True, lowbit_scope=scope)
    new.meta["lowbit_writes_part"] = True
    moved = 0
    for n, users in readers.items():
        for u in users:
            u.replace_input_with(n, after[n])
            moved += 1
    moved += len(write.users)
    write.replace_all_uses_with(new)
    graph.erase_node(write)
    return moved + 1


def _reroute(src: fx.Node, new: fx.Node, after: int, order: dict[fx.Node, int], skip: set[fx.Node]) -> int:
    """Readers of ``src`` placed after position ``after`` read ``new``; return how many."""
    moved = 0
    for user in list(src.users):
        if user not in skip and order.get(user, len(order)) > after:
            user.replace_input_with(src, new)
            moved += 1
    return moved


def _reroute_whole(gm: fx.GraphModule, node: fx.Node, target: fx.Node, order: dict[fx.Node, int]) -> int:
    """Later readers of ``target`` read ``node``; of each whole-view base of it, ``node`` reshaped to the base's size;
    an in-place ReLU / (un)squeeze / detach of a tensor the caller does not hold becomes its out-of-place twin."""
    moved = _reroute(target, node, order[node], order, {node})
    value, cur = node, target
    while (base := _view_of(cur, _WHOLE_VIEWS, _WHOLE_VIEW_FUNCS)) is not None:
        if any(order.get(u, -1) > order[node] for u in base.users):
            with gm.graph.inserting_after(value):
                size = gm.graph.call_method("size", (base,))
            with gm.graph.inserting_after(size):
                whole = gm.graph.call_method("reshape", (value, size))
            size.meta["lowbit_inserted"] = whole.meta["lowbit_inserted"] = True
            moved += _reroute(base, whole, order[node], order, {size, whole, cur})
            value = whole
        cur = base
    while (base := _step_base(cur)) is not None:
        cur = base
    twins = _METHOD_TWINS if node.op == "call_method" else _FUNC_TWINS if node.op == "call_function" else {}
    if node.target in twins and node.args[0] is target and cur.op not in ("placeholder", "get_attr"):
        node.meta["lowbit_target"] = node.target
        node.target = twins[node.target]  # type: ignore[index]
        moved += 1
    return moved


def reroute_inplace(gm: fx.GraphModule) -> int:
    """Make every later reader of a tensor an in-place op changed read the op's result (module doc), replaying a
    write to a part of a tensor on a float copy. Returns how many inputs it rerouted (and ops it rewrote)."""
    mods = dict(gm.named_modules())
    moved = 0
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or getattr(node, "_erased", False):
            continue
        if node.op == "call_function" and node.target in AUGMENTED_OPS and _number_like(node.args[0]):
            node.target = AUGMENTED_OPS[node.target]  # (``n += 1`` on ``x.size(0)``: a new number, nothing changed)
            moved += 1
            continue
        target = _changed(node, mods)
        if target is None:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if _needs_copy(node, target, order, mods):
            moved += _write_on_copy(gm, node, target, order, mods)
        else:
            moved += _reroute_whole(gm, node, target, order)
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved
