"""QDQ twin of a quantized Linear / Conv / ConvTranspose (split from ``qdq.py``), lowered to ONNX QDQ nodes::

    Q/DQ(x; s_x) -> Gemm / Conv / ConvTranspose(., DQ(w), DQ(b)) (-> Relu) -> Q/DQ(.; s_y, z_y)

with ``DQ(w) = (q_w - z_w) s_w`` per output channel and the bias as int32 codes ``round(b / (s_x s_w))``
on ``s_x s_w`` (``DequantizeLinear(., s_x s_w, 0)``); ONNX Runtime fuses the pattern into QLinearConv /
QGemm. ``exact.ExactWeightedTwin`` builds on it for ``to_onnx(exact=True)``.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 2), Q.DeQuantStub()).eval()
>>> m.qconfig = Q.get_default_qconfig()
>>> m = Q.prepare(m); _ = m(torch.randn(8, 4)); m = Q.convert(m)
>>> twin = WeightedTwin(m[1], "linear", (float(m[0].scale), int(m[0].zero_point), m[0].qdtype), "int8")
>>> x = m[0](torch.randn(3, 4))
>>> twin(x.dequantize()).shape
torch.Size([3, 2])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .qdq import QDQ, ConstDQ, Grid, _qdq, out_channel_weight_scale, weight_dq

__all__ = ["WeightedTwin"]

_INT32 = 2**31 - 1


class WeightedTwin(nn.Module):
    """Twin of a quantized Linear / Conv / ConvTranspose (``kind``), see the module docstring.

    ``in_grid`` is the grid of the inputs the converted module saw (``None``: quantized per call).
    The bias becomes int32 codes on ``s_x s_w`` when ``in_grid`` is static and the codes fit;
    otherwise it stays float and is added after the op. A Linear's float bias is written ``Sub(y, -b)``
    (the same float32 values): ORT fuses MatMul + Add into a Gemm, and its WeightBiasQuantization then
    rounds that float bias onto the int32 grid ``s_x s_w`` it did not fit (a tiny input scale, from
    all-zero or 1e-10 calibration data: the bias was lost, outputs at the grid's end).
    """

    def __init__(self, mod: Any, kind: str, in_grid: Grid | None, weight_dtype: str) -> None:
        super().__init__()
        self.kind, self.relu = kind, bool(getattr(mod, "_relu", False))
        axis = 1 if kind == "conv_transpose" else 0
        self.in_qdq = _qdq(in_grid)
        # a float-output layer (nnq.LinearFloatOut, from fuse_dequantize) ends at the float value
        self.out_qdq: nn.Module = nn.Identity() if getattr(mod, "float_output", False) else QDQ(
            float(mod.scale), int(mod.zero_point), mod.out_qdtype)
        self.weight = weight_dq(mod.weight_int8, mod.weight_scale, mod.weight_zero_point, axis, weight_dtype)
        self.bias_dq: ConstDQ | None = None
        self.register_buffer("bias_float", None)
        if mod.bias is not None:
            bias = mod.bias.detach().to(torch.float32).cpu()
            wscale = out_channel_weight_scale(mod, kind).to(torch.float64)
            bscale = (in_grid[0] * wscale) if in_grid else None
            if bscale is not None and bool((bias.double() / bscale).abs().max() < _INT32):
                codes = torch.round(bias.double() / bscale).to(torch.int32)
                self.bias_dq = ConstDQ(codes, bscale.to(torch.float32), torch.zeros_like(codes), 0)
            else:
                self.bias_float = bias
        self.in_features: int = getattr(mod, "in_features", 0)
        self.conv_args: dict[str, Any] = {}
        if kind != "linear":
            self.conv_args = {"stride": mod.stride, "dilation": mod.dilation, "groups": mod.groups,
                              "padding": mod._spec.padding}
            if kind == "conv_transpose":
                self.conv_args["output_padding"] = mod.output_padding
                self.output_padding, self.kernel_size = mod.output_padding, tuple(mod.kernel_size)
            self.dim = mod._dim
        self.pad, self.pad_mode = getattr(mod, "_explicit_pad", None), getattr(mod, "padding_mode", "zeros")

    def _op(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv_args: dict[str, Any]) -> torch.Tensor:
        if self.kind == "linear":
            return F.linear(x, w, b)
        fn: Any = {("conv", 1): F.conv1d, ("conv", 2): F.conv2d, ("conv", 3): F.conv3d,
              ("conv_transpose", 1): F.conv_transpose1d, ("conv_transpose", 2): F.conv_transpose2d,
              ("conv_transpose", 3): F.conv_transpose3d}[(self.kind, self.dim)]
        return fn(x, w, b, **conv_args)

    def forward(self, x: torch.Tensor, output_size: Any = None) -> torch.Tensor:
        """``output_size``: a ConvTranspose's torch argument (the output padding that reaches it, fixed in the file)."""
        if output_size is not None:
            if self.kind != "conv_transpose":
                raise TypeError(f"to_onnx: output_size is a ConvTranspose argument, given to a quantized {self.kind}")
            a = self.conv_args  # torch's own rule (and its error for a size it cannot reach), on the caller's rank
            pad = nn.ConvTranspose1d._output_padding(self, x, list(output_size), list(a["stride"]),  # type: ignore[arg-type]
                                                     list(a["padding"]), list(self.kernel_size), self.dim,
                                                     list(a["dilation"]))
            return self._forward(x, {**a, "output_padding": tuple(pad)})
        return self._forward(x, self.conv_args)

    def _core(self, x: torch.Tensor, conv_args: dict[str, Any]) -> torch.Tensor:
        """Q/DQ(input) -> the float op -> (bias, ReLU) -> Q/DQ(output) (``exact.ExactWeightedTwin``: the integer form)."""
        x = self.in_qdq(x)
        y = self._op(x, self.weight(), None if self.bias_dq is None else self.bias_dq(), conv_args)
        if self.bias_float is not None:  # (a Linear's as Sub(y, -b), exact: see the class docstring)
            y = y + self.bias_float.reshape(-1, *([1] * (y.dim() - 2))) if self.kind != "linear" else y - (-self.bias_float)
        if self.relu:
            y = torch.relu(y)
        return self.out_qdq(y)

    def _forward(self, x: torch.Tensor, conv_args: dict[str, Any]) -> torch.Tensor:
        lead, unbatched = None, self.kind != "linear" and x.dim() == self.dim + 1
        if self.kind == "linear" and x.dim() != 2:  # Gemm is 2-D: (*, K) -> (M, K) -> (*, N)
            lead = x.shape[:-1]
            x = x.reshape(-1, self.in_features)
        if unbatched:  # (C, *spatial) as a batch of one, as the module runs it (ONNX's circular Pad needs the batch)
            x = x.unsqueeze(0)
        if self.pad is not None:  # padding float 0.0 = padding codes with the zero point (before Q, so DQ meets Conv)
            x = F.pad(x, self.pad) if self.pad_mode == "zeros" else F.pad(x, self.pad, mode=self.pad_mode)
        y = self._core(x, conv_args)
        if unbatched:
            return y.squeeze(0)
        return y.reshape(*lead, y.shape[-1]) if lead is not None else y

