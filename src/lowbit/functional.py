"""quantize / dequantize / fake_quantize, per tensor and per channel (DESIGN §2).

For codes ``q`` on the grid ``[qmin, qmax]`` with ``scale`` s and ``zero_point`` z::

    q  = clamp(round_half_even(x / s) + z, qmin, qmax)       # quantize      (float -> int codes)
    x̂  = (q - z) * s                                         # dequantize    (int codes -> float32)
    fq = dequantize(quantize(x))                             # fake_quantize (float -> float)
    d fq / d x = 1[qmin <= round(x / s) + z <= qmax]          # straight-through, masked to the unclipped region

``x / s`` is evaluated as ``x * (1 / s)`` in float32, exactly as torch's kernels do; ``quantize``
rounds ``x / s + z`` (as ``torch.quantize_per_tensor``) and ``fake_quantize`` rounds ``x / s`` then adds
``z`` (as ``torch.fake_quantize_per_tensor_affine``), with two float32 roundings (the product, then
the sum); the two differ only where float32 addition moves a value onto a rounding tie. torch's
vectorised CPU ``quantize_per_tensor`` may instead round ``fma(x, 1/s, z)`` once, so it can differ
from lowbit by one code next to a tie (7683 of 7.0M adversarial values on torch 2.13 / AVX2);
lowbit's codes are the same on every kernel path, which is the contract (DESIGN §2). Per channel, ``s`` and ``z``
are ``(C,)`` and broadcast along ``ch_axis``.

>>> import torch, lowbit as Q
>>> x = torch.tensor([-1.0, 0.0, 0.26, 3.0])
>>> q = Q.quantize(x, torch.tensor(0.1), torch.tensor(0), Q.qint8)
>>> q.tolist()
[-10, 0, 3, 30]
>>> Q.dequantize(q, torch.tensor(0.1), torch.tensor(0)).tolist()[2]
0.30000001192092896
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import blocked, qstore
from .compile_state import inline_dequantize, inline_quantize, qdtype_key, tracing
from .qparams import _F32_MAX, _F32_TINY  # the smallest / largest positive float32
from .qscheme import QDtype, as_qdtype
from .rounding import grid_position, round_codes
from .state_check import _show, check_quantized_state  # noqa: F401 (check_quantized_state: re-exported)

__all__ = ["quantize", "dequantize", "fake_quantize", "check_ch_axis", "check_quantized_state"]

Number = float | int | torch.Tensor

_U8_VIA_INT16 = 4096  # above this many codes, convert float32 -> uint8 through int16 (one dispatch less below)


def check_ch_axis(ch_axis: int, ndim: int, shape: tuple[int, ...] | torch.Size | None = None) -> int:
    """Normalise a (possibly negative) channel axis, or raise a ``ValueError`` naming it."""
    if not isinstance(ch_axis, int) or isinstance(ch_axis, bool):
        raise TypeError(f"ch_axis={ch_axis!r} must be an int")
    if not -ndim <= ch_axis < ndim:
        what = f"shape {tuple(shape)}" if shape is not None else f"{ndim}-d tensor"
        raise ValueError(f"ch_axis={ch_axis} is out of range for a tensor of {what}")
    return ch_axis % ndim


def _check_qparams(fn: str, scale: Number, zero_point: Number, qmin: int | None = None,
                   qmax: int | None = None, *, float_zp: bool = False) -> None:
    """Reject a scale that is not positive and finite, and a zero point that is not an integer on the
    grid ``[qmin, qmax]`` — Python numbers and tensors alike (``ValueError`` naming the value).
    ``float_zp``: a float zero-point *tensor* (per channel: ``per_channel_affine_float_qparams``) need
    only be finite.

    A tensor qparam costs one host read (free on CPU); nothing is checked while ``torch.compile``
    traces (the values are symbolic there; they were checked when the module was built or loaded).
    """
    if tracing():
        return
    # (asked before _host_scalar: a one-row table's (1,) float zero point is a Python float after it)
    float_zp = float_zp and isinstance(zero_point, torch.Tensor) and zero_point.is_floating_point()
    scale, zero_point = _host_scalar(scale), _host_scalar(zero_point)
    if isinstance(scale, torch.Tensor):
        if scale.is_complex() or scale.dtype == torch.bool:
            raise TypeError(f"{fn}: scale must be a real tensor, got dtype {scale.dtype}")
        s = scale.detach().to(torch.float32)  # as quantize uses it: float64 1e39 / 1e-46 are inf / 0 there
        if s.numel() and not _all(s, lambda a: (a > 0) & (a < float("inf"))):
            raise ValueError(f"{fn}: scale={_show(s)} must be positive and finite")
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}: scale={scale!r} must be a float or a tensor")
    elif not _F32_TINY <= scale <= _F32_MAX:  # positive and finite once rounded to float32 (NaN fails too)
        raise ValueError(f"{fn}: scale={scale!r} must be a positive finite number (in float32)")
    lo = -float("inf") if qmin is None else qmin
    hi = float("inf") if qmax is None else qmax
    grid = "" if qmin is None else f" in [{qmin}, {qmax}]"
    if float_zp and not isinstance(zero_point, torch.Tensor):
        if not abs(zero_point) < float("inf"):
            raise ValueError(f"{fn}: zero_point={zero_point!r} must be finite")
        return
    if isinstance(zero_point, torch.Tensor):
        if zero_point.is_complex() or zero_point.dtype == torch.bool:
            raise TypeError(f"{fn}: zero_point must be a real tensor, got dtype {zero_point.dtype}")
        z = zero_point.detach()
        if z.numel() == 0:
            return
        if float_zp:
            if not _all(z, lambda a: abs(a) < float("inf")):
                raise ValueError(f"{fn}: zero_point={_show(z)} must be finite")
            return
        integral = z.is_floating_point()
        if not _all(z, lambda a: (a >= lo) & (a <= hi) & ((a == a.round()) if integral else True)):
            raise ValueError(f"{fn}: zero_point={_show(z)} must be integers{grid}")
    elif isinstance(zero_point, bool) or not isinstance(zero_point, (int, float)):
        raise TypeError(f"{fn}: zero_point={zero_point!r} must be an int or a tensor")
    elif not (lo <= zero_point <= hi and float(zero_point).is_integer()):
        raise ValueError(f"{fn}: zero_point={zero_point!r} must be an integer{grid}")


def _all(t: torch.Tensor, pred: Callable[[Any], Any]) -> bool:
    """``pred`` holds everywhere on ``t``: through a NumPy view on CPU (a few µs less than torch ops
    for the (C,) qparam tensors checked here), torch ops elsewhere (one host read)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        return bool(np.all(pred(t.numpy())))
    return bool(pred(t).all())


def _host_scalar(p: Number) -> Number:
    """A one-element real CPU tensor as a Python number (a cheaper check than tensor ops), else ``p``."""
    if isinstance(p, torch.Tensor) and p.numel() == 1 and p.device.type == "cpu" and not p.is_complex() \
            and p.dtype != torch.bool:
        return p.item()
    return p


def _broadcast(p: Number, x: torch.Tensor, ch_axis: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Shape a qparam for ``x``: 0-d per tensor, ``[1, .., C, .., 1]`` per channel."""
    t = p.to(device=x.device, dtype=dtype) if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=dtype, device=x.device)
    if ch_axis is None or t.dim() == 0:
        if t.numel() != 1:
            raise ValueError(f"per-tensor qparams must be scalars, got shape {tuple(t.shape)}; pass ch_axis for per-channel")
        return t.reshape(())
    axis = check_ch_axis(ch_axis, x.dim(), x.shape)
    if t.dim() != 1 or t.numel() != x.shape[axis]:
        raise ValueError(
            f"per-channel qparams of shape {tuple(t.shape)} do not match dim {axis} "
            f"(size {x.shape[axis]}) of a tensor of shape {tuple(x.shape)}"
        )
    shape = [1] * x.dim()
    shape[axis] = -1
    return t.reshape(shape)


def _qparam_tensor(p: Number, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A qparam as a tensor on ``x``'s device (for the traced ops; a tensor keeps its dtype)."""
    return p.to(x.device) if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=dtype, device=x.device)


def _codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Unclipped float codes ``round(x / s) + z``."""
    return torch.round(x.to(torch.float32) * torch.reciprocal(scale)) + zero_point


def quantize(x: torch.Tensor, scale: Number, zero_point: Number, qdtype: QDtype | str,
             ch_axis: int | None = None, *, validate: bool = True) -> torch.Tensor:
    """Integer codes of ``x`` on ``qdtype``'s grid, stored as ``qdtype.storage``; not differentiable.

    ``scale`` must be positive and finite, ``zero_point`` an integer on the grid (else ``ValueError``);
    ``validate=False`` skips that check (one host read) for qparams already checked, e.g. a module's.
    """
    qdtype = as_qdtype(qdtype)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if validate:
        _check_qparams("quantize", scale, zero_point, qdtype.quant_min, qdtype.quant_max, float_zp=ch_axis is not None)
    if tracing():  # one opaque op (lowbit.pt2): the compiled program computes these very codes
        s, z = _qparam_tensor(scale, x, torch.float32), _qparam_tensor(zero_point, x, torch.int64)
        inline = inline_quantize(x, s, z, qdtype) if ch_axis is None else None  # CPU: aten ops inductor fuses
        return inline if inline is not None else torch.ops.lowbit.quantize(x, s, z, qdtype_key(qdtype), ch_axis)
    inv_z = scalar_qparams(scale, zero_point) if ch_axis is None and x.device.type == "cpu" else None
    if inv_z is not None:  # per tensor on CPU: Python-float operands, no qparam tensors to build
        return quantize_scaled(x, inv_z[0], inv_z[1], qdtype)
    s, z = _broadcast(scale, x, ch_axis, torch.float32), _broadcast(zero_point, x, ch_axis, torch.float32)
    return _store(round_codes(x, s, z, qdtype.quant_min, qdtype.quant_max, check=False),  # (checked above)
                  qdtype)  # convert's weights: this formula


def quantize_scaled(x: torch.Tensor, inv_scale: float | torch.Tensor, zero_point: float | torch.Tensor,
                    qdtype: QDtype) -> torch.Tensor:
    """Per-tensor ``quantize`` with the grid as Python floats ``inv_scale = float32(1 / s)`` and ``z``
    (see ``scalar_qparams``), computed once by the caller (e.g. at convert time): no per-call qparam work.
    Not traceable (``quantize`` is); bit-identical to ``quantize(x, s, z, qdtype)``. The two may also be
    0-d float32 CPU tensors of those values (``scalar_tensors``): the same arithmetic, ~2 µs less per
    call on CPU, where a Python-number operand is wrapped and type-promoted on every op. 8-bit codes on CPU
    leave ``x · inv`` through ``lowbit.qstore`` (add, round, clamp and store in one pass: 1.2-2.5x faster than
    four passes, whole or in cache blocks, at 768 to 2M floats on the AVX2 EPYC).

    >>> import torch, lowbit as Q
    >>> x = torch.tensor([0.26, -1.0])
    >>> torch.equal(quantize_scaled(x, *scalar_qparams(0.1, 3), Q.qint8), quantize(x, 0.1, 3, Q.qint8))
    True
    """
    xf = x if x.dtype == torch.float32 and not x.requires_grad else x.detach().to(torch.float32)
    if xf.is_cpu and qdtype.storage in (torch.uint8, torch.int8) and float(zero_point).is_integer():
        # x · inv, then add, round, clamp and the 8-bit store in one pass
        return qstore.codes(torch.mul(xf, inv_scale), int(zero_point), qdtype.quant_min, qdtype.quant_max,
                            qdtype.storage)
    if xf.numel() > blocked.BLOCK and xf.dim() and xf.is_contiguous() and xf.device.type == "cpu":  # L2-sized blocks
        inv_t = inv_scale if isinstance(inv_scale, torch.Tensor) else torch.scalar_tensor(inv_scale)
        z_t = zero_point if isinstance(zero_point, torch.Tensor) else torch.scalar_tensor(zero_point)
        q2 = blocked.codes(xf.view(-1, xf.shape[-1]), inv_t, z_t, qdtype.quant_min, qdtype.quant_max, qdtype.storage)
        return q2.view(xf.shape)
    q = torch.mul(xf, inv_scale).add_(zero_point).round_().clamp_(qdtype.quant_min, qdtype.quant_max)  # in place
    return _store(q, qdtype)


def scalar_tensors(inv_scale: float, zero_point: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``scalar_qparams``' two floats as 0-d float32 CPU tensors (operands for ``quantize_scaled``)."""
    return torch.scalar_tensor(inv_scale), torch.scalar_tensor(zero_point)


def _store(q: torch.Tensor, qdtype: QDtype) -> torch.Tensor:
    """Integer-valued float32 codes (already clamped) in ``qdtype``'s storage dtype."""
    if qdtype.storage == torch.uint8 and q.numel() > _U8_VIA_INT16:
        # float32 -> uint8 is a scalar loop in torch's CPU kernels, float32 -> int16 a vector one
        # (4x faster at 3M elements); the codes are integers in [0, 255], so both are exact. A 7-bit grid
        # (codes in [0, 127], e.g. torch.ao's reduce_range) casts to int8 in one vector pass, viewed as uint8.
        return q.char().view(torch.uint8) if qdtype.quant_max <= 127 else q.short().byte()
    if qdtype.storage == torch.int32:  # float32 cannot hold 2**31 - 1 (the clamp gave 2**31, which wrapped to -2**31):
        return q.to(torch.int64).clamp_(qdtype.quant_min, qdtype.quant_max).to(torch.int32)  # saturate in int64
    cast = _CASTS.get(qdtype.storage)  # .byte()/.char(): ~1 µs; .to(dtype) parses its overloads (~3 µs)
    return cast(q) if cast is not None else q.to(qdtype.storage)


_CASTS: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.uint8: torch.Tensor.byte, torch.int8: torch.Tensor.char, torch.int16: torch.Tensor.short,
    torch.int32: torch.Tensor.int, torch.int64: torch.Tensor.long}


def dequantize(q: torch.Tensor, scale: Number, zero_point: Number, ch_axis: int | None = None, *,
               validate: bool = True) -> torch.Tensor:
    """float32 values ``(q - z) * s`` of integer codes ``q`` (``scale`` positive and finite,
    ``zero_point`` integral — or any finite float per channel — else ``ValueError``; ``validate=False``
    skips the check)."""
    if not isinstance(q, torch.Tensor) or q.is_complex() or q.dtype == torch.bool:
        raise TypeError(f"dequantize expects a tensor of codes, got {getattr(q, 'dtype', type(q).__name__)}")
    if validate:
        _check_qparams("dequantize", scale, zero_point, float_zp=ch_axis is not None)
    if tracing():
        s, z = _qparam_tensor(scale, q, torch.float32), _qparam_tensor(zero_point, q, torch.int64)
        inline = inline_dequantize(q, s, z) if ch_axis is None else None  # CPU: aten ops inductor fuses
        return inline if inline is not None else torch.ops.lowbit.dequantize(q, s, z, ch_axis)
    if ch_axis is None and q.device.type == "cpu" and q.dtype in _TORCH_QDTYPE and q.is_contiguous():
        sz = _f32_scalar(scale), _f32_scalar(zero_point)
        fast = None if None in sz else _dequantize_fused(q, *sz)  # type: ignore[arg-type]
        if fast is not None:
            return fast
    s, z = _broadcast(scale, q, ch_axis, torch.float32), _broadcast(zero_point, q, ch_axis, torch.float32)
    return q.to(torch.float32, copy=True).sub_(z).mul_(s)  # (q - z) * s, in place on one float32 copy


def dequantize_fast(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """``dequantize`` of per-tensor codes whose 0-d qparams were already checked (a ``QTensor``'s): on
    CPU, 8-bit and contiguous (or 4-d channels-last: the float result keeps that layout), one fused pass with no
    validation and no per-call dispatch of Python checks; otherwise ``dequantize(..., validate=False)``.
    Bit-identical to ``dequantize``."""
    if q.is_cpu and q.dtype in _TORCH_QDTYPE and scale.dtype == torch.float32 and dense_format(q) is not None:
        y = _dequantize_fused(q, scale.item(), zero_point.item())
        if y is not None:
            return y
    return dequantize(q, scale, zero_point, validate=False)


def dense_format(x: torch.Tensor) -> torch.memory_format | None:
    """The memory format in which ``x``'s elements are dense in the order of its memory (contiguous, or a 4-d
    channels-last tensor: an image batch after ``.to(memory_format=torch.channels_last)``), else ``None``: an
    elementwise pass over memory (quantize, dequantize) can then take it as it is and keep its layout."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


_TORCH_QDTYPE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}
_QUIET = [False]  # torch warns once per process that quantized tensors are deprecated: keep it from users


def scalar_qparams(scale: Number, zero_point: Number) -> tuple[float, float] | None:
    """``(float32(1 / s), float32(z))`` as Python floats for scalar qparams (float32 division, as
    ``torch.reciprocal``), or ``None`` when either is not a CPU scalar or ``1 / s`` is not finite."""
    s, z = _f32_scalar(scale), _f32_scalar(zero_point)
    if s is None or z is None or not 1e-38 <= s < float("inf"):  # 1 / s stays finite in float32
        return None
    return float(np.float32(1.0) / np.float32(s)), z


def _f32_scalar(p: Number) -> float | None:
    """``p`` rounded to float32 as a Python float, for a number or a one-element CPU tensor; else ``None``."""
    if isinstance(p, torch.Tensor):
        if p.numel() != 1 or p.device.type != "cpu" or p.is_complex():
            return None
        if p.dtype == torch.float32:
            return float(p)
        v = float(p.item())  # an integer below 2**24 is already exact in float32
        return v if not p.is_floating_point() and abs(v) < 2**24 else float(p.to(torch.float32))
    if isinstance(p, (int, float)) and not isinstance(p, bool):
        return struct.unpack("f", struct.pack("f", p))[0] if abs(p) < 3e38 else None
    return None


def _dequantize_fused(q: torch.Tensor, s: float, z: float) -> torch.Tensor | None:
    """``(q - z) * s`` in one pass through torch's per-tensor dequantize (CPU, 8-bit codes).

    torch computes ``(float(q) - z) * float32(s)`` per element, vectorised; checked bit-identical to
    the generic path (``tests/test_numerics_fastpaths.py``). ``None`` when torch would reject the grid.
    """
    lo, hi = _TORCH_QDTYPE[q.dtype]
    if not (0 < s < float("inf") and lo <= z <= hi and z == int(z)):
        return None
    return as_torch_quantized(q, s, int(z)).dequantize()


def as_torch_quantized(q: torch.Tensor, scale: float = 1.0, zero_point: int = 0) -> torch.Tensor:
    """8-bit codes as a torch ``quint8``/``qint8`` per-tensor quantized tensor on ``(scale, zero_point)``, for torch's
    quantized CPU kernels to read: above 4096 elements a view of the codes' memory (``set_``: torch's maker copies
    them, ~45 µs of a ~250 µs dequantize of 8 × 64 × 56 × 56 codes, 1 thread), below it the maker's copy (cheaper
    than the view's set-up there). Torch's once-per-process deprecation warning for quantized tensors is kept
    from users."""
    if _QUIET[0]:
        return _as_quantized(q, scale, zero_point)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = _as_quantized(q, scale, zero_point)
    _QUIET[0] = True
    return t


def _as_quantized(q: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    if q.numel() <= 4096:
        return torch._make_per_tensor_quantized_tensor(q, scale, zero_point)
    t = torch._empty_affine_quantized([0], scale=scale, zero_point=zero_point, dtype=_QDTYPE_OF[q.dtype])
    return t.set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


_QDTYPE_OF = {torch.uint8: torch.quint8, torch.int8: torch.qint8}


class _FakeQuantizeSTE(torch.autograd.Function):
    # forward and its straight-through backward side by side (micrograd style)
    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max, float_zero_point=False):  # type: ignore[override]
        if float_zero_point:  # round(x / s + z), as torch's float-zero-point kernels (z is not an integer)
            q = grid_position(x, scale, zero_point, check=False).round_()  # (fake_quantize's own check)
        else:
            q = _codes(x, scale, zero_point)
        mask = (q >= quant_min) & (q <= quant_max)
        ctx.save_for_backward(mask)
        return ((q.clamp(quant_min, quant_max) - zero_point) * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    scale: Number,
    zero_point: Number,
    quant_min: int,
    quant_max: int,
    ch_axis: int | None = None,
    *,
    float_zero_point: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype, with the masked straight-through gradient.

    Only ``x`` is differentiable; ``scale`` and ``zero_point`` are constants, checked as in
    ``quantize`` unless ``validate=False``. ``float_zero_point=True`` (``per_channel_affine_float_qparams``)
    rounds ``x / s + z`` instead of adding ``z`` after rounding (``z`` then need not be an integer).
    """
    # (before the comparison: a str bound raised a bare "'>=' not supported", a float one passed; type() is the fast path)
    if validate and not (type(quant_min) is int and type(quant_max) is int):  # noqa: E721
        for name, q in (("quant_min", quant_min), ("quant_max", quant_max)):
            if isinstance(q, bool) or not isinstance(q, (int, np.integer)):
                raise TypeError(f"fake_quantize: {name}={q!r} must be an int")
    if quant_min >= quant_max:
        raise ValueError(f"fake_quantize: quant_min={quant_min} must be < quant_max={quant_max}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"fake_quantize expects a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if validate:
        _check_qparams("fake_quantize", scale, zero_point, quant_min, quant_max, float_zp=bool(float_zero_point))
    s, z = _broadcast(scale, x, ch_axis, torch.float32), _broadcast(zero_point, x, ch_axis, torch.float32)
    return _FakeQuantizeSTE.apply(x, s.detach(), z.detach(), int(quant_min), int(quant_max), bool(float_zero_point))
