"""Per-token dynamic quantization and the per-token int8 GEMM of the dynamic ``Linear``.

For ``x`` ``(M, K)`` and the per-channel int8 weight ``W`` ``(N, K)`` (``s_w[n]``, ``z_w = 0``)::

    lo[m] = min(x_m, 0),  hi[m] = max(x_m, 0)                       # one amin + one amax pass
    s_x[m] = max((hi - lo) / 255, eps),  z_x[m] = -round(lo / s_x)   # affine quint8 per row
    q_x = clamp(round(x · float32(1 / s_x) + z_x), 0, 255)           # (M, K) u8, one fused pass
    y[m, n] = s_x[m] s_w[n] Σ_k (q_x - z_x[m]) q_w[n, k] + bias[n]

``quantize_per_token`` / ``per_token_linear`` are the generic building blocks (any backend, pins
honoured). ``dynamic_linear`` is the module's forward: the same codes (bit for bit) from a lean
quantize with no per-call validation, then the fastest exact GEMM for the case, chosen per call:

- ``M = 1`` on a VNNI/AMX CPU: ``torch._int_mm`` (u8 × s8 → exact int32, the GEMV is 3-5x faster
  than a prepacked oneDNN/fbgemm call at M = 1) and an integer zero-point correction;
- otherwise on x86: one prepacked ``onednn::qlinear_pointwise`` call on the shared grid
  ``(scale 1, zero point 128)`` and each row's grid in the float epilogue (``per_token_linear``'s
  arithmetic, with one fused multiply-add when the output is small: equal up to float32 rounding); on a CPU with
  AMX int8 and ``K % 64 == 0`` the same floats, bit for bit, from one ``lowbit.native`` call (``_amx_rows``: AMX
  tile sums and the epilogue, no per-call oneDNN set-up, which stayed on the calling thread at 2 threads);
- a CPU without VNNI (its u8 × s8 pairs saturate: the kernels' split/fbgemm rules apply): the
  generic path's codes, kernel call and epilogue (bit for bit) without its per-call wrapping (on torch's
  fbgemm/x86 engine: the codes, lowbit.native's exact int32 sums and the epilogue in one native call at every
  M, float64 sums where int32 could overflow); those routes live in ``no_vnni``;
- a pinned backend (``kernels.use_backend``), affine weights, non-finite rows or other devices take the
  generic ``per_token_linear``.

Both fast paths are counted in ``kernels.counts`` like the dispatcher (``("int_mm" | "onednn", "linear")``).

>>> import torch
>>> x = torch.tensor([[-1.0, 0.0, 2.0], [0.5, 0.25, 0.0]])
>>> quantize_per_token(x).int_repr().tolist()
[[0, 85, 255], [255, 127, 0]]
"""

from __future__ import annotations

from typing import Any

import torch

from .... import kernels, native
from ....compile_state import tensor_version
from ....kernels import int_mm, onednn, small_m
from ....qscheme import QDtype, quint8
from ....qtensor import QTensor
from .token_grid import (  # noqa: F401 (re-exported: reduced, no_vnni and the tests import them from here)
    _BLOCK, _C128, _C255, _CM128, _EPS, _F32, _INF, _LEVELS, U7, _block_rows, _codes, _one_row_grid, _row_grids,
    quantize_per_token,
)

__all__ = ["quantize_per_token", "per_token_linear", "dynamic_linear", "U7"]


def _weight_row_sums(weight: QTensor, cache: dict[str, Any] | None) -> torch.Tensor:
    """``Σ_k ŵ[n, k]`` (N,) float32, cached per version of the weight's codes, scales *and* zero points (the entry
    holds the three tensors, so their addresses cannot be reused while it is kept)."""
    w, ws, wz = weight.int_repr(), weight.scale, weight.zero_point
    key = tuple((t.data_ptr(), tensor_version(t)) for t in (w, ws, wz)) + (w.device,)
    hit = None if cache is None else cache.get("per_token.wsum")
    if hit is not None and hit[0] == key:
        return hit[1]
    centered = w.to(torch.int64).sum(1) - wz.to(torch.int64) * w.shape[1]
    wsum = (centered.to(torch.float64) * ws.to(torch.float64)).to(torch.float32)
    if cache is not None:
        cache["per_token.wsum"] = (key, wsum, (w, ws, wz))
    return wsum


def per_token_linear(xq: QTensor, weight: QTensor, bias: torch.Tensor | None = None,
                     cache: dict[str, Any] | None = None) -> torch.Tensor:
    """``x̂ ŵᵀ + bias`` (float32 ``(M, N)``): per-row 8-bit ``xq`` ``(M, K)``, per-channel int8 weight ``(N, K)``.

    The kernels take one activation grid per call, so the codes go in on the shared grid
    ``(scale 1, zero point c)`` (``c = 128``; ``64`` on ``quint8[0, 127]`` for 7-bit codes, which the
    kernels then run in one exact call without VNNI) and each row's own grid is applied in the epilogue::

        raw[m, n] = Σ_k (q_x[m, k] - c) ŵ[n, k]                      # lowbit.kernels: int32 accumulation
        y[m, n]   = s_x[m] (raw[m, n] - (z_x[m] - c) Σ_k ŵ[n, k]) + bias[n]

    Equal to ``F.linear(xq.dequantize(), weight.dequantize(), bias)`` up to float32 rounding.
    """
    q = xq.int_repr()
    if q.dtype == torch.int8:  # qint8 codes -> the same values on the u8 grid
        q, zx = q.view(torch.uint8).bitwise_xor(128), xq.zero_point + 128
        seven = False
    else:
        zx, seven = xq.zero_point, xq.qdtype.quant_max <= 127
    grid = _shared_grid(q.device, seven)
    raw = kernels.linear(QTensor._trusted(q, *grid), weight, None, None, cache=cache)
    wsum = _weight_row_sums(weight, cache)
    c = (zx - (64 if seven else 128)).to(torch.float32)[:, None]
    return _epilogue(raw, c, wsum, xq.scale[:, None], bias)  # type: ignore[arg-type]  # float out


_SHARED: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor, QDtype]] = {}


def _shared_grid(device: torch.device, seven: bool = False) -> tuple[torch.Tensor, torch.Tensor, QDtype]:
    """The shared kernel grid ``(scale 1, zero point 128, quint8)`` (``seven``: ``(1, 64, quint8[0, 127])``)
    as 0-d tensors, made once per device."""
    hit = _SHARED.get((device, seven))
    if hit is None:
        with torch.inference_mode(False):  # normal tensors even when first made under inference_mode
            hit = _SHARED[(device, seven)] = (torch.tensor(1.0, device=device),
                                              torch.tensor(64 if seven else 128, device=device), U7 if seven else quint8)
    return hit


def _epilogue(raw: torch.Tensor, c: torch.Tensor, wsum: torch.Tensor, sx: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """``(raw - c ⊗ wsum) · s_x + bias`` in place on ``raw`` (the kernel's fresh output); ``c``, ``sx`` ``(M, 1)``.

    The same float32 operations, in the same order, as the whole-tensor expression, applied to
    blocks of rows: each block stays in cache for its passes and the ``c ⊗ wsum`` temporary
    is one block, not a fresh ``(M, N)`` allocation.
    """
    rows = _block_rows(raw.shape[1])
    if rows >= raw.shape[0]:
        raw.sub_(c * wsum).mul_(sx)
        return raw if bias is None else raw.add_(bias)
    for i in range(0, raw.shape[0], rows):
        blk = raw[i:i + rows]
        blk.sub_(c[i:i + rows] * wsum).mul_(sx[i:i + rows])
        if bias is not None:
            blk.add_(bias)
    return raw


class _Plan:
    """Per-weight-version constants of the fast paths (a cache, never state)."""

    __slots__ = ("key", "weight", "w_t", "wsum_i", "wsum", "scale", "packed", "token", "rows", "vnni", "rows8", "amx")

    def __init__(self, key: Any, weight: QTensor, cache: dict[str, Any]) -> None:
        w = weight.int_repr()
        self.key, self.weight, self.scale = key, weight, weight.scale
        self.w_t = w.t()  # (K, N) column-major view: _int_mm's fast layout at M = 1
        self.wsum_i = w.to(torch.int32).sum(1)  # exact: |Σ| <= 128 K
        self.wsum = _weight_row_sums(weight, cache)
        self.packed: Any = None
        self.token: Any = None  # the 7-bit recipe's fbgemm pack (reduced.per_token_7bit)
        self.rows: Any = None  # its native plan for few rows, with the bias it holds: (bias key, native.LinearPlan)
        self.rows8: Any = None  # the 8-bit recipe's native "rows_sub" plan without VNNI, likewise (no_vnni._native_rows8)
        self.vnni: Any = None  # a VNNI CPU's native plans for few rows: (bias key, one-row plan, rows plan) (_vnni_native)
        self.amx: Any = None  # an AMX CPU's native "rows_sub" plan, likewise (_amx_rows)


def native_plan_call(plan: _Plan, slot: str, codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     bias: torch.Tensor | None, make: Any, zx: int = 0) -> torch.Tensor | None:
    """A dynamic Linear's ``native.LinearPlan`` call on ``native.row_grid``'s ``(q, s_x, a)`` (``a``: the plan's per-row
    vector, ``-z_x`` for "rows"), the codes on zero point ``zx``: the plan kept in ``plan.<slot>`` with the
    bias tensor it holds (``make()`` again for another bias tensor; ``None``: no plan), float32 ``(M, N)`` out, counted
    as the fbgemm call it replaces. ``None``: not taken (the caller's route runs)."""
    lin = slot_plan(plan, slot, bias, make)
    q, scale, neg_zp = codes
    y = torch.empty(q.shape[0], plan.wsum.shape[0])
    if lin is None or not lin.run(q, zx, y, (neg_zp, scale)):
        return None
    kernels.counts[("onednn", "linear")] += 1
    return y


def slot_plan(plan: _Plan, slot: str, bias: torch.Tensor | None, make: Any) -> Any:
    """The ``native.LinearPlan`` kept in ``plan.<slot>`` with the bias tensor it holds (``make()`` again for another bias
    tensor); ``None``: no plan."""
    bkey = None if bias is None else (bias.data_ptr(), bias.dtype)
    hit = getattr(plan, slot)
    if hit is None or hit[0] != bkey:
        hit = (bkey, make())
        setattr(plan, slot, hit)
    return hit[1]


def _plan(weight_int8: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, qdtype: QDtype,
          cache: dict[str, Any]) -> _Plan | None:
    """The fast-path plan for this weight (rebuilt when a buffer changes), ``None`` for affine weights."""
    key = (weight_int8.data_ptr(), tensor_version(weight_int8), w_scale.data_ptr(), tensor_version(w_scale),
           w_zero_point.data_ptr(), tensor_version(w_zero_point))
    hit = cache.get("per_token.plan")
    if hit is not None and hit.key == key:
        return hit if hit.weight is not None else None
    if bool(w_zero_point.any()):
        plan = _Plan.__new__(_Plan)
        plan.key, plan.weight = key, None
    else:
        plan = _Plan(key, QTensor._trusted(weight_int8, w_scale, w_zero_point, qdtype, axis=0), cache)
    cache["per_token.plan"] = plan
    return plan if plan.weight is not None else None


def dynamic_linear(x2: torch.Tensor, weight_int8: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                   qdtype: QDtype, bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor:
    """``quantize_per_token(x2)`` · ``Wᵀ`` + ``bias`` as float32 ``(M, N)`` for a 2-d float ``x2`` with ``M > 0``:
    the dynamic ``Linear``'s forward (eager, and the real implementation of ``lowbit::dynamic_linear``).

    ``weight_int8`` / ``w_scale`` / ``w_zero_point`` are the module's checked buffers (``(N, K)`` int8,
    ``(N,)`` float32 / int64); ``cache`` holds the per-weight plan and packed weights.
    """
    xf = x2.detach() if x2.requires_grad else x2  # (a no-grad input needs no detached view: one op less)
    xf = xf if xf.dtype == torch.float32 else xf.float()
    if xf.is_cuda and kernels.get_backend() is None:  # three CUDA kernels (kernels.cuda_fused), no host reads
        y = int_mm.dynamic_linear(xf, QTensor._trusted(weight_int8, w_scale, w_zero_point, qdtype, axis=0), bias, cache)
        if y is not None:
            kernels.counts[("int_mm", "linear")] += 1
            return y
    plan = _plan(weight_int8, w_scale, w_zero_point, qdtype, cache) if xf.is_cpu else None
    if plan is None or kernels.get_backend() is not None:
        return _generic(xf, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
    if not onednn.has_vnni():
        return _no_vnni(xf, plan, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
    m, k = xf.shape
    one_row = m == 1 and k > 1
    if (one_row or (m <= small_m.VNNI_M and plan.wsum.shape[0] * m <= _BLOCK)) and native.vnni():
        # the two native passes below (the codes and grids, the Linear) and their tensors in one native call
        hit = _vnni_plans(plan, bias)
        y = (None if one_row and hit[1] is None  # (no one-row plan: the routes below, never the rows plan's floats)
             else native.dyn_linear(xf, hit[1] if one_row else None, hit[2], plan.scale))
        if y is not None:
            kernels.counts[("int_mm" if one_row else "onednn", "linear")] += 1  # (as the call it replaces)
            return y
    if m == 1 and k > 1:  # (K = 1: torch's CPU _int_mm sums are wrong for N > 1, see kernels/int_mm.py)
        grid = _one_row_grid(xf)
        if grid is None:
            return _generic(xf, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
        scale, neg_zp, inv = grid
        q = _codes(xf, torch.scalar_tensor(inv), torch.scalar_tensor(neg_zp))
        acc = int_mm.cpu_int_mm(q, plan.w_t, plan.wsum_i)  # Σ_k q_x q_w, exact int32
        kernels.counts[("int_mm", "linear")] += 1
        if neg_zp:
            acc = acc.add_(plan.wsum_i, alpha=int(neg_zp))  # Σ_k (q_x - z_x) q_w: exact
        y = acc.float().mul_(torch.mul(plan.scale, torch.scalar_tensor(scale)))
        return y if bias is None else y.add_(bias)
    codes = _grid_codes(xf)
    if codes is None:
        return _generic(xf, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
    q, scale, neg_zp = codes
    if m <= small_m.VNNI_M and plan.wsum.shape[0] * m <= _BLOCK and native.vnni():  # the same floats, one native call
        y = _vnni_native(plan, q, scale, 128, neg_zp.add(_C128), bias)
        if y is not None:
            return y
    if plan.packed is None:
        entry = onednn._packed(cache, "onednn.linear", plan.weight, lambda w: torch.ops.onednn.qlinear_prepack(w, None))
        if entry is None:
            return _generic(xf, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
        plan.packed = entry[0]
    return onednn_rows(plan, q, scale, neg_zp, w_scale, w_zero_point, bias)


def onednn_route(plan: _Plan, xf: torch.Tensor) -> bool:
    """Whether ``dynamic_linear`` runs a float32 CPU ``xf`` ``(M, K)`` (no grad) with this plan (symmetric weights, its
    oneDNN pack made) through ``_grid_codes`` and ``onednn_rows`` on this call: a VNNI CPU, no pinned backend, more
    than one row and too many for the native few-rows call (the compiled op's fast entry, ``pt2.module_ops``)."""
    m = xf.shape[0]
    return (plan.packed is not None and m > 1 and kernels.get_backend() is None and onednn.has_vnni()
            and not (m <= small_m.VNNI_M and plan.wsum.shape[0] * m <= _BLOCK and native.vnni()))


def onednn_rows(plan: _Plan, q: torch.Tensor, scale: torch.Tensor, neg_zp: torch.Tensor, w_scale: torch.Tensor,
                w_zero_point: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``dynamic_linear``'s oneDNN route on ``_grid_codes``' ``(q, s_x, -z_x)`` (``neg_zp`` is overwritten): one
    ``qlinear_pointwise`` call on the shared grid (scale 1, zero point 128), then the row epilogue in place. On a CPU
    with AMX int8 (``native.amx()``) and ``K % 64 == 0``, ``_amx_rows`` gives the same floats in one native call."""
    if AMX_ROWS and q.shape[1] % 64 == 0 and native.amx():
        y = _amx_rows(plan, q, scale, neg_zp, bias)
        if y is not None:
            return y
    raw = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, plan.packed, w_scale, w_zero_point, None, 1.0, 0,
                                             torch.float32, "none", [], "")  # Σ (q_x - 128) ŵ, float32
    kernels.counts[("onednn", "linear")] += 1
    cn = neg_zp.add_(_C128)  # 128 - z_x
    if raw.numel() > _BLOCK:
        cn = cn.neg_()  # c = z_x - 128, blocked
        return _epilogue(raw, cn, plan.wsum, scale, bias) if native.row_epilogue(raw, cn, plan.wsum, scale, bias,
                                                                              False) is None else raw
    if native.row_epilogue(raw, cn, plan.wsum, scale, bias, True) is not None:
        return raw
    raw = raw.addcmul_(cn, plan.wsum).mul_(scale)  # (raw - c ⊗ wsum) · s_x: one fused pass less
    return raw if bias is None else raw.add_(bias)


AMX_ROWS = True  # onednn_rows takes _amx_rows where it can (tests turn it off for the oneDNN route)


def _amx_rows(plan: _Plan, q: torch.Tensor, scale: torch.Tensor, neg_zp: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """``onednn_rows``' floats, bit for bit, from ``lowbit.native``'s AMX int8 sums (``Σ (q - 128) ŵ``: exact int32, as
    oneDNN's) and its row epilogue in the same call: ``t = fl(fl(Σ) · s_w)``, then ``onednn_rows``' epilogue: fused
    (``fl(fl(t + cn · Σ ŵ) · s_x) + b``, the "rows" plan, ``cn = 128 - z_x``) up to ``_BLOCK`` outputs, unfused past
    it (``fl(fl(t - fl(c · Σ ŵ)) · s_x) + b``, "rows_sub", ``c = z_x - 128``). No per-call oneDNN primitive set-up
    (~40 µs of the calling thread's time a call, which stayed on one thread at 2 threads), no separate epilogue pass.
    ``neg_zp`` is kept. ``None``: not taken (no plan, the tensors do not fit)."""
    m, n = q.shape[0], plan.wsum.shape[0]
    if m * n > _BLOCK:
        w, wsum = plan.weight.int_repr(), plan.wsum_i.to(torch.int32)  # type: ignore[union-attr]
        lin = slot_plan(plan, "amx", bias, lambda: native.linear_plan(w, "rows_sub", plan.scale.float(), bias, wsum=wsum,
                                                                      pairs=False, fw=plan.wsum))
        a = neg_zp.add(_C128).neg_()  # z_x - 128
    else:
        lin = _vnni_plans(plan, bias)[2]
        a = neg_zp.add(_C128)  # 128 - z_x
    y = torch.empty(m, n)
    if lin is None or not lin.run(q, 128, y, (a, scale)):
        return None
    kernels.counts[("onednn", "linear")] += 1  # (as the call it replaces)
    return y


def _vnni_native(plan: _Plan, q: torch.Tensor, scale: torch.Tensor, zx: int, cn: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """A VNNI CPU's dynamic Linear on its u8 codes in one ``lowbit.native`` call (its AVX-512 VNNI kernels, kept per
    weight and bias), the floats of the oneDNN route it replaces, bit for bit (zero point 128, ``cn = 128 - z_x``,
    ``(M, 1)``): ``t = fl(fl(Σ (q - 128) ŵ) · s_w)`` (oneDNN's raw sums), ``y = fl(fl(t + cn · Σ ŵ) · s_x) + b`` (the
    fused row epilogue). One row goes through ``native.dyn_linear`` (its column scales ``fl(s_w s_x)`` made per call
    in C; the ``_int_mm`` route's floats where that declines).
    The caller checks ``native.vnni()`` (the VNNI kernels run here). ``None``: not taken (the tensors do not fit)."""
    hit = _vnni_plans(plan, bias)
    y = torch.empty(q.shape[0], plan.wsum.shape[0])
    if hit[2] is None or not hit[2].run(q, int(zx), y, (cn, scale)):
        return None
    kernels.counts[("onednn", "linear")] += 1  # (as the call it replaces)
    return y


def _vnni_plans(plan: _Plan, bias: torch.Tensor | None) -> tuple[Any, Any, Any]:
    """``(bias key, one-row plan, rows plan)``: a VNNI CPU's native plans for few rows, kept in ``plan.vnni`` with the
    bias tensor they hold (made again for another bias tensor); a plan is ``None`` where ``native.linear_plan`` declines."""
    bkey = None if bias is None else (bias.data_ptr(), bias.dtype)
    hit = plan.vnni
    if hit is None or hit[0] != bkey:
        w, wsum = plan.weight.int_repr(), plan.wsum_i.to(torch.int32)  # type: ignore[union-attr]  # (|Σ| ≤ 128 K)
        # (its column scales are native.dyn_linear's, made per call: s_w here is never read, threads share the plan)
        one = native.linear_plan(w, "float", plan.scale.float(), bias, wsum=wsum, pairs=False)
        rows = native.linear_plan(w, "rows", plan.scale.float(), bias, wsum=wsum, pairs=False, fw=plan.wsum)
        hit = plan.vnni = (bkey, one, rows)
    return hit  # type: ignore[no-any-return]


def _grid_codes(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(q, s_x, -z_x)``: ``_row_grids`` and ``_codes`` of ``xf`` (u8 codes, ``(M, 1)`` grids), in one native pass
    per row where ``lowbit.native`` runs (the same bits), else the torch ops; ``None`` for a non-finite row."""
    fast = native.row_grid(xf, 255.0, "codes")
    if fast is not None:
        return fast
    grids = _row_grids(xf)
    if grids is None:
        return None
    scale, neg_zp = grids
    return _codes(xf, torch.reciprocal(scale), neg_zp), scale, neg_zp


def _generic(xf: torch.Tensor, weight_int8: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
             qdtype: QDtype, bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor:
    weight = QTensor._trusted(weight_int8, w_scale, w_zero_point, qdtype, axis=0)
    return per_token_linear(quantize_per_token(xf), weight, bias, cache)


from .no_vnni import _no_vnni  # noqa: E402  (below the helpers it uses)
