"""Graph-mode steps on a model ``prepare_fx`` prepared child by child (an untraceable ``forward``).

A module whose own ``forward`` torch.fx cannot trace (control flow on data or on a shape: ``if x.sum() > 0``, a loop
over a data-dependent count) comes back from ``prepare_fx`` as itself, each child prepared as a graph of its own (a
*child graph*: a ``GraphModule`` carrying ``prepare_fx``'s mark); an untraceable submodule of a traced model is an
opaque leaf of the model's graph, its children child graphs alike. Every quantized layer lives in one child graph, so
the graph-mode steps run on each child graph, fed with what that child receives inside the whole model:

- ``child_graphs``: the child graphs, by path (the model's own graph, if any, is not one of them);
- ``capture_calls``: each child graph's calls (positional inputs) on the calibration batches, the whole model run as
  float (every observer the identity) or as the int8 model (``observers_as``), in call order;
- ``reconstruct_children``: ``layerwise.reconstruct``'s graph walk on each outermost child graph in the order they
  first run: its quantized inputs ``x_q`` come from the int8 model with the children before it already rounded, its
  float inputs ``x_f`` from a float copy taken before any rounding, so AdaRound (or the quadratic codes), BRECQ
  blocks, learned grids and bias correction minimise ``||f_q(x_q) - f(x_f)||²`` inside each child as the
  whole-graph walk does (a child graph's own opaque leaves are reached by its walk, in data order). A batch whose
  calls differ between the two models (the int8 model took another branch) pairs ``x_q`` with itself.

A layer pair or a residual stream that spans two child graphs is not equalized, a grid is searched on its own child
graph's output (not the model's), and a child that never runs on the calibration batches is left as calibrated.

>>> import torch, lowbit as Q, warnings
>>> from torch import nn
>>> class Gate(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
...     def forward(self, x):
...         return self.b(self.a(x) if x.sum() > 0 else x)
>>> _ = torch.manual_seed(0)
>>> x = torch.randn(16, 4).abs()
>>> with warnings.catch_warnings():
...     warnings.simplefilter("ignore")
...     p = Q.prepare_fx(Gate().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
>>> sorted(child_graphs(p))
['a', 'b']
>>> _ = p(x)
>>> [c.name for c in reconstruct_children(p, [(x,)], iters=0, rounding="quadratic", progress=False)]
['a.module', 'b.module']
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from ..fx.state import STATE_KEY
from .layers import is_weighted
from .layerwise_step import LayerChange, patch_observers

__all__ = ["capture_calls", "child_graphs", "equalize_children", "observers_as", "reconstruct_children",
           "refine_children"]


def child_graphs(model: nn.Module, outermost: bool = False) -> dict[str, fx.GraphModule]:
    """Path -> child graph (a ``GraphModule`` ``prepare_fx`` built) of every one inside ``model``, ``model`` itself
    excluded; outer graphs before the ones nested in their opaque leaves; ``outermost``: only those inside no other.

    >>> child_graphs(nn.Linear(2, 2))
    {}
    """
    graphs = {n: m for n, m in model.named_modules() if n and isinstance(m, fx.GraphModule) and STATE_KEY in m.meta}
    if outermost:
        graphs = {n: m for n, m in graphs.items() if not any(n.startswith(o + ".") for o in graphs)}
    return graphs


@contextmanager
def observers_as(model: nn.Module, mode: str) -> Iterator[None]:
    """Within: every observer of ``model`` the identity (``"float"``) or the int8 model's rounding (``"quant"``,
    ``layerwise_step.patch_observers``); no statistics recorded. A ``forward`` patched before is put back after."""
    saved = {m: m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__}
    patched = patch_observers(model, mode)
    try:
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
        for m, f in saved.items():
            m.forward = f  # type: ignore[method-assign]


Call = tuple[tuple[Any, ...], dict[str, Any]]  # a call's positional and keyword inputs


def _bind(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's inputs as the graph's positional inputs (keywords placed, defaults filled), tensors copied."""
    try:
        bound = inspect.signature(mod.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        values = tuple(bound.arguments.values())
    except (TypeError, ValueError):
        values = args
    return tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values)


def capture_calls(model: nn.Module, graphs: dict[str, fx.GraphModule], batches: list[Call],
                  mode: str) -> tuple[dict[str, list[list[tuple[Any, ...]]]], list[str]]:
    """Run ``batches`` (``(args, kwargs)`` each) through ``model`` with every observer as ``mode`` (``observers_as``);
    return, per child graph path, its calls' positional inputs per batch, and the paths in the order they first ran
    (those that never ran are left out of the order).

    >>> capture_calls(nn.Linear(2, 2), {}, [((torch.zeros(1, 2),), {})], "float")
    ({}, [])
    """
    calls: dict[str, list[list[tuple[Any, ...]]]] = {p: [[] for _ in batches] for p in graphs}
    order: list[str] = []
    current = [0]

    def hook(path: str) -> Any:
        def fn(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[path][current[0]].append(_bind(mod, args, kwargs))
            if path not in order:
                order.append(path)
        return fn

    handles = [m.register_forward_pre_hook(hook(p), with_kwargs=True) for p, m in graphs.items()]
    try:
        with torch.no_grad(), observers_as(model, mode):
            for i, (args, kwargs) in enumerate(batches):
                current[0] = i
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, order


def _pair(q: list[list[tuple[Any, ...]]], f: list[list[tuple[Any, ...]]]) -> tuple[list[Any], list[Any], int]:
    """Flatten per-batch calls into one batch list each; a batch whose quantized and float calls differ in number or
    shapes pairs its quantized calls with themselves. Returns (x_q, x_f, batches so paired)."""
    xq, xf, odd = [], [], 0

    def shapes(calls: list[tuple[Any, ...]]) -> list[Any]:
        return [tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in c) for c in calls]

    for cq, cf in zip(q, f):
        same = len(cq) == len(cf) and shapes(cq) == shapes(cf)
        odd += bool(cq) and not same
        xq += cq
        xf += cf if same else cq
    return xq, xf, odd


def reconstruct_children(model: nn.Module, calib: Iterable[Any], adaround: bool = True, bias_correction: bool = True,
                         iters: int = 500, batch_size: int = 8, seed: int = 0, progress: bool = True,
                         blocks: bool = False, learn_grids: bool = False, rounding: str = "adaround", *,
                         float_model: nn.Module | None = None, float_calib: list[Call] | None = None,
                         drop: float = 0.0) -> list[LayerChange]:
    """``layerwise.reconstruct``'s walk on every outermost child graph of a calibrated ``model`` (module doc), in the
    order they first run; returns their ``LayerChange`` records, each named by its path in ``model`` (a
    ``"child <path>"`` note on each); a child that never ran on ``calib`` gets none. ``float_model`` (default: a copy
    of ``model`` now, its observers the identity) on ``float_calib`` (default: ``calib``) gives the float inputs;
    batches of ``(args, kwargs)`` pairs are taken as such (an opaque leaf's calls in a graph walk)."""
    from .layerwise import _reconstruct_graph
    from .layerwise_step import batch_tuples

    def calls(c: Any) -> list[Call]:
        c = list(c)
        if c and all(isinstance(b, tuple) and len(b) == 2 and isinstance(b[1], dict) for b in c):
            return c
        return [(b, {}) for b in batch_tuples(c, "reconstruct")]

    batches = calls(calib)
    graphs = child_graphs(model, outermost=True)
    if not graphs:
        return []
    float_model = copy.deepcopy(model) if float_model is None else float_model
    fgraphs = dict(float_model.named_modules())
    f_calls, order = capture_calls(float_model, {p: fgraphs[p] for p in graphs}, batches if float_calib is None
                                   else float_calib, "float")
    changes: list[LayerChange] = []
    for path in order:
        gm = graphs[path]
        if not any(is_weighted(m) for m in gm.modules()):  # nothing to round (its grids stay)
            continue
        q_calls, _ = capture_calls(model, {path: gm}, batches, "quant")  # with the children before already rounded
        xq, xf, odd = _pair(q_calls[path], f_calls[path])
        if not xq:  # (it ran on the float model only)
            continue
        recs = _reconstruct_graph(gm, xq, xf, adaround=adaround, bias_correction=bias_correction, iters=iters,
                                  batch_size=batch_size, seed=seed, progress=progress, blocks=blocks,
                                  learn_grids=learn_grids, rounding=rounding, drop=drop)
        for rec in recs:  # (a record of a graph nested in this one's opaque leaves already names its child)
            rec.name = f"{path}.{rec.name}"
            if rec.notes and rec.notes[-1].startswith("child "):
                rec.notes[-1] = f"child {path}.{rec.notes[-1][len('child '):]}"
            else:
                rec.notes.append(f"child {path}" + (f" ({odd} batches took another path in the int8 model: float "
                                                     "targets from its inputs)" if odd else ""))
        changes += recs
    return changes


def _float_calls(model: nn.Module, graphs: dict[str, fx.GraphModule],
                 batches: list[tuple[Any, ...]]) -> tuple[dict[str, list[tuple[Any, ...]]], list[str]]:
    calls, order = capture_calls(model, graphs, [(b, {}) for b in batches], "float")
    return {p: [c for per in calls[p] for c in per] for p in order}, order


def equalize_children(model: nn.Module, batches: list[tuple[Any, ...]], *, weights: bool,
                      streams: float | None, dense: float = 0.0) -> tuple[list[Any], dict[str, str]]:
    """``equalize_prepared(relu6="range", weights=weights, dense=dense)`` and (``streams`` not None) ``equalize_streams`` on
    every child graph of a prepared, not yet calibrated ``model``, each on its float inputs in the whole model
    (the children keep their functions, so one float run feeds them all). Returns the records (layer names as paths
    in ``model``) and, per child graph that ran, a summary; a child no batch reaches is named as skipped."""
    from dataclasses import replace

    from .equalize import equalize_prepared
    from .equalize_stream import equalize_streams

    graphs = child_graphs(model)
    calls, order = _float_calls(model, graphs, batches)
    records: list[Any] = []
    done: dict[str, str] = {p: "skipped: no calibration batch runs it" for p in graphs if p not in calls}
    for path in order:
        gm, xs = graphs[path], calls[path]
        pairs = equalize_prepared(gm, xs, relu6="range", weights=weights, dense=dense)
        eq = equalize_streams(gm, xs, alpha=float(streams)) if streams is not None else []
        records += [replace(e, first=f"{path}.{e.first}", second=f"{path}.{e.second}") for e in pairs]
        records += [replace(e, writers=[f"{path}.{w}" for w in e.writers], readers=[f"{path}.{r}" for r in e.readers])
                    for e in eq]
        done[path] = (f"{len(pairs)} layer pairs ({sum(e.stretched for e in pairs)} channels stretched)"
                      + (f", {len(eq)} residual streams" if streams is not None else ""))
    return records, done


def refine_children(model: nn.Module, batches: list[tuple[Any, ...]], *, top: int,
                    progress: bool, held: int = 0) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """``grid_search.refine_grids(top=top, held=held)`` on every child graph of a calibrated ``model``, each on the
    first of its float inputs in the whole model (its later inputs the held-out ones) and on its own output error
    (the observers of graphs nested in its opaque leaves kept inert). Returns ``(path, GridChange)`` per searched
    grid and a summary per child graph."""
    from contextlib import ExitStack

    from .grid_search import refine_grids

    graphs = child_graphs(model)
    calls, order = _float_calls(model, graphs, batches)
    found: list[tuple[str, Any]] = []
    done: dict[str, str] = {p: "skipped: no calibration batch runs it" for p in graphs if p not in calls}
    for path in order:
        gm = graphs[path]
        with ExitStack() as stack:
            for inner in child_graphs(gm).values():
                stack.enter_context(observers_as(inner, "float"))
            grids = refine_grids(gm, calls[path], top=top, progress=progress, held=held)
        found += [(path, g) for g in grids]
        done[path] = f"{len(grids)} grids searched, {sum(g.scale_after != g.scale_before for g in grids)} shrunk"
    return found, done
