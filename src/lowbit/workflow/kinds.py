"""What kind of model a workflow step was given: float, prepared (it holds observers / fake-quants that learn), QAT-
prepared or quantized (``model_kind``). The debug tools (``debug.checks``) and ``prepare_fx`` refuse a model that is
not float: a prepared model's observers would be recalibrated by the tool's data, and graph mode would trace an
eager-prepared or converted model's observers and int8 modules as opaque leaves.

>>> import torch, lowbit as Q
>>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> model_kind(m) is None, model_kind(Q.prepare(m, Q.get_default_qconfig()))[0]
(True, 'prepared')
"""

from __future__ import annotations

from torch import nn

from ..fake_quant import FakeQuantize
from ..nn.quantized import FloatFunctional
from ..observer import ObserverBase

__all__ = ["model_kind"]


def model_kind(model: nn.Module) -> tuple[str, str] | None:
    """``None`` (float) or ``(kind, "module 'name' (Type)")`` of the first module that is not float."""
    from ..reference.modules import FrozenObserver  # (the reference package imports graph mode, which imports this)

    for name, mod in model.named_modules():
        where = f"module {name!r} ({type(mod).__name__})" if name else f"the model itself ({type(mod).__name__})"
        if isinstance(mod, (ObserverBase, FakeQuantize)) and not isinstance(mod, FrozenObserver):
            return "prepared", where
        kind = type(mod).__module__
        if kind.startswith(("lowbit.nn.qat", "lowbit.nn.intrinsic.qat")):
            return "QAT-prepared", where
        if kind.startswith("lowbit.nn.quantized") and not isinstance(mod, FloatFunctional):
            return "quantized", where
    return None
