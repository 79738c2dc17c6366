"""Channels-last 8-bit codes seen as the NCHW tensor they stand for.

The int8 conv kernels keep activations channels-last; the float model the user wrote has NCHW outputs. A reshape-like
op that merges the channel dim with another (``flatten(1)``, a 2-d ``reshape``, any ``view`` to another shape) has no
view of channels-last memory, so the codes are first copied into NCHW order (``contiguous_codes``: one native pass,
the opaque ``lowbit::contiguous_codes`` while traced): the same codes in the order the float tensor holds them.

>>> import torch
>>> q = torch.arange(16, dtype=torch.uint8).reshape(1, 4, 2, 2).contiguous(memory_format=torch.channels_last)
>>> merges_channels_last(q, "flatten", (1,)), view_of_channels_last(q, (1, -1)), nchw_copy(q).is_contiguous()
(True, True, True)
"""

from __future__ import annotations

from typing import Any

import torch

from .. import native
from ..compile_state import tracing

__all__ = ["contiguous_codes", "merges_channels_last", "nchw_copy", "view_of_channels_last"]


def merges_channels_last(q: torch.Tensor, name: str, args: tuple[Any, ...]) -> bool:
    """Whether ``q.<name>(*args)`` merges the channel dim of channels-last 8-bit ``(N, C, H, W)`` codes (C > 1,
    H W > 1) with another dim: then no view exists and torch copies to NCHW order (``flatten(start, end)`` with
    ``start <= 1 <= end``, ``start < end``; any 2-d ``reshape``)."""
    if q.element_size() != 1 or q.is_contiguous() or not q.is_contiguous(memory_format=torch.channels_last):
        return False
    n, c, h, w = q.shape
    if c == 1 or h * w == 1:
        return False
    if name == "reshape":
        shape = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
        return len(shape) == 2
    start, end = (list(args) + [0, -1][len(args):])[:2]
    start, end = start % 4, end % 4
    return start <= 1 <= end and start < end


def view_of_channels_last(q: torch.Tensor, args: tuple[Any, ...]) -> bool:
    """Whether ``q.view(*args)`` of channels-last 8-bit ``(N, C, H, W)`` codes (C > 1, H W > 1) asks for another shape.
    The float layer's output that the user's code views (``y.view(y.size(0), -1)``) is NCHW; the codes are channels-last
    only because the int8 kernels want them so: such a view is taken of NCHW codes (a copy; torch's view of the
    channels-last codes raised "view size is not compatible with input tensor's size and stride")."""
    if q.element_size() != 1 or q.is_contiguous() or not q.is_contiguous(memory_format=torch.channels_last):
        return False
    n, c, h, w = q.shape
    if c == 1 or h * w == 1:
        return False
    shape = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
    return tuple(shape) != tuple(q.shape)


def contiguous_codes(q: torch.Tensor) -> torch.Tensor:
    """Channels-last 8-bit codes in NCHW order: one native pass (``native.to_contiguous``: ~2.5x faster than
    torch's uint8 copy for SmallCNN's 64 × 32 × 7 × 7), traced as the opaque ``lowbit::contiguous_codes`` (inlined,
    inductor wrote it as a scalar gather with an integer division per byte: ~2.6x slower than eager's copy)."""
    return torch.ops.lowbit.contiguous_codes(q) if tracing() else nchw_copy(q)


def nchw_copy(q: torch.Tensor) -> torch.Tensor:
    """``q`` copied into contiguous (NCHW) memory: ``native.to_contiguous`` where it takes ``q``, else torch's copy
    (also ``lowbit::contiguous_codes``' implementation)."""
    y = native.to_contiguous(q)
    return q.contiguous() if y is None else y

