"""``QTensor.view(dtype)``: a QTensor stands for a float tensor, its codes are bytes.

- ``view(torch.float32)`` (or ``view(q.qdtype)``, or torch's own name of that grid, ``torch.qint8`` for ``qint8``): the
  dtype the QTensor stands for, a no-op in the float model
  (torch's ``x.view(x.dtype)``): the same QTensor on the same codes (torch raised "stride(-1) must be 1 to view Byte as
  Float" for channels-last codes, or reinterpreted 4 code bytes as one float);
- a 1-byte dtype (``torch.int8`` / ``uint8`` / ``bool``): the codes' bytes as a plain tensor, as torch's quantized
  tensors give them (``torch.quantize_per_tensor(...).view(torch.int8)``);
- any other dtype: a ``ValueError`` naming it (its bytes are neither the float value nor the codes; torch's other
  1-byte dtypes, ``torch.quint8`` / ``quint4x2`` / ``bits8``, gave a tensor of that dtype without a grid, which
  raised ``NotImplementedError`` on any use, or crashed the process).

>>> import torch, lowbit as Q
>>> q = Q.quantize_per_tensor(torch.tensor([0.5, -0.25]), 0.25, 2, Q.quint8)
>>> dtype_view(q, torch.float32).dequantize().tolist(), dtype_view(q, torch.uint8).tolist()
([0.5, -0.25], [4, 1])
>>> dtype_view(q, torch.quint8).qdtype
lowbit.quint8
"""

from __future__ import annotations

from typing import Any

import torch

from ..qscheme import QDtype, as_qdtype

_BYTES = (torch.int8, torch.uint8, torch.bool)  # the codes' bytes as a plain tensor
_TORCH_GRIDS = (torch.qint8, torch.quint8, torch.qint32)  # torch's names of lowbit's grids

__all__ = ["dtype_view"]


def dtype_view(qt: Any, dtype: Any) -> Any:
    """``qt.view(dtype)`` (module doc): ``qt``'s own float dtype or grid → a QTensor on the same codes; a 1-byte dtype
    → the codes as that dtype; else a ``ValueError`` naming ``dtype``."""
    grid = as_qdtype(dtype) if dtype in _TORCH_GRIDS else dtype
    if dtype == torch.float32 or (isinstance(grid, QDtype) and grid == qt.qdtype):
        return type(qt)._trusted(qt._q, qt._scale, qt._zero_point, qt._qdtype, qt._axis)
    if dtype in _BYTES:
        return qt._q.view(dtype)
    raise ValueError(f"QTensor.view(dtype={dtype!r}): a QTensor stands for a float32 tensor on the grid "
                     f"{qt.qdtype!r}; view it as torch.float32 (the same tensor), as torch.int8 / torch.uint8 "
                     "(its codes' bytes), or dequantize() it first")
