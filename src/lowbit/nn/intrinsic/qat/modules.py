"""QAT fused modules: conv/linear + ReLU, and conv/linear + BatchNorm with the BN folded for fake-quant.

``ConvReLUNd`` / ``LinearReLU``: ``y = relu(op(x, wfq(W), b))``.

``ConvBnNd`` / ``ConvBnReLUNd`` / ``LinearBn1d`` follow torch.ao's ``_ConvBnNd``: the weight that
gets fake-quantized is the one inference will use (BN folded with its running statistics), while
the BN itself still runs on the output so batch statistics update in training::

    s = gamma / sqrt(running_var + eps)                        # (C,)
    y = op(x, wfq(W * s[c]), 0) / s[c] + b                     # ≈ op(x, W, b), through the int8 grid
    y = bn(y)                                                  # batch stats in train, running in eval
    y = relu(y)                                                # ConvBnReLU only

In eval mode (or after ``freeze_bn_stats``) this equals ``op(x, wfq(W'), b')`` with the folded
``(W', b')`` of ``fold_bn_weights`` — what ``convert`` builds, via ``fold()``.

The BN variants are built from modules, ``ConvBn2d(conv, bn, qconfig=qc)`` (the seeds' signature;
torch.ao's takes conv constructor arguments), or with ``from_float`` from the float marker
``fuse_modules_qat`` made. They share the given ``conv``/``bn`` (parameters and statistics).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> import lowbit.nn.intrinsic.qat as nniqat
>>> m = nniqat.ConvBn2d(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), qconfig=Q.get_default_qat_qconfig())
>>> y = m(torch.randn(8, 2, 6, 6)); int(m.bn.num_batches_tracked)
1
>>> _ = m.apply(nniqat.freeze_bn_stats); _ = m(torch.randn(8, 2, 6, 6)); int(m.bn.num_batches_tracked)
1
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...qat.modules import Conv1d as _QConv1d
from ...qat.modules import Conv2d as _QConv2d
from ...qat.modules import Conv3d as _QConv3d
from ...qat.modules import Linear as _QLinear
from ...qat.modules import init_weight_fake_quant
from .. import modules as nni
from ..fold import bn_scale, fold_bn_weights

__all__ = [
    "BnFoldedBase", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d", "LinearReLU",
    "ConvBn1d", "ConvBn2d", "ConvBn3d", "ConvBnReLU1d", "ConvBnReLU2d", "ConvBnReLU3d", "LinearBn1d",
    "freeze_bn_stats", "update_bn_stats",
]


class ConvReLU1d(_QConv1d):
    """``relu(conv1d(x, wfq(W), b))``; ``from_float`` takes a ``nni.ConvReLU1d``."""

    _FLOAT_TYPES = (nni.ConvReLU1d,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class ConvReLU2d(_QConv2d):
    """``relu(conv2d(x, wfq(W), b))``; ``from_float`` takes a ``nni.ConvReLU2d``."""

    _FLOAT_TYPES = (nni.ConvReLU2d,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class ConvReLU3d(_QConv3d):
    """``relu(conv3d(x, wfq(W), b))``; ``from_float`` takes a ``nni.ConvReLU3d``."""

    _FLOAT_TYPES = (nni.ConvReLU3d,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class LinearReLU(_QLinear):
    """``relu(x @ wfq(W).T + b)``; ``from_float`` takes a ``nni.LinearReLU``."""

    _FLOAT_TYPES = (nni.LinearReLU,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class BnFoldedBase(nn.Module):
    """``(op, bn)`` with the fold-aware fake-quant forward of the module docstring.

    Children: ``conv`` (or ``linear``) — the float layer, whose parameters are trained; ``bn``;
    ``weight_fake_quant``. ``freeze_bn`` (bool) stops BN statistics from updating.
    """

    _MARKER: type[nn.Module] = nn.Module  # the float marker from_float accepts
    _LAYER: type[nn.Module] = nn.Module
    _BN: type[nn.Module] = nn.Module
    _RELU = False
    _FOLDED: type[nn.Module] = nn.Module  # the QAT module fold() returns
    _layer_name = "conv"

    def __init__(self, layer: nn.Module, bn: nn.Module, qconfig: Any = None, freeze_bn: bool = False) -> None:
        super().__init__()
        if type(layer) is not self._LAYER or type(bn) is not self._BN:
            raise TypeError(f"{type(self).__name__} expects ({self._LAYER.__name__}, {self._BN.__name__}), "
                            f"got ({type(layer).__name__}, {type(bn).__name__})")
        c = layer.out_channels if hasattr(layer, "out_channels") else layer.out_features
        if bn.num_features != c or not bn.track_running_stats:
            raise ValueError(f"{type(self).__name__}: {bn} cannot follow a layer with {c} output channels "
                             "(num_features must match and track_running_stats must be True)")
        self.add_module(self._layer_name, layer)
        self.bn = bn
        init_weight_fake_quant(self, qconfig)
        self.freeze_bn = bool(freeze_bn)
        self.train(layer.training)

    @property
    def layer(self) -> nn.Module:
        return getattr(self, self._layer_name)

    # nn.Conv-like attributes so code that inspects convs keeps working
    @property
    def weight(self) -> torch.Tensor:
        return self.layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.layer.bias

    def _op(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.layer._conv_forward(x, w, None)  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = bn_scale(self.bn)  # (C,)
        w_shape = [-1] + [1] * (self.weight.dim() - 1)  # (C, 1, ...)
        y = self._op(x, self.weight_fake_quant(self.weight * s.reshape(w_shape)))  # (N, C, *spatial)
        y_shape = [1, -1] + [1] * (y.dim() - 2)
        y = y / s.reshape(y_shape)
        if self.bias is not None:
            y = y + self.bias.reshape(y_shape)
        y = self.bn(y)
        return F.relu(y) if self._RELU else y

    def train(self, mode: bool = True) -> BnFoldedBase:
        super().train(mode)
        if self.freeze_bn:
            self.bn.train(False)
        return self

    def freeze_bn_stats(self) -> BnFoldedBase:
        """Use (and stop updating) the BN running statistics, as inference will."""
        self.freeze_bn = True
        self.bn.train(False)
        return self

    def update_bn_stats(self) -> BnFoldedBase:
        """Resume updating BN running statistics (in training mode)."""
        self.freeze_bn = False
        self.bn.train(self.training)
        return self

    @classmethod
    def from_float(cls, mod: nn.Module) -> BnFoldedBase:
        """From the float marker (``nni.ConvBn2d`` etc.): shares its layer and BN; reads ``mod.qconfig``."""
        if type(mod) is not cls._MARKER:
            raise TypeError(f"{cls.__name__}.from_float expects {cls._MARKER.__name__}, got {type(mod).__name__}")
        q = cls(mod[0], mod[1], qconfig=getattr(mod, "qconfig", None))
        return q.train(mod.training)

    def fold(self) -> nn.Module:
        """The QAT layer (``nnqat.Conv2d``, ``nniqat.ConvReLU2d``, ``nnqat.Linear`` ...) with the BN folded in.

        It shares ``qconfig``, ``weight_fake_quant`` and ``activation_post_process`` (if any), so
        ``lowbit.nn.quantized`` ``from_float`` builds the inference module from it.
        """
        w, b = fold_bn_weights(self.weight.detach(), None if self.bias is None else self.bias.detach(), self.bn)
        layer = self.layer
        if isinstance(layer, nn.Linear):
            out = self._FOLDED(layer.in_features, layer.out_features, True, qconfig=self.qconfig,
                               device=w.device, dtype=w.dtype)
        else:
            kw = _QConv2d.conv_kwargs(layer)
            kw["bias"] = True
            out = self._FOLDED(**kw, qconfig=self.qconfig)
        out.weight, out.bias = nn.Parameter(w), nn.Parameter(b.detach())
        out.weight_fake_quant = self.weight_fake_quant
        if hasattr(self, "activation_post_process"):
            out.activation_post_process = self.activation_post_process
        return out.train(self.training)

    def to_float(self) -> nn.Module:
        """Folded float layer (``nn.Conv2d``, or ``nni.ConvReLU2d`` for the ReLU variants)."""
        return self.fold().to_float() if not self._RELU else type(self)._float_relu(self.fold().to_float())

    @staticmethod
    def _float_relu(layer: nn.Module) -> nn.Module:
        marker = {nn.Conv1d: nni.ConvReLU1d, nn.Conv2d: nni.ConvReLU2d, nn.Conv3d: nni.ConvReLU3d}[type(layer)]
        return marker(layer, nn.ReLU())

    def extra_repr(self) -> str:
        return f"freeze_bn={self.freeze_bn}"


def _bn_class(name: str, marker: type, layer: type, bn: type, folded: type, relu: bool) -> type[BnFoldedBase]:
    doc = f"QAT ``{marker.__name__}``: ``{name}({layer.__name__}, {bn.__name__}, qconfig=qc)`` (see module doc)."
    return type(name, (BnFoldedBase,), {"_MARKER": marker, "_LAYER": layer, "_BN": bn, "_RELU": relu,
                                     "_FOLDED": folded, "__doc__": doc, "__module__": __name__})


ConvBn1d = _bn_class("ConvBn1d", nni.ConvBn1d, nn.Conv1d, nn.BatchNorm1d, _QConv1d, False)
ConvBn2d = _bn_class("ConvBn2d", nni.ConvBn2d, nn.Conv2d, nn.BatchNorm2d, _QConv2d, False)
ConvBn3d = _bn_class("ConvBn3d", nni.ConvBn3d, nn.Conv3d, nn.BatchNorm3d, _QConv3d, False)
ConvBnReLU1d = _bn_class("ConvBnReLU1d", nni.ConvBnReLU1d, nn.Conv1d, nn.BatchNorm1d, ConvReLU1d, True)
ConvBnReLU2d = _bn_class("ConvBnReLU2d", nni.ConvBnReLU2d, nn.Conv2d, nn.BatchNorm2d, ConvReLU2d, True)
ConvBnReLU3d = _bn_class("ConvBnReLU3d", nni.ConvBnReLU3d, nn.Conv3d, nn.BatchNorm3d, ConvReLU3d, True)


class LinearBn1d(_bn_class("_LinearBn1d", nni.LinearBn1d, nn.Linear, nn.BatchNorm1d, _QLinear, False)):
    """QAT ``nni.LinearBn1d``: ``LinearBn1d(nn.Linear, nn.BatchNorm1d, qconfig=qc)``; input ``(N, in_features)``."""

    _layer_name = "linear"

    def _op(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)


def freeze_bn_stats(mod: nn.Module) -> nn.Module:
    """``model.apply(freeze_bn_stats)``: freeze BN statistics of every fused QAT conv/linear-BN."""
    if isinstance(mod, BnFoldedBase):
        mod.freeze_bn_stats()
    return mod


def update_bn_stats(mod: nn.Module) -> nn.Module:
    """``model.apply(update_bn_stats)``: let BN statistics of fused QAT conv/linear-BN update again."""
    if isinstance(mod, BnFoldedBase):
        mod.update_bn_stats()
    return mod


_BnFolded = BnFoldedBase  # earlier private name, still imported by lowbit.fx.convert
