"""Eager-mode workflows: ``prepare`` → calibrate → ``convert``; ``prepare_qat`` → train → ``convert``;
``quantize_dynamic``.

**Which qconfig a module gets** (``propagate_qconfig_``, torch.ao semantics): the module's own
``.qconfig`` attribute if it has one (``model.qconfig = ...`` then ``prepare(model)``), else the
mapping's explicit setting for it (name > regex > type, see ``QConfigMapping``), else its parent's.
``qconfig=None`` with no ``.qconfig`` attribute anywhere means the default recipe. A
``QConfigMapping(resolution="exact")`` (lucid's legacy mode) ignores ``.qconfig`` attributes and
parents: a module gets its exact name's setting, else its exact type's, else the global one.

**Observers**: ``prepare`` gives every module whose exact type is a key of the static mapping
(Linear, Conv*, ConvTranspose*, fused markers, QAT modules, activations, ``QuantStub``,
``FloatFunctional``) and whose qconfig is not ``None`` an ``activation_post_process =
qconfig.activation()`` called on its output by a forward hook (the hook returns the observer's
output, so a ``FakeQuantize`` there fake-quantizes). Children of such modules (a fused marker's
conv, a QAT module's ``weight_fake_quant``) are not observed. ``DeQuantStub`` and embeddings get
no output observer (their outputs are float).

**Float inputs** (lowbit beyond torch.ao): a weighted module (Linear, Conv*, ConvTranspose*, their
fused/QAT forms) also gets ``input_activation_post_process``, fed by a forward pre-hook only with
inputs that no observed module produced (the output hook tags what it returns; ReLU / MaxPool /
Flatten / Dropout / Identity modules pass the tag on). ``convert`` records that grid as the
quantized module's ``input_grid``, so a layer after a float op (or in a model without
``QuantStub``) quantizes its float input on a calibrated grid instead of per call.

**convert** swaps each observed module for ``mapping[type(mod)].from_float(mod)`` (a conv-BN QAT
module is folded first), removes the remaining observers and hooks, and puts the model in eval
mode. An observer that saw no data raises ``RuntimeError`` naming the module path when no observer
saw data (convert before calibration); when others did, its module never ran (a ``FloatFunctional``
declared in every block, used in residual ones only): it stays float, with a warning and a
``left_float`` entry. Modules with
a qconfig that stay float are listed in a ``ConvertReport`` (``return_report=True`` returns
``(model, report)``; it is also logged on the ``"lowbit"`` logger at INFO).

**Dynamic qconfigs** (activation ``PlaceholderObserver(is_dynamic=True)``, ``get_dynamic_qconfig()``;
they mix with static ones in one mapping, e.g. static convs + ``set_object_type(nn.Linear, dynamic)``):
``prepare`` gives such a module no observer (``prepare_qat`` leaves it float, trained in float),
and ``convert`` swaps a module whose exact type is a key of the dynamic mapping (Linear, LSTM, GRU)
for ``dynamic_mapping[type].from_float(mod, dtype=qconfig.weight().qdtype)`` — the module
``quantize_dynamic`` builds with that qconfig; no calibration is needed. Any other module under a
dynamic qconfig (Conv*, fused markers, activations) has no dynamic kernel: it stays float and is
listed in ``ConvertReport.left_float`` (not an error, so a global dynamic recipe on a CNN works).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> model = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.ReLU(), Q.DeQuantStub())
>>> model.qconfig = Q.get_minmax_qconfig()
>>> prepared = prepare(model)
>>> _ = prepared(torch.randn(16, 4))                       # calibrate
>>> qmodel, report = convert(prepared, return_report=True)
>>> [type(m).__name__ for m in qmodel]
['Quantize', 'Linear', 'ReLU', 'DeQuantize']
>>> type(qmodel[1]).__module__.startswith("lowbit.nn.quantized"), len(report.left_float)
(True, 0)
"""

from ..nn.intrinsic.qat.modules import freeze_bn_stats, update_bn_stats
from ..quantize_dynamic import quantize_dynamic
from .hooks import _is_table_recipe  # noqa: F401  (lowbit.fx.classify imports it from here)
from .observe import prepare, prepare_qat
from .propagate import is_dynamic_qconfig, propagate_qconfig_
from .swap import convert

__all__ = [
    "prepare", "convert", "prepare_qat", "quantize_dynamic", "propagate_qconfig_",
    "freeze_bn_stats", "update_bn_stats", "is_dynamic_qconfig",
]
