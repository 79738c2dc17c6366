"""Edges and copies of ``search="fast"`` that make each score the built model's (split from ``graph_swap.py``).

**Past the share ops** (graph mode). Once a layer ``L`` is float, ``prepare_fx`` runs the grid-sharing ops after it
(max pool, flatten, ReLU, zero pads, ...) in float too and observes the value at their *end*, in front of the int8
reader: its grid is ``q(pool(y))``'s range search, not ``y``'s (a histogram's L2 search differs; min / max
mostly does not). ``record_share_ends`` observes every such end during the one calibration, ``share_end_grid`` reads
it back for the gate ``graph_swap.insert_gates`` puts there.

**Shared input ``Quantize``** (graph mode). A ``Quantize`` that several ops read (the model input read by three
layers) stays while one of them is int8; a float reader in the built model reads the float value itself:
``insert_picks`` puts a ``_Pick`` on each such edge into a candidate (``active``: the float value).

**Readers past the share ops** (``share_edges``): the one walk from a value through the grid-sharing ops after it to
the ops that read it, shared by ``record_share_ends`` (on the prepared graph) and ``graph_swap``'s ``readers`` /
``insert_gates`` (on the converted one).

**Plain float copies** (``_plain_copy``). A float twin is a copy of the prepared module without what ``prepare``
added (eager: observers and their hooks).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> x = torch.randn(16, 1, 8, 8)
>>> model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(18, 2)).eval()
>>> p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(x,))
>>> ends, handles = record_share_ends(p)
>>> _ = p(x)
>>> for h in handles:
...     h.remove()
>>> sorted(name for _, name in ends), share_end_grid(ends, "", next(n for n in p.graph.nodes if n.name == "_2"))[0] > 0
(['_2'], True)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

from torch import fx, nn

from ..fake_quant.base import holds_grid
from ..nn.quantized.stubs import Quantize
from ..qscheme import as_qdtype

__all__ = ["record_share_ends", "share_end_grid", "insert_picks", "share_edges"]


def _shape_read(u: fx.Node) -> bool:
    return (u.op == "call_function" and (u.target is len or (u.target is getattr and u.args[1] in ("shape", "device")))) \
        or (u.op == "call_method" and u.target in ("size", "dim", "numel"))


def share_edges(node: fx.Node, passes: Callable[[fx.Node], bool],
                users: list[fx.Node] | None = None) -> Iterator[tuple[fx.Node, fx.Node]]:
    """Every edge ``(s, u)`` from ``node`` (``users``: through these of its users only) or a grid-sharing op after it
    to an op ``u`` that reads the value, in breadth-first order: the walk goes on (once) through each reader for which
    ``passes(u)`` holds (a share op) and skips shape reads (``x.shape``, ``x.size()``: no value read).

    >>> import torch
    >>> from torch import fx, nn
    >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.Flatten(), nn.Linear(2, 2)))
    >>> lin = next(n for n in gm.graph.nodes if n.target == "0")
    >>> [(s.name, u.name) for s, u in share_edges(lin, lambda u: u.target == "1")]
    [('_1', '_2')]
    """
    todo, seen = [(node, u) for u in (node.users if users is None else users)], set()
    while todo:
        s, u = todo.pop(0)
        if _shape_read(u):
            continue
        if not passes(u):
            yield s, u  # (every edge: an op reading two values of the run gets both)
        elif u not in seen:
            seen.add(u)
            todo += [(u, r) for r in u.users]


class _Removal:
    """Takes the recording nodes ``record_share_ends`` put in a graph out again (a hook handle's ``remove``)."""

    def __init__(self, gm: fx.GraphModule, nodes: list[fx.Node], names: list[str]) -> None:
        self.gm, self.nodes, self.names = gm, nodes, names

    def remove(self) -> None:
        for node in self.nodes:
            node.replace_all_uses_with(node.args[0])
            self.gm.graph.erase_node(node)
        for name in self.names:
            delattr(self.gm, name)
        self.nodes, self.names = [], []
        self.gm.recompile()


def record_share_ends(prepared: nn.Module) -> tuple[dict[tuple[str, str], nn.Module], list[Any]]:
    """Graph mode: a fresh observer on the value at the end of every run of grid-sharing ops (max pool, flatten, ReLU,
    zero pad, ...) after an int8 layer's or op's output: where ``prepare_fx`` puts the input observer of the int8
    readers once the layer is float (the share ops then run in float). A histogram's range search on ``pool(y)``
    differs from the one on ``y``. ``({(graph path, node name): observer}, handles)``; the handles take the recording
    nodes out of ``prepared`` again (``remove()``) after calibration."""
    found: dict[tuple[str, str], nn.Module] = {}
    handles: list[Any] = []
    for gpath, gm in list(prepared.named_modules()):
        if not isinstance(gm, fx.GraphModule):
            continue
        ends: dict[fx.Node, Any] = {}
        for obs in [n for n in gm.graph.nodes if n.meta.get("lowbit_kind") == "obs_out"]:
            for s, reader in share_edges(obs, lambda u: u.meta.get("lowbit_kind") == "share"):
                if s is not obs and s not in ends and s.meta.get("lowbit_ftensor", True):
                    qconfig = reader.meta.get("lowbit_qconfig") or obs.meta.get("lowbit_qconfig")
                    if qconfig is not None and getattr(qconfig, "activation", None) is not None:
                        ends[s] = qconfig
        nodes, names = [], []
        for s, qconfig in ends.items():
            name = f"_lowbit_share_end_{len(names)}"
            found[(gpath, s.name)] = observer = qconfig.activation()
            gm.add_module(name, observer)
            names.append(name)
            with gm.graph.inserting_after(s):
                rec = gm.graph.call_module(name, (s,))
            s.replace_all_uses_with(rec, delete_user_cb=lambda u, rec=rec: u is not rec)
            nodes.append(rec)
        if nodes:
            gm.recompile()
            handles.append(_Removal(gm, nodes, names))
    return found, handles


def share_end_grid(ends: dict[tuple[str, str], nn.Module] | None, gpath: str,
                   node: fx.Node) -> tuple[float, int, Any] | None:
    """The grid ``record_share_ends`` recorded at ``node`` (the end of a run of share ops), or None."""
    obs = (ends or {}).get((gpath, node.name))
    if obs is None or not holds_grid(obs):
        return None
    scale, zero_point = obs.calculate_qparams()
    return float(scale), int(zero_point), as_qdtype(obs.qdtype)


class _Pick(nn.Module):
    """An edge from a ``Quantize`` that several ops read into one candidate: the ``Quantize``'s output while the
    candidate is int8, the float value it quantizes while ``active`` (the candidate kept float: the model built with it
    float hands it that value unrounded, as it does to a float layer whose ``Quantize`` has no other reader)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, quantized: Any, value: Any) -> Any:
        return value if self.active else quantized


def insert_picks(gm: fx.GraphModule, node: fx.Node, first: bool = False) -> list[_Pick]:
    """A ``_Pick`` on every edge into ``node`` (``first``: its first argument only) from a ``Quantize`` that other
    ops read too (one read by ``node`` alone goes with the candidate's swaps: ``input_quantizes``)."""
    out = []
    args = [a for arg in (node.args[:1] if first else node.args) for a in (arg if isinstance(arg, (list, tuple)) else (arg,))]
    for a in dict.fromkeys(a for a in args if isinstance(a, fx.Node)):
        if a.op == "call_module" and len(a.users) > 1 and isinstance(gm.get_submodule(str(a.target)), Quantize):
            pick = _Pick()
            name = f"_lowbit_pick_{len([m for m in gm.children() if isinstance(m, _Pick)])}"
            gm.add_module(name, pick)
            with gm.graph.inserting_before(node):
                p = gm.graph.call_module(name, (a, a.args[0]))
            node.replace_input_with(a, p)
            out.append(pick)
    if out:
        gm.recompile()
    return out


def _plain_copy(prepared_mod: nn.Module) -> nn.Module:
    """A float copy of a prepared module without what ``prepare`` added (eager mode: the observers and their hooks,
    which a float twin kept: the returned model carried the calibration histograms and updated them on every forward)."""
    from ..workflow.swap import _strip

    mod = copy.deepcopy(prepared_mod)
    for m in list(mod.modules()):
        _strip(m)
    return mod
