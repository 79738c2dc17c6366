"""What ``compare`` measures and returns: ``sqnr`` (float64 sums over any number of tensor pairs, ``_Stats``) and the
per-layer table (``LayerComparison`` rows in a ``CompareResult``: text, Markdown and dict forms)::

    SQNR = 10·log10(Σ x² / Σ (x - x̂)²)  dB        max abs error = max |x - x̂|

``x`` the float value, ``x̂`` the quantized one; equal values (an equal ±inf too) are no error, so an exact match is
``inf`` dB and an all-zero reference matched inexactly ``-inf``; a NaN stays in the max error.

>>> import torch
>>> sqnr(torch.tensor([1.0, float("inf")]), torch.tensor([1.0, float("inf")]))
inf
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from ..qtensor import QTensor
from .table import md_cell, pad, text_width

__all__ = ["CompareResult", "LayerComparison", "sqnr"]

_ONE_LINE = str.maketrans({"\t": " ", "\r": " ", "\n": " "})  # a text-table row is one line


# ---------------------------------------------------------------- numbers


def sqnr(x: torch.Tensor, x_hat: torch.Tensor | QTensor) -> float:
    """``10·log10(Σ x² / Σ (x - x̂)²)`` in dB (float64 sums); ``inf`` when ``x̂ == x``.

    >>> sqnr(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]))   # 25 / 0.25 = 100 -> 20 dB
    20.0
    """
    stats = _Stats()
    stats.add(_to_float(x, "sqnr: x"), _to_float(x_hat, "sqnr: x_hat"), "sqnr")
    return stats.sqnr_db


def _to_float(t: Any, what: str) -> torch.Tensor:
    if isinstance(t, QTensor):
        return t.dequantize()
    if isinstance(t, torch.Tensor):
        if t.is_complex():  # (the cast to float dropped the imaginary part, warned, and scored what was left)
            raise TypeError(f"{what} is a complex tensor ({t.dtype}); SQNR compares real values")
        return t.detach() if t.is_floating_point() else t.detach().double()
    raise TypeError(f"{what} must be a tensor or a QTensor, got {type(t).__name__}")


@dataclass
class _Stats:
    """Streaming Σx², Σ(x-x̂)², max|x-x̂| over any number of tensor pairs."""

    signal: float = 0.0
    noise: float = 0.0
    max_err: float = 0.0
    count: int = 0

    def add(self, x: torch.Tensor, x_hat: torch.Tensor, where: str) -> None:
        if x.shape != x_hat.shape:
            raise ValueError(f"{where}: float output of shape {tuple(x.shape)} vs quantized output of shape "
                             f"{tuple(x_hat.shape)}; the models do not compute the same thing here")
        x, x_hat = x.detach().double(), x_hat.detach().to(x.device).double()
        err = torch.where(x == x_hat, 0.0, x - x_hat)  # equal values are no error, an equal ±inf too (inf - inf: NaN)
        self.signal += float((x * x).sum())
        self.noise += float((err * err).sum())
        if err.numel():  # a NaN stays (Python's max(0.0, nan) is 0.0: a NaN output read "max abs err 0")
            m = float(err.abs().max())
            self.max_err = m if math.isnan(m) or m > self.max_err else self.max_err
        self.count += x.numel()

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


# ---------------------------------------------------------------- result table


@dataclass(frozen=True)
class LayerComparison:
    """One quantized module: activation and (if it has one) weight error against the float model."""

    name: str            # module name in the quantized model
    module_type: str     # its class name
    compared_with: str   # float module whose output is the reference (last fused-away module, or name)
    act_sqnr_db: float | None  # None: not comparable (channels rescaled by equalization)
    act_max_abs_err: float | None
    weight_sqnr_db: float | None = None
    weight_max_abs_err: float | None = None


_HEADER = ("layer", "type", "compared with", "act SQNR (dB)", "act max abs err", "weight SQNR (dB)", "weight max abs err")


def _fmt_db(v: float | None) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) and v > 0 else f"{v:.2f}")


def _fmt_err(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


@dataclass
class CompareResult:
    """The per-layer table ``compare`` returns: ``rows`` in the quantized model's module order."""

    rows: list[LayerComparison] = field(default_factory=list)
    columns: ClassVar[tuple[str, ...]] = _HEADER

    def cells(self) -> list[tuple[str, ...]]:
        """Each row as the formatted strings of the text/Markdown tables (SQNR 2 decimals, errors 4 digits)."""
        return [(r.name or "<root>", r.module_type, r.compared_with or "<root>", _fmt_db(r.act_sqnr_db),
                 _fmt_err(r.act_max_abs_err), _fmt_db(r.weight_sqnr_db), _fmt_err(r.weight_max_abs_err))
                for r in self.rows]

    def worst(self, kind: str = "activation") -> LayerComparison:
        """The row with the lowest SQNR of ``kind`` (``"activation"`` or ``"weight"``)."""
        if kind not in ("activation", "weight"):
            raise ValueError(f"kind={kind!r} must be 'activation' or 'weight'")
        key = "act_sqnr_db" if kind == "activation" else "weight_sqnr_db"
        rows = [r for r in self.rows if getattr(r, key) is not None]
        if not rows:
            raise ValueError(f"no layer has a {kind} comparison")
        return min(rows, key=lambda r: (not math.isnan(getattr(r, key)), getattr(r, key)))  # NaN: the worst news

    def __str__(self) -> str:
        table = [self.columns, *[tuple(c.translate(_ONE_LINE) for c in row) for row in self.cells()]]
        widths = [max(text_width(row[i]) for row in table) for i in range(len(self.columns))]
        lines = ["  ".join(pad(c, w, right=i >= 3) for i, (c, w) in enumerate(zip(row, widths))) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(line.rstrip() for line in lines)

    def to_markdown(self) -> str:
        """A GitHub Markdown table with the same cells as ``str(result)``."""
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * 3 + "---:|" * 4]
        lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in self.cells()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """``{"rows": [{name, module_type, compared_with, act_sqnr_db, ...}, ...]}`` (plain floats; inf kept)."""
        return {"rows": [asdict(r) for r in self.rows]}
