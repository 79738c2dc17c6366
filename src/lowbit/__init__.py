"""lowbit: int8 quantization for PyTorch — calibrate, convert, deploy.

``import lowbit as Q`` gives the seeds' ``quantization`` surface: schemes and dtypes,
``calculate_qparams``, quantize/dequantize/fake_quantize, ``QTensor``, observers, ``FakeQuantize``,
``QConfig``/``QConfigMapping`` and the workflows. Module families live in ``lowbit.nn``.

>>> import torch, lowbit as Q
>>> obs = Q.MinMaxObserver()
>>> _ = obs(torch.tensor([-1.0, 3.0]))
>>> [round(v.item(), 5) for v in obs.calculate_qparams()]
[0.01569, 64]
"""

from .functional import dequantize, fake_quantize, quantize
from .qparams import QParams, calculate_qparams
from .qscheme import (
    QDtype,
    QScheme,
    per_channel_affine,
    per_channel_symmetric,
    per_tensor_affine,
    per_tensor_symmetric,
    qint4,
    qint8,
    qint32,
    quint4,
    quint8,
)
from .qtensor import QTensor, quantize_per_channel, quantize_per_tensor

__version__ = "0.1.0"

__all__ = [
    # schemes and dtypes
    "QScheme", "QDtype", "per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
    "per_channel_symmetric", "qint8", "quint8", "qint32", "qint4", "quint4",
    # numerics
    "QParams", "calculate_qparams", "quantize", "dequantize", "fake_quantize",
    "QTensor", "quantize_per_tensor", "quantize_per_channel",
]
