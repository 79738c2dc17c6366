"""The per-token dynamic ``Linear`` on a CPU without VNNI (``per_token.dynamic_linear``'s route there).

Its u8 × s8 pairs saturate ``vpmaddubsw``, so the kernels' split / fbgemm rules apply. ``_no_vnni`` gives the generic
path's codes, kernel call and epilogue bit for bit without its per-call wrapping (the codes straight to the onednn
backend on the shared grid ``(1, 128)``, large outputs in row chunks of ``_OUT_CHUNK`` floats); for at most
``_WSPLIT_M`` rows on torch's fbgemm/x86 engine and weights up to ``_WSPLIT_MAX`` elements, ``_weight_split`` runs the
same codes against the weights split in two 7-bit halves (one fbgemm call, or ``lowbit.native``'s split plan)::

    q_w = 2 (q_w >> 1) + (q_w & 1),   y = s_x (Σ q · 2(q_w >> 1) + Σ q (q_w & 1) - z_x Σ q_w) s_w + bias

>>> import torch
>>> from torch import nn
>>> from lowbit.nn.quantized.dynamic import Linear
>>> m = Linear.from_float(nn.Linear(4, 2))
>>> m(torch.ones(3, 4)).shape
torch.Size([3, 2])
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .... import kernels, native
from ....kernels import onednn, small_m
from ....qscheme import QDtype
from ....qtensor import QTensor
from .per_token import (_CM128, _Plan, _epilogue, _generic, _grid_codes, _one_row_grid, _shared_grid,
                        native_plan_call)

__all__: list[str] = []


def _no_vnni(xf: torch.Tensor, plan: _Plan, weight_int8: torch.Tensor, w_scale: torch.Tensor,
             w_zero_point: torch.Tensor, qdtype: QDtype, bias: torch.Tensor | None,
             cache: dict[str, Any]) -> torch.Tensor:
    """``_generic``'s codes, kernel call and epilogue, bit for bit, without its per-call wrapping: the
    row grids stay ``(M, 1)`` float32 tensors (no int64 zero points, no ``QTensor`` of the codes, no
    dispatcher); the codes, sums and row epilogue in one native call where the float route holds
    (``_native_rows8``), else the codes straight to the onednn backend on the shared grid (split or not by
    its rules, fbgemm for few rows), a large output on row chunks of more than ``SMALL_M`` rows (``_OUT_CHUNK``).
    The route does not depend on whether ``lowbit.native`` runs (its routes give the same floats), so without the
    native build 2-4 rows take oneDNN's float route too (6-16 % slower there than the weight split, session 25)."""
    m, k = xf.shape
    if (m <= _WSPLIT_M and weight_int8.numel() <= _WSPLIT_MAX and onednn.fbgemm_engine()
            and small_m.split_exact(weight_int8, cache)):
        y = _weight_split(xf, plan, weight_int8, w_scale, bias, cache)
        if y is not None:
            return y
    codes = _grid_codes(xf)
    if codes is None:
        return _generic(xf, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
    q, scale, neg_zp = codes
    y = _native_rows8(q, scale, neg_zp, plan, weight_int8, w_scale, bias, cache)
    if y is not None:
        return y
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


def _native_rows8(q: torch.Tensor, scale: torch.Tensor, neg_zp: torch.Tensor, plan: _Plan, weight_int8: torch.Tensor,
                  w_scale: torch.Tensor, bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor | None:
    """The route below (codes on the shared grid ``(1, 128)``, ``onednn.linear``'s native float route, the row
    epilogue) in one ``lowbit.native`` call, its floats bit for bit: "rows_sub" at zero point 128 gives
    ``y = fl(fl(fl(fl(Σ (q - 128) q_w) · s_w) - fl(c · Σ ŵ)) · s_x) + b`` with ``c = z_x - 128``, the generic
    epilogue's operations in its order. Taken where that route is the native one: torch's fbgemm engine and sums that
    int32 holds (``small_m.int32_exact``); ``None`` elsewhere."""
    if not native.available() or not onednn.fbgemm_engine() or not small_m.int32_exact(weight_int8, cache):
        return None
    split = small_m.split_on_avx2(weight_int8, cache)
    return native_plan_call(plan, "rows8", (q, scale, torch.sub(_CM128, neg_zp)), bias, lambda: native.linear_plan(
        weight_int8, "rows_sub", w_scale, bias, pairs=not split, fw=plan.wsum), zx=128)


# The 8-bit path without VNNI in row chunks of _OUT_CHUNK output floats (4 MiB) per oneDNN call when the output has
# more than _CHUNK_ABOVE floats. Its split kernel returns (2M, N) float32 sums (the layer's output was a view of their
# second half); above 32 MiB (glibc's largest mmap threshold) that buffer is a fresh mapping per call, page-faulted on
# every write (12289 faults per call at 4096×384×1536). In 4 MiB chunks no call faulted (2-3 larger chunks still did);
# below the threshold nothing faults and the chunks' extra copy pass only costs (7-12 % at 1.6 M floats). At any thread
# count: quiet 2-core EPYC, 4096×384×1536 one call / chunks 1.07-1.08 at 1 thread, 1.22-1.34 at 2 (a loaded run had read
# 0.82 at 2 threads: contention, not the chunks). Read at call time (tests set them).
_OUT_CHUNK = 1 << 20
_CHUNK_ABOVE = 1 << 22


_WSPLIT_MAX = 768 * 3072  # weight elements up to which the split weights (2x the bytes) beat one read at small M
_WSPLIT_M = 1  # rows up to which the weight split runs; more take the codes and onednn.linear's float route
#                (small_m.float_route: lowbit.native's packed 8-bit kernel, or fbgemm's activation split, the same
#                floats): 1.35-1.45x at 5-32 rows of 768² / 768×3072 (session 15); since the any-code many-row kernel
#                (session 25) also at 2-4 rows: 1.1-2.0x the split there (4×768×3072: 0.40x -> 0.79x torch.ao). Weights
#                whose split sums could round (not small_m.split_exact) take that route at one row too (session 26).


def _weight_split(xf: torch.Tensor, plan: _Plan, weight_int8: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor | None:
    """One row without VNNI: the 8-bit codes against the weights split in two 7-bit halves, one fbgemm call.

    ``q_w = 2 (q_w >> 1) + (q_w & 1)``: ``q_w >> 1`` in ``[-64, 63]`` and ``q_w & 1`` in ``{0, 1}`` are stacked into
    one ``(2N, K)`` pack (made once per weight, scales ``2 s_w`` and ``s_w``), which ``vpmaddubsw`` multiplies
    exactly with any u8 codes (``255 · 126 ≤ 32767``, ``255 · -128 ≥ -32768``). fbgemm's float-input op quantizes
    ``u = x · float32(1/s_x) + z_x`` with scale 1 and zero point 0: ``clamp(round(u), 0, 255)``, exactly the codes
    of ``quantize_per_token`` (the same two float32 ops, round half to even)::

        raw = [2 s_w Σ q (q_w >> 1) | s_w Σ q (q_w & 1)]  (1, 2N)      y = s_x (hi + lo - z_x Σ ŵ) + bias

    Against the activation split (``kernels/avx2.py``: codes, 7-bit halves staged, two stacked rows per token)
    this is ~15 ops instead of ~65 per call and no staging; it reads twice the weight bytes, so it runs for
    weights up to ``_WSPLIT_MAX`` elements only, and only where the split's sums are exact floats (the caller).
    ``lowbit.native`` runs the route in two calls (the codes; the two split sums with fbgemm's float arithmetic
    ``fl(fl(acc) · scale)`` and the epilogue), the same floats. ``None`` for a non-finite row (the generic path
    decides).
    """
    n = weight_int8.shape[0]
    fast = native.row_grid(xf, 255.0, "codes")  # the codes and then the whole route in two native calls
    y = None if fast is None else native_plan_call(plan, "wsplit", fast, bias, lambda: native.linear_plan(
        weight_int8, "split", w_scale, bias, fw=plan.wsum, w2=weight_int8 & 1, pairs=onednn.saturation_safe(weight_int8)))
    if y is not None:
        return y
    grid = _one_row_grid(xf)
    if grid is None:
        return None
    s, neg_zp, inv = grid
    u = torch.mul(xf, torch.scalar_tensor(inv)).sub_(torch.scalar_tensor(neg_zp))
    raw = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(u, 1.0, 0, _split_pack(plan, w_scale))
    y = torch.add(raw[:, :n], raw[:, n:]).add_(plan.wsum, alpha=neg_zp).mul_(torch.scalar_tensor(s))
    kernels.counts[("onednn", "linear")] += 1
    return y if bias is None else y.add_(bias)


def _split_pack(plan: _Plan, w_scale: torch.Tensor) -> Any:
    """The fbgemm pack of ``[q_w >> 1; q_w & 1]`` with scales ``[2 s_w; s_w]`` (made once per plan)."""
    if plan.split is None:
        w = plan.weight.int_repr()
        n = w.shape[0]
        with warnings.catch_warnings():  # torch deprecates quantized tensors; this one lives only inside the pack
            warnings.simplefilter("ignore", UserWarning)
            wq = torch._make_per_channel_quantized_tensor(torch.cat([w >> 1, w & 1]),
                                                          torch.cat([w_scale * 2, w_scale]).double(),
                                                          torch.zeros(2 * n, dtype=torch.long), 0)
        plan.split = torch.ops.quantized.linear_prepack(wq, None)
    return plan.split
