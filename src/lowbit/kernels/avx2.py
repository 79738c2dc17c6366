"""Exact int8 on CPUs without VNNI: the 7-bit split in one kernel call, its float epilogue, fbgemm for few rows.

Without VNNI, oneDNN and fbgemm multiply u8 × s8 with ``vpmaddubsw``, which adds two products into a
*saturating* int16. ``_split_run`` makes 8-bit codes exact for any int8 weight::

    q - z = 2 (q_hi - z_hi) + (q_lo - z_lo),   q_hi = q >> 1,  q_lo = q & 1
    both halves on one zero point c = max(z_hi, z_lo): codes in [0, 128], stacked along dim 0
    one kernel call on the stack  →  y = lo + 2·hi  →  + bias, ReLU, requantized (or float)

(``128 · 254 ≤ 32767`` and ``128 · -256 = -32768``: no pair saturates). The float epilogue is the
same float32 operations as two separate calls would need, the requantizing add, round, clamp and 8-bit
store in one pass (``lowbit.qstore``). For at most ``onednn.SMALL_M`` rows the linear runs fbgemm's
float-output op (``_fbgemm_linear``, split the same way) or, for a u8 output on 7-bit codes or
saturation-safe weights, one fbgemm call with fused requantization (``_fbgemm_requant``). Static convs
split their *weights* instead, once (``weight_halves``, ``stack_halves``: ``q_w = 2 (q_w >> 1) + (q_w & 1)``;
``combine_stacked`` and ``_acc_epilogue`` finish ``conv_split._wsplit_conv``'s raw sums). The dispatch between
these paths lives in ``onednn.linear`` / ``onednn.conv``.

>>> st, c = _halves(torch.tensor([[255, 6]], dtype=torch.uint8), 3)
>>> st.tolist(), c
([[127, 3], [1, 0]], 1)
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from typing import Any

import torch

from .. import qstore
from ..compile_state import tensor_version
from ..qtensor import QTensor
from .spec import OutGrid

@functools.lru_cache(maxsize=256)
def _inv_scale(scale: float) -> float:
    """``float32(1 / float32(scale))`` as a Python float (``torch.reciprocal`` in float32)."""
    return float(torch.tensor(scale, dtype=torch.float32).reciprocal())


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
    # (whole-tensor passes: with the one-pass store they beat L2-sized row blocks 1.04-2x at 98K-2M outputs)
    return _float_epilogue(acc[n:].add_(acc[:n], alpha=2), bias, out, relu, channel_dim)  # 2·hi is exact


_F32_EXACT = 1 << 24  # integers below this magnitude are exact in float32


def weight_halves(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``q_w = 2 (q_w >> 1) + (q_w & 1)``: the two 7-bit halves ``(hi, lo)`` of int8 weights (output channels on dim 0).

    ``hi`` in ``[-64, 63]`` and ``lo`` in ``{0, 1}``: any u8 × half pair is exact through ``vpmaddubsw``
    (``255 · 126 ≤ 32767``, ``255 · -128 ≥ -32768``). ``None`` unless every half's sum is an exact float32 integer
    for any u8 codes and zero point: ``255 · Σ_k |hi| < 2²⁴`` per channel (``|q - z| ≤ 255``; ``Σ |lo|`` is
    smaller); then ``fl(lo + 2·hi) = fl(acc)``, the exact accumulator rounded once (exact while ``|acc| < 2²⁴``).

    >>> [t.tolist() for t in weight_halves(torch.tensor([[127, -128, 3]], dtype=torch.int8))]
    [[[63, -64, 1]], [[1, 0, 1]]]
    """
    hi, lo = torch.bitwise_right_shift(w, 1), torch.bitwise_and(w, 1)
    if 255 * int(hi.reshape(hi.shape[0], -1).abs().sum(1, dtype=torch.int64).max()) >= _F32_EXACT:
        return None
    return hi, lo


def stack_halves(hi: torch.Tensor, lo: torch.Tensor, groups: int) -> torch.Tensor:
    """``hi`` and ``lo`` stacked along dim 0 per group: channel ``c`` of group ``j`` (``m = C_out / groups`` a group)
    at ``2 m j + c`` (``hi``) and ``2 m j + m + c`` (``lo``), so a conv with the same ``groups`` on ``2 C_out``
    channels computes both halves of every channel from that group's inputs (``groups = 1``: ``[hi; lo]``)."""
    m = hi.shape[0] // groups
    return torch.stack([hi.reshape(groups, m, *hi.shape[1:]), lo.reshape(groups, m, *hi.shape[1:])], 1
                       ).reshape(2 * hi.shape[0], *hi.shape[1:])


def combine_stacked(y: torch.Tensor, groups: int, scratch: bool) -> torch.Tensor:
    """``fl(lo + 2·hi)`` from a conv's float32 sums ``(N, 2 C, *spatial)`` on ``stack_halves`` channels, as
    ``(N, C, *spatial)`` with the channels innermost in memory (channels-last, as oneDNN wrote ``y``).
    ``scratch``: written into this thread's reused buffer (``_scratch``), for a result that does not leave."""
    yl = y.movedim(1, -1)
    if not yl.is_contiguous():
        yl = yl.contiguous()
    lead, c = yl.shape[:-1], yl.shape[-1] // 2
    v = yl.view(*lead, groups, 2, c // groups)
    shape = (*lead, groups, c // groups)
    acc = _scratch(shape) if scratch else torch.empty(shape, dtype=torch.float32)
    torch.add(v[..., 1, :], v[..., 0, :], alpha=2, out=acc)  # 2·hi exact: one rounding of the exact sum
    return acc.view(*lead, c).movedim(-1, 1)


_SCRATCH = threading.local()


def _scratch(shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 ``shape`` view of this thread's scratch buffer (grown to the largest request, then kept).

    A float32 conv output of more than 32 MiB is a fresh ``mmap`` per call (glibc's largest mmap threshold), and
    writing it page-faults: ~5x the time of the same pass into reused memory (8×96×112² on the AVX2 EPYC)."""
    n = math.prod(shape)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
            buf = _SCRATCH.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n].view(shape)


def _acc_epilogue(acc: torch.Tensor, w_scale: torch.Tensor, sx: float, bias: torch.Tensor | None,
                  out: OutGrid | None, relu: bool, cache: dict[str, Any] | None) -> QTensor | torch.Tensor:
    """``fl(acc) · fl(s_x s_w) + bias`` (→ ReLU), requantized onto ``out`` or float (``_float_epilogue``), for a
    conv's float32 accumulator ``acc`` ``(N, C, *spatial)`` (overwritten)."""
    scale = _scaled(w_scale, sx, cache)
    return _float_epilogue(acc.mul_(scale.view(1, -1, *[1] * (acc.dim() - 2))), bias, out, relu, 1)


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
    if out is None:
        return y.relu_() if relu else y
    # bit-identical to functional.quantize: round(fl(y · float32(1/s)) + z), clamped (ReLU: _relu_floor); the add,
    # round, clamp and 8-bit store in one pass (lowbit.qstore)
    inv, _ = _out_consts(out.scale, out.zero_point)
    qd = out.qdtype
    return out.wrap_store(qstore.codes(y.mul_(inv), out.zero_point, _relu_floor(qd.quant_min, out.zero_point, relu),
                                       qd.quant_max, qd.storage, native=True))


def _relu_floor(qmin: int, zero_point: int, relu: bool) -> int:
    """The clamp's lower bound that applies a ReLU before requantization, bit for bit: with ``z`` on the grid,
    ``y < 0`` gives ``round(fl(fl(y·inv) + z)) ≤ z`` where ``relu(y) = 0`` gives exactly ``z``, and ``y ≥ 0`` gives
    ``≥ z`` either way, so ``clamp(q(relu(y)), qmin, qmax) = clamp(q(y), max(qmin, z), qmax)``: one pass less."""
    return max(qmin, zero_point) if relu else qmin


@functools.lru_cache(maxsize=256)
def _out_consts(scale: float, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``float32(1 / float32(scale))`` and ``float32(zero_point)`` as 0-d tensors (``_const``)."""
    return _const(_inv_scale(scale), torch.float32), _const(float(zero_point), torch.float32)


_QUIET = [False]  # set once the first quantized tensor was made (torch warns only once)


def direct(op: Any) -> Any:
    """The C++ entry of a ``torch.ops`` operator's default overload: the same kernel, without
    ``OpOverloadPacket.__call__``'s Python scan of every argument for torchbind fakes, which runs on each
    call of an op that takes a torchbind object (fbgemm's packed weights: ~2-4 µs per call on the AVX2 EPYC).
    The scan matters only while ``torch.export`` traces with fake script objects; the eager paths that use
    this never run while tracing. ``op`` itself where torch has no such entry."""
    return getattr(getattr(op, "default", None), "_op", op)


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
    op = fbgemm_ops()[0]
    lead, k = q.shape[:-1], q.shape[-1]
    q2 = q if q.dim() == 2 else q.reshape(-1, k)
    if split:  # both 7-bit halves in one call (``_halves``): float ``q_half - z_half`` on the shared zero point
        m, z_hi, z_lo = q2.shape[0], zx >> 1, zx & 1
        shifts, masks, zps = _split_consts(z_hi, z_lo)
        # (2, m, k): [q >> 1, q & 1] in three broadcast ops, then float32 q_half - z_half (exact small integers)
        st = torch.sub(torch.bitwise_right_shift(q2, shifts).bitwise_and_(masks), zps)
        hi, lo = op(st.reshape(2 * m, k), 1.0, max(z_hi, z_lo), packed).split(m)  # (a copy for transposed codes)
        y = lo.add_(hi, alpha=2)
    else:
        y = op(q2.float().sub_(_const(float(zx), torch.float32)), 1.0, zx, packed)
    y = y.mul_(_scaled(w_scale, sx, cache))
    return _float_epilogue(y if q.dim() == 2 else y.reshape(*lead, -1), bias, out, relu, -1)


def _exact_linear(q: torch.Tensor, sx: float, zx: int, w: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out: OutGrid | None, relu: bool,
                  cache: dict[str, Any] | None = None) -> QTensor | torch.Tensor:
    """``_fbgemm_linear``'s float epilogue on the exact sums ``acc = Σ (q - z) q_w`` taken in float64 (every product
    and partial sum an exact integer below 2⁵³), rounded once: ``fl(acc)``, what int32 kernels give, at any K. A slow
    fallback (a float64 GEMM and a float64 copy of the weights per call) for sums that float32 or int32 cannot hold.

    >>> _exact_linear(torch.tensor([[255, 0]], dtype=torch.uint8), 1.0, 0, torch.tensor([[-128, 1]], dtype=torch.int8),
    ...               torch.tensor([1.0]), None, None, False).tolist()
    [[-32640.0]]
    """
    lead, k = q.shape[:-1], q.shape[-1]
    acc = torch.matmul(q.reshape(-1, k).double().sub_(zx), w.double().t()).float()
    y = acc.mul_(_scaled(w_scale, sx, cache))
    return _float_epilogue(y if q.dim() == 2 else y.reshape(*lead, -1), bias, out, relu, -1)


@functools.lru_cache(maxsize=512)
def _split_consts(z_hi: int, z_lo: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(2, 1, 1)`` operands that make both halves of ``(m, k)`` u8 codes in one broadcast op each: shifts
    ``[1, 0]`` and masks ``[255, 1]`` (uint8), zero points ``[z_hi, z_lo]`` (float32); made once per grid."""
    with torch.inference_mode(False):
        return (torch.tensor([1, 0], dtype=torch.uint8).view(2, 1, 1), torch.tensor([255, 1], dtype=torch.uint8).view(2, 1, 1),
                torch.tensor([float(z_hi), float(z_lo)]).view(2, 1, 1))


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
    op = fbgemm_ops()[2 if relu else 1]
    if _QUIET[0]:
        xt = torch._make_per_tensor_quantized_tensor(q, sx, zx)
    else:  # torch warns once per process about quantized tensors: keep it from users
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            xt = torch._make_per_tensor_quantized_tensor(q, sx, zx)
        _QUIET[0] = True
    flat = q.dim() == 2  # (M, K) needs no reshape: saves two dispatches at M = 1
    y = qstore.plain(op(xt if flat else xt.reshape(-1, q.shape[-1]), hit[1], out.scale, out.zero_point), torch.uint8)
    y = y if flat else y.reshape(*q.shape[:-1], -1)
    return out.wrap(y if out.full_range else y.clamp_(out.qdtype.quant_min, out.qdtype.quant_max))


@functools.lru_cache(maxsize=None)
def fbgemm_ops() -> tuple[Any, Any, Any]:
    """fbgemm's float-output, requantizing and requantizing-ReLU linear ops through their C++ entries
    (``direct``), looked up on first use (a torch without them never gets here: the callers check the engine)."""
    q = torch.ops.quantized
    return direct(q.linear_with_input_q_dq_qweight_dq_output_fp32), direct(q.linear), direct(q.linear_relu)
