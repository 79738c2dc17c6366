"""ONNX twins of dynamic quantized modules (``lowbit.nn.quantized.dynamic``): per-token int8 GEMMs.

lowbit's dynamic ``Linear`` quantizes each row (token) of its input on that row's own quint8
affine grid. ONNX Runtime's ``MatMulInteger`` takes one activation zero point per call (a per-row
``a_zero_point`` is rejected), so the file feeds the codes on the shared zero point 128 and
applies each row's zero point in an exact int32 correction, as ``per_token_linear`` does. For
``x`` flattened to ``(M, K)``, int8 weight codes ``W`` ``(N, K)`` and their per-channel grids::

    lo, hi  = min(ReduceMin(x, -1), 0), max(ReduceMax(x, -1), 0)          # (M, 1) float, per token
    s_x     = max((hi - lo) / 255, 1e-8);   z_x = clip(-round(lo / s_x), 0, 255)
    q_x     = Cast<u8>(clip(round(x * (1 / s_x) + z_x), 0, 255))          # (M, K): lowbit's float32 operations
    acc     = MatMulInteger(q_x, Wᵀ, 128, z_w)                            # int32: Σ_k (q_x - 128)(q_w - z_w)
    acc    -= (z_x - 128) ⊗ Σ_k (q_w - z_w)                               # int32, exact: Σ_k (q_x - z_x)(q_w - z_w)
    y       = Cast<float>(acc) · (s_x ⊗ s_w) + bias                        # (M, N), reshaped to (*, N)

which is ``lowbit.nn.quantized.dynamic.Linear`` up to float32 rounding of the epilogue. Weight codes
follow ``weight_dtype`` as in ``lowbit.export.qdq`` (UINT8 ``q + 128`` where ORT's u8 x s8 kernel
could saturate on CPUs without VNNI). A ``dtype=torch.float16`` Linear becomes ``MatMul`` on a
FLOAT16 initializer cast to float (weight-only; opset >= 15, else float32 weights). Dynamic
``RNN``/``LSTM``/``GRU`` unroll their time loop (``DynamicRNNTwin``): the file has the example's number of
time steps, and every gate GEMM is the per-token graph above; the cells (``RNNCell``/``LSTMCell``/
``GRUCell``, ``DynamicCellTwin``) are one such step. ``dynamic_twin`` picks the twin of a module.

>>> import torch
>>> from lowbit.nn.quantized.dynamic import Linear
>>> from lowbit.export.dynamic import DynamicLinearTwin
>>> q = Linear.from_float(torch.nn.Linear(8, 3))
>>> x = torch.randn(2, 5, 8)
>>> y_twin, y = DynamicLinearTwin(q, "auto")(x), q(x)      # same int32 sums; the float epilogues may round apart
>>> bool(((y_twin - y).abs() <= 1e-6 * (1 + y.abs())).all())
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.onednn import saturation_safe
from ..nn.quantized.dynamic import GRU as DynamicGRU
from ..nn.quantized.dynamic import LSTM as DynamicLSTM
from ..nn.quantized.dynamic import RNN as DynamicRNN
from ..nn.quantized.dynamic import GRUCell, LSTMCell, RNNCell
from ..nn.quantized.dynamic import Linear as DynamicLinear
from ..nn.quantized.dynamic import LinearReLU as DynamicLinearReLU
from ..nn.quantized.dynamic import per_token_linear, quantize_per_token
from ..nn.quantized.dynamic.linear import NotATensor
from ..qtensor import QTensor
from .qdq import _Const
from .qdq import untraced as _untraced

__all__ = ["DynamicLinearTwin", "DynamicRNNTwin", "DynamicCellTwin", "dynamic_twin"]

_EPS = 1e-8  # quantize_per_token's calculate_qparams default


class _Eager:
    """The module's own weight ``QTensor`` and bias, for the eager forward (a Python object to the tracer)."""

    def __init__(self, weight: QTensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias


def _c(g: Any, value: Any, dtype: torch.dtype = torch.float32) -> Any:
    t = value.t if isinstance(value, _Const) else torch.tensor(value, dtype=dtype)
    return g.op("Constant", value_t=t)


def _reduce_last(g: Any, op: str, x: Any) -> Any:
    """``op`` (ReduceMin / ReduceMax) over axis 1 of a 2-D tensor, dims kept: axes moved to an input in opset 18."""
    if g.opset >= 18:
        return g.op(op, x, _c(g, [1], torch.int64), keepdims_i=1)
    return g.op(op, x, axes_i=[1], keepdims_i=1)


class _PerTokenLinearFn(torch.autograd.Function):
    """lowbit's per-token int8 linear on ``(M, K)``; ONNX: per-row grids, MatMulInteger, int32 correction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, eager: _Eager, w_t: _Const, w_zp: _Const,  # type: ignore[override]
                w_sum: _Const, w_scale: _Const, bias_c: _Const | None) -> torch.Tensor:
        with _untraced():  # lowbit's kernels (and their caches) stay out of the trace; symbolic gives the graph
            return per_token_linear(quantize_per_token(x), eager.weight, eager.bias)  # CPU: to_onnx traces on CPU

    @staticmethod
    def symbolic(g: Any, x: Any, eager: _Eager, w_t: _Const, w_zp: _Const, w_sum: _Const,
                 w_scale: _Const, bias_c: _Const | None) -> Any:
        zero = _c(g, 0.0)
        lo = g.op("Min", _reduce_last(g, "ReduceMin", x), zero)                      # (M, 1)
        hi = g.op("Max", _reduce_last(g, "ReduceMax", x), zero)
        s_x = g.op("Max", g.op("Div", g.op("Sub", hi, lo), _c(g, 255.0)), _c(g, _EPS))
        z_x = g.op("Clip", g.op("Neg", g.op("Round", g.op("Div", lo, s_x))), zero, _c(g, 255.0))
        q = g.op("Add", g.op("Mul", x, g.op("Reciprocal", s_x)), z_x)
        q = g.op("Cast", g.op("Clip", g.op("Round", q), zero, _c(g, 255.0)), to_i=2)   # 2: UINT8
        acc = g.op("MatMulInteger", q, _c(g, w_t), _c(g, 128, torch.uint8), _c(g, w_zp))  # (M, N) int32
        shift = g.op("Sub", g.op("Cast", z_x, to_i=6), _c(g, 128, torch.int32))          # 6: INT32, (M, 1)
        acc = g.op("Sub", acc, g.op("Mul", shift, _c(g, w_sum)))
        y = g.op("Mul", g.op("Cast", acc, to_i=1), g.op("Mul", s_x, _c(g, w_scale)))     # 1: FLOAT
        return y if bias_c is None else g.op("Add", y, _c(g, bias_c))


class _LeadReshapeFn(torch.autograd.Function):
    """``y`` ``(M, N)`` as ``(*x.shape[:-1], N)``; ONNX: Reshape(y, Concat(Shape(x)[:-1], Shape(y)[-1:])) with
    ``allowzero=1`` from opset 14: under the default a 0 in the target shape means "copy that dim of ``y``", so a
    zero batch (an RNN's ``(T, 0)`` rows, a ``(B, 0)`` sequence) was read as another shape and ORT's Reshape failed."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def symbolic(g: Any, y: Any, x: Any) -> Any:
        def part(t: Any, start: int, end: int) -> Any:
            ends = _c(g, [end], torch.int64)
            return g.op("Slice", g.op("Shape", t), _c(g, [start], torch.int64), ends, _c(g, [0], torch.int64))
        shape = g.op("Concat", part(x, 0, -1), part(y, -1, 2**62), axis_i=0)
        return g.op("Reshape", y, shape, allowzero_i=1) if g.opset >= 14 else g.op("Reshape", y, shape)


class _HalfLinearFn(torch.autograd.Function):
    """float16-weight linear in float32; ONNX: MatMul(x, CastLike(FLOAT16 Wᵀ, x)) (+ Add bias).

    Below opset 15 (no CastLike) the exporter folds the cast and the file holds float32 weights.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_t: _Const, bias_c: _Const | None) -> torch.Tensor:  # type: ignore[override]
        with _untraced():
            return F.linear(x, w_t.t.t().to(x.dtype), None if bias_c is None else bias_c.t)

    @staticmethod
    def symbolic(g: Any, x: Any, w_t: _Const, bias_c: _Const | None) -> Any:
        w = _c(g, w_t)  # CastLike: torch's constant folding would turn Cast(FLOAT16 constant) into a FLOAT one
        y = g.op("MatMul", x, g.op("CastLike", w, x) if g.opset >= 15 else g.op("Cast", w, to_i=1))
        return y if bias_c is None else g.op("Add", y, _c(g, bias_c))


class _NotATensor(NotATensor):
    """``DynamicLinearTwin.weight`` / ``.bias``: the stored weight's metadata, no tensor (``nn.TransformerEncoderLayer``
    reads ``linear1.weight`` in eval mode to check its fused fast path; see ``NotATensor``)."""

    __slots__ = ("device", "dtype", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.device, self.dtype, self.shape = t.device, t.dtype, t.shape


class DynamicLinearTwin(nn.Module):
    """Twin of a dynamic ``Linear``: eager forward = the module's numerics; ONNX graph in the module doc.

    ``weight_dtype`` (``"auto"``, ``"int8"``, ``"uint8"``) chooses the stored weight code type, as
    ``lowbit.export.qdq.weight_dq`` does.
    """

    def __init__(self, mod: DynamicLinear, weight_dtype: str) -> None:
        super().__init__()
        act = getattr(mod, "activation", "per_token")
        if act != "per_token" and mod.dtype != torch.float16:  # the graph below is the per-token 8-bit recipe only
            raise ValueError(f"to_onnx: a dynamic Linear with activation={act!r} (a 7-bit recipe) has no ONNX twin "
                             "yet; export the default per-token recipe (get_dynamic_qconfig())")
        self.in_features, self.out_features = mod.in_features, mod.out_features
        self.fp16 = mod.dtype == torch.float16
        self.relu = isinstance(mod, DynamicLinearReLU)
        stored = mod.weight_fp16 if self.fp16 else mod.weight_int8
        self.weight = self.bias = _NotATensor(stored)  # type: ignore[assignment] (fast-path checks, see the class)
        bias = None if mod.bias is None else mod.bias.detach().to(torch.float32).cpu()
        self.bias_c = None if bias is None else _Const(bias)
        if self.fp16:
            w16: torch.Tensor = mod.weight_fp16  # type: ignore[assignment]
            self.w_t = _Const(w16.detach().cpu().t())
            return
        codes = mod.weight_int8.detach().cpu()
        zp = mod.weight_zero_point.detach().cpu().to(torch.int64)
        w = mod.weight()
        assert isinstance(w, QTensor)
        self.eager = _Eager(QTensor(codes, w.scale.detach().cpu(), w.zero_point.detach().cpu(), w.qdtype, axis=0), bias)
        self.w_sum = _Const((codes.to(torch.int64).sum(1) - zp * codes.shape[1]).to(torch.int32))
        self.w_scale = _Const(mod.weight_scale.detach().cpu().to(torch.float32))
        shift = weight_dtype == "uint8" or (weight_dtype == "auto" and not saturation_safe(codes))
        if shift:  # u8 x u8 kernels cannot saturate (see lowbit.export.qdq)
            self.w_t = _Const((codes.to(torch.int16) + 128).to(torch.uint8).t())
            self.w_zp = _Const((zp + 128).to(torch.uint8))
        else:
            self.w_t, self.w_zp = _Const(codes.t()), _Const(zp.to(torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, QTensor):
            x = x.dequantize()
        lead = None
        if x.dim() != 2:  # (*, K) -> (M, K) -> (*, N): per-token grids are per row of the 2-D view
            lead, x = x, x.reshape(-1, self.in_features)
        x = x.to(torch.float32).detach()  # export-only twin: no autograd through the untraced bodies
        if self.fp16:
            y = _HalfLinearFn.apply(x, self.w_t, self.bias_c)
        else:
            y = _PerTokenLinearFn.apply(x, self.eager, self.w_t, self.w_zp, self.w_sum,
                                        self.w_scale, self.bias_c)
        y = _LeadReshapeFn.apply(y, lead) if lead is not None else y
        return F.relu(y) if self.relu else y

    def extra_repr(self) -> str:
        kind = "float16 weight" if self.fp16 else f"int8 per-token, weights {self.w_t.t.dtype}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class DynamicRNNTwin(nn.Module):
    """Twin of a dynamic ``RNN`` / ``LSTM`` / ``GRU``: the time loop unrolled, every gate GEMM a ``DynamicLinearTwin``.

    Per layer and direction: one per-token GEMM ``x W_ihᵀ`` over all steps, then per step
    ``h W_hhᵀ`` and the float cell (lowbit's own ``_cell``), exactly as the module computes for a
    padded (non-packed) batch. The ONNX file fixes the number of time steps to the example's (a
    ``Split`` of the steps fails on another length). The batch stays dynamic where it is dim 0 of
    the model's inputs (``batch_first=True``); ``to_onnx`` marks dim 0 as the batch, so export a
    time-major model with ``dynamic_batch=False``. ``PackedSequence`` inputs are not exportable (pad them).
    """

    def __init__(self, mod: DynamicRNN | DynamicLSTM | DynamicGRU, weight_dtype: str) -> None:
        super().__init__()
        self.lstm = isinstance(mod, DynamicLSTM)
        self.hidden_size, self.num_layers, self.batch_first = mod.hidden_size, mod.num_layers, mod.batch_first
        self.dirs = mod._suffixes()
        self.ih = nn.ModuleDict({k: DynamicLinearTwin(v, weight_dtype) for k, v in mod.ih.items()})  # type: ignore[arg-type]
        self.hh = nn.ModuleDict({k: DynamicLinearTwin(v, weight_dtype) for k, v in mod.hh.items()})  # type: ignore[arg-type]
        self._cell, self._split_hx = mod._cell, mod._split_hx  # the module's float cell and hx checks

    def forward(self, input: Any, hx: Any = None) -> tuple[torch.Tensor, Any]:
        if not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
            raise TypeError("to_onnx: a dynamic RNN/LSTM/GRU exports for padded float tensors (2-D or 3-D), got "
                            + (f"shape {tuple(input.shape)}" if isinstance(input, torch.Tensor)
                               else f"{type(input).__name__} (pad a PackedSequence first)"))
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)
        x = x.to(torch.float32)                                                      # (T, B, I)
        n_states = 2 if self.lstm else 1
        if hx is None:
            zeros = x.new_zeros(self.num_layers * len(self.dirs), x.shape[1], self.hidden_size)
            states: tuple[torch.Tensor, ...] = (zeros,) * n_states
        else:
            states = tuple(s.unsqueeze(1) if unbatched else s for s in self._split_hx(hx))
        finals: list[list[torch.Tensor]] = [[] for _ in range(n_states)]
        for layer in range(self.num_layers):
            outs = []
            for d, sfx in enumerate(self.dirs):
                key = f"l{layer}{sfx}"
                gx = self.ih[key](x).unbind(0)                                       # T x (B, G·H)
                state = tuple(s[layer * len(self.dirs) + d] for s in states)
                steps = range(len(gx)) if sfx == "" else reversed(range(len(gx)))
                out: list[torch.Tensor | None] = [None] * len(gx)
                for t in steps:
                    state = self._cell(gx[t], self.hh[key](state[0]), state)
                    out[t] = state[0]
                outs.append(torch.stack(out, 0))  # type: ignore[arg-type]
                for f, s in zip(finals, state):
                    f.append(s)
            x = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        final = tuple(torch.stack(f) for f in finals)
        if unbatched:
            x, final = x.squeeze(1), tuple(f.squeeze(1) for f in final)
        elif self.batch_first:
            x = x.transpose(0, 1)
        return x, ((final[0], final[1]) if self.lstm else final[0])


class DynamicCellTwin(nn.Module):
    """Twin of a dynamic ``RNNCell`` / ``LSTMCell`` / ``GRUCell``: two ``DynamicLinearTwin`` GEMMs and the float step."""

    def __init__(self, mod: RNNCell | LSTMCell | GRUCell, weight_dtype: str) -> None:
        super().__init__()
        self.lstm, self.hidden_size = isinstance(mod, LSTMCell), mod.hidden_size
        self.ih = DynamicLinearTwin(mod.ih, weight_dtype)
        self.hh = DynamicLinearTwin(mod.hh, weight_dtype)
        self._step, self._split_hx = mod._step, mod._split_hx  # the module's float step and hx checks

    def forward(self, input: torch.Tensor, hx: Any = None) -> Any:
        if not isinstance(input, torch.Tensor) or input.dim() not in (1, 2):
            raise TypeError("to_onnx: a dynamic cell exports for float tensors (input_size,) or (batch, input_size), "
                            f"got {tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__}")
        unbatched = input.dim() == 1
        x = (input.unsqueeze(0) if unbatched else input).to(torch.float32)           # (B, I)
        if hx is None:
            state: tuple[torch.Tensor, ...] = (x.new_zeros(x.shape[0], self.hidden_size),) * (1 + self.lstm)
        else:
            state = tuple((s.unsqueeze(0) if unbatched else s).to(torch.float32) for s in self._split_hx(hx))
        new = tuple(n.squeeze(0) if unbatched else n for n in self._step(self.ih(x), self.hh(state[0]), state))
        return (new[0], new[1]) if self.lstm else new[0]


def dynamic_twin(mod: nn.Module, weight_dtype: str) -> nn.Module | None:
    """The export twin of a ``lowbit.nn.quantized.dynamic`` module, or None for any other module."""
    if isinstance(mod, DynamicLinear):
        return DynamicLinearTwin(mod, weight_dtype)
    if isinstance(mod, (DynamicRNN, DynamicLSTM, DynamicGRU)):
        return DynamicRNNTwin(mod, weight_dtype)
    if isinstance(mod, (RNNCell, LSTMCell, GRUCell)):
        return DynamicCellTwin(mod, weight_dtype)
    return None
