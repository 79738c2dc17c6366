"""``quantize_ptq(recipe="accurate")``'s equalize and refine-grids steps, on the model's graph and on its child graphs.

A model whose ``forward`` torch.fx traces is one graph: equalization (``equalize_prepared``, ``equalize_streams``) and
the grid search (``refine_grids``) run on it as before. Where a ``forward`` cannot be traced (the model's own: no
graph; a submodule's: an opaque leaf of the graph), ``prepare_fx`` prepares the children one by one as graphs of their
own, and both steps also run on each such child graph (``lowbit.algorithms.children``): on its inputs in the whole
float model, a grid judged on its child's output. What each child got, or why it got nothing, goes into
``report.children`` (path -> lines) and the step's summary names the untraceable part; layer pairs or residual
streams spanning two children are not equalized (each child is its own graph).

>>> import torch, lowbit as Q, warnings
>>> from torch import nn
>>> class Gate(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
...     def forward(self, x):
...         return self.a(x) if x.sum() > 0 else x
>>> _ = torch.manual_seed(0)
>>> calib = [torch.randn(16, 4).abs() for _ in range(2)]
>>> with warnings.catch_warnings():
...     warnings.simplefilter("ignore")
...     q, r = Q.quantize_ptq(Gate().eval(), calib, iters=0, rounding="quadratic", equalize=True, progress=False)
>>> dict(r.steps)["equalize"].startswith("per child graph (Gate.forward cannot be traced by torch.fx")
True
>>> r.children["a"][0]
'equalize: 1 layer pairs (0 channels stretched), 0 residual streams'
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from torch import fx, nn

from .algorithms.children import child_graphs, equalize_children, observers_as, refine_children

__all__ = ["equalize_step", "note_children", "refine_step", "round_children"]

# the grid search's held-out check (``refine_grids(held=)``): a shrunk step is kept only if it also lowers the output
# error on the calibration batches after the first, up to this many samples (session 45: one 4-sample batch let
# overfitted steps through on an nn.MultiheadAttention wrapper, 12 samples did not)
HELD = 64
# the clamp stretch into a dense reader (``equalize_prepared(dense=)``): s_i^0.5, half the range disparity moved into
# the reader's weight rows (session 46, MobileNetV2's depthwise -> projection pairs: +0.2-0.3 dB logit SQNR)
DENSE = 0.5
# QDrop in the residual blocks' rounding (``reconstruct(drop=)``): each activation element inside a block stays float
# with this probability while the block learns (session 50, MobileNetV2: agreement up on two disjoint 480-crop sets)
QDROP = 0.5


def note_children(report: Any, step: str, done: dict[str, str]) -> None:
    """Add ``"<step>: <what>"`` to ``report.children[path]`` for each child graph in ``done``."""
    for path, what in done.items():
        report.children.setdefault(path, []).append(f"{step}: {what}")


def _children_summary(done: dict[str, str], untraced: str | None) -> str:
    ran = sum(not v.startswith("skipped") for v in done.values())
    idle = [p for p, v in done.items() if v.startswith("skipped")]
    where = f"per child graph ({untraced})" if untraced else "in the child graphs of untraceable submodules"
    return (f"{where}: {ran} of {len(done)} children" + (f" (not run by any calibration batch: {', '.join(idle)})"
                                                         if idle else ""))


def equalize_step(prepared: nn.Module, batches: list[tuple[Any, ...]], report: Any, *, equalize: bool | str,
                  streams: float | None, untraced: str | None) -> None:
    """Equalize ``prepared`` (before calibration): its graph, then its child graphs; record it in ``report``."""
    parts = []
    if isinstance(prepared, fx.GraphModule):
        from .algorithms.equalize import equalize_prepared
        from .algorithms.equalize_stream import equalize_streams

        report.equalized = equalize_prepared(prepared, batches, relu6="range", weights=equalize is True, dense=DENSE)
        stretched = sum(e.stretched for e in report.equalized if e.power == 1.0)
        part = [e for e in report.equalized if e.power != 1.0]
        summary = (f"{len(report.equalized)} layer pairs equalized ({stretched} channels stretched to fill their "
                   f"clamp; {sum(e.stretched for e in part)} channels of {len(part)} pairs with a dense reader "
                   f"stretched by s^{DENSE})")
        if streams is not None:
            eq = equalize_streams(prepared, batches, alpha=float(streams))
            report.equalized += eq
            spreads = ", ".join(f"{e.spread_before:.3g}->{e.spread_after:.3g}" for e in eq)
            summary += f"; {len(eq)} residual streams rescaled (channel range spread {spreads or '-'})"
        parts.append(summary)
    if child_graphs(prepared):
        records, done = equalize_children(prepared, batches, weights=equalize is True, streams=streams,
                                          dense=DENSE)
        report.equalized += records
        note_children(report, "equalize", done)
        pairs = sum(hasattr(e, "first") for e in records)
        parts.append(f"{_children_summary(done, untraced)}, {pairs} layer pairs equalized "
                     f"({sum(getattr(e, 'stretched', 0) for e in records)} channels stretched)"
                     + (f", {len(records) - pairs} residual streams rescaled" if streams is not None else "")
                     + "; pairs and streams spanning two children are not equalized")
    report.steps.append(("equalize", "; ".join(parts)))


def _kept(grids: list[Any]) -> str:
    """The report's note on the steps the held-out check turned down (``refine_grids(held=)``)."""
    back = [g for g in grids if g.held_after is not None and g.scale_after == g.scale_before]
    return (f"; {len(back)} kept at the calibrated step (the search batch's step raised the held-out batches' "
            f"error: " + ", ".join(f"{g.source} x{g.held_after / max(1e-30, g.held_before):.2f}" for g in back) + ")"
            if back else "")


def refine_step(prepared: nn.Module, batches: list[tuple[Any, ...]], report: Any, *, refine: int, progress: bool,
                untraced: str | None) -> None:
    """Search the costliest activation grids (after calibration): on the model's output where it is one graph, on
    each child graph's output too; record it in ``report``."""
    parts = []
    nested = child_graphs(prepared)
    if isinstance(prepared, fx.GraphModule):
        from .algorithms.grid_search import refine_grids

        with ExitStack() as stack:  # the child graphs' observers inert (they would record the search's runs)
            for inner in nested.values():
                stack.enter_context(observers_as(inner, "float"))
            grids = refine_grids(prepared, batches, top=refine, progress=progress, held=HELD)
        moved = [g for g in grids if g.scale_after != g.scale_before]
        gain = sum(g.error_before for g in grids) / max(1e-30, sum(g.error_after for g in grids))
        parts.append(f"{len(grids)} activation grids searched on the model output, {len(moved)} steps shrunk ("
                     + ", ".join(f"{g.source} x{g.scale_after / g.scale_before:.2f}" for g in moved)
                     + f"); their summed output error /{gain:.2f}" + _kept(grids))
    if nested:
        found, done = refine_children(prepared, batches, top=refine, progress=progress, held=HELD)
        note_children(report, "refine grids", done)
        moved2 = [(p, g) for p, g in found if g.scale_after != g.scale_before]
        parts.append(f"{_children_summary(done, untraced)}, up to {refine} grids each searched on its own output: "
                     f"{len(found)} searched, {len(moved2)} steps shrunk ("
                     + ", ".join(f"{p}.{g.source} x{g.scale_after / g.scale_before:.2f}" for p, g in moved2) + ")"
                     + _kept([g for _, g in found]))
    report.steps.append(("refine grids", "; ".join(parts)))


def round_children(prepared: nn.Module, report: Any, *, iters: int, untraced: str | None) -> str:
    """Per child graph, how its layers were rounded (from ``report.layers``' ``"child <path>"`` notes) into
    ``report.children``; a child with weighted layers that no calibration batch runs is named (its layers convert
    rounded to nearest on their calibrated grids). Returns the round step's addendum ("" without child graphs)."""
    from .algorithms.layers import is_weighted

    graphs = child_graphs(prepared)
    if not graphs:
        return ""
    done: dict[str, str] = {}
    for path in graphs:
        mine = [c for c in report.layers if any(n == f"child {path}" or n.startswith(f"child {path} (")
                                                for n in c.notes)]
        if not mine:
            if any(is_weighted(m) for m in graphs[path].modules()) and not any(
                    c.name.startswith(path + ".") for c in report.layers):
                done[path] = "skipped: no calibration batch runs it (its layers convert rounded to nearest)"
            continue
        quad = sum("quadratic" in c.notes for c in mine)
        block = sum(any(n.startswith("block ") for n in c.notes) for c in mine)
        rest = len(mine) - quad - block
        done[path] = (f"{len(mine)} layers: {quad} by the quadratic search, {block} by AdaRound per residual block, "
                      + (f"{rest} by AdaRound alone ({iters} steps)" if iters else f"{rest} to nearest")
                      + f"; {sum(c.codes_changed for c in mine) / len(mine):.1%} of codes moved, biases corrected")
    note_children(report, "round", done)
    return f"; {_children_summary(done, untraced)}" if done else ""
