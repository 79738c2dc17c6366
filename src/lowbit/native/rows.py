"""Row and elementwise passes: the per-token Linear's row grids and epilogue, the quantized add, the Quantize stub.

The per-token recipes quantize every row ``x_m`` of an ``(M, K)`` float32 input on its own grid, and after the
GEMM scale every output row by it. In torch ops that is ``amin``, ``amax``, the grid's ten tiny ops, then
``mul``, ``sub``, ``round``/``clamp`` over ``x`` and ``addcmul``, ``mul``, ``add`` over the output: each a pass
over memory, ~130 ms of a 950 ms MiniLM forward at one thread. ``rowquant.c`` does each side in one pass per
row (the row's second read comes from L1), with the same float32 operations in the same order::

    row_grid(x, levels, mode)      lo = min(x_m, 0), hi = max(x_m, 0)            (NaN / ±Inf: None, all rows)
                                   s_m = max(fl(fl(hi - lo) / levels), 1e-8),  -z_m = round(fl(lo / s_m))
                                   u = fl(fl(x · fl(1 / s_m)) - (-z_m))
                                   mode "u":     min(u, qmax)                   float32 (fbgemm rounds it)
                                   mode "codes": clamp(round(u), 0, qmax)       uint8
    row_epilogue(raw, a, w, s, b)  in place, fused=True:  raw = fl(raw + a_m w_n) · s_m + b_n   (one rounding
                                                          of raw + a w: torch's addcmul_ is a fused multiply-add)
                                              fused=False: raw = fl(raw - fl(a_m w_n)) · s_m + b_n  (sub_ of a product)
    qadd, quantize_into            the quantized add's and the Quantize stub's passes (their docstrings)

>>> import torch
>>> from lowbit import native
>>> x = torch.tensor([[-1.0, 0.0, 2.0], [0.5, 0.25, 0.0]])
>>> r = native.row_grid(x, 255.0, "codes") if native.available() else None
>>> r is None or r[0].tolist() == [[0, 85, 255], [255, 127, 0]]
True
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _check_grid, _lib, _local, _threads, counts

__all__ = ["row_grid", "row_epilogue", "qadd", "quantize_into", "all_finite"]


def _fits(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0
            and x.shape[1] > 0 and x.stride(0) >= x.shape[1] and not x.requires_grad)


def row_grid(x: torch.Tensor, levels: float, mode: str, out: torch.Tensor | None = None,
             qmax: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(out, s, -z)`` for a 2-d float32 CPU ``x`` (unit column stride): the row grids on ``[0, levels]`` as
    ``(M, 1)`` float32 and ``out`` (``(M, K)``, given or new; float32 for ``mode="u"``, uint8 for ``"codes"``)
    as the module doc states; ``qmax`` defaults to ``levels`` (``inf``: no clamp on ``u``). ``None`` when the
    native passes are off, the tensors do not fit them, or some row is not finite: the caller's torch ops decide."""
    if mode not in ("u", "codes"):
        raise ValueError(f"lowbit.native.row_grid: mode={mode!r} must be 'u' or 'codes'")
    top = levels if qmax is None else qmax
    if not (math.isfinite(levels) and levels > 0) or top != top or (mode == "codes" and not 0 <= top <= 255):
        raise ValueError(f"lowbit.native.row_grid: levels={levels!r} must be finite and positive, qmax={qmax!r} a number "
                         "(for codes: inside [0, 255])")
    lib = _lib()
    if lib is None or not _fits(x):
        return None
    m, k = x.shape
    dtype = torch.float32 if mode == "u" else torch.uint8
    if out is None:
        out = torch.empty(m, k, dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != (m, k) or not out.is_contiguous():
        raise ValueError(f"row_grid: out must be a contiguous {dtype} tensor of shape {(m, k)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    scale, negzp = torch.empty(m, 1), torch.empty(m, 1)
    bad = lib.lb_row_grid(x.data_ptr(), m, k, x.stride(0), levels, 1e-8, levels if qmax is None else qmax,
                          0 if mode == "u" else 1, out.data_ptr(), k, scale.data_ptr(), negzp.data_ptr(),
                          _threads(m * k), _local.__dict__.get("isa", 1))
    if bad:
        return None
    counts["row_grid"] += 1
    return out, scale, negzp


def all_finite(x: torch.Tensor) -> bool | None:
    """Whether every element of a contiguous float32 CPU ``x`` is finite, in one read of ``x`` (``dynamic.c``); ``None``
    when the native passes are off or ``x`` is another tensor. (Cheap checks only: ``_fits`` costs more than the pass
    at 16 × 768 floats.)"""
    lib = _lib()
    if lib is None or x.dtype is not torch.float32 or not x.is_contiguous() or not x.is_cpu:
        return None
    return lib.lb_all_finite(x.data_ptr(), x.numel(), _local.__dict__.get("isa", 1)) == 1


def row_epilogue(raw: torch.Tensor, a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
                 fused: bool) -> torch.Tensor | None:
    """``raw = (raw ± a ⊗ w) · s + bias`` in place (``fused``: ``+``, as ``addcmul_``; else ``-``), for ``raw``
    ``(M, N)``, ``a`` / ``s`` ``(M, 1)``, ``w`` / ``bias`` ``(N,)``, all contiguous float32 CPU; returns ``raw``, or
    ``None`` (nothing written) when the native passes are off or the tensors do not fit."""
    lib = _lib()
    if lib is None:
        return None
    m, n = raw.shape if raw.dim() == 2 else (0, 0)
    parts = (raw, a, w, s) if bias is None else (raw, a, w, s, bias)
    if m == 0 or n == 0 or any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in parts):
        return None
    if a.numel() != m or s.numel() != m or w.numel() != n or (bias is not None and bias.numel() != n):
        return None
    if raw.requires_grad:
        return None
    lib.lb_row_epilogue(raw.data_ptr(), m, n, n, a.data_ptr(), w.data_ptr(), s.data_ptr(),
                        None if bias is None else bias.data_ptr(), int(fused), _threads(m * n),
                        _local.__dict__.get("isa", 1))
    counts["row_epilogue"] += 1
    return raw


_CODES = (torch.uint8, torch.int8)


def qadd(qa: torch.Tensor, za: int, ka: float, qb: torch.Tensor, zb: int, kb: float, z: int, lo: int, hi: int,
         storage: torch.dtype) -> torch.Tensor | None:
    """``round(clamp(fl(fl((q_a - z_a) k_a) + fl((q_b - z_b) k_b)), lo - z, hi - z)) + z`` in ``storage`` (uint8 /
    int8) for two same-shape dense 8-bit code tensors in the same memory order (``functional_modules._fast_add``'s
    arithmetic, its float32 steps in its order), as a new tensor in that order; ``None`` where they do not fit."""
    if storage not in _CODES:
        raise ValueError(f"lowbit.native.qadd: storage={storage!r} must be torch.uint8 or torch.int8")
    _check_grid("qadd", z, lo, hi, storage)
    if not all(math.isfinite(k) and k > 0 for k in (ka, kb)):
        raise ValueError(f"lowbit.native.qadd: ka={ka!r}, kb={kb!r} must be finite positive scale ratios")
    lib = _lib()
    if lib is None or qa.dtype not in _CODES or qb.dtype not in _CODES:
        return None
    if qa.shape != qb.shape or qa.stride() != qb.stride() or not qa.is_cpu or not qb.is_cpu or qa.numel() == 0:
        return None
    if not (qa.is_contiguous() or qa.is_contiguous(memory_format=torch.channels_last)):
        return None
    out = torch.empty_like(qa, dtype=storage)
    if out.stride() != qa.stride():
        return None
    n = qa.numel()
    lib.lb_qadd(qa.data_ptr(), int(qa.dtype == torch.int8), qb.data_ptr(), int(qb.dtype == torch.int8), out.data_ptr(),
                int(storage == torch.int8), n, float(za), float(zb), ka, kb, float(lo - z), float(hi - z), float(z),
                _threads(n), _local.__dict__.get("isa", 1))
    counts["qadd"] += 1
    return out


def quantize_into(x: torch.Tensor, inv: float, z: int, lo: float | None, hi: float | None, out: torch.Tensor) -> bool:
    """``out = clamp(round(fl(clamp(fl(x · inv), lo, hi) + z)), storage range)`` for a contiguous float32 CPU ``x``
    and an 8-bit ``out`` of as many elements (its ``data_ptr`` written: a plain uint8 / int8 tensor or a torch
    quantized tensor's storage): the Quantize stub's ``mul``, clamp and ``quantize_per_tensor(v, 1, z)`` with its
    NaN check in one pass. ``False`` (``out`` partly written, to be dropped) for a NaN, or where it does not fit."""
    sgn = out.dtype in (torch.int8, torch.qint8)
    _check_grid("quantize_into", z, -128 if sgn else 0, 127 if sgn else 255, torch.int8 if sgn else torch.uint8, inv)
    if (lo is not None and lo != lo) or (hi is not None and hi != hi) or (lo is not None and hi is not None and lo > hi):
        raise ValueError(f"lowbit.native.quantize_into: clamp bounds lo={lo!r}, hi={hi!r} must be numbers with lo <= hi")
    lib = _lib()
    if lib is None or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or x.requires_grad:
        return False
    if out.dtype not in (torch.uint8, torch.int8, torch.quint8, torch.qint8) or out.numel() != x.numel() \
            or not out.is_contiguous():
        return False
    return _quantize(lib, x, inv, float(z), -math.inf if lo is None else lo, math.inf if hi is None else hi, sgn, out)


def _quantize(lib: Any, x: torch.Tensor, inv: float, z: float, lo: float, hi: float, sgn: bool, out: torch.Tensor) -> bool:
    """``quantize_into``'s call once its arguments are checked (the Quantize stub checks its grid once per state)."""
    n = x.numel()
    if lib.lb_quantize(x.data_ptr(), n, inv, z, lo, hi, int(sgn), out.data_ptr(), _threads(n),
                       _local.__dict__.get("isa", 1)):
        return False
    counts["quantize"] += 1
    return True


def dequantize(q: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor | None:
    """``fl(fl(q - z) · s)`` as float32 for dense 8-bit CPU codes (uint8 / int8, contiguous or 4-d channels-last: the
    result keeps the layout), one pass: torch's per-tensor dequantize, bit for bit (``q - z`` is exact in float32),
    without the quantized tensor it needs. ``None`` where the codes do not fit (dtype, layout, device, no build).

    >>> import torch
    >>> from lowbit import native
    >>> y = native.dequantize(torch.tensor([0, 10, 255], dtype=torch.uint8), 0.5, 10)
    >>> y is None or y.tolist() == [-5.0, 0.0, 122.5]
    True
    """
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"lowbit.native.dequantize: scale={scale!r} must be a finite positive number")
    if isinstance(zero_point, bool) or not isinstance(zero_point, int):
        raise ValueError(f"lowbit.native.dequantize: zero_point={zero_point!r} must be an integer")
    sgn = q.dtype == torch.int8
    _check_grid("dequantize", zero_point, -128 if sgn else 0, 127 if sgn else 255, torch.int8 if sgn else torch.uint8)
    lib = _lib()
    if lib is None or q.dtype not in _CODES or not q.is_cpu:
        return None
    fmt = (torch.contiguous_format if q.is_contiguous()
           else torch.channels_last if q.dim() == 4 and q.is_contiguous(memory_format=torch.channels_last) else None)
    if fmt is None:
        return None
    return _dequantize(lib, q, sgn, float(scale), float(zero_point), fmt)


def _dequantize(lib: Any, q: torch.Tensor, sgn: bool, s: float, z: float, fmt: torch.memory_format) -> torch.Tensor:
    """``dequantize``'s call once its arguments are checked (the DeQuantize stub reads a checked ``QTensor``'s grid;
    ``q`` may be a torch quantized tensor, whose storage holds the codes: ``sgn`` says which 8-bit type)."""
    # (empty_like of plain codes: ~1 µs less than torch.empty; a torch quantized tensor's codes take torch.empty, its
    # sizes unpacked: a torch.Size argument costs ~0.7 µs more to parse, session 34)
    out = (torch.empty_like(q, dtype=torch.float32) if not q.is_quantized
           else torch.empty(*q.shape, dtype=torch.float32) if fmt is torch.contiguous_format and q.dim()
           else torch.empty(q.shape, dtype=torch.float32, memory_format=fmt))
    n = q.numel()
    lib.lb_dequantize(q.data_ptr(), n, int(sgn), z, s, out.data_ptr(), _threads(n), _local.__dict__.get("isa", 1))
    counts["dequantize"] += 1
    return out
