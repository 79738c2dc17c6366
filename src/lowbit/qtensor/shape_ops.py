"""Torch functions on ``QTensor`` codes that select or move codes: exact, the grid kept.

``torch.relu`` / ``F.relu`` (``max(q, z)``), ``F.max_pool1d/2d/3d`` and ``F.adaptive_max_pool2d``
(max is monotone in the codes), ``torch.cat`` of per-tensor inputs on one grid, and ``torch.flatten``
/ ``reshape`` / ``permute`` / ``transpose`` / ``squeeze`` / ``unsqueeze`` / ``chunk`` / ``split`` /
``unbind`` as the ``QTensor`` methods of those names. Anything they decline (``NotImplemented``: a
per-channel max-pool, ``cat`` of different grids) takes the float fallback with its warning.

>>> import torch, torch.nn.functional as F, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([[[-0.2, 0.1, 0.4, 0.3]]]), 0.1, 10, Q.quint8)
>>> F.max_pool1d(qt, 2).int_repr().tolist(), torch.relu(qt).int_repr().tolist()
([[[11, 14]]], [[[10, 11, 14, 13]]])
>>> torch.cat([qt, qt], 0).shape
torch.Size([2, 1, 4])
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..compile_state import tracing
from . import _INT_OPS, QTensor

__all__: list[str] = []


def _method(name: str) -> Callable:
    """``torch.<name>(qtensor, ...)`` as the QTensor method of that name."""
    def op(x: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(x, name)(*args, **kwargs) if isinstance(x, QTensor) else NotImplemented
    return op


def _relu(x: Any, inplace: bool = False) -> Any:
    return x.relu() if isinstance(x, QTensor) else NotImplemented


def _max_pool(fn: Callable) -> Callable:
    def op(x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, QTensor) or x.axis is not None or kwargs.get("return_indices"):
            return NotImplemented
        # max is monotone in the codes, so pooling codes is exact; torch pools uint8 codes only as a
        # quantized tensor (one pass, channels-last kept: used for 2-d on CPU), anything else pools in a
        # float dtype that holds every code exactly
        q = x.int_repr()
        if fn is F.max_pool2d and q.dtype == torch.uint8 and q.device.type == "cpu" and not tracing():
            return x._same_grid(fn(_as_torch_quantized(q), *args, **kwargs).int_repr())
        return x._same_grid(fn(q.to(torch.float32), *args, **kwargs).to(q.dtype))
    return op


_QUIET = [False]  # torch warns once per process that quantized tensors are deprecated: keep it from users


def _as_torch_quantized(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes viewed as a torch quint8 tensor (unit grid; only its codes are used)."""
    if _QUIET[0]:
        return torch._make_per_tensor_quantized_tensor(q, 1.0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch._make_per_tensor_quantized_tensor(q, 1.0, 0)
    _QUIET[0] = True
    return t


def _cat(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
    ts = list(tensors)
    if kwargs or not all(isinstance(t, QTensor) and t.axis is None for t in ts):
        return NotImplemented
    first = ts[0]
    same = (t.qdtype == first.qdtype and torch.equal(t.scale, first.scale)
            and torch.equal(t.zero_point, first.zero_point) for t in ts)
    if not all(same):
        return NotImplemented
    return first._same_grid(torch.cat([t.int_repr() for t in ts], dim))


_INT_OPS.update({
    torch.relu: _relu,
    F.relu: _relu,
    torch.cat: _cat,
    torch.concat: _cat,
    F.max_pool1d: _max_pool(F.max_pool1d),
    F.max_pool2d: _max_pool(F.max_pool2d),
    F.max_pool3d: _max_pool(F.max_pool3d),
    F.adaptive_max_pool2d: _max_pool(F.adaptive_max_pool2d),
    **{getattr(torch, name): _method(name) for name in (
        "flatten", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "chunk", "split", "unbind")},
})
