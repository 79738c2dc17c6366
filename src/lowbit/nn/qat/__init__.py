"""QAT module family (``import lowbit.nn.qat as nnqat``).

Weight fake-quant is inside each module (``ConvTranspose*d``: along the output channels, its weight's
axis 1); the output fake-quant is added by ``prepare_qat``.

``LinearReLU`` and ``ConvReLU1d/2d/3d`` live in ``lowbit.nn.intrinsic.qat`` (torch.ao's home for
them) and are also reachable here, where the seeds list them.

>>> import lowbit.nn.qat as nnqat
>>> nnqat.ConvReLU2d.__mro__[1] is nnqat.Conv2d
True
"""

from typing import Any

from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .modules import Conv1d, Conv2d, Conv3d, Embedding, EmbeddingBag, Linear

__all__ = ["Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
           "Embedding", "EmbeddingBag",
           "LinearReLU", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d"]

_FUSED = ("LinearReLU", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d")


def __getattr__(name: str) -> Any:
    if name == "dynamic":  # lowbit.nn.qat.dynamic.Linear (torch.ao's nn.qat.dynamic)
        import importlib

        return importlib.import_module(f"{__name__}.dynamic")
    if name in _FUSED:  # imported lazily: lowbit.nn.intrinsic.qat builds on this package
        from ..intrinsic import qat as nniqat

        return getattr(nniqat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
