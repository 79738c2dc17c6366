"""Ordering ops on ``QTensor`` codes: ``sort``, ``argsort``, ``msort``, ``topk``, ``max`` / ``min`` (all, or along a
dim), ``amax`` / ``amin``, ``argmax`` / ``argmin``, ``kthvalue``, ``median``, ``mode``, ``cummax`` / ``cummin``.

``x̂ = (q - z) s`` with ``s > 0`` is increasing in the code ``q``, so ordering the codes orders the values, ties
included: the values these ops return are codes on the input's grid, exactly, and the indices are the float op's
(torch's quantized ``sort`` / ``topk`` / ``max`` / ``min`` sort ``int_repr()`` too: the same codes, grid and indices;
before session 37 they ran on the dequantized values and returned a float tensor, warned). Per channel, the same holds
along a dim other than the channel axis (each line lies in one channel); the values keep the per-channel grid, the
axis shifted past a reduced dim. Over the channel axis, or over all dims of a per-channel QTensor, channels mix: the
float values, with the fallback warning.

>>> import torch, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([[0.3, -0.1, 0.2]]), 0.1, 10, Q.quint8)
>>> v, i = qt.sort(1)
>>> v.int_repr().tolist(), i.tolist(), qt.max().int_repr().item(), qt.argmax().item()
([[9, 12, 13]], [[1, 2, 0]], 13, 0)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _INT_OPS, QTensor, _warn_float_fallback

__all__: list[str] = []

# name -> (position of ``dim`` among the positional arguments, its default (None: all dims), whether the op reduces
# the dim (keepdim decides), whether it returns values (else indices only))
_OPS: dict[str, tuple[int, Any, bool, bool]] = {
    "sort": (0, -1, False, True), "argsort": (0, -1, False, False), "msort": (-1, 0, False, True),
    "topk": (1, -1, False, True), "max": (0, None, True, True), "min": (0, None, True, True),
    "amax": (0, (), True, True), "amin": (0, (), True, True), "argmax": (0, None, True, False),
    "argmin": (0, None, True, False), "kthvalue": (1, -1, True, True), "median": (0, None, True, True),
    "mode": (0, -1, True, True), "cummax": (0, None, False, True), "cummin": (0, None, False, True),
}


def _dims(x: QTensor, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int] | None:
    """The dims the op orders along (normalised), or ``None`` for all of them."""
    pos, default, _, _ = _OPS[name]
    dim = kwargs.get("dim", args[pos] if 0 <= pos < len(args) else default)
    if dim is None or dim == ():
        return None
    n = max(x.dim(), 1)
    return [d % n for d in ((dim,) if isinstance(dim, int) else dim)]


def _on_codes(name: str) -> Callable:
    pos, _, reduces, values = _OPS[name]

    def method(self: QTensor, *args: Any, **kwargs: Any) -> Any:
        dims = _dims(self, name, args, kwargs) if not any(isinstance(a, (torch.Tensor, QTensor)) for a in args) \
            else []  # max(other) / min(other): elementwise, not an ordering of this tensor
        if dims == [] or (self.axis is not None and (dims is None or self.axis in dims)):
            _warn_float_fallback(f"QTensor.{name}" + ("" if dims == [] else " over the channel axis of a per-channel "
                                                                               "QTensor"))
            return getattr(self.dequantize(), name)(*args, **kwargs)
        out = getattr(self.int_repr(), name)(*args, **kwargs)  # (a bad dim / k: torch's own error)
        if not values:
            return out
        axis = self.axis
        if axis is not None and reduces and not kwargs.get("keepdim", len(args) > pos + 1 and args[pos + 1]):
            axis -= sum(d < axis for d in dims or ())
        if isinstance(out, torch.Tensor):
            return self._regrid(out, axis)
        return type(out)((self._regrid(out[0], axis), *out[1:]))  # (values, indices): torch.return_types
    method.__name__ = name
    return method


for _name in _OPS:
    setattr(QTensor, _name, _on_codes(_name))
    if hasattr(torch, _name):
        _INT_OPS[getattr(torch, _name)] = (lambda n: lambda x, *a, **k: getattr(x, n)(*a, **k) if isinstance(
            x, QTensor) else NotImplemented)(_name)
