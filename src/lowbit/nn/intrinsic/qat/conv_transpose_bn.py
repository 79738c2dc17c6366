"""QAT ``ConvTransposeBn1d/2d/3d``: a transposed conv + BatchNorm trained with the BN folded for fake-quant.

torch.ao has no QAT form (its ``fuse_modules_qat`` raises "not yet supported in QAT"). These follow lowbit's
``ConvBnNd`` (``lowbit.nn.intrinsic.qat.modules``) with the transposed conv's layout: weight ``W`` of shape
``(C_in, C_out/G, *k)``, output channel ``o = g·C_out/G + j`` owned by the rows of group ``g`` at column ``j``::

    s = gamma / sqrt(running_var + eps)                                   # (C_out,)
    (W·s)[i, j] = W[i, j] * s[g(i)·C_out/G + j]                           # g(i) = i // (C_in/G): the fold's axis 1
    y = conv_transposeNd(x, wfq(W·s), 0, ...) / s[o] + b[o]               # ≈ conv_transposeNd(x, W, b)
    y = bn(y)                                                             # batch stats in train, running in eval

``wfq`` keeps one grid per weight column ``j`` (axis 1), as the int8 ``ConvTranspose*d`` does (``ch_axis`` 0 in the
qconfig means the weight seen with axis 1 first; see ``lowbit.nn.qat.conv_transpose``). In eval mode (or after
``freeze_bn_stats``) this is ``conv_transposeNd(x, wfq(W'), b')`` with ``(W', b') = fold_bn_weights(W, b, bn,
transpose=True, groups=G)``: what ``fold()`` gives ``convert`` (an ``nnqat.ConvTranspose*d``), so the QAT model in
eval and the converted int8 model agree. ``bn_fold="running_stats"`` trains on that eval fold directly. There is no
ReLU variant (torch.ao has no ConvTranspose-BN-ReLU fusion either): a ReLU after it stays an op of its own.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = ConvTransposeBn2d(nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), nn.BatchNorm2d(6),
...                       qconfig=Q.get_default_qat_qconfig())
>>> y = m(torch.randn(8, 4, 5, 5)); tuple(y.shape), int(m.bn.num_batches_tracked), m.weight_fake_quant.scale.shape
((8, 6, 11, 11), 1, torch.Size([3]))
>>> type(m.fold()).__name__, type(m.to_float()).__name__
('ConvTranspose2d', 'ConvTranspose2d')
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...qat.conv_transpose import ConvTranspose1d as _QConvT1d
from ...qat.conv_transpose import ConvTranspose2d as _QConvT2d
from ...qat.conv_transpose import ConvTranspose3d as _QConvT3d
from .. import modules as nni
from ..fold import fold_bn_weights
from .modules import BnFoldedBase

__all__ = ["ConvTransposeBn1d", "ConvTransposeBn2d", "ConvTransposeBn3d"]


class _ConvTransposeBnNd(BnFoldedBase):
    """``(ConvTransposeNd, BatchNormNd)`` with the fold along the weight's axis 1 (module docstring)."""

    _TRANSPOSED = True
    _FN: Any = None
    _DIM = 2

    def __init__(self, layer: nn.Module, bn: nn.Module, qconfig: Any = None, freeze_bn: bool = False,
                 bn_fold: str = "batch_stats") -> None:
        super().__init__(layer, bn, qconfig=qconfig, freeze_bn=freeze_bn, bn_fold=bn_fold)
        axis = getattr(self.weight_fake_quant, "ch_axis", None)
        # as nnqat.ConvTranspose*d: ch_axis 0 fake-quantizes the weight with its axis 1 (output channels) first
        self.out_channels_first = isinstance(axis, int) and axis in (0, -self.weight.dim())

    def _fold_weights(self, w: torch.Tensor, b: torch.Tensor | None, check: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return fold_bn_weights(w, b, self.bn, transpose=True, groups=self.layer.groups, check=check)

    def _scale_weight(self, s: torch.Tensor) -> torch.Tensor:
        w, g = self.weight, self.layer.groups
        cin, cout_g, *k = w.shape  # (C_in, C_out/G, *k); output channel g·C_out/G + j
        return (w.reshape(g, cin // g, cout_g, *k) * s.reshape(g, 1, cout_g, *[1] * len(k))).reshape(w.shape)

    def _fake_quant(self, w: torch.Tensor) -> torch.Tensor:
        if self.out_channels_first:
            return self.weight_fake_quant(w.movedim(1, 0)).movedim(0, 1)
        return self.weight_fake_quant(w)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        ct: Any = self.layer
        self._check_rank(x)
        output_padding = ct._output_padding(x, output_size, ct.stride, ct.padding, ct.kernel_size, self._DIM,
                                            ct.dilation)

        def op(inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return type(self)._FN(inp, w, None, ct.stride, ct.padding, output_padding, ct.groups, ct.dilation)

        return self._forward(x, op)

    def to_float(self) -> nn.Module:
        """The folded float ``nn.ConvTranspose*d``."""
        return self.fold().to_float()


def _class(d: int, fn: Any, folded: type) -> type[BnFoldedBase]:
    name = f"ConvTransposeBn{d}d"
    doc = (f"QAT ``nni.{name}``: ``{name}(nn.ConvTranspose{d}d, nn.BatchNorm{d}d, qconfig=qc)``; "
           "``forward(x, output_size=None)`` (module docstring).")
    return type(name, (_ConvTransposeBnNd,), {
        "_MARKER": getattr(nni, name), "_LAYER": getattr(nn, f"ConvTranspose{d}d"),
        "_BN": getattr(nn, f"BatchNorm{d}d"), "_FOLDED": folded, "_FN": fn, "_DIM": d,
        "__doc__": doc, "__module__": __name__})


ConvTransposeBn1d = _class(1, F.conv_transpose1d, _QConvT1d)
ConvTransposeBn2d = _class(2, F.conv_transpose2d, _QConvT2d)
ConvTransposeBn3d = _class(3, F.conv_transpose3d, _QConvT3d)
