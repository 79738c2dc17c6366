"""A quantization report: accuracy/size/latency table, per-layer SQNR and activation ranges, as Markdown or HTML.

``write_report(out_dir, table_rows, compare_result=None, histograms=None, fmt="md")`` writes
``{name}.md`` (or ``.html``) and, when given the data, two PNG figures next to it:

- ``{name}_sqnr.png``: per-layer SQNR bars (activation and weight) from ``lowbit.debug.compare``;
  an exact layer (``inf`` dB) is drawn hatched at the top of the axis and labelled ``inf``.
- ``{name}_activations.png``: for each activation observer of a prepared (calibrated) model, the
  histogram of what it saw (``HistogramObserver``; a min/max observer gives only its observed
  range, shaded) with the chosen clipping range ``[(qmin - zp)·s, (qmax - zp)·s]`` as red lines.

``table_rows`` are the CLI's row dicts (``method, accuracy, delta, size_kib, size_ratio,
latency_ms, speedup``), printed as ``lowbit quantize`` prints them. The plots need matplotlib
(``pip install lowbit[report]``); ``plots=None`` (default) draws them when it is installed and
otherwise writes the tables alone, ``plots=True`` requires it.

>>> import tempfile
>>> row = dict(method="fp32", accuracy=91.0, delta=0.0, size_kib=120.0, size_ratio=1.0, latency_ms=2.5, speedup=1.0)
>>> print(rows_to_markdown([row]).splitlines()[2])
| fp32 | 91.00 | +0.00 | 120.0 | 1.00x | 2.50 | 1.00x |
>>> out = write_report(tempfile.mkdtemp(), [row], plots=False)
>>> out.report.name, out.figures
('report.md', {})
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .debug.compare import CompareResult
from .debug.ranges import ActivationRange, activation_ranges
from .debug.table import md_cell

__all__ = ["ReportFiles", "plot_activation_ranges", "plot_sqnr", "rows_to_markdown", "write_report"]

ROW_KEYS = ("method", "accuracy", "delta", "size_kib", "size_ratio", "latency_ms", "speedup")
_HEAD = ("method", "accuracy (%)", "Δ vs fp32 (pts)", "size (KiB)", "size ratio", "latency (ms, batch 64)",
         "speed-up vs fp32")
_INSTALL = "pip install lowbit[report]"


def _head(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """``_HEAD`` with the batch the latency was timed on (a row's ``latency_batch``; 64 when none says)."""
    batch = next((r["latency_batch"] for r in rows if isinstance(r.get("latency_batch"), int)), 64)
    return tuple(f"latency (ms, batch {batch})" if h.startswith("latency") else h for h in _HEAD)


@dataclass
class ReportFiles:
    """What ``write_report`` wrote, and the values its figures show (read back from the drawn artists)."""

    report: Path
    figures: dict[str, Path] = field(default_factory=dict)     # "sqnr" / "activations" -> PNG
    plotted: dict[str, Any] = field(default_factory=dict)      # "sqnr" / "activations" -> plotted values


# ---------------------------------------------------------------- tables


def _check_rows(rows: Any) -> list[dict[str, Any]]:
    if not isinstance(rows, (list, tuple)):
        raise TypeError(f"write_report: table_rows must be a list of row dicts, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"write_report: table_rows[{i}] must be a dict, got {type(r).__name__}")
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"write_report: table_rows[{i}] (method={r.get('method')!r}) lacks keys {missing}")
        bad = [k for k in ROW_KEYS[1:] if not (r[k] is None and k in ("accuracy", "delta"))
               and (isinstance(r[k], bool) or not isinstance(r[k], (int, float)))]
        if bad:
            raise TypeError(f"write_report: table_rows[{i}] (method={r.get('method')!r}) needs numbers for {bad}, got "
                            + ", ".join(f"{k}={r[k]!r}" for k in bad))
    return list(rows)


def _row_cells(r: dict[str, Any]) -> tuple[str, ...]:
    acc, delta = r["accuracy"], r["delta"]
    unmeasured = acc is None or acc != acc  # no evaluation data (None or NaN): "—", not "nan"
    return (str(r["method"]), "—" if unmeasured else f"{acc:.2f}", "—" if unmeasured else f"{delta:+.2f}",
            f"{r['size_kib']:.1f}",
            f"{r['size_ratio']:.2f}x", f"{r['latency_ms']:.2f}", f"{r['speedup']:.2f}x")


def rows_to_markdown(rows: list[dict[str, Any]]) -> str:
    """The accuracy/size/latency table, cell for cell as ``lowbit quantize`` prints it (cells escaped: ``_md_cell``)."""
    rows = _check_rows(rows)
    return _md_table(_head(rows), [_row_cells(r) for r in rows])


def _range_cells(ranges: list[ActivationRange]) -> list[tuple[str, ...]]:
    return [(a.name, a.observer, f"{a.observed[0]:.4g}", f"{a.observed[1]:.4g}", f"{a.clip[0]:.4g}",
             f"{a.clip[1]:.4g}", f"{a.scale:.4g}", str(a.zero_point)) for a in ranges]


_RANGE_HEAD = ("activation", "observer", "observed min", "observed max", "clip min", "clip max", "scale",
               "zero point")


_md_cell = md_cell  # one cell as literal text (lowbit.debug.table.md_cell)


def _md_table(head: tuple[str, ...], cells: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in cells])


def _html_table(head: tuple[str, ...], cells: list[tuple[str, ...]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in cells)
    return f"<table>\n<thead><tr>{th}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


# ---------------------------------------------------------------- figures


def _figure_class(required: bool) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        if required:
            raise ImportError(f"lowbit.report draws its plots with matplotlib, which is not installed: {_INSTALL}"
                              ) from err
        return None
    return Figure


_ONE_LINE = str.maketrans({"\t": " ", "\r": " ", "\n": " "})  # a tick label is one line (DejaVu has no tab glyph)


def _lowest(rows: list[Any], max_layers: int) -> list[Any]:
    """The ``max_layers`` rows with the lowest SQNR (NaN first: no number is the worst news), in module order."""
    def key(r: Any) -> float:
        vals = [v for v in (r.act_sqnr_db, r.weight_sqnr_db) if v is not None]
        return -math.inf if any(math.isnan(v) for v in vals) else min(vals, default=math.inf)
    keep = set(sorted(range(len(rows)), key=lambda i: key(rows[i]))[:max_layers])
    return [r for i, r in enumerate(rows) if i in keep]


def plot_sqnr(result: CompareResult, path: str | Path, max_layers: int = 100) -> list[tuple[str, str, float]]:
    """Bar chart of ``result``'s per-layer SQNR to ``path`` (PNG); returns ``(layer, kind, dB)`` as drawn.

    More than ``max_layers`` layers: the ``max_layers`` with the lowest SQNR are drawn (the figure is 0.7 inch
    a layer; 3000 layers made a 210,200-pixel-wide PNG, past what browsers display), the title says how many.
    A NaN SQNR is a hatched grey bar of height 0 labelled ``nan``."""
    if not isinstance(result, CompareResult):
        raise TypeError(f"plot_sqnr: result must be a CompareResult from lowbit.debug.compare, got {type(result).__name__}")
    if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 1:
        raise ValueError(f"plot_sqnr: max_layers={max_layers!r} must be a positive int")
    figure = _figure_class(required=True)
    rows = result.rows if len(result.rows) <= max_layers else _lowest(result.rows, max_layers)
    finite = [v for r in rows for v in (r.act_sqnr_db, r.weight_sqnr_db) if v is not None and math.isfinite(v)]
    top = (max(finite) if finite else 40.0) + 10.0  # where a +inf bar ends (an exact layer)
    lowest = min([0.0, *finite])
    bottom = lowest - 5.0 if lowest < 0 else 0.0  # where a -inf bar ends (noise without signal)
    fig = figure(figsize=(max(6.0, 0.7 * len(rows) + 2.0), 4.0))
    fig.subplots_adjust(bottom=0.22, top=0.92)  # room for rotated layer names (constrained layout is slow)
    ax = fig.add_subplot()
    for kind, attr, dx, color in (("activation", "act_sqnr_db", -0.2, "tab:blue"),
                                  ("weight", "weight_sqnr_db", 0.2, "tab:orange")):
        xs = [i + dx for i, r in enumerate(rows) if getattr(r, attr) is not None]
        vals = [getattr(r, attr) for r in rows if getattr(r, attr) is not None]
        bars = ax.bar(xs, [(top if v > 0 else bottom) if math.isinf(v) else 0.0 if math.isnan(v) else v
                           for v in vals], width=0.4, color=color, label=kind)
        for bar, v, name in zip(bars, vals, [r.name for r in rows if getattr(r, attr) is not None]):
            bar.set_gid(f"{kind}\t{name}\t{v if not math.isfinite(v) else 'finite'}")
            if not math.isfinite(v):
                bar.set_hatch("//")
                y = top if v > 0 else 0.0 if math.isnan(v) else bottom
                if math.isnan(v):
                    bar.set_edgecolor("grey")
                ax.annotate(str(v), (bar.get_x() + bar.get_width() / 2, y), ha="center",
                            va="bottom" if v > 0 or math.isnan(v) else "top", fontsize=8)
    ax.set_xticks(range(len(rows)), [(r.name or "<root>").translate(_ONE_LINE) for r in rows], rotation=45, ha="right")
    ax.set_ylabel("SQNR (dB)  (higher is better)")
    ax.set_title("float vs quantized, per layer" if len(rows) == len(result.rows) else
                 f"float vs quantized: the {len(rows)} lowest-SQNR layers of {len(result.rows)}")
    ax.set_ylim(bottom - (3.0 if bottom < 0 else 0.0), top + 8.0)
    ax.legend(loc="upper left", ncols=2, fontsize=8)
    fig.savefig(path, dpi=100)
    drawn = []
    for patch in ax.patches:  # read back what was drawn: (layer, kind, bar height, or ±inf for a hatched bar)
        kind, _, rest = (patch.get_gid() or "").partition("\t")
        name, _, tag = rest.rpartition("\t")  # (a layer name may hold a tab)
        if kind:
            drawn.append((name, kind, float(tag) if tag != "finite" else float(patch.get_height())))
    return drawn


def _coarsen(a: ActivationRange, max_bins: int) -> tuple[Any, Any]:
    """The histogram summed into at most ``max_bins`` bins (drawing 2048 bins is slow and looks the same)."""
    hist = a.histogram
    assert hist is not None
    group = -(-hist.numel() // max_bins)
    pad = (-hist.numel()) % group
    counts = torch.cat([hist, hist.new_zeros(pad)]).reshape(-1, group).sum(1)
    width = (a.observed[1] - a.observed[0]) / hist.numel()
    edges = a.observed[0] + width * group * torch.arange(counts.numel() + 1, dtype=torch.float64)
    return counts.numpy(), edges.clamp(max=a.observed[0] + width * (hist.numel() + pad)).numpy()


def plot_activation_ranges(ranges: list[ActivationRange], path: str | Path,
                           max_plots: int = 24) -> list[tuple[str, float, float]]:
    """Histograms (or observed ranges) with the clipping range, first ``max_plots`` observers; returns the
    ``(activation, clip min, clip max)`` drawn, read back from the red lines."""
    if not isinstance(max_plots, int) or max_plots < 1:
        raise ValueError(f"plot_activation_ranges: max_plots={max_plots!r} must be a positive int")
    if not ranges or not all(isinstance(a, ActivationRange) for a in ranges):
        raise TypeError("plot_activation_ranges: ranges must be a non-empty list of ActivationRange "
                        "(lowbit.debug.activation_ranges(prepared_model))")
    figure = _figure_class(required=True)
    shown = ranges[:max_plots]
    ncols = min(3, len(shown))
    nrows = -(-len(shown) // ncols)
    fig = figure(figsize=(4.2 * ncols, 2.8 * nrows + 0.5))
    fig.subplots_adjust(hspace=0.55, wspace=0.3, top=1 - 0.75 / (2.8 * nrows + 0.5), bottom=0.3 / nrows)
    drawn = []
    for i, a in enumerate(shown):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        if a.histogram is not None:
            counts, edges = _coarsen(a, max_bins=128)
            ax.stairs(counts, edges, fill=True, color="tab:blue", alpha=0.7)
            ax.set_yscale("symlog")
        else:
            ax.axvspan(*a.observed, color="tab:blue", alpha=0.3, label="observed")
            ax.set_yticks([])
        for x in a.clip:
            ax.axvline(x, color="red", linestyle="--", linewidth=1.2, gid=f"clip\t{a.name}")
        ax.set_title(f"{a.name} ({a.observer})", fontsize=9)
        ax.tick_params(labelsize=7)
        xs = [ln.get_xdata()[0] for ln in ax.lines if (ln.get_gid() or "") == f"clip\t{a.name}"]
        drawn.append((a.name, float(xs[0]), float(xs[1])))
    fig.suptitle("calibrated activations: histogram, clipping range (red)", fontsize=10)
    fig.savefig(path, dpi=90)
    return drawn


# ---------------------------------------------------------------- report


def write_report(out_dir: str | Path, table_rows: list[dict[str, Any]], compare_result: CompareResult | None = None,
                 histograms: nn.Module | list[ActivationRange] | None = None, fmt: str = "md",
                 name: str = "report", notes: str = "", plots: bool | None = None) -> ReportFiles:
    """Write ``{name}.{fmt}`` (+ PNG figures) into ``out_dir`` (created if missing); see the module doc.

    ``histograms``: a prepared, calibrated model (its observers are read with
    ``lowbit.debug.activation_ranges``) or that function's result. ``notes``: a paragraph of plain
    text under the title (model, versions, ...). ``plots``: ``None`` draws when matplotlib is
    installed, ``True`` requires it, ``False`` writes tables only.
    """
    if fmt not in ("md", "html"):
        raise ValueError(f"write_report: fmt={fmt!r} must be 'md' or 'html'")
    if not isinstance(name, str) or not name or any(c in name for c in "/\\\0"):
        raise ValueError(f"write_report: name={name!r} must be a plain file stem such as 'report'")
    if plots not in (None, True, False):
        raise TypeError(f"write_report: plots={plots!r} must be None, True or False")
    if not isinstance(notes, str):
        raise TypeError(f"write_report: notes must be a str, got {type(notes).__name__}")
    rows = _check_rows(table_rows)
    if compare_result is not None and not isinstance(compare_result, CompareResult):
        raise TypeError("write_report: compare_result must be a lowbit.debug.CompareResult or None, got "
                        f"{type(compare_result).__name__}")
    ranges: list[ActivationRange] | None = None
    if isinstance(histograms, nn.Module):
        ranges = activation_ranges(histograms)
    elif isinstance(histograms, (list, tuple)) and all(isinstance(a, ActivationRange) for a in histograms):
        ranges = list(histograms)
    elif histograms is not None:
        raise TypeError("write_report: histograms must be a prepared model, a list of ActivationRange or None, "
                        f"got {type(histograms).__name__}")
    out_dir = Path(out_dir)
    blocker = next((p for p in (out_dir, *out_dir.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise NotADirectoryError(f"write_report: out_dir={str(out_dir)!r} cannot be a folder: {str(blocker)!r} is a "
                                 "file (give another folder)")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(out_dir / f"{name}.{fmt}")
    wanted = compare_result is not None or bool(ranges)
    draw = plots is not False and wanted and _figure_class(plots is True) is not None
    if draw and compare_result is not None and compare_result.rows:
        files.figures["sqnr"] = out_dir / f"{name}_sqnr.png"
        files.plotted["sqnr"] = plot_sqnr(compare_result, files.figures["sqnr"])
    if draw and ranges:
        files.figures["activations"] = out_dir / f"{name}_activations.png"
        files.plotted["activations"] = plot_activation_ranges(ranges, files.figures["activations"])
    missing_plots = not draw and plots is None and wanted

    sections: list[tuple[str, Path | None, tuple[str, ...], list[tuple[str, ...]], str]] = []
    if rows:
        sections.append(("Accuracy, size and latency", None, _head(rows), [_row_cells(r) for r in rows], ""))
    if compare_result is not None:
        sections.append(("Per-layer error: float vs quantized", files.figures.get("sqnr"), CompareResult.columns,
                         compare_result.cells(), "SQNR = 10·log10(Σx² / Σ(x − x̂)²); every 6 dB is about one bit."
                         if compare_result.rows else "No layer was compared: the comparison holds no quantized layer."))
    if ranges:
        sections.append(("Activation ranges (calibration)", files.figures.get("activations"), _RANGE_HEAD,
                         _range_cells(ranges), "clip = [(qmin − zp)·s, (qmax − zp)·s], the representable range."))
    text = (_markdown if fmt == "md" else _html)(notes, sections, missing_plots)
    files.report.write_text(text, encoding="utf-8")
    return files


def _markdown(notes: str, sections: list[Any], missing_plots: bool) -> str:
    parts = ["# lowbit quantization report"]
    if notes:
        parts.append(notes)
    if missing_plots:
        parts.append(f"(Plots skipped: matplotlib is not installed — `{_INSTALL}`.)")
    for title, fig, head, cells, caption in sections:
        parts.append(f"## {title}")
        if fig is not None:
            parts.append(f"![{title}]({fig.name})")
        parts.append(_md_table(head, cells))
        if caption:
            parts.append(caption)
    return "\n\n".join(parts) + "\n"


def _html(notes: str, sections: list[Any], missing_plots: bool) -> str:
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
             "img{max-width:100%}")
    parts = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8"><title>lowbit quantization report</title>',
             f"<style>{style}</style></head><body>", "<h1>lowbit quantization report</h1>"]
    if notes:
        parts.append(f"<p>{html.escape(notes)}</p>")
    if missing_plots:
        parts.append(f"<p>(Plots skipped: matplotlib is not installed — <code>{_INSTALL}</code>.)</p>")
    for title, fig, head, cells, caption in sections:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if fig is not None:
            parts.append(f'<img src="{html.escape(fig.name)}" alt="{html.escape(title)}">')
        parts.append(_html_table(head, cells))
        if caption:
            parts.append(f"<p>{html.escape(caption)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
