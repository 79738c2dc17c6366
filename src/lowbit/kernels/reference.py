"""Reference backend: the float simulation every fast backend is tested against (the oracle).

For an input ``x̂ = (q_x - z_x) s_x`` (per tensor) and a weight ``ŵ = (q_w - z_w) s_w`` (per output
channel)::

    y   = op(x̂, ŵ) + bias                    # op: F.linear / F.convNd / F.conv_transposeNd, float32
    y   = relu(y)                            # if fused
    q_y = clamp(round_half_even(y / s_out) + z_out, qmin, qmax)    # or y itself for a float output

Runs on any device and covers every case (ConvTranspose, affine weights, custom grids).

>>> import torch, lowbit as Q
>>> from lowbit.kernels import reference, OutGrid
>>> x = Q.quantize_per_tensor(torch.tensor([[1.0, 2.0]]), 0.1, 0, Q.quint8)
>>> w = Q.quantize_per_channel(torch.tensor([[1.0, -1.0]]), torch.tensor([0.01]), torch.tensor([0]), 0, Q.qint8)
>>> reference.linear(x, w, None, OutGrid(0.05, 128, Q.quint8)).int_repr().tolist()
[[108]]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..compile_state import tensor_version
from ..functional import quantize
from ..qtensor import QTensor
from . import cuda_fused
from .spec import ConvSpec, OutGrid

__all__ = ["NAME", "linear", "conv"]

NAME = "reference"

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _finish(y: torch.Tensor, out: OutGrid | None, relu: bool) -> QTensor | torch.Tensor:
    if out is not None and cuda_fused.enabled(y.device) and out.qdtype.storage in (torch.uint8, torch.int8):
        # one compiled pass (ReLU: the grid's low clamp)
        qd = out.qdtype
        codes = cuda_fused.requant(y.float(), cuda_fused.grid_tensors(out.scale, out.zero_point, qd.quant_min,
                                                                     qd.quant_max, relu, y.device), qd.storage)
        if codes is not None:
            return out.wrap(codes)
    if relu:
        y = torch.relu(y)
    if out is None:
        return y
    return out.wrap(quantize(y, out.scale, out.zero_point, out.qdtype, validate=False))  # a module's checked grid


def _float_weight(weight: QTensor, cache: dict[str, Any] | None) -> torch.Tensor:
    """``weight.dequantize()``; on CUDA kept in the module's cache per version of the codes and scales (the float
    conv's weight is made once, not per call; on CPU this backend is the oracle and keeps no copy)."""
    if cache is None or weight.int_repr().device.type != "cuda":
        return weight.dequantize()
    w, s, z = weight.int_repr(), weight.scale, weight.zero_point
    key = tuple((t.data_ptr(), tensor_version(t)) for t in (w, s, z))
    hit = cache.get("reference.float_weight")
    if hit is None or hit[0] != key:
        hit = cache["reference.float_weight"] = (key, weight.dequantize(), (w, s, z))  # holds them: no address reuse
    return hit[1]


def linear(x: QTensor, weight: QTensor, bias: torch.Tensor | None, out: OutGrid | None,
           relu: bool = False, cache: dict[str, Any] | None = None) -> QTensor | torch.Tensor:
    """``y = x̂ ŵᵀ + b`` in float32, then requantized onto ``out`` (or returned as float)."""
    return _finish(F.linear(x.dequantize(), weight.dequantize(), bias), out, relu)


def conv(x: QTensor, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid | None,
         relu: bool = False, cache: dict[str, Any] | None = None) -> QTensor | torch.Tensor:
    """``y = conv(x̂, ŵ) + b`` (or the transposed conv) in float32, then requantized onto ``out``."""
    xf, wf = x.dequantize(), _float_weight(weight, cache)
    if spec.transposed:
        y = _CONV_T[spec.dim](xf, wf, bias, spec.stride, spec.padding, spec.output_padding, spec.groups,
                              spec.dilation)
    else:
        y = _CONV[spec.dim](xf, wf, bias, spec.stride, spec.padding, spec.dilation, spec.groups)
    return _finish(y, out, relu)
