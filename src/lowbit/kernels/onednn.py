"""oneDNN backend (x86 CPU): prepacked s8 weights, u8 activations, int32 accumulation, fused epilogue.

One call per layer: ``torch.ops.onednn.qlinear_pointwise`` / ``qconv_pointwise`` compute::

    acc[m, n] = Σ_k (q_x[m, k] - z_x) · q_w[n, k]                   # int32, u8 × s8 (VNNI)
    y[m, n]   = acc · s_x · s_w[n] + bias[n]   (→ relu)              # fused epilogue
    q_y       = clamp(round(y / s_out) + z_out)                     # fused requantization (or y)

Weights are packed once (``qlinear_prepack`` / ``qconv_prepack``) into the caller's ``cache`` and
repacked only when the weight tensor changes (its ``data_ptr``/``_version``). qint8 activations
are shifted to u8 (``q + 128``, ``z + 128``): oneDNN's s8-source path is its slow reference kernel.

Declines (returns ``NotImplemented``, the dispatcher falls back): non-CPU tensors, weight zero
points other than 0 (oneDNN ignores them) and empty inputs. A transposed conv runs as one ordinary conv on the
same codes (``conv_transpose``: its stride phases stacked as output channels).

Saturation on CPUs **without VNNI/AMX**: they multiply with ``vpmaddubsw``, which adds two u8·s8
products into a *saturating* int16, so one call is exact only when ``255 · (w_a + w_b)`` fits int16
for every pair of same-sign weights of a channel (``saturation_safe``; 7-bit weights always are).
For other weights the linear splits the activations into two 7-bit halves (``avx2._split_run``: stacked
along dim 0 into one exact kernel call on twice the rows, about as fast as fp32 there) and the conv
splits its weights, once (``_wsplit_conv``: one call on the unmodified codes, no staging), unless the
activations are already 7-bit (a ``reduce_range`` grid such as ``quint8.with_range(0, 127)``): then
one call is exact for every int8 weight. ``torch._int_mm`` is no alternative on such CPUs: without
VNNI it runs a scalar loop, ~30x slower than fp32. VNNI/AMX CPUs (``vpdpbusd``,
32-bit accumulation) are exact for every int8 weight in one call.

Small M without VNNI: oneDNN's AVX2 int8 GEMM (``gemm:jit``) is slower than fp32 at M = 1, while
fbgemm's is 2-5x faster there (``benchmarks/README.md``). For at most ``SMALL_M`` rows on such CPUs the
linear runs fbgemm's float-output op (``lowbit.kernels.avx2``; weights prepacked once with unit
scales, same exactness rules, same split) when torch's quantized engine is fbgemm/x86; it is counted as this backend.
A u8 output with no split takes fbgemm's requantized codes at every M there (``small_m.native_requant``: lowbit.native's
kernels, 1.1-1.3x fbgemm's packed GEMM at M ≥ 2 on the AVX2 EPYC, or fbgemm's ``quantized::linear`` itself).

>>> from lowbit.kernels import onednn
>>> isinstance(onednn.has_vnni(), bool)
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import native
from ..compile_state import tensor_version
from ..functional import _store
from ..qtensor import QTensor
from . import conv_small, conv_transpose, int_mm, small_m
from .avx2 import _exact_linear, _fbgemm_linear, _fbgemm_pack, _fbgemm_requant, _inv_scale, _relu_floor, _scaled, _split_run
from .isa import (available, cpu_has_vnni, fbgemm_engine, has_amx, has_vnni, isa_capped,  # noqa: F401 (re-exported)
                  saturation_safe, shares_routes)
from .conv_split import (SHAPED_PACKS, _pack_wsplit, _wsplit_conv, _wsplit_packs, packed_for_input,  # noqa: F401 (tests,
                         gemm_conv)  # conv_plan)
from .small_m import VNNI_M, float_route, native_linear, native_requant, split_on_avx2, vnni_rows  # noqa: F401 (VNNI_M: tests)
from .spec import (MULTIPLIER_CHUNK, ConvSpec, OutGrid, odd_windows, one_column, pad_codes, strided_column, unpadded,
                   wide_multiplier)

__all__ = ["NAME", "SMALL_M", "available", "has_vnni", "cpu_has_vnni", "isa_capped", "saturation_safe", "linear",
           "conv", "fbgemm_engine"]

NAME = "onednn"
SMALL_M = 32  # rows up to which fbgemm's int8 GEMM beats oneDNN's on CPUs without VNNI (benchmarks/README.md)


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
    ``saturation_safe``). ``pack=None``: ``(None, needs_split)``, for a caller whose route may never use the
    pack (``conv``: it packs on first use and stores the pack in the entry).
    """
    w = weight.int_repr()
    version = (w.data_ptr(), tensor_version(w), w.device)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] == version:
        return hit[1]
    ok = w.device.type == "cpu" and w.dtype == torch.int8 and available() and not bool(weight.zero_point.any())
    packed = (None if pack is None else pack(w), not (has_vnni() or saturation_safe(w))) if ok else None
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
    # a VNNI CPU takes the routes without VNNI below for few rows (their codes and floats, small_m.vnni_rows)
    nat_v = (vnni and q.numel() <= vnni_rows(q.shape[-1], weight.shape[0]) * q.shape[-1] and fbgemm_engine()
             and shares_routes())
    if nat_v:
        vnni = False
    if vnni and q.numel() == q.shape[-1] > 1:  # one row: torch._int_mm's GEMV (no pack needed, 3-5x faster)
        y = _gemv(q, x, weight, bias, out, relu, cache)
        if y is not NotImplemented:
            return y
    entry = _packed(cache, "onednn.linear", weight, _pack_linear)
    if entry is None:
        return NotImplemented
    packed, split = entry
    split_o = split  # (this CPU's own need, for oneDNN's call at the end)
    if nat_v:  # choose as a CPU without VNNI would, so that both give the same results
        split = split_on_avx2(weight.int_repr(), cache)
    if vnni and q.dtype == torch.uint8:  # the common case, straight to the op: one exact call
        s_out, z_out, dt = _epilogue(out)
        post, scalars, clamp = ("relu" if relu else "none", [], False) if out is None else out.onednn_post(relu)
        y = torch.ops.onednn.qlinear_pointwise(q, x.scale.item(), x.zero_point.item(), packed, weight.scale,
                                               weight.zero_point, bias, s_out, z_out, dt, post, scalars, "")
        if out is None:
            return y
        return out.wrap(y.clamp_(out.qdtype.quant_min, out.qdtype.quant_max) if clamp else y)  # (as the plan's call)
    q, sx, zx, seven_bit = _as_u8(x)
    if (not vnni and fbgemm_engine() and out is not None and out.qdtype.storage == torch.uint8 and not (split and not seven_bit)
            and small_m.requant_fits(weight.int_repr(), weight.scale, bias, sx, out, cache)):
        # a u8 output with no split: fbgemm's requantized codes at every M (lowbit.native's kernels, or fbgemm's op)
        y = native_requant(q, sx, zx, weight.int_repr(), weight.scale, bias, out, relu, cache)
        return y if y is not None else _fbgemm_requant(cache, weight, bias, q, sx, zx, out, relu)
    halves = split and not seven_bit
    if not vnni and fbgemm_engine() and (q.numel() <= SMALL_M * q.shape[-1] or float_route(out)):
        # the float epilogue fl(fl(acc) · fl(s_x s_w)), acc exact: lowbit.native's one call, else fbgemm's split or
        # float64 (the same floats)
        y = native_linear(q, sx, zx, weight.int_repr(), weight.scale, halves, bias, out, relu, cache)
        if y is not None:
            return y
        fb = _packed(cache, "onednn.fbgemm", weight, _fbgemm_pack)
        if fb is not None:
            return fallback_linear(lambda: fb[0], q, sx, zx, weight.int_repr(), weight.scale, halves and split_o,
                                   bias, out, relu, cache)

    def run(codes: torch.Tensor, zp: int, b: torch.Tensor | None, s_out: float, z_out: int, dt: torch.dtype,
            post: str) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(codes, sx, zp, packed, weight.scale, weight.zero_point, b, s_out,
                                                  z_out, dt, post, [], "")

    if split_o and not seven_bit:
        return _split_run(run, q, zx, bias, out, relu, -1)
    s_out, z_out, dt = _epilogue(out)
    return _wrap(run(q, zx, bias, s_out, z_out, dt, "relu" if relu else "none"), out)


def fallback_linear(pack: Callable[[], Any], q: torch.Tensor, sx: float, zx: int, w: torch.Tensor,
                    w_scale: torch.Tensor, split: bool, bias: torch.Tensor | None, out: OutGrid | None, relu: bool,
                    cache: dict[str, Any] | None) -> QTensor | torch.Tensor:
    """``native_linear``'s codes or floats without it: fbgemm's float-output op (``_fbgemm_linear`` on ``pack()``, the
    7-bit split where ``split``) while its sums are exact floats, else the exact sums in float64 (``_exact_linear``:
    slow, for a missing native build or sums past int32). Both are ``fl(acc)``, so every M and both builds give the
    same floats."""
    if (split and not small_m.split_exact(w, cache)) or not small_m.int32_exact(w, cache):
        return _exact_linear(q, sx, zx, w, w_scale, bias, out, relu, cache)
    return _fbgemm_linear(pack(), q, sx, zx, split, w_scale, bias, out, relu, cache)


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
    acc = int_mm.cpu_int_mm(q if q.dim() == 2 else q.reshape(1, -1), w_t, w_sum)
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


def conv(x: QTensor, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid | None,
         relu: bool = False, cache: dict[str, Any] | None = None) -> Any:
    """N-d int8 convolution through ``onednn::qconv_pointwise`` (channels-last output)."""
    if x.device.type != "cpu" or x.numel() == 0 or x.int_repr().element_size() != 1:
        return NotImplemented
    if spec.transposed:  # its stride phases as one ordinary conv on the same codes (conv_transpose's docstring)
        if bool(weight.zero_point.any()) or not available():
            return NotImplemented
        rewritten = conv_transpose.as_conv(x, weight, bias, spec, cache)
        if rewritten is None:
            return NotImplemented
        xc, wc, bc, spec_c, inner, shuffle = rewritten
        y = conv(xc, wc, bc, spec_c, out, relu, inner)
        if y is NotImplemented:
            return NotImplemented
        return shuffle(y) if out is None else out.wrap(shuffle(y.int_repr()))
    if wide_multiplier(weight.shape, spec, has_amx()):  # oneDNN's wrong sums there: at most 32 channels a group a call
        return _chunked(x, weight, bias, spec, out, relu, cache)
    if odd_windows(x.shape, weight.shape, spec):  # oneDNN's crash or wrong sums there: the zero-point padding made here
        return conv(pad_codes(x, spec), weight, bias, unpadded(spec), out, relu, cache)
    if strided_column(x.shape, weight.shape, spec):  # oneDNN's wrong sums there: the one window read with stride 1
        xc, spec_c = one_column(x, weight.shape, spec)
        return conv(xc, weight, bias, spec_c, out, relu, cache)
    stride, padding, dilation = _geometry(spec)

    def pack(w: torch.Tensor, zx: int, shape: list[int] | None) -> torch.Tensor:
        # x_scale / x_zp given to prepack do not enter the sums; the input's shape and whether z_x is non-zero choose
        # the layout oneDNN's call wants (packed for another, every call reorders the weight: conv_plan's docstring)
        return torch.ops.onednn.qconv_prepack(w, weight.scale, 1.0, zx, stride, padding, dilation, spec.groups, shape)

    entry = _packed(cache, "onednn.conv", weight, None)  # the pack deferred: the weight split never reads it
    if entry is None:
        return NotImplemented
    split = entry[1]
    q, sx, zx, seven_bit = _as_u8(x)
    # a first conv's small window: one native pass (where this CPU would split, the split's route is the bar)
    if out is not None and conv_small.takes(weight, spec, out, split and not seven_bit):
        small = conv_small.conv(q, sx, zx, weight, bias, spec, out, relu, cache)
        if small is not None:
            return small
    if split and not seven_bit and WSPLIT_CONV:
        y = gemm_conv(q, sx, zx, weight, bias, spec, out, relu, cache)  # (one group: the any-code Linear kernel)
        if y is not None:
            return y
        halves = _packed(cache, "onednn.conv_wsplit", weight, functools.partial(
            _pack_wsplit, geometry=(stride, padding, dilation), groups=spec.groups))
        if halves is not None and halves[0] is not None:
            if (out is not None and spec.dim == 2 and spec.groups == q.shape[1] == weight.shape[0] and weight.shape[1] == 1
                    and out.qdtype.storage == torch.uint8):  # depthwise: one native pass, the same codes
                codes = _native_dw(q, zx, sx, weight, bias, (stride, padding, dilation), out, relu, cache)
                if codes is not None:
                    return codes
            return _wsplit_conv(halves[0], q, sx, zx, weight, bias, spec.groups, (stride, padding, dilation), out,
                                relu, cache)
    shaped = entry[0]
    if shaped is None:  # first call on this weight version that needs the unsplit pack: packs per input, made on use
        shaped = {}
        kept = None if cache is None else cache.get("onednn.conv")
        if kept is not None and kept[1] is entry:  # (not cleared or replaced since: a load_state_dict in another thread)
            cache["onednn.conv"] = (kept[0], (shaped, split))
    packed = packed_for_input(shaped, q, zx, lambda z, shape: pack(weight.int_repr(), z, shape))

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


def _chunked(x: QTensor, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid | None, relu: bool,
             cache: dict[str, Any] | None) -> Any:
    """A ``wide_multiplier`` conv as calls on at most ``MULTIPLIER_CHUNK`` output channels a group (each group's
    channels ``[j, j + 32)``, weights, scales, zero points and bias sliced once per weight version), concatenated back
    per group: the same sums and epilogue per channel."""
    w, g = weight.int_repr(), spec.groups
    m = w.shape[0] // g
    key = (w.data_ptr(), tensor_version(w), weight.scale.data_ptr(), tensor_version(weight.scale),
           None if bias is None else (bias.data_ptr(), tensor_version(bias)))
    hit = None if cache is None else cache.get("onednn.chunks")
    if hit is None or hit[0] != key:
        def part(t: torch.Tensor, j: int) -> torch.Tensor:
            return t.reshape(g, m, *t.shape[1:])[:, j:j + MULTIPLIER_CHUNK].reshape(-1, *t.shape[1:]).contiguous()
        parts = [(QTensor(part(w, j), part(weight.scale.reshape(-1).expand(w.shape[0]), j),
                          part(weight.zero_point.reshape(-1).expand(w.shape[0]), j), weight.qdtype, 0),
                  None if bias is None else part(bias, j), {}) for j in range(0, m, MULTIPLIER_CHUNK)]
        hit = (key, parts, (weight, bias))  # (holds them: no address reuse)
        if cache is not None:
            cache["onednn.chunks"] = hit
    ys = []
    for wj, bj, cj in hit[1]:
        y = conv(x, wj, bj, spec, out, relu, cj)
        if y is NotImplemented:
            return NotImplemented
        y = y if out is None else y.int_repr()
        ys.append(y.reshape(y.shape[0], g, -1, *y.shape[2:]))
    y = torch.cat(ys, 2).flatten(1, 2)
    return y if out is None else out.wrap(y)


def _native_dw(q: torch.Tensor, zx: int, sx: float, weight: QTensor, bias: torch.Tensor | None,
               geometry: tuple[list[int], list[int], list[int]], out: OutGrid, relu: bool,
               cache: dict[str, Any] | None) -> QTensor | None:
    """The split-weight depthwise conv (``_wsplit_conv``: two oneDNN calls and the epilogue) as ``native.dwconv``: the
    same exact sums (int32 instead of two float32 halves, ``fl(acc)`` either way) and epilogue, so the same codes."""
    if not native.available():
        return None
    taps = _packed(cache, "native.dw", weight, lambda w: native.dw_weight(w))
    if taps is None:
        return None
    stride, padding, dilation = geometry
    codes = native.dwconv(q, zx, taps[0], stride, padding, dilation, _scaled(weight.scale, sx, cache), bias,
                          _inv_scale(out.scale), out.zero_point, _relu_floor(out.qdtype.quant_min, out.zero_point, relu),
                          out.qdtype.quant_max)
    return None if codes is None else out.wrap(codes)


WSPLIT_CONV = True  # split the weights (one call on the codes) rather than the activations; see ``_wsplit_conv``


@functools.lru_cache(maxsize=256)
def _geometry(spec: ConvSpec) -> tuple[list[int], list[int], list[int]]:
    """``(stride, padding, dilation)`` lists of a (frozen, hashable) ``ConvSpec``, built once per geometry.
    The lists are passed to the oneDNN ops only, which do not mutate them."""
    return list(spec.stride), list(spec.padding), list(spec.dilation)
