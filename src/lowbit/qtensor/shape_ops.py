"""Torch functions on ``QTensor`` codes that select or move codes: exact, the grid kept; the ``chunk`` / ``split`` /
``unbind`` methods (per channel, splitting the channel dim splits the qparams) and the other view methods.

``torch.relu`` / ``F.relu`` (``max(q, z)``; max pooling, also monotone in the codes, is ``pool.py``),
``torch.cat`` / ``torch.stack`` of per-tensor inputs on one grid (per channel: along the channel dim of a ``cat`` the
qparams concatenated, else equal qparams), ``torch.equal`` (grid and codes, as torch), the functional accessors
(``torch.int_repr`` ...), and ``torch.flatten`` / ``reshape`` / ``permute`` / ``transpose`` / ``squeeze`` /
``unsqueeze`` / ``chunk`` / ``split`` / ``split_with_sizes`` / ``tensor_split`` / ``h/v/dsplit`` / ``unbind`` and the
selections (``flip``, ``roll``, ``repeat``, ``index_select``, ``gather``, ``masked_select``, ``expand`` ...; per channel
on the grid ``axis.traced`` finds) as the ``QTensor`` methods of those names. Anything they decline
(``NotImplemented``: a ``cat`` of different grids, a selection mixing channels) takes the float fallback with its
warning.

>>> import torch, torch.nn.functional as F, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([[[-0.2, 0.1, 0.4, 0.3]]]), 0.1, 10, Q.quint8)
>>> F.max_pool1d(qt, 2).int_repr().tolist(), torch.relu(qt).int_repr().tolist()
([[[11, 14]]], [[[10, 11, 14, 13]]])
>>> torch.cat([qt, qt], 0).shape
torch.Size([2, 1, 4])
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import _INT_OPS, QTensor, _warn_float_fallback
from .axis import traced

__all__: list[str] = []


def _method(name: str) -> Callable:
    """``torch.<name>(qtensor, ...)`` as the QTensor method of that name."""
    def op(x: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(x, name)(*args, **kwargs) if isinstance(x, QTensor) else NotImplemented
    return op


def _relu(x: Any, inplace: bool = False) -> Any:
    return x.relu() if isinstance(x, QTensor) else NotImplemented


def _one_grid(ts: list[Any]) -> bool:
    """Whether ``ts`` are per-tensor QTensors on one grid (their codes can be joined as they are)."""
    if not ts or not all(isinstance(t, QTensor) and t.axis is None for t in ts):
        return False
    first = ts[0]
    if any(t.scale.device.type == "meta" for t in ts):  # (meta qparams hold no values to compare: float meta out)
        return False
    return all(t.qdtype == first.qdtype and torch.equal(t.scale, first.scale)
               and torch.equal(t.zero_point, first.zero_point) for t in ts)


def _per_channel_joined(ts: list[Any], dim: int, new_dim: bool) -> Any:
    """``cat`` (``new_dim`` False) / ``stack`` of per-channel QTensors of one dtype and axis: along the channel dim of a
    ``cat`` their qparams are concatenated (each code keeps its channel's grid); along another dim, or stacked, they
    must have equal qparams. Else ``NotImplemented`` (the float fallback); torch refuses both."""
    first = ts[0]
    if not all(isinstance(t, QTensor) and t.axis == first.axis and t.axis is not None and t.qdtype == first.qdtype
               and t.dim() == first.dim() and t.zero_point.dtype == first.zero_point.dtype for t in ts):
        return NotImplemented
    codes = [t.int_repr() for t in ts]
    q = torch.stack(codes, dim) if new_dim else torch.cat(codes, dim)  # (torch's errors: shapes, dim)
    d, a = dim % q.dim(), first.axis
    if not new_dim and d == a:
        return QTensor(q, torch.cat([t.scale for t in ts]), torch.cat([t.zero_point for t in ts]), first.qdtype, a)
    if any(t.scale.device.type == "meta" for t in ts) or not all(
            torch.equal(t.scale, first.scale) and torch.equal(t.zero_point, first.zero_point) for t in ts):
        return NotImplemented
    return QTensor(q, first.scale, first.zero_point, first.qdtype, a + (new_dim and d <= a))


def _cat(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
    """``torch.cat`` of per-tensor QTensors on one grid, or of per-channel ones (``_per_channel_joined``)."""
    ts = list(tensors)
    if kwargs or not ts:
        return NotImplemented
    if isinstance(ts[0], QTensor) and ts[0].axis is not None:
        return _per_channel_joined(ts, dim, False)
    if not _one_grid(ts):
        return NotImplemented
    return ts[0]._same_grid(torch.cat([t.int_repr() for t in ts], dim))


def _stack(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
    """``torch.stack`` of per-tensor QTensors on one grid, or per-channel ones with equal qparams (the axis shifted
    past the new dim): the codes stacked (else the float fallback)."""
    ts = list(tensors)
    if kwargs or not ts:
        return NotImplemented
    if isinstance(ts[0], QTensor) and ts[0].axis is not None:
        return _per_channel_joined(ts, dim, True)
    if not _one_grid(ts):
        return NotImplemented
    return ts[0]._same_grid(torch.stack([t.int_repr() for t in ts], dim))


def _equal(a: Any, b: Any) -> bool:
    """``torch.equal`` as torch's quantized tensors: the same shape, grid (dtype, scheme, scales, zero points, axis)
    and codes; a QTensor never equals a float tensor. Not the values: codes 2 on scale 0.1 and 1 on 0.2 differ."""
    if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
        return False
    return (a.shape == b.shape and a.qdtype == b.qdtype and a.axis == b.axis and a.qscheme() == b.qscheme()
            and torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
            and torch.equal(a.int_repr(), b.int_repr()))


# the other view ops, and the ops that select, move or repeat codes by index: on a per-tensor QTensor they run on the
# codes (the grid kept), so every view of a quantized output stays quantized after convert, as prepare assumes
# (workflow.hooks._tagged); per channel: the ops that move its axis, else the codes' channels traced (``traced``)
_CODE_VIEWS = ("narrow", "select", "unflatten", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "expand",
               "expand_as", "view_as", "reshape_as", "diagonal", "unfold")
_CODE_SELECTIONS = ("flip", "fliplr", "flipud", "rot90", "roll", "repeat", "tile", "index_select", "gather", "take",
                    "take_along_dim", "masked_select", "repeat_interleave", "narrow_copy", "broadcast_to")


def _per_channel_view(x: QTensor, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view op on a per-channel QTensor through the ops that move its axis (indexing, transpose, reshape), or
    ``None`` where none applies (then ``traced``)."""
    a = list(args) + [kwargs[k] for k in ("dim", "start", "length", "index") if k in kwargs]
    if name in ("narrow", "select") and len(a) == (3 if name == "narrow" else 2) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in a):
        getattr(x.int_repr(), name)(*args, **kwargs)  # a bad dim / range: torch's own error (a view: no copy)
        d = a[0] % x.dim()
        start = a[1] + x.shape[d] if a[1] < 0 else a[1]
        return x[(slice(None),) * d + ((slice(start, start + a[2]),) if name == "narrow" else (a[1],))]
    if name == "t" and not args and not kwargs and x.dim() <= 2:
        return x.transpose(0, 1) if x.dim() == 2 else x
    if name in ("swapaxes", "swapdims") and len(args) == 2 and not kwargs:
        return x.transpose(*args)
    if name in ("view_as", "reshape_as") and len(args) == 1 and not kwargs and hasattr(args[0], "shape"):
        return getattr(x, name[:-3])(tuple(args[0].shape))
    return None


def _codes_of(v: Any) -> Any:
    return v.int_repr() if isinstance(v, QTensor) else v  # (expand_as / view_as / broadcast_to of a QTensor: its shape)


def _code_view(name: str) -> Callable:
    def method(self: QTensor, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tuple(_codes_of(a) for a in args), {k: _codes_of(v) for k, v in kwargs.items()}
        if self.axis is None:
            return self._same_grid(getattr(self.int_repr(), name)(*args, **kwargs))
        out = _per_channel_view(self, name, args, kwargs) if name in _CODE_VIEWS else None
        if out is None:
            out = traced(self, lambda t: getattr(t, name)(*args, **kwargs))
        if out is not None:
            return out
        _warn_float_fallback(f"QTensor.{name} on a per-channel QTensor (its codes mix channels)")  # (was silent)
        return getattr(self.dequantize(), name)(*args, **kwargs)
    method.__name__ = name
    return method


def _pieces(x: QTensor, parts: tuple[torch.Tensor, ...], dim: int) -> tuple[Any, ...]:
    """Split results along ``dim``: per channel, splitting the channel dim splits the qparams."""
    dim = dim % x.dim()
    if x.axis != dim:
        return tuple(x._regrid(p, x.axis) for p in parts)
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + p.shape[dim])
    return tuple(x._regrid(p, dim, slice(lo, hi)) for p, lo, hi in zip(parts, offsets, offsets[1:]))


def _chunk(self: QTensor, chunks: int, dim: int = 0) -> tuple[Any, ...]:
    return _pieces(self, self.int_repr().chunk(chunks, dim), dim)


def _split(self: QTensor, split_size_or_sections: Any = None, dim: int = 0, *, split_size: Any = None) -> tuple[Any, ...]:
    sizes = split_size if split_size_or_sections is None else split_size_or_sections
    if sizes is None:
        raise TypeError("QTensor.split() missing its split_size_or_sections argument")
    return _pieces(self, self.int_repr().split(sizes, dim), dim)


def _unbind(self: QTensor, dim: int = 0) -> tuple[Any, ...]:
    """Per channel: unbinding the channel dim gives per-tensor slices (each its channel's grid)."""
    parts, dim, a = self.int_repr().unbind(dim), dim % self.dim(), self.axis
    if a is None or a != dim:
        return tuple(self._regrid(p, None if a is None else a - (dim < a)) for p in parts)
    return tuple(self._regrid(p, None, i) for i, p in enumerate(parts))


def _split_with_sizes(self: QTensor, split_sizes: Any, dim: int = 0) -> tuple[Any, ...]:
    return _pieces(self, self.int_repr().split_with_sizes(split_sizes, dim), dim)


def _tensor_split(self: QTensor, indices_or_sections: Any = None, dim: int = 0, **kwargs: Any) -> tuple[Any, ...]:
    """``tensor_split`` (sections, indices, or ``sections=`` / ``indices=`` / ``tensor_indices_or_sections=``)."""
    q = self.int_repr()
    parts = q.tensor_split(indices_or_sections, dim, **kwargs) if indices_or_sections is not None else \
        q.tensor_split(dim=dim, **kwargs)
    return _pieces(self, parts, dim)


def _split_along(name: str, dim: Callable[[int], int]) -> Callable:
    """``hsplit`` / ``vsplit`` / ``dsplit``: ``tensor_split`` along the dim torch's op uses (torch's own checks)."""
    def method(self: QTensor, indices_or_sections: Any) -> tuple[Any, ...]:
        return _pieces(self, getattr(self.int_repr(), name)(indices_or_sections), dim(self.dim()))
    method.__name__ = name
    return method


QTensor.chunk, QTensor.split, QTensor.unbind = _chunk, _split, _unbind  # type: ignore[attr-defined,method-assign]
QTensor.split_with_sizes, QTensor.tensor_split = _split_with_sizes, _tensor_split  # type: ignore[attr-defined]
QTensor.hsplit = _split_along("hsplit", lambda n: 1 if n > 1 else 0)  # type: ignore[attr-defined]
QTensor.vsplit = _split_along("vsplit", lambda n: 0)  # type: ignore[attr-defined]
QTensor.dsplit = _split_along("dsplit", lambda n: 2)  # type: ignore[attr-defined]
QTensor.ravel = lambda self: self.flatten()  # type: ignore[attr-defined]  # (channels-last codes in NCHW order)
QTensor.equal = _equal  # type: ignore[attr-defined]
for _name in _CODE_VIEWS + _CODE_SELECTIONS:
    if _name not in QTensor.__dict__:
        setattr(QTensor, _name, _code_view(_name))

_INT_OPS.update({
    # torch's functional accessors of a quantized tensor (torch.int_repr(qt) ...) as the QTensor's methods: they ran
    # on the dequantized float tensor and failed deep in torch ("Could not run 'aten::int_repr' ... 'CPU' backend")
    **{getattr(torch, name): _method(name) for name in (
        "int_repr", "q_scale", "q_zero_point", "q_per_channel_scales", "q_per_channel_zero_points",
        "q_per_channel_axis")},
    torch.relu: _relu,
    F.relu: _relu,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.stack: _stack,
    torch.equal: _equal,
    torch.Tensor.equal: _equal,
    **{getattr(torch, name): _method(name) for name in (
        "flatten", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "chunk", "split", "unbind",
        "narrow", "select", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "unflatten",
        "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit", "ravel", *_CODE_SELECTIONS) if hasattr(torch, name)},
})
