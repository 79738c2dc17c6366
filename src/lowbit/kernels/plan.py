"""A static int8 Linear's per-call work at the floor: its path, packs and constants chosen once per layer state.

``onednn.linear`` re-derives on every call what a converted layer never changes between calls: whether the CPU
saturates (VNNI), whether the weights are ``saturation_safe``, the activation grid's u8 shift and 7-bit-ness,
whether the split is needed, which packed weight to use (three version-keyed cache look-ups), the output grid's
Python floats, and which fbgemm op. ``linear_plan`` decides all of it once, for one layer state (weight codes,
scales, zero points, bias, output grid) and one activation ``QDtype``, and returns ``run(codes, s_x, z_x)``::

    u8 = codes (uint8 storage)  |  codes ^ 0x80 (full int8 grid)  |  codes - qmin (≤ 128-code int8 grid)
    torch's engine is x86/fbgemm:
        u8 output, no split      →  fbgemm's requantized codes at every M: lowbit.native (small_m.native_requant, the
                                    same codes) or fbgemm quantized::linear(_relu) on the real-scale pack (clamp)
        rows ≤ SMALL_M, or at any M where small_m.float_route holds (a float or u8 output)
                                 →  onednn.native_linear (lowbit.native: the same floats) or
                                    onednn.fallback_linear (fbgemm's unit-scale pack, the split if needed; float64
                                    where the split's sums would round or int32 could overflow)
    otherwise                    →  one onednn::qlinear_pointwise (a 7-bit grid's clamp as its hardtanh post-op,
                                    OutGrid.onednn_post)   |   onednn._split_run

These are the very calls and float32 operations ``onednn.linear`` makes on a CPU without VNNI (the
same helpers, looked up on ``onednn`` at call time), so the integer codes are bit-identical to the generic
path's (``tests/test_kernels_paths.py`` compares them shape by shape, on every route); the plan drops only
re-validation and re-derivation. ``None`` where the generic dispatcher must run: a VNNI/AMX CPU (its
generic path is already one call), no oneDNN, weights with zero points, a non-CPU layer. The caller keys
the plan on the layer's buffers (identity and ``tensor_version``) and runs it only with no backend pinned
and outside tracing; a plan's call counts in ``kernels.counts`` as ``("onednn", "linear")`` like the generic
one.

>>> import torch, lowbit as Q
>>> from lowbit.kernels import OutGrid, plan
>>> w = Q.quantize_per_channel(torch.tensor([[1.0, -1.0]]), torch.tensor([0.01]), torch.tensor([0]), 0, Q.qint8)
>>> run = plan.linear_plan(w, None, OutGrid(0.05, 128, Q.quint8), False, Q.quint8)
>>> run is None or run(torch.tensor([[10, 20]], dtype=torch.uint8), 0.1, 0).int_repr().tolist() == [[108]]
True
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import native, qstore
from ..native.layers import _QUIET as _CODES_QUIET  # (native.empty_codes has silenced torch's warning)
from ..qscheme import QDtype
from ..qtensor import QTensor
from . import avx2, onednn, small_m
from .avx2 import _QUIET
from .lane import LinearLane
from .spec import OutGrid

__all__ = ["linear_plan", "layer_key", "input_grid_key"]

Run = Callable[..., QTensor]  # run(codes, s_x, z_x, tq=None)
_UNMADE = object()  # a kept slot not filled yet (None is a made "declined")


def _quiet_qtensor(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """A torch quantized tensor made by ``fn``, without torch's one-time deprecation warning reaching users."""
    if _QUIET[0]:
        return fn(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = fn(*args)
    _QUIET[0] = True
    return t


def layer_key(w: torch.Tensor, ws: torch.Tensor, wz: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor,
              z: torch.Tensor) -> tuple[Any, ...]:
    """The cache key of a layer's plan: the identity and version counter of its weight codes, scales, zero points,
    bias (``None``: ``-2``), output scale and zero point, whether the CPU has VNNI (one helper for the eager
    module and the ``lowbit::qlinear`` op), and the address of the weight codes, which the plan's native calls read
    in place (its bias they copy): a storage moved without a version bump (``share_memory_``, as multiprocessing's
    pickler does to every tensor it sends to a spawned process or a ``DataLoader`` worker; a ``.data`` swap) would
    leave them reading freed memory. A cache that keeps the plan must hold the tensors too, so that their
    ids cannot be reused. ``_version`` read directly (~1 µs for the whole key instead of ~2 through
    ``compile_state.tensor_version``); inference tensors, which keep no version counter, key as ``-1`` as there
    (asked first: reading their ``_version`` raises, and catching that costs ~8 µs per call).

    >>> t = torch.zeros(2)
    >>> k0 = layer_key(t, t, t, None, t, t)
    >>> _ = t.add_(1)
    >>> k0 == layer_key(t, t, t, None, t, t), k0[4] == id(None), k0[10]
    (False, True, -2)
    """
    # (is_inference() first: an inference tensor's _version raises, and a caught torch error costs ~8 µs)
    return (onednn.has_vnni(), id(w), id(ws), id(wz), id(bias), id(s), id(z),
            -1 if w.is_inference() else w._version, -1 if ws.is_inference() else ws._version,
            -1 if wz.is_inference() else wz._version,
            -2 if bias is None else -1 if bias.is_inference() else bias._version,
            -1 if s.is_inference() else s._version, -1 if z.is_inference() else z._version,
            w.data_ptr())


def input_grid_key(s: torch.Tensor, z: torch.Tensor) -> tuple[int, int, int, int]:
    """The key of an input grid's Python numbers (its scale and zero point read once per state): the tensors'
    identities and versions (an inference tensor -1, asked first: its ``_version`` raises, ~8 µs caught)."""
    return id(s), id(z), -1 if s.is_inference() else s._version, -1 if z.is_inference() else z._version


def linear_plan(weight: QTensor, bias: torch.Tensor | None, out: OutGrid, relu: bool, x_qdtype: QDtype) -> Run | None:
    """``run(codes, s_x, z_x)`` computing ``onednn.linear``'s result for this layer, or ``None`` (a VNNI CPU without
    AVX-512 VNNI: its generic path is one oneDNN call)."""
    w = weight.int_repr()
    if (not onednn.available() or (onednn.has_vnni() and not onednn.shares_routes()) or w.device.type != "cpu"
            or w.dtype != torch.int8
            or w.dim() != 2 or x_qdtype.storage not in (torch.uint8, torch.int8) or bool(weight.zero_point.any())):
        return None
    k = w.shape[1]
    # the activation codes as u8 (onednn._as_u8, decided once for this grid)
    if x_qdtype.storage == torch.int8:
        shift = 128 if x_qdtype.quant_max - x_qdtype.quant_min > 127 else -x_qdtype.quant_min
    else:
        shift = 0
    seven_bit = x_qdtype.quant_max + shift <= 127
    split = not (seven_bit or onednn.saturation_safe(w))  # (as a CPU without VNNI decides: a VNNI CPU's few rows too)
    vnni = onednn.has_vnni()
    vnni_rows = small_m.vnni_rows(k, w.shape[0]) * k  # codes up to which a VNNI CPU takes the routes without VNNI
    s_out, z_out, dt = out.scale, out.zero_point, out.qdtype.storage
    qd, full = out.qdtype, out.full_range
    o_post, o_scalars, o_clamp = out.onednn_post(relu)  # oneDNN's one call: a 7-bit grid's clamp as its post-op
    w_scale, w_zp = weight.scale, weight.zero_point
    packs: dict[str, Any] = {}  # made on first use: a layer that only ever sees small M never packs for oneDNN
    fused_ok = dt == torch.uint8 and not split
    make_qt, qclamp = torch._make_per_tensor_quantized_tensor, torch.clamp
    # the output grid's clamp where it is narrower than the u8 storage (a 7-bit grid): fbgemm saturates at 0 / 255
    c_lo, c_hi = (qd.quant_min if qd.quant_min > 0 else None), (qd.quant_max if qd.quant_max < 255 else None)
    s_t, z_t = out.scale_t, out.zero_point_t
    if s_t is None or z_t is None or s_t.device != w.device:
        s_t, z_t = None, None  # (out.wrap checks the grid)
    counts = _counts()
    key = ("onednn", "linear")
    empty, empty_like, u8 = torch.empty, torch.empty_like, torch.uint8

    def onednn_pack() -> Any:
        p = packs.get("onednn")
        if p is None:
            p = packs["onednn"] = torch.ops.onednn.qlinear_prepack(w, None)
        return p

    def fbgemm_pack(scales: torch.Tensor) -> Any:  # onednn._fbgemm_requant's pack: per-channel scales, bias inside
        wq = _quiet_qtensor(torch._make_per_channel_quantized_tensor, w, scales.to(torch.float64), w_zp, 0)
        return torch.ops.quantized.linear_prepack(wq, None if bias is None else bias.detach().float())

    op = avx2.fbgemm_ops()[2 if relu else 1] if fused_ok else None
    # the 7-bit clamp as torch's quantized clamp (out of place: hardtanh_, the in-place one, is this clamp then a
    # copy_ back) where it gives clamp's codes on this grid (all 256 checked once): one op on the quantized output,
    # whose plain codes are then made only if something reads them
    ht = (None if not fused_ok or s_t is None or (c_lo is None and c_hi is None) or not _qclamp_exact(s_out, z_out, qd)
          else ((qd.quant_min - z_out) * s_out, (qd.quant_max - z_out) * s_out))

    def fbgemm_out(t: torch.Tensor, lead: Any = None) -> QTensor:
        """fbgemm's u8 output on the output grid (``lead``: a 1-d input's ``()``, the output reshaped to it):
        its codes stay in t (a QTensor's _tq, for DeQuantize / the next layer), clamped by the quantized clamp (ht) or,
        viewed, by clamp_."""
        if ht is not None:
            t = qclamp(t, ht[0], ht[1])
        if lead is not None:
            t = t.reshape(*lead, t.shape[-1])  # (a view of the quantized tensor)
        if (ht is not None or (c_lo is None and c_hi is None)) and s_t is not None:
            return QTensor._trusted(None, s_t, z_t, qd, None, t)  # type: ignore[arg-type]
        y = empty(0, dtype=u8).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())  # a view, no copy
        if c_lo is not None or c_hi is not None:
            y.clamp_(c_lo, c_hi)
        return QTensor._trusted(y, s_t, z_t, qd, None, t) if s_t is not None else out.wrap(y, t)

    def fbgemm_requant_pack() -> Any:
        p = packs.get("fbgemm_q")
        if p is None:
            p = packs["fbgemm_q"] = fbgemm_pack(w_scale)
        return p

    def fbgemm_requant(q: torch.Tensor, sx: float, zx: int, tq: torch.Tensor | None) -> QTensor:
        y = small_m.native_requant(q, sx, zx, w, w_scale, bias, out, relu, packs)
        if y is not None:
            return y
        p = fbgemm_requant_pack()
        if q.dim() == 2:
            if tq is None:
                tq = make_qt(q, sx, zx) if _QUIET[0] else _quiet_qtensor(make_qt, q, sx, zx)
            return fbgemm_out(op(tq, p, s_out, z_out))
        y = qstore.plain(op(_quiet_qtensor(make_qt, q.reshape(-1, k), sx, zx), p, s_out, z_out), torch.uint8)
        y = y.reshape(*q.shape[:-1], -1)  # (above 4096 codes no int_repr copy: a scalar loop)
        return out.wrap(y if full else y.clamp_(qd.quant_min, qd.quant_max))

    def run_codes(q: torch.Tensor, sx: float, zx: int, tq: torch.Tensor | None = None) -> QTensor:
        counts[key] += 1
        if shift:
            q = q.view(torch.uint8).bitwise_xor(128) if shift == 128 else torch.sub(q, x_qdtype.quant_min).view(torch.uint8)
            zx += shift
            tq = None
        if vnni and (not onednn.fbgemm_engine() or q.numel() > vnni_rows):  # oneDNN's one exact call (VNNI / AMX)
            y = torch.ops.onednn.qlinear_pointwise(q, sx, zx, onednn_pack(), w_scale, w_zp, bias, s_out, z_out, dt, o_post,
                                                   o_scalars, "")
            return out.wrap(y.clamp_(qd.quant_min, qd.quant_max) if o_clamp else y)
        if onednn.fbgemm_engine() and (fused_ok or q.numel() <= onednn.SMALL_M * k or small_m.float_route(out)):
            if fused_ok and small_m.requant_fits(w, w_scale, bias, sx, out, packs):
                # fbgemm's requantization at every M (lowbit.native's packed kernel from 2 rows, or fbgemm's op)
                return fbgemm_requant(q, sx, zx, tq)
            # the float epilogue fl(fl(acc) · fl(s_x s_w)), acc exact: lowbit.native, else fbgemm's split or float64
            y = onednn.native_linear(q, sx, zx, w, w_scale, split, bias, out, relu, packs)
            if y is not None:
                return y  # type: ignore[return-value]

            def fbgemm_pack() -> Any:
                p = packs.get("fbgemm")
                if p is None:
                    p = packs["fbgemm"] = onednn._fbgemm_pack(w)
                return p

            y = onednn.fallback_linear(fbgemm_pack, q, sx, zx, w, w_scale, split and not vnni, bias, out, relu, packs)
            return y  # type: ignore[no-any-return]
        packed = onednn_pack()
        if split and not vnni:
            def call(codes: torch.Tensor, zp: int, b: torch.Tensor | None, so: float, zo: int, d: torch.dtype,
                     pst: str) -> torch.Tensor:
                return torch.ops.onednn.qlinear_pointwise(codes, sx, zp, packed, w_scale, w_zp, b, so, zo, d, pst, [], "")

            return onednn._split_run(call, q, zx, bias, out, relu, -1)  # type: ignore[no-any-return]
        y = torch.ops.onednn.qlinear_pointwise(q, sx, zx, packed, w_scale, w_zp, bias, s_out, z_out, dt, o_post, o_scalars,
                                               "")
        return out.wrap(y.clamp_(qd.quant_min, qd.quant_max) if o_clamp else y)

    unit: list[Any] = [None]  # (key, s_x, z_x, the grid's tensors held, the pack for inputs on scale 1 or None,
    #                           the native plans for this grid: _UNMADE, None (declined) or a native.LinearPlan:
    #                           fbgemm's requantization (no split), then the float route's codes (split_ok);
    #                           whether fbgemm's requantization stays in int32's range: small_m.requant_fits)
    native_ok = fused_ok and w.is_contiguous() and native.available()
    # the 8-bit codes' float route on a u8 output (the split's case): onednn.native_linear's plan for each input grid,
    # called straight (its checks made once: an int32-exact layer, the u8 output grid, no code shift; a VNNI CPU up to
    # vnni_rows, where run_codes takes the same route: session 31, 1×768² 27.8 → 21.6 µs on Zen 5)
    split_ok = (split and dt == u8 and not shift and w.is_contiguous() and native.available()
                and small_m.int32_exact(w, packs))
    o_codes = small_m.out_codes(out, relu)
    o_zp, empty_q = (None if o_codes is None else o_codes[1]), torch._empty_affine_quantized
    lane = LinearLane(k, vnni, vnni_rows, (s_t, z_t, qd), counts, key)
    one_row: list[torch.Tensor | None] = [None]  # a (1, N) output on scale 1, o_zp: empty_like of it is one row's output
    #                                               (~5 µs less than _empty_affine_quantized's keyword parsing, Zen 1)

    def run_qt(x: QTensor) -> QTensor:
        """``run`` on a per-tensor ``QTensor`` (the module's entry). For a u8 output with no split, ``lowbit.native``
        takes its codes as they are (plain, ``_tq`` or ``_tu``) with the native plan made once per input grid; with the
        split (8-bit codes, ``split_ok``), ``onednn.native_linear``'s plan for the grid is called straight. Else a
        kernel output (``_tq``) goes into fbgemm as it is; ``Quantize``'s codes on scale 1 (``_tu``) go in with the pack
        made for this input grid, whose weight scales are float32 ``s_x · s_w`` (fbgemm multiplies ``float(s_in) ·
        w_scale`` first: with ``s_in = 1`` the same float32 products, so the same requantization); no scale read as a
        Python number, no re-wrap."""
        tq, tu = x._tq, x._tu
        t, lead = tq if tq is not None else (tu if tu is not None else x._q), None  # (plain codes: lowbit.native only)
        fused = (t is not None and op is not None and not shift and onednn.fbgemm_engine()
                 and not (vnni and t.numel() > vnni_rows))
        if fused and t.dim() != 2:  # type: ignore[union-attr]  # (fbgemm flattens ≥ 3-d inputs itself, as for torch.ao)
            if t.dim() == 0 or not t.is_contiguous():  # type: ignore[union-attr]
                fused = False
            elif t.dim() == 1:  # type: ignore[union-attr]
                lead, t = (), t.reshape(1, k)  # type: ignore[union-attr]
        s, z = x._scale, x._zero_point  # the input grid as Python numbers, read once per grid state (no items)
        ukey = input_grid_key(s, z)
        hit = unit[0]
        if hit is None or hit[0] != ukey:
            hit = unit[0] = [ukey, s.item(), z.item(), (s, z), None, _UNMADE, _UNMADE,
                             op is not None and small_m.requant_fits(w, w_scale, bias, s.item(), out, packs)]
        fused = fused and hit[7]  # (fbgemm's requantization out of int32's range: the float epilogue, run_codes)
        if fused and tq is not None and not native_ok:
            counts[key] += 1
            return fbgemm_out(op(t, fbgemm_requant_pack(), s_out, z_out), lead)
        # (the native slots are filled only while lowbit.native runs in this thread: a plan declined inside
        # native.disabled() would otherwise stay declined for this grid, and in the layer's shared cache)
        live = native.available()
        if fused and native_ok and live and t.is_contiguous():  # type: ignore[union-attr]  # lowbit.native: fbgemm's codes
            if hit[5] is _UNMADE:  # the native plan for this input grid, made once
                hit[5] = small_m.requant_plan(w, w_scale, bias, hit[1], out, relu, packs)
            y = (None if hit[5] is None else  # type: ignore[arg-type]
                 small_m.native_requant(t, hit[1], hit[2], w, w_scale, bias, out, relu, packs, lead, hit[5]))
            if y is not None:
                counts[key] += 1
                if lead is None and t.dim() == 2:  # type: ignore[union-attr]  # the next call on this grid: the lane
                    lane.arm(x, "requant", hit[5], hit[2], (s_out, z_out))
                return y
        if fused and tq is not None:
            counts[key] += 1
            return fbgemm_out(op(t, fbgemm_requant_pack(), s_out, z_out), lead)
        if fused and tu is not None:
            counts[key] += 1
            if hit[4] is None:
                hit[4] = fbgemm_pack(s.float() * w_scale.float())
            return fbgemm_out(op(t, hit[4], s_out, z_out), lead)
        if (split_ok and live and onednn.fbgemm_engine()  # onednn.native_linear's call, its plan kept for this grid
                and not (vnni and t is not None and t.numel() > vnni_rows)):
            if hit[6] is _UNMADE:
                hit[6] = small_m._linear_plan(w, avx2._scaled(w_scale, hit[1], packs), bias, o_codes, relu, True, packs)
            p6 = hit[6]
            if p6 is not None and s_t is not None and _CODES_QUIET[0]:
                # 2-d u8 codes: native_linear's steps with what it re-derives per call made here once (the output
                # grid's zero point, checked when the plan was made; the QTensor as out.wrap_store makes it): ~10 µs
                # less per call on a Zen 1 EPYC, where one row of 768² took ~170 µs end to end (session 29)
                q = x._q
                if q.dim() == 2 and q.dtype == u8:
                    if q.shape[0] == 1:
                        if one_row[0] is None:
                            one_row[0] = empty_q((1, p6.n), scale=1.0, zero_point=o_zp, dtype=torch.quint8)
                        yq = empty_like(one_row[0])  # (the quantizer comes with it: scale 1, zero point o_zp)
                    else:
                        yq = empty_q((q.shape[0], p6.n), scale=1.0, zero_point=o_zp, dtype=torch.quint8)
                    if p6.run(q, hit[2], yq):
                        counts[key] += 1
                        lane.arm(x, "codes", p6, hit[2], (1.0, o_zp))  # type: ignore[arg-type]
                        return QTensor._trusted(None, s_t, z_t, qd, None, None, yq)
            y = (None if p6 is None else
                 small_m.native_linear(x._q, hit[1], hit[2], w, w_scale, True, bias, out, relu, packs, p6))
            if y is not None:
                counts[key] += 1
                return y  # type: ignore[return-value]
        return run_codes(x._q, hit[1], hit[2], tq)

    # run_qt reads run_codes, not the returned object: a function whose attribute refers back to it would be a
    # reference cycle, and a replaced plan (its packed weights) would wait for the cycle collector
    run = functools.partial(run_codes)
    run.qt = run_qt  # type: ignore[attr-defined]
    run.lane = lane  # type: ignore[attr-defined]  # (armed by run_qt; the module calls it first: kernels.lane)
    return run


def _qclamp_exact(s: float, z: int, qd: QDtype) -> bool:
    """Whether torch's quantized ``clamp`` at ``(qmin - z)·s, (qmax - z)·s`` clamps all 256 u8 codes of this grid
    to ``[qmin, qmax]`` (its bounds are quantized by torch: checked, not assumed; a vector body and a scalar tail)."""
    codes = torch.arange(263, dtype=torch.int16).remainder_(256).to(torch.uint8)
    with torch.inference_mode(False):
        t = _quiet_qtensor(torch._make_per_tensor_quantized_tensor, codes.clone(), s, z)
        t = torch.clamp(t, (qd.quant_min - z) * s, (qd.quant_max - z) * s)
        return torch.equal(t.int_repr(), codes.clamp(qd.quant_min, qd.quant_max))


def _counts() -> Any:
    from . import counts  # the dispatcher's tally (imported when a plan is built: the package is loaded by then)

    return counts
