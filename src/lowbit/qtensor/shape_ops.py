"""Torch functions on ``QTensor`` codes that select or move codes: exact, the grid kept; the ``chunk`` / ``split`` /
``unbind`` methods (per channel, splitting the channel dim splits the qparams) and the other view methods.

``torch.relu`` / ``F.relu`` (``max(q, z)``; max pooling, also monotone in the codes, is ``pool.py``),
``torch.cat`` / ``torch.stack`` of per-tensor inputs on one grid, ``torch.equal`` (grid and codes, as torch), and
``torch.flatten``
/ ``reshape`` / ``permute`` / ``transpose`` / ``squeeze`` / ``unsqueeze`` / ``chunk`` / ``split`` /
``unbind`` as the ``QTensor`` methods of those names. Anything they decline (``NotImplemented``: a
``cat`` of different grids) takes the float fallback with its warning.

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
    return all(t.qdtype == first.qdtype and torch.equal(t.scale, first.scale)
               and torch.equal(t.zero_point, first.zero_point) for t in ts)


def _cat(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
    ts = list(tensors)
    if kwargs or not _one_grid(ts):
        return NotImplemented
    return ts[0]._same_grid(torch.cat([t.int_repr() for t in ts], dim))


def _stack(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
    """``torch.stack`` of per-tensor QTensors on one grid: the codes stacked (else the float fallback)."""
    ts = list(tensors)
    if kwargs or not _one_grid(ts):
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


# the other view ops: on a per-tensor QTensor they move or select codes (the grid kept), so every view of a quantized
# output stays quantized after convert, as prepare assumes (workflow.hooks._tagged); per channel: the float fallback
_CODE_VIEWS = ("narrow", "select", "unflatten", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "expand",
               "expand_as", "view_as", "reshape_as", "diagonal", "unfold")


def _per_channel_view(x: QTensor, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view op on a per-channel QTensor through the ops that move its axis (indexing, transpose, reshape), or
    ``None`` where none applies (then the float fallback, warned)."""
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


def _code_view(name: str) -> Callable:
    def method(self: QTensor, *args: Any, **kwargs: Any) -> Any:
        if self.axis is not None:
            out = _per_channel_view(self, name, args, kwargs)
            if out is not None:
                return out
            _warn_float_fallback(f"QTensor.{name} on a per-channel QTensor")  # (was silent)
            return getattr(self.dequantize(), name)(*args, **kwargs)
        args = tuple(a.int_repr() if isinstance(a, QTensor) else a for a in args)  # (expand_as / view_as: its shape)
        return self._same_grid(getattr(self.int_repr(), name)(*args, **kwargs))
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


QTensor.chunk, QTensor.split, QTensor.unbind = _chunk, _split, _unbind  # type: ignore[attr-defined,method-assign]
QTensor.equal = _equal  # type: ignore[attr-defined]
for _name in _CODE_VIEWS:
    if _name not in QTensor.__dict__:
        setattr(QTensor, _name, _code_view(_name))

_INT_OPS.update({
    torch.relu: _relu,
    F.relu: _relu,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.stack: _stack,
    torch.equal: _equal,
    torch.Tensor.equal: _equal,
    **{getattr(torch, name): _method(name) for name in (
        "flatten", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "chunk", "split", "unbind",
        "narrow", "select", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal")},
})
