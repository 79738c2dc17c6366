"""Static quantized ``Conv1d/2d/3d`` and ``ConvReLU1d/2d/3d``: int8 convolution with a fused epilogue.

For a per-tensor input ``x̂ = (q_x - z_x) s_x`` of shape ``(N, C_in, *spatial)`` (or unbatched
``(C_in, *spatial)``) and the per-output-channel weight ``ŵ`` of shape ``(C_out, C_in/groups, *k)``::

    acc = conv(q_x - z_x, q_w - z_w)                  # int32; padded positions hold z_x (i.e. 0.0)
    y   = acc · s_x s_w[c] + bias[c]   (→ relu)
    q_y = clamp(round(y / scale) + zero_point)         # the module's output grid

``padding='same'`` (possibly asymmetric for even kernels) and ``padding_mode`` ``'reflect'``,
``'replicate'``, ``'circular'`` are honoured by padding the input codes explicitly before the int
kernel (reflect/replicate/circular copy codes, so they commute with quantization exactly).
On x86 CPU the kernel is oneDNN's prepacked int8 conv (1d/2d/3d); elsewhere the float reference.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized import Conv2d
>>> m = Conv2d(1, 1, 3, padding=1)
>>> m.set_weight_bias(Q.quantize_per_channel(torch.ones(1, 1, 3, 3), torch.tensor([0.01]),
...                                          torch.tensor([0]), 0, Q.qint8), torch.zeros(1))
>>> m.set_output_grid(0.1, 0, Q.quint8)
>>> m(Q.quantize_per_tensor(torch.ones(1, 1, 3, 3), 0.1, 0, Q.quint8)).int_repr()[0, 0].tolist()
[[40, 60, 40], [60, 90, 60], [40, 60, 40]]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import kernels
from ...kernels import ConvSpec
from ...kernels.conv_plan import conv_plan
from ...compile_state import deferring
from ...qscheme import QDtype, quint8
from ...qtensor import QTensor
from ._utils import as_qtensor, refused_result
from ._weighted import WeightedQuantModule

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d", "ntuple", "check_channels",
           "refused_conv"]

_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def ntuple(v: Any, n: int, name: str, where: str, minimum: int = 1) -> tuple[int, ...]:
    """``v`` as an ``n``-tuple of ints ``>= minimum`` (an int is repeated), or ``ValueError`` naming it."""
    t = ((v,) * n if isinstance(v, int) and not isinstance(v, bool)
         else tuple(v) if isinstance(v, (tuple, list)) else None)
    if t is None or len(t) != n or not all(isinstance(i, int) and not isinstance(i, bool) and i >= minimum for i in t):
        raise ValueError(f"{where}: {name}={v!r} must be an int >= {minimum} or a tuple of {n} such ints")
    return t


def check_channels(in_channels: Any, out_channels: Any, groups: Any, where: str) -> None:
    for name, v in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{where}: {name}={v!r} must be a positive int")
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"{where}: groups={groups} must divide in_channels={in_channels} "
                         f"and out_channels={out_channels}")


def refused_conv(conv: nn.Module, bad: str, qx: QTensor, shown: torch.Tensor, unbatched: bool) -> QTensor:
    """Under ``torch.compile``: ``conv`` (a quantized conv or transposed conv of ``d`` spatial dims) on zero codes of
    a shape it takes, ``(N, C_in, *spatial)`` (``qx``'s batch and spatial sizes where its rank is ``d + 2``, each
    raised to the kernel's minimum; one sample of the minimum otherwise), as ``lowbit::failed``, which raises
    ``ValueError(bad)`` when the compiled program runs (``{shape}``: ``shown``'s shape)."""
    d = conv._dim
    fits = qx.dim() == d + 2
    least = [max(m, 1) for m in getattr(conv, "_min_in", (1,) * d)]
    spatial = [max(n, m) for n, m in zip(qx.shape[2:], least)] if fits else least
    y = refused_result(conv, ValueError, bad, qx, (qx.shape[0] if fits else 1, conv.in_channels, *spatial), shown)
    return y.reshape(*y.shape[1:]) if unbatched else y  # type: ignore[no-any-return]


class _ConvNd(WeightedQuantModule):
    _dim = 2
    _float_type: type[nn.Module] = nn.Conv2d

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1, padding: Any = 0,
                 dilation: Any = 1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device: Any = None) -> None:
        where, d = type(self).__name__, self._dim
        check_channels(in_channels, out_channels, groups, where)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = ntuple(kernel_size, d, "kernel_size", where)
        self.stride = ntuple(stride, d, "stride", where)
        self.dilation = ntuple(dilation, d, "dilation", where)
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"{where}: padding_mode={padding_mode!r} must be one of {_PADDING_MODES}")
        self.padding_mode = padding_mode
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"{where}: padding={padding!r} must be 'same', 'valid', an int or a tuple")
            if padding == "same" and self.stride != (1,) * d:
                raise ValueError(f"{where}: padding='same' needs stride=1, got stride={stride!r}")
            self.padding_str: str | None = padding
            total = [dl * (k - 1) for dl, k in zip(self.dilation, self.kernel_size)] if padding == "same" else [0] * d
            lr = [(t // 2, t - t // 2) for t in total]
        else:
            self.padding_str = None
            p = ntuple(padding, d, "padding", where, minimum=0)
            lr = [(i, i) for i in p]
        self.padding = tuple(left for left, _ in lr)
        explicit = padding_mode != "zeros" or any(left != right for left, right in lr)
        # F.pad takes (left, right) pairs from the last dim backwards
        self._explicit_pad = [v for pair in reversed(lr) for v in pair] if explicit else None
        super().__init__((out_channels, in_channels // groups, *self.kernel_size), out_channels, bool(bias), device)
        self._spec = ConvSpec(d, self.stride, (0,) * d if explicit else self.padding, self.dilation, groups)
        # the smallest input extent per spatial dim (as given, before any padding) the window fits in, as torch's conv
        self._min_in = tuple(dl * (k - 1) + 1 - left - right
                             for dl, k, (left, right) in zip(self.dilation, self.kernel_size, lr))

    def _pad(self, qx: QTensor) -> QTensor:
        assert self._explicit_pad is not None
        if self.padding_mode == "zeros":  # the QTensor's pad: the zero point's code (traceable, qtensor/ops.py)
            return F.pad(qx, self._explicit_pad)
        q = qx.int_repr()  # copy codes in float32 (exact for 8-bit codes): torch pads integer tensors only with constants
        q = F.pad(q.to(torch.float32), self._explicit_pad, mode=self.padding_mode).to(q.dtype)
        return QTensor(q, qx.scale, qx.zero_point, qx.qdtype)

    def forward(self, input: QTensor | torch.Tensor) -> QTensor:
        x = input  # (torch's argument name: fc(input=t) works)
        if type(x) is QTensor and self._explicit_pad is None:  # (padded: the plan's input is not the module's)
            y = self._lane_call(x)  # the oneDNN call the plan made last time, for input on that grid and shape
            if y is not None:
                return y  # type: ignore[no-any-return]
        where = type(self).__name__
        qx = as_qtensor(x, self.input_grid, where)
        unbatched = qx.dim() == self._dim + 1
        if unbatched:
            qx = qx.reshape(1, *qx.shape)
        if qx.dim() != self._dim + 2 or qx.shape[1] != self.in_channels:
            bad = (f"{where}: expects input of shape (N, {self.in_channels}, *{self._dim} spatial dims) or unbatched, "
                   "got {shape}")
            if deferring():  # torch.compile: raised by the compiled program (lowbit::failed), not while tracing
                return refused_conv(self, bad, qx, qx.int_repr()[0] if unbatched else qx.int_repr(), unbatched)
            raise ValueError(bad.format(shape=tuple(x.shape)))
        # a window larger than the (padded) input: torch's conv raises; the int8 kernels would give an empty output
        if any(n < m for n, m in zip(qx.shape[2:], getattr(self, "_min_in", ()))):
            bad = (f"{where}: input spatial size {{shape}} is smaller than the kernel {self.kernel_size} (dilation "
                   f"{self.dilation}, padding {self.padding}) needs: at least {tuple(max(m, 1) for m in self._min_in)}")
            if deferring():  # (the shown codes: one per spatial position, read from the refused input)
                return refused_conv(self, bad, qx, qx.int_repr().sum((0, 1)), unbatched)
            raise ValueError(bad.format(shape=tuple(qx.shape[2:])))
        if self._explicit_pad is not None:
            qx = self._pad(qx)
        run = self._plan(qx, self._conv_plan)  # the eager floor: one plan per layer state (kernels.conv_plan)
        if run is not None:
            y = run(qx)
            return y.reshape(*y.shape[1:]) if unbatched else y
        weight, out = self._prepared()
        y = kernels.conv(qx, weight, self.bias, self._spec, out, self._relu, self._cache)
        assert isinstance(y, QTensor)
        return y.reshape(*y.shape[1:]) if unbatched else y

    def _conv_plan(self, weight: QTensor, bias: torch.Tensor | None, out: Any, relu: bool, x_qdtype: QDtype) -> Any:
        return conv_plan(weight, bias, out, relu, x_qdtype, self._spec)

    @classmethod
    def from_reference(cls, conv: nn.Module, weight: QTensor, out_scale: float, out_zero_point: int,
                       out_qdtype: QDtype | str = quint8) -> _ConvNd:
        """Build from a float conv (geometry, bias — e.g. a BN-folded one), its quantized ``weight``
        (per channel along axis 0) and an output grid."""
        c: Any = conv
        mod = cls(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation, c.groups,
                  c.bias is not None, getattr(c, "padding_mode", "zeros"), device=c.weight.device)
        mod.set_weight_bias(weight, None if c.bias is None else c.bias.detach().float())
        mod.set_output_grid(out_scale, out_zero_point, out_qdtype)
        return mod

    def extra_repr(self) -> str:
        pad = repr(self.padding_str) if self.padding_str else self.padding
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={pad}")
        if self.dilation != (1,) * self._dim:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        return f"{s}, bias={self.bias is not None}, {self._grid_repr()}"


class Conv1d(_ConvNd):
    """Quantized ``nn.Conv1d``."""

    _dim, _float_type = 1, nn.Conv1d


class Conv2d(_ConvNd):
    """Quantized ``nn.Conv2d``."""

    _dim, _float_type = 2, nn.Conv2d


class Conv3d(_ConvNd):
    """Quantized ``nn.Conv3d``."""

    _dim, _float_type = 3, nn.Conv3d


class ConvReLU1d(Conv1d):
    """``relu(conv1d(x))`` requantized once."""

    _relu = True


class ConvReLU2d(Conv2d):
    """``relu(conv2d(x))`` requantized once."""

    _relu = True


class ConvReLU3d(Conv3d):
    """``relu(conv3d(x))`` requantized once."""

    _relu = True
