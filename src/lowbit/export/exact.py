"""``to_onnx(..., exact=True)``: quantized Conv / Linear layers whose ONNX Runtime codes equal lowbit's, bit for bit.

The QDQ form (``weighted.WeightedTwin``) stores the bias as int32 codes ``round(b / (s_x s_w))`` and ORT fuses
``DQ -> Conv -> Q`` into ``QLinearConv`` (``QGemm`` / ``QLinearMatMul`` for a Linear), which computes::

    q_y = clamp(round(fl(fl(acc + round(b / (s_x s_w))) * fl(s_x s_w / s_y))) + z_y)          # ORT (MLAS)

while lowbit's int8 kernels keep the float32 bias and requantize (``kernels.avx2._float_epilogue``)::

    q_y = clamp(round(fl(fl(fl(fl(acc) * fl(s_x s_w)) + b) * fl(1 / s_y)) + z_y), lo, qmax)   # lowbit

(``lo = max(qmin, z_y)`` with a fused ReLU). The bias rounding moves ``y`` by up to ``s_x s_w / 2``, and near-tie codes
by one step (74 of 147,456 codes of a random 3x3 conv, 120 of a depthwise one); the folded multiplier moves a few more.
Here each such layer is written as::

    lowbit's codes of x -> exact sums acc (below) -> Cast(float) -> Mul(fl(s_x s_w)) -> Add(b) -> Mul(fl(1 / s_y))
      -> Add(z_y) -> Round -> Clip(lo, qmax) -> Cast -> DequantizeLinear(s_y, z_y)

``acc = Σ (q_x - z_x) q_w`` is exact: ``MatMulInteger`` for a Linear; for a Conv / ConvTranspose a float32 ``Conv`` /
``ConvTranspose`` of the centred codes and the weight codes, exact in any summation order while every partial sum is an
integer below 2**24 (``255 · Σ|q_w|`` per output channel; ``ConvInteger`` past that, and ConvTranspose stays QDQ).
A code input with ``z_x = 0`` is not centred; an unpadded Conv reads the codes as they are with the bias
``-z_x Σ q_w`` (``Σ q w - z Σ w``: every partial sum, bias included, an integer below ``(|z_x| + 255) Σ|q_w| < 2**24``,
else the ``Sub`` stays; a padded one keeps it: the Conv pads with 0, lowbit with ``z_x``). The scale is the ``Mul``'s
first input: ORT's ConvMulFusion folds ``Mul(conv, constant)`` into the weights (1 of 147,456 codes off), not the
commuted product (NCHWc then runs that ``Mul`` as a 1x1 depthwise conv: one product each). ``Round`` is half to
even, as ``torch.round``; every float op is one IEEE float32 operation in lowbit's order. A Linear with a u8 output
and no activation split (7-bit input grid or ``saturation_safe`` weights: ``kernels.plan.linear_plan``) takes fbgemm's
requantized codes in lowbit, so it is written as fbgemm computes them::

    q_y = clamp(round(fl(fl(acc + fl(b / fl(s_x s_w))) · fl(fl(s_x s_w) / s_y))) + z_y, lo, qmax)

The model's ``Quantize`` and each layer's input codes are lowbit's ``round(fl(x · fl(1 / s)) + z)`` (Mul, Add, Round,
Clip, Cast), not ``QuantizeLinear``'s ``x / s`` (1 of 73,728 random input codes differed); ``QFunctional`` add /
add_relu / mul / cat and quantized BatchNorm are lowbit's code arithmetic (``exact_ops``). The codes equal lowbit's
routes on CPUs without VNNI (and a VNNI CPU's rows up to ``small_m.VNNI_M``, which take the same routes); oneDNN's
one call past them may round a tie the other way (DESIGN §4: within one quantum). ``ConvInteger`` / ``MatMulInteger``
weights that ``vpmaddubsw`` could saturate are stored as ``q_w + 128`` (u8, zero point 128), as ``weight_dtype`` says
(``qdq``). Kept in the QDQ form (``qdq_reason``; ``to_onnx`` warns naming each such layer): a per-call (dynamic)
input grid, weights with non-zero zero points, a ConvTranspose past 2**24; other ops (matmul, activations) are as in
the QDQ export. A float-output Linear ends at ``fl(acc) fl(s_x s_w) + b``.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = nn.Sequential(Q.QuantStub(), nn.Conv2d(2, 3, 3), Q.DeQuantStub()).eval()
>>> m.qconfig = Q.get_default_qconfig()
>>> m = Q.prepare(m); _ = m(torch.randn(4, 2, 6, 6)); m = Q.convert(m)
>>> twin = exact_twin(m[1], "conv", (float(m[0].scale), int(m[0].zero_point), m[0].qdtype), "auto")
>>> x = m[0](torch.randn(1, 2, 6, 6))
>>> y = twin(x.dequantize())
>>> bool(((y / m[1].scale).round() + m[1].zero_point == m[1](x).int_repr()).all())
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..kernels.onednn import saturation_safe
from .qdq import QDQ, Grid, _Const, _storage, out_channel_weight_scale, stored_codes, untraced
from .weighted import WeightedTwin

__all__ = ["EXACT_KINDS", "ExactQDQ", "ExactWeightedTwin", "const_f32", "dq_symbolic", "exact_twin", "qdq_reason"]

EXACT_KINDS = ("linear", "conv", "conv_transpose")
_ONNX = {torch.uint8: 2, torch.int8: 3, torch.float32: 1}  # TensorProto types


def _epilogue(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out: tuple[float, int, int, int] | None
              ) -> torch.Tensor:
    """lowbit's float32 epilogue of exact sums ``acc`` (module doc): codes on ``out = (inv, z, lo, hi)`` as float32,
    or the float result where ``out`` is ``None``."""
    y = acc.to(torch.float32) * scale
    if bias is not None:
        y = y + bias
    if out is None:
        return y
    inv, z, lo, hi = out
    return torch.clamp(torch.round(y * torch.tensor(inv, dtype=torch.float32) + float(z)), lo, hi)


def _codes(x: torch.Tensor, s: float, z: int, qmin: int, qmax: int) -> torch.Tensor:
    """lowbit's quantize (``functional.quantize``): ``clamp(round(fl(fl(x · fl(1 / s)) + z)))``, as float32."""
    inv = torch.tensor(s, dtype=torch.float32).reciprocal()
    return torch.clamp(torch.round(x.detach().to(torch.float32) * inv + float(z)), qmin, qmax)


def const_f32(g: Any, v: float) -> Any:
    """A float32 scalar ONNX constant."""
    return g.op("Constant", value_t=torch.tensor(v, dtype=torch.float32))


def dq_symbolic(g: Any, q: Any, s: float, z: int, storage: torch.dtype) -> Any:
    """Float32 codes ``q`` (integers in the grid's range) -> Cast -> DequantizeLinear(s, z): ``(q - z) · s``. int8 codes
    leave as ``q + 128`` (uint8, zero point ``z + 128``: the same values): ORT fused an int8 ``DequantizeLinear`` into
    the next ``QLinearMatMul`` as a u8 x s8 product, whose int16 pair sums saturate without VNNI (448 of 1,024 codes
    off, up to 98 steps, on a full-range int8 input), where its QDQ form first shifts the codes to uint8."""
    if storage == torch.int8:
        q, z, storage = g.op("Add", q, const_f32(g, 128.0)), z + 128, torch.uint8
    return g.op("DequantizeLinear", g.op("Cast", q, to_i=_ONNX[storage]), const_f32(g, s),
                g.op("Constant", value_t=torch.tensor(z, dtype=storage)))


def _codes_symbolic(g: Any, x: Any, s: float, z: int, qmin: int, qmax: int, storage: torch.dtype | None) -> Any:
    """``_codes`` in ONNX: Mul(fl(1 / s)) -> Add(z) -> Round -> Clip (-> Cast to ``storage``; ``None``: float32 codes)
    (``QuantizeLinear`` divides by ``s``: another code at near-ties of a float input, 1 of 73,728 random inputs)."""
    inv = float(torch.tensor(s, dtype=torch.float32).reciprocal())
    y = g.op("Round", g.op("Add", g.op("Mul", x, const_f32(g, inv)), const_f32(g, float(z))))
    y = g.op("Clip", y, const_f32(g, float(qmin)), const_f32(g, float(qmax)))
    return y if storage is None else g.op("Cast", y, to_i=_ONNX[storage])


class _LowbitQDQFn(torch.autograd.Function):
    """lowbit's quantize onto a per-tensor grid, dequantized; ONNX: ``_codes_symbolic`` -> DequantizeLinear."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: float, z: int, qmin: int, qmax: int,  # type: ignore[override]
                storage: torch.dtype) -> torch.Tensor:
        with untraced():
            return (_codes(x, s, z, qmin, qmax) - z) * torch.tensor(s, dtype=torch.float32)

    @staticmethod
    def symbolic(g: Any, x: Any, s: float, z: int, qmin: int, qmax: int, storage: torch.dtype) -> Any:
        return dq_symbolic(g, _codes_symbolic(g, x, s, z, qmin, qmax, None), s, z, storage)


class ExactQDQ(QDQ):
    """A ``Quantize`` (float -> grid) as lowbit rounds it, ``x · fl(1 / s)``, not ``QuantizeLinear``'s ``x / s``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, z, d = self.grid
        return _LowbitQDQFn.apply(x.detach(), s, z, d.quant_min, d.quant_max, self._storage)


class _IntegerLayerFn(torch.autograd.Function):
    """Quantize ``x``, exact integer Conv / MatMul, lowbit's epilogue, dequantize (module doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Any, out_pad: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        with untraced():
            s, z, qmin, qmax = layer.in_grid
            c = (_codes(x, s, z, qmin, qmax) - z).to(torch.float64)
            w = layer.w.t.to(torch.float64) - layer.w_zp
            if layer.kind == "linear":
                acc = c @ w
            elif layer.kind == "conv_transpose":
                conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[layer.dim - 1]
                acc = conv_t(c, w, None, stride=layer.stride, padding=layer.padding, output_padding=out_pad,
                             groups=layer.groups, dilation=layer.dilation)
            else:
                conv = (F.conv1d, F.conv2d, F.conv3d)[layer.dim - 1]
                acc = conv(c, w, None, stride=layer.stride, padding=layer.padding, dilation=layer.dilation,
                           groups=layer.groups)
            if layer.fbgemm:
                v = acc.to(torch.float32) if layer.bterm is None else acc.to(torch.float32) + layer.bterm.t
                y = torch.clamp(torch.round(v * layer.mult.t) + float(layer.out[1]), layer.out[2], layer.out[3])
            else:
                y = _epilogue(acc, layer.scale.t, None if layer.bias is None else layer.bias.t, layer.out)
            if layer.out is None:
                return y
            return (y - layer.out[1]) * torch.tensor(layer.out_scale, dtype=torch.float32)

    @staticmethod
    def symbolic(g: Any, x: Any, layer: Any, out_pad: tuple[int, ...]) -> Any:
        def const(t: torch.Tensor) -> Any:
            return g.op("Constant", value_t=t)

        s, z, qmin, qmax = layer.in_grid
        st = layer.storage
        zx = const(torch.tensor(z, dtype=st))
        q = _codes_symbolic(g, x, s, z, qmin, qmax, st)  # (lowbit's rounding: a float input's codes too)
        w = const(layer.w.t)
        ins = [q, w, zx] + ([const(torch.tensor(layer.w_zp, dtype=torch.uint8))] if layer.w_zp else [])
        if layer.kind == "linear":
            acc = g.op("MatMulInteger", *ins)
        elif layer.float_sums:  # float32 sums of integers below 2**24 (exact in any order; ORT's float kernels)
            qf = g.op("Cast", q, to_i=_ONNX[torch.float32])
            wf = const(layer.w.t.to(torch.float32) - layer.w_zp)
            geometry = {"strides_i": list(layer.stride), "pads_i": list(layer.padding) * 2,
                        "dilations_i": list(layer.dilation), "group_i": layer.groups,
                        "kernel_shape_i": list(layer.w.t.shape[2:])}
            if layer.kind == "conv_transpose":
                geometry["output_padding_i"] = list(out_pad)
            return_op = "ConvTranspose" if layer.kind == "conv_transpose" else "Conv"
            if layer.zfold is not None:  # Σ (q - z) w = Σ q w - z Σ w: the zero point in the bias (_zero_point_bias)
                conv = g.op(return_op, qf, wf, const(layer.zfold), **geometry)
            else:  # centred codes (a zero-padded border is the zero point's code)
                conv = g.op(return_op, qf if z == 0 else g.op("Sub", qf, const(torch.tensor(float(z)))), wf,
                            **geometry)
            # the scale as the Mul's first input: ORT's ConvMulFusion folds a Conv's ``Mul(y, constant)`` into its
            # weights and bias, whose float products then round (1 of 147,456 codes off); the product commutes
            y = g.op("Mul", const(layer.scale.t), conv)
            return _requantize(g, y, layer, const)
        else:
            acc = g.op("ConvInteger", *ins, strides_i=list(layer.stride), pads_i=list(layer.padding) * 2,
                       dilations_i=list(layer.dilation), group_i=layer.groups,
                       kernel_shape_i=list(layer.w.t.shape[2:]))
        acc = g.op("Cast", acc, to_i=_ONNX[torch.float32])
        if layer.fbgemm:  # fbgemm's requantization (module doc)
            if layer.bterm is not None:
                acc = g.op("Add", acc, const(layer.bterm.t))
            inv, zo, lo, hi = layer.out
            y = g.op("Add", g.op("Round", g.op("Mul", acc, const(layer.mult.t))), const(torch.tensor(float(zo))))
            return _dq(g, y, layer, const)
        return _requantize(g, g.op("Mul", acc, const(layer.scale.t)), layer, const)


def _requantize(g: Any, y: Any, layer: Any, const: Any) -> Any:
    """``fl(acc) fl(s_x s_w)`` -> Add(b) -> Mul(fl(1 / s_y)) -> Add(z_y) -> Round -> ``_dq`` (the float result where
    the layer has no output grid)."""
    if layer.bias is not None:
        y = g.op("Add", y, const(layer.bias.t))
    if layer.out is None:
        return y
    inv, zo, lo, hi = layer.out
    y = g.op("Add", g.op("Mul", y, const(torch.tensor(inv, dtype=torch.float32))),
             const(torch.tensor(float(zo), dtype=torch.float32)))
    return _dq(g, g.op("Round", y), layer, const)


def _dq(g: Any, y: Any, layer: Any, const: Any) -> Any:
    """Clip(lo, qmax) -> Cast -> DequantizeLinear onto the layer's output grid."""
    _, zo, lo, hi = layer.out
    y = g.op("Clip", y, const(torch.tensor(float(lo))), const(torch.tensor(float(hi))))
    return dq_symbolic(g, y, layer.out_scale, zo, layer.out_storage)


class _Layer:
    """The constants of one exact layer, handed to ``_IntegerLayerFn`` as one Python object (not traced)."""


class ExactWeightedTwin(WeightedTwin):
    """A ``WeightedTwin`` (its padding, unbatched and N-d Linear handling) whose Q/DQ + float op + Q/DQ core is the
    exact integer chain of the module doc."""

    def __init__(self, mod: Any, kind: str, in_grid: Grid, weight_dtype: str) -> None:
        super().__init__(mod, kind, in_grid, weight_dtype)
        s, z, d = in_grid
        L = self.layer = _Layer()
        L.kind, L.in_grid, L.storage = kind, (float(s), int(z), d.quant_min, d.quant_max), _storage(d, "to_onnx")
        codes = mod.weight_int8.detach().cpu()
        # (a ConvTranspose's float sums take the int8 codes: no ConvInteger form, no u8 x s8 kernel)
        w, L.w_zp = stored_codes(codes, 0, "int8" if kind == "conv_transpose" else weight_dtype)
        L.w = _Const(w.t() if kind == "linear" else w)
        L.float_sums = kind != "linear" and _float_sums_exact(codes, mod.groups, kind == "conv_transpose")
        sw = out_channel_weight_scale(mod, kind)
        scale = sw * torch.tensor(float(s), dtype=torch.float32)  # fl(s_x s_w), as kernels.avx2._scaled
        chan = (-1,) if kind == "linear" else (-1,) + (1,) * self.dim
        L.scale = _Const(scale.reshape(chan))
        L.bias = None if mod.bias is None else _Const(mod.bias.detach().cpu().to(torch.float32).reshape(chan))
        if kind != "linear":
            L.dim = self.dim
            L.stride, L.padding, L.dilation, L.groups = (tuple(self.conv_args[k]) if k != "groups" else
                                                         self.conv_args[k] for k in ("stride", "padding", "dilation",
                                                                                     "groups"))
        L.zfold = _zero_point_bias(codes, int(z), L.padding) if kind == "conv" and L.float_sums else None
        L.fbgemm = False
        if getattr(mod, "float_output", False):
            L.out = None
        else:
            so, zo, qd = float(mod.scale), int(mod.zero_point), mod.out_qdtype
            inv = float(torch.tensor(so, dtype=torch.float32).reciprocal())  # fl(1 / s_y), kernels.avx2._inv_scale
            lo = max(qd.quant_min, zo) if self.relu else qd.quant_min  # the ReLU as the clamp (avx2._relu_floor)
            L.out, L.out_scale, L.out_storage = (inv, zo, lo, qd.quant_max), so, _storage(qd, "to_onnx")
            # a Linear with a u8 output and no split takes fbgemm's requantized codes (kernels.plan.linear_plan)
            shift = (128 if d.quant_max - d.quant_min > 127 else -d.quant_min) if d.storage == torch.int8 else 0
            L.fbgemm = (kind == "linear" and qd.storage == torch.uint8
                        and (d.quant_max + shift <= 127 or saturation_safe(codes)))
            L.mult = _Const((scale / torch.tensor(so, dtype=torch.float32)).reshape(chan))  # fl(fl(s_x s_w) / s_y)
            L.bterm = None if mod.bias is None else _Const(mod.bias.detach().cpu().float().reshape(chan) / scale.reshape(chan))

    def _core(self, x: torch.Tensor, conv_args: dict[str, Any]) -> torch.Tensor:
        out_pad = tuple(conv_args.get("output_padding", ()))
        return _IntegerLayerFn.apply(x.detach(), self.layer, out_pad)  # (detached: see codes.to_codes_and_back)


def _float_sums_exact(w: torch.Tensor, groups: int, transposed: bool) -> bool:
    """Whether every float32 partial sum of a (transposed) conv of 8-bit centred codes (``|q - z| <= 255``) with the
    int8 weights ``w`` (``(C_out, C_in / groups, *k)``; transposed ``(C_in, C_out / groups, *k)``) is an integer below
    2**24, so exact in any summation order."""
    w = w.detach().abs().to(torch.int64)
    per_out = (w.reshape(groups, w.shape[0] // groups, w.shape[1], -1).sum((1, 3)) if transposed
               else w.reshape(w.shape[0], -1).sum(1))
    return bool(255 * int(per_out.max()) < 2**24) if per_out.numel() else True


def _zero_point_bias(w: torch.Tensor, z: int, padding: tuple[int, ...]) -> torch.Tensor | None:
    """The float32 Conv bias ``-z Σ_k w[c, k]`` (per output channel) that turns ``Σ q w`` of uncentred codes into the
    exact sums ``Σ (q - z) w``, or ``None`` where that is not exact or saves nothing: ``z = 0`` (no correction); a
    padded conv (the Conv pads with 0, the codes with ``z``); or a partial sum ``bias + Σ' q w`` (any order, ``|q| <=
    255``) that could reach 2**24: ``(|z| + 255) · Σ|w| >= 2**24``.

    >>> _zero_point_bias(torch.tensor([[[1, -2]], [[3, 3]]], dtype=torch.int8), 5, (0,)).flatten().tolist()
    [5.0, -30.0]
    """
    if z == 0 or any(padding):
        return None
    w = w.detach().to(torch.int64).reshape(w.shape[0], -1)
    if (abs(z) + 255) * int(w.abs().sum(1).max()) >= 2**24:
        return None
    return (-z * w.sum(1)).to(torch.float32)


def qdq_reason(mod: Any, kind: str, in_grid: Grid | None) -> str | None:
    """Why a quantized layer has no integer ONNX form and stays QDQ (ORT may then round codes its own way), or
    ``None`` where it has one (a Linear / Conv / ConvTranspose on a static input grid with symmetric weights, a
    ConvTranspose's float32 sums exact)."""
    if kind not in EXACT_KINDS:
        return f"no integer form for {kind}"
    if in_grid is None:
        return "its input has no static grid (a float or per-call input)"
    if bool(mod.weight_zero_point.any()):
        return "its weights have non-zero zero points"
    if kind == "conv_transpose" and not _float_sums_exact(mod.weight_int8, mod.groups, True):
        return "its integer sums can pass 2**24 (255 * sum|q_w| per output channel), past float32's exact integers"
    return None


def exact_twin(mod: Any, kind: str, in_grid: Grid | None, weight_dtype: str) -> WeightedTwin:
    """``ExactWeightedTwin`` where the layer has an integer ONNX form (``qdq_reason`` is ``None``), else the QDQ
    ``WeightedTwin``."""
    if qdq_reason(mod, kind, in_grid) is None:
        return ExactWeightedTwin(mod, kind, in_grid, weight_dtype)
    return WeightedTwin(mod, kind, in_grid, weight_dtype)

