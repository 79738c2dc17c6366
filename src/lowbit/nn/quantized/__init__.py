"""Static quantized modules: integer codes in, integer kernels, integer codes out (DESIGN §3).

>>> import lowbit.nn.quantized as nnq
>>> nnq.Linear(4, 2)
Linear(in_features=4, out_features=2, bias=True, scale=1, zero_point=0, dtype=lowbit.quint8, qscheme=per_channel_symmetric)
"""

from .conv import Conv1d, Conv2d, Conv3d, ConvReLU1d, ConvReLU2d, ConvReLU3d
from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .linear import Linear, LinearReLU

__all__ = [
    "Linear", "LinearReLU",
    "Conv1d", "Conv2d", "Conv3d", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d",
    "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
]
