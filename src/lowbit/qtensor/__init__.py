"""QTensor: integer codes plus the grid they live on (DESIGN §3).

``x̂ = (int_repr - zero_point) * scale`` — per tensor with 0-d qparams, per channel with ``(C,)``
qparams broadcast along ``axis``. A QTensor is a small value object, not a ``torch.Tensor``
subclass: shape ops that keep the grid (view, reshape, flatten, squeeze/unsqueeze, permute,
transpose, indexing, chunk/split/unbind, relu, max_pool, cat of equal grids, flip / roll / repeat / index_select /
gather / expand ...; ``qtensor/shape_ops.py``) stay integer, and so do average pooling, ``mean``, nearest
interpolation, constant padding, clamping, ``masked_fill`` (``qtensor/ops.py``) and sort / topk / max / min
(``qtensor/order.py``);
any other torch op runs on the dequantized values and warns once, naming the op, so a model never
crashes at an int8/float boundary.

Per channel, a shape op moves ``axis`` with the channel dim (``permute``, ``transpose``, a reshape
that keeps the dim whole, indexing); an int index or ``unbind`` on the channel dim leaves a
per-tensor slice on that channel's grid; ``chunk``/``split`` along it split the qparams. A reshape
that merges or splits the channel dim, or advanced indexing, runs on float values (with the warning), unless
there is one channel: its grid, per tensor (as a squeezed size-1 channel dim). Conversions: ``qtensor/convert.py``.

>>> import torch, lowbit as Q
>>> qt = Q.quantize_per_channel(torch.tensor([[0.5, -1.0], [2.0, 4.0]]),
...                             torch.tensor([0.01, 0.1]), torch.tensor([0, 0]), 0, Q.qint8)
>>> qt.int_repr().tolist(), qt.q_per_channel_scales().tolist(), qt.q_per_channel_axis()
([[50, -100], [20, 40]], [0.009999999776482582, 0.10000000149011612], 0)
>>> qt.dequantize()[1].tolist()
[2.0, 4.0]
>>> qt.transpose(0, 1).q_per_channel_axis(), qt[1].q_scale(), [p.q_per_channel_axis() for p in qt.chunk(2, 1)]
(1, 0.10000000149011612, [0, 0])
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable

import torch

from ..compile_state import tracing
from ..functional import _F32_MAX, _F32_TINY, check_ch_axis, dequantize
from ..qscheme import QDtype, QScheme, as_qdtype
from .axis import indexed_axis, reshaped_axis, traced
from .dtype_view import dtype_view
from .layout import contiguous_codes, merges_channels_last, view_of_channels_last

__all__ = ["QTensor", "quantize_per_tensor", "quantize_per_channel"]

_warned_ops: set[str] = set()


def _warn_float_fallback(op: str) -> None:
    # once per op; not while dynamo traces (``warnings.warn`` is a graph break: ``fullgraph=True`` failed on it)
    if op not in _warned_ops and not torch.compiler.is_dynamo_compiling():
        _warned_ops.add(op)
        warnings.warn(f"lowbit: {op} has no integer implementation for QTensor inputs; it ran on dequantized "
                      "float values (the output is float). Quantize it or move it outside the quantized region.",
                      stacklevel=3)


def _check_python_qparams(scale: Any, zero_point: Any) -> None:
    """Python-number qparams (free to check): a positive finite scale and an integral zero point.
    Tensor qparams are checked where they are made (``quantize``, module ``load_state_dict``)."""
    if isinstance(scale, bool) or isinstance(zero_point, bool):
        raise TypeError(f"QTensor: scale={scale!r} and zero_point={zero_point!r} must be numbers or tensors, not bools")
    if isinstance(scale, (int, float)) and not _F32_TINY <= scale <= _F32_MAX:
        raise ValueError(f"QTensor: scale={scale!r} must be a positive finite number (in float32, as it is stored)")
    if isinstance(zero_point, float) and not zero_point.is_integer():
        raise ValueError(f"QTensor: zero_point={zero_point!r} must be an integer")


class QTensor:
    """Integer codes ``int_repr`` (``qdtype.storage``) with ``scale``/``zero_point`` (0-d or ``(C,)``)."""

    # _tq: None, or a torch quantized tensor on this very grid whose storage *is* the codes (a kernel's output, kept
    # so that the next fbgemm call or DeQuantize takes it as it is instead of wrapping the codes again); _tu: None, or
    # one with the same codes on scale 1 and this zero point (Quantize's store). _c: the plain codes, or None while a
    # native tensor holds them: made on first use (_q), a copy up to 4096 codes (the natives then dropped) else a view
    __slots__ = ("_c", "_scale", "_zero_point", "_qdtype", "_axis", "_tq", "_tu")

    def __init__(self, int_repr: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int,
                 qdtype: QDtype | str, axis: int | None = None) -> None:
        qdtype = as_qdtype(qdtype)
        if not isinstance(int_repr, torch.Tensor):
            raise TypeError(f"QTensor int_repr must be an integer tensor, got {type(int_repr).__name__}")
        if int_repr.is_floating_point() or int_repr.is_complex() or int_repr.dtype == torch.bool:
            raise TypeError(f"QTensor int_repr must be an integer tensor, got dtype {int_repr.dtype}")
        _check_python_qparams(scale, zero_point)
        if isinstance(zero_point, int) and not qdtype.quant_min <= zero_point <= qdtype.quant_max:
            raise ValueError(f"QTensor: zero_point={zero_point} is outside the {qdtype!r} grid "
                             f"[{qdtype.quant_min}, {qdtype.quant_max}]")
        if int_repr.dtype != qdtype.storage and int_repr.numel() and not tracing() and not bool(
                ((int_repr >= qdtype.quant_min) & (int_repr <= qdtype.quant_max)).all()):  # (only off the storage dtype)
            raise ValueError(f"QTensor: int_repr ({int_repr.dtype}) holds codes outside the {qdtype!r} grid "
                             f"[{qdtype.quant_min}, {qdtype.quant_max}]")
        if axis is None and isinstance(zero_point, torch.Tensor) and zero_point.is_floating_point():
            if not bool((zero_point == torch.round(zero_point)).all()):  # never truncated (per channel: kept float)
                raise ValueError(f"QTensor: zero_point={zero_point.tolist()} must be an integer")
        float_zp = axis is not None and isinstance(zero_point, torch.Tensor) and zero_point.is_floating_point()
        try:  # a float per-channel zero point is kept (per_channel_affine_float_qparams, torch.ao's embeddings)
            scale, zero_point = torch.as_tensor(scale, dtype=torch.float32, device=int_repr.device), torch.as_tensor(
                zero_point, dtype=torch.float32 if float_zp else torch.int64, device=int_repr.device)
        except (TypeError, ValueError, RuntimeError):  # (torch's error for a str named no value)
            raise TypeError(f"QTensor: scale={scale!r} and zero_point={zero_point!r} must be numbers or tensors") from None
        if axis is not None:
            axis = check_ch_axis(axis, int_repr.dim(), int_repr.shape)
            n = int_repr.shape[axis]
            if scale.shape != (n,) or zero_point.shape != (n,):
                raise ValueError(
                    f"per-channel QTensor along axis {axis} needs ({n},) scales and zero points, "
                    f"got {tuple(scale.shape)} and {tuple(zero_point.shape)}"
                )
        elif scale.numel() != 1 or zero_point.numel() != 1:
            raise ValueError(f"per-tensor QTensor needs scalar qparams, got shape {tuple(scale.shape)}; pass axis")
        else:
            scale, zero_point = scale.reshape(()), zero_point.reshape(())
        self._c, self._scale, self._zero_point, self._qdtype, self._axis = int_repr, scale, zero_point, qdtype, axis
        self._tq = self._tu = None

    @classmethod
    def _trusted(cls, int_repr: torch.Tensor | None, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: QDtype,
                 axis: int | None = None, tq: torch.Tensor | None = None, tu: torch.Tensor | None = None) -> QTensor:
        """A QTensor from parts that already meet ``__init__``'s contract (float32 / int64 qparams on the
        codes' device, 0-d per tensor or ``(C,)`` along ``axis``), without re-checking them: lowbit's own
        kernels and shape ops rewrap validated grids on every call (~0.1 µs instead of ~10 µs). ``tq`` / ``tu``: a
        torch quantized tensor holding the codes on this grid / on scale 1 (``int_repr`` ``None``: made when read)."""
        t = cls.__new__(cls)
        t._c, t._scale, t._zero_point, t._qdtype, t._axis, t._tq, t._tu = int_repr, scale, zero_point, qdtype, axis, tq, tu
        return t

    @property
    def _q(self) -> torch.Tensor:  # the codes; a native tensor's made on first read: int_repr's copy, above 4096 a view
        c = self._c
        if c is None:
            t = self._tu if self._tu is not None else self._tq
            if t.numel() <= 4096:  # (a copy: the natives, no longer sharing its memory, are dropped)
                c, self._tq, self._tu = t.int_repr(), None, None
            else:
                c = torch.empty(0, dtype=self._qdtype.storage).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            self._c = c
        return c

    @property
    def _meta(self) -> torch.Tensor:  # a tensor with the codes' shape and device (no plain codes made)
        c = self._c
        return c if c is not None else self._tu if self._tu is not None else self._tq  # type: ignore[return-value]

    # ---- accessors (the torch.Tensor quantized API) ----
    def int_repr(self) -> torch.Tensor:
        return self._q

    def dequantize(self) -> torch.Tensor:
        """``(int_repr - zero_point) * scale`` in float32 (on the meta device: a meta float32 tensor, unchecked)."""
        return dequantize(self._q, self._scale, self._zero_point, self._axis, validate=self._scale.device.type != "meta")

    def qscheme(self) -> QScheme:
        if self._axis is None:
            return QScheme.PER_TENSOR_AFFINE
        if self._zero_point.is_floating_point():
            return QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS
        return QScheme.PER_CHANNEL_AFFINE

    def _require(self, per_channel: bool, name: str) -> None:
        if (self._axis is not None) != per_channel:
            kind = "per-channel" if self._axis is not None else "per-tensor"
            raise RuntimeError(f"QTensor.{name}() is not defined for a {kind} QTensor")

    def q_scale(self) -> float:
        self._require(False, "q_scale")
        return float(self._scale)

    def q_zero_point(self) -> int:
        self._require(False, "q_zero_point")
        return int(self._zero_point)

    def q_per_channel_scales(self) -> torch.Tensor:
        self._require(True, "q_per_channel_scales")
        return self._scale

    def q_per_channel_zero_points(self) -> torch.Tensor:
        self._require(True, "q_per_channel_zero_points")
        return self._zero_point

    def q_per_channel_axis(self) -> int:
        self._require(True, "q_per_channel_axis")
        assert self._axis is not None
        return self._axis

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def zero_point(self) -> torch.Tensor:
        return self._zero_point

    @property
    def axis(self) -> int | None:
        return self._axis

    @property
    def qdtype(self) -> QDtype:
        return self._qdtype

    @property
    def dtype(self) -> QDtype | torch.dtype:
        """The grid, ``qdtype``; ``torch.float32`` to torch's float modules' own code (``fallback.seen_dtype``)."""
        return self._qdtype if torch.compiler.is_compiling() else seen_dtype(self, sys._getframe(1))

    @property
    def shape(self) -> torch.Size:
        return self._meta.shape

    @property
    def device(self) -> torch.device:
        return self._meta.device

    @property
    def is_quantized(self) -> bool:
        return True

    def size(self, dim: int | None = None) -> Any:
        return self._meta.size() if dim is None else self._meta.size(dim)

    def dim(self) -> int:
        return self._meta.dim()

    def numel(self) -> int:
        return self._meta.numel()

    def __len__(self) -> int:
        return len(self._meta)

    def detach(self) -> QTensor:
        return self

    # ---- integer-preserving ops ----
    def _same_grid(self, q: torch.Tensor) -> QTensor:
        return QTensor._trusted(q, self._scale, self._zero_point, self._qdtype)

    def _regrid(self, q: torch.Tensor, axis: int | None, channels: Any = slice(None)) -> Any:
        """Codes ``q`` on this grid; per channel, ``axis`` is where the channel dim now is and
        ``channels`` selects its qparams (an int selects one channel: the result is per tensor on its grid, or,
        for a fractional float zero point no per-tensor grid holds, the float values ``(q - z) * s``, warned). A slice
        or index tensor keeping one channel of several is that channel's per-tensor grid too, as torch's slices
        (``qt[:, 1:2]``, ``narrow``, ``split`` / ``chunk`` pieces of one channel; they stayed per channel)."""
        if self._axis is None:
            return self._same_grid(q)
        if not isinstance(channels, int) and self._scale.numel() > 1 and axis is not None and q.shape[axis] == 1:
            channels = range(self._scale.numel())[channels][0] if isinstance(channels, slice) else int(channels[0])
        s, z = self._scale[channels], self._zero_point[channels]
        if isinstance(channels, int) and z.is_floating_point() and z.device.type != "meta" and bool(z != torch.round(z)):
            _warn_float_fallback("selecting one channel of a float-zero-point per-channel QTensor")  # (was a ValueError)
            return (q.to(torch.float32) - z) * s
        return QTensor(q, s, z, self._qdtype, None if isinstance(channels, int) else axis)

    def _float_fallback(self, name: str, *args: Any) -> Any:
        _warn_float_fallback(f"QTensor.{name} on a per-channel QTensor")
        return getattr(self.dequantize(), name)(*args)

    def _reshaped(self, name: str, *args: Any) -> Any:
        """A reshape-like op: per channel, it stays integer when the channel dim survives intact."""
        q = self._q
        if q.dim() == 4 and self._axis is None and (name in ("flatten", "reshape") and merges_channels_last(q, name, args)
                                                    or name == "view" and view_of_channels_last(q, args)):
            q = contiguous_codes(q)
        q = getattr(q, name)(*args)
        if self._axis is None:
            return self._same_grid(q)
        axis = reshaped_axis(self.shape, self._axis, q.shape)
        if axis is None and self.shape[self._axis] == 1:  # one channel (squeezed, merged): its grid, as torch's
            return self._regrid(q, None, 0)
        return self._float_fallback(name, *args) if axis is None else self._regrid(q, axis)

    def view(self, *shape: Any, **kwargs: Any) -> Any:
        """A view of another shape; ``view(dtype)`` (``dtype_view``): ``torch.float32`` the same tensor, a 1-byte dtype
        its codes' bytes as a plain tensor (``torch.quantize_per_tensor(...).view(torch.int8)``), else a clear error."""
        if "dtype" in kwargs or (len(shape) == 1 and isinstance(shape[0], (torch.dtype, QDtype))):
            return dtype_view(self, kwargs.pop("dtype", None) or shape[0])
        if "size" in kwargs:
            shape = (kwargs.pop("size"),)
        return self._reshaped("view", *shape)

    def reshape(self, *shape: Any, **kwargs: Any) -> QTensor:
        if "shape" in kwargs:
            shape = (kwargs.pop("shape"),)
        return self._reshaped("reshape", *shape)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> QTensor:
        return self._reshaped("flatten", start_dim, end_dim)

    def squeeze(self, *dim: Any, **kwargs: Any) -> QTensor:
        if "dim" in kwargs:
            dim = (kwargs.pop("dim"),)
        return self._reshaped("squeeze", *dim)

    def unsqueeze(self, dim: int) -> QTensor:
        return self._reshaped("unsqueeze", dim)

    def permute(self, *dims: Any, **kwargs: Any) -> QTensor:
        """Per channel, the channel axis moves to where ``dims`` puts it."""
        if "dims" in kwargs:
            dims = (kwargs.pop("dims"),)
        q = self._q.permute(*dims)
        moved = [d % self.dim() for d in (dims[0] if len(dims) == 1 and not isinstance(dims[0], int) else dims)]
        return self._regrid(q, None if self._axis is None else moved.index(self._axis))

    def transpose(self, dim0: int, dim1: int) -> QTensor:
        d0, d1 = dim0, dim1
        q, a = self._q.transpose(d0, d1), self._axis
        if a is not None:  # the channel axis follows the swap
            d0, d1 = d0 % self.dim(), d1 % self.dim()
            a = d1 if a == d0 else d0 if a == d1 else a
        return self._regrid(q, a)

    def contiguous(self, *args: Any, **kwargs: Any) -> QTensor:
        return QTensor(self._q.contiguous(*args, **kwargs), self._scale, self._zero_point, self._qdtype, self._axis)

    def __getitem__(self, idx: Any) -> QTensor:
        """Indexing; per channel, basic indices (ints, slices, ``None``, ``...``) keep the grid: an
        int on the channel dim gives that channel's per-tensor grid, a slice slices the qparams; advanced indices
        (tensors, bools) take the grid ``axis.traced`` finds (float values where the codes mix channels)."""
        q = self._q[idx]
        if self._axis is None:
            return self._same_grid(q)
        where = indexed_axis(idx, self.dim(), self._axis)
        if where is not None:
            return self._regrid(q, *where)
        out = traced(self, lambda t: t[idx])  # advanced indexing: the grid its channels say, else float values
        return self._float_fallback("__getitem__", idx) if out is None else out

    def relu(self) -> QTensor:
        """ReLU on codes: ``max(q, zero_point)`` — exact, the grid is unchanged (float per-channel zero points:
        ``max(q, round(z))``, 0.0's code; ``ops.zero_codes``)."""
        if self._axis is not None:
            return QTensor(torch.maximum(self._q, ops.zero_codes(self).to(self._q.dtype)),
                           self._scale, self._zero_point, self._qdtype, self._axis)
        if tracing():  # no zero point read into Python (torch.export would guard on it): the same codes as a tensor op
            return self._same_grid(torch.maximum(self._q, self._zero_point.to(self._q.dtype)))
        return self._same_grid(torch.clamp(self._q, min=int(self._zero_point)))

    def clamp(self, min: Any = None, max: Any = None) -> Any:  # noqa: A002 - torch's names
        return torch.clamp(self, min, max)

    def mean(self, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:  # dtype=: a float mean
        return torch.mean(self, *(() if dim is None else (dim, keepdim)), **({} if dtype is None else {"dtype": dtype}))

    # ---- everything else: float fallback ----
    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fast = _INT_OPS.get(func)
        if fast is not None:
            out = fast(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = getattr(func, "__name__", repr(func))
        run = torch_ao_kernel(func)  # (fallback.py: a torch.ao quantized kernel that cannot take float values says so)
        memo: dict[int, torch.Tensor] = {}
        dtype = fallback_dtype(args, kwargs)
        args, kwargs = _tree_dequantize(args, memo, dtype), _tree_dequantize(kwargs, memo, dtype)
        if run is None:
            _warn_float_fallback(f"torch.{name}")
            return func(*args, **kwargs)
        out = run(func, args, kwargs)
        _warn_float_fallback(f"torch.ops.quantized.{name}")  # (one that can, e.g. linear_dynamic: the usual warning)
        return out


def _tree_dequantize(obj: Any, memo: dict[int, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> Any:
    """``obj`` with every QTensor dequantized; one float tensor per QTensor object (``memo``: its id -> the values),
    so arguments that were the same QTensor stay the same tensor (``nn.MultiheadAttention`` takes its packed
    self-attention path on ``query is key is value``: three copies took the other path, off in the last bits).
    ``dtype``: the values' dtype where not the QTensor's own (``fallback.fallback_dtype``)."""
    memo = {} if memo is None else memo
    if isinstance(obj, QTensor):
        t = memo.get(id(obj))
        if t is None:
            t = obj.dequantize()
            if dtype is not None:
                t = t.to(dtype)
            memo[id(obj)] = t
        return t
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree_dequantize(o, memo, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _tree_dequantize(v, memo, dtype) for k, v in obj.items()}
    return obj


_INT_OPS: dict[Callable, Callable] = {}  # torch function -> integer implementation (shape_ops.py, pool.py, ops.py)


from . import ops, order, pool, shape_ops  # noqa: E402,F401  register their integer ops into _INT_OPS
from .convert import install as _install_conversions  # noqa: E402
from .factories import quantize_per_channel, quantize_per_tensor  # noqa: E402
from .fallback import fallback_dtype, install as _install_fallback, seen_dtype, torch_ao_kernel  # noqa: E402
from .serial import install as _install_pickling  # noqa: E402

_install_conversions(QTensor)  # to / type / type_as / int() / float() ..., format, requires_grad_ (convert.py)
_install_fallback(QTensor)  # every other torch.Tensor method / attribute: the float fallback (fallback.py)
_install_pickling(QTensor)  # torch.save / torch.load (weights_only), deepcopy, pickle as plain parts (serial.py)
