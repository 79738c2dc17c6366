"""QAT fused modules (``import lowbit.nn.intrinsic.qat as nniqat``) and the BN-statistics schedule helpers."""

from .conv_transpose_bn import ConvTransposeBn1d, ConvTransposeBn2d, ConvTransposeBn3d
from .modules import (
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    ConvBnReLU1d,
    ConvBnReLU2d,
    ConvBnReLU3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
    LinearBn1d,
    LinearReLU,
    freeze_bn_stats,
    set_bn_fold_mode,
    update_bn_stats,
)

__all__ = [
    "ConvReLU1d", "ConvReLU2d", "ConvReLU3d", "LinearReLU",
    "ConvBn1d", "ConvBn2d", "ConvBn3d", "ConvBnReLU1d", "ConvBnReLU2d", "ConvBnReLU3d", "LinearBn1d",
    "ConvTransposeBn1d", "ConvTransposeBn2d", "ConvTransposeBn3d",
    "freeze_bn_stats", "update_bn_stats", "set_bn_fold_mode",
]
