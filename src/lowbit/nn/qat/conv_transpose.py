"""QAT ``ConvTranspose1d/2d/3d``: a float transposed conv whose weight passes through a ``FakeQuantize``.

A transposed conv's weight ``W`` has shape ``(C_in, C_out/groups, *k)``; the int8 layer ``convert`` builds
(``lowbit.nn.quantized.ConvTranspose*d``) keeps one grid per output channel, **axis 1**. The weight fake-quant
``wfq = qconfig.weight()`` sees ``W`` exactly as ``convert`` observes it (``nn.quantized._utils.weight_qparams``), so
the trained grid is the converted grid::

    ch_axis 0 (the default qconfigs) or -W.dim():   Ŵ = wfq(W.movedim(1, 0)).movedim(0, 1)
    ch_axis 1 or 1 - W.dim(), or per tensor:        Ŵ = wfq(W)
    y = conv_transposeNd(x, Ŵ, b, stride, padding, output_padding, groups, dilation)   # output_size= honoured

Grouped (``groups = G``): grid ``j`` of axis 1 serves output channel ``j`` of every group (``o = g·C_out/G + j``),
as the int8 layer stores it. Any other ``ch_axis`` is refused when the module is built (``prepare_qat`` /
``prepare_qat_fx`` name the module). The output fake-quant is attached by ``prepare_qat``, as for the other QAT layers.
A transposed conv followed by a BatchNorm trains as ``lowbit.nn.intrinsic.qat.ConvTransposeBn*d`` (``fuse_modules_qat``,
``prepare_qat_fx``), which folds the BN along this axis.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> import lowbit.nn.qat as nnqat
>>> ct = nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2); ct.qconfig = Q.get_default_qat_qconfig()
>>> q = nnqat.ConvTranspose2d.from_float(ct)
>>> q.weight is ct.weight, q(torch.randn(1, 4, 5, 5)).shape, q.weight_fake_quant.scale.shape
(True, torch.Size([1, 6, 11, 11]), torch.Size([3]))
>>> type(q.to_float()).__name__
'ConvTranspose2d'
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...fx_leaves import FxLeaf
from ...qconfig import QConfig
from .modules import init_weight_fake_quant

__all__ = ["ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]


class _ConvTransposeNd(FxLeaf):
    """Mixin over ``nn.ConvTransposeNd``: ``conv_transposeNd(x, Ŵ, b)`` (module docstring)."""

    _FLOAT: type[nn.Module] = nn.Module
    _FN: Any = None
    _DIM = 2

    def __init__(self, *args: Any, qconfig: QConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        init_weight_fake_quant(self, qconfig, transposed=True)  # type: ignore[arg-type]
        me: Any = self
        axis = getattr(me.weight_fake_quant, "ch_axis", None)
        # decided once (an export twin standing in for the fake-quant later has no ch_axis): "output channels first"
        self.out_channels_first = isinstance(axis, int) and axis in (0, -me.weight.dim())

    def fake_quant_weight(self) -> torch.Tensor:
        """``Ŵ``: the weight on its fake-quant grid, per output channel (axis 1) as the converted layer keeps it."""
        me: Any = self
        if self.out_channels_first:  # ch_axis 0: the weight seen with axis 1 first, as convert observes it
            return me.weight_fake_quant(me.weight.movedim(1, 0)).movedim(0, 1)
        return me.weight_fake_quant(me.weight)

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        me: Any = self
        output_padding = me._output_padding(input, output_size, me.stride, me.padding, me.kernel_size, self._DIM,
                                            me.dilation)
        return type(self)._FN(input, self.fake_quant_weight(), me.bias, me.stride, me.padding, output_padding,
                              me.groups, me.dilation)

    @staticmethod
    def conv_kwargs(conv: nn.Module) -> dict[str, Any]:
        """Constructor arguments reproducing the transposed conv ``conv``."""
        c: Any = conv
        return dict(in_channels=c.in_channels, out_channels=c.out_channels, kernel_size=c.kernel_size,
                    stride=c.stride, padding=c.padding, output_padding=c.output_padding, groups=c.groups,
                    bias=c.bias is not None, dilation=c.dilation, padding_mode=c.padding_mode,
                    device=c.weight.device, dtype=c.weight.dtype)

    @classmethod
    def from_float(cls, mod: nn.Module) -> Any:
        """QAT twin of ``mod`` (exactly ``cls``'s float transposed conv) sharing its parameters; ``mod.qconfig``
        must be set."""
        if type(mod) is not cls._FLOAT:
            raise TypeError(f"{cls.__name__}.from_float expects {cls._FLOAT.__name__}, got {type(mod).__name__}")
        q = cls(**cls.conv_kwargs(mod), qconfig=getattr(mod, "qconfig", None))
        q.weight, q.bias = mod.weight, mod.bias
        return q.train(mod.training)

    def to_float(self) -> nn.Module:
        """A plain float transposed conv with this module's current weights (no fake-quant)."""
        me: Any = self
        conv = self._FLOAT(**_ConvTransposeNd.conv_kwargs(self))  # type: ignore[arg-type]
        conv.weight = nn.Parameter(me.weight.detach())
        if me.bias is not None:
            conv.bias = nn.Parameter(me.bias.detach())
        return conv.train(me.training)


class ConvTranspose1d(_ConvTransposeNd, nn.ConvTranspose1d):
    """QAT ``nn.ConvTranspose1d``: ``ConvTranspose1d(*args, qconfig=qc, **kwargs)``."""

    _FLOAT, _FN, _DIM = nn.ConvTranspose1d, F.conv_transpose1d, 1


class ConvTranspose2d(_ConvTransposeNd, nn.ConvTranspose2d):
    """QAT ``nn.ConvTranspose2d``: ``ConvTranspose2d(*args, qconfig=qc, **kwargs)``."""

    _FLOAT, _FN, _DIM = nn.ConvTranspose2d, F.conv_transpose2d, 2


class ConvTranspose3d(_ConvTransposeNd, nn.ConvTranspose3d):
    """QAT ``nn.ConvTranspose3d``: ``ConvTranspose3d(*args, qconfig=qc, **kwargs)``."""

    _FLOAT, _FN, _DIM = nn.ConvTranspose3d, F.conv_transpose3d, 3
