"""``LinearFloatOut``: a static int8 Linear whose output is float, for layers read only by float ops.

Same input grid, weights and int32 accumulation as ``Linear``; the epilogue stops at the float value::

    y = acc · s_x s_w + bias   (→ relu)        # float32 (*, out_features); no requantization

A ``Linear`` whose output goes straight into float ops (a residual add before LayerNorm, attention
scores, GELU) is otherwise requantized to 8 bits and dequantized at once: one rounding for nothing,
and a costly one when the output has a few huge channels (MiniLM's FFN down projections reach
190 where the median channel stays near 1). ``lowbit.fuse_dequantize`` swaps such layers in
graph-mode models. The output grid buffers (``scale``/``zero_point``) are kept but unused.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized import Linear
>>> m = Linear(2, 1)
>>> m.set_weight_bias(Q.quantize_per_channel(torch.tensor([[1.0, -1.0]]), torch.tensor([0.01]),
...                                          torch.tensor([0]), 0, Q.qint8), torch.tensor([0.5]))
>>> x = Q.quantize_per_tensor(torch.tensor([[1.0, 2.0]]), 0.1, 0, Q.quint8)
>>> LinearFloatOut.from_linear(m)(x)                      # (1 - 2) · 1.0 + 0.5, as float
tensor([[-0.5000]])
"""

from __future__ import annotations

import copy

import torch

from ... import kernels
from ...compile_state import deferring
from ...qtensor import QTensor
from ._utils import as_qtensor, refused_result
from .linear import Linear

__all__ = ["LinearFloatOut"]


class LinearFloatOut(Linear):
    """Quantized ``nn.Linear`` with a float output (``relu`` kept if built from a ``LinearReLU``).

    ONNX export (``lowbit.export.to_onnx``) writes it as the Linear's QDQ form without the output
    QuantizeLinear/DequantizeLinear pair.
    """

    float_output = True

    def forward(self, input: QTensor | torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = input  # (torch's argument name: fc(input=t) works)
        qx = as_qtensor(x, self.input_grid, type(self).__name__)
        if qx.dim() == 0 or qx.shape[-1] != self.in_features:
            bad = f"{type(self).__name__}: input of shape {{shape}} does not end in in_features={self.in_features}"
            if deferring():  # torch.compile: raised by the compiled program (lowbit::failed), not while tracing
                return refused_result(self, ValueError, bad, qx, (*qx.shape[:-1], self.in_features), qx.int_repr())
            raise ValueError(bad.format(shape=tuple(qx.shape)))
        weight, _ = self._prepared()
        return kernels.linear(qx, weight, self.bias, None, self._relu, self._cache)  # type: ignore[return-value]

    @classmethod
    def from_linear(cls, mod: Linear) -> LinearFloatOut:
        """The same layer (state, input grid, ReLU) with a float output."""
        if not isinstance(mod, Linear):
            raise TypeError(f"LinearFloatOut.from_linear: expected a lowbit.nn.quantized.Linear, got {type(mod).__name__}")
        new = copy.deepcopy(mod)  # every buffer and setting (grids, dtypes, ReLU); this class adds no state
        new.__class__ = cls
        new._relu = type(mod)._relu
        new._cache.clear()
        return new

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"float output{', relu' if self._relu else ''}"
