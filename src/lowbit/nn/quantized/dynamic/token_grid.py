"""Per-token grids and codes: each row of an ``(M, K)`` float input on its own affine 8-bit (or 7-bit) grid::

    lo[m] = min(x_m, 0),  hi[m] = max(x_m, 0)                       # one amin + one amax pass
    s_x[m] = max((hi - lo) / 255, eps),  z_x[m] = -round(lo / s_x)   # affine quint8 per row
    q_x = clamp(round(x · float32(1 / s_x) + z_x), 0, 255)           # (M, K) u8, one fused pass

``quantize_per_token`` is the generic form (any input, NaN / Inf rows carried as NaN scales); ``_row_grids`` /
``_one_row_grid`` / ``_codes`` are the lean steps the dynamic Linear's fast paths take (``per_token.py``), the same
codes bit for bit.

>>> import torch
>>> x = torch.tensor([[-1.0, 0.0, 2.0], [0.5, 0.25, 0.0]])
>>> quantize_per_token(x).int_repr().tolist()
[[0, 85, 255], [255, 127, 0]]
"""

from __future__ import annotations

import numpy as np
import torch

from .... import qstore
from ....functional import _store, quantize
from ....qparams import calculate_qparams
from ....qscheme import QDtype, QScheme, quint8
from ....qtensor import QTensor

__all__ = ["quantize_per_token", "U7"]

_EPS = 1e-8  # calculate_qparams' default eps
_INF = float("inf")
_F32 = np.float32
# 0-d operands made once: on CPU a Python float operand costs ~3 µs per op (scalar wrapping and
# type promotion), a 0-d float32 tensor ~0.6 µs, with the same float32 arithmetic
_C255, _C128, _CM128 = torch.tensor(255.0), torch.tensor(128.0), torch.tensor(-128.0)
_LEVELS = {255: _C255, 127: torch.tensor(127.0)}


_BLOCK = 262144  # floats per row block of the epilogue (1 MiB; fastest of 64 KiB-4 MiB and unblocked, AVX2 EPYC)


def _block_rows(cols: int) -> int:
    """Rows of ``cols`` floats per ``_BLOCK``-float row block (at least one)."""
    return max(1, _BLOCK // max(1, cols))


def _row_grids(xf: torch.Tensor, levels: torch.Tensor = _C255,
               blocked: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(s_x, -z_x)`` as ``(M, 1)`` float32 on ``[0, levels]`` (255, or 127 for 7-bit codes), computed as
    ``calculate_qparams`` does (same bits), or ``None`` when some row's range is not finite (NaN/Inf, or
    wider than float32): the generic path then decides (a NaN scale that carries NaN to the row's output).
    ``blocked``: the row minima and maxima on ``_BLOCK``-float row blocks (the amax reads each block from cache,
    not from memory: an input past the caches is read once instead of twice; min and max are exact either way)."""
    m = xf.shape[0]
    rows = _block_rows(xf.shape[1]) if blocked else m
    if rows >= m:
        lo, hi = xf.amin(1, keepdim=True), xf.amax(1, keepdim=True)  # ~20x faster than aminmax(dim=1) on CPU
    else:
        lo, hi = xf.new_empty(m, 1), xf.new_empty(m, 1)
        for i in range(0, m, rows):
            torch.amin(xf[i:i + rows], 1, keepdim=True, out=lo[i:i + rows])
            torch.amax(xf[i:i + rows], 1, keepdim=True, out=hi[i:i + rows])
    lo = lo.clamp_(max=0.0)
    width = hi.clamp_(min=0.0).sub_(lo)
    if not width.max().item() < _INF:  # one host read: NaN fails too
        return None
    scale = width.div_(levels).clamp_(min=_EPS)
    return scale, lo.div_(scale).round_()  # -z_x = round(lo / s_x) in [-levels, 0]: the clamp is a no-op


def _one_row_grid(xf: torch.Tensor, levels: float = 255.0) -> tuple[float, float, float] | None:
    """``(s_x, -z_x, float32(1 / s_x))`` of a one-row ``xf`` as Python floats: ``_row_grids``'
    float32 arithmetic on NumPy scalars (one reduction and two host reads instead of ~10 tiny ops)."""
    lo_t, hi_t = torch.aminmax(xf)
    lo, hi = _F32(min(lo_t.item(), 0.0)), _F32(max(hi_t.item(), 0.0))
    width = hi - lo
    if not width < _INF:
        return None
    scale = max(width / _F32(levels), _F32(_EPS))
    return float(scale), float(np.rint(lo / scale)), float(_F32(1.0) / scale)  # (np.round at 0 decimals is rint)


def _codes(xf: torch.Tensor, inv_scale: torch.Tensor, neg_zp: torch.Tensor, qmax: int = 255) -> torch.Tensor:
    """u8 codes ``clamp(round(x · float32(1/s) + z), 0, qmax)``: ``functional.quantize``'s arithmetic
    (``a - (-z)`` is ``a + z`` exactly); above 4096 codes round, clamp and store in one pass (``lowbit.qstore``,
    zero point 0: 1.4-2.3x faster at 32×3072 to 512×3072 than the four passes, whole or in cache blocks; a tie
    below, where the passes are cheap)."""
    v = torch.mul(xf, inv_scale).sub_(neg_zp)
    if xf.numel() > 4096:
        return qstore.codes(v, 0, 0, qmax, torch.uint8)
    return _store(v.round_().clamp_(0, qmax), quint8)


U7 = quint8.with_range(0, 127)  # 7-bit activations (torch.ao's reduce_range): one exact call without VNNI


def quantize_per_token(x: torch.Tensor, qdtype: QDtype = quint8) -> QTensor:
    """``(M, K)`` float -> per-row (axis 0) affine ``QTensor`` on ``qdtype`` (``quint8``, or the 7-bit
    ``quint8[0, 127]``): one grid per token."""
    if qdtype not in (quint8, U7):
        raise ValueError(f"quantize_per_token: qdtype={qdtype!r} must be lowbit.quint8 or quint8.with_range(0, 127)")
    xf = x.detach().to(torch.float32)
    grids = _row_grids(xf, _LEVELS[qdtype.quant_max]) if xf.numel() else None
    if grids is not None:
        scale, neg_zp = grids
        zp = neg_zp.neg().to(torch.int64).reshape(-1)
        q = _codes(xf, torch.reciprocal(scale), neg_zp, qdtype.quant_max)
        return QTensor._trusted(q, scale.reshape(-1), zp, qdtype, axis=0)
    lo, hi = xf.amin(1), xf.amax(1)
    scale, zp = calculate_qparams(lo, hi, QScheme.PER_CHANNEL_AFFINE, qdtype, validate=False)
    # validate=False: (M,) float32 / int64 qparams on x's device are already QTensor's contract: no re-check per call.
    # A row holding NaN or ±Inf gets a NaN scale (and zero point 0), which carries NaN to that row of the output, as
    # the float Linear's row is not finite either; calculate_qparams alone would clamp an infinite range to a finite
    # grid (a +Inf row gave finite outputs of ~1e37) or give a -Inf row a zero point of -2^63.
    bad = torch.isfinite(lo).logical_and_(torch.isfinite(hi)).logical_not_()
    if bool(bad.any()):
        scale, zp = scale.masked_fill(bad, float("nan")), zp.masked_fill(bad, 0)
    return QTensor._trusted(quantize(xf, scale, zp, qdtype, ch_axis=0, validate=False), scale, zp, qdtype, axis=0)
