"""Input checks of the quantized modules: a float input with NaN, a meta tensor (``RuntimeError`` naming the module).

>>> import torch
>>> try:
...     check_no_nan(torch.tensor([1.0, float("nan")]), "Linear")
... except RuntimeError as e:
...     print(str(e)[:49])
Linear: the float input of shape (2,) holds 1 NaN
"""

from __future__ import annotations

import torch

from ...compile_state import tracing

__all__ = ["check_no_nan", "check_not_meta"]


def check_not_meta(x: torch.Tensor, where: str) -> None:
    """A ``RuntimeError`` for a ``meta`` tensor: quantized modules choose grids and codes from the values, which a
    meta tensor does not have (shape inference runs on the float model)."""
    if x.is_meta:
        raise RuntimeError(f"{where}: a meta tensor (shape {tuple(x.shape)}) has no values to quantize; lowbit's "
                           "quantized modules run on cpu / cuda tensors (infer shapes on the float model)")


def check_no_nan(x: torch.Tensor, where: str) -> None:
    """``RuntimeError`` for a float input holding NaN: int8 codes cannot carry it, and quantizing it would
    turn it into a finite code (the float model outputs NaN there). One reduction over ``x``; while
    ``torch.compile`` / ``torch.export`` trace (no data-dependent branch in a graph) the graph gets the same
    reduction as an ``_assert_async``: the compiled or exported program raises too, instead of finite codes."""
    check_not_meta(x, where)
    if tracing():
        # x != x (true exactly at NaN): inductor vectorises the compare, while its isnan went one element at a time
        # through a scratch buffer on AVX2 (a 8 x 3 x 224^2 Quantize stub: 1.9 -> 0.65 ms compiled, session 28)
        torch._assert_async(torch.logical_not(torch.ne(x, x).any()),
                            f"{where}: the float input holds NaN values; int8 codes cannot represent NaN")
        return
    if x.numel() and bool(torch.isnan(x).any()):
        raise RuntimeError(f"{where}: the float input of shape {tuple(x.shape)} holds {int(torch.isnan(x).sum())} "
                           "NaN values; int8 codes cannot represent NaN (the float model would output NaN) — "
                           "check the data, or keep this part of the model float")
