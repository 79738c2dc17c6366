"""Graph mode: quantize a model without stubs by tracing it with ``torch.fx``.

``prepare_fx`` traces the model, fuses conv/linear-BN-ReLU runs, and inserts observers on module
outputs and on functional ops (``+``, ``torch.cat``, ``matmul``, ...); ``convert_fx`` swaps in
``lowbit.nn.quantized`` modules and ``QFunctional`` integer ops, with ``Quantize``/``DeQuantize``
nodes where int8 regions begin and end. Ops with no integer kernel (softmax, layer norm, GELU)
stay float. ``F.linear``/``F.conv1d/2d/3d`` on the model's own parameters run as quantized
``Linear``/``ConvNd`` (``lowbit.fx.weighted``); ``nn.Embedding``/``nn.EmbeddingBag`` become per-row
weight-only quantized tables; ``ConvTranspose``-BN runs are folded. A submodule torch.fx cannot
trace (data-dependent control flow) stays a float leaf and its children are prepared one by one,
each as its own graph; it is named in a warning and in ``model.lowbit_report`` (an ``FxReport``).
Dynamic qconfigs (``get_dynamic_qconfig()``, alone or mixed with static settings in one mapping)
make Linear/LSTM/GRU modules and ``F.linear`` ``lowbit.nn.quantized.dynamic`` modules (float in
and out, no calibration); other ops under a dynamic qconfig stay float and are reported.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
...         self.fc = nn.Linear(4 * 6 * 6, 3)
...     def forward(self, x):                                 # (N, 4, 6, 6)
...         return self.fc(torch.relu(self.bn(self.conv(x)) + x).flatten(1))
>>> model, x = Block().eval(), torch.randn(8, 4, 6, 6)
>>> prepared = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
>>> _ = prepared(x)                                             # calibrate
>>> qmodel = convert_fx(prepared)                               # conv+bn folded, `+` and relu fused
>>> [type(m).__name__ for m in qmodel.children()]
['Conv2d', 'Linear', 'Quantize', 'QFunctional', 'DeQuantize']
>>> print(qmodel.lowbit_report.converted["add_relu"])
add_relu -> QFunctional.add_relu
>>> err = (qmodel(x) - model(x)).abs().max() / model(x).abs().max()
>>> bool(err < 0.05)
True
"""

from .convert import convert_fx
from .fuse_fx import fuse_fx
from .prepare import prepare_fx, prepare_qat_fx
from .report import FxReport
from .state import restore

__all__ = ["prepare_fx", "prepare_qat_fx", "convert_fx", "fuse_fx", "FxReport", "restore"]
