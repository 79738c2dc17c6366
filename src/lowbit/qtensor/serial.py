"""Pickling a ``QTensor`` (``torch.save`` / ``torch.load``, ``copy.deepcopy``, ``pickle``) as plain parts.

A ``QTensor`` pickles as ``rebuild(codes, scale, zero_point, <its QDtype's fields>, axis)``: tensors, numbers, a
string and a ``torch.dtype``, which ``torch.load``'s default ``weights_only=True`` unpickler reads once ``rebuild``
is on its allow-list (``install`` puts it there, as torch's own quantized tensors load). ``rebuild`` re-checks the
parts (the qparams as ``quantize`` does, the codes and shapes through ``QTensor(...)``), so a tampered file gives a
``ValueError`` naming the bad value, not a bad grid.

>>> import io, torch, lowbit as Q
>>> buf = io.BytesIO()
>>> torch.save({"x": Q.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.5, 3, Q.qint8)}, buf)
>>> _ = buf.seek(0)
>>> torch.load(buf)["x"].int_repr().tolist()        # weights_only=True, torch's default
[4, 1]
"""

from __future__ import annotations

from typing import Any

import torch

from ..functional import _check_qparams
from ..qscheme import _BUILTIN, QDtype

__all__ = ["rebuild", "install"]


def rebuild(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, name: str, bits: int, signed: bool,
            quant_min: int, quant_max: int, storage: torch.dtype, axis: int | None) -> Any:
    """The ``QTensor`` that ``_reduce_ex`` took apart (its ``QDtype`` the builtin one when the fields are its)."""
    from . import QTensor

    qdtype = QDtype(name, bits, signed, quant_min, quant_max, storage)
    qdtype = _BUILTIN.get(name) if _BUILTIN.get(name) == qdtype else qdtype
    # a file is where bad qparams are made (QTensor(...) checks Python numbers only; tensors where they are made)
    if scale.device.type != "meta":  # (a meta QTensor's qparams have no values: deepcopy of a meta model)
        _check_qparams("QTensor (unpickled)", scale, zero_point, quant_min, quant_max, float_zp=axis is not None)
    return QTensor(codes, scale, zero_point, qdtype, axis)


def _reduce_ex(self: Any, protocol: int) -> tuple[Any, tuple[Any, ...]]:
    qd = self.qdtype
    return rebuild, (self.int_repr(), self.scale, self.zero_point, qd.name, qd.bits, qd.signed, qd.quant_min,
                     qd.quant_max, qd.storage, self.axis)


def install(cls: type) -> None:
    """``cls.__reduce_ex__`` (``QTensor``) as plain parts, and ``rebuild`` on ``torch.load``'s allow-list."""
    cls.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign]
    torch.serialization.add_safe_globals([rebuild])
