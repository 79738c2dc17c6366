"""``lowbit::quantize`` / ``lowbit::dequantize``: ``lowbit.functional`` as opaque custom ops; ``lowbit::failed``:
a refusal ``torch.compile`` traced (``compile_state.refuse``), raised by the compiled program when it runs.

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

from collections.abc import Callable
from typing import Any

import torch

from ..compile_state import qdtype_from_key
from ..functional import dequantize, quantize

__all__ = ["like", "define", "LIB"]

# one fragment of the ``lowbit`` op namespace per process; ops defined through ``define`` dispatch in
# ~5 µs (``torch.library.custom_op`` adds ~25 µs of Python per call: too much for a per-layer op)
LIB = torch.library.Library("lowbit", "FRAGMENT")


def define(schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> None:
    """Define ``lowbit::<schema>`` with ``impl`` (every device) and its fake implementation."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lowbit::{name}", fake, lib=LIB)


def like(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``y`` with the strides ``torch.empty_like(ref)`` has (what the fake implementations promise). A dense ``ref``
    (contiguous in either memory format) gives ``empty_like`` its own strides: ``y`` with those is returned without
    making the comparison tensor (a full-size allocation per call: ~20 µs for SmallCNN's 64 × 32 × 14 × 14 codes)."""
    if y.shape == ref.shape and y.stride() == ref.stride() and (
            ref.is_contiguous() or ref.is_contiguous(memory_format=torch.channels_last)):
        return y
    want = torch.empty_like(ref, dtype=y.dtype)
    return y if y.stride() == want.stride() else want.copy_(y)


def quantize_op(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: str,
                ch_axis: int | None) -> torch.Tensor:
    return like(quantize(x, scale, zero_point, qdtype_from_key(qdtype), ch_axis), x)


def _quantize_fake(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: str,
      ch_axis: int | None) -> torch.Tensor:
    return torch.empty_like(x, dtype=qdtype_from_key(qdtype).storage)


def dequantize_op(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  ch_axis: int | None) -> torch.Tensor:
    return like(dequantize(q, scale, zero_point, ch_axis), q)


def _dequantize_fake(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, ch_axis: int | None) -> torch.Tensor:
    return torch.empty_like(q, dtype=torch.float32)


define("quantize(Tensor x, Tensor scale, Tensor zero_point, str qdtype, int? ch_axis) -> Tensor", quantize_op,
       _quantize_fake)
define("dequantize(Tensor q, Tensor scale, Tensor zero_point, int? ch_axis) -> Tensor", dequantize_op,
       _dequantize_fake)


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}  # what ``refuse`` defers; anything else: RuntimeError


def failed_op(like: torch.Tensor, refused: torch.Tensor, kind: str, message: str) -> torch.Tensor:
    """Raise lowbit's own refusal, ``kind(message)`` with ``{shape}`` the refused input's shape, where the program
    runs (never returns). ``refused`` also orders it after the steps that made that input (a refusal among them
    raises first, and stays in the program: a layer after a refused one computes on a stand-in, not on its output)."""
    raise _ERRORS.get(kind, RuntimeError)(message.format(shape=tuple(refused.shape)))


def _failed_fake(like: torch.Tensor, refused: torch.Tensor, kind: str, message: str) -> torch.Tensor:
    return torch.empty_like(like)  # (what the refused step would have returned, for the rest of the trace)


define("failed(Tensor like, Tensor refused, str kind, str message) -> Tensor", failed_op, _failed_fake)


def checked_ids_op(idx: torch.Tensor, n: int, where: str) -> torch.Tensor:
    """``idx`` as int64 (a copy), or ``IndexError`` naming the first id outside ``[0, n)``: the eager embedding's own
    refusal, made where a compiled program runs (the ids' values are unknown while ``torch.compile`` traces)."""
    ids = idx.to(torch.int64, copy=True)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        bad = ids[(ids < 0) | (ids >= n)][0].item()
        raise IndexError(f"{where}: index {bad} is out of range for {n} embeddings")
    return ids


def _checked_ids_fake(idx: torch.Tensor, n: int, where: str) -> torch.Tensor:
    return torch.empty_like(idx, dtype=torch.int64)


define("checked_ids(Tensor idx, int n, str where) -> Tensor", checked_ids_op, _checked_ids_fake)
