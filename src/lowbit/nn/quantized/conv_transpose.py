"""Static quantized ``ConvTranspose1d/2d/3d``.

The weight has shape ``(C_in, C_out/groups, *k)`` and is quantized per channel along **axis 1**::

    y   = conv_transpose(x̂, ŵ) + bias            # x̂ = (q_x - z_x) s_x, ŵ = (q_w - z_w[j]) s_w[j]
    q_y = clamp(round(y / scale) + zero_point)

On CPU the kernel is one ordinary int8 oneDNN conv on the same codes (``lowbit.kernels.conv_transpose``: the stride
phases stacked as output channels; counted as ``("onednn", "conv_transpose")``); weights with zero points and other
devices run the float reference. Only integer padding and ``padding_mode='zeros'``.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized import ConvTranspose1d
>>> m = ConvTranspose1d(1, 1, 2, stride=2)
>>> m.set_weight_bias(Q.quantize_per_channel(torch.ones(1, 1, 2), torch.tensor([0.01]), torch.tensor([0]), 1,
...                                          Q.qint8), torch.zeros(1))
>>> m.set_output_grid(0.1, 0, Q.quint8)
>>> m(Q.quantize_per_tensor(torch.tensor([[[1.0, 2.0]]]), 0.1, 0, Q.quint8)).int_repr().tolist()
[[[10, 10, 20, 20]]]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ... import kernels
from ...compile_state import deferring
from ...kernels import ConvSpec
from ...qscheme import QDtype, quint8
from ...qtensor import QTensor
from ._utils import as_qtensor
from ._weighted import WeightedQuantModule
from .conv import check_channels, ntuple, refused_conv

__all__ = ["ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]


def _concrete(v: Any, bound: int) -> int:
    """An output padding ``0 <= v < bound`` as a Python int. Traced with a dynamic spatial size (``torch.compile``
    after a second image size or ``dynamic=True``, ``torch.export`` with a spatial ``Dim``), torch's rule gives a
    ``SymInt`` (``output_size`` minus a function of the input's size), which the conv's op cannot take (its geometry
    is a string): compared with each candidate, the value it equals becomes a guard (compile: one graph per value;
    export: the program checks it, or refuses a ``Dim`` range with several values, as for any specialisation)."""
    for i in range(bound):  # (not isinstance(v, int): dynamo answers True for a SymInt)
        if v == i:
            return i
    raise ValueError(f"output padding {v} must lie in [0, {bound})")  # (torch's rule checked the range before)


class _ConvTransposeNd(WeightedQuantModule):
    _dim = 2
    _float_type: type[nn.Module] = nn.ConvTranspose2d
    _weight_axis = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1, padding: Any = 0,
                 output_padding: Any = 0, groups: int = 1, bias: bool = True, dilation: Any = 1,
                 padding_mode: str = "zeros", device: Any = None) -> None:
        where, d = type(self).__name__, self._dim
        check_channels(in_channels, out_channels, groups, where)
        if padding_mode != "zeros":
            raise ValueError(f"{where}: padding_mode={padding_mode!r} is not supported (only 'zeros', as in torch)")
        if isinstance(padding, str):
            raise ValueError(f"{where}: padding={padding!r}: string padding is not defined for transposed convs")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = ntuple(kernel_size, d, "kernel_size", where)
        self.stride = ntuple(stride, d, "stride", where)
        self.dilation = ntuple(dilation, d, "dilation", where)
        self.padding = ntuple(padding, d, "padding", where, minimum=0)
        self.output_padding = ntuple(output_padding, d, "output_padding", where, minimum=0)
        for op, st, dl in zip(self.output_padding, self.stride, self.dilation):
            if op >= max(st, dl):  # (torch's conv_transpose refuses it at the first forward, deep in the kernel)
                raise ValueError(f"{where}: output_padding={self.output_padding} must be smaller than stride="
                                 f"{self.stride} or dilation={self.dilation} in each dim")
        self.padding_mode = padding_mode
        super().__init__((in_channels, out_channels // groups, *self.kernel_size), out_channels, bool(bias), device)
        self._spec = ConvSpec(d, self.stride, self.padding, self.dilation, groups, True, self.output_padding)

    def forward(self, input: QTensor | torch.Tensor, output_size: Any = None) -> QTensor:
        """``output_size`` (torch's argument): the output padding that reaches it, as ``nn.ConvTranspose*d``."""
        x, where = input, type(self).__name__
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
        weight, out = self._prepared()
        spec = self._spec
        if output_size is not None:  # torch's own rule picks the padding (and names a size it cannot reach)
            sizes = list(output_size) if isinstance(output_size, (list, tuple, torch.Size)) else None
            lead = 1 if unbatched else 2  # (integer-like: traced shapes are SymInts)
            if sizes is None or len(sizes) not in (self._dim, self._dim + lead) or not all(
                    hasattr(type(v), "__index__") and not isinstance(v, bool) and not (isinstance(v, int) and v < 0)
                    for v in sizes):
                raise ValueError(f"{where}: output_size={output_size!r} must be a list of {self._dim} (or "
                                 f"{self._dim + lead}, with the leading dims) sizes >= 0")
            codes = qx.int_repr()[0] if unbatched else qx.int_repr()  # (the rank the caller gave: torch's rule reads it)
            pad = nn.ConvTranspose1d._output_padding(self, codes, list(output_size), list(self.stride),
                                                     list(self.padding), list(self.kernel_size), self._dim,
                                                     list(self.dilation))
            pad = [_concrete(v, max(st, dl)) for v, st, dl in zip(pad, self.stride, self.dilation)]
            spec = ConvSpec(self._dim, self.stride, self.padding, self.dilation, self.groups, True, tuple(pad))
        y = kernels.conv(qx, weight, self.bias, spec, out, False, self._cache if spec is self._spec else {})
        assert isinstance(y, QTensor)
        return y.reshape(*y.shape[1:]) if unbatched else y

    @classmethod
    def from_reference(cls, conv: nn.Module, weight: QTensor, out_scale: float, out_zero_point: int,
                       out_qdtype: QDtype | str = quint8) -> _ConvTransposeNd:
        """Build from a float transposed conv, its axis-1 per-channel ``weight`` and an output grid."""
        c: Any = conv
        mod = cls(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.output_padding, c.groups,
                  c.bias is not None, c.dilation, c.padding_mode, device=c.weight.device)
        mod.set_weight_bias(weight, None if c.bias is None else c.bias.detach().float())
        mod.set_output_grid(out_scale, out_zero_point, out_qdtype)
        return mod

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, output_padding={self.output_padding}, bias={self.bias is not None}, "
                f"{self._grid_repr()}")


class ConvTranspose1d(_ConvTransposeNd):
    """Quantized ``nn.ConvTranspose1d``."""

    _dim, _float_type = 1, nn.ConvTranspose1d


class ConvTranspose2d(_ConvTransposeNd):
    """Quantized ``nn.ConvTranspose2d``."""

    _dim, _float_type = 2, nn.ConvTranspose2d


class ConvTranspose3d(_ConvTransposeNd):
    """Quantized ``nn.ConvTranspose3d``."""

    _dim, _float_type = 3, nn.ConvTranspose3d
