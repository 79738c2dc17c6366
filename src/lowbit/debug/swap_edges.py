"""Edges and copies of ``search="fast"`` that make each score the built model's (split from ``graph_swap.py``).

**Past the share ops** (graph mode). Once a layer ``L`` is float, ``prepare_fx`` runs the grid-sharing ops after it
(max pool, flatten, ReLU, zero pads, ...) in float too and observes the value at their *end*, in front of the int8
reader: its grid is ``q(pool(y))``'s range search, not ``y``'s (a histogram's L2 search differs; min / max
mostly does not). ``record_share_ends`` observes every such end during the one calibration, ``share_end_grid`` reads
it back for the gate ``graph_swap.insert_gates`` puts there.

**Shared input ``Quantize``** (graph mode). A ``Quantize`` that several ops read (the model input read by three
layers) stays while one of them is int8; a float reader in the built model reads the float value itself:
``insert_picks`` puts a ``_Pick`` on each such edge into a candidate (``active``: the float value).

**Islands** (graph mode, ``island_ops``). Once layers are float, ``prepare_fx`` keeps float the int8 adds / muls /
cats that no int8 op reads any more, by ``fx.islands``' group rule (a float input, or a float op reading one):
``float_read`` tells the last from the converted graph (a ``DeQuantize`` feeding more than the output).

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
from typing import Any

from torch import fx, nn

from ..fake_quant.base import holds_grid
from ..nn.quantized.stubs import DeQuantize, Quantize
from ..qscheme import as_qdtype

__all__ = ["record_share_ends", "share_end_grid", "insert_picks", "float_read", "island_ops"]


def _shape_read(u: fx.Node) -> bool:
    return (u.op == "call_function" and (u.target is len or (u.target is getattr and u.args[1] in ("shape", "device")))) \
        or (u.op == "call_method" and u.target in ("size", "dim", "numel"))


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
            todo, seen = [u for u in obs.users if u.meta.get("lowbit_kind") == "share"], set()
            while todo:
                s = todo.pop()
                if s in seen:
                    continue
                seen.add(s)
                users = [u for u in s.users if not _shape_read(u)]
                todo += [u for u in users if u.meta.get("lowbit_kind") == "share"]
                reader = next((u for u in users if u.meta.get("lowbit_kind") != "share"), None)
                if reader is not None and s.meta.get("lowbit_ftensor", True):
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


def float_read(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a float op reads ``node``'s value: a ``DeQuantize`` of it (through grid-sharing ops) that feeds more
    than the graph's output (``fx.islands``: such an int8 op is kept float once no int8 op reads it)."""
    from ..fx.patterns import is_share_op

    todo, seen = list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        mod = gm.get_submodule(str(u.target)) if u.op == "call_module" else None
        if isinstance(mod, DeQuantize) and any(r.op != "output" for r in u.users):
            return True
        if u.op != "output" and not isinstance(mod, (Quantize, DeQuantize)) and is_share_op(u, mod):
            todo.extend(u.users)
    return False


def island_ops(islands: dict[str, tuple[set[str], bool, set[str], bool, bool]], floats: set[str]) -> set[str]:
    """``floats`` and the int8 ops ``prepare_fx`` then keeps float (``fx.islands``' rule on the converted graph): the
    ops no int8 non-candidate reads (``islands[op]``: candidate readers, an int8 non-candidate reads it, candidate
    sources, it reads a float value, a float op reads it) whose candidate readers are float or such ops too, kept
    float by connected groups where each reads a float value (a float source) or a float op or layer reads one."""
    out = set(floats)
    cand = {op for op, (_, int_other, *_rest) in islands.items() if op not in out and not int_other}
    while drop := {op for op in cand if not islands[op][0] <= out | cand}:
        cand -= drop
    seen: set[str] = set()
    for start in sorted(cand):
        if start in seen:
            continue
        group, todo = set(), [start]
        while todo:
            op = todo.pop()
            if op not in group:
                group.add(op)
                todo += [o for o in (*islands[op][0], *islands[op][2]) if o in cand]
        seen |= group
        if any(islands[op][0] & out or islands[op][4] for op in group) or \
                all(islands[op][3] or islands[op][2] & out for op in group):
            out |= group
    return out
