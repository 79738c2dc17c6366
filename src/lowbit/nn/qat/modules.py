"""QAT modules: float layers whose weight passes through a ``FakeQuantize`` on every forward.

For weight ``W`` and ``wfq = qconfig.weight()`` (a ``FakeQuantize``)::

    Linear:    y = x @ wfq(W).T + b
    ConvNd:    y = convNd(x, wfq(W), b)          # padding (incl. 'same'/'valid') and padding_mode kept
    Embedding: y = wfq(W)[idx]
    EmbeddingBag: y_b = reduce_{j in bag b} psw_j * wfq(W)[idx_j]      # sum / mean / max

``wfq`` rounds in the forward pass and passes the gradient straight through (STE), so training
adapts the weights to the int8 grid. The *output* fake-quant is not part of these modules:
``prepare_qat`` attaches ``activation_post_process`` (from ``qconfig.activation``) as an output
hook, exactly as ``prepare`` attaches observers. ``from_float(mod)`` reads ``mod.qconfig`` and
**shares** ``mod``'s ``Parameter`` objects; ``to_float()`` gives back a plain float module.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> import lowbit.nn.qat as nnqat
>>> lin = nn.Linear(4, 3); lin.qconfig = Q.get_default_qat_qconfig()
>>> q = nnqat.Linear.from_float(lin)
>>> q.weight is lin.weight, q(torch.randn(2, 4)).shape
(True, torch.Size([2, 3]))
>>> nnqat.Linear(4, 3)
Traceback (most recent call last):
...
ValueError: lowbit.nn.qat.Linear needs a qconfig (got None): pass qconfig= or set mod.qconfig before from_float
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...fx_leaves import FxLeaf
from ...qconfig import QConfig
from ...qconfig.config import build

__all__ = ["Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding", "EmbeddingBag", "init_weight_fake_quant"]


def init_weight_fake_quant(mod: nn.Module, qconfig: Any, transposed: bool = False) -> None:
    """Validate ``qconfig`` and give ``mod`` its ``qconfig`` and ``weight_fake_quant = qconfig.weight()``.

    A per-channel weight fake-quant must lie along the output channels: ``ch_axis`` 0 (or ``-W.dim()``); for a
    transposed conv (``transposed``, weight ``(C_in, C_out/groups, *k)``) also 1 (or ``1 - W.dim()``), 0 there meaning
    the weight with axis 1 moved to the front (``lowbit.nn.qat.conv_transpose``), as ``convert`` observes it."""
    owner = f"lowbit.nn.qat.{type(mod).__name__}"
    if qconfig is None:
        raise ValueError(f"{owner} needs a qconfig (got None): pass qconfig= or set mod.qconfig before from_float")
    if not isinstance(qconfig, QConfig):
        raise TypeError(f"{owner}: qconfig must be a lowbit QConfig, got {type(qconfig).__name__}")
    mod.qconfig = qconfig
    mod.weight_fake_quant = build(qconfig, "weight", owner)
    axis, weight = getattr(mod.weight_fake_quant, "ch_axis", None), getattr(mod, "weight", None)
    if not isinstance(axis, int) or not isinstance(weight, torch.Tensor) or not weight.dim():
        return
    n = weight.dim()
    if transposed and axis not in (0, -n, 1, 1 - n):
        raise ValueError(f"{owner}: the weight fake-quant is per channel along ch_axis={axis}, but the int8 transposed "
                         f"conv keeps one grid per output channel, axis 1 of its weight of shape {tuple(weight.shape)} "
                         "(in, out/groups, *kernel): use ch_axis=0 (the weight is fake-quantized with axis 1 moved to "
                         "the front, as convert observes it) or ch_axis=1 in the qconfig's weight")
    if not transposed and axis not in (0, -n):
        # (the whole QAT run trained on those grids; convert then refused them, or silently took a square weight's
        # input-channel scales for its output channels)
        raise ValueError(f"{owner}: the weight fake-quant is per channel along ch_axis={axis}, but the int8 layer "
                         f"keeps one grid per output channel, axis 0 of its weight of shape {tuple(weight.shape)}: "
                         "use ch_axis=0 in the qconfig's weight")


def _check_float(cls: type, mod: nn.Module, float_types: tuple[type, ...]) -> None:
    if type(mod) not in float_types:
        want = " or ".join(t.__name__ for t in float_types)
        raise TypeError(f"{cls.__name__}.from_float expects {want}, got {type(mod).__name__}")


class Linear(FxLeaf, nn.Linear):
    """``y = x @ wfq(W).T + b``; same constructor as ``nn.Linear`` plus ``qconfig`` (required)."""

    _FLOAT_TYPES: tuple[type, ...] = (nn.Linear,)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, qconfig: QConfig | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        init_weight_fake_quant(self, qconfig)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_fake_quant(self.weight), self.bias)

    @classmethod
    def _float_core(cls, mod: nn.Module) -> nn.Linear:
        _check_float(cls, mod, cls._FLOAT_TYPES)
        return mod[0] if isinstance(mod, nn.Sequential) else mod

    @classmethod
    def from_float(cls, mod: nn.Module) -> Linear:
        """QAT twin of ``mod`` (``nn.Linear``) sharing its parameters; ``mod.qconfig`` must be set."""
        lin = cls._float_core(mod)
        q = cls(lin.in_features, lin.out_features, lin.bias is not None, qconfig=getattr(mod, "qconfig", None),
                device=lin.weight.device, dtype=lin.weight.dtype)
        q.weight, q.bias = lin.weight, lin.bias
        return q.train(mod.training)

    def to_float(self) -> nn.Module:
        """A plain ``nn.Linear`` with this module's current weights (no fake-quant)."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        lin.weight = nn.Parameter(self.weight.detach())
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach())
        return lin.train(self.training)


class _ConvNd(FxLeaf):
    """Mixin over ``nn.ConvNd``: ``convNd(x, wfq(W), b)`` with the float conv's padding rules."""

    _FLOAT_TYPES: tuple[type, ...] = ()
    _FLOAT_CONV: type[nn.Module] = nn.Module

    def __init__(self, *args: Any, qconfig: QConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        init_weight_fake_quant(self, qconfig)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight_fake_quant(self.weight), self.bias)  # type: ignore[attr-defined]

    @staticmethod
    def conv_kwargs(conv: nn.Module) -> dict[str, Any]:
        """Constructor arguments reproducing ``conv`` (string padding and ``padding_mode`` included)."""
        return dict(in_channels=conv.in_channels, out_channels=conv.out_channels, kernel_size=conv.kernel_size,
                    stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
                    bias=conv.bias is not None, padding_mode=conv.padding_mode,
                    device=conv.weight.device, dtype=conv.weight.dtype)

    @classmethod
    def from_float(cls, mod: nn.Module) -> Any:
        """QAT twin of ``mod`` (a float conv, or a fused marker led by one) sharing its parameters."""
        _check_float(cls, mod, cls._FLOAT_TYPES)
        conv = mod[0] if isinstance(mod, nn.Sequential) else mod
        q = cls(**cls.conv_kwargs(conv), qconfig=getattr(mod, "qconfig", None))
        q.weight, q.bias = conv.weight, conv.bias
        return q.train(mod.training)

    def to_float(self) -> nn.Module:
        """A plain float conv with this module's current weights (no fake-quant)."""
        conv = self._FLOAT_CONV(**_ConvNd.conv_kwargs(self))  # type: ignore[arg-type]
        conv.weight = nn.Parameter(self.weight.detach())  # type: ignore[attr-defined]
        if self.bias is not None:  # type: ignore[attr-defined]
            conv.bias = nn.Parameter(self.bias.detach())  # type: ignore[attr-defined]
        return conv.train(self.training)  # type: ignore[attr-defined]


class Conv1d(_ConvNd, nn.Conv1d):
    """QAT ``nn.Conv1d``: ``Conv1d(*conv_args, qconfig=qc, **conv_kwargs)``."""

    _FLOAT_TYPES = (nn.Conv1d,)
    _FLOAT_CONV = nn.Conv1d


class Conv2d(_ConvNd, nn.Conv2d):
    """QAT ``nn.Conv2d``: ``Conv2d(*conv_args, qconfig=qc, **conv_kwargs)``."""

    _FLOAT_TYPES = (nn.Conv2d,)
    _FLOAT_CONV = nn.Conv2d


class Conv3d(_ConvNd, nn.Conv3d):
    """QAT ``nn.Conv3d``: ``Conv3d(*conv_args, qconfig=qc, **conv_kwargs)``."""

    _FLOAT_TYPES = (nn.Conv3d,)
    _FLOAT_CONV = nn.Conv3d


class _Table(FxLeaf):
    """Mixin over ``nn.Embedding`` / ``nn.EmbeddingBag``: ``from_float`` shares the float table,
    ``to_float`` copies it back; ``_FLOAT`` is the float class, ``_ATTRS`` its constructor options."""

    _FLOAT: type[nn.Module] = nn.Module
    _ATTRS: tuple[str, ...] = ()

    @classmethod
    def from_float(cls, mod: nn.Module) -> Any:
        """QAT twin of a float table sharing its weight; ``mod.qconfig`` must be set."""
        _check_float(cls, mod, (cls._FLOAT,))
        kw = {a: getattr(mod, a) for a in cls._ATTRS}
        q = cls(mod.num_embeddings, mod.embedding_dim, qconfig=getattr(mod, "qconfig", None), **kw,  # type: ignore[call-arg]
                device=mod.weight.device, dtype=mod.weight.dtype)
        q.weight = mod.weight  # type: ignore[attr-defined]
        return q.train(mod.training)  # type: ignore[attr-defined]

    def to_float(self) -> nn.Module:
        """A plain float table (``nn.Embedding`` / ``nn.EmbeddingBag``) with this module's current weight."""
        me: Any = self
        table = self._FLOAT(me.num_embeddings, me.embedding_dim, **{a: getattr(me, a) for a in self._ATTRS},
                            _weight=me.weight.detach())
        return table.train(me.training)


class Embedding(_Table, nn.Embedding):
    """``y = wfq(W)[idx]``: the table is fake-quantized (per row with the default qconfig); no output fake-quant."""

    _FLOAT = nn.Embedding
    _ATTRS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 qconfig: QConfig | None = None, **kwargs: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, **kwargs)
        init_weight_fake_quant(self, qconfig)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.weight_fake_quant(self.weight), self.padding_idx, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse)


class EmbeddingBag(_Table, nn.EmbeddingBag):
    """``nn.EmbeddingBag`` over ``wfq(W)``: pooled bags of fake-quantized rows; no output fake-quant.

    >>> import torch, lowbit as Q
    >>> import lowbit.nn.qat as nnqat
    >>> bag = torch.nn.EmbeddingBag(10, 4, mode="sum"); bag.qconfig = Q.get_embedding_qat_qconfig()
    >>> q = nnqat.EmbeddingBag.from_float(bag)
    >>> q(torch.tensor([1, 2, 3]), torch.tensor([0, 2])).shape, type(q.to_float()).__name__
    (torch.Size([2, 4]), 'EmbeddingBag')
    """

    _FLOAT = nn.EmbeddingBag
    _ATTRS = ("max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse", "include_last_offset", "padding_idx")

    def __init__(self, num_embeddings: int, embedding_dim: int, *, qconfig: QConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        init_weight_fake_quant(self, qconfig)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return F.embedding_bag(input, self.weight_fake_quant(self.weight), offsets, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.mode, self.sparse, per_sample_weights,
                               self.include_last_offset, self.padding_idx)
