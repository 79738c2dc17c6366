"""``lowbit::quantize`` / ``lowbit::dequantize``: ``lowbit.functional`` as opaque custom ops.

``quantize(x, s, z, qdtype, ch_axis) = clamp(round_half_even(x / s) + z, qmin, qmax)`` in
``qdtype``'s storage; ``dequantize(q, s, z, ch_axis) = (q - z) · s`` in float32. Opaque ops keep the
compiler from contracting ``x · (1/s) + z`` into a fused multiply-add (which would move codes at
rounding ties): the compiled program runs exactly the eager arithmetic.

>>> import torch
>>> from lowbit.pt2 import quant_ops
>>> torch.ops.lowbit.dequantize(torch.tensor([3, -10], dtype=torch.int8), torch.tensor(0.1), torch.tensor(0), None).tolist()
[0.30000001192092896, -1.0]
"""

from __future__ import annotations

import torch

from ..compile_state import qdtype_from_key
from ..functional import dequantize, quantize

__all__ = ["like"]


def like(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``y`` with the strides ``torch.empty_like(ref)`` has (what the fake implementations promise)."""
    want = torch.empty_like(ref, dtype=y.dtype)
    return y if y.stride() == want.stride() else want.copy_(y)


@torch.library.custom_op("lowbit::quantize", mutates_args=())
def quantize_op(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: str,
                ch_axis: int | None) -> torch.Tensor:
    return like(quantize(x, scale, zero_point, qdtype_from_key(qdtype), ch_axis), x)


@quantize_op.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: str,
      ch_axis: int | None) -> torch.Tensor:
    return torch.empty_like(x, dtype=qdtype_from_key(qdtype).storage)


@torch.library.custom_op("lowbit::dequantize", mutates_args=())
def dequantize_op(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  ch_axis: int | None) -> torch.Tensor:
    return like(dequantize(q, scale, zero_point, ch_axis), q)


@dequantize_op.register_fake
def _(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, ch_axis: int | None) -> torch.Tensor:
    return torch.empty_like(q, dtype=torch.float32)
