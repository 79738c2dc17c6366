"""Bilinear resampling of ``QTensor`` codes on the input's grid: torch's quantized CPU kernel, code for code.

torch.ao keeps ``F.interpolate(mode="bilinear")`` / ``nn.Upsample(mode="bilinear")`` / ``nn.UpsamplingBilinear2d``
int8: its converted model runs ``quantized::upsample_bilinear2d`` (aten ``UpSampleBilinear2d.cpp`` and the
channels-last ``qupsample_bilinear2d_nhwc_kernel``) on the codes, output on the input's grid ``(s, z)``. Its math,
in float32 with each product and sum rounded (no fused multiply-add), for output pixel ``(i, j)``:

- per axis of input size ``n`` and output size ``m``: ``r = (n - 1) / (m - 1)`` (``align_corners``; 0 for
  ``m = 1``), else ``r = 1 / scale_factor`` when a scale factor reaches the kernel (``F.interpolate`` with
  ``scale_factor`` and ``recompute_scale_factor`` not ``True``), else ``r = n / m``;
- source ``t = r i`` (``align_corners``) or ``t = max(r (i + 0.5) - 0.5, 0)``; ``i0 = trunc(t)``,
  ``i1 = i0 + 1`` (``i0`` at the last row), ``λ1 = t - i0``, ``λ0 = 1 - λ1``;
- ``v = h0 (w0 q00 + w1 q01) + h1 (w0 q10 + w1 q11) - z`` and ``q_out = clamp(round_half_even(z + v))`` (fbgemm's
  legacy ``Quantize``: ``v`` is first rounded to float32 around ``-z``, so a near-tie can land on either side).

lowbit runs this math for every memory format and CPU: one definition. torch's channels-last (NHWC) kernel is
compiled per instruction set, with fused multiply-adds on its x86 AVX2 / AVX-512 builds (the source index, one
product of each blend, which one depending on the channel's place in the vector loop), so the same codes in NHWC give
other codes than in NCHW at near-ties, and other codes on other CPUs: in a 2,900-case random sweep on AVX2 it moved
313 cases (all channels-last, about a fifth of those) by one step against its own NCHW kernel. lowbit's codes equal
torch's NCHW kernel's, in either layout, and are within one step of its NHWC kernel's (which torch also runs for
any input that is channels-last contiguous too: one channel, or 1x1 maps). Rounding ``v - z`` instead of
``z + (v - z)`` missed 907 of those cases. An input whose output size equals its own is copied (torch's NCHW
shortcut, even when a scale factor would move the samples; torch's NHWC kernel computes them, and writes a 1x1
input's channels-last output in the wrong layout, scrambling its channels: lowbit gives the right codes). Per channel
QTensors (axis 0 or 1: torch has no quantized per-channel bilinear) use each channel's zero point.

Eager calls (``bilinear_codes``, ``bilinear_on_grid``) take the same values faster: each axis' indices and weights
are made once per sizes / ``align_corners`` / scale factors / device (``_plan``, an LRU cache), and the blend is
separable (``_blend_planned``: the column blend of each input row once, then the row blend), the same float32 products
and sums on the same operands. Traced calls (``torch.compile`` / ``torch.export``, symbolic sizes, ONNX through
``lowbit.export.codes``) record ``bilinear_blend``.
``antialias=True``, ``linear`` (1-d), ``trilinear`` (3-d) and ``bicubic`` have no quantized kernel in torch: they stay
float values (the QTensor fallback warns).

>>> import torch, torch.nn.functional as F, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([[[[0.0, 0.3], [0.6, 0.9]]]]), 0.1, 1, Q.quint8)
>>> F.interpolate(qt, scale_factor=2, mode="bilinear").int_repr()[0, 0].tolist()
[[1, 2, 3, 4], [2, 3, 5, 6], [6, 6, 8, 8], [7, 8, 9, 10]]
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Sequence

import torch

from ..compile_state import tracing

__all__ = ["bilinear_args", "bilinear_blend", "bilinear_codes", "bilinear_on_grid", "check_resample_args",
           "check_resample_sizes", "interpolate_bilinear"]


def _f32(v: float, device: torch.device) -> torch.Tensor:
    """``v`` rounded to float32, as a 0-d tensor (no host read: torch.compile traces it as a constant; a traced size,
    a ``SymInt``, stays symbolic where ``torch.tensor`` would specialise it)."""
    return torch.full((), v, dtype=torch.float32, device=device)


def bilinear_args(shape: Sequence[int], size: Any, scale_factor: Any,
                  recompute_scale_factor: Any) -> tuple[list[int], list[float | None]]:
    """The output size and the scale factors that reach torch's kernel, as ``F.interpolate`` resolves them for a
    ``(N, C, H, W)`` input (its checks have run before: ``_interpolate`` calls it on a meta tensor)."""
    spatial = list(shape[2:])
    if size is not None:
        out = list(size) if isinstance(size, (list, tuple)) else [size] * 2
        return [o if isinstance(o, torch.SymInt) else int(o) for o in out], [None, None]
    sf = list(scale_factor) if isinstance(scale_factor, (list, tuple)) else [scale_factor] * 2
    # (n * f, not float(n) * f: the same double for an int n; a traced SymInt n stays symbolic, float() specialises it)
    out = [math.floor(n * float(f)) for n, f in zip(spatial, sf)]
    return out, ([None, None] if recompute_scale_factor else [float(f) for f in sf])


def check_resample_args(shape: Sequence[int], size: Any, scale_factor: Any) -> None:
    """A ``ValueError`` naming ``size`` / ``scale_factor`` where a value is a number but not finite and above 0 (torch's
    meta path, which ``interpolate_bilinear`` asks for the output size, fails on them deep inside: a
    ``ZeroDivisionError`` for a size of 0, "upper bound and lower bound inconsistent with step sign" for a negative one,
    "cannot convert float NaN to integer"); other kinds of value are left to torch's own checks.

    >>> check_resample_args((1, 1, 4, 4), None, (2.0, float("nan")))
    Traceback (most recent call last):
        ...
    ValueError: interpolate (bilinear, QTensor input of shape (1, 1, 4, 4)): scale_factor=(2.0, nan) must hold finite numbers > 0
    """
    for name, v in (("size", size), ("scale_factor", scale_factor)):
        for e in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(e, numbers.Real) and not isinstance(e, bool) and not (math.isfinite(e) and e > 0):
                raise ValueError(f"interpolate (bilinear, QTensor input of shape {tuple(shape)}): {name}={v!r} must "
                                 "hold finite numbers > 0")


def check_resample_sizes(shape: Sequence[int], out: Sequence[int]) -> None:
    """A ``ValueError`` where torch's bilinear kernels refuse the sizes (float and quantized alike: "Input and output
    sizes should be greater than 0", "Non-empty 4D data tensor expected") and its meta path does not: no channels, an
    empty spatial input, or an output size that rounds down to 0 (``scale_factor=0.15`` of 5 rows). A batch of 0 is
    fine (an empty output, as torch).

    >>> check_resample_sizes((2, 3, 5, 7), [0, 1])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    ValueError: interpolate (bilinear, QTensor): ... got input (C: 3, H: 5, W: 7) and output (H: 0, W: 1)
    """
    c, h, w = shape[1:]
    if c <= 0 or h <= 0 or w <= 0 or min(out) <= 0:
        raise ValueError(f"interpolate (bilinear, QTensor): input and output sizes must be greater than 0, got input "
                         f"(C: {c}, H: {h}, W: {w}) and output (H: {out[0]}, W: {out[1]})")


def _axis(n: int, m: int, align_corners: bool, scale: float | None, device: torch.device,
          same: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(i0, i1, λ0, λ1)`` of one axis: torch's ``area_pixel_compute_scale`` / ``_source_index`` in float32.

    ``same`` (traced symbolic sizes: a 0-d bool tensor, "the output size equals the input's on both axes"): torch's
    copy shortcut as the ratio 1, which samples every code exactly (``t = i``, ``λ1 = 0``), instead of a Python
    comparison of the sizes, which ``torch.export`` would turn into a guard on a dynamic dim."""
    if align_corners:  # (float32 divisions of the sizes, as torch's; 1 / scale in float64, then rounded)
        if same is None:
            r = _f32(n - 1, device) / _f32(m - 1, device) if m > 1 else _f32(0.0, device)
        else:  # (m > 1 as a tensor: no guard; the 0 / 0 of m = 1 is not selected)
            mt = _f32(m, device)
            r = torch.where(mt > 1, _f32(n - 1, device) / (mt - 1), _f32(0.0, device))
    else:
        r = _f32(1.0 / scale, device) if scale is not None and scale > 0 else _f32(n, device) / _f32(m, device)
        if same is not None and scale is not None:
            r = torch.where(same, _f32(1.0, device), r)
    d = torch.arange(m, dtype=torch.float32, device=device)
    t = d * r if align_corners else ((d + 0.5) * r - 0.5).clamp_min(0.0)
    i0 = t.to(torch.int64)
    i1 = i0 + (i0 < n - 1).to(torch.int64)
    l1 = t - i0.to(torch.float32)
    return i0, i1, 1.0 - l1, l1


def bilinear_blend(p: torch.Tensor, out_size: Sequence[int], align_corners: bool,
                   scales: Sequence[float | None] = (None, None)) -> torch.Tensor:
    """The float32 blend ``v`` of codes ``p`` (``(N, C, H, W)``, float32) onto ``out_size``, before rounding (module
    docstring): ``h0 (w0 q00 + w1 q01) + h1 (w0 q10 + w1 q11)``, each product and sum rounded. ``p`` itself when the
    (static) output size equals the input's (torch's copy shortcut); ``lowbit.export.codes`` writes these ops into
    ONNX files, which then give lowbit's codes."""
    (h, w), (oh, ow) = p.shape[-2:], out_size
    same = None
    if any(isinstance(v, torch.SymInt) for v in (h, w, oh, ow)):  # (torch.export: dynamic spatial dims)
        same = (_f32(h, p.device) == _f32(oh, p.device)) & (_f32(w, p.device) == _f32(ow, p.device))
    elif (oh, ow) == (h, w):
        return p
    h0, h1, hl0, hl1 = _axis(h, oh, align_corners, scales[0], p.device, same)
    w0, w1, wl0, wl1 = _axis(w, ow, align_corners, scales[1], p.device, same)
    hl0, hl1 = hl0[:, None], hl1[:, None]
    top, bottom = p.index_select(-2, h0), p.index_select(-2, h1)
    a, b, c, d = (top.index_select(-1, w0), top.index_select(-1, w1), bottom.index_select(-1, w0),
                  bottom.index_select(-1, w1))
    return (a * wl0 + b * wl1) * hl0 + (c * wl0 + d * wl1) * hl1  # (each product and sum rounded: no FMA)


@functools.lru_cache(maxsize=64)
def _plan(h: int, w: int, oh: int, ow: int, align_corners: bool, scales: tuple[float | None, float | None],
          device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``bilinear_blend``'s indices and weights (``_axis``, the same float32 values) for one resample, made once per
    sizes / ``align_corners`` / scale factors / device: the input rows the blend reads (``None``: all of them), the
    pairs of output rows as positions in those rows ``[h0 | h1]``, their weights ``[λ0 | λ1]`` (a column), the
    column pairs ``[w0 | w1]`` and their weights."""
    cpu = torch.device("cpu")  # (made on the CPU, whose float32 steps the kernel's are, then moved: meta too)
    h0, h1, hl0, hl1 = _axis(h, oh, align_corners, scales[0], cpu)
    w0, w1, wl0, wl1 = _axis(w, ow, align_corners, scales[1], cpu)
    hh = torch.cat([h0, h1])
    rows = torch.unique(hh)  # (sorted; a downsample reads only these rows)
    if rows.numel() == h:
        keep = None
    else:
        pos = torch.zeros(h, dtype=torch.int64)
        pos[rows] = torch.arange(rows.numel())
        keep, hh = rows.to(device), pos[hh]
    return (keep, hh.to(device), torch.cat([hl0, hl1])[:, None].to(device), torch.cat([w0, w1]).to(device),
            torch.cat([wl0, wl1]).to(device))


def _eager_plan(q: torch.Tensor, out_size: Sequence[int], align_corners: bool,
                scales: Sequence[float | None]) -> tuple[Any, ...] | None:
    """``_plan`` for an eager call on static sizes, else ``None`` (traced: ``bilinear_blend``, whose ops
    ``torch.compile`` / ``torch.export`` record)."""
    if tracing() or any(isinstance(v, torch.SymInt) for v in (*q.shape, *out_size)):
        return None
    (h, w), (oh, ow) = q.shape[-2:], out_size
    with torch.inference_mode(False), torch.no_grad():  # (cached: plain tensors, whatever mode the first call ran in)
        return _plan(int(h), int(w), int(oh), int(ow), bool(align_corners), (scales[0], scales[1]), q.device)


def _blend_planned(p: torch.Tensor, plan: tuple[Any, ...]) -> torch.Tensor:
    """``bilinear_blend(p, ...)`` value for value, separably: each input row's column blend ``w0 q0 + w1 q1`` once
    (upsampling 2x: half the products), then the row blend of those; each product and sum rounded as there (the
    same float32 operations on the same operands). Gathers with cached indices (``_plan``), products in place; a
    channels-last ``p`` is blended as its ``(N, H, W, C)`` view (whole pixels gathered; the output channels-last)."""
    keep, hh, hl, ww, wl = plan
    cl = not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
    t, hd = (p.permute(0, 2, 3, 1), 1) if cl else (p, 2)
    if keep is not None:
        t = t.index_select(hd, keep)
    ow, oh = ww.numel() // 2, hh.numel() // 2
    if cl:  # [w0 q(., w0) | w1 q(., w1)] along W
        cols = t.index_select(2, ww).mul_(wl[:, None])
        r = cols[:, :, :ow] + cols[:, :, ow:]
        rows = r.index_select(1, hh).mul_(hl[:, :, None])  # [h0 r(h0, .) ; h1 r(h1, .)]
        return (rows[:, :oh] + rows[:, oh:]).permute(0, 3, 1, 2)
    n, c, h, _ = t.shape
    cols = torch.gather(t, 3, ww.expand(n, c, h, 2 * ow)).mul_(wl)
    r = cols[..., :ow] + cols[..., ow:]
    rows = r.index_select(2, hh).mul_(hl)
    return rows[:, :, :oh] + rows[:, :, oh:]


def bilinear_codes(q: torch.Tensor, zero_point: torch.Tensor, quant_min: int, quant_max: int,
                   out_size: Sequence[int], align_corners: bool,
                   scales: Sequence[float | None] = (None, None)) -> torch.Tensor:
    """Codes ``q`` (``(N, C, H, W)``, integer dtype) resampled bilinearly onto ``out_size`` on their own grid
    (module docstring); ``zero_point``: 0-d, or shaped to broadcast against ``q`` (per channel). Same dtype and
    memory format as ``q``."""
    channels_last = q.is_contiguous(memory_format=torch.channels_last)
    if not any(isinstance(v, torch.SymInt) for v in (*q.shape[-2:], *out_size)) and tuple(out_size) == q.shape[-2:]:
        return q.clone(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    fast = _eager_plan(q, out_size, align_corners, scales)
    v = (bilinear_blend(q.to(torch.float32), out_size, align_corners, scales) if fast is None
         else _blend_planned(q.to(torch.float32), fast))
    z = zero_point.to(torch.float32)
    # fbgemm's Quantize (torch's quantize_val): nearbyint(z + (v - z)), the difference rounded to float32 first
    out = ((v - z) + z).round_().clamp_(quant_min, quant_max).to(q.dtype)
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


def interpolate_bilinear(x: Any, size: Any = None, scale_factor: Any = None, align_corners: Any = None,
                         recompute_scale_factor: Any = None, antialias: bool = False) -> Any:
    """``F.interpolate(x, ..., mode="bilinear")`` of a QTensor ``x``: a QTensor on ``x``'s grid (``bilinear_codes``),
    or ``NotImplemented`` (the float fallback, warned) for ``antialias=True``, a per-channel axis among the resampled
    dims, or a rank other than 4 (torch's error comes from the float op)."""
    from . import QTensor
    if x.dim() != 4 or antialias or (x.axis is not None and x.axis >= 2):
        return NotImplemented
    align = bool(align_corners) if align_corners is not None else False
    want = None
    if not tracing():  # torch's own checks of the arguments, and its output size, on a meta tensor
        check_resample_args(x.shape, size, scale_factor)
        want = list(torch.nn.functional.interpolate(torch.empty(x.shape, device="meta"), size, scale_factor,
                                                    "bilinear", align_corners, recompute_scale_factor).shape[2:])
        check_resample_sizes(x.shape, want)
    out, scales = bilinear_args(x.shape, size, scale_factor, recompute_scale_factor)
    if want is not None and want != out:
        raise AssertionError(f"bilinear output size {out} differs from torch's {want}")
    qd = x.qdtype
    z = x.zero_point if x.axis is None else x.zero_point.reshape([-1 if i == x.axis else 1 for i in range(4)])
    codes = bilinear_codes(x.int_repr(), z, qd.quant_min, qd.quant_max, out, align, scales)
    return QTensor(codes, x.scale, x.zero_point, qd, x.axis)


def bilinear_on_grid(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                     quant_min: int, quant_max: int, axis: int | None, size: Any = None, scale_factor: Any = None,
                     align_corners: Any = None, recompute_scale_factor: Any = None) -> torch.Tensor:
    """The bilinear resample of ``x`` (float values on the grid ``(scale, zero_point)``, ``(N, C, H, W)``) as the
    int8 model computes it, in float: ``(bilinear_codes(q) - z) s`` with ``q = clamp(round(x / s) + z)`` the codes
    of ``x``; ``y`` (the float op's output fake-quantized on that grid, same shape) gives the gradient
    (``y + (exact - y).detach()``). Rounding ``F.interpolate``'s float output instead (``y``) moves the kernel's
    near-ties by one step (2x upsampling: its exact ties, when ``z`` is odd). ``axis``: a per-channel grid's axis
    (0 or 1), else ``None``. Eager: ``bilinear_codes``' steps in place on float32 codes with a cached plan (module
    docstring), bit for bit as ``bilinear_codes``; the backward is ``y``'s alone.

    >>> import torch, torch.nn.functional as F
    >>> x = torch.tensor([[[[1.0, 1.1], [1.2, 1.4]]]])           # codes 10, 11, 12, 14 on (0.1, 0)
    >>> y = F.interpolate(x, scale_factor=2, mode="bilinear")
    >>> out = bilinear_on_grid(x, y, torch.tensor(0.1), torch.tensor(0), 0, 255, None, scale_factor=2)
    >>> (out / 0.1).round().int()[0, 0, 0].tolist()
    [10, 10, 11, 11]
    """
    if axis is None:
        s, z = scale.detach().reshape(()), zero_point.detach().reshape(())
    else:
        shape = [-1 if i == axis else 1 for i in range(4)]
        s, z = scale.detach().reshape(shape), zero_point.detach().reshape(shape)
    with torch.no_grad():
        s32, z32 = s.to(torch.float32), z.to(torch.float32)
        q = (x.detach().to(torch.float32) / s32).round_().add_(z32).clamp_(quant_min, quant_max).to(torch.int32)
        out, scales = bilinear_args(x.shape, size, scale_factor, recompute_scale_factor)
        align = bool(align_corners) if align_corners is not None else False
        plan = None if tuple(out) == tuple(q.shape[-2:]) else _eager_plan(q, out, align, scales)
        if plan is None:  # (traced, or torch's copy shortcut)
            codes = bilinear_codes(q, z.to(torch.int32), quant_min, quant_max, out, align, scales)
            exact = ((codes.to(torch.float32) - z32) * s32).to(y.dtype)
        else:  # bilinear_codes' steps in place, on float32 codes (int32 only where float32 cannot hold them all)
            zi = z.to(torch.int32).to(torch.float32)
            c = _blend_planned(q.to(torch.float32), plan).sub_(zi).add_(zi).round_().clamp_(quant_min, quant_max)
            if quant_min < -(1 << 24) or quant_max > 1 << 24:
                c = c.to(torch.int32).to(torch.float32)
            if q.is_contiguous(memory_format=torch.channels_last):
                c = c.contiguous(memory_format=torch.channels_last)
            exact = c.sub_(z32).mul_(s32).to(y.dtype)
        delta = exact.sub_(y.detach()) if exact.shape == y.shape else exact - y
    return y + delta
