"""Which elementwise int ops graph mode keeps float: those that would only add roundings (no kernel saved).

An int8 add / mul / cat / activation whose value no int op reads only requantizes: its result is dequantized by every
reader, so each such op costs one rounding onto its output grid and saves no integer kernel. ``demote_float_islands``
keeps them float, by groups (split from ``lowbit.fx.classify``, session 44):

- the candidates are the ``functional`` / ``act`` nodes; an int ``matmul`` (a kernel) only with a float input;
- a candidate read by an int op that is not a candidate is dropped, until none is (reads through shape ops count);
- a connected group of the rest is kept float when each of them has a float-domain input (the residual
  ``LayerNorm(dense(x) + x)`` of a BERT layer: int8 would quantize ``x`` first) or a float op reads one of them (a
  pre-norm transformer's residual stream, whose adds only LayerNorms and the next add read: int8 from add to add, a
  ViT's class-token row, 50x smaller than the patch rows, kept ~7 codes of the stream's grid: 14.2 dB -> 24.9 dB);
- a group read only by the graph's output stays int8 (``return a(x) + b(x)``, ``torch.cat([x, x], 1) + 1``: as
  torch.ao).

``islands_under`` runs the same rule on a *prepared* graph with some more nodes float (no new trace): the mixed-precision
search's ``search="fast"`` asks it which int ops the model ``prepare_fx`` builds with those layers float keeps float,
from the kinds classify gave before any island was demoted (``meta["lowbit_island_of"]``; the attention-mask rule of
``fx.masks`` is in them: it does not depend on the qconfigs).

>>> import operator
>>> from collections.abc import Iterable

from torch import fx
>>> g = fx.Graph()
>>> x = g.placeholder("x"); y = g.call_function(operator.add, (x, x)); z = g.call_function(operator.neg, (y,))
>>> _ = g.output(z)
>>> for n, kind, dom in ((x, "input", "float"), (y, "functional", "int"), (z, "float", "float")):
...     n.meta.update(lowbit_kind=kind, lowbit_domain=dom)
>>> from lowbit.fx.report import FxReport
>>> report = FxReport()
>>> demote_float_islands(fx.GraphModule({}, g), report, ""), y.meta["lowbit_kind"]
(True, 'float')
>>> report.left_float["add"]
'add (kept float: float input, only float consumers)'
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

from ..workflow.propagate import join_name as join
from .report import FxReport

__all__ = ["INT_KINDS", "wants_int", "assign_domains", "demote_float_islands", "islands_under"]

INT_KINDS = ("module", "functional", "act", "weighted")


def wants_int(user: fx.Node) -> bool:
    """Whether ``user`` reads (some of) its inputs as ``QTensor``s after convert."""
    return user.meta.get("lowbit_kind") in INT_KINDS


def assign_domains(gm: fx.GraphModule | fx.Graph) -> None:
    """``meta["lowbit_domain"]``: ``int`` (a QTensor after convert), ``float`` or ``other`` (no float tensor)."""
    for node in (gm.graph if isinstance(gm, fx.GraphModule) else gm).nodes:
        kind = node.meta["lowbit_kind"]
        if not node.meta.get("lowbit_ftensor", False) and not (kind == "share" and node.meta.get("lowbit_ftuple")):
            domain = "other"
        elif kind == "share":  # (a chunk / split of an int value is a tuple of QTensors: its getitems are int)
            # the value the op moves is its first argument: `x.expand_as(y)` of a float x is float, an int y only
            # gives it a shape (a float share op reads its int inputs through a DeQuantize)
            src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            ins = [src] if src is not None else node.all_input_nodes
            domain = "int" if any(a.meta.get("lowbit_domain") == "int" for a in ins) else "float"
        else:  # a placeholder declared quantized (input_quantized_idxs) arrives as a QTensor
            domain = "int" if kind in INT_KINDS or node.meta.get("lowbit_qinput") else "float"
        node.meta["lowbit_domain"] = domain


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s value, through shape ops (``share``) that pass it on."""
    return [r for u in node.users for r in (_readers(u) if u.meta.get("lowbit_kind") == "share" else [u])]


def _sources(node: fx.Node) -> list[fx.Node]:
    """``node`` or, through shape ops (``share``), the nodes whose value it passes on."""
    if node.meta.get("lowbit_kind") != "share":
        return [node]
    return [m for a in node.all_input_nodes for m in _sources(a)]


def _float_in(node: fx.Node) -> bool:
    return any(a.meta.get("lowbit_domain") == "float" for a in node.all_input_nodes)


def _group(start: fx.Node, cand: set[fx.Node]) -> set[fx.Node]:
    """The candidates linked to ``start`` by reading one another (through shape ops)."""
    group, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in group:
            group.add(n)
            todo += [m for m in _readers(n) if m in cand]
            todo += [m for a in n.all_input_nodes for m in _sources(a) if m in cand]
    return group


def demote_float_islands(gm: fx.GraphModule | fx.Graph, report: FxReport, prefix: str) -> bool:
    """Set the groups of the module docstring to ``lowbit_kind="float"``, each named in ``report.left_float`` (its
    kind before, ``meta["lowbit_island_of"]``: ``islands_under`` starts from it); return whether a node changed (the
    caller reassigns the domains and asks again)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    cand = {n for n in graph.nodes if n.meta.get("lowbit_kind") in ("functional", "act")
            and (n.meta.get("lowbit_qop") != "matmul" or _float_in(n))}
    while drop := {n for n in cand if any(wants_int(r) and r not in cand for r in _readers(n))}:
        cand -= drop
    changed, seen = False, set()
    for start in [n for n in graph.nodes if n in cand]:
        if start in seen:
            continue
        group = _group(start, cand)
        seen |= group
        reader = any(r.meta.get("lowbit_kind") == "float" for n in group for r in _readers(n))
        if not reader and not all(_float_in(n) for n in group):
            continue
        for n in [m for m in graph.nodes if m in group]:  # (graph order: a stable report)
            n.meta["lowbit_island_of"] = (n.meta["lowbit_kind"], n.meta.get("lowbit_qop"))
            n.meta.update(lowbit_kind="float", lowbit_qop=None)
            what = getattr(n.target, "__name__", str(n.target))
            why = "float input" if _float_in(n) else "read by float ops" if reader else "with its group"
            report.left_float[join(prefix, n.name)] = f"{what} (kept float: {why}, only float consumers)"
        changed = True
    return changed


_OBSERVERS = ("obs_in", "obs_out", "obs_share", "obs_w")  # (prepare's nodes: each passes its first argument on)


def islands_under(gm: fx.GraphModule, floats: Iterable[fx.Node]) -> set[fx.Node]:
    """The int ops (``functional`` / ``act``) of the prepared graph ``gm`` that ``prepare_fx`` keeps float once the
    nodes ``floats`` (layers, ops) have no qconfig: this module's rule, run to its fixed point on a copy of the graph
    without prepare's observers, from the kinds before any island (``gm`` is not changed). The int ops already float
    in ``gm`` (islands of ``gm``'s own qconfigs) come back too when they still are.

    >>> import torch, lowbit as Q
    >>> from torch import nn
    >>> class Res(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b, self.ln = nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)
    ...     def forward(self, x):
    ...         h = self.a(x) + x
    ...         return self.b(h), self.ln(h)
    >>> p = Q.prepare_fx(Res().eval(), Q.get_minmax_qconfig(), example_inputs=(torch.randn(2, 4),))
    >>> node = {n.name: n for n in p.graph.nodes}
    >>> islands_under(p, []), sorted(n.name for n in islands_under(p, [node["b"]]))  # (b float: no int8 reader)
    (set(), ['add'])
    """
    graph, env, back = fx.Graph(), {}, {}
    floats = set(floats)
    for n in gm.graph.nodes:
        kind = n.meta.get("lowbit_kind")
        if kind in _OBSERVERS or kind == "grid_blend":  # (a blend refines its second argument)
            env[n] = env[n.args[1 if kind == "grid_blend" else 0]]
            continue
        new = env[n] = graph.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        back[new] = n
        kind, qop = new.meta.pop("lowbit_island_of", (kind, n.meta.get("lowbit_qop")))
        new.meta.update(lowbit_kind="float" if n in floats and kind in INT_KINDS else kind, lowbit_qop=qop)
    report = FxReport()
    assign_domains(graph)
    while demote_float_islands(graph, report, ""):
        assign_domains(graph)
    return {back[n] for n in graph.nodes if "lowbit_island_of" in n.meta and back[n] not in floats}
