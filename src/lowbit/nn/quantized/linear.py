"""Static quantized ``Linear`` / ``LinearReLU``: int8 in, int8 weights, int32 accumulation, int8 out.

For a per-tensor input ``x̂ = (q_x - z_x) s_x`` of shape ``(*, in_features)`` and the per-channel
weight ``ŵ = (q_w - z_w) s_w`` of shape ``(out_features, in_features)``::

    acc = Σ_k (q_x - z_x)(q_w - z_w)                    # int32, (*, out_features)
    y   = acc · s_x s_w + bias   (→ relu)                # fused epilogue
    q_y = clamp(round(y / scale) + zero_point)            # the module's output grid (buffers)

The kernel comes from ``lowbit.kernels`` (oneDNN prepacked on x86 CPU, ``torch._int_mm`` elsewhere,
the float reference as the fallback); the packed weight is a cache rebuilt after
``load_state_dict`` / ``.to()``.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized import Linear
>>> m = Linear(2, 1)
>>> m.set_weight_bias(Q.quantize_per_channel(torch.tensor([[1.0, -1.0]]), torch.tensor([0.01]),
...                                          torch.tensor([0]), 0, Q.qint8), torch.tensor([0.5]))
>>> m.set_output_grid(0.05, 128, Q.quint8)
>>> x = Q.quantize_per_tensor(torch.tensor([[1.0, 2.0]]), 0.1, 0, Q.quint8)
>>> m(x).int_repr().tolist()
[[118]]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ... import kernels
from ...qscheme import QDtype, quint8
from ...kernels.plan import linear_plan
from ...compile_state import deferring
from ...qtensor import QTensor
from ._utils import as_qtensor, refused_result
from ._weighted import WeightedQuantModule

__all__ = ["Linear", "LinearReLU"]


def _positive_int(v: Any, name: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{where}: {name}={v!r} must be a positive int")
    return v


class Linear(WeightedQuantModule):
    """Quantized ``nn.Linear``; see the module docstring for the math and state."""

    _float_type = nn.Linear

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None) -> None:
        where = type(self).__name__
        self.in_features = _positive_int(in_features, "in_features", where)
        self.out_features = _positive_int(out_features, "out_features", where)
        super().__init__((out_features, in_features), out_features, bool(bias), device)

    def forward(self, input: QTensor | torch.Tensor) -> QTensor:
        x = input  # (torch's argument name: fc(input=t) works)
        if type(x) is QTensor:
            y = self._lane_call(x)  # (the native call the plan made last time, for an input on the same grid)
            if y is not None:
                return y  # type: ignore[no-any-return]
            q = x._meta
            if q.dim() and q.shape[-1] == self.in_features:
                run = self._plan(x, linear_plan, q)  # the eager floor: one plan per layer state (kernels.plan)
                if run is not None:
                    return run.qt(x)  # type: ignore[no-any-return]
        qx = as_qtensor(x, self.input_grid, type(self).__name__)
        if qx.dim() == 0 or qx.shape[-1] != self.in_features:
            bad = f"{type(self).__name__}: input of shape {{shape}} does not end in in_features={self.in_features}"
            if deferring():  # torch.compile: raised by the compiled program (lowbit::failed), not while tracing
                return refused_result(self, ValueError, bad, qx, (*qx.shape[:-1], self.in_features), qx.int_repr())
            raise ValueError(bad.format(shape=tuple(qx.shape)))
        weight, out = self._prepared()
        return kernels.linear(qx, weight, self._buffers["bias"], out, self._relu, self._cache)  # type: ignore[return-value]

    @classmethod
    def from_reference(cls, linear: nn.Linear, weight: QTensor, out_scale: float, out_zero_point: int,
                       out_qdtype: QDtype | str = quint8) -> Linear:
        """Build from a float ``linear`` (shape, bias), its quantized ``weight`` and an output grid."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device)
        mod.set_weight_bias(weight, None if linear.bias is None else linear.bias.detach().float())
        mod.set_output_grid(out_scale, out_zero_point, out_qdtype)
        return mod

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._grid_repr()}")


class LinearReLU(Linear):
    """``relu(linear(x))`` requantized once (the ReLU runs in the kernel's epilogue)."""

    _relu = True
