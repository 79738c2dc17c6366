"""Static Linears through ``lowbit.native`` on CPUs without VNNI: fbgemm's codes or lowbit's floats, one call.

(The module's name is from session 14, when these routes took few rows only.) On such a CPU the few-row static Linear
ran fbgemm (``onednn.linear``, ``plan.linear_plan``): ``quantized::linear`` for
a u8 output when no split is needed, ``_fbgemm_linear`` with lowbit's float epilogue otherwise. ``native.qlinear*``
(``lowbit/native/linear.c``) does the exact int32 sums with a register-blocked AVX2 kernel (``vpmaddubsw`` where no
u8 × s8 pair can saturate) and the epilogue in the same call, so a layer costs one call instead of fbgemm's input
wrapping, packed GEMM, output tensor and clamp:

    native_requant   fbgemm's requantized codes, bit for bit (``native.qlinear_requant``): a = Σ q w - z_x Σ w,
                     v = fl(fl(a) + fl(b / fl(s_x s_w))), round(fl(v · fl(fl(s_x s_w) / s_out))), saturated, + z_out,
                     clamped to the output grid (the ReLU floor and a 7-bit grid's top folded in)
    native_linear    ``onednn.fallback_linear``'s codes or floats (``native.qlinear``): fl(a) · fl(s_x s_w) + b, lowbit's store,
                     a exact (int32 sums while 255 · max Σ|w| < 2³¹, ``int32_exact``; ``onednn.fallback_linear``:
                     fbgemm's split or float64 sums, the same floats, and float64 past that bound)

Each keeps its per-weight constants (``Σ w``, the fbgemm multipliers per input grid) in the layer's cache.
``native_requant`` runs at every M: one row by the dot-product kernel (1.1-2.7x fbgemm at M = 1, session 14), from
``native.gemm.BCAST_M`` rows by the packed many-row kernel (1.1-1.3x fbgemm's packed GEMM, session 15). ``native_linear``
at every M where ``float_route`` holds (1.3-1.5x oneDNN's split from 64 rows, session 15). ``None``: not taken.

>>> import torch, lowbit as Q
>>> from lowbit.kernels import OutGrid, small_m
>>> w = Q.quantize_per_channel(torch.tensor([[1.0, -1.0]]), torch.tensor([0.01]), torch.tensor([0]), 0, Q.qint8)
>>> y = small_m.native_requant(torch.tensor([[10, 20]], dtype=torch.uint8), 0.1, 0, w.int_repr(), w.scale, None,
...                            OutGrid(0.05, 128, Q.quint8), False, {})
>>> y is None or y.int_repr().tolist() == [[108]]
True
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import native
from ..compile_state import tensor_version
from ..native.layers import _QUIET as _CODES_QUIET  # (set once native.empty_codes has silenced torch's warning)
from ..qtensor import QTensor
from .avx2 import _F32_EXACT, _QUIET, _inv_scale, _relu_floor, _scaled
from .spec import OutGrid

__all__ = ["VNNI_M", "VNNI_WORK", "VNNI_M_MAX", "vnni_rows", "float_route", "split_exact", "int32_exact",
           "native_linear", "native_requant", "requant_plan", "requant_fits",
           "split_on_avx2"]

# Rows up to which a static Linear on a VNNI CPU (torch's x86/fbgemm engine) takes the routes of a CPU without VNNI,
# chosen as there (``split_on_avx2``), so it gives their codes and floats: lowbit.native's AVX-512 VNNI kernels where
# they run, else fbgemm's ops (exact with VNNI, no split needed). Session 16's 16-row × 1-vector blocks were 1.1-1.6x
# oneDNN's call at 2-32 rows but 0.73-1.0x at 64-128 (Zen 4 EPYC), so the bound was 32; session 31's 6 × 4 blocks run
# 1.4-1.7x those (Zen 5 EPYC, raw kernels, 1 thread: 0.97-1.04x oneDNN's call at 64-128 rows, 1.0-1.3x at 2 threads,
# 1.0-1.1x to 256 rows at 2 threads), and the module ratios to torch.ao at 64-128 rows rose from 0.92-1.01 to
# 1.02-1.20 with the bound at 128. Zen 4 (512-bit ops on 256-bit units) was not re-measured: the new blocks cut the
# loads per vpdpbusd, which both cores pay for. More rows keep oneDNN's one call, its codes (AMX where the CPU has it).
# The route depends on the CPU and M only, never on whether lowbit.native is built.
VNNI_M = 128
# ... and past VNNI_M rows while the layer is small (M·K·N ≤ VNNI_WORK multiply-adds, at most VNNI_M_MAX rows), where
# oneDNN's per-call cost (~30 µs: its primitive made on every call) outweighs its faster blocking: SmallCNN's
# 64×1568×64 Linear 119 → 85 µs, 128 rows 152 → 131 (Zen 4 EPYC, session 18, interleaved).
VNNI_WORK = 1 << 24
VNNI_M_MAX = 256
_I32 = 1 << 31
_REQUANT_MAX = float(_I32) * (1 - 2.0 ** -10)  # fbgemm's requantized values stay below this (requant_fits)


def vnni_rows(k: int, n: int) -> int:
    """Rows up to which a static Linear with ``K = k`` inputs and ``N = n`` outputs on a VNNI CPU takes the routes of a
    CPU without VNNI: ``VNNI_M``, or more while ``M·k·n ≤ VNNI_WORK`` (at most ``VNNI_M_MAX``).

    >>> vnni_rows(768, 3072), vnni_rows(1568, 64), vnni_rows(64, 10)
    (128, 167, 256)
    """
    return min(VNNI_M_MAX, max(VNNI_M, VNNI_WORK // max(1, k * n)))


def split_on_avx2(w: torch.Tensor, cache: dict[str, Any] | None) -> bool:
    """Whether a CPU without VNNI would split these 8-bit weights (not ``saturation_safe``), kept per weight version:
    the routes a VNNI CPU shares with it are chosen by this, so that both give the same results."""
    from .onednn import saturation_safe

    return not _per_weight(cache, "native.safe", w, saturation_safe)  # type: ignore[no-any-return]


def _per_weight(cache: dict[str, Any] | None, name: str, w: torch.Tensor, make: Any) -> Any:
    """``make(w)`` kept in ``cache[name]`` per weight version (the weight's storage and ``tensor_version``)."""
    key = (w.data_ptr(), tensor_version(w))
    hit = cache.get(name) if cache is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]
    v = make(w)
    if cache is not None:
        cache[name] = (key, v)
    return v


def _weight_sums(w: torch.Tensor, cache: dict[str, Any] | None) -> torch.Tensor:
    """``Σ_k w[n, k]`` (int32) of int8 weights, kept in ``cache`` per weight version."""
    return _per_weight(cache, "native.wsum", w, lambda t: t.sum(1, dtype=torch.int32))  # type: ignore[no-any-return]


def requant_plan(w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, sx: float, out: OutGrid, relu: bool,
                 cache: dict[str, Any] | None) -> native.LinearPlan | None:
    """``native.linear_plan`` in "requant" mode for this layer state and input scale, kept in ``cache``: fbgemm's float32
    constants ``mult = fl(fl(s_x s_w) / s_out)`` and ``bterm = fl(b / fl(s_x s_w))`` (torch's qlinear:
    ``act_times_w_scale``, ``output_multiplier_float``; fbgemm's requantization divides the float bias), ``Σ w``, and
    the output codes' range (the ReLU floor and a narrow grid's ends). ``None`` while ``lowbit.native`` is off in this
    thread, made and kept only while it runs (a plan declined inside ``native.disabled()`` is not kept)."""
    if not native.available():
        return None
    qd = out.qdtype
    key = (w.data_ptr(), tensor_version(w), w_scale.data_ptr(), tensor_version(w_scale),
           None if bias is None else (bias.data_ptr(), tensor_version(bias)), sx, out.scale, out.zero_point,
           qd.quant_min, qd.quant_max, relu)
    hit = cache.get("native.requant") if cache is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]  # type: ignore[no-any-return]
    atws = torch.tensor(sx, dtype=torch.float32) * w_scale.float()
    mult = atws / torch.tensor(out.scale, dtype=torch.float32)
    bterm = None if bias is None else bias.detach().float() / atws
    plan = native.linear_plan(w, "requant", mult, bterm, wsum=_weight_sums(w, cache), pairs=True,
                              codes=(out.zero_point, _relu_floor(qd.quant_min, out.zero_point, relu), qd.quant_max))
    if cache is not None:
        cache["native.requant"] = (key, plan)
    return plan


def requant_fits(w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, sx: float, out: OutGrid,
                 cache: dict[str, Any] | None) -> bool:
    """Whether fbgemm's requantization (``native_requant``, ``onednn._fbgemm_requant``) is in range for every input of
    this layer on input scale ``sx``: ``(255 · Σ_k |w[n, k]| + |fl(b / fl(s_x s_w))|) · fl(fl(s_x s_w) / s_out)`` finite
    and below 2³¹ (with a margin for float32's roundings) for every channel. Past it fbgemm's ``cvtps2dq`` returns
    ``INT32_MIN`` for a value past int32 (a positive overflow became code 0 / the ReLU floor) and its bias term turns
    infinite where ``s_x s_w`` underflows: torch.ao's own codes are garbage there, so the caller takes the exact float
    epilogue instead (``native_linear`` / ``onednn.fallback_linear``, the reference's codes). Kept in ``cache`` per
    layer state and input scale."""
    key = (w.data_ptr(), tensor_version(w), w_scale.data_ptr(), tensor_version(w_scale),
           None if bias is None else (bias.data_ptr(), tensor_version(bias)), sx, out.scale)
    hit = cache.get("native.requant_fits") if cache is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]  # type: ignore[no-any-return]
    atws = torch.tensor(sx, dtype=torch.float32) * w_scale.detach().float()
    mult = (atws / torch.tensor(out.scale, dtype=torch.float32)).double()
    absw = _per_weight(cache, "native.abssum", w, lambda t: t.to(torch.int16).abs().sum(1, dtype=torch.int64))
    reach = 255 * absw.double()
    if bias is not None:
        reach = reach + (bias.detach().float() / atws).double().abs()
    bound = reach * mult
    fits = not bound.numel() or bool(torch.isfinite(bound).all()) and float(bound.max()) < _REQUANT_MAX
    if cache is not None:
        cache["native.requant_fits"] = (key, fits)
    return fits


def _quantized_out(shape: tuple[int, ...], scale: float, zero_point: int) -> torch.Tensor:
    """An empty torch ``quint8`` tensor on the output grid for the native pass to fill (a ``QTensor``'s ``tq``)."""
    if _QUIET[0]:
        return torch._empty_affine_quantized(shape, scale=scale, zero_point=zero_point, dtype=torch.quint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch._empty_affine_quantized(shape, scale=scale, zero_point=zero_point, dtype=torch.quint8)
    _QUIET[0] = True
    return t


def native_requant(q: torch.Tensor, sx: float, zx: int, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out: OutGrid, relu: bool, cache: dict[str, Any] | None, lead: tuple[int, ...] | None = None,
                   plan: native.LinearPlan | None = None) -> QTensor | None:
    """``onednn._fbgemm_requant``'s codes (fbgemm ``quantized::linear(_relu)``, then the output grid's clamp) from one
    native call (``requant_plan``, or ``plan`` made by it for this state), for u8 codes ``q`` (or a contiguous ``quint8``
    tensor holding them) on ``(s_x, z_x)`` whose pairs cannot saturate (7-bit codes or ``saturation_safe`` weights:
    the caller's ``not split``), at any M. The codes land in a torch
    quantized tensor on the output grid (the QTensor's ``tq``: DeQuantize and the next fbgemm layer read it as it
    is), shaped ``(*q.shape[:-1], N)`` or ``(*lead, N)``. ``None``: not taken."""
    k = q.shape[-1] if q.dim() else 0
    if k == 0 or out.qdtype.storage != torch.uint8:
        return None
    if plan is None:
        plan = requant_plan(w, w_scale, bias, sx, out, relu, cache)
        if plan is None:
            return None
    m = q.numel() // k
    t = _quantized_out((m, plan.n), out.scale, out.zero_point)
    if not plan.run(q if q.dim() == 2 else q.reshape(m, k), zx, t):
        return None
    if lead is not None or q.dim() != 2:
        t = t.reshape(*(q.shape[:-1] if lead is None else lead), plan.n)
    if out.scale_t is not None and out.zero_point_t is not None and out.scale_t.device == t.device:
        return QTensor._trusted(None, out.scale_t, out.zero_point_t, out.qdtype, None, t)
    return out.wrap(t.int_repr(), t)


def native_linear(q: torch.Tensor, sx: float, zx: int, w: torch.Tensor, w_scale: torch.Tensor, split: bool,
                  bias: torch.Tensor | None, out: OutGrid | None, relu: bool,
                  cache: dict[str, Any] | None, plan: native.LinearPlan | None = None) -> QTensor | torch.Tensor | None:
    """``onednn.fallback_linear``'s result (the same codes or floats) from a ``native.qlinear`` plan kept per layer state, at
    every M: the exact int32 sums and the float epilogue ``fl(fl(acc) · fl(s_x s_w)) + b`` in one call (the packed
    many-row kernels from 2 rows: 8-bit codes against full int8 weights 1.3-1.5x oneDNN's activation split from 64
    rows, session 15; 4096² 1.7-1.9x, session 26). ``None``: not taken (no build, not ``float_route``, or sums that
    could pass int32: ``int32_exact``). ``plan``: ``_linear_plan``'s plan for this state and ``s_x``, made by the caller
    with those checks passed (``kernels.plan`` keeps one per input grid), run as it is."""
    k = q.shape[-1] if q.dim() else 0
    if k == 0 or q.dtype != torch.uint8:
        return None
    o = out_codes(out, relu)
    if plan is None:
        if not native.available() or not float_route(out) or not int32_exact(w, cache):
            return None
        plan = _linear_plan(w, _scaled(w_scale, sx, cache), bias, o, relu, split, cache)
        if plan is None:
            return None
    q2 = q if q.dim() == 2 else q.reshape(-1, k)
    m = q2.shape[0]
    # (o[1] was checked where the plan was made: once torch's deprecation warning is silenced, the quantized output
    # is made straight, ~0.4 µs less than empty_codes' checks, session 34)
    y = (torch.empty(m, plan.n) if o is None
         else torch._empty_affine_quantized((m, plan.n), scale=1.0, zero_point=o[1], dtype=torch.quint8)
         if _CODES_QUIET[0] else native.empty_codes((m, plan.n), o[1], torch.quint8))
    if not plan.run(q2, zx, y):
        return None
    if q.dim() != 2:
        y = y.reshape(*q.shape[:-1], y.shape[-1])
    return y if out is None else out.wrap_store(y)  # (the codes stay a scale-1 torch tensor, as the split's store)


def out_codes(out: OutGrid | None, relu: bool) -> tuple[float, int, int, int] | None:
    """A ``native.qlinear`` plan's "codes" grid for ``out``: ``(inv, z, lo, hi)``, the ReLU as the clamp's floor
    (``avx2._relu_floor``); ``None`` for a float output."""
    return None if out is None else (_inv_scale(out.scale), out.zero_point,
                                     _relu_floor(out.qdtype.quant_min, out.zero_point, relu), out.qdtype.quant_max)


def float_route(out: OutGrid | None) -> bool:
    """Whether a Linear without VNNI (torch's fbgemm engine) takes the float epilogue ``fl(fl(acc) · fl(s_x s_w)) + b``
    at every M: a float or u8 output. ``native_linear`` runs it, else ``onednn.fallback_linear`` (the same floats); other
    outputs take oneDNN's split above ``SMALL_M`` rows, as before session 15. Its sums are exact at any K since session
    26: before, weights with ``127 · max Σ|w| ≥ 2²⁴`` took oneDNN's activation split, whose float32 half sums round
    (0.5x torch.ao at 4096²), where a VNNI CPU gave ``fl(acc)``."""
    return out is None or out.qdtype.storage == torch.uint8


def split_exact(w: torch.Tensor, cache: dict[str, Any] | None) -> bool:
    """Whether the 7-bit split's float32 half sums are exact for any u8 codes and zero point (``127 · max_n Σ_k |w| <
    2²⁴``), so that its ``fl(fl(lo) + 2 fl(hi))`` is ``fl(acc)``."""
    return 127 * _abs_row_max(w, cache) < _F32_EXACT


def int32_exact(w: torch.Tensor, cache: dict[str, Any] | None) -> bool:
    """Whether int32 holds every sum ``Σ_k (q - z) w`` of u8 codes (``255 · max_n Σ_k |w| < 2³¹``)."""
    return 255 * _abs_row_max(w, cache) < _I32


def _linear_plan(w: torch.Tensor, sc: torch.Tensor, bias: torch.Tensor | None, o: tuple[float, int, int, int] | None,
                 relu: bool, split: bool, cache: dict[str, Any] | None) -> native.LinearPlan | None:
    """``native.qlinear``'s plan ("float", or "codes" on ``o``) for this layer state, kept in ``cache``: a call then costs
    the codes' pass only, and the many-row kernel's packed weights are made once (``sc``: ``_scaled``'s kept tensor,
    held by the entry, so its id stays unique while the entry lives). ``None`` while ``lowbit.native`` is off in this
    thread, and nothing kept then."""
    if not native.available():
        return None
    key = (w.data_ptr(), tensor_version(w), id(sc), None if bias is None else (bias.data_ptr(), tensor_version(bias)), o,
           relu, split)
    hit = cache.get("native.linear") if cache is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]  # type: ignore[no-any-return]
    plan = native.linear_plan(w, "float" if o is None else "codes", sc, bias, wsum=_weight_sums(w, cache),
                              pairs=not split, relu=relu, grid=o)
    if cache is not None:
        cache["native.linear"] = (key, plan, sc)
    return plan


def _abs_row_max(w: torch.Tensor, cache: dict[str, Any] | None) -> int:
    """``max_n Σ_k |w[n, k]|`` of int8 weights, kept in ``cache`` per weight version."""
    return _per_weight(cache, "native.absmax", w,  # type: ignore[no-any-return]
                       lambda t: int(t.to(torch.int16).abs().sum(1, dtype=torch.int64).max()) if t.numel() else 0)
