"""The dynamic ``Linear``'s 7-bit (``reduce_range``) activation recipes: one exact int8 call on every x86 CPU.

Without VNNI a u8 × s8 GEMM adds product pairs into a saturating int16, so lowbit's default 8-bit
per-token codes need two 7-bit halves (``kernels/avx2.py``); codes ≤ 128 never saturate with any int8
weight (``128 · 254 ≤ 32767``), so both recipes here make one call. For ``x`` ``(M, K)``, int8 weights
``q_w`` ``(N, K)`` with scales ``s_w[n]`` (zero points 0)::

    per_tensor_7bit  (torch.ao's dynamic Linear on its x86 / fbgemm engine: reduce_range=True)
      lo, hi = min(min x, 0), max(max x, 0)                        # one grid for the whole input
      s = float32((hi - lo) / 127)  (float64 arithmetic; 0.1 if 0; floored at 6.1e-5)
      z = round(the zero point of the end, lo or hi, with the smaller error), clamped to [0, 127]
      q = clamp(round(x · float32(1/s) + z), 0, 255)               # ≤ 128 (x · inv + z rounded once: an FMA)
      y = s s_w[n] Σ_k (q - z) q_w[n, k] + bias[n]

    per_token_7bit   (lowbit's per-token recipe on quint8[0, 127])
      s_x[m], z_x[m] = calculate_qparams(min(x_m, 0), max(x_m, 0)) on [0, 127]   # one grid per token
      q = clamp(round(x · float32(1/s_x) + z_x), 0, 127)
      y = s_x[m] (Σ_k q ŵ[n, k] - z_x[m] Σ_k ŵ[n, k]) + bias[n]          # ŵ = s_w q_w

``per_tensor_7bit``'s grid is fbgemm's ``ChooseQuantizationParams`` (``ao_qparams``; torch's
``_choose_qparams_per_tensor(x, reduce_range=True)``), so on an x86 CPU with torch's ``x86``/``fbgemm``
quantized engine the layer runs torch.ao's own op, ``quantized::linear_dynamic(x, packed, True)``:
torch.ao's outputs bit for bit, at its speed. ``per_token_7bit`` runs fbgemm's float-input GEMM on
``u = min(x · float32(1/s_x) + z_x, 127)`` with scale 1 and zero point 0: fbgemm rounds half to
even, as ``torch.round``, and clamps to ``[0, 255]`` (so the low clamp is left to it), so its codes are
exactly ``q`` (one quantize pass, fused in the call). Where ``lowbit.native`` runs, the same floats come from two
native calls at every M instead (``_native_rows``: the row codes, then exact sums with fbgemm's float output and the
row epilogue fused; 1.15-1.3x the fbgemm route from 2 rows, session 15).
A pinned backend (``kernels.use_backend``), another device or engine, or weights with zero points
take the generic path: the same codes through ``lowbit.kernels`` (``per_token_linear`` /
``kernels.linear``). The fast paths count as ``("onednn", "linear")``, as the other fbgemm paths.

>>> import torch
>>> s, z = ao_qparams(torch.tensor([[-1.0, 0.5], [2.0, 0.25]]))
>>> round(s, 6), z, ao_codes(torch.tensor([[-1.0, 2.0]]), s, z).tolist()
(0.023622, 42, [[0, 127]])
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import numpy as np
import torch

from .... import kernels, native
from ....compile_state import tensor_version
from ....kernels import onednn
from ....kernels.avx2 import _scratch, direct, fbgemm_ops
from ....qscheme import QDtype, quint8
from ....qtensor import QTensor
from .per_token import (U7, _LEVELS, _block_rows, _one_row_grid, _plan, _row_grids, dynamic_linear, native_plan_call,
                        per_token_linear, quantize_per_token)

__all__ = ["ACTIVATIONS", "ao_qparams", "ao_codes", "per_tensor_7bit", "per_token_7bit"]

# the dynamic Linear's activation recipes: lowbit's default first
ACTIVATIONS = ("per_token", "per_token_7bit", "per_tensor_7bit")
_F32 = np.float32
_SMALL_SCALE = _F32(6.1e-5)  # fbgemm's SMALL_SCALE_THRESHOLD (a float)
_SCRATCH_MAX = 1 << 24  # floats (64 MiB) up to which per_token_7bit's u lives in the thread's kept scratch buffer
_SCRATCH_MIN = 1 << 16  # floats (256 KiB) above which it does (below: malloc's reused heap blocks, no faults)


def ao_qparams(x: torch.Tensor) -> tuple[float, int]:
    """``(scale, zero_point)`` of ``x`` on ``[0, 127]`` as torch.ao's x86 dynamic ops choose them (fbgemm's
    ``ChooseQuantizationParams`` with ``reduce_range``; ``torch._choose_qparams_per_tensor(x, True)``)."""
    lo_t, hi_t = torch.aminmax(x.detach().float())
    lo, hi = min(_F32(lo_t.item()), _F32(0.0)), max(_F32(hi_t.item()), _F32(0.0))  # float32, as fbgemm's
    qmin, qmax = 0, 127
    scale = (float(hi) - float(lo)) / (qmax - qmin)  # float64, as fbgemm
    if not math.isfinite(scale):
        return float("nan"), 0  # NaN / Inf input: a NaN output, as the per-token recipe's non-finite rows
    s32 = _F32(scale)
    with np.errstate(over="ignore", divide="ignore"):
        if s32 == 0 or np.isinf(_F32(1.0) / s32):
            scale, s32 = 0.1, _F32(0.1)
    if scale < _SMALL_SCALE:  # fbgemm widens the range so that the scale is the threshold
        org, scale = s32, float(_SMALL_SCALE)
        if lo == 0:
            hi = _SMALL_SCALE * _F32(qmax - qmin)
        elif hi == 0:
            lo = -_SMALL_SCALE * _F32(qmax - qmin)
        else:
            amp = _SMALL_SCALE / org
            lo, hi = lo * amp, hi * amp
    lo_d, hi_d = float(lo), float(hi)
    from_min, from_max = qmin - lo_d / scale, qmax - hi_d / scale
    err_min, err_max = abs(qmin) - abs(lo_d / scale), abs(qmax) - abs(hi_d / scale)
    z0 = from_min if err_min < err_max else from_max
    z = qmin if z0 < qmin else qmax if z0 > qmax else int(round(z0))  # round half even, as nearbyint
    return float(_F32(scale)), z


def ao_codes(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """u8 codes ``clamp(round(x · float32(1/s) + z), 0, 255)`` with ``x · inv + z`` rounded once to float32, as
    fbgemm's vectorised ``Quantize`` (a fused multiply-add) and ``torch.quantize_per_tensor`` compute them
    (emulated in float64: the product of two float32 is exact there)."""
    inv = torch.tensor(scale, dtype=torch.float32, device=x.device).reciprocal().double()
    return torch.mul(x.detach().double(), inv).add_(zero_point).float().round_().clamp_(0, 255).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


def _fbgemm_may_run(x: torch.Tensor) -> bool:
    """Whether fbgemm's ops may run on ``x``: x86 CPU, torch's x86/fbgemm engine (``onednn.fbgemm_engine``: its id
    read from C++, not the ``torch.backends.quantized.engine`` property's name lookup), no pinned backend."""
    return x.is_cpu and _fbgemm() and onednn.fbgemm_engine() and kernels.get_backend() is None


def _fast(x: torch.Tensor, w_zero_point: torch.Tensor, cache: dict[str, Any]) -> bool:
    """``_fbgemm_may_run`` and symmetric weights (checked once per zero-point version)."""
    if not _fbgemm_may_run(x):
        return False
    key = (w_zero_point.data_ptr(), tensor_version(w_zero_point))
    hit = cache.get("reduced.symmetric")
    if hit is None or hit[0] != key:
        hit = cache["reduced.symmetric"] = (key, not bool(w_zero_point.any()))
    return hit[1]


def _pack(cache: dict[str, Any], name: str, weight_int8: torch.Tensor, w_scale: torch.Tensor,
          bias: torch.Tensor | None) -> Any:
    """fbgemm-packed weight with its real per-channel scales (and ``bias``), rebuilt when a buffer changes (their
    identities and versions)."""
    # (the pack holds the three tensors: their ids stay unique; an inference tensor keys as -1 without a raise)
    key = (id(weight_int8), id(w_scale), id(bias), tensor_version(weight_int8), tensor_version(w_scale),
           None if bias is None else tensor_version(bias))
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = cache[name] = (key, _prepack(weight_int8, w_scale, bias), (weight_int8, w_scale, bias))
    return hit[1]


def _prepack(weight_int8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """fbgemm's pack of the int8 weight with its real per-channel scales (zero points 0) and ``bias``."""
    with warnings.catch_warnings():  # torch deprecates quantized tensors; this one lives only inside the pack
        warnings.simplefilter("ignore", UserWarning)
        wq = torch._make_per_channel_quantized_tensor(weight_int8, w_scale.double(),
                                                      torch.zeros(weight_int8.shape[0], dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(wq, bias)


def per_tensor_7bit(x2: torch.Tensor, weight_int8: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                    qdtype: QDtype, bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor:
    """torch.ao's x86 dynamic Linear (``(M, K)`` float, ``M > 0`` → ``(M, N)`` float32): one grid, 7-bit."""
    xf = x2.detach()
    xf = xf if xf.dtype == torch.float32 else xf.float()
    # fbgemm's min/max skip a NaN past the first element (finite garbage out) and raise "min should be less than or
    # equal to max" on a first one: a non-finite input takes the path below, whose one grid is NaN: NaN out, every row
    if _fast(xf, w_zero_point, cache) and _finite(xf):
        packed = _pack(cache, "reduced.ao", weight_int8, w_scale, bias)
        kernels.counts[("onednn", "linear")] += 1
        return _dynamic_op()(xf, packed, True)
    scale, zp = ao_qparams(xf)
    dev = xf.device
    if not math.isfinite(scale):  # a NaN / Inf input: NaN out on every route (the reference backend refused the grid)
        return torch.full((xf.shape[0], weight_int8.shape[0]), float("nan"), device=dev)
    xq = QTensor._trusted(ao_codes(xf, scale, zp), torch.tensor(scale, dtype=torch.float32, device=dev),
                          torch.tensor(zp, dtype=torch.int64, device=dev), quint8)  # codes ≤ 128: the 8-bit grid
    weight = QTensor._trusted(weight_int8, w_scale, w_zero_point, qdtype, axis=0)
    return kernels.linear(xq, weight, bias, None, cache=cache)  # type: ignore[return-value]


def _finite(xf: torch.Tensor) -> bool:
    """Whether every element of ``xf`` is finite: one native read (``native.all_finite``), else one ``sum`` (a finite
    input whose sum overflows only takes the exact path below)."""
    ok = native.all_finite(xf)
    return math.isfinite(float(xf.sum())) if ok is None else ok


def per_token_7bit(x2: torch.Tensor, weight_int8: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                   qdtype: QDtype, bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor:
    """lowbit's per-token recipe on 7-bit codes (``(M, K)`` float, ``M > 0`` → ``(M, N)`` float32)."""
    xf = x2.detach() if x2.requires_grad else x2  # (a no-grad input needs no detached view: one op less)
    xf = xf if xf.dtype == torch.float32 else xf.float()
    plan = _token_plan(xf, weight_int8, w_scale, w_zero_point, qdtype, cache)
    if plan is not None:
        y = _native_rows(xf, plan, weight_int8, w_scale, bias)
        if y is not None:
            return y
    fast = _native_u7(xf) if plan is not None else None
    if fast is not None:  # grids and u in one native pass per row (the same bits as the torch ops below)
        u, scale, neg_zp = fast
        raw = _token_gemm(u, plan)
        if native.row_epilogue(raw, neg_zp, plan.wsum, scale, bias, True) is not None:
            return raw
        return _row_epilogue(raw, neg_zp, plan.wsum, scale, bias)
    if plan is not None and xf.shape[0] == 1:  # one token: the grid as Python floats (one reduction, two host reads)
        grid = _one_row_grid(xf, 127.0)
        if grid is not None:
            s, neg_zp, inv = grid
            u = torch.mul(xf, torch.scalar_tensor(inv)).sub_(torch.scalar_tensor(neg_zp)).clamp_max_(127)
            y = _token_gemm(u, plan).add_(plan.wsum, alpha=neg_zp)
            y = y.mul_(torch.scalar_tensor(s))  # s_x (Σ q ŵ - z_x Σ ŵ)
            return y if bias is None else y.add_(bias)
    grids = _row_grids(xf, _LEVELS[127], blocked=True) if plan is not None else None
    if grids is None:  # generic: pinned backend, other device/engine, affine weights, or a non-finite row
        weight = QTensor._trusted(weight_int8, w_scale, w_zero_point, qdtype, axis=0)
        return per_token_linear(quantize_per_token(xf, U7), weight, bias, cache)
    scale, neg_zp = grids
    return _row_epilogue(_token_gemm(_u7(xf, scale, neg_zp), plan), neg_zp, plan.wsum, scale, bias)


def _native_rows(xf: torch.Tensor, plan: Any, weight_int8: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """Any rows in two native calls, the same floats as the fbgemm route below: the row grids with their 7-bit codes
    ``round(u)`` (``native.row_grid``: what fbgemm's scale-1 quantize of ``u`` makes), then ``native.LinearPlan``'s
    "rows" mode: exact ``Σ q q_w``, fbgemm's float output ``fl(fl(acc) · s_w)`` and the fused row epilogue. The plan
    holds the bias it was made with (rebuilt for another bias tensor). ``None``: not taken (the fbgemm route runs)."""
    g = native.row_grid(xf, 127.0, "codes")
    return None if g is None else native_plan_call(plan, "rows", g, bias, lambda: native.linear_plan(
        weight_int8, "rows", w_scale, bias, pairs=True, fw=plan.wsum))


def _native_u7(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(u, s_x, -z_x)`` of ``_row_grids(xf, 127)`` and ``_u7`` in one native pass per row (``lowbit.native``),
    ``u`` in the thread's scratch buffer as ``_u7``'s (above ``_SCRATCH_MIN`` floats); ``None`` where the native
    pass does not run or a row is not finite (the torch ops then decide)."""
    if not native.available():
        return None
    m, k = xf.shape
    kept = _SCRATCH_MIN < m * k <= _SCRATCH_MAX  # (a small u: a fresh malloc block is cheaper than the lookup)
    return native.row_grid(xf, 127.0, "u", out=_scratch((m, k)) if kept else None)


def _token_plan(xf: torch.Tensor, weight_int8: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor,
                qdtype: QDtype, cache: dict[str, Any]) -> Any:
    """``per_token._plan`` (the per-weight-version constants, one key check per call: ``Σ ŵ``) with its fbgemm pack
    of the real scales (no bias) as ``plan.token``, when fbgemm's ops may run this call (``_fast``'s conditions:
    x86 CPU, torch's x86/fbgemm engine, no pinned backend, symmetric weights); else ``None``."""
    if not _fbgemm_may_run(xf):
        return None
    plan = _plan(weight_int8, w_scale, w_zero_point, qdtype, cache)
    if plan is not None and plan.token is None:
        plan.token = _prepack(weight_int8, w_scale, None)  # (the plan's key covers both buffers)
    return plan


def _token_gemm(u: torch.Tensor, plan: Any) -> torch.Tensor:
    """``s_w[n] Σ_k round(u[m, k]) q_w[n, k]`` (float32) in one fbgemm call on ``plan.token``: fbgemm quantizes ``u``
    with scale 1 and zero point 0 (round half to even: ``round(u)``, exact on the integer-valued range ``[0, 127]``)."""
    kernels.counts[("onednn", "linear")] += 1
    return fbgemm_ops()[0](u, 1.0, 0, plan.token)  # type: ignore[no-any-return]


def _u7(xf: torch.Tensor, scale: torch.Tensor, neg_zp: torch.Tensor) -> torch.Tensor:
    """``u = min(x · float32(1/s_x) - (-z_x), 127)`` (``(M, K)`` float32, the same three float32 operations) written
    into this thread's reused scratch buffer (``avx2._scratch``, up to ``_SCRATCH_MAX`` floats; ``u`` only feeds the
    fbgemm call) on ``_BLOCK``-float row blocks: no fresh ``(M, K)`` allocation to page-fault per call, and the sub
    and clamp passes read the block from cache."""
    m, k = xf.shape
    inv = torch.reciprocal(scale)
    u = _scratch((m, k)) if m * k <= _SCRATCH_MAX else torch.empty(m, k)
    rows = _block_rows(k)
    if rows >= m:
        return torch.mul(xf, inv, out=u).sub_(neg_zp).clamp_max_(127)
    for i in range(0, m, rows):
        torch.mul(xf[i:i + rows], inv[i:i + rows], out=u[i:i + rows]).sub_(neg_zp[i:i + rows]).clamp_max_(127)
    return u


def _row_epilogue(raw: torch.Tensor, neg_zp: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``(raw - z_x ⊗ Σŵ) · s_x + bias`` in place (one fused multiply-add, no temporary), on L2-sized row blocks."""
    rows = _block_rows(raw.shape[1])
    if raw.shape[0] <= rows:  # one block: the whole tensors (three slices less), the same operations
        raw = raw.addcmul_(neg_zp, wsum).mul_(scale)
        return raw if bias is None else raw.add_(bias)
    for i in range(0, raw.shape[0], rows):
        blk = raw[i:i + rows].addcmul_(neg_zp[i:i + rows], wsum).mul_(scale[i:i + rows])
        if bias is not None:
            blk.add_(bias)
    return raw


@functools.lru_cache(maxsize=None)
def _dynamic_op() -> Any:
    """torch.ao's ``quantized::linear_dynamic`` through its C++ entry (``kernels.avx2.direct``)."""
    return direct(torch.ops.quantized.linear_dynamic)


def forward(activation: str, x2: torch.Tensor, weight_int8: torch.Tensor, w_scale: torch.Tensor,
            w_zero_point: torch.Tensor, qdtype: QDtype, bias: torch.Tensor | None, cache: dict[str, Any]) -> torch.Tensor:
    """The dynamic Linear's forward for ``activation`` (one of ``ACTIVATIONS``) on a 2-d ``x2`` with rows."""
    if activation == "per_tensor_7bit":
        return per_tensor_7bit(x2, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
    if activation == "per_token_7bit":
        return per_token_7bit(x2, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
    return dynamic_linear(x2, weight_int8, w_scale, w_zero_point, qdtype, bias, cache)
