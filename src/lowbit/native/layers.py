"""Conv passes without VNNI: the split-weight conv epilogue and a whole depthwise conv (``gemm``: the Linears);
max pooling of channels-last codes on every CPU.

On a CPU whose u8 × s8 pairs saturate, 8-bit codes cost lowbit extra passes around oneDNN (weight halves, their
float sums combined, the epilogue). These do the exact integer sums and lowbit's float epilogue in one call with
the same float32 operations, so the same codes (``kernels.onednn`` says where each is taken). ``empty_codes`` makes
the torch quantized tensor a pass writes its u8 codes into.

>>> import torch
>>> from lowbit import native
>>> tuple(native.dw_weight(torch.ones(4, 1, 3, 3, dtype=torch.int8)).shape)
(3, 3, 4)
"""

from __future__ import annotations

import warnings

import torch

from . import _channel_vectors, _check_conv, _check_kernel, conv_out_hw, _check_grid, _lib, _local, _threads, counts

__all__ = ["conv_epilogue", "dw_weight", "dwconv", "empty_codes", "maxpool_codes", "to_channels_last"]


def conv_epilogue(ys: list[torch.Tensor], groups: int, scale: torch.Tensor, bias: torch.Tensor | None, inv: float,
                  zero_point: int, lo: int, hi: int) -> torch.Tensor | None:
    """The split-weight conv's epilogue in one pass (``kernels.onednn._wsplit_conv``): from its raw float32 sums,
    ``[stacked]`` (``(N, 2C, *sp)``, each group's ``hi`` then ``lo`` channels) or ``[hi, lo]`` (``(N, C, *sp)`` each),
    channels innermost in memory (oneDNN's channels-last output), the uint8 codes
    ``clamp(round(fl(clamp(fl(fl(fl(lo + 2 hi) · scale_c) + bias_c) · inv), lo - z, hi - z) + z)), 0, 255)``
    (``combine_stacked`` / ``add_(alpha=2)``, ``_acc_epilogue``'s multiply and bias, ``qstore.codes``' clamp, round and
    store) as an ``(N, C, *sp)`` channels-last tensor; ``None`` (nothing written) where the tensors do not fit."""
    _check_grid("conv_epilogue", zero_point, lo, hi, inv=inv)
    if groups < 1:
        raise ValueError(f"lowbit.native.conv_epilogue: groups={groups!r} must be at least 1")
    lib = _lib()
    if lib is None or len(ys) not in (1, 2):
        return None
    y0 = ys[0]
    c2 = y0.shape[1] if y0.dim() >= 3 else 0
    c = c2 // 2 if len(ys) == 1 else c2
    if c == 0 or (len(ys) == 1 and (c2 % 2 or c % groups)):
        return None
    lasts = [t.movedim(1, -1) for t in ys]
    if any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.requires_grad for t in lasts):
        return None
    if len(ys) == 2 and ys[1].shape != y0.shape:
        return None
    if not _channel_vectors(c, scale, bias):
        return None
    npix = y0.numel() // c2
    codes = torch.empty((*lasts[0].shape[:-1], c), dtype=torch.uint8)
    if len(ys) == 1:
        cpg = c // groups
        h, lo_ptr, ps, gs, ng = y0.data_ptr(), y0.data_ptr() + 4 * cpg, 2 * c, 2 * cpg, groups
    else:
        cpg, h, lo_ptr, ps, gs, ng = c, ys[0].data_ptr(), ys[1].data_ptr(), c, 0, 1
    vlo = float(lo - zero_point) if lo > 0 else -float("inf")
    vhi = float(hi - zero_point) if hi < 255 else float("inf")
    lib.lb_conv_epilogue(h, lo_ptr, npix, ps, gs, ng, cpg, scale.data_ptr(), None if bias is None else bias.data_ptr(),
                         inv, float(zero_point), vlo, vhi, codes.data_ptr(), _threads(npix * c),
                         _local.__dict__.get("isa", 1))
    counts["conv_epilogue"] += 1
    return codes.movedim(-1, 1)


def dw_weight(w: torch.Tensor) -> torch.Tensor:
    """A depthwise conv's int8 weight ``(C, 1, kh, kw)`` as the ``(kh, kw, C)`` int16 taps ``dwconv`` reads."""
    if w.dtype != torch.int8 or w.dim() != 4 or w.shape[1] != 1:
        raise ValueError(f"lowbit.native.dw_weight: a depthwise int8 weight of shape (C, 1, kh, kw) is needed, got "
                         f"{w.dtype} of shape {tuple(w.shape)}")
    return w[:, 0].permute(1, 2, 0).to(torch.int16).contiguous()


def dwconv(q: torch.Tensor, zx: int, taps: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int],
           scale: torch.Tensor, bias: torch.Tensor | None, inv: float, zero_point: int, lo: int,
           hi: int) -> torch.Tensor | None:
    """A 2-d depthwise int8 conv with its requantizing epilogue in one pass: u8 codes ``q`` ``(N, C, H, W)`` on zero
    point ``zx`` (zero padding: the zero point), ``taps`` from ``dw_weight``, exact int32 sums ``acc``, then
    ``conv_epilogue``'s codes of ``fl(acc)`` (``scale`` = ``fl(s_x s_w)`` per channel, ``bias``, ``inv`` = 1 / s_out,
    clamp to ``[lo, hi]``) as ``(N, C, OH, OW)`` channels-last uint8; ``None`` where the tensors do not fit."""
    _check_grid("dwconv", zero_point, lo, hi, inv=inv)
    _check_conv("dwconv", zx, stride, padding, dilation)
    lib = _lib()
    if lib is None or q.dtype != torch.uint8 or q.dim() != 4 or not q.is_cpu:
        return None
    n, c, h, w = q.shape
    kh, kw = taps.shape[:2] if taps.dim() == 3 else (0, 0)
    if taps.dtype != torch.int16 or taps.shape != (kh, kw, c) or not taps.is_contiguous() or kh * kw > 64:
        return None  # (rowquant.c's DW_MAX_TAPS)
    if not _channel_vectors(c, scale, bias):
        return None
    oh, ow = conv_out_hw(h, w, (kh, kw), stride, padding, dilation)
    if oh <= 0 or ow <= 0 or n == 0 or c == 0:
        return None
    x = q.movedim(1, -1)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((n, oh, ow, c), dtype=torch.uint8)
    vlo = float(lo - zero_point) if lo > 0 else -float("inf")
    vhi = float(hi - zero_point) if hi < 255 else float("inf")
    lib.lb_dwconv(x.data_ptr(), n, c, h, w, taps.data_ptr(), kh, kw, stride[0], stride[1], padding[0], padding[1],
                  dilation[0], dilation[1], zx, oh, ow, scale.data_ptr(), None if bias is None else bias.data_ptr(),
                  inv, float(zero_point), vlo, vhi, out.data_ptr(), _threads(n * oh * ow * c * kh * kw),
                  _local.__dict__.get("isa", 1))
    counts["dwconv"] += 1
    return out.movedim(-1, 1)


_QUIET = [False]  # torch's one deprecation warning for quantized tensors, kept from users


def empty_codes(shape: tuple[int, ...] | torch.Size, zero_point: int, dtype: torch.dtype,
                memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """An empty torch quantized tensor (``quint8`` / ``qint8``) on scale 1 and ``zero_point``, for a native pass to fill:
    the form lowbit keeps 8-bit codes in for the fbgemm ops that read them next (a ``QTensor``'s ``tu``)."""
    if dtype not in (torch.quint8, torch.qint8):
        raise ValueError(f"lowbit.native.empty_codes: dtype={dtype!r} must be torch.quint8 or torch.qint8")
    _check_grid("empty_codes", zero_point, *((-128, 127, torch.int8) if dtype == torch.qint8 else (0, 255)))
    if _QUIET[0]:
        return torch._empty_affine_quantized(shape, scale=1.0, zero_point=zero_point, dtype=dtype,
                                             memory_format=memory_format)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch._empty_affine_quantized(shape, scale=1.0, zero_point=zero_point, dtype=dtype, memory_format=memory_format)
    _QUIET[0] = True
    return t


def maxpool_codes(q: torch.Tensor, kh: int, kw: int, sh: int, sw: int) -> torch.Tensor | None:
    """2-d max pooling of channels-last ``(N, C, H, W)`` 8-bit codes (uint8, or int8 compared as signed), window
    ``kh × kw``, stride ``sh × sw``, no padding or dilation, in one pass (``pool.c``): a new channels-last
    ``(N, C, (H - kh) // sh + 1, (W - kw) // sw + 1)`` tensor of the same dtype; ``None`` (nothing made) where ``q``
    does not fit (another dtype or layout, not CPU, empty, a window larger than the input)."""
    if min(kh, kw, sh, sw) < 1:
        raise ValueError(f"lowbit.native.maxpool_codes: kernel ({kh}, {kw}) and stride ({sh}, {sw}) must be positive")
    lib = _lib()
    if (lib is None or q.dtype not in (torch.uint8, torch.int8) or q.dim() != 4 or not q.is_cpu or q.numel() == 0
            or not q.is_contiguous(memory_format=torch.channels_last)):
        return None
    n, c, h, w = q.shape
    if h < kh or w < kw:
        return None
    out = torch.empty((n, c, (h - kh) // sh + 1, (w - kw) // sw + 1), dtype=q.dtype, memory_format=torch.channels_last)
    lib.lb_maxpool_codes(q.data_ptr(), int(q.dtype == torch.int8), n, h, w, c, kh, kw, sh, sw, out.data_ptr(),
                         _threads(q.numel()), _local.__dict__.get("isa", 1))
    counts["maxpool"] += 1
    return out


def to_channels_last(q: torch.Tensor) -> torch.Tensor | None:
    """A contiguous ``(N, C, H, W)`` 8-bit code tensor copied into channels-last memory in one pass (``pool.c``;
    torch's ``contiguous(memory_format=torch.channels_last)`` of uint8 codes takes ~1.6 ms for MobileNetV2's
    8×3×224×224 input, this ~0.2): the same values, a new tensor; ``None`` where ``q`` does not fit."""
    lib = _lib()
    if (lib is None or q.dtype not in (torch.uint8, torch.int8) or q.dim() != 4 or not q.is_cpu or q.numel() == 0
            or not q.is_contiguous()):
        return None
    n, c, h, w = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, memory_format=torch.channels_last)
    lib.lb_to_nhwc(q.data_ptr(), n, c, h * w, out.data_ptr(), _threads(q.numel()))
    counts["to_nhwc"] += 1
    return out


def to_contiguous(q: torch.Tensor) -> torch.Tensor | None:
    """A channels-last ``(N, C, H, W)`` 8-bit code tensor copied into contiguous (NCHW) memory in one pass
    (``pool.c``: 16 × 16 byte tiles transposed in registers), e.g. before a flatten feeds a Linear: the same values,
    a new tensor; ``None`` where ``q`` does not fit (then ``q.contiguous()`` does it)."""
    lib = _lib()
    if (lib is None or q.dtype not in (torch.uint8, torch.int8) or q.dim() != 4 or not q.is_cpu or q.numel() == 0
            or not q.is_contiguous(memory_format=torch.channels_last)):
        return None
    n, c, h, w = q.shape
    out = torch.empty(q.shape, dtype=q.dtype)
    lib.lb_to_nchw(q.data_ptr(), n, c, h * w, out.data_ptr(), _threads(q.numel()))
    counts["to_nchw"] += 1
    return out


def im2col(q: torch.Tensor, zx: int, kernel: tuple[int, int], stride: list[int], padding: list[int],
           dilation: list[int]) -> torch.Tensor | None:
    """The patches of a 2-d conv over channels-last u8 codes ``q`` ``(N, C, H, W)``: ``(N·OH·OW, KH·KW·C)`` uint8, row
    ``(n OH + i) OW + j`` holding output pixel ``(n, i, j)``'s window tap by tap (``(di KW + dj) C + c``), padding taps
    at the input zero point ``zx`` (they add ``(z_x - z_x) w = 0`` to a conv's sums; ``pool.c``'s ``lb_im2col``, one
    pass over the output rows). ``None`` where ``q`` does not fit or the window does not fit the padded input; wrong
    geometry values raise ``ValueError``.

    >>> q = torch.arange(4, dtype=torch.uint8).view(1, 1, 2, 2).contiguous(memory_format=torch.channels_last)
    >>> cols = im2col(q, 9, (2, 2), [1, 1], [1, 1], [1, 1])
    >>> cols is None or cols.tolist()[0] == [9, 9, 9, 0]
    True
    """
    _check_conv("im2col", zx, stride, padding, dilation)
    _check_kernel("im2col", kernel)
    lib = _lib()
    if (lib is None or q.dtype != torch.uint8 or q.dim() != 4 or not q.is_cpu or q.numel() == 0
            or not q.is_contiguous(memory_format=torch.channels_last)):
        return None
    n, c, h, w = q.shape
    kh, kw = kernel
    oh, ow = conv_out_hw(h, w, (kh, kw), stride, padding, dilation)
    if oh < 1 or ow < 1:
        return None
    out = torch.empty(n * oh * ow, kh * kw * c, dtype=torch.uint8)
    lib.lb_im2col(q.data_ptr(), n, c, h, w, kh, kw, stride[0], stride[1], padding[0], padding[1], dilation[0],
                  dilation[1], zx, oh, ow, out.data_ptr(), _threads(out.numel()))
    counts["im2col"] += 1
    return out
