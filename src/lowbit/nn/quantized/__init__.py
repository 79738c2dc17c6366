"""Static quantized modules: integer codes in, integer kernels, integer codes out (DESIGN §3).

>>> import lowbit.nn.quantized as nnq
>>> nnq.Linear(4, 2)
Linear(in_features=4, out_features=2, bias=True, scale=1, zero_point=0, dtype=lowbit.quint8, qscheme=per_channel_symmetric)
"""

from .conv import Conv1d, Conv2d, Conv3d, ConvReLU1d, ConvReLU2d, ConvReLU3d
from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .linear import Linear, LinearReLU
from .linear_float_out import LinearFloatOut
from .activation import ELU, Hardsigmoid, Hardswish, LeakyReLU, ReLU6, Sigmoid, Tanh
from .embedding import Embedding, EmbeddingBag
from .functional_modules import FloatFunctional, QFunctional
from .stubs import DeQuantize, Quantize
from .weight_only import WeightOnlyLinear
from .normalization import Dropout, GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm
from . import dynamic

__all__ = [
    "Linear", "LinearReLU", "LinearFloatOut",
    "Conv1d", "Conv2d", "Conv3d", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d",
    "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "ReLU6", "Hardswish", "Hardsigmoid", "ELU", "LeakyReLU", "Sigmoid", "Tanh",
    "Embedding", "EmbeddingBag", "FloatFunctional", "QFunctional", "Quantize", "DeQuantize", "dynamic",
    "WeightOnlyLinear", "LayerNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "Dropout",
]
