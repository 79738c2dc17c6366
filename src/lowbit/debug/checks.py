"""What a debug tool's model argument is: float, prepared (it holds observers / fake-quants that learn) or quantized.

``model_kind(model)`` is ``None`` for a float model, else ``(kind, where)``: ``kind`` one of ``"prepared"``
(a calibrating observer or a ``FakeQuantize``: running the model changes its grids), ``"QAT-prepared"`` (a
``lowbit.nn.qat`` module) or ``"quantized"`` (a ``lowbit.nn.quantized`` module other than ``FloatFunctional``,
which float models use), ``where`` the first such module. A reference model's ``FrozenObserver`` does not learn
and does not count. ``check_float_model(model, fn, arg)`` raises ``TypeError`` naming both for a model that is not
float: the tools quantize or compare against a float model, and ran such a model's observers on their data (a
prepared model's calibration was changed in place) or failed deep inside (``MinMaxObserver observes tensors, got
QTensor``).
"""

from __future__ import annotations

from torch import nn

from ..workflow.kinds import model_kind

__all__ = ["model_kind", "check_float_model"]


def check_float_model(model: nn.Module, fn: str, arg: str = "model") -> None:
    """``TypeError`` unless ``model`` is a float model (see the module docstring)."""
    found = model_kind(model)
    if found is not None:
        kind, where = found
        raise TypeError(f"{fn}: {arg} is already {kind} ({where} is not a float module); pass the float model "
                        f"it was {'prepared' if kind != 'quantized' else 'quantized'} from")
