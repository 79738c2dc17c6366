"""Dynamic int8 ``Linear``: int8 per-channel weights, activations quantized per token at each call.

For an input flattened to ``x`` ``(M, K)`` and the weight ``W`` ``(N, K)``::

    s_w[n], z_w[n] = per-channel symmetric qint8 (z_w = 0)                 # once, in from_float
    s_x[m], z_x[m] = affine quint8 over row m's [min(x_m, 0), max(x_m, 0)]  # each call, per token
    q_x = clamp(round(x / s_x[m]) + z_x[m], 0, 255)                         # (M, K) u8
    acc = Σ_k (q_x - z_x[m]) (q_w - z_w[n])                                 # (M, N) int32 accumulation
    y   = acc · s_x[m] s_w[n] + bias[n]                                     # (M, N) float, reshaped to (*, N)

Per-token asymmetric 8-bit activations (256 levels per row, on the row's own range) keep the
relative error near 1 % even when some tokens carry outliers; ``torch.ao``'s ``quantize_dynamic``
uses one 7-bit (reduce_range) grid for the whole tensor, which is what loses accuracy on
transformers (MiniLM sentence embeddings: cosine 0.999 here vs 0.93). The integer GEMM runs
through ``lowbit.kernels`` (oneDNN prepacked on x86 CPU, ``torch._int_mm`` on CUDA): the kernels
take one activation grid per call, so ``per_token_linear`` applies the per-row grids in its
epilogue; the forward runs ``per_token.dynamic_linear``, the same codes with no per-call
validation (``torch._int_mm`` at M = 1 on VNNI CPUs, see ``per_token.py``). ``dtype=torch.float16``
instead stores the weight in float16 and computes in the input's dtype (weight-only compression).

``activation`` picks the activation recipe (``reduced.py``): ``"per_token"`` (the default above),
``"per_token_7bit"`` (the same on ``quint8[0, 127]``: one exact call without VNNI) or ``"per_tensor_7bit"``
(torch.ao's x86 dynamic Linear, bit for bit: one 7-bit grid per input). ``from_float`` reads it from the
module's qconfig: ``get_dynamic_qconfig(reduce_range=True)`` / ``get_dynamic_qconfig(backend="x86")``.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.dynamic import Linear
>>> fc = torch.nn.Linear(64, 32)
>>> qfc = Linear.from_float(fc)
>>> x = torch.randn(4, 64)
>>> bool(((qfc(x) - fc(x)).norm() / fc(x).norm()) < 0.02), qfc.weight().qdtype
(True, lowbit.qint8)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ....compile_state import deferring, qdtype_key, tracing
from ....qparams import calculate_qparams
from ....nn.intrinsic import LinearReLU as _LinearReLUMarker
from ....qscheme import QDtype, QScheme, as_qdtype, qint8, quint8
from ....qtensor import QTensor, quantize_per_channel
from .._utils import (check_finite_weight, check_not_meta, check_precomputed_flag, quantize_weight, refused_call,
                      weight_qparams)
from .._state import CheckedQuantState
from . import reduced
from .per_token import U7, dynamic_linear, per_token_linear, quantize_per_token

__all__ = ["Linear", "LinearReLU", "quantize_per_token", "per_token_linear"]


def _dtype_arg(dtype: Any, where: str) -> QDtype | torch.dtype:
    if dtype in (torch.float16, "float16"):
        return torch.float16
    d = as_qdtype(dtype)
    if d.storage != torch.int8:
        raise ValueError(f"{where}: dtype={dtype!r} is not supported; use lowbit.qint8 or torch.float16")
    return d


def _activation_arg(activation: Any, where: str) -> str:
    if activation not in reduced.ACTIVATIONS:
        raise ValueError(f"{where}: activation={activation!r} is not one of {list(reduced.ACTIVATIONS)}")
    return activation


def activation_of(owner: nn.Module | None, where: str) -> str:
    """The activation recipe of ``owner.qconfig.activation()`` (lowbit's ``"per_token"`` without one):
    ``quint8`` per token, or ``quint8[0, 127]`` per token / per tensor (``PlaceholderObserver(per_token=...)``)."""
    qc = getattr(owner, "qconfig", None)
    if qc is None or getattr(qc, "activation", None) is None:
        return "per_token"
    obs = qc.activation()
    qd, per_token = getattr(obs, "qdtype", quint8), getattr(obs, "per_token", True)
    if qd == U7:
        return "per_token_7bit" if per_token else "per_tensor_7bit"
    if not per_token:
        raise ValueError(f"{where}: per-tensor dynamic activations need the 7-bit grid quint8[0, 127] "
                         f"(get_dynamic_qconfig(backend='x86')), got qdtype={qd!r}")
    return "per_token"


FP16_MAX = 65504.0  # torch.finfo(torch.float16).max


def fp16_dynamic_weight(weight: torch.Tensor, where: str) -> torch.Tensor:
    """The float16 copy of a float weight (``dtype=torch.float16``): a meta or NaN/Inf weight is an error naming
    ``where`` (as for int8); values past ±65504 saturate there with a warning, as torch.ao's fp16 prepack does
    (``.to(torch.float16)`` made them ±inf: every output reading them was ±inf / NaN)."""
    check_not_meta(weight, f"{where}.from_float")
    check_finite_weight(weight, f"{where}.from_float")
    w = weight.detach()
    over = int((w.abs() > FP16_MAX).sum())
    if over:
        warnings.warn(f"{where}.from_float: {over} weight value(s) exceed float16's range (|w| > {FP16_MAX:g}); "
                      "saturated to ±65504 (as torch.ao)", stacklevel=3)
        w = w.clamp(-FP16_MAX, FP16_MAX)
    return w.to(torch.float16)


def quantize_dynamic_weight(weight: torch.Tensor, mod: nn.Module | None, dtype: QDtype, where: str,
                            precomputed: bool = False) -> QTensor:
    """Per-channel (axis 0) int8 weight: ``mod.qconfig.weight()``'s grid if set, else symmetric ``dtype``
    (``precomputed``: a QAT module's ``weight_fake_quant`` grid as it stands). A meta or NaN/Inf weight is an error
    naming ``where``."""
    check_not_meta(weight, f"{where}.from_float")
    check_finite_weight(weight, f"{where}.from_float")
    if mod is not None and getattr(getattr(mod, "qconfig", None), "weight", None) is not None:
        return quantize_weight(weight, weight_qparams(weight, mod, 0, where, precomputed), 0)
    w = weight.detach().to(torch.float32)
    scale, zp = calculate_qparams(w.amin(1), w.amax(1), QScheme.PER_CHANNEL_SYMMETRIC, dtype)
    return quantize_per_channel(w, scale, zp, 0, dtype)


class NotATensor:
    """A stand-in for a float layer's ``weight`` / ``bias`` tensor that says it is none to torch: its
    ``__torch_function__`` declines every function, so ``torch.overrides.has_torch_function`` finds it and code that
    checks that first (the fast paths of ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder``) takes its plain
    module-by-module path."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return NotImplemented  # (not a tensor: torch functions refuse it with a TypeError naming this type)


class WeightAccessor(NotATensor):
    """A dynamic ``Linear``'s ``weight`` attribute: call it for the quantized weight (torch.ao's ``weight()``); read
    ``device`` / ``dtype`` / ``shape`` for the stored weight's (int8 codes, or the float16 tensor).

    torch.ao's ``weight`` is a method, so code written for a float ``nn.Linear`` that reads ``.weight`` as a tensor
    failed on it: ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` in eval mode check their fused fast path
    with ``linear1.weight.device`` ("'function' object has no attribute 'device'", pytorch/pytorch#32764 and
    #109987). This object is no tensor and says so to torch (``__torch_function__``, declining every function): those
    fast-path checks then find a tensor-like argument and take the layer's module-by-module path, which calls the
    quantized Linears.

    >>> import torch, lowbit as Q
    >>> q = Q.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 3)))[0]
    >>> q.weight().qdtype, q.weight.dtype, tuple(q.weight.shape), torch.overrides.has_torch_function((q.weight,))
    (lowbit.qint8, torch.int8, (3, 4), True)
    """

    __slots__ = ("_mod",)

    def __init__(self, mod: Linear) -> None:
        self._mod = mod

    def __call__(self) -> QTensor | torch.Tensor:
        return self._mod._weight()

    def _stored(self) -> torch.Tensor:
        m = self._mod
        return m.weight_fp16 if m.dtype == torch.float16 else m.weight_int8  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self._stored().device

    @property
    def dtype(self) -> torch.dtype:
        return self._stored().dtype

    @property
    def shape(self) -> torch.Size:
        return self._stored().shape

    def __repr__(self) -> str:
        return f"<weight of {self._mod.extra_repr()}: call it for the quantized weight>"


class Linear(CheckedQuantState):
    """``y = x Wᵀ + b`` with int8 weights and per-token int8 activations; float in, float out.

    ``state_dict``: ``weight_int8`` (N, K) int8, ``weight_scale`` (N,) float32, ``weight_zero_point``
    (N,) int64, ``bias`` (N,) float32 — or ``weight_fp16`` and ``bias`` for ``dtype=torch.float16``.
    """

    _weight_grids = ("dtype",)  # (a checkpoint's metadata: the weight grid's kind must match, its range may be narrower)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: QDtype | str | torch.dtype = qint8, activation: str = "per_token") -> None:
        super().__init__()
        for arg, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"dynamic Linear: {arg}={v!r} must be a positive int")
        self.in_features, self.out_features = in_features, out_features
        self.dtype = _dtype_arg(dtype, "dynamic Linear")
        self.activation = _activation_arg(activation, "dynamic Linear")
        if self.dtype == torch.float16:
            self.register_buffer("weight_fp16", torch.zeros(out_features, in_features, dtype=torch.float16))
        else:
            self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
            self.register_buffer("weight_scale", torch.ones(out_features))
            self.register_buffer("weight_zero_point", torch.zeros(out_features, dtype=torch.int64))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._cache: dict[str, Any] = {}

    @property
    def weight(self) -> WeightAccessor:
        """``weight()``: the per-channel int8 weight as a ``QTensor`` (the float16 tensor for ``dtype=torch.float16``),
        as torch.ao's method; ``weight.device`` / ``.dtype`` / ``.shape``: the stored weight's (``WeightAccessor``)."""
        return WeightAccessor(self)

    def _weight(self) -> QTensor | torch.Tensor:
        if self.dtype == torch.float16:  # (copies, as torch.ao's unpacked weight: writes leave the layer as it is)
            return self.weight_fp16.clone()
        return QTensor(self.weight_int8.clone(), self.weight_scale.clone(), self.weight_zero_point.clone(), self.dtype,
                       axis=0)

    def set_weight_bias(self, weight: QTensor | torch.Tensor, bias: torch.Tensor | None) -> None:
        """Store a per-channel int8 ``QTensor`` (or, for float16, a float tensor) and a float bias."""
        shape = (self.out_features, self.in_features)
        if tuple(weight.shape) != shape:
            raise ValueError(f"dynamic Linear: weight shape {tuple(weight.shape)} != {shape}")
        if self.dtype == torch.float16:
            self.weight_fp16 = weight.detach().to(torch.float16).contiguous()
        else:
            if not isinstance(weight, QTensor) or weight.axis not in (0, None) or weight.int_repr().dtype != torch.int8:
                raise TypeError(f"dynamic Linear: weight must be a per-channel (axis 0) int8 QTensor, got {weight!r}")
            n = self.out_features
            self.weight_int8 = weight.int_repr().contiguous()
            self.weight_scale = weight.scale.to(torch.float32).expand(n).contiguous()
            self.weight_zero_point = weight.zero_point.to(torch.int64).expand(n).contiguous()
            self.dtype = weight.qdtype
        if (bias is None) != (self.bias is None):
            raise ValueError(f"dynamic Linear: bias={'None' if bias is None else 'a tensor'} does not match "
                             f"bias={self.bias is not None} given at construction")
        if bias is not None:
            self.bias = bias.detach().to(torch.float32).reshape(self.out_features).contiguous()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input  # (torch's argument name: fc(input=t) works)
        if isinstance(x, QTensor):
            x = x.dequantize()
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            bad = "dynamic Linear expects a floating-point tensor, got " + (
                f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__)
            if isinstance(x, torch.Tensor) and deferring():  # torch.compile: raised by the compiled program
                return refused_call(self, TypeError, bad, x.new_zeros(*x.shape[:-1], self.in_features, dtype=torch.float32), x)
            raise TypeError(bad)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            bad = f"dynamic Linear: input shape {{shape}} does not end in in_features={self.in_features}"
            if deferring():  # torch.compile: raised by the compiled program (lowbit::failed), not while tracing
                return refused_call(self, ValueError, bad, x.new_zeros(*x.shape[:-1], self.in_features), x)
            raise ValueError(bad.format(shape=tuple(x.shape)))
        check_not_meta(x, "dynamic Linear")
        if self.dtype == torch.float16:
            return F.linear(x, self.weight_fp16.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        flat = x.dim() == 2  # (M, K): no reshape either way (two dispatches less at M = 1)
        x2 = x if flat else x.reshape(-1, self.in_features)
        act = self.activation
        if tracing():  # one opaque op (lowbit.pt2): compiled/exported programs compute the eager numbers
            key = qdtype_key(self.dtype) if act == "per_token" else f"{qdtype_key(self.dtype)}|{act}"
            y = torch.ops.lowbit.dynamic_linear(x2, self.weight_int8, self.weight_scale, self.weight_zero_point,
                                                key, self.bias)  # type: ignore[arg-type]
        elif x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features, dtype=torch.float32)
        else:
            b = self._buffers  # (nn.Module.__getattr__ costs ~1 µs per buffer read)
            f = dynamic_linear if act == "per_token" else _REDUCED[act]
            y = f(x2, b["weight_int8"], b["weight_scale"], b["weight_zero_point"],  # type: ignore[arg-type]
                  self.dtype, b["bias"], self._cache)
        if not flat:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    @classmethod
    def from_float(cls, mod: nn.Module, dtype: QDtype | str | torch.dtype = qint8,
                   use_precomputed_fake_quant: bool = False) -> Linear:
        """Quantize an ``nn.Linear`` (per-channel symmetric ``dtype``, or its ``qconfig.weight`` grid;
        ``use_precomputed_fake_quant``: a QAT Linear's ``weight_fake_quant`` grid as it stands)."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"dynamic Linear.from_float expects an nn.Linear, got {type(mod).__name__}")
        return cls._build(mod, mod, dtype, use_precomputed_fake_quant)

    @classmethod
    def _build(cls, lin: nn.Linear, owner: nn.Module, dtype: Any, precomputed: Any = False) -> Any:
        """``cls`` holding ``lin``'s weight, on ``owner.qconfig.weight``'s grid when ``owner`` has one."""
        pre = check_precomputed_flag(precomputed, f"dynamic {cls.__name__}.from_float")
        d = _dtype_arg(dtype, f"dynamic {cls.__name__}.from_float")
        act = "per_token" if d == torch.float16 else activation_of(owner, f"dynamic {cls.__name__}.from_float")
        q = cls(lin.in_features, lin.out_features, lin.bias is not None, d, act)
        w = (fp16_dynamic_weight(lin.weight, f"dynamic {cls.__name__}") if d == torch.float16
             else quantize_dynamic_weight(lin.weight, owner, d, f"dynamic {cls.__name__}", pre))  # type: ignore[arg-type]
        q.set_weight_bias(w, lin.bias)
        return q.to(lin.weight.device)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # .to()/.cuda(): packed weights are a cache
        self._cache = {}
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle: the cache is not state
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        if self.dtype == torch.float16:
            return s + ", dtype=torch.float16"
        return s + f", dtype={self.dtype!r}, activation={self.activation}"


_REDUCED = {"per_token_7bit": reduced.per_token_7bit, "per_tensor_7bit": reduced.per_tensor_7bit}


class LinearReLU(Linear):
    """``relu(x Wᵀ + b)``: a fused ``lowbit.nn.intrinsic.LinearReLU`` (``fuse_modules`` of Linear, ReLU)
    quantized dynamically, as ``torch.ao.nn.intrinsic.quantized.dynamic.LinearReLU``.

    >>> import torch, lowbit as Q
    >>> m = Q.fuse_modules(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval(), [["0", "1"]])
    >>> q = LinearReLU.from_float(m[0])
    >>> bool((q(torch.randn(3, 8)) >= 0).all())
    True
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input  # (torch's argument name: fc(input=t) works)
        return F.relu(super().forward(x))

    @classmethod
    def from_float(cls, mod: nn.Module, dtype: QDtype | str | torch.dtype = qint8,
                   use_precomputed_fake_quant: bool = False) -> LinearReLU:
        """Quantize a fused ``LinearReLU`` marker (its qconfig's weight grid, else per-channel symmetric)."""
        if not isinstance(mod, _LinearReLUMarker):
            raise TypeError(f"dynamic LinearReLU.from_float expects a fused lowbit.nn.intrinsic.LinearReLU, "
                            f"got {type(mod).__name__}")
        lin = mod[0]
        return cls._build(lin, mod if getattr(mod, "qconfig", None) is not None else lin, dtype,
                          use_precomputed_fake_quant)
