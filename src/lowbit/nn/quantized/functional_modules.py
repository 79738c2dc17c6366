"""Observable merge points: ``FloatFunctional`` (float, observed) and ``QFunctional`` (integer).

A model writes ``self.skip = FloatFunctional()`` and ``y = self.skip.add(a, b)`` (one instance
per merge site: the instance's observer sees only that site's output). ``prepare`` replaces its
``activation_post_process`` (an ``Identity`` until then) by an observer; ``convert`` swaps it for a
``QFunctional`` on the observed output grid ``(s, z)``, which works on per-tensor QTensor codes
``q_a, q_b`` with grids ``(s_a, z_a)``, ``(s_b, z_b)`` and requantizes once::

    add:        q = round((q_a - z_a) * s_a/s + (q_b - z_b) * s_b/s) + z
    add_scalar: q = round((q_a - z_a) * s_a/s + c/s) + z
    mul:        q = round((q_a - z_a) * (q_b - z_b) * s_a*s_b/s) + z       # code product exact in float32
    mul_scalar: q = round((q_a - z_a) * s_a*c/s) + z
    matmul:     q = round(((q_a - z_a) @ (q_b - z_b)) * s_a*s_b/s) + z     # (.., M, K) @ (.., K, N)
    cat:        each input requantized onto (s, z) (codes copied when the grid already matches)
    add_relu:   add, then max(q, z)

then ``clamp(q, qmin, qmax)``. The code sums run in float32 (exact for code products, and for
matmul up to K = 258; beyond that the relative rounding is ~1e-7, far below one quantum). A
float or per-channel input makes the method compute in float on dequantized values and quantize
the result onto ``(s, z)``.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.functional_modules import QFunctional
>>> qa = Q.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.01, 128, Q.quint8)
>>> qb = Q.quantize_per_tensor(torch.tensor([0.25, 0.7]), 0.005, 0, Q.quint8)
>>> QFunctional(0.02, 100).add(qa, qb).dequantize().tolist()
[0.7599999904632568, -0.29999998211860657]
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from ... import native
from ...compile_state import deferring, inline_float_ok, qdtype_key, refuse, tracing
from ...fx_leaves import FxLeaf, leaf_method
from ...kernels.plan import input_grid_key
from ...functional import quantize
from ...qscheme import QDtype, quint8
from ...qtensor import QTensor
from ...qtensor.pool import as_torch_quantized
from ._utils import check_no_nan, check_out_grid, output_qparams
from ._state import CheckedQuantState
from .add_alpha import scaled_operand  # (re-exported: the converter's graphs name it here)

__all__ = ["FloatFunctional", "QFunctional", "scaled_operand"]


class FloatFunctional(FxLeaf, nn.Module):
    """Float ``add/mul/cat/add_relu/add_scalar/mul_scalar/matmul`` whose result passes ``activation_post_process``."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process: nn.Module = nn.Identity()

    def forward(self, x: Any) -> Any:
        raise RuntimeError("FloatFunctional is not called directly: use its add/mul/cat/add_relu/"
                           "add_scalar/mul_scalar/matmul methods")

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.add(x, y))

    def add_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self.activation_post_process(torch.add(x, _scalar(y, "add_scalar")))

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.mul(x, y))

    def mul_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self.activation_post_process(torch.mul(x, _scalar(y, "mul_scalar")))

    def cat(self, x: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.activation_post_process(torch.cat(list(x), dim=dim))

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.relu(torch.add(x, y)))

    def matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.matmul(x, y))


def _scalar(c: Any, op: str) -> float:
    if isinstance(c, torch.Tensor) and c.numel() == 1 and not (c.is_complex() or c.dtype == torch.bool):
        v = float(c)
    elif isinstance(c, bool) or not isinstance(c, (int, float)):
        raise TypeError(f"{op}: the scalar operand must be a float or int, got {type(c).__name__} {c!r}")
    else:
        v = float(c)
    if not math.isfinite(v):  # NaN became the lowest code and 0 · inf code 0: finite garbage where float gives NaN/inf
        raise ValueError(f"{op}: the scalar operand must be finite, got {v!r}")
    return v


def _centered(x: Any, op: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q - z) as float32, s`` for a per-tensor QTensor; ``None`` for inputs taking the float path."""
    if isinstance(x, QTensor):
        if x.axis is not None:
            return None
        return x.int_repr().to(torch.float32).sub_(x.zero_point.to(torch.float32)), x.scale  # fresh: in place
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return None
    raise TypeError(f"QFunctional.{op} expects QTensors or float tensors, got {type(x).__name__}"
                    + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))


def _scaled_sum(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                s: torch.Tensor) -> torch.Tensor:
    """``(q_a - z_a) · (s_a / s) + (q_b - z_b) · (s_b / s)``: the same float32 operations in the same order,
    in place on the fresh centred codes when no broadcasting is involved (no new full-size temporaries)."""
    if a[0].shape != b[0].shape:
        return a[0] * (a[1] / s) + b[0] * (b[1] / s)
    return a[0].mul_(a[1] / s).add_(b[0].mul_(b[1] / s))


@functools.lru_cache(maxsize=None)
def _fbgemm_dequantize() -> bool:
    """Whether ``torch.dequantize`` of a CPU quantized tensor is fbgemm's ``scale * (q - zero_point)`` (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def _add_numbers(x: QTensor, y: QTensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: QDtype,
                 relu: bool) -> tuple[float, float, int, int, int, int, int] | None:
    """``(k_a, k_b, z_a, z_b, z, lo, hi)`` of ``_fast_add`` for these grids (``None``: a ratio not finite and positive).
    ``k = fl32(s_in / s)``, the float32 quotient ``_scaled_sum`` multiplies by, from the scales read as Python
    floats: the double quotient of two float32 values rounded to float32 is the float32 quotient (53 >= 2·24 + 2
    bits: no double-rounding error), at a fraction of two tensor divisions' cost."""
    try:  # (QTensor scales are float32: read exactly; the output scale rounded as .to(torch.float32) rounds it)
        s = _f32(scale.item())
        ka, kb = _f32(x.scale.item() / s), _f32(y.scale.item() / s)
    except (OverflowError, ZeroDivisionError):  # a quotient past float32's range, a zero scale
        return None
    if not (0 < ka < float("inf") and 0 < kb < float("inf")):
        return None
    z = int(zero_point)
    return ka, kb, int(x.zero_point), int(y.zero_point), z, (z if relu else qdtype.quant_min), qdtype.quant_max



_MISS = object()


def _f32(v: float) -> float:
    """``v`` rounded to float32 (to nearest, ties to even); ``OverflowError`` past float32's range."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _fast_add(x: Any, y: Any, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: QDtype,
              relu: bool, memo: dict[Any, Any] | None = None) -> QTensor | None:
    """``add`` / ``add_relu`` of two same-shape per-tensor 8-bit CPU QTensors in 6 tensor passes instead of 11,
    bit-identical to ``_scaled_sum`` + ``_out`` (``None`` when the case is not covered).

    ``(q - z) · k`` with ``k = float32(s_in / s)`` is fbgemm's dequantization of the codes viewed as a torch
    quantized tensor of scale ``k`` and zero point ``z`` (``scale * (q - z)`` in float32: one rounding, as
    ours), so the centred, scaled codes come out of one native pass each; then, with integer bounds
    ``lo, hi``, ``clamp(round(acc) + z, lo, hi) = round(clamp(acc, lo - z, hi - z)) + z`` (rounding is
    monotone and fixes integers), and the last add and the narrowing run in int16.
    """
    if not (isinstance(x, QTensor) and isinstance(y, QTensor) and x.axis is None and y.axis is None
            and x.device.type == "cpu" and y.device.type == "cpu" and x.shape == y.shape and x.numel()
            and x.int_repr().element_size() == 1 and y.int_repr().element_size() == 1
            and qdtype.storage in (torch.uint8, torch.int8) and not tracing() and _fbgemm_dequantize()):
        return None
    qa, qb = x.int_repr(), y.int_repr()
    if not ((qa.is_contiguous() or qa.is_contiguous(memory_format=torch.channels_last))
            and (qb.is_contiguous() or qb.is_contiguous(memory_format=torch.channels_last))):
        return None
    if memo is None:
        nums = _add_numbers(x, y, scale, zero_point, qdtype, relu)
    else:  # read once per state of the three grids (~15 µs of tensor arithmetic and item reads per call otherwise)
        grids = (x._scale, x._zero_point, y._scale, y._zero_point, scale, zero_point)
        key = (input_grid_key(grids[0], grids[1]) + input_grid_key(grids[2], grids[3]) + input_grid_key(scale, zero_point)
               + (relu, qdtype))
        hit = memo.get(key, _MISS)
        if hit is _MISS:
            if len(memo) >= 8:
                memo.clear()
            hit = memo[key] = (_add_numbers(x, y, scale, zero_point, qdtype, relu), grids)  # (tensors held: ids stay)
        nums = hit[0]
    if nums is None:
        return None
    ka, kb, za, zb, z, lo, hi = nums

    fused = native.qadd(qa, za, ka, qb, zb, kb, z, lo, hi, qdtype.storage)  # the passes below in one (same codes)
    if fused is not None:
        return QTensor._trusted(fused, scale, zero_point, qdtype)

    def codes(ca: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        acc = torch.dequantize(as_torch_quantized(ca, ka, za)).add_(torch.dequantize(as_torch_quantized(cb, kb, zb)))
        return acc.clamp_(lo - z, hi - z).round_().to(torch.int16).add_(z)

    rows = max(1, _ADD_BLOCK // max(1, qa[0].numel())) if qa.dim() else 0
    if qa.dim() == 0 or qa.shape[0] <= rows or qa.stride() != qb.stride():
        return QTensor._trusted(codes(qa, qb).to(qdtype.storage), scale, zero_point, qdtype)
    # large: the same passes on blocks of whole samples, so the two float32 temporaries stay in L2
    out = torch.empty_like(qa, dtype=qdtype.storage)
    for i in range(0, qa.shape[0], rows):
        out[i:i + rows].copy_(codes(qa[i:i + rows], qb[i:i + rows]))
    return QTensor._trusted(out, scale, zero_point, qdtype)


_ADD_BLOCK = 64 * 1024  # elements per block of a large fast add (two float32 temporaries: 512 KB)


def _inductor_exact(x: QTensor, y: QTensor) -> bool:
    """Whether a traced ``add`` is plain aten ops: CPU tensors, no contraction (``compile_state.inline_float_ok``)
    and no native build. Otherwise the opaque ``lowbit::qfunctional`` op runs: on CUDA or with contraction on for
    exactness; on CPU with ``lowbit.native`` because its eager one-pass add (``_fast_add``) beats inductor's fused
    kernel of the same float32 steps (SmallCNN's 64 × 32 × 14 × 14 add + ReLU on the Zen 4 EPYC, 1 thread: ~125 µs
    against ~178 µs) and nothing else fuses with it since pooling and the flatten copy are opaque too."""
    return x.device.type == "cpu" and y.device.type == "cpu" and inline_float_ok() and not native.traced_available()


def _traced_add(x: QTensor, y: QTensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: QDtype,
                relu: bool) -> QTensor:
    """``add`` / ``add_relu`` as the aten ops of ``_scaled_sum`` + ``_out`` in their order (no data-dependent
    Python value), so that inductor fuses them into one pass over the codes and ``torch.export`` records them;
    the float32 steps are the eager ones, so the codes are too (``tests/test_pt2.py``)."""
    f32 = torch.float32
    a = (x.int_repr().to(f32) - x.zero_point.to(f32)) * (x.scale / scale)
    b = (y.int_repr().to(f32) - y.zero_point.to(f32)) * (y.scale / scale)
    z = zero_point.to(f32)
    q = torch.clamp(torch.round(a + b) + z, qdtype.quant_min, qdtype.quant_max)
    if relu:
        q = torch.maximum(q, z)
    return QTensor(q.to(qdtype.storage), scale, zero_point, qdtype)


def _operands(op: str, *xs: Any) -> list[Any]:
    """Under ``torch.compile``: each integer / bool / complex tensor operand ``_centered`` refuses becomes a float32
    stand-in of its shape as ``lowbit::failed``, which raises that ``TypeError`` when the compiled program runs
    (the first refused operand's, as eager); eager (and export): ``xs`` as they are."""
    if not deferring():
        return list(xs)
    bad = [isinstance(t, torch.Tensor) and not isinstance(t, QTensor) and not t.is_floating_point() for t in xs]
    return [refuse(TypeError, f"QFunctional.{op} expects QTensors or float tensors, got {type(t).__name__} of dtype "
                   f"{t.dtype}", torch.zeros(t.shape, device=t.device), t) if b else t for t, b in zip(xs, bad)]


def _float(x: Any) -> torch.Tensor:
    return x.dequantize() if isinstance(x, QTensor) else x.to(torch.float32)


QF_METHODS = ("add", "add_relu", "mul", "matmul", "add_scalar", "mul_scalar", "cat")  # QFunctional's ops


class QFunctional(CheckedQuantState):
    """The integer twin of ``FloatFunctional``: every method returns a QTensor on ``(scale, zero_point, qdtype)``."""

    def __init__(self, scale: float = 1.0, zero_point: int = 0, qdtype: QDtype | str | torch.dtype = quint8) -> None:
        super().__init__()
        scale, zero_point, self.qdtype = check_out_grid(scale, zero_point, qdtype, "QFunctional")
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor(zero_point, dtype=torch.int64))

    def __getstate__(self) -> dict[str, Any]:
        """Pickles and deep copies leave out the eager memos (``_memo``: requantization constants, ``_scaled``: an
        operand's scaled grid, ``add_alpha``): keyed on the identities of the tensors they were read from, a copy
        could never hit them, and they would carry the copied tensors along."""
        state = self.__dict__.copy()
        state.pop("_memo", None)
        state.pop("_scaled", None)
        return state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``forward(op, *operands)``: the method ``op`` (how a converted graph calls it: as a module, so
        torch.fx keeps the call as one node when it re-traces the graph, e.g. unpickling it; and how a method call
        is recorded when torch.fx traces an eager-converted model: ``leaf_method``)."""
        if not args or not isinstance(args[0], str) or args[0] not in QF_METHODS:
            raise RuntimeError("QFunctional is not called directly: use its add/mul/cat/add_relu/"
                               "add_scalar/mul_scalar/matmul methods")
        return getattr(self, args[0])(*args[1:], **kwargs)

    # ---- requantization onto the output grid ----
    def _out(self, acc: torch.Tensor, relu: bool = False) -> QTensor:
        """``acc`` is the result in units of the output scale (before rounding and the zero point)."""
        d = self.qdtype  # acc is always a fresh temporary here: round, shift and clamp it in place
        q = acc.round_().add_(self.zero_point.to(acc.device, torch.float32))
        q = q.clamp_(int(self.zero_point) if relu else d.quant_min, d.quant_max).to(d.storage)
        return QTensor._trusted(q, self.scale, self.zero_point, d)

    def _from_float(self, y: torch.Tensor, relu: bool = False) -> QTensor:
        check_no_nan(y, type(self).__name__)  # a NaN operand would become a finite code (as at Quantize)
        if relu:
            y = torch.relu(y)
        return QTensor(quantize(y, self.scale, self.zero_point, self.qdtype), self.scale, self.zero_point, self.qdtype)

    def _binary(self, x: Any, y: Any, op: str, int_op: Callable, float_op: Callable, relu: bool = False) -> QTensor:
        x, y = _operands(op, x, y)
        cx, cy = _centered(x, op), _centered(y, op)
        if cx is None or cy is None:
            return self._from_float(float_op(_float(x), _float(y)), relu)
        return self._out(int_op(cx, cy, self.scale.to(cx[0].device)), relu)

    def _eager_add(self, x: QTensor, y: QTensor) -> QTensor:
        fast = _fast_add(x, y, self.scale, self.zero_point, self.qdtype, False, self.__dict__.setdefault("_memo", {}))
        return fast if fast is not None else self._binary(x, y, "add", _scaled_sum, torch.add)

    def _eager_add_relu(self, x: QTensor, y: QTensor) -> QTensor:
        fast = _fast_add(x, y, self.scale, self.zero_point, self.qdtype, True, self.__dict__.setdefault("_memo", {}))
        return fast if fast is not None else self._binary(x, y, "add_relu", _scaled_sum, torch.add, relu=True)

    def _eager_mul(self, x: QTensor, y: QTensor) -> QTensor:
        return self._binary(x, y, "mul", lambda a, b, s: (a[0] * b[0]) * (a[1] * b[1] / s), torch.mul)

    # ---- public methods: eager arithmetic, or one lowbit::qfunctional op while tracing ----
    @leaf_method
    def add(self, x: QTensor, y: QTensor) -> QTensor:
        return self._traced("add", x, y) if tracing() else self._eager_add(x, y)

    @leaf_method
    def add_relu(self, x: QTensor, y: QTensor) -> QTensor:
        return self._traced("add_relu", x, y) if tracing() else self._eager_add_relu(x, y)

    @leaf_method
    def mul(self, x: QTensor, y: QTensor) -> QTensor:
        return self._traced("mul", x, y) if tracing() else self._eager_mul(x, y)

    @leaf_method
    def add_scalar(self, x: QTensor, y: float) -> QTensor:
        return self._traced("add_scalar", x, None, y) if tracing() else self._eager_add_scalar(x, y)

    @leaf_method
    def mul_scalar(self, x: QTensor, y: float) -> QTensor:
        return self._traced("mul_scalar", x, None, y) if tracing() else self._eager_mul_scalar(x, y)

    def _traced(self, op: str, x: Any, y: Any, c: Any = 0.0) -> QTensor:
        """While tracing, per-tensor QTensor inputs go through ``torch.ops.lowbit.qfunctional`` (opaque: the
        compiler cannot reassociate or fuse the float32 steps, so the codes match eager)."""
        if not all(isinstance(t, QTensor) and t.axis is None for t in (x, y) if t is not None):
            return getattr(self, f"_eager_{op}")(x, c if y is None else y)
        if op in ("add", "add_relu") and _inductor_exact(x, y):
            return _traced_add(x, y, self.scale, self.zero_point, self.qdtype, op == "add_relu")
        # (a binary op's ``c`` is the unused default: under ``dynamic=True`` dynamo makes a float default a SymFloat,
        # and ``math.isfinite`` of it broke the graph; only scalar ops read theirs)
        c = _scalar(c, f"QFunctional.{op}") if y is None else 0.0
        yq = (None, None, None, "") if y is None else (y.int_repr(), y.scale, y.zero_point, qdtype_key(y.qdtype))
        q = torch.ops.lowbit.qfunctional(op, x.int_repr(), x.scale, x.zero_point, qdtype_key(x.qdtype), *yq, c,
                                         self.scale, self.zero_point, qdtype_key(self.qdtype))
        return QTensor(q, self.scale, self.zero_point, self.qdtype)

    @leaf_method
    def matmul(self, x: QTensor, y: QTensor) -> QTensor:
        return self._binary(x, y, "matmul", lambda a, b, s: torch.matmul(a[0], b[0]) * (a[1] * b[1] / s),
                            torch.matmul)

    def _eager_add_scalar(self, x: QTensor, y: float) -> QTensor:
        c = _scalar(y, "QFunctional.add_scalar")
        x = _operands("add_scalar", x)[0]
        cx = _centered(x, "add_scalar")
        if cx is None:
            return self._from_float(_float(x) + c)
        s = self.scale.to(cx[0].device)
        return self._out(cx[0] * (cx[1] / s) + c / s)

    def _eager_mul_scalar(self, x: QTensor, y: float) -> QTensor:
        c = _scalar(y, "QFunctional.mul_scalar")
        x = _operands("mul_scalar", x)[0]
        cx = _centered(x, "mul_scalar")
        if cx is None:
            return self._from_float(_float(x) * c)
        return self._out(cx[0] * (cx[1] * c / self.scale.to(cx[0].device)))

    @leaf_method
    def cat(self, x: Sequence[QTensor], dim: int = 0) -> QTensor:
        if isinstance(x, (QTensor, torch.Tensor)) or not isinstance(x, Sequence) or len(x) == 0:
            raise TypeError(f"QFunctional.cat expects a non-empty list of QTensors, got {type(x).__name__}")
        parts, x = [], _operands("cat", *x)
        for t in x:
            c = _centered(t, "cat")
            if c is None:
                return self._from_float(torch.cat([_float(t) for t in x], dim=dim))
            t_: QTensor = t  # type: ignore[assignment]
            # on the output grid already: its codes as they are (while tracing, the requantization below, which gives
            # those very codes on an equal grid, instead of a data-dependent comparison torch.export cannot take)
            if (not tracing() and t_.qdtype == self.qdtype and torch.equal(t_.scale, self.scale.to(t_.device))
                    and torch.equal(t_.zero_point, self.zero_point.to(t_.device))):
                parts.append(t_.int_repr())
            else:
                parts.append(self._out(c[0] * (c[1] / self.scale.to(t_.device))).int_repr())
        return QTensor(torch.cat(parts, dim=dim), self.scale, self.zero_point, self.qdtype)

    @classmethod
    def from_float(cls, mod: nn.Module) -> QFunctional:
        """Build from a prepared and calibrated ``FloatFunctional`` (its observer gives the grid)."""
        if not isinstance(mod, FloatFunctional):
            raise TypeError(f"QFunctional.from_float expects a FloatFunctional, got {type(mod).__name__}")
        if isinstance(mod.activation_post_process, nn.Identity):
            raise ValueError("QFunctional.from_float: this FloatFunctional was never prepared "
                             "(its activation_post_process is Identity); run prepare() and calibrate")
        return cls(*output_qparams(mod, "QFunctional"))

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}, zero_point={self.zero_point.item()}, dtype={self.qdtype!r}"
