"""``search="fast"``'s machinery: int8 layers of one converted model swapped back to float, as the model built with
``set_module_name(L, None)`` computes them (split from ``mixed_precision.py``).

A candidate is every int8 module of the converted model that the user's model names: weighted layers, and (since
session 39) standalone BatchNorm / BNReLU, quantized activations (Hardswish, ELU, Sigmoid, ...) and eager
``QFunctional`` (a ``FloatFunctional``'s adds). Graph mode's adds / muls / cats (``x + y``, ``torch.add``, ``ff.add``)
become generated ``qfunctional_N`` modules: ``auto_mixed_precision`` and ``keep_float_layers`` (``quantize_ptq``) name
them by their call-order key (session 40, ``graph_swap.py``; ``SensitivityTable.op_keys``).

Eager mode: the float twins and the input grids of ``float_twins.py``.

Graph mode reads the graph instead (``graph_swap.readers``): ``auto_mixed_precision`` and ``keep_float_layers``
(``ops=True``): every twin outputs float and a ``_Gate`` on each edge out of it rounds onto its grid only where an int8
op reads that edge; a reused layer gets one twin per call, on that call's own grid; the int8 ops ``prepare_fx`` then
keeps float as islands are swapped too (``_islands``): every row is the built model's score. ``keep_float_layers``
then fixes the gates into plain ``Quantize`` modules (``graph_swap.settle``). Eager ``keep_float_layers``: a float
layer's output goes back onto its calibrated grid, and stays float while every reader is a float layer too.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from tqdm.auto import tqdm

from ..nn.quantized.functional_modules import FloatFunctional, QFunctional
from ..nn.quantized.stubs import DeQuantize, Quantize
from .float_twins import _FloatTwin, _FunctionalTwin, give_input_grids, record_tagged_inputs
from .graph_swap import call_grid, float_only_readers, input_quantizes, make_op_twin, node_of, op_candidates, readers
from .graph_swap import insert_gates, settle, split_calls
from .swap_edges import _plain_copy, insert_picks
from .swap_islands import IslandRule, act_twins, method_ops
from .sensitivity import SensitivityRow, SensitivityTable, _quiet_float_fallback, _score, metric_drop
from .sensitivity import warn_if_lower_is_better

__all__ = ["keep_float_layers", "record_tagged_inputs", "give_input_grids"]


def _set(root: nn.Module, path: str, mod: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, mod)


def _candidates(base_mods: dict[str, nn.Module], prep_mods: dict[str, nn.Module], qmodel: nn.Module) -> list[str]:
    """Paths of ``qmodel``'s int8 modules a mapping can keep float: weighted layers, and the other int8 modules the
    user's model names (BN, activations, eager ``QFunctional``); stubs, dynamic layers and graph mode's generated
    ``qfunctional_N`` are not."""
    out = []
    for path, qmod in qmodel.named_modules():
        mod_name = type(qmod).__module__
        if not mod_name.startswith("lowbit.nn.quantized") or ".dynamic" in mod_name or path not in prep_mods:
            continue
        if isinstance(qmod, (Quantize, DeQuantize, FloatFunctional)) or isinstance(qmod, fx.GraphModule):
            continue
        if callable(getattr(qmod, "weight", None)) or path in base_mods:
            out.append(path)
    return out


Twins = list[tuple[str, nn.Module, set[str]]]


@dataclass
class _Plan:
    """What ``search="fast"`` swaps: ``swaps`` ``{name: [(path in qmodel, float replacement), ...]}`` per candidate,
    ``twins`` ``[(name, a float twin, the candidates that alone read its output)]`` (``_regrid``), ``op_keys`` ``{op
    name: call-order key}``, ``rule`` (graph mode: ``swap_islands.IslandRule``) the int8 ops ``prepare_fx`` keeps float
    with a set of candidates (``fx.islands``), whether the mapping names them or not (``_islands``), and ``follow``
    the swaps of the function activations and method-call ops it may keep float that are no candidate
    (``swap_islands.act_twins`` / ``method_ops``)."""

    swaps: dict[str, list[tuple[str, nn.Module]]]
    twins: Twins = field(default_factory=list)
    op_keys: dict[str, tuple[str, Any, int]] = field(default_factory=dict)
    rule: Callable[[set[str]], set[str]] | None = None
    follow: dict[str, list[tuple[str, nn.Module]]] = field(default_factory=dict)
    op_kinds: dict[str, str] = field(default_factory=dict)  # op name -> "add", "add_relu", "cat", ... (the type column)
    gates: list[tuple[nn.Module, str, set[str], bool]] = field(default_factory=list)  # (gate, producer, readers, int)
    picks: list[tuple[nn.Module, str]] = field(default_factory=list)  # (a _Pick, the candidate it feeds)


def _swaps(base: nn.Module, prepared: nn.Module, qmodel: nn.Module, eager: bool = False, ops: bool = False,
           call_outputs: dict[str, list[nn.Module]] | None = None,
           share_ends: dict[tuple[str, str], nn.Module] | None = None) -> _Plan:
    """The float replacements of every candidate (``_candidates``). ``eager``: float twins output float
    (``give_input_grids`` gives their int8 readers the grid the built model records). Graph mode: ``ops`` adds the int8
    ops a call-order key reaches (``graph_swap.op_candidates``); ``call_outputs`` (``record_call_outputs``) gives each
    call of a reused layer its own twin and grid (``split_calls``: the converted graph's later calls get their own
    attribute); ``share_ends`` (``record_share_ends``) the grids where ``prepare_fx`` observes a float layer's value
    after max pooling, flatten, ... (its gates sit there)."""
    out: dict[str, list[tuple[str, nn.Module]]] = {}
    entries: list[tuple[str, nn.Module, set[str], bool]] = []
    base_mods = dict(base.named_modules())
    prep_mods = dict(prepared.named_modules())
    paths = _candidates(base_mods, prep_mods, qmodel)
    name_of = {p: p for p in paths}
    calls = {p: (p, 0) for p in paths}
    if call_outputs is not None and not eager:
        aliases = split_calls(qmodel, [p for p in paths if p in call_outputs])
        name_of.update({a: p for a, (p, _) in aliases.items()})
        calls.update(aliases)
    gated = ops and not eager  # (graph mode, exact: _Gate on every edge instead of one grid per twin)
    opc = op_candidates(qmodel) if gated else {}
    name_of.update({p: name for p, (name, _, _) in opc.items()})
    acts = act_twins(qmodel) if gated else {}
    name_of.update({p: name for p, (name, _) in acts.items()})
    methods = method_ops(qmodel) if gated else {}
    name_of.update(methods)
    follow = {}
    sites: list[tuple[str, nn.Module, fx.GraphModule, str, fx.Node]] = []  # (ops: a gate on each edge of each)
    picks: list[tuple[nn.Module, str]] = []
    for path, (name, _, _) in opc.items():
        swaps, twin, gm, gpath, node, op_picks = make_op_twin(qmodel, path)
        picks += [(p, name) for p in op_picks]
        sites.append((name, twin, gm, gpath, node))
        out[name] = swaps
        m, o, _ = readers(gm, gpath, node, set(name_of))
        entries.append((name, twin, m, o))
    for path, name in methods.items():  # (x.add(y): no row, swapped when the island rule keeps it float)
        swaps, twin, gm, gpath, node, op_picks = make_op_twin(qmodel, path)
        picks += [(p, name) for p in op_picks]
        sites.append((name, twin, gm, gpath, node))
        follow[name] = swaps
    for path, (name, act) in acts.items():  # (no row: swapped when the island rule keeps it float)
        if (found := node_of(qmodel, path)) is None or len(found[2]) != 1:
            continue
        gpath, gm, (node,) = found
        picks += [(p, name) for p in insert_picks(gm, node, first=True)]
        follow[name] = [*((q, nn.Identity()) for q in input_quantizes(gm, gpath, node, first=True)), (path, act)]
        sites.append((name, act, gm, gpath, node))
    for path, (name, k) in calls.items():
        qmod = qmodel.get_submodule(path)
        parent, _, last = path.rpartition(".")
        if last == "module" and parent in base_mods and type(base_mods[parent]) is type(prep_mods[path]):
            out[parent] = [(parent, copy.deepcopy(base_mods[parent]))]  # a one-layer graph: the float module
            continue
        if isinstance(qmod, QFunctional):
            if eager:  # (graph mode's QFunctional are generated: op_candidates)
                out[path] = [(path, _FunctionalTwin())]
            continue
        found = None if eager else node_of(qmodel, path)
        swaps: list[tuple[str, nn.Module]] = []
        float_out = eager
        mods: set[str] = set()
        other = True
        if found is not None:  # the layer's own input Quantize goes too: a float layer reads float
            gpath, gm, nodes = found
            float_out, other = True, False
            for node in nodes:  # (a reused module not split: its twin serves every call)
                if gated:
                    picks += [(p, name) for p in insert_picks(gm, node, first=True)]
                swaps += [(q, nn.Identity()) for q in input_quantizes(gm, gpath, node, first=True)]
                float_out = float_out and float_only_readers(gm, node)
                m, o, _ = readers(gm, gpath, node, set(name_of))
                mods, other = mods | m, other or o
        twin = _FloatTwin(_plain_copy(prep_mods[name]), qmod, float_out and not gated,
                          call_grid((call_outputs or {}).get(name), k) if found is not None else None)
        if found is not None:
            sites += [(name, twin, found[1], found[0], node) for node in found[2]]
        swaps.append((path, twin))
        out.setdefault(name, []).extend(swaps)
        entries.append((name, twin, mods, other))
    # a twin may drop its grid only when every reader is a layer that has a float twin too
    has_twin = {name for name, *_ in entries}
    twins = [(name, twin, {name_of[m] for m in mods}) for name, twin, mods, other in entries
             if not other and mods and all(name_of[m] in has_twin for m in mods)]
    gates = []
    if gated:  # every twin outputs float, a gate on each of its edges rounds where an int8 op reads it
        twins = []
        for name, twin, gm, gpath, node in sites:
            twin.keep = False
            gates += [(g, name, {name_of[m] for m in mods}, int_other)
                      for g, mods, int_other in insert_gates(gm, gpath, node, twin.grid, set(name_of), share_ends)]
    return _Plan(out, twins, {name: key for name, key, _ in opc.values()}, IslandRule(prepared) if gated else None,
                 follow, {name: op for name, _, op in opc.values()}, gates, picks)


def _islands(plan: _Plan, floats: set[str]) -> set[str]:
    """``floats`` and the int8 ops ``prepare_fx`` then keeps float as islands that the plan can swap (``plan.rule``)."""
    want = set(floats) if plan.rule is None else plan.rule(set(floats))
    return {n for n in want if n in floats or n in plan.swaps or n in plan.follow}


def _regrid(twins: Twins, floats: set[str]) -> None:
    """A float layer whose every reader is float too outputs float (no rounding between float layers)."""
    for name, twin, mods in twins:
        twin.keep = not (name in floats and mods <= floats)


def _apply(qmodel: nn.Module, swaps: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Put the replacements in; return what to put back."""
    undo = [(path, qmodel.get_submodule(path)) for path, _ in swaps]
    for path, mod in swaps:
        _set(qmodel, path, mod)
    return undo


class _State:
    """``qmodel`` with exactly a given set of candidates float (and the islands that follows from it)."""

    def __init__(self, qmodel: nn.Module, plan: _Plan) -> None:
        self.qmodel, self.plan, self.undo = qmodel, plan, {}

    def set(self, floats: set[str]) -> None:
        want = _islands(self.plan, floats)
        for name in [n for n in self.undo if n not in want]:
            _apply(self.qmodel, self.undo.pop(name))
        for name in sorted(want - set(self.undo)):
            self.undo[name] = _apply(self.qmodel, self.plan.swaps.get(name) or self.plan.follow[name])
        _regrid(self.plan.twins, want)
        for gate, producer, mods, int_other in self.plan.gates:
            gate.active = producer in want and (int_other or not mods <= want)
        for pick, reader in self.plan.picks:
            pick.active = reader in want


def _search(qmodel: nn.Module, plan: _Plan, eval_fn: Callable[[nn.Module], Any], baseline: float,
            tolerance: float | None, max_float_layers: int | None, progress: bool, who: str) -> SensitivityTable:
    """Rank (one layer float each) and walk greedily; ``qmodel`` is left with the chosen layers swapped in."""
    table = SensitivityTable(baseline, tolerance=tolerance, view="float", op_keys=plan.op_keys)
    metric = table.all_quantized_metric = _score(eval_fn, qmodel, "the fully quantized model", who)
    state = _State(qmodel, plan)
    rows = []
    for name in tqdm(plan.swaps, desc=f"{who}: rank (one layer float)", disable=not progress, leave=False):
        state.set({name})
        m = _score(eval_fn, qmodel, f"the model with '{name}' float", who)
        kind = plan.op_kinds.get(name) or type(state.undo[name][-1][1]).__name__
        state.set(set())
        rows.append(SensitivityRow(name, kind, m, metric_drop(baseline, m)))
    rows.sort(key=lambda r: -r.metric)  # not by drop: an infinite baseline (SQNR vs float) makes every drop inf
    warn_if_lower_is_better(baseline, [metric, *(r.metric for r in rows)], who)
    table.rows = rows
    budget = len(rows) if max_float_layers is None else max_float_layers
    limit = -math.inf if tolerance is None else tolerance
    for row in tqdm(rows, desc=f"{who}: greedy", disable=not progress, leave=False):
        if (metric_drop(baseline, metric) <= limit or len(table.float_layers) >= budget
                or row.metric <= table.all_quantized_metric):
            break
        state.set({*table.float_layers, row.name})
        m = _score(eval_fn, qmodel, f"the model with {[*table.float_layers, row.name]} float", who)
        if m > metric:
            metric = m
            table.float_layers.append(row.name)
        else:
            state.set(set(table.float_layers))
    table.final_metric = metric
    return table


def keep_float_layers(float_model: nn.Module, prepared: nn.Module, qmodel: nn.Module,
                      eval_fn: Callable[[nn.Module], Any], max_float_layers: int, *, progress: bool = True,
                      who: str = "keep_float_layers",
                      call_outputs: dict[str, list[nn.Module]] | None = None,
                      share_ends: dict[tuple[str, str], nn.Module] | None = None) -> SensitivityTable:
    """Swap up to ``max_float_layers`` int8 layers (graph mode: and ops) of the converted ``qmodel`` back to float, in
    place, picked as ``auto_mixed_precision(search="fast")`` picks them (ranked by ``eval_fn`` with only that candidate
    float, then greedily while the metric improves), on the same candidates and rows: graph mode's adds / muls / cats
    named ``"module:function#index"`` (``table.op_keys``), and with ``call_outputs`` (``graph_swap.record_call_outputs``
    run during the calibration of ``prepared``) one float twin per call of a reused layer on that call's own grid, and
    with ``share_ends`` (``swap_edges.record_share_ends``, same calibration) a float layer read through max pooling /
    flatten / ... is rounded after them, on the grid ``prepare_fx`` records there (exact with histogram observers).
    ``prepared`` is the calibrated model ``qmodel`` came from (its modules give the float twins), ``float_model`` the
    float original. Every other layer stays on the int8 kernels; graph mode's gates are then fixed (``settle``).
    """
    for what, m in (("float_model", float_model), ("prepared", prepared), ("qmodel", qmodel)):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{who}: {what} must be an nn.Module, got {type(m).__name__}")
    if isinstance(max_float_layers, bool) or not isinstance(max_float_layers, int) or max_float_layers < 0:
        raise ValueError(f"{who}: max_float_layers={max_float_layers!r} must be an int >= 0")
    if not callable(eval_fn):
        raise TypeError(f"{who}: eval_fn={eval_fn!r} must be callable (model -> score, higher is better)")
    if share_ends is not None and not isinstance(share_ends, dict):
        raise TypeError(f"{who}: share_ends={type(share_ends).__name__} must be None or the dict "
                        "record_share_ends returns")
    if call_outputs is not None and not isinstance(call_outputs, dict):
        raise TypeError(f"{who}: call_outputs={type(call_outputs).__name__} must be None or the dict "
                        "record_call_outputs returns")
    with _quiet_float_fallback(), torch.no_grad():
        baseline = _score(eval_fn, float_model, "the float model", who)
        graph = any(isinstance(m, fx.GraphModule) for m in qmodel.modules())  # (eager: the twins of before)
        plan = _swaps(float_model, prepared, qmodel, ops=graph, call_outputs=call_outputs or {},
                      share_ends=share_ends)
        if not plan.swaps:
            return SensitivityTable(baseline, view="float")
        table = _search(qmodel, plan, eval_fn, baseline, None, max_float_layers, progress, who)
        settle(qmodel)
        return table
