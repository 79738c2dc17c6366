"""A dense int8 conv with a small window (``C_in · kh · roundup(kw, 4)`` ≤ 64 padded taps: an image model's first conv)
in one native pass (``smallconv.c``), with the depthwise conv's requantizing epilogue.

``smallconv_weight`` packs an int8 weight ``(C_out, C_in, kh, kw)`` once; ``smallconv`` runs the conv on u8 codes of
any strides (an image's NCHW codes as the Quantize stub writes them, or channels-last) and returns channels-last u8
codes ``clamp(round(fl(clamp(fl(fl(fl(acc) · scale_c) + bias_c) · inv), lo - z, hi - z) + z)), 0, 255)`` of the exact
int32 sums ``acc = Σ (x - z_x) w`` (zero padding reads the zero point): ``dwconv``'s and the split-weight conv's
codes (``conv_epilogue``).

>>> import torch
>>> from lowbit import native
>>> packed = native.smallconv_weight(torch.ones(16, 1, 3, 3, dtype=torch.int8))
>>> q = torch.full((1, 1, 4, 4), 12, dtype=torch.uint8)          # codes 12 on zero point 10: value 2 per tap
>>> y = native.smallconv(q, 10, packed, [1, 1], [0, 0], [1, 1], torch.full((16,), 1.0), None, 1.0, 0, 0, 255)
>>> y is None or (tuple(y.shape), y[0, 0].flatten().tolist()) == ((1, 16, 2, 2), [18, 18, 18, 18])
True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _channel_vectors, _check_conv, conv_out_hw, _check_grid, _lib, _local, _threads, counts

__all__ = ["MAX_TAPS", "SmallConvWeight", "smallconv_weight", "smallconv", "smallconv_prepared", "smallconv_body"]

MAX_TAPS = 64  # smallconv.c's SC_MAX_TAPS: C_in kh kw rounded up to 4


class SmallConvWeight(NamedTuple):
    """``smallconv.c``'s packs of one int8 weight (its file comment): taps ``(c, i, k)`` in quads (``w4``) and pairs
    (``w2``), output channels padded to ``cp`` (a multiple of 16) with zero weights, and ``wsum`` per channel."""

    w4: torch.Tensor
    w2: torch.Tensor
    wsum: torch.Tensor
    shape: tuple[int, int, int, int]
    cp: int


def smallconv_weight(w: torch.Tensor) -> SmallConvWeight:
    """Pack an int8 conv weight ``(C_out, C_in, kh, kw)`` whose window has at most ``MAX_TAPS`` taps."""
    if w.dtype != torch.int8 or w.dim() != 4 or w.numel() == 0:
        raise ValueError(f"lowbit.native.smallconv_weight: a non-empty int8 weight (C_out, C_in, kh, kw) is needed, got "
                         f"{w.dtype} of shape {tuple(w.shape)}")
    cout, cin, kh, kw = w.shape
    kwp, cp = -(-kw // 4) * 4, -(-cout // 16) * 16
    kp = cin * kh * kwp
    if kp > MAX_TAPS:
        raise ValueError(f"lowbit.native.smallconv_weight: C_in * kh * kw = {cin} * {kh} * {kw} is more than {MAX_TAPS} "
                         "taps with each window row padded to a multiple of 4")
    flat = torch.zeros(cp, cin, kh, kwp, dtype=torch.int8)
    flat[:cout, :, :, :kw] = w
    flat = flat.reshape(cp, kp)
    w4 = flat.reshape(cp, kp // 4, 4).transpose(0, 1).contiguous()
    w2 = flat.to(torch.int16).reshape(cp, kp // 2, 2).transpose(0, 1).contiguous()
    wsum = flat.to(torch.int32).sum(1, dtype=torch.int32).contiguous()
    return SmallConvWeight(w4, w2, wsum, (int(cout), int(cin), int(kh), int(kw)), cp)


def smallconv_body() -> str:
    """The C body ``smallconv`` runs on this CPU (pinning in tests aside): ``"vnni"`` (AVX-512 VNNI and BW),
    ``"avx2"``, ``"scalar"``, or ``""`` without the native build."""
    lib = _lib()
    return "" if lib is None else ("scalar", "avx2", "vnni")[lib.lb_smallconv_body(1)]


def _padded(v: torch.Tensor | None, cp: int) -> torch.Tensor | None:
    return v if v is None or v.numel() == cp else torch.cat([v, v.new_zeros(cp - v.numel())])


def smallconv(q: torch.Tensor, zx: int, packed: SmallConvWeight, stride: list[int], padding: list[int],
              dilation: list[int], scale: torch.Tensor, bias: torch.Tensor | None, inv: float, zero_point: int, lo: int,
              hi: int) -> torch.Tensor | None:
    """The conv of u8 codes ``q`` ``(N, C_in, H, W)`` (any strides) on input zero point ``zx`` with the packed weight:
    ``(N, C_out, OH, OW)`` channels-last u8 codes (module docstring; ``scale`` = ``fl(s_x s_w)`` and ``bias`` per output
    channel, ``inv`` = 1 / s_out, codes clamped to ``[lo, hi]``); ``None`` where the tensors do not fit."""
    run = smallconv_prepared(zx, packed, stride, padding, dilation, scale, bias, inv, zero_point, lo, hi)
    return None if run is None else run(q)


def smallconv_prepared(zx: int, packed: SmallConvWeight, stride: list[int], padding: list[int], dilation: list[int],
                       scale: torch.Tensor, bias: torch.Tensor | None, inv: float, zero_point: int, lo: int,
                       hi: int) -> Any:
    """``smallconv`` with every argument but the codes fixed: ``run(q)`` is ``smallconv(q, zx, packed, ...)`` (the same
    pass on the same numbers, so the same codes and tally), its argument checks and conversions made here once, and
    per call only what depends on ``q`` (dtype, rank, device, channels, the output size) and the thread's switches
    (``disabled``, the pinned body, the thread count). ``None`` where ``smallconv`` would decline every input (the
    scale or bias vectors do not fit, a dilated row); bad values raise as ``smallconv`` raises them. Saves the ~8 µs of
    Python ``smallconv`` spends on each call (the first conv's lane: ``kernels.conv_plan``).

    >>> import torch
    >>> packed = smallconv_weight(torch.ones(16, 1, 3, 3, dtype=torch.int8))
    >>> run = smallconv_prepared(10, packed, [1, 1], [0, 0], [1, 1], torch.full((16,), 1.0), None, 1.0, 0, 0, 255)
    >>> y = run(torch.full((1, 1, 4, 4), 12, dtype=torch.uint8))
    >>> y is None or y[0, 0].flatten().tolist() == [18, 18, 18, 18]
    True
    """
    _check_grid("smallconv", zero_point, lo, hi, inv=inv)
    _check_conv("smallconv", zx, stride, padding, dilation)
    cout, cin, kh, kw = packed.shape
    if not _channel_vectors(cout, scale, bias) or dilation[1] != 1:
        return None
    sc, b = _padded(scale, packed.cp), _padded(bias, packed.cp)
    vlo = float(lo - zero_point) if lo > 0 else -float("inf")
    vhi = float(hi - zero_point) if hi < 255 else float("inf")
    sy, sx_, py, px, dy, dx = stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1]
    fixed = (packed.w4.data_ptr(), packed.w2.data_ptr(), packed.wsum.data_ptr(), cout, packed.cp, kh, kw, sy, sx_, py,
             px, dy, dx, zx)
    tail = (sc.data_ptr(), None if b is None else b.data_ptr(), inv, float(zero_point), vlo, vhi)
    sizes: dict[tuple[int, int], tuple[int, int]] = {}
    held = (packed, sc, b)  # (the pointers above stay valid while run lives)

    def run(q: torch.Tensor) -> torch.Tensor | None:
        lib = _lib()
        if lib is None or q.dtype != torch.uint8 or q.dim() != 4 or not q.is_cpu or q.shape[1] != cin:
            return None
        n, _, h, w = q.shape
        hw = sizes.get((h, w))
        if hw is None:
            if len(sizes) >= 16:
                sizes.clear()
            hw = sizes[(h, w)] = conv_out_hw(h, w, (kh, kw), stride, padding, dilation)
        oh, ow = hw
        if oh <= 0 or ow <= 0 or n == 0:
            return None
        out = torch.empty((n, oh, ow, cout), dtype=torch.uint8)
        if lib.lb_smallconv(q.data_ptr(), n, cin, h, w, *q.stride(), *fixed, oh, ow, *tail, out.data_ptr(),
                            _threads(n * oh * ow * cout * kh * kw * cin), _local.__dict__.get("isa", 1)) != 0:
            return None  # (no memory for the padded images)
        counts["smallconv"] += 1
        return out.permute(0, 3, 1, 2)
    run.held = held  # type: ignore[attr-defined]
    return run
