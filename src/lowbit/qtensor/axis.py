"""Where a per-channel QTensor's channel dim lands after a reshape or an index (pure shape arithmetic).

>>> from torch import Size
>>> reshaped_axis(Size([2, 3, 4, 5]), 1, Size([2, 3, 20])), reshaped_axis(Size([2, 3, 4]), 1, Size([6, 4]))
(1, None)
>>> indexed_axis((None, 0), 3, 1), indexed_axis((slice(None), 2), 3, 1)
((1, slice(None, None, None)), (None, 2))
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["reshaped_axis", "indexed_axis"]


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
