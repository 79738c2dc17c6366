"""Pooling, resampling, padding and clamping of ``QTensor`` codes: ops that keep the input's grid.

Each op here is what ``torch``'s quantized CPU kernels do on a ``torch.quantize_per_tensor`` input
(the oracle of ``tests/test_qtensor_ops.py``), applied to the codes ``q`` on the grid ``(s, z)``; the
output keeps ``(s, z)``:

- ``torch.neg`` / ``-x`` mirror the codes onto the mirrored grid (exact: ``q' = qmin + qmax - q``, ``z' = qmin + qmax - z``);
- selection ops are exact (code for code): ``F.interpolate(mode="nearest" / "nearest-exact")`` (``"bilinear"``
  averages: torch's quantized kernel's codes, ``qtensor/resample.py``), ``F.pad`` (constant;
  the pad value quantized onto the grid, so ``0.0`` pads ``z``), ``F.hardtanh``/``F.relu6``/``torch.clamp``
  (``clamp(q, quantize(min), quantize(max))``; a bound past the grid's far end, whose code would saturate, runs on
  float values); ``masked_fill`` / ``torch.where`` with a number (on the grid, else float values, as ``F.pad``'s
  value), ``tril`` / ``triu`` (0.0's code), ``F.threshold`` (the codes above the threshold kept, the rest ``value``'s
  code) and dropout at inference (``training=False``: the QTensor itself);
- averaging ops round the mean of the centred codes half to even:
  ``q_out = clamp(round(mean_window(q - z) + z), qmin, qmax)`` (the mean code rounded, as torch) for ``F.avg_pool1d/2d/3d``,
  ``F.adaptive_avg_pool1d/2d/3d`` and ``torch.mean``. The mean is exact (float64 where float32 could
  lose a bit), so this is the correctly rounded average. torch multiplies the integer window sum by a
  float32 ``1 / count`` before rounding, which can land on the other side of a ``.5`` tie: torch's codes
  differ from these by at most one, and only where the exact average is a tie (``count`` even).

Per-channel ``QTensor``s keep their per-channel grid when the op leaves the channel axis alone (pooling,
interpolating or padding only trailing spatial dims; a mean over other dims); otherwise the op runs on
float values with the usual one-time warning (torch's quantized ops reject per-channel inputs outright).

>>> import torch, torch.nn.functional as F, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([[[0.0, 0.1, 0.2, 0.4]]]), 0.1, 10, Q.quint8)
>>> F.avg_pool1d(qt, 2).int_repr().tolist()       # means of (0, 1) and (2, 4) centred codes: 0.5, 3
[[[10, 13]]]
>>> F.pad(qt, (1, 0)).int_repr().tolist(), F.hardtanh(qt, 0.0, 0.25).int_repr().tolist()
([[[10, 10, 11, 12, 14]]], [[[10, 11, 12, 12]]])
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..compile_state import tracing
from ..functional import quantize
from . import _INT_OPS, QTensor, _warn_float_fallback
from .resample import interpolate_bilinear

__all__ = ["fill_code", "zero_codes"]

_F32_EXACT = 2**24  # float32 holds every integer up to this exactly


def _channel_shaped(x: QTensor, p: torch.Tensor) -> torch.Tensor:
    """A qparam broadcast against the codes: 0-d per tensor, ``[1, .., C, .., 1]`` per channel."""
    return p if x.axis is None else p.reshape([-1 if i == x.axis else 1 for i in range(x.dim())])


def _touches_axis(x: QTensor, trailing: int) -> bool:
    """Whether an op on the last ``trailing`` dims would mix or move the channel axis."""
    return x.axis is not None and x.axis >= x.dim() - trailing


def zero_codes(x: QTensor) -> torch.Tensor:
    """The code of 0.0 on ``x``'s grid (int64, shaped to broadcast against the codes): the zero point; a float
    per-channel zero point (``per_channel_affine_float_qparams``) has 0.0 between two codes: ``round(z)`` (what
    ``quantize`` gives 0.0), on the grid. Its truncation to the storage dtype put ReLU / zero padding a step off, and
    a negative ``z`` wrapped (ReLU of quint8 codes on ``z = -3.6``: every value ``(253 + 3.6) s``)."""
    z = x.zero_point
    if z.is_floating_point():
        z = z.round().clamp(x.qdtype.quant_min, x.qdtype.quant_max)
    return _channel_shaped(x, z.to(torch.int64))


def _centred(x: QTensor, region: int) -> torch.Tensor:
    """``q - z`` in a float dtype in which sums over ``region`` elements are exact."""
    qd = x.qdtype
    span = (qd.quant_max - qd.quant_min) * max(region, 1)
    dtype = torch.float32 if span < _F32_EXACT else torch.float64
    return x.int_repr().to(dtype) - _channel_shaped(x, x.zero_point).to(dtype)


def _recentre(x: QTensor, y: torch.Tensor, axis: int | None = -1) -> QTensor:
    """``clamp(round(y + z))`` back on ``x``'s grid (``axis=-1``: the channel axis is unchanged)."""
    axis = x.axis if axis == -1 else axis
    z = x.zero_point if x.axis is None else x.zero_point.reshape([-1 if i == axis else 1 for i in range(y.dim())])
    q = y.add_(z).round_().clamp_(x.qdtype.quant_min, x.qdtype.quant_max)
    return QTensor(q.to(x.qdtype.storage), x.scale, x.zero_point, x.qdtype, axis)


def _region(x: QTensor, dims: Any) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d]
    return n


def _avg_pool(fn: Callable, spatial: int) -> Callable:
    """``fn`` (an average pooling of the last ``spatial`` dims) on the centred codes, rounded."""
    def op(x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, QTensor) or _touches_axis(x, spatial) or x.dim() <= spatial:
            return NotImplemented
        region = _region(x, range(x.dim() - spatial, x.dim()))
        return _recentre(x, fn(_centred(x, region), *args, **kwargs))
    return op


def _mean(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """``torch.mean`` over ``dim`` (all dims when ``None``) that keeps the grid."""
    if not isinstance(x, QTensor) or dtype is not None or x.numel() == 0:
        return NotImplemented
    dims = list(range(x.dim())) if dim is None or dim == [] or dim == () else (
        [dim] if isinstance(dim, int) else list(dim))
    n = max(x.dim(), 1)  # torch lets a 0-d tensor take dim 0 / -1
    for d in dims:  # as torch.mean: an index past the rank or given twice is an error, not wrapped
        if isinstance(d, bool) or not isinstance(d, int) or not -n <= d < n:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {d})")
    if len({d % n for d in dims}) != len(dims):
        raise RuntimeError(f"dim {dims} names a dimension more than once")
    dims = sorted({d % x.dim() for d in dims}) if x.dim() else []
    if x.axis is not None and x.axis in dims:
        return NotImplemented
    y = _centred(x, _region(x, dims))
    y = y.mean(dims, keepdim=keepdim) if dims else y.clone()
    axis = None if x.axis is None else x.axis - (0 if keepdim else sum(d < x.axis for d in dims))
    return _recentre(x, y, axis)


def _interpolate(x: Any, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                 *args: Any, **kwargs: Any) -> Any:
    """Nearest-neighbour resampling (``nearest``, ``nearest-exact``) selects codes: exact; ``bilinear``: torch's
    quantized kernel on the codes (``qtensor/resample.py``)."""
    if isinstance(x, QTensor) and mode == "bilinear":
        return interpolate_bilinear(x, size, scale_factor, *args, **kwargs)
    if not isinstance(x, QTensor) or mode not in ("nearest", "nearest-exact") or _touches_axis(x, x.dim() - 2):
        return NotImplemented
    wide = torch.float32 if x.qdtype.quant_max - x.qdtype.quant_min < _F32_EXACT else torch.float64
    q = F.interpolate(x.int_repr().to(wide), size, scale_factor, mode, *args, **kwargs)
    return QTensor(q.to(x.qdtype.storage), x.scale, x.zero_point, x.qdtype, x.axis)


def _pad(x: Any, pad: Any, mode: str = "constant", value: float | None = None) -> Any:
    """Constant padding with ``value`` quantized onto the grid (``0.0`` pads the zero point). A value the grid cannot
    hold (past its ends: ``nn.ConstantPad2d(1, 3.0)`` after a layer whose grid ends at 1.5) runs on float values
    (warned), so the next layer quantizes it on the grid it calibrated; its code would have saturated silently."""
    if not isinstance(x, QTensor) or mode != "constant" or _touches_axis(x, len(pad) // 2):
        return NotImplemented
    if value is not None and float(value) != float(value):
        _code_bound(x, value)  # raises: a NaN pad value has no code (masked_fill's NaN: float values instead)
    fill = fill_code(x, value or 0.0)
    if fill is None:
        return NotImplemented
    if x.axis is None and not tracing():
        return x._same_grid(F.pad(x.int_repr(), pad, value=int(fill)))
    # per channel, or while torch.compile / torch.export trace (int() of the fill code is a data-dependent read
    # there): pad 0 around q - fill, the same codes
    q = (F.pad(x.int_repr().to(torch.int64) - fill, pad) + fill).to(x.qdtype.storage)
    return x._same_grid(q) if x.axis is None else QTensor(q, x.scale, x.zero_point, x.qdtype, x.axis)


def fill_code(x: QTensor, value: Any) -> torch.Tensor | None:
    """The code of the fill value ``value`` on ``x``'s grid (int64: 0-d per tensor, channel-shaped per channel), or
    ``None`` where the grid cannot hold it within half a step on every channel (past its ends, ``-inf`` as an attention
    mask fills, NaN): the caller then runs on float values (warned) instead of saturating the code silently. ``0.0`` is
    the zero point (``zero_codes``; no quantize call). ``F.pad``'s value, ``masked_fill``, ``torch.where``."""
    value = float(value)
    if value != value:
        return None
    if not value:  # 0 is the zero point's code on every integer grid
        return x.zero_point.to(torch.int64).reshape(()) if x.axis is None else zero_codes(x)
    fill = _code_bound(x, value)
    assert fill is not None
    s = _channel_shaped(x, x.scale).to(torch.float64)
    held = (fill - _channel_shaped(x, x.zero_point)).to(torch.float64) * s
    return None if bool(((held - value).abs() > 0.5001 * s).any()) else fill


def _code_bound(x: QTensor, v: Any) -> torch.Tensor | None:
    """``quantize(v)`` on ``x``'s grid, shaped to broadcast against the codes; ``None`` for no bound."""
    if v is None:
        return None
    if float(v) != float(v):  # a NaN bound has no code (float clamp / pad give NaN): not a finite code
        raise ValueError(f"QTensor: a clamp bound or pad value of NaN has no code on the grid (got {v!r})")
    per_channel = x.axis is not None
    c = x.scale.numel()
    code = quantize(torch.full((c,), float(v)), x.scale.reshape(c), x.zero_point.reshape(c), x.qdtype,
                    0 if per_channel else None)
    return _channel_shaped(x, code.to(torch.int64)) if per_channel else code.to(torch.int64).reshape(())


def _past_far_end(x: QTensor, v: Any, lower: bool) -> bool:
    """Whether clamp bound ``v`` lies past the grid's far end (a lower bound above its top, an upper bound below its
    bottom, by more than half a step): every output is then ``v``, which the grid cannot hold (its code saturates).
    A bound on the zero's side (a lower bound <= 0, an upper bound >= 0: ReLU6, Hardtanh(-1, 1)) never does: an
    integer zero point lies on the grid, so 0 does. Not checked while traced (no data-dependent read)."""
    if v is None or (not x.zero_point.is_floating_point() and (v <= 0 if lower else v >= 0)) or tracing():
        return False
    s = _channel_shaped(x, x.scale).to(torch.float64)
    code = x.qdtype.quant_max if lower else x.qdtype.quant_min
    end = (code - _channel_shaped(x, x.zero_point).to(torch.float64)) * s
    return bool((float(v) - end > 0.5001 * s).any() if lower else (end - float(v) > 0.5001 * s).any())


def _clamp(x: Any, min: Any = None, max: Any = None) -> Any:  # noqa: A002 - torch's names
    """``clamp(q, quantize(min), quantize(max))``: exact, the grid is unchanged. A bound past the grid's far end
    (``clamp(min=5.0)`` on a grid that ends at 1.27: every output is 5.0) runs on float values (warned), as ``F.pad``
    with such a value: its code would have saturated silently (torch's quantized clamp gives 1.27 everywhere)."""
    if not isinstance(x, QTensor) or isinstance(min, torch.Tensor) or isinstance(max, torch.Tensor):
        return NotImplemented
    if min is None and max is None:
        raise ValueError("clamp: at least one of min=None and max=None must be a number")
    lo, hi = _code_bound(x, min), _code_bound(x, max)  # (first: a NaN bound is refused)
    if _past_far_end(x, min, True) or _past_far_end(x, max, False):
        return NotImplemented
    q = torch.clamp(x.int_repr(), lo, hi).to(x.qdtype.storage)
    return QTensor(q, x.scale, x.zero_point, x.qdtype, x.axis)


def _hardtanh(x: Any, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Any:
    if isinstance(x, QTensor) and min_val > max_val:  # as F.hardtanh
        raise ValueError(f"hardtanh: min_val={min_val!r} cannot be greater than max_val={max_val!r}")
    return _clamp(x, min_val, max_val)


def _relu6(x: Any, inplace: bool = False) -> Any:
    return _clamp(x, 0.0, 6.0)


def _threshold(x: Any, threshold: Any, value: Any, inplace: bool = False) -> Any:
    """``F.threshold``: the codes of values above ``threshold`` kept (the float comparison of the dequantized values,
    as the float op makes it), the rest ``value``'s code (``fill_code``; a value the grid cannot hold: float values,
    warned, as ``masked_fill``). Exact, the grid kept. Until session 37 it ran on float values (warned). torch's
    quantized ``threshold`` compares codes with ``threshold``'s code instead, so it keeps a value equal to
    ``threshold`` once rounded onto the grid that the float op (and lowbit) replaces."""
    if not isinstance(x, QTensor) or isinstance(threshold, torch.Tensor) or isinstance(value, torch.Tensor) or (
            tracing() and float(value) != 0.0):  # (while traced: 0.0, the zero point, needs no host read of the grid)
        return NotImplemented
    if float(threshold) != float(threshold):  # every comparison with NaN is False: all of x would become value
        raise ValueError(f"threshold: threshold={threshold!r} must be a number, not NaN")
    fill = _fill_value(x, value)
    if fill is None:
        return NotImplemented
    q = x.int_repr()
    q = torch.where(x.dequantize() > threshold, q, fill.to(q.dtype))
    return x._same_grid(q) if x.axis is None else QTensor._trusted(q, x.scale, x.zero_point, x.qdtype, x.axis)


def _dropout(x: Any, p: Any = 0.5, training: bool = True, inplace: bool = False, *, train: Any = None) -> Any:
    """Dropout at inference (``training=False``: ``nn.Dropout*`` in ``eval()`` calls ``F.dropout(x, p, False)``), or
    with ``p = 0``: the identity, the QTensor itself, as torch's quantized tensors. Until session 37 it dequantized the
    codes and returned float values (warned); a training-mode dropout still does (torch's quantized tensors refuse
    it). ``p`` outside ``[0, 1]`` (NaN too) is refused, as ``F.dropout`` refuses it."""
    if not isinstance(x, QTensor) or isinstance(p, torch.Tensor):
        return NotImplemented
    training = training if train is None else train
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return NotImplemented if training and float(p) != 0.0 else x


def _fill_value(x: QTensor, value: Any) -> torch.Tensor | None:
    """``value`` (a Python number or a 0-d float tensor) as its code on ``x``'s grid (``fill_code``), else ``None``."""
    if isinstance(value, torch.Tensor) and (value.dim() or value.is_complex()):
        return None
    if isinstance(value, (QTensor, complex)) or x.scale.device.type == "meta" or (
            isinstance(value, torch.Tensor) and value.device.type == "meta"):
        return None
    return fill_code(x, value.item() if isinstance(value, torch.Tensor) else value)


def _masked_fill(self: QTensor, mask: Any, value: Any) -> Any:
    """``masked_fill`` with ``value`` quantized onto the grid (per channel, each channel's code): exact, the grid kept,
    as torch's quantized ``masked_fill``. A value the grid cannot hold (``-inf`` as attention masks fill, NaN, a value
    past its ends that torch saturates) runs on float values (warned), as ``F.pad`` with such a value."""
    q = self.int_repr()
    fill = _fill_value(self, value)
    if fill is None or tracing():
        _warn_float_fallback("QTensor.masked_fill (a fill value off the grid)" if fill is None else "QTensor.masked_fill")
        return self.dequantize().masked_fill(mask, value)
    if self.axis is None:
        return self._same_grid(q.masked_fill(mask, int(fill)))
    q.masked_fill(mask, 0)  # (torch's checks: a bool mask that broadcasts to the codes' shape)
    return QTensor._trusted(torch.where(mask, fill.to(q.dtype), q), self.scale, self.zero_point, self.qdtype, self.axis)


def _keep_grid(a: QTensor, b: Any) -> bool:
    """Whether QTensor ``b`` is on ``a``'s grid (per channel: the same axis, qparams and shape)."""
    return (isinstance(b, QTensor) and a.qdtype == b.qdtype and a.axis == b.axis
            and (a.axis is None or a.shape == b.shape) and torch.equal(a.scale, b.scale)
            and torch.equal(a.zero_point, b.zero_point))


def _where(condition: Any, input: Any = None, other: Any = None, *, out: Any = None) -> Any:  # noqa: A002
    """``torch.where(cond, a, b)`` with QTensors on one grid, or a QTensor and a number the grid holds: the codes
    selected, exact (torch's quantized tensors have no ``where``). Per channel, when the output keeps the QTensor's
    shape. Other grids: the float fallback."""
    if input is None or out is not None or isinstance(condition, QTensor) or tracing():
        return NotImplemented
    x = input if isinstance(input, QTensor) else other
    if x.scale.device.type == "meta":  # (no qparams to compare)
        return NotImplemented
    codes = []
    for v in (input, other):
        c = v.int_repr() if _keep_grid(x, v) else None if isinstance(v, (QTensor, torch.Tensor)) and v.dim() \
            else _fill_value(x, v)
        if c is None:
            return NotImplemented
        codes.append(c.to(x.int_repr().dtype))
    q = torch.where(condition, *codes)
    if x.axis is None:
        return x._same_grid(q)
    return QTensor(q, x.scale, x.zero_point, x.qdtype, x.axis) if q.shape == x.shape else NotImplemented


def _triangle(name: str) -> Callable:
    """``tril`` / ``triu``: the codes kept, the rest 0.0's code (``zero_codes``), exact (torch's quantized tensors
    have neither)."""
    def method(self: QTensor, diagonal: int = 0) -> QTensor:
        q = self.int_repr()
        keep = getattr(torch.ones(q.shape[-2:] if q.dim() >= 2 else q.shape, dtype=torch.bool, device=q.device),
                       name)(diagonal)  # (torch's error for fewer than 2 dims)
        return QTensor(torch.where(keep, q, zero_codes(self).to(q.dtype)), self.scale, self.zero_point, self.qdtype,
                       self.axis)
    method.__name__ = name
    return method


def _neg(x: Any) -> Any:
    """``-x`` on the codes: ``q' = qmin + qmax - q`` on the grid ``(s, qmin + qmax - z)``, so ``s·(q' - z') = -s·(q - z)``
    exactly (float zero points: the float fallback)."""
    if not isinstance(x, QTensor) or x.zero_point.is_floating_point():
        return NotImplemented
    q, m = x.int_repr(), x.qdtype.quant_min + x.qdtype.quant_max
    return QTensor._trusted((m - q.to(torch.int16)).to(q.dtype), x.scale, m - x.zero_point, x.qdtype, x.axis)


QTensor.neg = QTensor.negative = lambda self: torch.neg(self)  # type: ignore[attr-defined]
QTensor.masked_fill = _masked_fill  # type: ignore[attr-defined]
QTensor.tril, QTensor.triu = _triangle("tril"), _triangle("triu")  # type: ignore[attr-defined]
QTensor.where = lambda self, condition, other: torch.where(condition, self, other)  # type: ignore[attr-defined]
QTensor.clip = QTensor.clamp  # type: ignore[attr-defined]  # (as torch.clip: the method kept the float fallback)

_INT_OPS.update({
    F.avg_pool1d: _avg_pool(F.avg_pool1d, 1),
    F.avg_pool2d: _avg_pool(F.avg_pool2d, 2),
    F.avg_pool3d: _avg_pool(F.avg_pool3d, 3),
    F.adaptive_avg_pool1d: _avg_pool(F.adaptive_avg_pool1d, 1),
    F.adaptive_avg_pool2d: _avg_pool(F.adaptive_avg_pool2d, 2),
    F.adaptive_avg_pool3d: _avg_pool(F.adaptive_avg_pool3d, 3),
    torch.mean: _mean,
    F.interpolate: _interpolate,
    F.pad: _pad,
    F.hardtanh: _hardtanh,
    torch._C._nn.hardtanh: _hardtanh,  # (torch.ao.nn.quantized.functional.hardtanh calls it)
    F.threshold: _threshold,
    torch.threshold: _threshold,
    F.relu6: _relu6,
    torch.clamp: _clamp,
    torch.clip: _clamp,
    torch.where: _where,
    torch.neg: _neg,
    torch.negative: _neg,
    torch.masked_fill: lambda x, mask, value: _masked_fill(x, mask, value) if isinstance(x, QTensor) else NotImplemented,
    torch.tril: lambda x, diagonal=0: x.tril(diagonal) if isinstance(x, QTensor) else NotImplemented,
    torch.triu: lambda x, diagonal=0: x.triu(diagonal) if isinstance(x, QTensor) else NotImplemented,
})
_INT_OPS.update({fn: _dropout for fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                                          F.feature_alpha_dropout, torch.dropout, torch.alpha_dropout,
                                          torch.feature_dropout, torch.feature_alpha_dropout)})
