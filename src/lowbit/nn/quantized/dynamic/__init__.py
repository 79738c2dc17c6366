"""Dynamic quantized modules: int8 weights stored ahead of time, activations quantized per token at each call.

``quantize_dynamic`` swaps ``nn.Linear`` (and fused ``LinearReLU``), ``nn.RNN``/``nn.LSTM``/``nn.GRU`` and
the ``nn.RNNCell``/``nn.LSTMCell``/``nn.GRUCell`` cells for these; each has ``from_float(mod, dtype)`` with
``dtype`` ``lowbit.qint8`` (default) or ``torch.float16`` (weight-only float16). Inputs and outputs are float.

>>> import torch
>>> from lowbit.nn.quantized import dynamic as nnqd
>>> nnqd.Linear.from_float(torch.nn.Linear(4, 2))
Linear(in_features=4, out_features=2, bias=True, dtype=lowbit.qint8, activation=per_token)
"""

from .linear import Linear, LinearReLU, per_token_linear, quantize_per_token
from .cells import GRUCell, LSTMCell, RNNCell
from .rnn import GRU, LSTM, RNN

__all__ = ["Linear", "LinearReLU", "RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell", "quantize_per_token",
           "per_token_linear"]
