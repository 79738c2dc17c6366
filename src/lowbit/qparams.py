"""From an observed range to quantization parameters (DESIGN §2).

Affine (free zero point)::

    min' = min(min, 0),  max' = max(max, 0)                    # 0.0 is always exactly representable
    scale = max((max' - min') / (qmax - qmin), eps)
    zero_point = clamp(qmin - round_half_even(min' / scale), qmin, qmax)

Symmetric (zero point pinned)::

    scale = max(max(|min'|, |max'|) / ((qmax - qmin) / 2), eps)
    zero_point = 0 for signed grids, (qmin + qmax + 1) // 2 for unsigned ones (128 for quint8)

Float qparams (``per_channel_affine_float_qparams``, torch.ao's embedding scheme; per row)::

    scale = (max - min) / (qmax - qmin), or 1.0 where that is <= eps    # the range is NOT widened to 0
    zero_point = qmin - min / scale                                     # float32, not rounded

so that ``q = round(x / scale + zero_point) = qmin + round((x - min) / scale)`` spans exactly ``[qmin, qmax]``
(torch.ao's ``-min / scale`` is the same on its unsigned grids, where ``qmin = 0``; on a signed or
offset grid it clipped the top of every row).

Scalars give per-tensor qparams, ``(C,)`` tensors give per-channel ones: the map is elementwise.

>>> import lowbit as Q
>>> s, z = Q.calculate_qparams(-2.0, 6.0, Q.per_tensor_affine, Q.quint8)
>>> round(s.item(), 6), int(z)
(0.031373, 64)
>>> s, z = Q.calculate_qparams(-1.0, 0.5, Q.per_tensor_symmetric, Q.qint8)
>>> round(s.item(), 6), int(z)
(0.007843, 0)

Deliberate differences from ``torch.ao``: ``eps`` defaults to 1e-8 (torch: float32 machine eps,
~1.19e-7, which only matters for ranges narrower than ~3e-5); per-tensor results are 0-d tensors
(torch: shape ``(1,)``); a custom unsigned symmetric grid takes the rounded-up midpoint
``(qmin + qmax + 1) // 2`` (torch: rounded down); float qparams offset the zero point by ``qmin``
(torch.ao: ``-min / scale`` whatever the grid); non-finite or inverted ranges raise a ``ValueError``
instead of yielding a NaN scale; and a symmetric scheme on a signed grid without 0 (``qint8.with_range(1,
100)``, whose pinned zero point 0 is off the grid) is a ``ValueError`` (torch.ao refuses every custom
range without 0; lowbit takes them with an affine scheme, whose zero point is a grid code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compile_state import tracing
from .qscheme import QDtype, QScheme, as_qdtype, as_qscheme

__all__ = ["QParams", "calculate_qparams", "symmetric_zero_point"]


@dataclass(frozen=True)
class QParams:
    """A complete description of one quantization grid.

    ``scale``/``zero_point`` are 0-d tensors (per tensor) or ``(C,)`` tensors along ``ch_axis``.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    qscheme: QScheme
    qdtype: QDtype
    ch_axis: int | None = None

    def __post_init__(self) -> None:
        """Refuse a record no quantize would take (it was kept as given: a NaN scale, an off-grid zero point, a
        per-channel scheme without ``ch_axis``): ``TypeError`` / ``ValueError`` naming the field."""
        if not isinstance(self.qscheme, QScheme) or not isinstance(self.qdtype, QDtype):
            raise TypeError(f"QParams: qscheme={self.qscheme!r} and qdtype={self.qdtype!r} must be a lowbit QScheme "
                            "and QDtype (e.g. lowbit.per_tensor_affine, lowbit.quint8)")
        s, z = self.scale, self.zero_point
        if not isinstance(s, torch.Tensor) or not isinstance(z, torch.Tensor) or s.is_complex() or z.is_complex():
            raise TypeError(f"QParams: scale={s!r} and zero_point={z!r} must be real tensors")
        per_channel = self.qscheme.is_per_channel
        if per_channel != (self.ch_axis is not None) or isinstance(self.ch_axis, bool) \
                or not isinstance(self.ch_axis, (int, type(None))):
            raise ValueError(f"QParams: ch_axis={self.ch_axis!r} does not fit qscheme={self.qscheme.value} (an int "
                             "per channel, None per tensor)")
        if s.shape != z.shape or (s.numel() != 1 if not per_channel else s.dim() != 1):
            raise ValueError(f"QParams: scale {tuple(s.shape)} / zero_point {tuple(z.shape)} must be "
                             + ("(C,) vectors of one length" if per_channel else "single values"))
        if s.device.type == "meta" or s.numel() == 0:
            return
        sf = s.detach().to(torch.float32)
        if not bool(((sf > 0) & torch.isfinite(sf)).all()):
            raise ValueError(f"QParams: scale={s.tolist()} must be positive and finite")
        zd = z.detach().double()
        lo, hi = self.qdtype.quant_min, self.qdtype.quant_max
        ok = torch.isfinite(zd) if self.qscheme.has_float_zero_point else (zd == zd.round()) & (zd >= lo) & (zd <= hi)
        if not bool(ok.all()):
            raise ValueError(f"QParams: zero_point={z.tolist()} must be "
                             + ("finite" if self.qscheme.has_float_zero_point else f"integers in [{lo}, {hi}]"))


def _as_float_tensor(v: float | torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        if v.is_complex():
            raise TypeError(f"calculate_qparams: {name} must be real, got dtype {v.dtype}")
        return v.detach().to(torch.float32)
    if isinstance(v, (int, float)):
        return torch.tensor(float(v), dtype=torch.float32)
    raise TypeError(f"calculate_qparams: {name}={v!r} must be a float or a tensor")




def symmetric_zero_point(qdtype: QDtype, owner: str) -> int:
    """The zero point a symmetric scheme pins on ``qdtype``: 0 on signed grids, ``(qmin + qmax + 1) // 2`` on
    unsigned ones; ``ValueError`` naming ``owner`` for a signed grid that does not hold 0 (its codes could not
    represent 0.0, and every quantize would refuse the zero point)."""
    if not qdtype.signed:
        return (qdtype.quant_min + qdtype.quant_max + 1) // 2
    if not qdtype.quant_min <= 0 <= qdtype.quant_max:
        raise ValueError(f"{owner}: a symmetric qscheme pins the zero point at 0, which is off the grid {qdtype!r}; "
                         "use an affine qscheme, or a grid with quant_min <= 0 <= quant_max")
    return 0


_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = 1.401298464324817e-45  # the smallest positive float32: a smaller eps or scale rounds to 0 there


def _keep_grid_finite(scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Shrink a scale whose grid end ``(qmin - z) s`` or ``(qmax - z) s`` overflows float32 (a range
    within half a step of ±3.4e38) to the largest one that keeps both ends finite: the end is clipped
    by less than one step instead of dequantizing to ±inf. Every other scale is returned unchanged."""
    steps = torch.maximum(zero_point - qmin, qmax - zero_point).to(torch.float64)  # >= 1 (qmin < qmax)
    over = steps * scale.to(torch.float64) > _F32_MAX
    if not (tracing() or over.is_meta) and not bool(over.any()):  # (traced / meta: always the torch.where form)
        return scale
    safe = (_F32_MAX / steps).to(torch.float32)
    safe = torch.where(steps.to(torch.float32) * safe > _F32_MAX, torch.nextafter(safe, torch.zeros_like(safe)), safe)
    return torch.where(over, safe, scale)


def calculate_qparams(
    min_val: float | torch.Tensor,
    max_val: float | torch.Tensor,
    qscheme: QScheme | str = QScheme.PER_TENSOR_AFFINE,
    qdtype: QDtype | str = "quint8",
    eps: float = 1e-8,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(scale, zero_point)``: float32 scale, int64 zero point (float32 for float qparams), shaped like ``min_val``.

    ``validate=False`` skips the finiteness / ordering check (one host sync), for callers such as
    ``FakeQuantize`` that call this every step on data they already validated.
    """
    qscheme, qdtype = as_qscheme(qscheme), as_qdtype(qdtype)
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and _F32_TINY <= eps <= _F32_MAX):
        raise ValueError(f"calculate_qparams: eps={eps!r} must be a positive float, finite and > 0 in float32")
    lo, hi = _as_float_tensor(min_val, "min_val"), _as_float_tensor(max_val, "max_val")
    if lo.shape != hi.shape:
        raise ValueError(f"calculate_qparams: min_val shape {tuple(lo.shape)} != max_val shape {tuple(hi.shape)}")
    if validate and lo.numel() > 0:
        if lo.is_meta or hi.is_meta:  # (the check below reads values: torch's bare "item() on meta tensors")
            raise ValueError(f"calculate_qparams: min_val / max_val on devices {lo.device.type} / {hi.device.type}: "
                             "a meta tensor holds no range to check; calibrate on real data, or pass "
                             "validate=False for shape-only (meta) qparams")
        finite = bool(torch.isfinite(lo).all() & torch.isfinite(hi).all())
        if not finite:
            raise ValueError(
                f"calculate_qparams: the range must be finite, got min_val={lo.tolist()} max_val={hi.tolist()} "
                "(an observer that saw no data, or NaN/Inf inputs?)"
            )
        if bool((lo > hi).any()):
            raise ValueError(f"calculate_qparams: min_val={lo.tolist()} exceeds max_val={hi.tolist()}")
    qmin, qmax = qdtype.quant_min, qdtype.quant_max
    zero = torch.zeros((), dtype=torch.float32, device=lo.device)
    min_neg, max_pos = torch.minimum(lo, zero), torch.maximum(hi, zero)
    eps_t = torch.tensor(eps, dtype=torch.float32, device=lo.device)
    if qscheme.has_float_zero_point:  # torch.ao's formula, eps only guards a constant row
        scale = (hi - lo) / float(qmax - qmin)
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        if validate and scale.numel() > 0 and not bool(torch.isfinite(scale).all()):  # as the other schemes
            raise ValueError(f"calculate_qparams: the range [{lo.tolist()}, {hi.tolist()}] is too wide for a float32 "
                             f"scale on the {qmax - qmin + 1}-level grid {qdtype!r}")
        # qmin + round((x - min) / s): torch.ao's -min / s where qmin is 0 (bit for bit: no + 0.0, which turns -0.0 into 0.0)
        return scale, (-lo / scale if qmin == 0 else qmin - lo / scale)
    if qscheme.is_symmetric:
        amax = torch.maximum(-min_neg, max_pos)
        scale = torch.maximum(amax / (float(qmax - qmin) / 2), eps_t)
        mid = symmetric_zero_point(qdtype, "calculate_qparams")
        zero_point = torch.full(lo.shape, mid, dtype=torch.int64, device=lo.device)
    else:
        width = max_pos - min_neg  # overflows float32 beyond ±1.7e38: then (max - min) / n term by term
        scale = torch.where(torch.isfinite(width), width / float(qmax - qmin),
                            max_pos / float(qmax - qmin) - min_neg / float(qmax - qmin))
        scale = torch.maximum(scale, eps_t)
        # the subtraction in int64, as torch.ao's (in float32, qint32's qmin - round(.) lost its low bits);
        # |min_neg / scale| <= ~(qmax - qmin), so the conversion is exact
        zero_point = (qmin - torch.round(min_neg / scale).to(torch.int64)).clamp_(qmin, qmax)
    scale = _keep_grid_finite(scale, zero_point, qmin, qmax)
    if validate and scale.numel() > 0 and not bool(torch.isfinite(scale).all()):
        raise ValueError(f"calculate_qparams: the range [{lo.tolist()}, {hi.tolist()}] is too wide for a float32 "
                         f"scale on the {qmax - qmin + 1}-level grid {qdtype!r}")
    return scale, zero_point
