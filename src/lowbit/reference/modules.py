"""Reference quantized modules: float modules whose quantization is explicit quantize → dequantize.

A reference model runs in float but on the grids of the int8 model, so it states exactly what the
integer model computes (the form backends and exporters lower from, as ``torch.ao``'s
``torch.ao.nn.quantized.reference``). With ``qdq(v; s, z) = (clamp(round(v / s + z), qmin, qmax) - z) * s``::

    QuantDeQuant(x)          = qdq(x; s, z)                                  # an activation grid, per tensor
    Linear(x)                = x @ qdq(W; s_w, z_w).T + b                    # weight grid per output channel
    ConvNd(x)                = convNd(x, qdq(W; s_w, z_w), b)
    ConvTransposeNd(x)       = conv_transposeNd(x, qdq(W; s_w, z_w), b)      # grid per output channel: axis 1
    Embedding(idx)           = qdq(W; s_w, z_w)[idx]                         # per row (float qparams allowed)
    EmbeddingBag(idx, off)   = reduce over bags of qdq(W; s_w, z_w)[idx]

The weight is re-quantized on every call from the float ``weight`` parameter (``get_weight()``),
with the grid in buffers ``weight_scale`` / ``weight_zero_point`` and attributes
``weight_qscheme``, ``weight_dtype``, ``weight_axis``; ``from_float(mod, weight_qparams)`` takes the
grid as ``torch.ao``'s ``weight_qparams`` dict (``{"qscheme", "dtype", "scale", "zero_point",
"axis"}``; lowbit or torch qscheme/dtype spellings). The modules' outputs are float and carry no
output grid: in a reference model (``convert(..., is_reference=True)``) a ``QuantDeQuant`` after each
module holds it.

>>> import torch, lowbit as Q
>>> from lowbit.reference import Linear, weight_qparams_of
>>> fc = torch.nn.Linear(4, 3)
>>> obs = Q.PerChannelMinMaxObserver(ch_axis=0); _ = obs(fc.weight)
>>> ref = Linear.from_float(fc, weight_qparams_of(obs))
>>> ref.weight_qscheme, ref.weight_dtype, ref.weight_axis
(lowbit.per_channel_symmetric, lowbit.qint8, 0)
>>> x = torch.randn(2, 4)
>>> bool((ref(x) - fc(x)).abs().max() < 0.02), ref.get_quantized_weight().int_repr().dtype
(True, torch.int8)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fx_leaves import FxLeaf
from ..functional import dequantize, quantize
from ..observer.base import ObserverBase
from ..qscheme import QDtype, QScheme, as_qdtype, as_qscheme, per_tensor_affine, quint8
from ..nn.quantized._utils import observer_grid
from ..qtensor import QTensor
from .ops import check_grid_dtype

__all__ = ["QuantDeQuant", "FrozenObserver", "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d",
           "ConvTranspose2d", "ConvTranspose3d", "Embedding", "EmbeddingBag",
           "weight_qparams_of", "REFERENCE_MODULES"]


def _qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: QDtype,
         axis: int | None, where: str) -> torch.Tensor:
    """``dequantize(quantize(x))`` on the grid, in ``x``'s dtype (float32 arithmetic); a float16 / bfloat16 grid
    (a module moved with ``.half()``: rounded onto other values) is refused, naming ``where``."""
    check_grid_dtype(where, scale)
    return dequantize(quantize(x, scale, zero_point, qdtype, axis), scale, zero_point, axis).to(x.dtype)


class FrozenObserver(ObserverBase):
    """An observer whose qparams are given, not measured: ``forward`` is the identity (nothing observed),
    ``calculate_qparams()`` returns ``(scale, zero_point)`` — per tensor (0-d) or per channel (``(C,)``).

    ``lower_reference`` hands these to ``convert`` so that the int8 modules are built on exactly the
    grids the reference model recorded.
    """

    _lowbit_fx_leaf = True  # (one node in any torch.fx trace, as torch.ao's reference modules: FxLeaf)

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(self, scale: torch.Tensor | float = 1.0, zero_point: torch.Tensor | float = 0,
                 qscheme: QScheme | str = per_tensor_affine, qdtype: QDtype | str | torch.dtype = quint8,
                 ch_axis: int | None = None) -> None:
        super().__init__(qscheme, qdtype, ch_axis)
        scale = torch.as_tensor(scale, dtype=torch.float32).detach().clone()
        zp_dtype = torch.float32 if self.qscheme.has_float_zero_point else torch.int64
        zero_point = torch.as_tensor(zero_point).detach().to(zp_dtype).clone()
        if scale.shape != zero_point.shape:
            raise ValueError(f"{type(self).__name__}: scale shape {tuple(scale.shape)} != zero_point shape "
                             f"{tuple(zero_point.shape)}")
        if self.qscheme.is_per_channel != (scale.dim() == 1):
            raise ValueError(f"{type(self).__name__}: qscheme={self.qscheme.value} needs "
                             f"{'(C,)' if self.qscheme.is_per_channel else '0-d'} qparams, got shape "
                             f"{tuple(scale.shape)}")
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale.clone(), self.zero_point.clone()


class QuantDeQuant(FxLeaf, nn.Module):
    """``qdq(x; s, z)``: a float value rounded onto a recorded per-tensor activation grid (float in, float out).

    Buffers ``scale`` (0-d float32) and ``zero_point`` (0-d int64); ``qdtype`` the grid's dtype.
    ``from_observer(obs)`` freezes a calibrated observer or fake-quant; ``as_observer()`` gives the
    ``FrozenObserver`` with the same grid.

    >>> import torch, lowbit as Q
    >>> qdq = QuantDeQuant(0.5, 2, Q.quint8)
    >>> qdq(torch.tensor([-1.2, 0.3, 200.0])).tolist()
    [-1.0, 0.5, 126.5]
    """

    _lowbit_fx_leaf = True

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(self, scale: torch.Tensor | float = 1.0, zero_point: torch.Tensor | int = 0,
                 qdtype: QDtype | str | torch.dtype = quint8) -> None:
        super().__init__()
        self.qdtype = as_qdtype(qdtype)
        s = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(())
        z = torch.as_tensor(zero_point).detach().to(torch.int64).reshape(())
        if not (bool(torch.isfinite(s)) and float(s) > 0):
            raise ValueError(f"QuantDeQuant: scale={float(s)!r} must be a positive finite float")
        if not self.qdtype.quant_min <= int(z) <= self.qdtype.quant_max:
            raise ValueError(f"QuantDeQuant: zero_point={int(z)} is outside the {self.qdtype!r} grid")
        self.register_buffer("scale", s.clone())
        self.register_buffer("zero_point", z.clone())

    @classmethod
    def from_observer(cls, obs: nn.Module, where: str = "") -> QuantDeQuant:
        """The grid a calibrated per-tensor observer (or ``FakeQuantize``) describes."""
        return cls(*observer_grid(obs, where or type(obs).__name__))

    def as_observer(self) -> FrozenObserver:
        return FrozenObserver(self.scale, self.zero_point, per_tensor_affine, self.qdtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _qdq(x, self.scale, self.zero_point, self.qdtype, None, "lowbit.reference.QuantDeQuant")

    def extra_repr(self) -> str:
        return f"scale={float(self.scale):.6g}, zero_point={int(self.zero_point)}, qdtype={self.qdtype!r}"


def weight_qparams_of(obs: Any) -> dict[str, Any]:
    """``torch.ao``'s ``weight_qparams`` dict from a lowbit observer/fake-quant that has seen the weight."""
    scale, zero_point = obs.calculate_qparams()
    qscheme = as_qscheme(obs.qscheme)
    return {"qscheme": qscheme, "dtype": as_qdtype(obs.qdtype), "scale": scale, "zero_point": zero_point,
            "axis": getattr(obs, "ch_axis", None) if qscheme.is_per_channel else None}


def _copy_weight_bias(dst: nn.Module, src: nn.Module) -> nn.Module:
    """``dst`` with its own copies (new ``Parameter``s) of ``src``'s float weight and bias."""
    dst.weight = nn.Parameter(src.weight.detach().clone())
    if src.bias is not None:
        dst.bias = nn.Parameter(src.bias.detach().clone())
    return dst


class _WeightQDQ(FxLeaf):
    """Mixin: the weight grid (buffers ``weight_scale``, ``weight_zero_point``) and ``get_weight()``."""

    _lowbit_fx_leaf = True

    weight: nn.Parameter
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor

    def _init_weight_qparams(self, weight_qparams: dict[str, Any] | None) -> None:
        name = f"lowbit.reference.{type(self).__name__}"
        if not isinstance(weight_qparams, dict):
            raise TypeError(f"{name}: weight_qparams must be a dict with qscheme, dtype, scale, zero_point "
                            f"(and axis per channel), got {weight_qparams!r}")
        missing = {"qscheme", "dtype", "scale", "zero_point"} - set(weight_qparams)
        if missing:
            raise ValueError(f"{name}: weight_qparams lacks {sorted(missing)}")
        self.weight_qscheme = as_qscheme(weight_qparams["qscheme"])
        self.weight_dtype = as_qdtype(weight_qparams["dtype"])
        axis = weight_qparams.get("axis") if self.weight_qscheme.is_per_channel else None
        if self.weight_qscheme.is_per_channel and not isinstance(axis, int):
            raise ValueError(f"{name}: a {self.weight_qscheme.value} weight needs an int 'axis', got {axis!r}")
        self.weight_axis = axis
        dev = self.weight.device
        scale = torch.as_tensor(weight_qparams["scale"], dtype=torch.float32, device=dev).detach().clone()
        zero_point = torch.as_tensor(weight_qparams["zero_point"], device=dev).detach()
        zp_dtype = torch.float32 if self.weight_qscheme.has_float_zero_point else torch.int64
        if axis is None:
            scale, zero_point = scale.reshape(()), zero_point.reshape(())
        else:
            n = self.weight.shape[axis]
            scale, zero_point = scale.reshape(-1).expand(n).clone(), zero_point.reshape(-1).expand(n)
        self.register_buffer("weight_scale", scale)  # type: ignore[attr-defined]
        self.register_buffer("weight_zero_point", zero_point.to(zp_dtype).clone())  # type: ignore[attr-defined]

    @property
    def weight_qparams(self) -> dict[str, Any]:
        return {"qscheme": self.weight_qscheme, "dtype": self.weight_dtype, "scale": self.weight_scale,
                "zero_point": self.weight_zero_point, "axis": self.weight_axis}

    def get_weight(self) -> torch.Tensor:
        """``qdq(W)``: the float weight rounded onto its grid (what the int8 module multiplies by)."""
        return _qdq(self.weight, self.weight_scale, self.weight_zero_point, self.weight_dtype, self.weight_axis,
                    f"lowbit.reference.{type(self).__name__}")

    def get_quantized_weight(self) -> QTensor:
        """The weight's codes as a ``QTensor`` (what ``lower_reference`` stores in the int8 module)."""
        codes = quantize(self.weight.detach(), self.weight_scale, self.weight_zero_point, self.weight_dtype,
                         self.weight_axis)
        return QTensor(codes, self.weight_scale, self.weight_zero_point, self.weight_dtype, self.weight_axis)

    def _weight_repr(self) -> str:
        axis = f", weight_axis={self.weight_axis}" if self.weight_axis is not None else ""
        return f"weight_qscheme={self.weight_qscheme.value}, weight_dtype={self.weight_dtype!r}{axis}"


class Linear(_WeightQDQ, nn.Linear):
    """``x @ qdq(W).T + b``; as ``torch.ao.nn.quantized.reference.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, weight_qparams: dict[str, Any] | None = None) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self._init_weight_qparams(weight_qparams)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.get_weight(), self.bias)

    @classmethod
    def from_float(cls, mod: nn.Linear, weight_qparams: dict[str, Any]) -> Linear:
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"lowbit.reference.Linear.from_float expects an nn.Linear, got {type(mod).__name__}")
        ref = cls(mod.in_features, mod.out_features, mod.bias is not None, mod.weight.device, mod.weight.dtype,
                  weight_qparams=weight_qparams)
        return _copy_weight_bias(ref, mod)

    def to_float(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the float weight and bias."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, self.weight.device,
                        self.weight.dtype)
        return _copy_weight_bias(lin, self)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", " + self._weight_repr()


def _conv_kwargs(conv: nn.Module) -> dict[str, Any]:
    return dict(in_channels=conv.in_channels, out_channels=conv.out_channels, kernel_size=conv.kernel_size,
                stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
                bias=conv.bias is not None, padding_mode=conv.padding_mode,
                device=conv.weight.device, dtype=conv.weight.dtype)


class _ConvNd(_WeightQDQ):
    """``convNd(x, qdq(W), b)`` with the float conv's padding rules; as torch.ao's reference convs."""

    _FLOAT: type[nn.Module] = nn.Module
    _kwargs = staticmethod(_conv_kwargs)  # constructor arguments reproducing a float conv

    def __init__(self, *args: Any, weight_qparams: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._FLOAT.__init__(self, *args, **kwargs)  # type: ignore[arg-type]
        self._init_weight_qparams(weight_qparams)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.get_weight(), self.bias)  # type: ignore[attr-defined]

    @classmethod
    def from_float(cls, mod: nn.Module, weight_qparams: dict[str, Any]) -> Any:
        if not isinstance(mod, cls._FLOAT):
            raise TypeError(f"lowbit.reference.{cls.__name__}.from_float expects an nn.{cls._FLOAT.__name__}, "
                            f"got {type(mod).__name__}")
        return _copy_weight_bias(cls(**cls._kwargs(mod), weight_qparams=weight_qparams), mod)

    def to_float(self) -> nn.Module:
        """A plain float conv with the float weight and bias."""
        return _copy_weight_bias(self._FLOAT(**self._kwargs(self)), self)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return self._FLOAT.extra_repr(self) + ", " + self._weight_repr()  # type: ignore[arg-type]


class Conv1d(_ConvNd, nn.Conv1d):
    """Reference ``nn.Conv1d``."""

    _FLOAT = nn.Conv1d


class Conv2d(_ConvNd, nn.Conv2d):
    """Reference ``nn.Conv2d``."""

    _FLOAT = nn.Conv2d


class Conv3d(_ConvNd, nn.Conv3d):
    """Reference ``nn.Conv3d``."""

    _FLOAT = nn.Conv3d


def _conv_transpose_kwargs(conv: nn.Module) -> dict[str, Any]:
    return dict(in_channels=conv.in_channels, out_channels=conv.out_channels, kernel_size=conv.kernel_size,
                stride=conv.stride, padding=conv.padding, output_padding=conv.output_padding, groups=conv.groups,
                bias=conv.bias is not None, dilation=conv.dilation, padding_mode=conv.padding_mode,
                device=conv.weight.device, dtype=conv.weight.dtype)


class _ConvTransposeNd(_ConvNd):
    """``conv_transposeNd(x, qdq(W), b)``; as torch.ao's reference transposed convs (``output_size`` honoured)."""

    _FN: Any = None
    _kwargs = staticmethod(_conv_transpose_kwargs)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        dims = len(self.kernel_size)  # type: ignore[attr-defined]
        output_padding = self._output_padding(x, output_size, self.stride, self.padding,  # type: ignore[attr-defined]
                                              self.kernel_size, dims, self.dilation)  # type: ignore[attr-defined]
        return type(self)._FN(x, self.get_weight(), self.bias, self.stride, self.padding,  # type: ignore[attr-defined]
                              output_padding, self.groups, self.dilation)  # type: ignore[attr-defined]



class ConvTranspose1d(_ConvTransposeNd, nn.ConvTranspose1d):
    """Reference ``nn.ConvTranspose1d``."""

    _FLOAT, _FN = nn.ConvTranspose1d, F.conv_transpose1d


class ConvTranspose2d(_ConvTransposeNd, nn.ConvTranspose2d):
    """Reference ``nn.ConvTranspose2d``."""

    _FLOAT, _FN = nn.ConvTranspose2d, F.conv_transpose2d


class ConvTranspose3d(_ConvTransposeNd, nn.ConvTranspose3d):
    """Reference ``nn.ConvTranspose3d``."""

    _FLOAT, _FN = nn.ConvTranspose3d, F.conv_transpose3d


def _table_options(mod: nn.Module) -> dict[str, Any]:
    """The lookup options of an ``nn.Embedding`` / ``nn.EmbeddingBag`` besides its geometry (``max_norm`` renorms
    looked-up rows in the forward: dropping it changed the outputs)."""
    return {a: getattr(mod, a) for a in ("max_norm", "norm_type", "scale_grad_by_freq", "sparse")}


class Embedding(_WeightQDQ, nn.Embedding):
    """``qdq(W)[idx]`` per row; as ``torch.ao.nn.quantized.reference.Embedding``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 weight_qparams: dict[str, Any] | None = None, **kwargs: Any) -> None:
        nn.Embedding.__init__(self, num_embeddings, embedding_dim, padding_idx, **kwargs)
        self._init_weight_qparams(weight_qparams)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.get_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    @classmethod
    def from_float(cls, mod: nn.Embedding, weight_qparams: dict[str, Any]) -> Embedding:
        if not isinstance(mod, nn.Embedding):
            raise TypeError(f"lowbit.reference.Embedding.from_float expects an nn.Embedding, got {type(mod).__name__}")
        return cls(mod.num_embeddings, mod.embedding_dim, mod.padding_idx, weight_qparams,
                   _weight=mod.weight.detach().clone(), **_table_options(mod))

    def to_float(self) -> nn.Embedding:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                            _weight=self.weight.detach().clone(), **_table_options(self))


class EmbeddingBag(_WeightQDQ, nn.EmbeddingBag):
    """Bags of ``qdq(W)`` rows (sum / mean / max); as ``torch.ao.nn.quantized.reference.EmbeddingBag``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean",
                 weight_qparams: dict[str, Any] | None = None, **kwargs: Any) -> None:
        nn.EmbeddingBag.__init__(self, num_embeddings, embedding_dim, mode=mode, **kwargs)
        self._init_weight_qparams(weight_qparams)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return F.embedding_bag(input, self.get_weight(), offsets, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.mode, self.sparse, per_sample_weights,
                               self.include_last_offset, self.padding_idx)

    @classmethod
    def from_float(cls, mod: nn.EmbeddingBag, weight_qparams: dict[str, Any]) -> EmbeddingBag:
        if not isinstance(mod, nn.EmbeddingBag):
            raise TypeError("lowbit.reference.EmbeddingBag.from_float expects an nn.EmbeddingBag, got "
                            f"{type(mod).__name__}")
        return cls(mod.num_embeddings, mod.embedding_dim, mod.mode, weight_qparams, padding_idx=mod.padding_idx,
                   include_last_offset=mod.include_last_offset, _weight=mod.weight.detach().clone(),
                   **_table_options(mod))

    def to_float(self) -> nn.EmbeddingBag:
        return nn.EmbeddingBag(self.num_embeddings, self.embedding_dim, mode=self.mode, padding_idx=self.padding_idx,
                               include_last_offset=self.include_last_offset, _weight=self.weight.detach().clone(),
                               **_table_options(self))


# float type -> reference class (what convert(..., is_reference=True) swaps a weighted module for)
REFERENCE_MODULES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: Linear, nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d, nn.ConvTranspose3d: ConvTranspose3d,
    nn.Embedding: Embedding, nn.EmbeddingBag: EmbeddingBag,
}
