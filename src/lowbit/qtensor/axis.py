"""Where a per-channel QTensor's channel dim lands after a reshape or an index (pure shape arithmetic), or after any
op that selects, moves or repeats codes by index (``traced``: the op run on the codes' channel numbers).

>>> from torch import Size
>>> reshaped_axis(Size([2, 3, 4, 5]), 1, Size([2, 3, 20])), reshaped_axis(Size([2, 3, 4]), 1, Size([6, 4]))
(1, None)
>>> indexed_axis((None, 0), 3, 1), indexed_axis((slice(None), 2), 3, 1)
((1, slice(None, None, None)), (None, 2))
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..compile_state import tracing

__all__ = ["reshaped_axis", "indexed_axis", "traced"]


def reshaped_axis(old: torch.Size, axis: int, new: torch.Size) -> int | None:
    """The dim of ``new`` that holds ``old``'s channel dim ``axis`` intact after a reshape, or ``None``
    when the reshape merges or splits it: the dims before it must multiply to the same size."""
    before, p = 1, 1
    for n in old[:axis]:
        before *= n
    for i, n in enumerate(new):
        if p == before and n == old[axis]:
            return i
        p *= n
    return None


def indexed_axis(idx: Any, ndim: int, axis: int) -> tuple[int | None, Any] | None:
    """``(new axis, channel selector)`` after basic indexing, or ``None`` for advanced indexing."""
    items = idx if isinstance(idx, tuple) else (idx,)
    basic = (int, slice, type(None), type(Ellipsis))
    if any(isinstance(i, bool) or not isinstance(i, basic) for i in items) or items.count(Ellipsis) > 1:
        return None
    fill = [slice(None)] * (ndim - sum(isinstance(i, (int, slice)) for i in items))
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = (*items[:k], *fill, *items[k + 1:])
    else:
        items = (*items, *fill)
    dim_in = dim_out = 0
    for item in items:
        if item is not None and dim_in == axis:
            return (None, item) if isinstance(item, int) else (dim_out, item)
        dim_in += item is not None
        dim_out += not isinstance(item, int)
    return None


def traced(x: Any, op: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``op`` (selecting, moving or repeating elements: flip, roll, repeat, index_select, gather, expand, movedim,
    advanced indexing ...) on the codes of per-channel QTensor ``x``, on the grid that the same ``op`` run on each
    code's channel number says, exactly:

    - the channels vary along one output dim only: per channel along it, the qparams picked as the codes were
      (``flip`` of the channel dim reverses them, ``index_select`` / ``repeat`` pick / tile them);
    - one channel throughout: per tensor on its grid (as an int index, and torch's one-channel slices); a one-channel
      ``x`` stays per channel where the output has its channel dim, of size 1, where ``x`` had it (``roll``);
    - ``None`` where no grid holds the output (channels vary along several dims: ``take`` / ``masked_select`` across
      channels, a ``gather`` along the channel dim), for an empty or meta output, and while traced (no data-dependent read):
      the caller then runs on float values, warned.
    """
    q = op(x.int_repr())  # (first: a bad argument raises torch's own error)
    if tracing() or q.numel() == 0 or q.device.type == "meta":  # (no values to read)
        return None
    c, a = x.scale.numel(), x.axis
    ids = op(torch.arange(c, device=q.device).reshape([c if i == a else 1 for i in range(x.dim())]).expand(x.shape).contiguous())
    flat = ids.reshape(-1)
    first = int(flat[0])
    if bool((flat == first).all()):
        if c == 1 and ids.dim() == x.dim() and ids.shape[a] == 1:
            return x._regrid(q, a)
        return x._regrid(q, None, first)
    for d in range(ids.dim()):
        line = ids[(0,) * d + (slice(None),) + (0,) * (ids.dim() - d - 1)]
        if torch.equal(ids, line.reshape([-1 if i == d else 1 for i in range(ids.dim())]).expand(ids.shape)):
            return x._regrid(q, d, line)
    return None
