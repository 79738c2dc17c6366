"""The compiled ``lowbit::qconv_cfg``'s and ``lowbit::qlinear``'s fast entry: a layer's later calls handed to its
plan's lane.

A ``qconv_cfg`` call checks its weight and grids (``checked_weight``, ``check_conv``), keys its plan (``layer_key``)
and then, for an input the lane serves, makes the same oneDNN call as the last one (``kernels.lane.ConvLane``); a
``qlinear`` call does the same with ``check_linear`` and the Linear plan's lane (``kernels.lane.LinearLane``, since
session 49). After such a call, everything those checks and the key read of the layer is fixed by

    (id, _version) of weight, w_scale, w_zero_point, bias, out_scale, out_zero_point;  the weight's address;
    the CPU's VNNI answer;  no pinned backend;  one value in each of the four grid tensors,

so ``arm`` keeps that key with the lane in the weight's cache (``kernel_ops.weight_cache``: emptied when the weight's
version or address moves), under the call's config (``qconv_cfg``'s string; ``qlinear``'s grid strings and ``relu``),
and ``call`` serves a later call whose key matches by
handing its input to the lane. The input's own conditions (shape, dtype, device, its grid tensors and versions) the
lane checks itself: where it declines, or the key differs, ``call`` returns ``None`` and the op's full body runs,
errors included. Tensors without a version (``None``, inference tensors) are keyed by one never-written tensor.
Not armed where ``checked_weight`` put held copies in place of the given grid (AOTInductor's per-call constants are
other objects every call). Saves ~7-15 µs a conv call at batch 1 on the Xeon (``benchmarks/qconv_fast.py``), ~6-10
µs a Linear call (``benchmarks/op_bodies.py``).

>>> import torch
>>> from lowbit.pt2.fast_entry import call
>>> call(None, *([torch.zeros(1)] * 9)) is None   # no entry: the full body runs
True
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels
from ..qtensor import QTensor

__all__ = ["arm", "call"]

_STILL = torch.zeros(0)  # (never written: its version stands for a tensor without one in an entry's key)


def _still(t: torch.Tensor | None) -> torch.Tensor:
    return _STILL if t is None or t.is_inference() else t


def arm(cache: dict[Any, Any], config: Any, lane: Any, x_qdtype: Any, given: tuple[Any, ...],
        grids: tuple[Any, ...], extra: Any) -> None:
    """Keep ``config``'s entry in ``cache`` after a call ``lane`` served: ``given`` the op's ``(weight, w_scale,
    w_zero_point, bias)`` as called, ``grids`` the checked ``(w_scale, w_zero_point, bias, out_scale,
    out_zero_point)``, ``extra`` what ``call`` hands back with the lane's output (the conv's ``(dim, nlc)``: its output
    layout, ``kernel_ops._conv_layout``)."""
    weight, *wgrid = given
    if any(a is not b for a, b in zip(wgrid, grids[:3], strict=True)):
        return
    tensors = tuple(map(_still, grids))  # (never the weight itself: see kernel_ops.cached_weight)
    w_inf = weight.is_inference()
    cache[config] = (grids, tensors, tuple(t._version for t in tensors), w_inf, -1 if w_inf else weight._version,
                     weight.data_ptr(), kernels.onednn.has_vnni(), lane, x_qdtype, extra)


def call(entry: Any, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor, weight: torch.Tensor,
         w_scale: torch.Tensor, w_zero_point: torch.Tensor, bias: torch.Tensor | None, out_scale: torch.Tensor | None,
         out_zero_point: torch.Tensor | None) -> tuple[QTensor, Any] | None:
    """The lane's output and ``arm``'s ``extra`` for a call ``entry`` (``arm``'s, or ``None``) serves, else ``None``."""
    if entry is None:
        return None
    g, (ts, tz, tb, tos, toz) = entry[0], entry[1]
    if (g[0] is w_scale and g[1] is w_zero_point and g[2] is bias and g[3] is out_scale and g[4] is out_zero_point
            and (ts._version, tz._version, tb._version, tos._version, toz._version) == entry[2]
            and (entry[3] or weight._version == entry[4]) and weight.data_ptr() == entry[5]
            and kernels.onednn.has_vnni() is entry[6] and kernels.get_backend() is None
            and x_scale.numel() == 1 == x_zero_point.numel() == out_scale.numel() == out_zero_point.numel()):
        # (the numels: check_conv's / check_linear's per-call grid checks, which a .data swap would change without a
        # version bump)
        y = entry[7](QTensor._trusted(x, x_scale, x_zero_point, entry[8]))
        if y is not None:
            return y, entry[9]
    return None
