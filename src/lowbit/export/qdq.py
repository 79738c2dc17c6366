"""Export-only float "QDQ twins" of lowbit's quantized modules, lowered to ONNX QDQ nodes.

Every twin is a float ``nn.Module`` whose integer steps are custom autograd functions carrying an
ONNX ``symbolic``, so ``torch.onnx.export(..., dynamo=False)`` writes standard QDQ nodes::

    activation grid (s, z):    x -> QuantizeLinear(x, s, z) -> DequantizeLinear(., s, z)
                               = clamp(round_half_even(x / s) + z, qmin, qmax) - z) * s
    weight (codes q, axis a):  DequantizeLinear(q int8/uint8 initializer, s (C,), z (C,), axis=a)
    bias b (per channel c):    DequantizeLinear(round(b / (s_x s_w[c])) int32, s_x s_w, 0, axis=0)
    quantized Linear / Conv:   Q/DQ(x; s_x) -> Gemm/Conv(., DQ(w), DQ(b)) (-> Relu) -> Q/DQ(.; s_y, z_y)   (weighted.py)

which ONNX Runtime fuses into integer kernels (QLinearConv, QGemm, QLinearMatMul, QLinearAdd, ...).
In eager mode the same twins compute the float simulation (``dequantize(quantize(.))``).

``weight_dtype``: ``"int8"`` stores the codes as they are; ``"uint8"`` stores ``q + 128`` with zero
point ``z + 128`` (same values). x86 CPUs without VNNI multiply u8 activations by s8 weights with
``vpmaddubsw``, whose int16 pair sums saturate for full-range weights; u8 x u8 kernels do not. ``"auto"``
keeps int8 for layers whose weights cannot saturate (``kernels.onednn.saturation_safe``) and uses
uint8 for the others, so the file gives lowbit's results on every CPU.

>>> import torch
>>> from lowbit.export.qdq import QDQ
>>> import lowbit as Q
>>> QDQ(0.1, 10, Q.quint8)(torch.tensor([-2.0, 0.04, 0.26])).tolist()
[-1.0, 0.0, 0.30000001192092896]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import fake_quantize
from ..kernels.onednn import saturation_safe
from ..qscheme import QDtype

__all__ = [
    "QDQ",
    "WEIGHT_DTYPES",
    "ActivationTwin",
    "ConstDQ",
    "ConstWeight",
    "DynamicQDQ",
    "EmbeddingTwin",
    "FunctionalTwin",
    "Grid",
    "out_channel_weight_scale",
    "stored_codes",
    "traced_scalar",
    "untraced",
    "weight_dq",
]

Grid = tuple[float, int, QDtype]  # (scale, zero_point, qdtype) of a per-tensor activation grid
WEIGHT_DTYPES = ("auto", "int8", "uint8")


class _Const:
    """A tensor handed to a ``symbolic`` as a Python object, so it becomes an ONNX constant, not an input."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t.detach().cpu().contiguous()


def _storage(qdtype: QDtype, where: str) -> torch.dtype:
    if qdtype.storage not in (torch.int8, torch.uint8):
        raise ValueError(f"{where}: a {qdtype!r} grid has no ONNX QuantizeLinear form (8-bit or narrower only)")
    return qdtype.storage


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Suspend the TorchScript tracer inside an ``autograd.Function``'s ``forward``: its ``symbolic`` describes the op,
    and its eager body is not traced into a subgraph. A traced body becomes a block of the ``prim::PythonOp`` that
    TorchScript's alias analysis never registers; its alias-sensitive peephole pass still visits it and, on an identity
    ``x + 0`` / ``x - 0`` / ``x * 1`` / ``x / 1`` of a graph tensor and a constant, asks that analysis about the block's
    values: ``IndexError: Argument passed to at() was not in the map`` (``codes.py`` on a zero point of 0)."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)  # type: ignore[attr-defined]


class _QDQFn(torch.autograd.Function):
    """``fake_quantize`` on a per-tensor grid; ONNX: QuantizeLinear -> DequantizeLinear (-> Clip)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, zp: int, qmin: int, qmax: int,  # type: ignore[override]
                storage: torch.dtype) -> torch.Tensor:
        return fake_quantize(x, scale, zp, qmin, qmax)

    @staticmethod
    def symbolic(g: Any, x: Any, scale: float, zp: int, qmin: int, qmax: int, storage: torch.dtype) -> Any:
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        z = g.op("Constant", value_t=torch.tensor(zp, dtype=storage))
        y = g.op("DequantizeLinear", g.op("QuantizeLinear", x, s, z), s, z)
        full = (-128, 127) if storage == torch.int8 else (0, 255)
        if (qmin, qmax) != full:  # a narrower grid (reduce_range, 4-bit): clip to its dequantized ends
            s32 = torch.tensor(scale, dtype=torch.float32)  # (q - z) * s in float32, as DequantizeLinear does
            lo = g.op("Constant", value_t=torch.tensor(float(qmin - zp), dtype=torch.float32) * s32)
            hi = g.op("Constant", value_t=torch.tensor(float(qmax - zp), dtype=torch.float32) * s32)
            y = g.op("Clip", y, lo, hi)
        return y


class _DynamicQDQFn(torch.autograd.Function):
    """Per-call quint8 affine grid from ``x``'s range; ONNX: DynamicQuantizeLinear -> DequantizeLinear."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        lo = torch.clamp(x.detach().min(), max=0.0)
        hi = torch.clamp(x.detach().max(), min=0.0)
        scale = float(torch.clamp((hi - lo) / 255, min=1e-8))
        zp = int(torch.clamp(torch.round(-lo / scale), 0, 255))
        return fake_quantize(x, scale, zp, 0, 255)

    @staticmethod
    def symbolic(g: Any, x: Any) -> Any:
        q, s, z = g.op("DynamicQuantizeLinear", x, outputs=3)
        return g.op("DequantizeLinear", q, s, z)


class _ConstDQFn(torch.autograd.Function):
    """Constant codes dequantized per channel; ONNX: one DequantizeLinear of integer initializers."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, codes: _Const, scale: _Const, zp: _Const,  # type: ignore[override]
                axis: int) -> torch.Tensor:
        shape = [-1 if i == axis else 1 for i in range(codes.t.dim())]
        z, s = zp.t.to(torch.float32).reshape(shape), scale.t.reshape(shape)
        return ((codes.t.to(torch.float32) - z) * s).to(anchor.device)

    @staticmethod
    def symbolic(g: Any, anchor: Any, codes: _Const, scale: _Const, zp: _Const, axis: int) -> Any:
        c, s, z = (g.op("Constant", value_t=v.t) for v in (codes, scale, zp))
        return g.op("DequantizeLinear", c, s, z, axis_i=axis)


class QDQ(nn.Module):
    """Quantize-dequantize onto a per-tensor grid ``(scale, zero_point, qdtype)``."""

    def __init__(self, scale: float, zero_point: int, qdtype: QDtype) -> None:
        super().__init__()
        self.grid = (float(scale), int(zero_point), qdtype)
        self._storage = _storage(qdtype, "QDQ")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, z, d = self.grid
        return _QDQFn.apply(x, s, z, d.quant_min, d.quant_max, self._storage)

    def resample_on_codes(self, x: torch.Tensor, size: Any, scale_factor: Any, align_corners: Any,
                          recompute_scale_factor: Any) -> torch.Tensor:
        """A bilinear resample of ``x`` on the codes of this grid, as the int8 model runs it (``codes.py``): the
        shared-grid mode (``workflow/shared_grids.py``) calls it in a prepared eager model's twin, where the QAT
        model takes the int8 kernel's codes (``bilinear_on_grid``)."""
        from .codes import bilinear_on_codes  # (codes.py imports this module)
        return bilinear_on_codes(x, self.grid, size, scale_factor, align_corners, recompute_scale_factor)

    def extra_repr(self) -> str:
        return f"scale={self.grid[0]:.6g}, zero_point={self.grid[1]}, qdtype={self.grid[2]!r}"


class DynamicQDQ(nn.Module):
    """Quantize-dequantize onto a quint8 grid computed from each input's range (ONNX DynamicQuantizeLinear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DynamicQDQFn.apply(x)


def _qdq(grid: Grid | None) -> nn.Module:
    return DynamicQDQ() if grid is None else QDQ(*grid)


class ConstDQ(nn.Module):
    """A constant float tensor stored as integer ``codes`` with per-channel ``scale``/``zero_point`` along ``axis``."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> None:
        super().__init__()
        self.codes, self.scale, self.axis = _Const(codes), _Const(scale.to(torch.float32)), axis
        self.zero_point = _Const(zero_point.to(codes.dtype))
        self.register_buffer("anchor", torch.zeros(()), persistent=False)  # carries the device

    def forward(self) -> torch.Tensor:
        return _ConstDQFn.apply(self.anchor, self.codes, self.scale, self.zero_point, self.axis)


def stored_codes(codes: torch.Tensor, axis: int, weight_dtype: str) -> tuple[torch.Tensor, int]:
    """int8 weight codes as the file stores them and the shift of their zero point: ``(q + 128, 128)`` as uint8 when
    ``weight_dtype`` asks (see module doc), else ``(q, 0)`` as int8."""
    codes = codes.detach().cpu()
    if weight_dtype == "uint8" or (weight_dtype == "auto" and not saturation_safe(codes.movedim(axis, 0))):
        return (codes.to(torch.int16) + 128).to(torch.uint8), 128
    return codes.to(torch.int8), 0


def out_channel_weight_scale(mod: Any, kind: str) -> torch.Tensor:
    """The weight scale of each output channel (float32): a grouped ConvTranspose's ``(C_in, C_out / groups, *k)``
    weight has one per ``C_out / groups``, and output channel ``o`` reads ``s_w[o % (C_out / groups)]``."""
    sw = mod.weight_scale.detach().cpu().to(torch.float32)
    if kind == "conv_transpose" and mod.bias is not None and sw.numel() != mod.bias.numel():
        sw = sw.repeat(mod.groups)
    return sw


def weight_dq(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int,
              weight_dtype: str) -> ConstDQ:
    """``ConstDQ`` of int8 weight codes, shifted to uint8 when ``weight_dtype`` asks (``stored_codes``)."""
    stored, shift = stored_codes(codes, axis, weight_dtype)
    return ConstDQ(stored, scale, zero_point.detach().cpu().to(torch.int64) + shift, axis)


def traced_scalar(c: Any) -> Any:
    """A scalar operand as a float, or, where the exporter traced it (a graph-mode ``y * y.shape[0]``: a 0-dim
    tensor), as a float32 tensor, so the file computes it per call (``float(c)`` froze the example's batch size)."""
    return c.to(torch.float32) if isinstance(c, torch.Tensor) and torch.jit.is_tracing() else float(c)


class FunctionalTwin(nn.Module):
    """Twin of ``QFunctional``: Q/DQ on each quantized input's grid, the float op, Q/DQ onto the output grid.

    ``in_grids[method]`` lists the grid of each tensor input the converted module received
    (``None`` for float inputs, which take lowbit's float path and get no Q/DQ).
    """

    def __init__(self, mod: Any, in_grids: dict[str, list[Grid | None]]) -> None:
        super().__init__()
        self.out_qdq = QDQ(float(mod.scale), int(mod.zero_point), mod.qdtype)
        self.in_qdq = nn.ModuleDict({f"{op}_{i}": QDQ(*g) for op, gs in in_grids.items()
                                     for i, g in enumerate(gs) if g is not None})

    def _in(self, op: str, *xs: torch.Tensor) -> list[torch.Tensor]:
        return [self.in_qdq[f"{op}_{i}"](x) if f"{op}_{i}" in self.in_qdq else x for i, x in enumerate(xs)]

    def forward(self, op: str, *args: Any) -> torch.Tensor:
        """``QFunctional.forward(op, ...)``: how a converted graph calls it."""
        return getattr(self, op)(*args)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out_qdq(torch.add(*self._in("add", x, y)))

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out_qdq(torch.relu(torch.add(*self._in("add_relu", x, y))))

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out_qdq(torch.mul(*self._in("mul", x, y)))

    def matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out_qdq(torch.matmul(*self._in("matmul", x, y)))

    def add_scalar(self, x: torch.Tensor, c: float) -> torch.Tensor:
        return self.out_qdq(self._in("add_scalar", x)[0] + traced_scalar(c))

    def mul_scalar(self, x: torch.Tensor, c: float) -> torch.Tensor:
        return self.out_qdq(self._in("mul_scalar", x)[0] * traced_scalar(c))

    def cat(self, xs: Any, dim: int = 0) -> torch.Tensor:
        return self.out_qdq(torch.cat(self._in("cat", *xs), dim=dim))


class ActivationTwin(nn.Module):
    """Twin of an activation on quantized values: ``fn`` in float, then onto ``grid``."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], grid: Grid | None) -> None:
        super().__init__()
        self.fn, self.out_qdq = fn, _qdq(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_qdq(self.fn(x))


def renorm_rows(rows: torch.Tensor, max_norm: float | None, norm_type: float) -> torch.Tensor:
    """Looked-up rows (``(..., D)``) longer than ``max_norm`` scaled to ``max_norm / (norm + 1e-7)``, as
    ``nn.Embedding``'s forward: out of place (``F.embedding(max_norm=)`` renorms in place, which the exporter drops)."""
    if max_norm is None:
        return rows
    norm = rows.norm(p=norm_type, dim=-1, keepdim=True)
    return rows * torch.where(norm > max_norm, max_norm / (norm + 1e-7), torch.ones_like(norm))


def check_integer_zero_points(mod: Any) -> None:
    """Raise unless ``mod``'s table has integer zero points (float ones cannot be a DequantizeLinear's)."""
    if mod.weight_zero_point.is_floating_point():
        raise ValueError(f"to_onnx: {type(mod).__name__} has float zero points (per_channel_affine_float_qparams), "
                         "which ONNX DequantizeLinear cannot hold; quantize it with get_embedding_qconfig() "
                         "(integer zero points) to export")


class EmbeddingTwin(nn.Module):
    """Twin of an 8-bit per-row ``Embedding``: ``Gather(DequantizeLinear(table, axis=0), indices)``."""

    def __init__(self, mod: Any) -> None:
        super().__init__()
        check_integer_zero_points(mod)
        self.table = ConstDQ(mod.weight_q, mod.weight_scale, mod.weight_zero_point, 0)
        self.max_norm, self.norm_type = mod.max_norm, mod.norm_type

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return renorm_rows(F.embedding(indices, self.table()), self.max_norm, self.norm_type)


class ConstWeight(nn.Module):
    """Replaces a weight computation by constant codes: ``forward(w)`` ignores ``w``'s value (ONNX: one DQ)."""

    def __init__(self, dq: ConstDQ | None = None) -> None:
        super().__init__()
        self.dq = dq

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        assert self.dq is not None
        return _ConstDQFn.apply(w, self.dq.codes, self.dq.scale, self.dq.zero_point, self.dq.axis)
