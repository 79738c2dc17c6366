"""Graph mode: quantize a model without stubs by tracing it with ``torch.fx``.

``prepare_fx`` traces the model, fuses conv/linear-BN-ReLU runs, and inserts observers on module
outputs and on functional ops (``+``, ``torch.cat``, ``matmul``, ...); ``convert_fx`` swaps in
``lowbit.nn.quantized`` modules and ``QFunctional`` integer ops, with ``Quantize``/``DeQuantize``
nodes where int8 regions begin and end. Ops with no integer kernel (softmax, layer norm, GELU)
stay float. Submodules torch.fx cannot trace are quantized eager-fashion and listed in
``gm.lowbit_report``.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
...     def forward(self, x):
...         return torch.relu(self.bn(self.conv(x)) + x)
>>> x = torch.randn(8, 4, 6, 6)
>>> prepared = prepare_fx(Block().eval(), Q.get_minmax_qconfig(), example_inputs=(x,))
>>> _ = prepared(x)                                             # calibrate
>>> qmodel = convert_fx(prepared)
>>> [type(m).__name__ for m in qmodel.children()]
['Conv2d', 'Quantize', 'QFunctional', 'DeQuantize']
>>> bool((qmodel(x) - Block().eval()(x)).abs().max() < 10)
True
"""

from .convert import convert_fx
from .prepare import prepare_fx, prepare_qat_fx
from .report import FxReport

__all__ = ["prepare_fx", "prepare_qat_fx", "convert_fx", "FxReport"]
