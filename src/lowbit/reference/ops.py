"""The quantize / dequantize functions of reference graphs (``convert_to_reference_fx``).

Plain functions of tensors and literals (no ``QDtype`` objects), so a reference graph's code reads
``quantize_per_tensor(x, conv_scale_0, conv_zero_point_0, 0, 255, torch.uint8)`` (the grid: the graph's buffers,
as torch.ao's reference graphs; Python numbers work too)::

    quantize_per_tensor(x, s, z, qmin, qmax, storage)   = clamp(round(x / s + z), qmin, qmax)   as storage
    dequantize_per_tensor(q, s, z)                      = (q - z) * s                          float32
    quantize_per_channel(x, s, z, axis, qmin, qmax, storage), dequantize_per_channel(q, s, z, axis)
                                                        the same with (C,) qparams along axis
    bilinear_per_tensor(x, y, s, z, qmin, qmax, size, scale_factor, align_corners, recompute_scale_factor)
                                                        (bilinear_codes(quantize(x)) - z) * s (the int8 kernel)

They are ``lowbit.quantize`` / ``lowbit.dequantize`` (bit for bit the int8 modules' rounding), in float32
arithmetic. A float64 scale tensor (a reference model moved with ``.double()``: its float32 grids are exact in
float64) gives float64 values; a float16 / bfloat16 one (``.half()`` / ``.bfloat16()`` rounded the grid onto other
values) is refused (``check_grid_dtype``).

>>> import torch
>>> q = quantize_per_tensor(torch.tensor([-1.0, 0.26, 9.0]), 0.1, 10, 0, 255, torch.uint8)
>>> q.tolist(), dequantize_per_tensor(q, 0.1, 10).tolist()[0]
([0, 13, 100], -1.0)
"""

from __future__ import annotations

from typing import Any

import torch

from ..compile_state import graph_leaf
from ..functional import _check_qparams, dequantize, quantize
from ..qscheme import QDtype, as_qdtype
from ..qtensor.resample import bilinear_on_grid

__all__ = ["quantize_per_tensor", "dequantize_per_tensor", "quantize_per_channel", "dequantize_per_channel",
           "bilinear_per_tensor", "check_grid_dtype"]

Grid = float | int | torch.Tensor


def check_grid_dtype(fn: str, scale: Grid) -> torch.dtype:
    """The float dtype of ``fn``'s values on the grid ``scale``: float64 for a float64 scale tensor (float32 grids
    are exact in float64), float32 otherwise; ``TypeError`` for a float16 / bfloat16 scale, a grid that a move of the
    reference model (``.half()``, ``.bfloat16()``, ``.to(dtype)``) rounded onto other values."""
    dtype = scale.dtype if isinstance(scale, torch.Tensor) else torch.float32
    if dtype in (torch.float16, torch.bfloat16):
        raise TypeError(f"{fn}: the grid's scale is {dtype}: the reference model was moved with .half() / "
                        f".bfloat16() / .to({dtype}), which rounds its float32 grids onto other values. Keep a "
                        "reference model in float32 (or float64: .double() holds the grids exactly), or lower it "
                        "(lowbit.lower_reference) and run the int8 model in that dtype")
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grid(quant_min: int, quant_max: int, storage: torch.dtype) -> QDtype:
    base = as_qdtype(storage)  # int8 -> qint8, uint8 -> quint8
    return base if (base.quant_min, base.quant_max) == (quant_min, quant_max) else base.with_range(quant_min, quant_max)


@graph_leaf
def quantize_per_tensor(x: torch.Tensor, scale: Grid, zero_point: Grid, quant_min: int, quant_max: int,
                        storage: torch.dtype) -> torch.Tensor:
    check_grid_dtype("quantize_per_tensor", scale)
    return quantize(x, scale, zero_point, _grid(quant_min, quant_max, storage))


@graph_leaf
def dequantize_per_tensor(q: torch.Tensor, scale: Grid, zero_point: Grid) -> torch.Tensor:
    dtype = check_grid_dtype("dequantize_per_tensor", scale)
    y = dequantize(q, scale, zero_point)
    return y if dtype == torch.float32 else y.to(dtype)


@graph_leaf
def quantize_per_channel(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, quant_min: int,
                         quant_max: int, storage: torch.dtype) -> torch.Tensor:
    check_grid_dtype("quantize_per_channel", scale)
    return quantize(x, scale, zero_point, _grid(quant_min, quant_max, storage), axis)


@graph_leaf
def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    dtype = check_grid_dtype("dequantize_per_channel", scale)
    y = dequantize(q, scale, zero_point, axis)
    return y if dtype == torch.float32 else y.to(dtype)


@graph_leaf
def bilinear_per_tensor(x: torch.Tensor, y: torch.Tensor, scale: Grid, zero_point: Grid, quant_min: int,
                        quant_max: int, size: Any = None, scale_factor: Any = None, align_corners: Any = None,
                        recompute_scale_factor: Any = None) -> torch.Tensor:
    """``F.interpolate(x, ..., mode="bilinear")`` as the int8 model runs it on the codes of ``x`` (values on the grid
    ``(scale, zero_point)``): ``(bilinear_codes(quantize(x)) - z) * s`` (``qtensor.resample.bilinear_on_grid``); ``y``,
    the float op's output quantized and dequantized on that grid, gives the dtype and the gradient. A reference graph
    calls it after a shared-grid bilinear upsample: rounding the float op's output (``y``) moves the kernel's
    near-ties by one step.

    >>> x = torch.tensor([[[[1.0, 1.2]]]])                        # codes 11, 13 on (0.1, 1)
    >>> up = torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear")
    >>> y = dequantize_per_tensor(quantize_per_tensor(up, 0.1, 1, 0, 255, torch.uint8), 0.1, 1)
    >>> out = bilinear_per_tensor(x, y, 0.1, 1, 0, 255, None, 2)
    >>> quantize_per_tensor(out, 0.1, 1, 0, 255, torch.uint8)[0, 0, 0].tolist()  # (12.5: to even, around -z)
    [11, 12, 12, 13]
    >>> quantize_per_tensor(y, 0.1, 1, 0, 255, torch.uint8)[0, 0, 0].tolist()
    [11, 12, 13, 13]
    """
    check_grid_dtype("bilinear_per_tensor", scale)
    for name, p in (("scale", scale), ("zero_point", zero_point)):  # (the blend reshapes them to 0-d)
        if isinstance(p, torch.Tensor) and p.numel() != 1:
            raise ValueError(f"bilinear_per_tensor: {name} of shape {tuple(p.shape)} is not per tensor (one element)")
    _check_qparams("bilinear_per_tensor", scale, zero_point, quant_min, quant_max)  # (as quantize_per_tensor)
    return bilinear_on_grid(x, y, torch.as_tensor(scale), torch.as_tensor(zero_point), quant_min, quant_max, None, size,
                            scale_factor, align_corners, recompute_scale_factor)
