"""Quantization schemes and quantized dtypes: the integer grids and how codes are stored.

A ``QDtype`` is a tiny value object: the grid ``[quant_min, quant_max]`` and the torch dtype that
physically holds the codes. A ``QScheme`` says how qparams are shared (per tensor or per channel)
and how the zero point is chosen (affine: free; symmetric: pinned).

>>> import lowbit as Q
>>> Q.quint8.quant_min, Q.quint8.quant_max, Q.qint8.storage
(0, 255, torch.int8)
>>> Q.per_channel_symmetric.is_per_channel, Q.per_channel_symmetric.is_symmetric
(True, True)
>>> Q.qint8.with_range(-127, 127)
lowbit.qint8[-127, 127]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "QScheme",
    "QDtype",
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
    "qint8",
    "quint8",
    "qint32",
    "qint4",
    "quint4",
    "as_qscheme",
    "as_qdtype",
]


class QScheme(enum.Enum):
    """How scale / zero_point are shared and chosen."""

    PER_TENSOR_AFFINE = "per_tensor_affine"
    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_AFFINE = "per_channel_affine"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"
    # torch.ao's embedding scheme: per channel, unwidened min/max, *float* zero point z = -min / s
    PER_CHANNEL_AFFINE_FLOAT_QPARAMS = "per_channel_affine_float_qparams"

    @property
    def is_per_channel(self) -> bool:
        return self in (QScheme.PER_CHANNEL_AFFINE, QScheme.PER_CHANNEL_SYMMETRIC,
                        QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS)

    @property
    def has_float_zero_point(self) -> bool:
        """Whether zero points are float32 (``per_channel_affine_float_qparams``) rather than integer codes."""
        return self is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS

    @property
    def is_symmetric(self) -> bool:
        return self in (QScheme.PER_TENSOR_SYMMETRIC, QScheme.PER_CHANNEL_SYMMETRIC)

    def __repr__(self) -> str:
        return f"lowbit.{self.value}"


per_tensor_affine = QScheme.PER_TENSOR_AFFINE
per_tensor_symmetric = QScheme.PER_TENSOR_SYMMETRIC
per_channel_affine = QScheme.PER_CHANNEL_AFFINE
per_channel_symmetric = QScheme.PER_CHANNEL_SYMMETRIC
per_channel_affine_float_qparams = QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS

_TORCH_QSCHEMES = {
    torch.per_tensor_affine: per_tensor_affine,
    torch.per_tensor_symmetric: per_tensor_symmetric,
    torch.per_channel_affine: per_channel_affine,
    torch.per_channel_symmetric: per_channel_symmetric,
    torch.per_channel_affine_float_qparams: per_channel_affine_float_qparams,
}


@dataclass(frozen=True)
class QDtype:
    """An integer grid ``[quant_min, quant_max]`` of ``bits`` bits, codes held in ``storage``.

    ``quant_min``/``quant_max`` may be narrower than the full ``bits`` range (a custom grid such
    as ``qint8.with_range(-127, 127)``); they must never exceed what ``storage`` can hold.
    """

    name: str
    bits: int
    signed: bool
    quant_min: int
    quant_max: int
    storage: torch.dtype

    def __post_init__(self) -> None:
        for k in ("bits", "quant_min", "quant_max"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"QDtype {self.name!r}: {k}={v!r} must be an int")
        if not isinstance(self.storage, torch.dtype) or self.storage.is_floating_point or self.storage.is_complex:
            raise TypeError(f"QDtype {self.name!r}: storage={self.storage!r} must be an integer torch dtype")
        info = torch.iinfo(self.storage) if self.storage != torch.bool else None
        if info is None or self.quant_min < info.min or self.quant_max > info.max:
            raise ValueError(f"QDtype {self.name!r}: range [{self.quant_min}, {self.quant_max}] does not fit its "
                             f"storage {self.storage}")
        if self.quant_min >= self.quant_max:
            raise ValueError(
                f"QDtype {self.name!r}: quant_min={self.quant_min} must be < quant_max={self.quant_max}"
            )
        lo, hi = (-(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1) if self.signed else (0, 2**self.bits - 1)
        if self.quant_min < lo or self.quant_max > hi:
            raise ValueError(
                f"QDtype {self.name!r}: range [{self.quant_min}, {self.quant_max}] does not fit "
                f"{self.bits}-bit {'signed' if self.signed else 'unsigned'} codes [{lo}, {hi}]"
            )
        # the grid as one string (compile_state.qdtype_key), made here: a traced QTensor input's QDtype ints become
        # symbolic once dynamo sees them change (its automatic dynamic), and a key formatted from them while tracing
        # cannot be (``BUILD_STRING``); a string attribute is a constant that dynamo guards by equality
        object.__setattr__(self, "_key", f"{self.name}:{self.quant_min}:{self.quant_max}")

    def __setstate__(self, state: dict) -> None:  # (unpickling skips __post_init__; a pickle from before has no _key)
        self.__dict__.update(state)
        object.__setattr__(self, "_key", f"{self.name}:{self.quant_min}:{self.quant_max}")

    @property
    def has_custom_range(self) -> bool:
        full = _BUILTIN.get(self.name)
        return full is None or (full.quant_min, full.quant_max) != (self.quant_min, self.quant_max)

    def with_range(self, quant_min: int, quant_max: int) -> QDtype:
        """The same storage with a narrower grid, e.g. ``quint8.with_range(0, 127)`` (reduce_range)."""
        for k, v in (("quant_min", quant_min), ("quant_max", quant_max)):
            if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
                raise TypeError(f"QDtype.with_range: {k}={v!r} must be an int")
        return QDtype(self.name, self.bits, self.signed, int(quant_min), int(quant_max), self.storage)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The matching ``torch.q*`` dtype (for interop with ``torch.ao``), or ``None``."""
        return {"qint8": torch.qint8, "quint8": torch.quint8, "qint32": torch.qint32}.get(self.name)

    def __repr__(self) -> str:
        if self.has_custom_range:
            return f"lowbit.{self.name}[{self.quant_min}, {self.quant_max}]"
        return f"lowbit.{self.name}"


qint8 = QDtype("qint8", 8, True, -128, 127, torch.int8)
quint8 = QDtype("quint8", 8, False, 0, 255, torch.uint8)
qint32 = QDtype("qint32", 32, True, -(2**31), 2**31 - 1, torch.int32)
qint4 = QDtype("qint4", 4, True, -8, 7, torch.int8)
quint4 = QDtype("quint4", 4, False, 0, 15, torch.uint8)
_BUILTIN = {d.name: d for d in (qint8, quint8, qint32, qint4, quint4)}
_TORCH_QDTYPES = {torch.qint8: qint8, torch.quint8: quint8, torch.qint32: qint32,
                  torch.int8: qint8, torch.uint8: quint8}


def as_qscheme(qscheme: QScheme | str | torch.qscheme) -> QScheme:
    """Accept a ``QScheme``, its string value, or a ``torch.per_*`` qscheme."""
    if isinstance(qscheme, QScheme):
        return qscheme
    if isinstance(qscheme, str):
        try:
            return QScheme(qscheme)
        except ValueError:
            pass
    elif qscheme in _TORCH_QSCHEMES:
        return _TORCH_QSCHEMES[qscheme]
    raise ValueError(
        f"qscheme={qscheme!r} is not a quantization scheme; use one of "
        f"{[s.value for s in QScheme]}"
    )


def as_qdtype(qdtype: QDtype | str | torch.dtype) -> QDtype:
    """Accept a ``QDtype``, a builtin name (``"qint8"``) or a ``torch.qint8``-style dtype."""
    if isinstance(qdtype, QDtype):
        return qdtype
    if isinstance(qdtype, str) and qdtype in _BUILTIN:
        return _BUILTIN[qdtype]
    if isinstance(qdtype, torch.dtype) and qdtype in _TORCH_QDTYPES:
        return _TORCH_QDTYPES[qdtype]
    raise TypeError(
        f"qdtype={qdtype!r} is not a quantized dtype; use one of {sorted(_BUILTIN)} "
        "or a QDtype(...) with a custom range"
    )
