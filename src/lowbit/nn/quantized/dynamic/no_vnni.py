"""The per-token dynamic ``Linear`` on a CPU without VNNI (``per_token.dynamic_linear``'s route there).

Its u8 × s8 pairs saturate ``vpmaddubsw``, so the kernels' split / fbgemm rules apply. ``_no_vnni`` gives the generic
path's codes, kernel call and epilogue bit for bit without its per-call wrapping: the codes, the exact sums and the
row epilogue in one ``lowbit.native`` call (``_native_rows8``) at every M, else the codes straight to the onednn
backend on the shared grid ``(1, 128)`` (its float route, large outputs in row chunks of ``_OUT_CHUNK`` floats)::

    y = fl(fl(fl(fl(Σ (q - 128) q_w) · s_w) - fl(c · Σ ŵ)) · s_x) + b,   c = z_x - 128

(Until session 26 one row took the weights split in two 7-bit halves instead, ``q_w = 2 (q_w >> 1) + (q_w & 1)``, with
fbgemm's float sums of each half: the one native call is 1.1-1.7x that route at one row, and a row's floats no longer
depend on whether it came alone or in a batch.)

>>> import torch
>>> from torch import nn
>>> from lowbit.nn.quantized.dynamic import Linear
>>> m = Linear.from_float(nn.Linear(4, 2))
>>> m(torch.ones(3, 4)).shape
torch.Size([3, 2])
"""

from __future__ import annotations

from typing import Any

import torch

from .... import kernels, native
from ....kernels import onednn, small_m
from ....qscheme import QDtype
from ....qtensor import QTensor
from .per_token import _CM128, _Plan, _epilogue, _generic, _grid_codes, _shared_grid, slot_plan

__all__: list[str] = []


def _no_vnni(xf: torch.Tensor, plan: _Plan, weight_int8: torch.Tensor, w_scale: torch.Tensor,
             w_zero_point: torch.Tensor, qdtype: QDtype, bias: torch.Tensor | None,
             cache: dict[str, Any]) -> torch.Tensor:
    """``_generic``'s codes, kernel call and epilogue, bit for bit, without its per-call wrapping: the
    row grids stay ``(M, 1)`` float32 tensors (no int64 zero points, no ``QTensor`` of the codes, no
    dispatcher); the codes, sums and row epilogue in one native call (``_native_rows8``), else the codes
    straight to the onednn backend on the shared grid (its float route: fbgemm's split, or float64 sums where
    the split's would round or int32 could overflow), a large output on row chunks of more than ``SMALL_M`` rows
    (``_OUT_CHUNK``).
    Both give the same floats, so a row's floats do not depend on whether ``lowbit.native`` runs."""
    m = xf.shape[0]
    y = _native_rows8(xf, plan, weight_int8, w_scale, bias, cache)
    if y is not None:
        return y
    codes = _grid_codes(xf)
    if codes is None:
        return _generic(xf, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
    q, scale, neg_zp = codes
    grid = _shared_grid(q.device)
    n = weight_int8.shape[0]
    chunks = max(1, min(-(-m * n // _OUT_CHUNK), m // (onednn.SMALL_M + 1))) if m * n > _CHUNK_ABOVE else 1
    raw = torch.empty(m, n) if chunks > 1 else None  # chunks: more than SMALL_M rows each, the whole's oneDNN route
    for c in range(chunks):
        i, j = m * c // chunks, m * (c + 1) // chunks
        r = onednn.linear(QTensor._trusted(q if chunks == 1 else q[i:j], *grid), plan.weight, None, None, False, cache)
        if r is NotImplemented:
            return _generic(xf, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
        if raw is None:
            raw = r
        else:
            raw[i:j].copy_(r)
    kernels.counts[("onednn", "linear")] += 1
    c = torch.sub(_CM128, neg_zp)  # c = z_x - 128, as _generic's
    return raw if native.row_epilogue(raw, c, plan.wsum, scale, bias, False) is not None else _epilogue(
        raw, c, plan.wsum, scale, bias)


def _native_rows8(xf: torch.Tensor, plan: _Plan, weight_int8: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor | None:
    """The route below (``_grid_codes``, codes on the shared grid ``(1, 128)``, ``onednn.linear``'s native float route,
    the row epilogue) in one ``lowbit.native`` call (``native.dyn_linear`` on a "rows_sub" plan), its floats bit for
    bit: the same codes and grids, then at zero point 128
    ``y = fl(fl(fl(fl(Σ (q - 128) q_w) · s_w) - fl(c · Σ ŵ)) · s_x) + b`` with ``c = fl(-128 + z_x)``, the generic
    epilogue's operations in its order. Taken where that route is the native one: torch's fbgemm engine and sums that
    int32 holds (``small_m.int32_exact``); ``None`` elsewhere, and for a non-finite row (the route below decides)."""
    if not native.available() or not onednn.fbgemm_engine() or not small_m.int32_exact(weight_int8, cache):
        return None
    lin = slot_plan(plan, "rows8", bias, lambda: native.linear_plan(
        weight_int8, "rows_sub", w_scale, bias, pairs=not small_m.split_on_avx2(weight_int8, cache), fw=plan.wsum))
    y = None if lin is None else native.dyn_linear(xf, None, lin)
    if y is not None:
        kernels.counts[("onednn", "linear")] += 1
    return y


# The 8-bit path without VNNI in row chunks of _OUT_CHUNK output floats (4 MiB) per oneDNN call when the output has
# more than _CHUNK_ABOVE floats. Its split kernel returns (2M, N) float32 sums (the layer's output was a view of their
# second half); above 32 MiB (glibc's largest mmap threshold) that buffer is a fresh mapping per call, page-faulted on
# every write (12289 faults per call at 4096×384×1536). In 4 MiB chunks no call faulted (2-3 larger chunks still did);
# below the threshold nothing faults and the chunks' extra copy pass only costs (7-12 % at 1.6 M floats). At any thread
# count: quiet 2-core EPYC, 4096×384×1536 one call / chunks 1.07-1.08 at 1 thread, 1.22-1.34 at 2 (a loaded run had read
# 0.82 at 2 threads: contention, not the chunks). Read at call time (tests set them).
_OUT_CHUNK = 1 << 20
_CHUNK_ABOVE = 1 << 22
