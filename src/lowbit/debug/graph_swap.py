"""Graph mode's part of ``search="fast"`` (split from ``float_swap.py``): where a converted graph calls a layer, who
reads its output, graph-mode ops kept float, and a reused layer's calls one by one.

**Ops.** ``convert_fx`` turns an int8 add / mul / cat (``x + y``, ``torch.add``, ``ff.add``) into a generated
``qfunctional_N`` module that no name of the user's model reaches; the mapping reaches the op through its call-order
key ``(module_name, function, index)`` (``set_module_name_object_type_order``: the ``index``-th call of ``function``
traced in ``module_name``'s ``forward``), which ``prepare_fx`` records on the node (``meta["lowbit_call_order"]``) and
``convert_fx`` carries onto the ``qfunctional_N`` call. The model built with that key set to ``None`` computes the op
in float on its dequantized operands (their ``Quantize`` gone where the op was their only reader) and its int8
readers quantize the float result on the grid their input observer recorded: the values the op's own output observer
saw, so ``_OpTwin`` rounds onto the op's calibrated grid, and stays float while every reader is kept float too
(``_regrid``). A method call (``x.add(y)``) has no call-order key (torch.ao counts functions only): not a candidate,
but swapped float when the island rule keeps it float (``swap_islands.method_ops``).

**A reused layer** (one module, several call nodes): one observer sees every call in the prepared model, so the int8
layer has one output grid; the model built with the layer float rounds each call's output on the grid its own int8
readers record, i.e. over that call's outputs only, and keeps a call's output float where only float layers read it.
``record_call_outputs`` observes each call separately during the one calibration; ``split_calls`` gives each later
call node of the converted graph its own attribute (the same module object: the int8 model is unchanged), so each call
gets its own float twin with its own grid and its own readers.

>>> import operator
>>> import torch, lowbit as Q
>>> from torch import nn
>>> class Res(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
...     def forward(self, x):
...         h = self.a(x)
...         return self.b(h + x)
>>> x = torch.randn(8, 4)
>>> p = Q.prepare_fx(Res().eval(), Q.get_minmax_qconfig(), example_inputs=(x,))
>>> _ = p(x)
>>> q = Q.convert_fx(p)
>>> [(path, name, key[1] is operator.add) for path, (name, key, op) in op_candidates(q).items()]
[('qfunctional_2', 'operator.add#0', True)]
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..fake_quant.base import holds_grid
from ..nn.quantized.functional_modules import FloatFunctional, QFunctional
from ..nn.quantized.stubs import DeQuantize, Quantize
from ..qscheme import as_qdtype
from ..qtensor import QTensor
from ..speed_guard import requant_grid
from ..workflow.propagate import join_name
from .swap_edges import _Pick, insert_picks, share_edges, share_end_grid
from .table import call_order_name

__all__ = ["node_of", "readers", "op_candidates", "prepared_ops", "record_call_outputs", "settle", "split_calls"]


def _dq(x: Any) -> Any:
    return x.dequantize() if isinstance(x, QTensor) else x


def node_of(qmodel: nn.Module, path: str) -> tuple[str, fx.GraphModule, list[fx.Node]] | None:
    """The innermost graph holding the calls of module ``path``, and those nodes (a reused module: several)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        gpath = ".".join(parts[:i])
        gm = qmodel.get_submodule(gpath) if gpath else qmodel
        if isinstance(gm, fx.GraphModule):
            rel = ".".join(parts[i:])
            nodes = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == rel]
            return (gpath, gm, nodes) if nodes else None
    return None


def _passes(gm: fx.GraphModule, gpath: str, names: set[str]) -> Callable[[fx.Node], bool]:
    """Whether the reader walk (``swap_edges.share_edges``) goes on through ``u``: a grid-sharing op (zero pad, flatten,
    max pool, ...) that is no candidate (paths in ``names``), no ``Quantize`` / ``DeQuantize`` / gate, not the output."""
    from ..fx.patterns import is_share_op

    def passes(u: fx.Node) -> bool:
        mod = gm.get_submodule(str(u.target)) if u.op == "call_module" else None
        return u.op != "output" and not isinstance(mod, (Quantize, DeQuantize, _Gate)) \
            and join_name(gpath, str(u.target)) not in names and is_share_op(u, mod)
    return passes


def readers(gm: fx.GraphModule, gpath: str, node: fx.Node, names: set[str],
            users: list[fx.Node] | None = None) -> tuple[set[str], bool, bool]:
    """The candidate modules (paths in ``names``) that read ``node``'s value (``users``: through these of its users
    only) through grid-sharing ops (zero pads, flatten, ...), whether anything else reads it (``x.shape`` reads do not
    count), and whether an int8 op that is no candidate does (anything but a ``DeQuantize`` or the output)."""
    mods, other, int_other = set(), False, False
    for _, u in share_edges(node, _passes(gm, gpath, names), users):
        mod = gm.get_submodule(str(u.target)) if u.op == "call_module" else None
        if mod is not None and join_name(gpath, str(u.target)) in names:
            mods.add(join_name(gpath, str(u.target)))
        else:
            other, int_other = True, int_other or (u.op != "output" and not isinstance(mod, DeQuantize))
    return mods, other, int_other


def input_quantizes(gm: fx.GraphModule, gpath: str, node: fx.Node, first: bool = False) -> list[str]:
    """Paths of the ``Quantize`` modules whose only reader is ``node`` (a float layer or op reads float: they go);
    ``first``: of its first argument only (a layer's input)."""
    args = [a for arg in (node.args[:1] if first else node.args)
            for a in (arg if isinstance(arg, (list, tuple)) else (arg,))]
    return [join_name(gpath, str(a.target)) for a in args
            if isinstance(a, fx.Node) and a.op == "call_module" and len(a.users) == 1
            and isinstance(gm.get_submodule(str(a.target)), Quantize)]


def float_only_readers(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is read only through ``DeQuantize`` (float ops, the model's output): no grid to round onto."""
    return bool(node.users) and all(u.op == "call_module" and isinstance(gm.get_submodule(str(u.target)), DeQuantize)
                                    for u in node.users)


class _OpTwin(nn.Module):
    """A graph-mode ``QFunctional`` kept float: the ``FloatFunctional`` method on dequantized operands, then back on the
    op's calibrated output grid (``requant``) while ``keep`` (an int8 reader reads it); float otherwise."""

    def __init__(self, qop: QFunctional, float_out: bool) -> None:
        super().__init__()
        self.float_mod = FloatFunctional()
        self.add_module("requant", None if float_out else Quantize(float(qop.scale), int(qop.zero_point), qop.qdtype))
        self.keep = True

    @property
    def grid(self) -> tuple[float, int, Any] | None:
        """The output grid ``(scale, zero_point, qdtype)``, or None (float output)."""
        return requant_grid(self.requant)

    def forward(self, op: str, *args: Any) -> Any:
        args = tuple(type(a)(_dq(t) for t in a) if isinstance(a, (list, tuple)) else _dq(a) for a in args)
        y = getattr(self.float_mod, op)(*args)
        return y if self.requant is None or not self.keep else self.requant(y)


def op_candidates(qmodel: nn.Module) -> dict[str, tuple[str, tuple[str, Any, int], str]]:
    """``{path of a qfunctional_N: (row name, call-order key, op)}`` for every graph-mode int8 op a mapping can keep
    float (its node carries ``meta["lowbit_call_order"]``)."""
    if not isinstance(qmodel, nn.Module):
        raise TypeError(f"op_candidates: qmodel must be an nn.Module (a convert_fx model), got {type(qmodel).__name__}")
    out = {}
    for path, mod in qmodel.named_modules():
        if not isinstance(mod, QFunctional):
            continue
        found = node_of(qmodel, path)
        if found is None or len(found[2]) != 1:
            continue
        node = found[2][0]
        key = node.meta.get("lowbit_call_order")
        if key is not None:
            out[path] = (call_order_name(key), key, str(node.args[0]))
    return out


def prepared_ops(prepared: nn.Module) -> list[tuple[str, str, Any, tuple[str, Any, int]]]:
    """``(row name, op, qconfig, call-order key)`` of every int8 op (add, mul, cat, ...) of a model ``prepare_fx``
    prepared that a call-order key reaches: the exact search's op candidates, in graph order."""
    return [(call_order_name(n.meta["lowbit_call_order"]), str(n.meta["lowbit_qop"]), n.meta["lowbit_qconfig"],
             n.meta["lowbit_call_order"])
            for gm in prepared.modules() if isinstance(gm, fx.GraphModule) for n in gm.graph.nodes
            if n.meta.get("lowbit_kind") == "functional" and n.meta.get("lowbit_qconfig") is not None
            and "lowbit_call_order" in n.meta]


def make_op_twin(qmodel: nn.Module, path: str) -> tuple[list[tuple[str, nn.Module]], _OpTwin, fx.GraphModule,
                                                        str, fx.Node, list[_Pick]]:
    """The swaps that keep the op at ``path`` float (its twin, its own input ``Quantize`` modules gone), and the picks
    on its edges from shared ``Quantize`` modules (``insert_picks``)."""
    found = node_of(qmodel, path)
    assert found is not None
    gpath, gm, (node,) = found
    picks = insert_picks(gm, node)
    twin = _OpTwin(qmodel.get_submodule(path), float_only_readers(gm, node))
    return [*((q, nn.Identity()) for q in input_quantizes(gm, gpath, node)), (path, twin)], twin, gm, gpath, node, picks


def record_call_outputs(prepared: nn.Module) -> tuple[dict[str, list[nn.Module]], list[Any]]:
    """Graph mode: for every module a prepared graph calls more than once, a fresh copy of its (shared) output observer
    per call, observing that call's outputs only. ``({path: [observer per call]}, hook handles)``."""
    found: dict[str, list[nn.Module]] = {}
    handles = []
    for gpath, gm in prepared.named_modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        calls: dict[str, list[fx.Node]] = {}
        for n in gm.graph.nodes:
            if n.op == "call_module":
                calls.setdefault(str(n.target), []).append(n)
        counts: dict[str, int] = {}
        for target, nodes in calls.items():
            obs_nodes = [u for u in nodes[0].users if u.meta.get("lowbit_kind") == "obs_out"]
            if len(nodes) < 2 or not obs_nodes:
                continue
            shared = gm.get_submodule(str(obs_nodes[0].target))
            observers = found[join_name(gpath, target)] = [copy.deepcopy(shared) for _ in nodes]  # (fresh: no batch yet)
            counts[target] = 0

            def hook(_m: nn.Module, _i: Any, out: Any, target: str = target, observers: list = observers,
                     counts: dict = counts) -> None:
                k = counts[target]
                counts[target] = k + 1
                if k < len(observers) and isinstance(out, torch.Tensor) and out.is_floating_point():
                    observers[k](out.detach())
            handles.append(gm.get_submodule(target).register_forward_hook(hook))
        if counts:
            handles.append(gm.register_forward_pre_hook(lambda *_, counts=counts: counts.update(dict.fromkeys(counts, 0))))
    return found, handles


def call_grid(observers: list[nn.Module] | None, k: int) -> tuple[float, int, Any] | None:
    """The grid call ``k`` alone recorded, or None (not reused, or it saw nothing)."""
    if not observers or k >= len(observers) or not holds_grid(observers[k]):
        return None
    scale, zero_point = observers[k].calculate_qparams()
    return float(scale), int(zero_point), as_qdtype(observers[k].qdtype)


def split_calls(qmodel: nn.Module, paths: list[str]) -> dict[str, tuple[str, int]]:
    """Every later call of a module called several times in a converted graph gets its own attribute holding the same
    module (``{attribute path: (module path, call index)}``): the int8 model computes what it did, and each call can
    be swapped on its own."""
    aliases: dict[str, tuple[str, int]] = {}
    for path in paths:
        found = node_of(qmodel, path)
        if found is None or len(found[2]) < 2:
            continue
        gpath, gm, nodes = found
        for k, node in enumerate(nodes[1:], 1):
            alias = f"{str(node.target).replace('.', '_')}__call{k}"
            gm.add_module(alias, gm.get_submodule(str(node.target)))
            node.target = alias
            aliases[join_name(gpath, alias)] = (path, k)
        gm.recompile()
    return aliases


class _Gate(nn.Module):
    """One edge from a candidate to its readers: passes its input on, or (``active``: the candidate is float and an
    int8 op reads this edge) rounds it onto ``grid``, as the built model's ``Quantize`` in front of that reader."""

    def __init__(self, grid: tuple[float, int, Any] | None) -> None:
        super().__init__()
        self.add_module("requant", None if grid is None else Quantize(*grid))
        self.active = False

    def forward(self, x: Any) -> Any:
        return self.requant(x) if self.active and self.requant is not None and not isinstance(x, QTensor) else x


def insert_gates(gm: fx.GraphModule, gpath: str, node: fx.Node, grid: tuple[float, int, Any] | None,
                 names: set[str], ends: dict[tuple[str, str], nn.Module] | None = None
                 ) -> list[tuple[_Gate, set[str], bool]]:
    """A ``_Gate`` on every edge into a reader of ``node``'s value: past the grid-sharing ops (max pool, flatten, ...)
    that follow ``node``, which then run in float as in the model built with it float, on the grid ``prepare_fx``'s
    observer records there (``ends``: ``record_share_ends``; else ``grid``). With what reads through each gate
    (``readers``: candidate paths, whether an int8 non-candidate does); ``x.shape`` reads get none."""
    out = []
    for s, u in list(share_edges(node, _passes(gm, gpath, names))):  # (the share ops run in float on the float value)
        mods, _, int_other = readers(gm, gpath, s, names, [u])
        gate = _Gate((share_end_grid(ends, gpath, s) or grid) if s is not node else grid)
        name = f"_lowbit_gate_{len([m for m in gm.children() if isinstance(m, _Gate)])}"
        gm.add_module(name, gate)
        with gm.graph.inserting_after(s):
            g = gm.graph.call_module(name, (s,))
        u.replace_input_with(s, g)
        out.append((gate, mods, int_other))
    gm.recompile()
    return out


def settle(qmodel: nn.Module) -> None:
    """Fix the search's final state into plain modules (``keep_float_layers``' returned model): a ``_Pick`` leaves the
    graph (a float reader reads the float value, an int8 one the ``Quantize``; a ``Quantize`` no one reads goes), an
    active ``_Gate`` becomes its ``Quantize`` (the built model's own ``Quantize`` in front of an int8 reader), an idle
    one leaves the graph, and a reused layer's call alias (``split_calls``) that still holds the int8 layer is pointed back at it
    (one module, one set of ``state_dict`` keys); an alias holding a float twin stays: that call's own grid.

    >>> import torch, lowbit as Q
    >>> from torch import nn
    >>> x = torch.randn(8, 4)
    >>> p = Q.prepare_fx(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), Q.get_minmax_qconfig(), example_inputs=(x,))
    >>> _ = p(x)
    >>> q = Q.convert_fx(p)
    >>> gm, (node,) = q, [n for n in q.graph.nodes if n.target == "0"]
    >>> [(g.active, mods) for g, mods, _ in insert_gates(gm, "", node, (0.1, 0, Q.quint8), {"0"})]
    [(False, set())]
    >>> settle(q)                                         # an idle gate leaves the graph
    >>> [n.target for n in q.graph.nodes if n.op == "call_module"]
    ['quantize_1', '0', 'dequantize']
    """
    for gm in [m for m in qmodel.modules() if isinstance(m, fx.GraphModule)]:
        first: dict[int, str] = {}
        for name, mod in gm.named_modules(remove_duplicate=False):  # (an alias is registered after its module)
            first.setdefault(id(mod), name)
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_module":
                continue
            target = str(node.target)
            mod = gm.get_submodule(target)
            if isinstance(mod, _Pick):
                node.replace_all_uses_with(node.args[1] if mod.active else node.args[0])
                quantize = node.args[0]
                gm.graph.erase_node(node)
                delattr(gm, target)
                if not quantize.users:  # (every reader float: the input stays float)
                    gm.graph.erase_node(quantize)
                    if all(n.target != quantize.target for n in gm.graph.nodes if n.op == "call_module"):
                        delattr(gm, str(quantize.target))
                changed = True
            elif isinstance(mod, _Gate):
                if mod.active and mod.requant is not None:
                    gm.add_module(target, mod.requant)
                else:
                    node.replace_all_uses_with(node.args[0])
                    gm.graph.erase_node(node)
                    delattr(gm, target)
                changed = True
            elif "__call" in target and "." not in target and first.get(id(mod), target) != target:
                node.target = first[id(mod)]
                delattr(gm, target)
                changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
