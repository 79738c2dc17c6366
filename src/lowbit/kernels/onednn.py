"""oneDNN backend (x86 CPU): prepacked s8 weights, u8 activations, int32 accumulation, fused epilogue.

One call per layer: ``torch.ops.onednn.qlinear_pointwise`` / ``qconv_pointwise`` compute::

    acc[m, n] = Σ_k (q_x[m, k] - z_x) · q_w[n, k]                   # int32, u8 × s8 (VNNI)
    y[m, n]   = acc · s_x · s_w[n] + bias[n]   (→ relu)              # fused epilogue
    q_y       = clamp(round(y / s_out) + z_out)                     # fused requantization (or y)

Weights are packed once (``qlinear_prepack`` / ``qconv_prepack``) into the caller's ``cache`` and
repacked only when the weight tensor changes (its ``data_ptr``/``_version``). qint8 activations
are shifted to u8 (``q + 128``, ``z + 128``): oneDNN's s8-source path is its slow reference kernel.

Declines (returns ``NotImplemented``, the dispatcher falls back): non-CPU tensors, weight zero
points other than 0 (oneDNN ignores them), transposed convs and empty inputs.

Saturation on CPUs **without VNNI/AMX**: they multiply with ``vpmaddubsw``, which adds two u8·s8
products into a *saturating* int16, so one call is exact only when ``255 · (w_a + w_b)`` fits int16
for every pair of same-sign weights of a channel (``saturation_safe``; 7-bit weights always are).
For other weights both ops split the activations into two 7-bit halves (``_split_run``: stacked
along dim 0 into one exact kernel call on twice the rows, about as fast as fp32 there), unless the activations are already 7-bit (a
``reduce_range`` grid such as ``quint8.with_range(0, 127)``): then one call is exact for every int8
weight; ``torch._int_mm`` is no alternative on such
CPUs: without VNNI it runs a scalar loop, ~30x slower than fp32). VNNI/AMX CPUs (``vpdpbusd``,
32-bit accumulation) are exact for every int8 weight in one call.

Small M without VNNI: oneDNN's AVX2 int8 GEMM (``gemm:jit``) is slower than fp32 at M = 1, while
fbgemm's is 2-5x faster there (``benchmarks/README.md``). For at most ``SMALL_M`` rows on such CPUs the
linear runs fbgemm's float-output op (weights prepacked once with unit scales, same exactness
rules, same split) when torch's quantized engine is fbgemm/x86; it is counted as this backend.

>>> from lowbit.kernels import onednn
>>> isinstance(onednn.has_vnni(), bool)
True
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch

from ..compile_state import tensor_version
from ..functional import _store
from ..qtensor import QTensor
from .spec import ConvSpec, OutGrid

__all__ = ["NAME", "SMALL_M", "available", "has_vnni", "cpu_has_vnni", "isa_capped", "saturation_safe", "linear",
           "conv"]

NAME = "onednn"
SMALL_M = 32  # rows up to which fbgemm's int8 GEMM beats oneDNN's on CPUs without VNNI (benchmarks/README.md)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether torch was built with the oneDNN quantized ops (x86 builds)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.lru_cache(maxsize=None)
def has_vnni() -> bool:
    """Whether this CPU has a non-saturating u8×s8 dot product (AVX512-VNNI, AVX-VNNI or AMX) that
    oneDNN may use: ``ONEDNN_MAX_CPU_ISA=AVX2`` (or any cap below VNNI) makes oneDNN run its
    saturating AVX2 kernels on a VNNI CPU, so the cap counts as no VNNI (``isa_capped``)."""
    return cpu_has_vnni() and not isa_capped()


@functools.lru_cache(maxsize=None)
def cpu_has_vnni() -> bool:
    """Whether the CPU itself reports VNNI/AMX int8 (``/proc/cpuinfo`` flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def isa_capped() -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` keeps oneDNN below any VNNI ISA
    (``SSE41``, ``AVX``, ``AVX2``, ``AVX512_CORE``, ...); ``ALL``/``DEFAULT``/unset: no cap."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if cap in ("", "ALL", "DEFAULT"):
        return False
    return not ("VNNI" in cap or "AMX" in cap or "BF16" in cap or "FP16" in cap or cap.startswith("AVX10"))


def saturation_safe(weight_codes: torch.Tensor) -> bool:
    """Whether ``vpmaddubsw`` (u8 × s8 pairs into a saturating int16) is exact for these weights.

    For every output channel (dim 0), the two largest positive codes and the two most negative
    codes must each sum to at most 128 in magnitude: ``255 · 128 = 32640 ≤ 32767``.
    """
    w = weight_codes.reshape(weight_codes.shape[0], -1).to(torch.int32)
    if w.shape[1] < 2:
        return True
    pos = w.clamp(min=0).topk(2, dim=1).values.sum(1)
    neg = (-w).clamp(min=0).topk(2, dim=1).values.sum(1)
    return bool((pos <= 128).all() and (neg <= 128).all())


def _as_u8(x: QTensor) -> tuple[torch.Tensor, float, int, bool]:
    """u8 codes, scale, zero point of a per-tensor 8-bit QTensor, and whether every code is ≤ 127.

    qint8 is shifted by +128, or by ``-quant_min`` when its grid spans at most 128 codes, so that a
    7-bit grid (``reduce_range``: ``quint8.with_range(0, 127)``, ``qint8.with_range(-64, 63)``) stays
    7-bit: ``127 · (w_a + w_b) ≤ 127 · 256 < 2¹⁵``, so ``vpmaddubsw`` cannot saturate for any int8 weight.
    The codes are trusted to lie on the QTensor's grid (every lowbit op produces them so).
    """
    q, zp, qd = x.int_repr(), int(x.zero_point.item()), x.qdtype
    if q.dtype == torch.int8:
        shift = 128 if qd.quant_max - qd.quant_min > 127 else -qd.quant_min
        q = q.view(torch.uint8).bitwise_xor(128) if shift == 128 else torch.sub(q, qd.quant_min).view(torch.uint8)
        return q, x.scale.item(), zp + shift, qd.quant_max + shift <= 127
    return q, x.scale.item(), zp, qd.quant_max <= 127


def _packed(cache: dict[str, Any] | None, key: str, weight: QTensor, pack: Any) -> Any:
    """``(packed weight, needs_split)`` for ``weight`` (``None`` if declined), built once per weight version.

    ``needs_split``: this CPU's u8×s8 product could saturate for these weights (no VNNI and not
    ``saturation_safe``).
    """
    w = weight.int_repr()
    version = (w.data_ptr(), tensor_version(w), w.device)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] == version:
        return hit[1]
    ok = w.device.type == "cpu" and w.dtype == torch.int8 and available() and not bool(weight.zero_point.any())
    packed = (pack(w), not (has_vnni() or saturation_safe(w))) if ok else None
    if cache is not None:
        cache[key] = (version, packed)
    return packed


def _epilogue(out: OutGrid | None) -> tuple[float, int, torch.dtype]:
    if out is None:
        return 1.0, 0, torch.float32
    return out.scale, out.zero_point, out.qdtype.storage


def _wrap(y: torch.Tensor, out: OutGrid | None) -> QTensor | torch.Tensor:
    if out is None:
        return y
    if not out.full_range:
        y = y.clamp_(out.qdtype.quant_min, out.qdtype.quant_max)
    return out.wrap(y)


def linear(x: QTensor, weight: QTensor, bias: torch.Tensor | None, out: OutGrid | None,
           relu: bool = False, cache: dict[str, Any] | None = None) -> Any:
    """``int8 x (…, K) · int8 wᵀ (K, N)`` through ``onednn::qlinear_pointwise``; ``NotImplemented`` if declined."""
    q = x.int_repr()
    if not q.is_cpu or q.numel() == 0 or q.element_size() != 1:
        return NotImplemented
    vnni = has_vnni()
    if vnni and q.numel() == q.shape[-1] > 1:  # one row: torch._int_mm's GEMV (no pack needed, 3-5x faster)
        y = _gemv(q, x, weight, bias, out, relu, cache)
        if y is not NotImplemented:
            return y
    entry = _packed(cache, "onednn.linear", weight, _pack_linear)
    if entry is None:
        return NotImplemented
    packed, split = entry
    if vnni and q.dtype == torch.uint8:  # the common case, straight to the op: one exact call
        s_out, z_out, dt = _epilogue(out)
        y = torch.ops.onednn.qlinear_pointwise(q, x.scale.item(), x.zero_point.item(), packed, weight.scale,
                                               weight.zero_point, bias, s_out, z_out, dt, "relu" if relu else "none",
                                               [], "")
        return _wrap(y, out)
    q, sx, zx, seven_bit = _as_u8(x)
    if not vnni and q.numel() <= SMALL_M * q.shape[-1] and torch.backends.quantized.engine in _FBGEMM:
        fb = _packed(cache, "onednn.fbgemm", weight, _fbgemm_pack)
        if fb is not None and out is not None and out.qdtype.storage == torch.uint8 and not (split and not seven_bit):
            return _fbgemm_requant(cache, weight, bias, q, sx, zx, out, relu)
        if fb is not None:
            return _fbgemm_linear(fb[0], q, sx, zx, split and not seven_bit, weight.scale, bias, out, relu, cache)

    def run(codes: torch.Tensor, zp: int, b: torch.Tensor | None, s_out: float, z_out: int, dt: torch.dtype,
            post: str) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(codes, sx, zp, packed, weight.scale, weight.zero_point, b, s_out,
                                                  z_out, dt, post, [], "")

    if split and not seven_bit:
        return _split_run(run, q, zx, bias, out, relu, -1)
    s_out, z_out, dt = _epilogue(out)
    return _wrap(run(q, zx, bias, s_out, z_out, dt, "relu" if relu else "none"), out)


def _pack_linear(w: torch.Tensor) -> Any:
    return torch.ops.onednn.qlinear_prepack(w, None)


def _gemv(q: torch.Tensor, x: QTensor, weight: QTensor, bias: torch.Tensor | None, out: OutGrid | None,
          relu: bool, cache: dict[str, Any] | None) -> Any:
    """One row ``(…, 1, K)`` on a VNNI/AMX CPU: ``torch._int_mm`` (u8/s8 × s8, exact int32; the weight is
    read in place as ``wᵀ``, no pack) and the ``int_mm`` backend's epilogue, bit for bit::

        acc = Σ_k q_x q_w - z_x Σ_k q_w            y = acc · (s_x s_w) + bias (→ relu)  →  quantize onto ``out``

    oneDNN's and fbgemm's prepacked calls cost 20-35 µs at M = 1 (1×768×768); this one ~7 µs. Weight
    zero points must be 0 (checked once per weight version), else ``NotImplemented``. A requantized
    output folds the epilogue into one affine map (``_requant_folded``)."""
    w = weight.int_repr()
    version = (w.data_ptr(), tensor_version(w), weight.scale.data_ptr(), tensor_version(weight.scale))
    hit = cache.get("onednn.gemv") if cache is not None else None
    if hit is None or hit[0] != version:
        ok = w.dtype == torch.int8 and not bool(weight.zero_point.any())
        hit = (version, (w.t(), w.to(torch.int32).sum(1), weight.scale) if ok else None, {})
        if cache is not None:
            cache["onednn.gemv"] = hit
    if hit[1] is None:
        return NotImplemented
    (w_t, w_sum, w_scale), grids = hit[1], hit[2]
    sx, zx = x.scale.item(), x.zero_point.item()
    acc = torch._int_mm(q if q.dim() == 2 else q.reshape(1, -1), w_t)
    if out is not None:  # requantized: one folded affine map of the exact int32 sums
        y = _requant_folded(acc, grids, sx, zx, w_sum, w_scale, bias, out, relu)
        return out.wrap(y if q.dim() == 2 else y.reshape(*q.shape[:-1], -1))
    g = grids.get((sx, zx))
    if g is None:  # per input grid: z_x Σ q_w and s_x s_w, made once (a model's input grids are fixed)
        g = grids[(sx, zx)] = (w_sum * zx if zx else None, w_scale * sx)
        if len(grids) > 16:
            grids.pop(next(iter(grids)))
    if g[0] is not None:
        acc = acc.sub_(g[0])
    y = acc.float().mul_(g[1])
    if bias is not None:
        y = y.add_(bias)
    if relu:
        y = y.relu_()
    return y if q.dim() == 2 else y.reshape(*q.shape[:-1], -1)


def _requant_folded(acc: torch.Tensor, grids: dict[Any, Any], sx: float, zx: int, w_sum: torch.Tensor,
                    w_scale: torch.Tensor, bias: torch.Tensor | None, out: OutGrid, relu: bool) -> torch.Tensor:
    """``clamp(round(Σ q_x q_w · a[n] + c[n]))`` codes on ``out``: the requantization folded into one affine map,
    ``a = s_x s_w / s_out`` and ``c = (bias - z_x s_x s_w Σ q_w) / s_out + z_out`` (float64 once per grid), so a
    row costs four small ops instead of eight. The int32 sums are exact; ``y / s_out`` is rounded once
    instead of twice, so a code can differ from the reference's by one at a rounding tie (the DESIGN §4
    contract: within one output quantum). ReLU is the clamp at ``z_out`` (quantize is monotone)."""
    key = (sx, zx, out, relu, None if bias is None else (bias.data_ptr(), tensor_version(bias)))
    f = grids.get(key)
    if f is None:
        qd = out.qdtype
        sw = w_scale.double() * sx / out.scale
        c = -(zx * w_sum.double()) * sw + out.zero_point
        if bias is not None:
            c = c + bias.double() / out.scale
        lo = max(qd.quant_min, out.zero_point) if relu else qd.quant_min
        f = grids[key] = (sw.float(), c.float(), lo, qd.quant_max, qd)
        if len(grids) > 16:
            grids.pop(next(iter(grids)))
    a, c, lo, hi, qd = f
    return _store(torch.addcmul(c, acc.float(), a).round_().clamp_(lo, hi), qd)


@functools.lru_cache(maxsize=256)
def _inv_scale(scale: float) -> float:
    """``float32(1 / float32(scale))`` as a Python float (``torch.reciprocal`` in float32)."""
    return float(torch.tensor(scale, dtype=torch.float32).reciprocal())


def conv(x: QTensor, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid | None,
         relu: bool = False, cache: dict[str, Any] | None = None) -> Any:
    """N-d int8 convolution through ``onednn::qconv_pointwise`` (channels-last output)."""
    if spec.transposed or x.device.type != "cpu" or x.numel() == 0 or x.int_repr().element_size() != 1:
        return NotImplemented
    stride, padding, dilation = _geometry(spec)

    def pack(w: torch.Tensor) -> torch.Tensor:
        # x_scale / x_zp given to prepack do not enter the packed weight (checked in the tests)
        return torch.ops.onednn.qconv_prepack(w, weight.scale, 1.0, 0, stride, padding, dilation, spec.groups, None)

    entry = _packed(cache, "onednn.conv", weight, pack)
    if entry is None:
        return NotImplemented
    packed, split = entry
    q, sx, zx, seven_bit = _as_u8(x)

    def run(codes: torch.Tensor, zp: int, b: torch.Tensor | None, s_out: float, z_out: int, dt: torch.dtype,
            post: str) -> torch.Tensor:
        return torch.ops.onednn.qconv_pointwise(codes, sx, zp, packed, weight.scale, weight.zero_point, b, stride,
                                                padding, dilation, spec.groups, s_out, z_out, dt, post, [], "")

    if split and not seven_bit:
        return _split_run(run, q, zx, bias, out, relu, 1)
    s_out, z_out, dt = _epilogue(out)
    fuse = relu and spec.dim != 3  # oneDNN's conv3d has no fused relu
    y = run(q, zx, bias, s_out, z_out, dt, "relu" if fuse else "none")
    if relu and not fuse:  # quantize is monotone with quantize(0) = z_out, so relu commutes with it
        y = y.relu_() if out is None else y.clamp_(min=out.zero_point)
    return _wrap(y, out)


@functools.lru_cache(maxsize=256)
def _geometry(spec: ConvSpec) -> tuple[list[int], list[int], list[int]]:
    """``(stride, padding, dilation)`` lists of a (frozen, hashable) ``ConvSpec``, built once per geometry.
    The lists are passed to the oneDNN ops only, which do not mutate them."""
    return list(spec.stride), list(spec.padding), list(spec.dilation)


@functools.lru_cache(maxsize=512)
def _const(value: float | int, dtype: torch.dtype) -> torch.Tensor:
    """A 0-d CPU tensor made once: an elementwise op with a Python number operand wraps and casts it on
    every call (~3-4 µs and a ``_to_copy`` on this CPU), with a 0-d tensor of the operand's dtype ~1 µs;
    the arithmetic is the same (the scalar is cast to that dtype either way)."""
    with torch.inference_mode(False):  # a normal tensor even when first made under inference_mode
        return torch.tensor(value, dtype=dtype)


def _halves(q: torch.Tensor, zx: int) -> tuple[torch.Tensor, int]:
    """The two 7-bit halves of 8-bit codes stacked along dim 0 on one shared zero point ``c``.

    ``q - z = 2 (q_hi - z_hi) + (q_lo - z_lo)`` with ``q_hi = q >> 1``, ``q_lo = q & 1``. Both halves are
    moved onto ``c = max(z_hi, z_lo)``: codes ``q_hi - z_hi + c`` and ``q_lo - z_lo + c`` lie in ``[0, 128]``
    (``c ≤ z_hi + 1``), so ``vpmaddubsw`` cannot saturate with any int8 weight (``128 · 254 ≤ 32767``,
    ``128 · -256 = -32768``), and one kernel call on the ``2 × dim 0`` stack gives both exact sums.

    >>> st, c = _halves(torch.tensor([[255, 6]], dtype=torch.uint8), 3)
    >>> st.tolist(), c
    ([[127, 3], [1, 0]], 1)
    """
    z_hi, z_lo = zx >> 1, zx & 1
    c = max(z_hi, z_lo)
    n = q.shape[0]
    st = torch.empty((2 * n, *q.shape[1:]), dtype=torch.uint8)
    one = _const(1, torch.uint8)
    hi, lo = st[:n], st[n:]
    torch.bitwise_right_shift(q, one, out=hi)
    torch.bitwise_and(q, one, out=lo)
    if c != z_hi:
        hi.add_(_const(c - z_hi, torch.uint8))
    if c != z_lo:
        lo.add_(_const(c - z_lo, torch.uint8))
    return st, c


def _split_run(run: Any, q: torch.Tensor, zx: int, bias: torch.Tensor | None, out: OutGrid | None,
               relu: bool, channel_dim: int) -> QTensor | torch.Tensor:
    """Exact int8 GEMM/conv on CPUs whose u8×s8 pairs saturate: the 7-bit halves (``_halves``) in one call.

    ``q - z = 2 (q_hi - z_hi) + (q_lo - z_lo)``; the halves are stacked along dim 0 (rows of a GEMM,
    samples of a conv), so one kernel call computes ``Σ (q_hi - z_hi) w`` and ``Σ (q_lo - z_lo) w``
    with the weights read once; conv padding stays exact because both halves pad with their shared
    zero point (centered value 0). A float epilogue adds ``2·hi + lo`` (the same float32 operations
    as two separate calls) and applies bias, ReLU and the output grid.
    """
    if q.dim() < 2:  # one row of a linear: nothing to stack along
        hi = run(q.bitwise_right_shift(1), zx >> 1, None, 1.0, 0, torch.float32, "none")
        lo = run(q.bitwise_and(1), zx & 1, None, 1.0, 0, torch.float32, "none")
        return _float_epilogue(lo.add_(hi, alpha=2), bias, out, relu, channel_dim)
    st, c = _halves(q, zx)
    acc = run(st, c, None, 1.0, 0, torch.float32, "none")
    n = q.shape[0]
    return _float_epilogue(acc[n:].add_(acc[:n], alpha=2), bias, out, relu, channel_dim)  # 2·hi is exact


def _float_epilogue(y: torch.Tensor, bias: torch.Tensor | None, out: OutGrid | None, relu: bool,
                    channel_dim: int) -> QTensor | torch.Tensor:
    """``relu?(y + bias)`` requantized onto ``out`` (or float)."""
    if bias is not None:
        if channel_dim == -1 or y.dim() == 1:
            y = y.add_(bias)
        else:
            shape = [1] * y.dim()
            shape[channel_dim] = -1
            y = y.add_(bias.reshape(shape))
    if relu:
        y = y.relu_()
    if out is None:
        return y
    # in place, bit-identical to functional.quantize: round(y · float32(1/s) + z), clamped
    inv, zp = _out_consts(out.scale, out.zero_point)
    y = y.mul_(inv).add_(zp).round_().clamp_(out.qdtype.quant_min, out.qdtype.quant_max)
    return out.wrap(y.to(out.qdtype.storage))


@functools.lru_cache(maxsize=256)
def _out_consts(scale: float, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``float32(1 / float32(scale))`` and ``float32(zero_point)`` as 0-d tensors (``_const``)."""
    return _const(_inv_scale(scale), torch.float32), _const(float(zero_point), torch.float32)


_FBGEMM = ("x86", "fbgemm")
_QUIET = [False]  # set once the first quantized tensor was made (torch warns only once)


def _fbgemm_pack(w: torch.Tensor) -> Any:
    """fbgemm-packed int8 weight with unit per-channel scales (the real scales enter at call time)."""
    ones, zeros = torch.ones(w.shape[0], dtype=torch.float64), torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates quantized tensors; this one lives only inside the pack
        warnings.simplefilter("ignore", UserWarning)
        wq = torch._make_per_channel_quantized_tensor(w, ones, zeros, 0)
    return torch.ops.quantized.linear_prepack(wq, None)


def _fbgemm_linear(packed: Any, q: torch.Tensor, sx: float, zx: int, split: bool, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out: OutGrid | None, relu: bool,
                   cache: dict[str, Any] | None = None) -> QTensor | torch.Tensor:
    """Small-M linear through fbgemm: ``acc = Σ (q - z) q_w`` exactly (as float), then the float epilogue.

    fbgemm's float-output op quantizes its float input ``q - z`` with scale 1 and zero point ``z``,
    which gives back exactly the codes ``q``; the same ``vpmaddubsw`` rules hold, so unsafe
    weights with 8-bit codes take the two 7-bit halves (``split``), stacked into one call.
    """
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    lead, k = q.shape[:-1], q.shape[-1]
    q2 = q if q.dim() == 2 else q.reshape(-1, k)
    if split:  # both 7-bit halves in one call (``_halves``): float ``q_half - z_half`` on the shared zero point
        m, z_hi, z_lo = q2.shape[0], zx >> 1, zx & 1
        st = torch.empty((2 * m, k), dtype=torch.float32)
        one = _const(1, torch.uint8)
        torch.bitwise_right_shift(q2, one, out=st[:m])
        torch.bitwise_and(q2, one, out=st[m:])
        if z_hi:
            st[:m].sub_(_const(float(z_hi), torch.float32))
        if z_lo:
            st[m:].sub_(_const(1.0, torch.float32))
        a = op(st, 1.0, max(z_hi, z_lo), packed)
        y = a[m:].add_(a[:m], alpha=2)
    else:
        y = op(q2.float().sub_(_const(float(zx), torch.float32)), 1.0, zx, packed)
    y = y.mul_(_scaled(w_scale, sx, cache))
    return _float_epilogue(y if q.dim() == 2 else y.reshape(*lead, -1), bias, out, relu, -1)


def _scaled(w_scale: torch.Tensor, sx: float, cache: dict[str, Any] | None) -> torch.Tensor:
    """``w_scale * sx`` (float32, the same product), kept in the layer's ``cache`` for its last input scale."""
    key = (w_scale.data_ptr(), tensor_version(w_scale), sx)
    hit = cache.get("onednn.scaled") if cache is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]
    prod = w_scale * sx
    if cache is not None:
        cache["onednn.scaled"] = (key, prod)
    return prod


def _fbgemm_requant(cache: dict[str, Any] | None, weight: QTensor, bias: torch.Tensor | None, q: torch.Tensor,
                    sx: float, zx: int, out: OutGrid, relu: bool) -> QTensor:
    """Small-M static linear with a u8 output in one fbgemm call (scales, bias and requantization fused).

    Needs a pack with the real scales and bias (keyed on their versions too); exact accumulation under
    the same rules as ``_fbgemm_linear``, requantized by fbgemm (±1 code from the reference at ties).
    """
    w, sw = weight.int_repr(), weight.scale
    version = (w.data_ptr(), tensor_version(w), sw.data_ptr(), tensor_version(sw),
               None if bias is None else (bias.data_ptr(), tensor_version(bias)))
    hit = cache.get("onednn.fbgemm_q") if cache is not None else None
    if hit is None or hit[0] != version:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            wq = torch._make_per_channel_quantized_tensor(w, sw.to(torch.float64), weight.zero_point, 0)
        hit = (version, torch.ops.quantized.linear_prepack(wq, None if bias is None else bias.detach().float()))
        if cache is not None:
            cache["onednn.fbgemm_q"] = hit
    op = torch.ops.quantized.linear_relu if relu else torch.ops.quantized.linear
    if _QUIET[0]:
        xt = torch._make_per_tensor_quantized_tensor(q, sx, zx)
    else:  # torch warns once per process about quantized tensors: keep it from users
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            xt = torch._make_per_tensor_quantized_tensor(q, sx, zx)
        _QUIET[0] = True
    flat = q.dim() == 2  # (M, K) needs no reshape: saves two dispatches at M = 1
    y = op(xt if flat else xt.reshape(-1, q.shape[-1]), hit[1], out.scale, out.zero_point).int_repr()
    y = y if flat else y.reshape(*q.shape[:-1], -1)
    return out.wrap(y if out.full_range else y.clamp_(out.qdtype.quant_min, out.qdtype.quant_max))
