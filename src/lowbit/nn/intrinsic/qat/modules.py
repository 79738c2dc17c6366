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

``bn_fold="running_stats"`` is lucid's variant instead (``_ConvBnNd``): always that eval-mode fold,
in training too. The BN is never run, so its running statistics stay as they were when fused; the
fold is computed on live tensors, so gradients reach ``W``, ``b``, ``gamma`` and ``beta``::

    y = op(x, wfq(W'), b'),   W' = W * s[c],   b' = (b - running_mean) * s + beta

Pass it to the constructor, or set it on a model before or after ``prepare_qat`` with
``set_bn_fold_mode(model, "running_stats")`` (it also marks ``fuse_modules_qat``'s float markers).
``convert`` folds either mode the same way.

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

from ....compile_state import tracing
from ....fx_leaves import FxLeaf
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
    "freeze_bn_stats", "update_bn_stats", "set_bn_fold_mode",
]

_BN_FOLD_MODES = ("batch_stats", "running_stats")


def _check_bn_fold(owner: str, mode: object) -> str:
    if not isinstance(mode, str) or mode not in _BN_FOLD_MODES:
        raise ValueError(f"{owner}: bn_fold={mode!r} must be one of {_BN_FOLD_MODES}")
    return mode


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


class BnFoldedBase(FxLeaf, nn.Module):
    """``(op, bn)`` with the fold-aware fake-quant forward of the module docstring.

    Children: ``conv`` (or ``linear``) — the float layer, whose parameters are trained; ``bn``;
    ``weight_fake_quant``. ``freeze_bn`` (bool) stops BN statistics from updating. ``bn_fold``:
    ``"batch_stats"`` (default, torch.ao) or ``"running_stats"`` (lucid: the fixed eval-mode fold;
    ``freeze_bn`` then has no effect since the BN never runs).
    """

    _MARKER: type[nn.Module] = nn.Module  # the float marker from_float accepts
    _LAYER: type[nn.Module] = nn.Module
    _BN: type[nn.Module] = nn.Module
    _RELU = False
    _FOLDED: type[nn.Module] = nn.Module  # the QAT module fold() returns
    _layer_name = "conv"
    _TRANSPOSED = False  # a transposed conv: output channels on the weight's axis 1 (conv_transpose_bn.py)
    _bn_fold = "batch_stats"  # (modules pickled before the option existed)

    def __init__(self, layer: nn.Module, bn: nn.Module, qconfig: Any = None, freeze_bn: bool = False,
                 bn_fold: str = "batch_stats") -> None:
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
        init_weight_fake_quant(self, qconfig, transposed=self._TRANSPOSED)
        self.freeze_bn = bool(freeze_bn)
        self.bn_fold = bn_fold
        self.train(layer.training)

    @property
    def bn_fold(self) -> str:
        """``"batch_stats"`` (BN runs on the output) or ``"running_stats"`` (fixed fold, BN never runs)."""
        return self._bn_fold

    @bn_fold.setter
    def bn_fold(self, mode: str) -> None:
        self._bn_fold = _check_bn_fold(type(self).__name__, mode)

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

    def _fold_weights(self, w: torch.Tensor, b: torch.Tensor | None, check: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``fold_bn_weights`` of this layer's kind (a transposed conv's output channels are its weight's axis 1)."""
        return fold_bn_weights(w, b, self.bn, check=check)

    def _scale_weight(self, s: torch.Tensor) -> torch.Tensor:
        """``W * s`` along the output channels (axis 0)."""
        return self.weight * s.reshape([-1] + [1] * (self.weight.dim() - 1))  # (C, 1, ...)

    def _fake_quant(self, w: torch.Tensor) -> torch.Tensor:
        return self.weight_fake_quant(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self._op)

    def _forward(self, x: torch.Tensor, op: Any) -> torch.Tensor:
        """The forward of the module docstring with ``op(x, w)`` the layer's op (bias-free)."""
        self._check_rank(x)
        if self._bn_fold == "running_stats":  # lucid: the eval-mode fold, live in W, b, gamma, beta
            w, b = self._fold_weights(self.weight, self.bias, check=False)  # (C, ...), (C,)
            y = op(x, self._fake_quant(w))  # (N, C, *spatial)
            y = y + b.reshape([1, -1] + [1] * (y.dim() - 2))
            return F.relu(y) if self._RELU else y
        self._check_bn_batch(x, op)
        s = bn_scale(self.bn)  # (C,)
        y = op(x, self._fake_quant(self._scale_weight(s)))  # (N, C, *spatial)
        y_shape = [1, -1] + [1] * (y.dim() - 2)
        # a channel whose BN gamma is 0 (torchvision's zero_init_residual) has s = 0: its folded weight, and so y, is
        # 0, and dividing by s would make it NaN (and every running statistic after it): it divides by 1 instead
        y = y / torch.where(s == 0, torch.ones_like(s), s).reshape(y_shape)
        if self.bias is not None:
            y = y + self.bias.reshape(y_shape)
        y = self.bn(y)
        return F.relu(y) if self._RELU else y

    def _check_bn_batch(self, x: torch.Tensor, op: Any) -> None:
        """A BatchNorm in training needs more than one value per channel (``N * prod(output spatial) > 1``); torch's
        error came after the weight fake-quant had observed (its grid moved) and the BN had counted the batch
        (``num_batches_tracked``), so a skipped batch of one still changed the model. Refused before any of that."""
        if not (self.bn.training and isinstance(x, torch.Tensor) and x.shape[0] == 1) or tracing():
            return
        out = op(torch.empty_like(x, device="meta"), torch.empty_like(self.weight, device="meta")).shape
        if out[0] * (out[2:].numel() if len(out) > 2 else 1) == 1:
            raise ValueError(f"{type(self).__name__}: BatchNorm in training mode needs more than 1 value per channel, "
                             f"got an input of shape {tuple(x.shape)} (output {tuple(out)}); train on batches of 2 "
                             "or more, or use the running statistics (freeze_bn_stats() or eval())")

    def _check_rank(self, x: torch.Tensor) -> None:
        """The BN folds along dim 1 of a batched input, ``(N, C, *spatial)`` or ``(N, features)``, whose rank is the
        weight's: an unbatched conv input or a 3-d Linear input would put the channels elsewhere (silently wrong
        values where the sizes happen to broadcast)."""
        rank = self.weight.dim()
        if isinstance(x, torch.Tensor) and x.dim() != rank:
            layout = {2: "(N, in_features)", 3: "(N, C, L)", 4: "(N, C, H, W)"}.get(rank, "(N, C, D, H, W)")
            raise ValueError(f"{type(self).__name__} expects a {rank}-d input {layout} (batched, the BatchNorm's "
                             f"channels on dim 1), got shape {tuple(x.shape)}")

    def train(self, mode: bool = True) -> BnFoldedBase:
        super().train(mode)
        if self.freeze_bn:
            self.bn.train(False)
        return self

    def get_extra_state(self) -> torch.Tensor:
        """``[freeze_bn, bn_fold index]`` (uint8): a checkpoint resumes with frozen BN statistics and its fold mode
        (torch.ao's ``freeze_bn`` is lost on a reload: the resumed run updated the statistics again)."""
        return torch.tensor([int(self.freeze_bn), _BN_FOLD_MODES.index(self._bn_fold)], dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """Apply ``[freeze_bn, bn_fold index]``. A meta tensor has no values to read: under
        ``load_state_dict(meta_sd, assign=True)`` (a meta checkpoint's shapes) it is checked for shape and dtype and
        the module keeps its settings; elsewhere it is refused."""
        ok = isinstance(state, torch.Tensor) and state.shape == (2,) and not state.is_floating_point() \
            and not state.is_complex()
        if ok and state.is_meta and self.__dict__.get("_loading_assign", False):
            return
        ok = ok and not state.is_meta
        if not ok or int(state[0]) not in (0, 1) or int(state[1]) not in range(len(_BN_FOLD_MODES)):
            raise ValueError(f"{type(self).__name__}: _extra_state={state!r} is not [freeze_bn (0 / 1), bn_fold index "
                             f"into {_BN_FOLD_MODES}] (an integer tensor of 2 entries)")
        self.bn_fold = _BN_FOLD_MODES[int(state[1])]
        if int(state[0]):
            self.freeze_bn_stats()
        else:
            self.update_bn_stats()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        self.__dict__["_loading_assign"] = bool(local_metadata.get("assign_to_params_buffers", False))
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self.__dict__.pop("_loading_assign", None)
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing_keys:  # a checkpoint from before it was saved: keep the state
            missing_keys.remove(key)

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
        q = cls(mod[0], mod[1], qconfig=getattr(mod, "qconfig", None),
                bn_fold=getattr(mod, "bn_fold", "batch_stats"))  # set_bn_fold_mode marks the marker
        return q.train(mod.training)

    def fold(self) -> nn.Module:
        """The QAT layer (``nnqat.Conv2d``, ``nniqat.ConvReLU2d``, ``nnqat.Linear`` ...) with the BN folded in.

        It shares ``qconfig``, ``weight_fake_quant`` and ``activation_post_process`` (if any), so
        ``lowbit.nn.quantized`` ``from_float`` builds the inference module from it.
        """
        w, b = self._fold_weights(self.weight.detach(), None if self.bias is None else self.bias.detach(), check=True)
        layer = self.layer
        if isinstance(layer, nn.Linear):
            out = self._FOLDED(layer.in_features, layer.out_features, True, qconfig=self.qconfig,
                               device=w.device, dtype=w.dtype)
        else:
            kw = self._FOLDED.conv_kwargs(layer)  # type: ignore[attr-defined]
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
        return f"freeze_bn={self.freeze_bn}, bn_fold={self._bn_fold!r}"


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


def set_bn_fold_mode(model: nn.Module, mode: str) -> nn.Module:
    """Set ``bn_fold = mode`` on every QAT conv/linear-BN module of ``model`` and on every float
    ``nni.ConvBn*`` / ``LinearBn1d`` marker (which ``prepare_qat`` then builds in that mode); in place.

    >>> import torch, lowbit as Q
    >>> from torch import nn
    >>> m = Q.fuse_modules_qat(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), [["0", "1"]])
    >>> qat = Q.prepare_qat(set_bn_fold_mode(m, "running_stats"), Q.get_default_qat_qconfig())
    >>> _ = qat(torch.randn(4, 1, 5, 5)); qat[0].bn_fold, int(qat[0].bn.num_batches_tracked)
    ('running_stats', 0)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"set_bn_fold_mode: model must be an nn.Module, got {type(model).__name__}")
    _check_bn_fold("set_bn_fold_mode", mode)
    markers = tuple(cls._MARKER for cls in _bn_classes())
    for mod in model.modules():
        if isinstance(mod, BnFoldedBase) or type(mod) in markers:
            mod.bn_fold = mode
    return model


def _bn_classes() -> list[type[BnFoldedBase]]:
    """Every subclass of ``BnFoldedBase`` that names a float marker (``ConvTransposeBn*d`` live in another module)."""
    out, todo = [], list(BnFoldedBase.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls._MARKER is not nn.Module:
            out.append(cls)
    return out


_BnFolded = BnFoldedBase  # earlier private name, still imported by lowbit.fx.convert
