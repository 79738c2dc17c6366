"""Pickling a ``QTensor`` (``torch.save`` / ``torch.load``, ``copy.deepcopy``, ``pickle``) as plain parts.

A ``QTensor`` pickles as ``rebuild(codes, scale, zero_point, <its QDtype's fields>, axis)``: tensors, numbers, a
string and a ``torch.dtype``, which ``torch.load``'s default ``weights_only=True`` unpickler reads once ``rebuild``
is on its allow-list (``install`` puts it there, as torch's own quantized tensors load). ``rebuild`` re-checks the
parts (the qparams as ``quantize`` does, the codes and shapes through ``QTensor(...)``), so a tampered file gives a
``ValueError`` naming the bad value, not a bad grid.

A ``QTensor`` is also a pytree node (``torch.utils._pytree``): leaves ``int_repr``, ``scale``, ``zero_point``, its
``QDtype`` and axis the context. So ``torch.export`` takes a model whose forward returns (or takes) QTensors, alone
or inside tuples / dicts: the exported program returns the plain tensors and its ``module()`` rebuilds the QTensors
(``torch.export.save`` / ``load`` keep the context, as JSON, under the name ``lowbit.QTensor``).

>>> import io, torch, lowbit as Q
>>> buf = io.BytesIO()
>>> torch.save({"x": Q.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.5, 3, Q.qint8)}, buf)
>>> _ = buf.seek(0)
>>> torch.load(buf)["x"].int_repr().tolist()        # weights_only=True, torch's default
[4, 1]
>>> leaves, spec = torch.utils._pytree.tree_flatten(Q.quantize_per_tensor(torch.tensor([0.5]), 0.5, 3, Q.qint8))
>>> [t.tolist() for t in leaves], torch.utils._pytree.tree_unflatten(leaves, spec).qdtype == Q.qint8
([[4], 0.5, 3], True)
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..functional import _check_qparams
from ..qscheme import _BUILTIN, QDtype

__all__ = ["rebuild", "install", "PYTREE_NAME"]

PYTREE_NAME = "lowbit.QTensor"  # the node's name in a saved exported program's input / output specs


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


_LEAVES = ("int_repr", "scale", "zero_point")


def _context(qt: Any) -> tuple[Any, ...]:
    qd = qt.qdtype
    return qd.name, qd.bits, qd.signed, qd.quant_min, qd.quant_max, str(qd.storage).removeprefix("torch."), qt.axis


def _flatten(qt: Any) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    return [qt.int_repr(), qt.scale, qt.zero_point], _context(qt)


def _flatten_with_keys(qt: Any) -> tuple[list[tuple[Any, torch.Tensor]], tuple[Any, ...]]:
    leaves, context = _flatten(qt)
    return [(pytree.GetAttrKey(k), v) for k, v in zip(_LEAVES, leaves)], context


def _unflatten(leaves: Any, context: tuple[Any, ...]) -> Any:
    """The QTensor of ``_flatten``'s parts (unchecked, as a kernel's output: they are a QTensor's own, traced or run;
    fake or symbolic while ``torch.export`` traces)."""
    from . import QTensor

    codes, scale, zero_point = leaves
    name, bits, signed, lo, hi, storage, axis = context
    qdtype = QDtype(name, bits, signed, lo, hi, getattr(torch, storage))
    qdtype = _BUILTIN.get(name) if _BUILTIN.get(name) == qdtype else qdtype
    return QTensor._trusted(codes, scale, zero_point, qdtype, axis)


def install(cls: type) -> None:
    """``cls.__reduce_ex__`` (``QTensor``) as plain parts, ``rebuild`` on ``torch.load``'s allow-list, and ``cls`` a
    pytree node (``torch.export`` of models that return or take QTensors)."""
    cls.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign]
    torch.serialization.add_safe_globals([rebuild])
    if cls not in pytree.SUPPORTED_NODES:  # (a module reload must not register it twice: torch refuses that)
        pytree.register_pytree_node(cls, _flatten, _unflatten, serialized_type_name=PYTREE_NAME,
                                    flatten_with_keys_fn=_flatten_with_keys, to_dumpable_context=json.dumps,
                                    from_dumpable_context=lambda s: tuple(json.loads(s)))
