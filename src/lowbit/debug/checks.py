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

from typing import Any

import torch
from torch import nn

from ..batches import check_finite_batch
from ..workflow.kinds import model_kind

__all__ = ["model_kind", "check_float_model"]


def check_float_model(model: nn.Module, fn: str, arg: str = "model") -> None:
    """``TypeError`` unless ``model`` is a float model (see the module docstring)."""
    found = model_kind(model)
    if found is not None:
        kind, where = found
        raise TypeError(f"{fn}: {arg} is already {kind} ({where} is not a float module); pass the float model "
                        f"it was {'prepared' if kind != 'quantized' else 'quantized'} from")


def check_calib(batches: list[Any], where: str) -> None:
    """Every calibration batch holds finite data and at least one sample, or a ``ValueError`` naming the batch: the
    observers skip NaN and see nothing in an empty tensor, so such a batch was either silently left out or ended in
    convert's "observer saw no data; run calibration batches" after the batches had run."""
    for i, b in enumerate(batches):
        check_finite_batch(b, where, f"calib batch {i}", "calibration ranges need finite data", masks=True)
        parts = b.values() if isinstance(b, dict) else b if isinstance(b, (tuple, list)) else (b,)
        empty = [tuple(t.shape) for t in parts if isinstance(t, torch.Tensor) and t.numel() == 0]
        if empty:
            raise ValueError(f"{where}: calib batch {i} holds an empty tensor (shape {empty[0]}); every calibration "
                             "batch needs at least one sample")


def example_inputs_of(batch: Any, where: str) -> tuple[Any, ...]:
    """A calibration batch as ``prepare_fx``'s ``example_inputs`` (a dict batch needs them explicitly)."""
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    raise ValueError(f"{where}: graph mode needs example_inputs (a tuple of positional arguments) for batches "
                     f"of type {type(batch).__name__}")
