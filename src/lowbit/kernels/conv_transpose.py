"""A transposed int8 conv as one ordinary int8 conv on the same codes: its stride phases stacked as output channels.

Along one axis (kernel ``k``, stride ``s``, padding ``p``, dilation ``d``) the transposed conv's output ``o = a + s m``
(phase ``a`` in ``[0, s)``) sums ``x[i] w[t]`` over the taps with ``i s + t d - p = o``, i.e. the taps
``t`` with ``(a + p - t d) mod s = 0``, each reading ``x[m + c_t]``, ``c_t = (a + p - t d) / s``. So phase ``a`` is a
correlation of ``x`` with the taps placed at offsets ``c_t``; over every phase the offsets span ``[c_min, c_max]``,
and all ``s`` phases (``Π s`` in N-d) become one stride-1 conv whose window is that span, with the phases as extra
output channels (a tap a phase does not read weighs 0: ``(q_x - z_x) · 0 = 0``). The input is padded with its zero
point's code where a window reaches past it (``(z_x - z_x) w = 0``: the transposed conv's zero border), and the conv's
output pixels are shuffled back (``out[..., a + s m] = y[phase a][..., m]``), cropped to the transposed output size.

Every output code is then the ordinary conv path's (``onednn.conv``) on the same integer sums
``Σ (q_x - z_x) q_w`` with the same epilogue, so the transposed conv inherits its exactness contract on every CPU
(VNNI, the AVX2 weight split, 7-bit inputs, the ``odd_windows`` padding) instead of the float simulation. Zero-weight
taps cost work where the phases' windows differ: none for ``k = s`` (a UNet's ``k=2, s=2``: one 1×1 conv), 2.25x the
MACs for ``k=4, s=2, p=1`` in 2-d (a 3×3 window for four 2×2 phases). Output: channels-last codes (or floats).

>>> phases(3, 2, 1, 1)   # k=3, s=2, p=1: phase 0 reads x[m] (tap 1), phase 1 reads x[m] (tap 2) and x[m+1] (tap 0)
([[(1, 0)], [(0, 1), (2, 0)]], 0, 1)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import native
from ..compile_state import tensor_version
from ..qtensor import QTensor
from .spec import ConvSpec

__all__ = ["phases", "as_conv"]


def phases(k: int, s: int, p: int, d: int) -> tuple[list[list[tuple[int, int]]], int, int]:
    """Per phase ``a`` of one axis, its ``(tap t, offset c_t)`` pairs; and the offsets' span ``(c_min, c_max)``."""
    per = [[(t, (a + p - t * d) // s) for t in range(k) if (a + p - t * d) % s == 0] for a in range(s)]
    offs = [c for taps in per for _, c in taps]
    return per, min(offs), max(offs)


def _stacked(weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec) -> tuple[QTensor, torch.Tensor | None, Any]:
    """The stacked conv weight ``(g · P · C_out/g, C_in/g, *span)`` (channels ordered group, phase, channel), its
    per-channel scales and zero points and bias; ``axes``: per axis ``(stride, c_min, span)``."""
    w = weight.int_repr()
    d, g = spec.dim, spec.groups
    cin, cout_g, ks = w.shape[0], w.shape[1], w.shape[2:]
    axes = [phases(k, s, p, dl) for k, s, p, dl in zip(ks, spec.stride, spec.padding, spec.dilation)]
    spans = [hi - lo + 1 for _, lo, hi in axes]
    n_ph = math.prod(spec.stride)
    wt = w.reshape(g, cin // g, cout_g, *ks).movedim(2, 1)  # (g, C_out/g, C_in/g, *k)
    out = torch.zeros(g, n_ph, cout_g, cin // g, *spans, dtype=torch.int8)
    for ph, a in enumerate(itertools.product(*(range(s) for s in spec.stride))):
        for taps in itertools.product(*(axes[i][0][a[i]] for i in range(d))):
            src = (slice(None),) * 3 + tuple(t for t, _ in taps)
            dst = (slice(None), ph, slice(None), slice(None)) + tuple(c - axes[i][1] for i, (_, c) in enumerate(taps))
            out[dst] = wt[src]

    def per_channel(v: torch.Tensor) -> torch.Tensor:
        v = v.reshape(-1)
        v = v.expand(cout_g) if v.numel() == 1 else v
        return v.reshape(1, 1, cout_g).expand(g, n_ph, cout_g).reshape(-1).contiguous()

    scale, zp = per_channel(weight.scale.float()), per_channel(weight.zero_point.long())
    stacked = QTensor(out.reshape(g * n_ph * cout_g, cin // g, *spans), scale, zp, weight.qdtype, 0)
    b = None if bias is None else bias.reshape(g, 1, cout_g).expand(g, n_ph, cout_g).reshape(-1).contiguous()
    return stacked, b, [(s, lo, span) for s, (_, lo, _), span in zip(spec.stride, axes, spans)]


def as_conv(x: QTensor, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec,
            cache: dict[str, Any] | None) -> tuple[QTensor, QTensor, torch.Tensor | None, ConvSpec, dict[str, Any],
                                                  Callable[[torch.Tensor], torch.Tensor]] | None:
    """``(x', weight', bias', spec', inner cache, shuffle)``: the transposed conv of ``x`` as the ordinary conv of
    ``x'`` (``shuffle`` turns its output into the transposed conv's), or ``None`` (a weight whose scales are not one
    per output channel of a group, or an output size torch refuses: the caller falls back)."""
    w = weight.int_repr()
    if weight.scale.numel() not in (1, w.shape[1]) or weight.zero_point.numel() not in (1, w.shape[1]):
        return None
    sizes = [(n - 1) * s - 2 * p + dl * (k - 1) + op + 1 for n, s, p, dl, k, op in
             zip(x.shape[2:], spec.stride, spec.padding, spec.dilation, w.shape[2:], spec.output_padding)]
    if min(sizes) <= 0:
        return None
    key = (w.data_ptr(), tensor_version(w), weight.scale.data_ptr(), tensor_version(weight.scale),
           weight.zero_point.data_ptr(), tensor_version(weight.zero_point),
           None if bias is None else (bias.data_ptr(), tensor_version(bias)), spec)
    hit = None if cache is None else cache.get("conv_transpose")
    if hit is None or hit[0] != key:
        hit = (key, _stacked(weight, bias, spec), {}, (weight, bias))  # (holds them: no address reuse)
        if cache is not None:
            cache["conv_transpose"] = hit
    stacked, b, axes = hit[1]
    counts = [-(-n // s) for n, (s, _, _) in zip(sizes, axes)]  # outputs per phase (the last ones cropped)
    # the window of output m along an axis reads x[m + lo .. m + lo + span - 1], m < count: pad (or crop) x to that
    pads = [(-lo, m - 1 + lo + span - n) for (_, lo, span), m, n in zip(axes, counts, x.shape[2:])]
    q = x.int_repr()
    if all(lft == rgt >= 0 for lft, rgt in pads):
        conv_pad = tuple(lft for lft, _ in pads)
    else:
        flat = [v for lft, rgt in reversed(pads) for v in (lft, rgt)]
        q = F.pad(q, flat, value=int(x.zero_point.item()))  # (a negative pad crops)
        x = QTensor(q, x.scale, x.zero_point, x.qdtype)
        conv_pad = (0,) * spec.dim
    if q.dim() == 4 and not q.is_contiguous(memory_format=torch.channels_last):
        cl = native.to_channels_last(q)  # (oneDNN would make this copy inside the call, ~3x slower: conv_plan)
        if cl is not None:
            x = QTensor(cl, x.scale, x.zero_point, x.qdtype)
    inner = ConvSpec(spec.dim, (1,) * spec.dim, conv_pad, (1,) * spec.dim, spec.groups)
    g, d = spec.groups, spec.dim
    cout_g = w.shape[1]
    strides = [s for s, _, _ in axes]

    def shuffle(y: torch.Tensor) -> torch.Tensor:
        n = y.shape[0]
        t = y.movedim(1, -1).reshape(n, *counts, g, *strides, cout_g)  # (N, *M, g, *s, C/g)
        order = [0] + [i for a in range(d) for i in (1 + a, 2 + d + a)] + [1 + d, 2 + 2 * d]  # (N, M1, s1, .., g, C/g)
        t = t.permute(order).reshape(n, *(m * s for m, s in zip(counts, strides)), g * cout_g)
        if any(m * s != size for m, s, size in zip(counts, strides, sizes)):
            t = t[(slice(None),) + tuple(slice(0, size) for size in sizes)].contiguous()
        return t.movedim(-1, 1)

    return x, stacked, b, inner, hit[2], shuffle
