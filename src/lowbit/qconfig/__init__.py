"""QConfig, QConfigMapping and the default recipes: *how* and *where* to quantize.

A ``QConfig(activation, weight)`` pairs two zero-arg factories (``Observer.with_args(...)`` or
``FakeQuantize.with_args(...)``); ``prepare`` calls each once per insertion site, so no two
layers share observer state. A ``QConfigMapping`` says which ``QConfig`` applies to which module.
For a module named ``name`` of type ``T`` whose parent resolved to ``inherited``::

    qconfig(name, T) = module_name[name]                     if name was set explicitly
                     = first regex r (in registration order) with r.fullmatch(name)
                     = object_type[T]                         (exact type, subclasses not matched)
                     = inherited                              (the parent's; the root inherits the global)

A ``None`` at any tier is an explicit setting: it excludes the module (and, through inheritance,
its children unless they match a setting of their own).

``QConfigMapping(resolution="exact")`` is lucid's legacy lookup instead: ``module_name[name]``, else
``object_type[T]``, else the global setting — no parent inheritance (``set_module_name("encoder",
qc)`` does not reach ``encoder.fc``), no regexes, and ``prepare`` ignores ``.qconfig`` attributes.

>>> import torch.nn as nn, lowbit as Q
>>> m = (Q.QConfigMapping().set_global(Q.get_default_qconfig())
...      .set_object_type(nn.Linear, Q.get_minmax_qconfig())
...      .set_module_name("head", None))
>>> m.get_qconfig(nn.Linear, "encoder.fc") is m.object_type_qconfigs[nn.Linear]
True
>>> m.get_qconfig(nn.Linear, "head") is None
True
>>> type(Q.get_default_qconfig().activation()).__name__
'HistogramObserver'

Departures from ``torch.ao``: regexes must match the whole name (``re.fullmatch``; torch uses
``re.match``, a prefix match); children inherit their parent's resolved setting (torch's eager
``propagate_qconfig_`` does this, its ``QConfigMapping`` lookup does not); and a ``QConfig`` built
from an observer *instance* or a factory that needs arguments raises ``TypeError`` at construction.
"""

from .config import QConfig, qconfig_equals
from .defaults import (
    get_default_qat_qconfig,
    get_default_qat_qconfig_mapping,
    get_default_qconfig,
    get_default_qconfig_mapping,
    get_dynamic_qconfig,
    get_embedding_qat_qconfig,
    get_embedding_qconfig,
    get_fused_qat_qconfig,
    get_lsq_qat_qconfig,
    get_minmax_qconfig,
)
from .mapping import QConfigMapping

__all__ = [
    "QConfig",
    "QConfigMapping",
    "get_default_qconfig",
    "get_default_qat_qconfig",
    "get_default_qconfig_mapping",
    "get_default_qat_qconfig_mapping",
    "get_minmax_qconfig",
    "get_dynamic_qconfig",
    "get_lsq_qat_qconfig",
    "get_fused_qat_qconfig",
    "get_embedding_qconfig",
    "get_embedding_qat_qconfig",
    "qconfig_equals",
]
