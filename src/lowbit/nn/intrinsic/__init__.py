"""Fused module families: float markers here, their QAT forms in ``lowbit.nn.intrinsic.qat``.

>>> import lowbit.nn.intrinsic as nni
>>> nni.ConvBnReLU2d.__mro__[1].__name__
'FusedModule'
"""

from .fold import bn_scale, fold_bn_weights
from .modules import (
    BNReLU2d,
    BNReLU3d,
    ClampedReLU,
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    ConvBnReLU1d,
    ConvBnReLU2d,
    ConvBnReLU3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
    ConvTransposeBn1d,
    ConvTransposeBn2d,
    ConvTransposeBn3d,
    FusedModule,
    LinearBn1d,
    LinearReLU,
    as_fusable_relu,
)

__all__ = [
    "FusedModule", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d", "LinearReLU",
    "ConvBn1d", "ConvBn2d", "ConvBn3d", "ConvBnReLU1d", "ConvBnReLU2d", "ConvBnReLU3d",
    "LinearBn1d", "BNReLU2d", "BNReLU3d", "fold_bn_weights", "bn_scale",
    "ClampedReLU", "as_fusable_relu", "ConvTransposeBn1d", "ConvTransposeBn2d", "ConvTransposeBn3d",
]
