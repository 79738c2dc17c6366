"""``QTensor.view(dtype)``: a QTensor stands for a float tensor, its codes are bytes.

- ``view(torch.float32)`` (or ``view(q.qdtype)``): the dtype the QTensor stands for, a no-op in the float model
  (torch's ``x.view(x.dtype)``): the same QTensor on the same codes (torch raised "stride(-1) must be 1 to view Byte as
  Float" for channels-last codes, or reinterpreted 4 code bytes as one float);
- a 1-byte dtype (``torch.int8`` / ``uint8`` / ``bool``): the codes' bytes as a plain tensor, as torch's quantized
  tensors give them (``torch.quantize_per_tensor(...).view(torch.int8)``);
- any other dtype: a ``ValueError`` naming it (its bytes are neither the float value nor the codes).

>>> import torch, lowbit as Q
>>> q = Q.quantize_per_tensor(torch.tensor([0.5, -0.25]), 0.25, 2, Q.quint8)
>>> dtype_view(q, torch.float32).dequantize().tolist(), dtype_view(q, torch.uint8).tolist()
([0.5, -0.25], [4, 1])
"""

from __future__ import annotations

from typing import Any

import torch

from ..qscheme import QDtype

__all__ = ["dtype_view"]


def dtype_view(qt: Any, dtype: Any) -> Any:
    """``qt.view(dtype)`` (module doc): ``qt``'s own float dtype or grid → a QTensor on the same codes; a 1-byte dtype
    → the codes as that dtype; else a ``ValueError`` naming ``dtype``."""
    if dtype == torch.float32 or (isinstance(dtype, QDtype) and dtype == qt.qdtype):
        return type(qt)._trusted(qt._q, qt._scale, qt._zero_point, qt._qdtype, qt._axis)
    if isinstance(dtype, torch.dtype) and dtype.itemsize == 1 and not dtype.is_floating_point:
        return qt._q.view(dtype)
    raise ValueError(f"QTensor.view(dtype={dtype!r}): a QTensor stands for a float32 tensor on the grid "
                     f"{qt.qdtype!r}; view it as torch.float32 (the same tensor), as torch.int8 / torch.uint8 "
                     "(its codes' bytes), or dequantize() it first")
