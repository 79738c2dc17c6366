"""Making a ``QTensor`` from float values: ``quantize_per_tensor`` (one grid) and ``quantize_per_channel``
(one grid per slice along ``axis``), as ``torch.quantize_per_tensor`` / ``torch.quantize_per_channel``.

``q = clamp(round(x / scale) + zero_point, qmin, qmax)``, with ``scale``/``zero_point`` 0-d (per tensor) or
``(C,)`` broadcast along ``axis`` (per channel); bad qparams raise ``ValueError`` naming the value.

>>> import torch, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([-1.0, 0.26, 9.0]), 0.5, 2, Q.quint8)
>>> qt.int_repr().tolist(), qt.dequantize().tolist()              # 0.26 / 0.5 = 0.52 rounds to 1
([0, 3, 20], [-1.0, 0.5, 9.0])
"""

from __future__ import annotations

import numpy as np
import torch

from ..functional import _check_qparams, check_ch_axis, quantize
from ..qscheme import QDtype, as_qdtype
from . import QTensor

__all__ = ["quantize_per_tensor", "quantize_per_channel"]

_NP_REAL = (np.floating, np.integer)


def _as_number(p: object) -> object:
    """A NumPy real scalar as the Python number it holds; anything else as it is."""
    return p.item() if isinstance(p, _NP_REAL) else p


def quantize_per_tensor(x: torch.Tensor, scale: float | torch.Tensor, zero_point: int | torch.Tensor,
                        dtype: QDtype | str) -> QTensor:
    """Quantize ``x`` onto one grid: ``q = clamp(round(x / scale) + zero_point, qmin, qmax)``.

    ``scale`` must be positive and finite and ``zero_point`` an integer on the grid (``ValueError``)."""
    qdtype = as_qdtype(dtype)
    try:
        _check_qparams("quantize_per_tensor", scale, zero_point, qdtype.quant_min, qdtype.quant_max)
    except TypeError:  # NumPy scalars (np.float32 scale, np.int64 zero point), as torch takes them: Python numbers
        if not isinstance(scale, _NP_REAL) and not isinstance(zero_point, _NP_REAL):
            raise
        return quantize_per_tensor(x, _as_number(scale), _as_number(zero_point), qdtype)
    q = quantize(x, scale, zero_point, qdtype, validate=False)
    if (isinstance(scale, torch.Tensor) and isinstance(zero_point, torch.Tensor) and scale.dim() == 0
            and zero_point.dim() == 0 and scale.dtype == torch.float32 and zero_point.dtype == torch.int64
            and scale.device == q.device and zero_point.device == q.device):  # e.g. a Quantize stub's buffers
        return QTensor._trusted(q, scale, zero_point, qdtype)
    return QTensor(q, scale, zero_point, qdtype)


def quantize_per_channel(x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, axis: int,
                         dtype: QDtype | str) -> QTensor:
    """Quantize ``x`` with one grid per slice along ``axis`` (``scales``/``zero_points`` of shape ``(C,)``)."""
    qdtype = as_qdtype(dtype)
    axis = check_ch_axis(axis, x.dim(), x.shape)
    _check_qparams("quantize_per_channel", scales, zero_points, qdtype.quant_min, qdtype.quant_max, float_zp=True)
    return QTensor(quantize(x, scales, zero_points, qdtype, axis, validate=False), scales, zero_points, qdtype, axis)
