"""Quantized normalization layers and ``Dropout``: integer codes in, integer codes out.

``LayerNorm``, ``GroupNorm`` and ``InstanceNorm1d/2d/3d`` (torch.ao's ``nn.quantized`` forms) take a
``QTensor`` on any per-tensor 8-bit grid, normalize its values in float32 and quantize the result
onto the module's output grid ``(scale, zero_point, qdtype)`` (the one its ``activation_post_process``
observed)::

    x̂ = (q_in - z_in) * s_in                                          # (*) dequantized input
    y  = (x̂ - mean) / sqrt(var + eps) * weight + bias                 # statistics over the norm's axes
    q  = clamp(round_half_even(y / scale) + zero_point, qmin, qmax)     # (*) output codes

A normalization mixes all values of a row or group, so there is no integer-only form; ``torch.ao``'s
kernels compute the same float math, and the results agree within one output quantum. A float
input is normalized as is. ``Dropout`` is the identity (inference): it returns its input unchanged.

``LayerNorm``, ``GroupNorm``, ``InstanceNorm*`` and ``Dropout`` are **not** in lowbit's default static mapping: by
default such a norm stays float and the next quantized layer requantizes its output on its calibrated input grid
(more accurate on transformers; see docs/design.md). ``BatchNorm2d/3d`` and ``BNReLU2d/3d`` (a BatchNorm not folded
into a conv: DenseNet's pre-activation BN → ReLU, a BN after a cat or an add) are, as in torch.ao's default mapping;
a BatchNorm that normalizes with batch statistics (``track_running_stats=False``) stays float
(``batchnorm_float_reason``); one in training mode at convert is converted on its running statistics, as in torch.ao.
Opt in to the others with a mapping entry::

    mapping = {**Q.get_default_static_quant_module_mappings(), **nnq.normalization.NORM_MAPPINGS}
    qmodel = Q.convert(Q.prepare(model, mapping=mapping), mapping=mapping)

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.normalization import LayerNorm
>>> ln = LayerNorm(4, weight=torch.ones(4), bias=torch.zeros(4), scale=2 / 255, zero_point=128)
>>> qx = Q.quantize_per_tensor(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 0.1, 0, Q.quint8)
>>> [round(v, 2) for v in ln(qx).dequantize()[0].tolist()]
[-1.0, -0.45, 0.45, 1.0]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...fx_leaves import FxLeaf
from ...functional import quantize
from ...qscheme import QDtype, quint8
from ...qtensor import QTensor
from ._checks import check_no_nan
from ._state import CheckedQuantState
from ._utils import check_out_grid, output_qparams

__all__ = ["LayerNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "Dropout",
           "BatchNorm2d", "BatchNorm3d", "BNReLU2d", "BNReLU3d", "NORM_MAPPINGS", "batchnorm_float_reason",
           "check_batchnorm_stats"]


class _QuantizedNorm(CheckedQuantState):
    """Mixin: the output grid buffers and the dequantize → float norm → quantize forward; ``load_state_dict``
    checks the grid and the affine parameters (``CheckedQuantState``)."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    _float_type: type[nn.Module] = nn.Module  # the float module from_float accepts (exact type)

    def _init_grid(self, scale: Any, zero_point: Any, qdtype: Any) -> None:
        s, z, self.qdtype = check_out_grid(scale, zero_point, qdtype, type(self).__name__)
        self.register_buffer("scale", torch.tensor(s, dtype=torch.float32))  # type: ignore[attr-defined]
        self.register_buffer("zero_point", torch.tensor(z, dtype=torch.int64))  # type: ignore[attr-defined]

    def _float_forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, input: Any) -> QTensor:
        x = input  # (torch's argument name: fc(input=t) works)
        if isinstance(x, QTensor):
            x = x.dequantize()
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"quantized {type(self).__name__} expects a QTensor or a float tensor, got {got}")
        if not isinstance(input, QTensor):  # (a NaN would become a finite code)
            check_no_nan(x, f"quantized {type(self).__name__}")
        y = self._float_forward(x.to(torch.float32))
        return QTensor(quantize(y, self.scale, self.zero_point, self.qdtype), self.scale, self.zero_point,
                       self.qdtype)

    @classmethod
    def _from_float_parts(cls, mod: nn.Module) -> tuple[Any, Any, float, int, QDtype]:
        """``(weight, bias, scale, zero_point, qdtype)`` of an observed float norm: its affine parameters
        (float32 copies, or ``None``) and the output grid its ``activation_post_process`` observed."""
        if type(mod) is not cls._float_type:
            raise TypeError(f"quantized {cls.__name__}.from_float expects an nn.{cls._float_type.__name__}, "
                            f"got {type(mod).__name__}")
        s, z, d = output_qparams(mod, cls.__name__)
        w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
        return (None if w is None else w.detach().float()), (None if b is None else b.detach().float()), s, z, d

    def _grid_repr(self) -> str:
        return f"scale={self.scale.item():.6g}, zero_point={self.zero_point.item()}, dtype={self.qdtype!r}"


def _set_affine(mod: nn.Module, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """Store the affine parameters as float32 buffers (no gradients: this is an inference module)."""
    for name, t in (("weight", weight), ("bias", bias)):
        if name in mod._parameters:
            del mod._parameters[name]
        mod.register_buffer(name, None if t is None else t.detach().to(torch.float32).clone())


class LayerNorm(_QuantizedNorm, nn.LayerNorm):
    """``F.layer_norm`` over the last ``len(normalized_shape)`` dims, onto the output grid."""

    _float_type = nn.LayerNorm

    def __init__(self, normalized_shape: Any, weight: torch.Tensor | None, bias: torch.Tensor | None, scale: float,
                 zero_point: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 qdtype: QDtype | str | torch.dtype = quint8) -> None:
        nn.LayerNorm.__init__(self, normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        _set_affine(self, weight, bias)
        self._init_grid(scale, zero_point, qdtype)

    def _float_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    @classmethod
    def from_float(cls, mod: nn.Module) -> LayerNorm:
        w, b, s, z, d = cls._from_float_parts(mod)
        return cls(mod.normalized_shape, w, b, s, z, mod.eps, mod.elementwise_affine, d)

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, {self._grid_repr()}"


class GroupNorm(_QuantizedNorm, nn.GroupNorm):
    """``F.group_norm`` with ``num_groups`` groups over ``num_channels``, onto the output grid."""

    _float_type = nn.GroupNorm

    def __init__(self, num_groups: int, num_channels: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 scale: float, zero_point: int, eps: float = 1e-5, affine: bool = True,
                 qdtype: QDtype | str | torch.dtype = quint8) -> None:
        nn.GroupNorm.__init__(self, num_groups, num_channels, eps=eps, affine=affine)
        _set_affine(self, weight, bias)
        self._init_grid(scale, zero_point, qdtype)

    def _float_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    @classmethod
    def from_float(cls, mod: nn.Module) -> GroupNorm:
        w, b, s, z, d = cls._from_float_parts(mod)
        return cls(mod.num_groups, mod.num_channels, w, b, s, z, mod.eps, mod.affine, d)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, {self._grid_repr()}"


class _InstanceNorm(_QuantizedNorm):
    """``F.instance_norm`` with per-sample statistics (running statistics are not used, as in torch.ao)."""

    def __init__(self, num_features: int, weight: torch.Tensor | None, bias: torch.Tensor | None, scale: float,
                 zero_point: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = False,
                 track_running_stats: bool = False, qdtype: QDtype | str | torch.dtype = quint8) -> None:
        self._float_type.__init__(self, num_features, eps, momentum, affine, track_running_stats)  # type: ignore[call-arg]
        _set_affine(self, weight, bias)
        self._init_grid(scale, zero_point, qdtype)

    _spatial = 1  # spatial dims: 1, 2, 3 for InstanceNorm1d/2d/3d

    def _float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C, *spatial)`` or unbatched ``(C, *spatial)`` as ``nn.InstanceNorm*d`` takes them (an unbatched input
        normalized as it stands would take C as the batch and its first spatial dim as the channels)."""
        name, d = f"quantized {type(self).__name__}", self._spatial
        if x.dim() not in (d + 1, d + 2):
            raise ValueError(f"{name}: expects a {d + 2}-D (N, C, *{d} spatial) or {d + 1}-D unbatched input, "
                             f"got shape {tuple(x.shape)}")
        unbatched = x.dim() == d + 1
        if unbatched:
            x = x.unsqueeze(0)
        c = self.num_features  # type: ignore[attr-defined]
        if x.shape[1] != c and self.weight is not None:
            raise ValueError(f"{name}: input of shape {tuple(x.shape[1:] if unbatched else x.shape)} has "
                             f"{x.shape[1]} channels, the module num_features={c}")
        y = F.instance_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)  # type: ignore[attr-defined]
        return y.squeeze(0) if unbatched else y

    @classmethod
    def from_float(cls, mod: nn.Module) -> Any:
        w, b, s, z, d = cls._from_float_parts(mod)
        return cls(mod.num_features, w, b, s, z, mod.eps, mod.momentum, mod.affine, mod.track_running_stats, d)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, {self._grid_repr()}"  # type: ignore[attr-defined]


class InstanceNorm1d(_InstanceNorm, nn.InstanceNorm1d):
    """Instance norm over ``(N, C, L)``."""

    _float_type = nn.InstanceNorm1d


class InstanceNorm2d(_InstanceNorm, nn.InstanceNorm2d):
    """Instance norm over ``(N, C, H, W)``."""

    _float_type, _spatial = nn.InstanceNorm2d, 2


class InstanceNorm3d(_InstanceNorm, nn.InstanceNorm3d):
    """Instance norm over ``(N, C, D, H, W)``."""

    _float_type, _spatial = nn.InstanceNorm3d, 3


class _BatchNorm(_QuantizedNorm):
    """Inference BatchNorm (running statistics): a per-channel affine map of the codes, as torch.ao's
    ``quantized::batch_norm2d/3d`` (``_relu``: ``batch_norm*_relu``)::

        alpha_c = weight_c / sqrt(var_c + eps) * s_in / s_out,   beta_c = (bias_c - mean_c weight_c / sqrt(var_c + eps)) / s_out
        q = clamp(round_half_even((q_in - z_in) alpha_c + beta_c) + z_out, qmin, qmax)     (ReLU: at least z_out)

    ``alpha`` / ``beta`` are rounded to float32 as torch stores them; the map itself runs in float64 (torch's kernel
    in float32 with fused multiply-adds: its codes can differ by one where the exact value is within float32 error of a
    ``.5`` tie). A float input is normalized in float and quantized onto the output grid."""

    _relu = False
    _spatial = 2

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, scale: float = 1.0,
                 zero_point: int = 0, qdtype: QDtype | str | torch.dtype = quint8) -> None:
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features < 0:
            raise ValueError(f"quantized {type(self).__name__}: num_features={num_features!r} must be an int >= 0")
        self._float_type.__init__(self, num_features, eps, momentum)  # type: ignore[call-arg]
        _set_affine(self, self.weight, self.bias)
        self.eval()
        self._init_grid(scale, zero_point, qdtype)

    def _check_shape(self, x: torch.Tensor) -> None:
        if x.dim() != self._spatial + 2 or x.shape[1] != self.num_features:
            raise ValueError(f"quantized {type(self).__name__}({self.num_features}) expects a "
                             f"{self._spatial + 2}-D input with {self.num_features} channels, got shape {tuple(x.shape)}")

    def _float_forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_shape(x)  # (a wrong channel count was torch's RuntimeError "running_mean should contain ...")
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return F.relu(y) if self._relu else y

    def forward(self, input: Any) -> QTensor:
        x = input
        if not isinstance(x, QTensor) or x.axis is not None:
            return super().forward(x)
        self._check_shape(x)
        f64 = torch.float64
        alpha, beta = self.code_map(x.scale)
        shape = (1, -1) + (1,) * self._spatial
        y = (x.int_repr().double() - x.zero_point.to(f64)) * alpha.view(shape) + beta.view(shape)
        z_out = self.zero_point.to(f64)
        q = torch.round(y) + z_out
        lo = z_out.clamp(min=self.qdtype.quant_min) if self._relu else z_out.new_tensor(float(self.qdtype.quant_min))
        q = torch.maximum(q, lo).clamp(max=self.qdtype.quant_max).to(self.qdtype.storage)
        return QTensor(q, self.scale, self.zero_point, self.qdtype)

    def code_map(self, in_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(alpha, beta)`` of the class doc for inputs on scale ``in_scale`` (float32 values, as float64 tensors)."""
        f32, f64 = torch.float32, torch.float64
        inv = (1.0 / torch.sqrt(self.running_var.to(f32) + torch.tensor(self.eps, dtype=f32)).double()).to(f32)
        w = self.weight if self.weight is not None else torch.ones_like(inv)
        b = self.bias if self.bias is not None else torch.zeros_like(inv)
        iw = inv * w.to(f32)  # (float32, as torch's `inv_sigma * weight_v`)
        # grids as 0-d tensors, never Python numbers: torch.export cannot guard on a buffer's value (same float64 math)
        s_out = self.scale.to(f64)
        alpha = (iw.double() * (in_scale.to(f64) / s_out)).to(f32).double()
        beta = ((b.to(f32) - self.running_mean.to(f32) * iw).double() / s_out).to(f32).double()
        return alpha, beta

    @classmethod
    def from_float(cls, mod: nn.Module) -> Any:
        fused = cls._relu and type(mod).__name__ == cls.__name__  # an nni.BNReLUNd: its BN is mod[0]
        bn = mod[0] if fused else mod  # type: ignore[index]
        if type(bn) is not cls._float_type or cls._relu != fused:
            raise TypeError(f"quantized {cls.__name__}.from_float expects an nn.{cls._float_type.__name__}"
                            f"{' (or its fused BN-ReLU)' if cls._relu else ''}, got {type(mod).__name__}")
        if not bn.track_running_stats or bn.running_mean is None:
            raise ValueError(f"quantized {cls.__name__}.from_float: the BatchNorm has no running statistics "
                             "(track_running_stats=False normalizes with batch statistics; it stays float)")
        check_batchnorm_stats(bn, f"quantized {cls.__name__}.from_float")
        s, z, d = output_qparams(mod if hasattr(mod, "activation_post_process") else bn, cls.__name__)
        new = cls(bn.num_features, bn.eps, bn.momentum, s, z, d)
        _set_affine(new, None if bn.weight is None else bn.weight.detach().float(),
                    None if bn.bias is None else bn.bias.detach().float())
        new.running_mean.copy_(bn.running_mean.float())
        new.running_var.copy_(bn.running_var.float())
        return new

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, {self._grid_repr()}"


def check_batchnorm_stats(bn: nn.Module, who: str) -> None:
    """A ``ValueError`` naming the value where a BatchNorm's inference map has no finite int8 form: ``eps`` below 0 or
    not finite, a running statistic or affine parameter that is NaN / infinite, or a channel whose
    ``running_var + eps`` (float32, as the kernel adds them) is not above 0 (``1 / sqrt(var + eps)`` infinite or NaN:
    the float model's outputs there are too; the codes were clamped garbage).

    >>> from torch import nn
    >>> bn = nn.BatchNorm2d(2, eps=0.0)
    >>> bn.running_var[1] = 0.0
    >>> check_batchnorm_stats(bn, "bn")
    Traceback (most recent call last):
        ...
    ValueError: bn: running_var[1]=0 + eps=0.0 is not above 0 (1/sqrt(running_var + eps) is not finite)
    """
    stats = [getattr(bn, k, None) for k in ("running_mean", "running_var")]
    if not all(isinstance(t, torch.Tensor) for t in stats):  # (track_running_stats=False, or not a BatchNorm)
        raise TypeError(f"{who}: expects a BatchNorm with running statistics, got {type(bn).__name__} whose "
                        f"running_mean / running_var are {[type(t).__name__ for t in stats]}")
    if any(t.is_meta for t in stats):
        raise ValueError(f"{who}: the BatchNorm's running statistics are on the meta device (no values); load them")
    eps = bn.eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"{who}: eps={eps!r} must be a finite number >= 0")
    for name in ("running_mean", "running_var", "weight", "bias"):
        t = getattr(bn, name, None)
        bad = ~torch.isfinite(t.detach()) if isinstance(t, torch.Tensor) else None
        if bad is not None and bad.any():
            c = int(bad.nonzero()[0, 0])
            raise ValueError(f"{who}: {name}[{c}]={t[c].item()} is not finite")
    f32 = torch.float32
    denom = bn.running_var.detach().to(f32) + torch.tensor(eps, dtype=f32)
    bad = ~torch.isfinite(torch.rsqrt(denom)) | (denom <= 0)
    if bad.any():
        c = int(bad.nonzero()[0, 0])
        raise ValueError(f"{who}: running_var[{c}]={bn.running_var[c].item():g} + eps={eps!r} is not above 0 "
                         "(1/sqrt(running_var + eps) is not finite)")


def batchnorm_float_reason(mod: nn.Module) -> str | None:
    """Why a standalone ``BatchNorm2d/3d`` or fused ``BNReLU2d/3d`` must stay float, or ``None`` (it has an int8 form).

    The int8 form applies the running statistics; a BN without them (``track_running_stats=False``) normalizes with
    batch statistics even in eval: it is not converted. A BN in training mode at convert (a QAT model converted
    without ``.eval()``, as torch.ao's ``quantize_qat`` does) is converted, as torch.ao does: the int8 module applies
    the running statistics (inference semantics). Any other module: ``None``.

    >>> from torch import nn
    >>> batchnorm_float_reason(nn.BatchNorm2d(3).train()) is None
    True
    >>> batchnorm_float_reason(nn.BatchNorm2d(3, track_running_stats=False))[:40]
    'BatchNorm without running statistics (tr'
    """
    bn = mod[0] if type(mod).__name__ in ("BNReLU2d", "BNReLU3d") and isinstance(mod, nn.Sequential) else mod
    if type(bn) not in (nn.BatchNorm2d, nn.BatchNorm3d):
        return None
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return "BatchNorm without running statistics (track_running_stats=False: batch statistics even in eval)"
    return None


class BatchNorm2d(_BatchNorm, nn.BatchNorm2d):
    """Inference ``BatchNorm2d`` on int8 codes (torch.ao's ``nn.quantized.BatchNorm2d``)."""

    _float_type = nn.BatchNorm2d


class BatchNorm3d(_BatchNorm, nn.BatchNorm3d):
    """Inference ``BatchNorm3d`` on int8 codes (torch.ao's ``nn.quantized.BatchNorm3d``)."""

    _float_type, _spatial = nn.BatchNorm3d, 3


class BNReLU2d(BatchNorm2d):
    """``relu(bn2d(x))`` on int8 codes (torch.ao's ``nn.intrinsic.quantized.BNReLU2d``)."""

    _relu = True


class BNReLU3d(BatchNorm3d):
    """``relu(bn3d(x))`` on int8 codes (torch.ao's ``nn.intrinsic.quantized.BNReLU3d``)."""

    _relu = True


class Dropout(FxLeaf, nn.Dropout):
    """Inference dropout: the identity on ``QTensor`` (and float) inputs."""

    def forward(self, input: Any) -> Any:
        x = input  # (torch's argument name: fc(input=t) works)
        return x

    @classmethod
    def from_float(cls, mod: nn.Module) -> Dropout:
        if not isinstance(mod, nn.Dropout):
            raise TypeError(f"quantized Dropout.from_float expects an nn.Dropout, got {type(mod).__name__}")
        return cls(mod.p, mod.inplace)


# opt-in mapping entries (float type -> quantized class) for prepare/convert
NORM_MAPPINGS: dict[type[nn.Module], type[nn.Module]] = {
    nn.LayerNorm: LayerNorm, nn.GroupNorm: GroupNorm, nn.InstanceNorm1d: InstanceNorm1d,
    nn.InstanceNorm2d: InstanceNorm2d, nn.InstanceNorm3d: InstanceNorm3d, nn.Dropout: Dropout,
    nn.BatchNorm2d: BatchNorm2d, nn.BatchNorm3d: BatchNorm3d,
}
