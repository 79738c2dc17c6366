"""Weight-only group-wise ``Linear``: int4 (packed two per byte) or int8 weights, float activations.

Row ``n`` of the ``(N, K)`` weight is cut into ``G = K / g`` groups of ``g = group_size`` input
columns (``group_size=-1``: one group per row, i.e. per channel); group ``(n, j)`` has its own
``(s_nj, z_nj)``::

    q[n, k]  = clamp(round_half_even(w[n, k] / s[n, j]) + z[n, j], qmin, qmax)    # j = k // g
    ŵ[n, k]  = (q[n, k] - z[n, j]) * s[n, j]                                      # (N, K) float32
    y        = x @ ŵ^T + bias   (-> relu)                                          # x: (*, K) -> (*, N)

Grids: 4 bits symmetric ``qint4`` [-8, 7] (z = 0) or affine ``quint4`` [0, 15]; 8 bits ``qint8``
[-128, 127] either way. ``s, z`` come from the clipped range ``[r·min, r·max]`` of each group with
the contract of ``calculate_qparams``: ``r = 1`` for ``method="rtn"`` (round to nearest); for
``method="mse"`` the ratio ``r`` in ``CLIP_RATIOS`` that minimises ``||w - ŵ||²`` of the group; for
``method="gptq"`` columns are quantized in order and each rounding error is spread over the
columns not yet quantized, weighted by the inverse Hessian ``H = 2 XᵀX`` of calibration inputs
(Frantar et al. 2022: damping 1 % of mean diag(H), blocks of 128 columns; by default in "act order",
most active inputs first, with static group qparams from the mse search; see ``gptq_quantize``). These quantizers
are ``lowbit.nn.quantized.group_codes``, re-exported here.

State (``state_dict``, loadable with ``weights_only=True``): ``qweight`` (uint8 ``(N, K/2)`` for 4 bits,
column ``2i`` in the low nibble; int8 ``(N, K)`` for 8 bits), ``scales`` float32 ``(N, G)``,
``zero_points`` int8 ``(N, G)``, ``bias``. Forward: 4-bit weights with ``N % 16 == 0`` and
``g ∈ {32, 64, 128, 256}`` run torch's CPU int4 kernel ``_weight_int4pack_mm_for_cpu`` (bf16
activations and scales, float32 accumulation: error ≤ ~2⁻⁸ |x|·(|ŵ| + |8 - z_u|·s), ``z_u`` the zero point
on the unsigned grid, since an affine zero point is a second bf16 term ``(8 - z_u)·s``: an all-zero row reads
~2⁻⁹·7s·|x|, far below the int4 rounding error; scales outside bf16's normal range take the dequantized path;
its packed layout is a cache the size of ``qweight``, rebuilt after ``load_state_dict`` /
``.to()``); 8-bit per-channel weights compute ``(x @ qᵀ) * s`` in float32 (bf16; an fp16 input dequantizes:
``x @ qᵀ`` passes 65504 first; a result whose sum is not finite, from ``x @ qᵀ`` past float32's 3.4e38 where
``x @ ŵᵀ`` is not (|x| ≳ 2.7e36 / K) or from the input, is computed again dequantized on CPU: one sum a call);
everything else
dequantizes the weight per call and runs ``F.linear``. ``kernel="reference"`` forces dequantize +
``F.linear`` (the oracle). For up to ``DECODE_MAX_ROWS`` input rows (decoding), 8-bit per-channel
symmetric weights with ``K % 16 == 0`` run torch's ``_weight_int8pack_mm`` with bf16 activations and a bf16 product
(2⁻⁹ relative each; the float32 scales are applied after): 2.6x fp32 at M = 1 on AVX-512. The
int4 kernel also runs only up to ``DECODE_MAX_ROWS`` rows: for prefill, dequantize + ``F.linear``
is faster (and exact in float32).

>>> import torch
>>> from lowbit.nn.quantized import WeightOnlyLinear
>>> lin = torch.nn.Linear(64, 32)
>>> q = WeightOnlyLinear.from_float(lin, bits=4, group_size=32, method="mse")
>>> q
WeightOnlyLinear(in_features=64, out_features=32, bias=True, bits=4, group_size=32, symmetric=True)
>>> q.qweight.dtype, tuple(q.qweight.shape), tuple(q.scales.shape)
(torch.uint8, (32, 32), (32, 2))
>>> x = torch.randn(3, 64)
>>> bool((q(x) - lin(x)).norm() < 0.1 * lin(x).norm())   # int4: a few % relative error
True
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...compile_state import deferring, tracing
from ...qscheme import QDtype, qint4, qint8, quint4
from ...qtensor import QTensor
from ._state import CheckedQuantState
from ._utils import refused_call
from .embedding import _pack4, _unpack4
from .group_codes import CLIP_RATIOS, group_qparams, gptq_quantize, quantize_groups
from .group_size import fit_group_size

__all__ = ["WeightOnlyLinear", "CLIP_RATIOS", "METHODS", "group_qparams", "quantize_groups", "gptq_quantize", "fit_group_size"]

METHODS = ("rtn", "mse", "gptq")
_KERNEL_GROUPS = (32, 64, 128, 256)
# torch's packed CPU kernels win for few rows (decode: 2.5-3x fp32 at M=1) and lose to dequantize + F.linear
# for many (prefill: ~2x slower at M=512), so they run up to this many rows
DECODE_MAX_ROWS = 32
_UNWRITTEN = object()  # WeightOnlyLinear._written until the first write of its codes (an old pickle's too)
_KERNELS = ("auto", "reference")


def weight_qdtype(bits: int, symmetric: bool) -> QDtype:
    """The code grid: ``qint4`` / ``quint4`` (4 bits, symmetric / affine) or ``qint8`` (8 bits)."""
    return qint8 if bits == 8 else (qint4 if symmetric else quint4)


def check_recipe(bits: Any, group_size: Any, where: str, symmetric: Any = None) -> None:
    """``bits`` 4 or 8, ``group_size`` a positive int or -1, ``symmetric`` a bool (``None``: not given here): else an
    error naming the value. Symmetric 4-bit groups of fewer than 8 weights are warned: the grid ``max|w| / 7.5`` on
    ``[-8, 7]`` (torch.ao's and GPTQ's symmetric convention) clamps every group's positive maximum from 8 to 7 codes,
    6.7 % short and always the same sign, and with tiny groups most weights are a group's maximum: on non-negative
    inputs (after a ReLU) the errors add up (a 64→32 Linear's output: 10.4 dB at group 1, 17.8 at 4, 20.6 at 8, 23.6
    at 32; affine 146.3 / 26.9 / 24.9 / 22.4)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):  # (4.0 passed "in (4, 8)")
        raise ValueError(f"{where}: bits={bits!r} must be 4 or 8")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"{where}: group_size={group_size!r} must be a positive int or -1 (per channel)")
    if symmetric is not None and not isinstance(symmetric, bool):  # a truthy "no" meant symmetric
        raise TypeError(f"{where}: symmetric={symmetric!r} must be a bool")
    if bits == 4 and symmetric is True and 0 < group_size < 8:
        warnings.warn(f"{where}: symmetric 4-bit groups of {group_size} weights lose accuracy (each group's largest "
                      "positive weight clamps from code 8 to 7 on the symmetric grid max|w| / 7.5); use "
                      "symmetric=False or group_size >= 8", stacklevel=3)


def _check_args(in_features: Any, out_features: Any, bits: Any, group_size: Any, where: str) -> int:
    """Validate the shape arguments; return the effective group size (``in_features`` for -1)."""
    for name, v in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{where}: {name}={v!r} must be a positive int")
    check_recipe(bits, group_size, where)
    g = in_features if group_size == -1 else group_size
    if in_features % g:
        raise ValueError(f"{where}: in_features={in_features} is not divisible by group_size={group_size}")
    if bits == 4 and in_features % 2:
        raise ValueError(f"{where}: in_features={in_features} must be even to pack two 4-bit codes per byte")
    return g


def _needs_grad(x: torch.Tensor) -> bool:
    """An input autograd follows: the packed int4 / int8 kernels have no derivative, so such an input takes the
    dequantized ``F.linear`` path at every batch size (else a model would backpropagate only above 32 rows)."""
    return x.requires_grad and torch.is_grad_enabled()


class WeightOnlyLinear(CheckedQuantState):
    """``F.linear(x, ŵ, bias)`` with a group-wise quantized weight; see the module docstring."""

    _written: object = _UNWRITTEN  # a new object after each write of the state (set_codes, load_state_dict, .to())

    _weight_grids = ("qdtype",)  # (a checkpoint's metadata: the weight grid's kind must match, its range may be narrower)

    _keep_buffer_dtypes = False  # .half() / .to(torch.bfloat16) cast its scales and bias with the model, as before

    qweight: torch.Tensor  # (N, K/2) uint8 (4 bits) or (N, K) int8
    scales: torch.Tensor  # (N, G) float32
    zero_points: torch.Tensor  # (N, G) int8
    bias: torch.Tensor | None  # (N,) float32

    def __init__(self, in_features: int, out_features: int, bias: bool = True, bits: int = 4,
                 group_size: int = 128, symmetric: bool = True, relu: bool = False, kernel: str = "auto") -> None:
        super().__init__()
        g = _check_args(in_features, out_features, bits, group_size, type(self).__name__)
        if kernel not in _KERNELS:
            raise ValueError(f"WeightOnlyLinear: kernel={kernel!r} must be one of {_KERNELS}")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        self.symmetric, self.relu, self.kernel, self._g = bool(symmetric), bool(relu), kernel, g
        self.qdtype = weight_qdtype(bits, self.symmetric)
        cols = in_features // 2 if bits == 4 else in_features
        self.register_buffer("qweight", torch.zeros(out_features, cols, dtype=torch.uint8 if bits == 4 else torch.int8))
        self.register_buffer("scales", torch.ones(out_features, in_features // g))
        self.register_buffer("zero_points", torch.zeros(out_features, in_features // g, dtype=torch.int8))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._cache: tuple[object, tuple[torch.Tensor, torch.Tensor] | tuple[()]] | None = None

    # ---- construction ----
    @classmethod
    def from_float(cls, mod: nn.Module, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                   method: str = "rtn", hessian: torch.Tensor | None = None, relu: bool = False,
                   kernel: str = "auto", act_order: bool = True) -> WeightOnlyLinear:
        """Quantize ``mod.weight`` (an ``nn.Linear``); ``method="gptq"`` needs ``hessian`` = ``XᵀX`` ``(K, K)``
        (``act_order``: see ``gptq_quantize``)."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"WeightOnlyLinear.from_float expects an nn.Linear, got {type(mod).__name__}")
        if method not in METHODS:
            raise ValueError(f"WeightOnlyLinear.from_float: method={method!r} must be one of {METHODS}")
        if method == "gptq" and not isinstance(hessian, torch.Tensor):
            raise ValueError("WeightOnlyLinear.from_float: method='gptq' needs hessian=X^T X of calibration inputs "
                             "(lowbit.quantize_weight_only collects it from calib batches)")
        bad = int((~torch.isfinite(mod.weight.detach())).sum())
        if bad:
            raise ValueError(f"WeightOnlyLinear.from_float: the weight holds {bad} NaN/Inf values "
                             f"(of {mod.weight.numel()}); they have no place on a quantization grid")
        q = cls(mod.in_features, mod.out_features, mod.bias is not None, bits, group_size, symmetric, relu, kernel)
        w = mod.weight.detach().cpu()
        if method == "gptq":
            codes, s, z = gptq_quantize(w, hessian.cpu(), q._g, q.qdtype, q.symmetric,  # type: ignore[union-attr]
                                        act_order=act_order)
        else:
            codes, s, z = quantize_groups(w, q._g, q.qdtype, q.symmetric, method)
        q.set_codes(codes, s, z)
        if mod.bias is not None:
            q.bias = mod.bias.detach().to(torch.float32).cpu().clone()
        return q.to(mod.weight.device)

    def set_codes(self, codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor) -> None:
        """Store integer ``codes`` ``(N, K)`` on this module's grid with ``scales``/``zero_points`` ``(N, G)``."""
        shape, gshape = (self.out_features, self.in_features), tuple(self.scales.shape)
        if tuple(codes.shape) != shape or tuple(scales.shape) != gshape or tuple(zero_points.shape) != gshape:
            raise ValueError(f"WeightOnlyLinear.set_codes: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} "
                             f"/ zero_points {tuple(zero_points.shape)} do not match {shape} / {gshape}")
        lo, hi = self.qdtype.quant_min, self.qdtype.quant_max
        if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ValueError(f"WeightOnlyLinear.set_codes: codes outside the {self.qdtype!r} grid [{lo}, {hi}]")
        dev = self.qweight.device
        self.qweight = (_pack4(codes) if self.bits == 4 else codes.to(torch.int8)).to(dev).contiguous()
        self.scales = scales.to(dev, torch.float32).contiguous()
        self.zero_points = zero_points.to(dev, torch.int8).contiguous()
        self._written, self._cache = object(), None

    # ---- inspection ----
    def codes(self) -> torch.Tensor:
        """Unpacked integer codes ``(N, K)`` (int8 for signed grids, uint8 for ``quint4``)."""
        return _unpack4(self.qweight, self.in_features, self.qdtype.signed) if self.bits == 4 else self.qweight

    def dequantize_weight(self) -> torch.Tensor:
        """``ŵ = (q - z) * s`` as float32 ``(N, K)``."""
        q = self.codes().to(torch.float32).reshape(self.out_features, -1, self._g)
        return ((q - self.zero_points.to(torch.float32)[..., None]) * self.scales[..., None]).reshape(
            self.out_features, self.in_features)

    def weight(self) -> QTensor | torch.Tensor:
        """Per channel: the weight as an axis-0 ``QTensor``; group-wise: the dequantized float32 weight. Copies, as
        torch.ao's unpacked weight: writing to them leaves the layer as it is."""
        if self._g != self.in_features:
            return self.dequantize_weight()
        codes = self.codes()
        return QTensor(codes.clone() if self.bits != 4 else codes, self.scales[:, 0].clone(),
                       self.zero_points[:, 0].to(torch.int64), self.qdtype, axis=0)

    # ---- forward ----
    def _kernel_applies(self, x: torch.Tensor) -> bool:
        return (self.kernel == "auto" and self.bits == 4 and x.device.type == "cpu" and self.out_features % 16 == 0
                and self._g in _KERNEL_GROUPS and x.dtype in (torch.float32, torch.bfloat16)
                and x.numel() <= DECODE_MAX_ROWS * self.in_features and not _needs_grad(x))

    def _int8_kernel_applies(self, x: torch.Tensor) -> bool:
        # (torch's _weight_int8pack_mm reads past the rows, or crashes, when in_features is not a multiple of 8; its
        # AVX-512 body (16 bf16 lanes) also when it is not a multiple of 16: K = 24 crashed the process at 1-32 rows)
        return (self.kernel == "auto" and self.bits == 8 and self._g == self.in_features and self.symmetric
                and self.in_features % 16 == 0
                and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and x.numel() <= DECODE_MAX_ROWS * self.in_features and not _needs_grad(x))

    def _int4_cache(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
        """The kernel's packed codes and bf16 ``(scale, zero)`` pairs; ``()`` where a scale is below bfloat16's normal
        range (a subnormal scale kept 1-7 of its bits there: 8 % off at 1e-40) or a pair overflows it: such a layer
        takes the dequantized path. Kept with the write token ``_written`` read before the buffers, which a
        ``load_state_dict`` / ``set_codes`` in another thread replaces after its writes: a pack made meanwhile is made
        again (a cache cleared before the writes let it stay: the old weights for good). ~40 ns a call."""
        written = self._written
        hit = self._cache
        if not hit or hit[0] is not written:  # (an old pickle's cache, a bare (packed, sz) or (), is made again too)
            u = self.codes().to(torch.int32) + (8 if self.qdtype.signed else 0)  # unsigned codes 0..15
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 2)
            zp_u = self.zero_points.to(torch.float32) + (8 if self.qdtype.signed else 0)
            # the kernel computes (u - 8) * s + zero, so zero = (8 - z_u) * s
            sz = torch.stack([self.scales, (8 - zp_u) * self.scales], -1).transpose(0, 1)  # (G, N, 2)
            sz = sz.to(torch.bfloat16).contiguous()
            ok = bool(torch.isfinite(sz).all()) and bool((sz[..., 0].abs() >= torch.finfo(torch.bfloat16).tiny).all())
            hit = self._cache = (written, (packed, sz) if ok else ())
        return hit[1]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input  # (torch's argument name: fc(input=t) works)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            bad = "WeightOnlyLinear: input must be a float tensor, got " + (
                str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__)
            if isinstance(x, torch.Tensor) and deferring():  # torch.compile: raised by the compiled program
                return refused_call(self, TypeError, bad, x.new_zeros(*x.shape[:-1], self.in_features, dtype=torch.float32), x)  # type: ignore[no-any-return]
            raise TypeError(bad)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            bad = f"WeightOnlyLinear: input of shape {{shape}} does not end in in_features={self.in_features}"
            if deferring():  # torch.compile: raised by the compiled program (lowbit::failed), not while tracing
                return refused_call(self, ValueError, bad, x.new_zeros(*x.shape[:-1], self.in_features), x)  # type: ignore[no-any-return]
            raise ValueError(bad.format(shape=tuple(x.shape)))
        if tracing():  # one opaque op (lowbit.pt2): compiled/exported programs compute the eager numbers
            spec = [self.in_features, self.out_features, self.bits, self.group_size, int(self.symmetric),
                    int(self.relu)]
            return torch.ops.lowbit.weight_only_linear(x, self.qweight, self.scales, self.zero_points, self.bias,
                                                       spec, self.kernel)
        return self._eager(x)

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)  # (M, K)
        int4 = self._int4_cache() if self._kernel_applies(x) else ()
        y: torch.Tensor | None = None
        if int4:
            packed, sz = int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), packed, self._g, sz)
            y = y.to(x.dtype)
        elif self._int8_kernel_applies(x):  # bf16 activations, float32 scales applied after
            ones = torch.ones(self.out_features, dtype=torch.bfloat16, device=x.device)
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight, ones)
            y = y.to(torch.float32) * self.scales[:, 0]
            y = y.to(x.dtype)
        elif (self.kernel == "auto" and self.bits == 8 and self._g == self.in_features and self.symmetric
              and x.dtype != torch.float16):  # (x @ qᵀ overflows half's 65504 where x @ ŵᵀ does not: |q| ≤ 128)
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales[:, 0].to(x.dtype)  # (x @ qᵀ) * s
        if y is not None and not int4 and y.device.type == "cpu" and not math.isfinite(float(y.sum())):
            # (~2.5 us; torch.isfinite(y).all(): 30 us; CPU only: on a GPU the read would synchronize every call)
            # x @ qᵀ overflowed (past float32's 3.4e38, where x @ ŵᵀ need not: |q| ≤ 128), or the input holds NaN/Inf,
            # or finite outputs sum past 3.4e38: the dequantized product, as the float layer computes it
            y = None
        if y is None:
            w = self.dequantize_weight().to(x.dtype)
            y = F.linear(x2, w)
            if y.device.type == "cpu" and x2.shape[0] > 1 and not math.isfinite(float(y.sum())):
                y = _rows_apart(x2, w, y)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.relu:
            y = torch.relu(y)
        return y.reshape(*lead, self.out_features)

    # ---- cache invalidation ----
    def _apply(self, fn: Any, recurse: bool = True) -> WeightOnlyLinear:
        self._cache = None
        out = super()._apply(fn, recurse)
        self._written, self._cache = object(), None
        return out

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        self._cache = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._written, self._cache = object(), None  # (after the writes: a pack made meanwhile is made again)

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
             f"bits={self.bits}, group_size={self.group_size}, symmetric={self.symmetric}")
        return s + (", relu=True" if self.relu else "") + (f", kernel={self.kernel!r}" if self.kernel != "auto" else "")


def _rows_apart(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F.linear(x2, w)`` with each row holding NaN / Inf computed alone, so a non-finite input reaches exactly its own
    output row, as in float64. torch's bf16 ``F.linear`` on an AMX CPU (oneDNN's ``brg_matmul``) spread a NaN of row 1
    into row 0 at 96 × 34 × 5 (session 47; not with its AVX-512 BF16 kernels). ``y``: the product as computed, kept
    where every input row is finite (finite products past the dtype's range: the float layer's own result)."""
    bad = ~torch.isfinite(x2).all(1)
    if not bool(bad.any()):
        return y
    y = F.linear(x2.masked_fill(bad[:, None], 0), w)
    for i in bad.nonzero().flatten().tolist():
        y[i] = F.linear(x2[i:i + 1], w)[0]
    return y
