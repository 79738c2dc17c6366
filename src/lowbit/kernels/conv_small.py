"""A static int8 conv with a small window (an image model's first conv) as one native pass, where oneDNN is slow.

oneDNN blocks its int8 convolutions over input channels, so a conv reading one to three channels spends most of each
block on padding: SmallCNN's ``1 → 16`` 3x3 conv at batch 64 took ~530 µs in oneDNN's call on the Zen 4 EPYC (1 thread)
for 7 M products, against ~220 µs for ``native.smallconv`` (every output pixel's window read as 4-byte quads from a
zero-point-padded copy of the image, four taps per ``vpdpbusd`` on VNNI, two per ``vpmaddwd`` on AVX2). The pass is
taken where the window's padded taps ``C_in · kh · roundup(kw, 4)`` are at most ``SMALL_TAPS`` for the body this CPU
runs. On VNNI (two pixels by 32 channels at a time) windows up to 64 taps measured 1.1-2.6x oneDNN's call (1 thread,
Zen 4, ``benchmarks/smallconv.py``: SmallCNN's 12 taps 2.3-2.6x, MobileNetV2's 3 → 32 stride-2 stem at 224², 36 taps,
1.3x at batch 8 and 1.5x at batch 1), one wide-output layer (3 → 64 at 112²) at par (0.89-1.04x). The AVX2 body (two
taps per ``vpmaddwd``, 16 channels by two pixels at a time), against oneDNN capped to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``;
the same codes every time): 1.3x its one call at 12 taps but 0.77x at the 36-tap stem (session 27, each tap pair one
4-byte read of the image widened to int16, on an AVX2-only Zen 3: 1.42x and 0.85x), and 2.1-3.0x its weight split
(two calls and an epilogue, which full-range weights take there: ``onednn.saturation_safe``), so without VNNI a
window takes it up to 16 taps, or up to ``SPLIT_TAPS`` where the weights would be split. Windows narrower than 3 taps are left to
oneDNN: a row of one or two taps is padded to a quad, so most of each ``vpdpbusd`` multiplies zero weights
(MobileNetV2's 16 → 96 1x1 expand at 112², 64 padded taps for 16 real ones, took 3.5 ms against oneDNN's 0.5).

The codes are lowbit's conv epilogue of the exact int32 sums (``native.smallconv``): those of the split-weight
conv and the native depthwise conv on a CPU without VNNI, and oneDNN's but at exact float ties (2 codes in 7.9 M
measured against oneDNN's depthwise call, where ``fl(y · inv) + z`` lands on a half).

>>> import torch, lowbit as Q
>>> from lowbit.kernels import ConvSpec, OutGrid, conv_small
>>> conv_small.taps((16, 1, 3, 3)), conv_small.taps((32, 3, 3, 3)), conv_small.taps((96, 16, 1, 1))
(12, 36, 64)
>>> w = Q.quantize_per_channel(torch.ones(96, 16, 1, 1), torch.full((96,), 0.01), torch.zeros(96, dtype=torch.long), 0,
...                            Q.qint8)
>>> conv_small.takes(w, ConvSpec(2, (1, 1), (0, 0), (1, 1), 1), OutGrid(0.1, 0, Q.quint8))   # a 1x1 conv: oneDNN's
False
"""

from __future__ import annotations

from typing import Any

import torch

from .. import native
from ..compile_state import tensor_version
from ..qtensor import QTensor
from .avx2 import _inv_scale, _relu_floor
from .spec import ConvSpec, OutGrid

__all__ = ["SMALL_TAPS", "SPLIT_TAPS", "taps", "takes", "conv", "prepared"]

# padded taps up to which the native pass runs, by the body the CPU runs (module docstring); SPLIT_TAPS for the AVX2
# body where the weights would take oneDNN's weight split
SMALL_TAPS = {"vnni": 64, "avx2": 16}
SPLIT_TAPS = 64


def taps(shape: tuple[int, ...] | torch.Size) -> int:
    """``C_in · kh · roundup(kw, 4)`` of a ``(C_out, C_in, kh, kw)`` weight: the taps ``native.smallconv`` reads."""
    _, cin, kh, kw = shape
    return int(cin * kh * -(-kw // 4) * 4)


def takes(weight: QTensor, spec: ConvSpec, out: OutGrid | None, split: bool = False) -> bool:
    """Whether ``conv`` runs this layer natively: a dense 2-d conv with a window at least 3 wide and at most ``SMALL_TAPS``
    taps for the body this CPU runs (``SPLIT_TAPS`` on AVX2 where ``split``: this CPU would split these weights), unit
    dilation along W, symmetric int8 weights, a u8 output grid, on a CPU with AVX2 and the native build."""
    w = weight.int_repr()
    body = native.smallconv_body()
    limit = SPLIT_TAPS if split and body == "avx2" else SMALL_TAPS.get(body, 0)
    return (out is not None and out.qdtype.storage == torch.uint8 and spec.dim == 2 and not spec.transposed
            and spec.groups == 1 and spec.dilation[1] == 1 and w.dim() == 4 and w.shape[3] >= 3 and w.dtype == torch.int8
            and w.is_cpu and taps(w.shape) <= limit and not bool(weight.zero_point.any()))


def _state(cache: dict[str, Any] | None, weight: QTensor, sx: float) -> tuple[Any, torch.Tensor]:
    """The packed weight (per weight version) and ``fl(s_x s_w)`` per output channel (per input scale), cached."""
    w = weight.int_repr()
    key = (w.data_ptr(), tensor_version(w), weight.scale.data_ptr(), tensor_version(weight.scale), sx)
    hit = cache.get("conv_small") if cache is not None else None
    if hit is not None and hit[0] == key:
        return hit[1]
    scale = (weight.scale.to(torch.float32) * sx).expand(w.shape[0]).contiguous()
    state = (native.smallconv_weight(w), scale)
    if cache is not None:
        cache["conv_small"] = (key, state)
    return state


def conv(q: torch.Tensor, sx: float, zx: int, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid,
         relu: bool, cache: dict[str, Any] | None) -> QTensor | None:
    """The conv of u8 codes ``q`` (scale ``sx``, zero point ``zx``) on ``out``'s grid as channels-last codes, for a layer
    ``takes`` accepts; ``None`` where the native pass declines the tensors (the caller's oneDNN route runs)."""
    packed, scale = _state(cache, weight, sx)
    codes = native.smallconv(q, zx, packed, list(spec.stride), list(spec.padding), list(spec.dilation), scale, bias,
                             _inv_scale(out.scale), out.zero_point, _relu_floor(out.qdtype.quant_min, out.zero_point, relu),
                             out.qdtype.quant_max)
    return None if codes is None else out.wrap(codes)


def prepared(weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid, relu: bool,
             cache: dict[str, Any] | None, sx: float, zx: int) -> Any:
    """``run(q)``: ``conv(q, sx, zx, weight, bias, spec, out, relu, cache)`` for u8 codes ``q`` with the input grid
    ``(sx, zx)`` and everything else fixed (``native.smallconv_prepared``: the same pass and codes, its arguments
    converted once), ``None`` where the pass declines ``q``; or ``None`` (no ``run``) where it would decline any."""
    packed, scale = _state(cache, weight, sx)
    call = native.smallconv_prepared(zx, packed, list(spec.stride), list(spec.padding), list(spec.dilation), scale, bias,
                                     _inv_scale(out.scale), out.zero_point,
                                     _relu_floor(out.qdtype.quant_min, out.zero_point, relu), out.qdtype.quant_max)
    if call is None:
        return None

    def run(q: torch.Tensor) -> QTensor | None:
        codes = call(q)
        return None if codes is None else out.wrap(codes)
    return run
