"""Debugging observers: ``RecordingObserver`` keeps every tensor it sees; ``get_observer_dict`` finds observers.

``RecordingObserver`` is an identity module that appends a copy of each input to ``tensor_val``
(``get_tensor_value()`` returns that list); it computes no qparams (``calculate_qparams`` raises),
so it is for looking at the values a layer produces during calibration, not for ``convert``.

``get_observer_dict(model, target_dict)`` fills ``target_dict`` with ``"<path>.activation_post_process"
-> observer`` for every module that carries one (torch.ao's ``_get_observer_dict``; the root's key
is ``"activation_post_process"``).

>>> import torch, lowbit as Q
>>> rec = Q.RecordingObserver()
>>> _ = rec(torch.tensor([1.0, 2.0])); _ = rec(torch.tensor([3.0]))
>>> [t.tolist() for t in rec.get_tensor_value()]
[[1.0, 2.0], [3.0]]
>>> from torch import nn
>>> m = nn.Sequential(nn.Linear(2, 2)); m[0].activation_post_process = rec
>>> d = {}; get_observer_dict(m, d); list(d)
['0.activation_post_process']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..qscheme import QDtype, quint8
from .base import ObserverBase

__all__ = ["RecordingObserver", "get_observer_dict"]


class RecordingObserver(ObserverBase):
    """Identity that records a detached copy of every input in ``tensor_val`` (a list, not state)."""

    _saves_eps = False  # it derives no scale

    def __init__(self, qdtype: QDtype | str = quint8) -> None:
        super().__init__(qdtype=qdtype)
        self.tensor_val: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"RecordingObserver takes tensors, got {type(x).__name__}")
        self.tensor_val.append(x.detach().clone())
        return x

    def get_tensor_value(self) -> list[torch.Tensor]:
        """Every recorded tensor, in call order."""
        return self.tensor_val

    @property
    def is_calibrated(self) -> bool:
        return bool(self.tensor_val)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("RecordingObserver only records tensors (get_tensor_value()); it computes no qparams — "
                           "use a MinMaxObserver/HistogramObserver for a quantization grid")


def get_observer_dict(mod: nn.Module, target_dict: dict[str, Any], prefix: str = "") -> None:
    """Put ``mod``'s ``activation_post_process`` observers into ``target_dict`` (in place), keyed by path."""
    if not isinstance(mod, nn.Module):
        raise TypeError(f"get_observer_dict: mod must be an nn.Module, got {type(mod).__name__}")
    if not isinstance(target_dict, dict):
        raise TypeError(f"get_observer_dict: target_dict must be a dict, got {type(target_dict).__name__}")
    head = f"{prefix}." if prefix else ""
    if hasattr(mod, "activation_post_process"):
        target_dict[head + "activation_post_process"] = mod.activation_post_process
    for name, child in mod.named_children():
        get_observer_dict(child, target_dict, head + name)
