"""FixedQParamsFakeQuantize: fake quantization on a grid fixed at construction (no statistics).

For ops with a known output range (sigmoid / hardsigmoid / softmax ``[0, 1]``: ``scale = 1/256,
zero_point = 0`` on quint8; tanh ``[-1, 1]``: ``scale = 2/256, zero_point = 128``), QAT uses the same
grid the quantized op will use after ``convert``::

    y = (clamp(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale     # fixed scale, zero_point
    dy/dx = 1[qmin <= round(x / scale) + zero_point <= qmax]                         # straight-through

The observer must build a ``FixedQParamsObserver`` (per tensor); ``calculate_qparams()`` returns its
constants, the observer switch changes nothing.

>>> import torch, lowbit as Q
>>> fq = Q.FixedQParamsFakeQuantize(Q.FixedQParamsObserver.with_args(scale=1.0 / 256, zero_point=0))
>>> fq(torch.tensor([0.001, 0.5, 2.0])).tolist()
[0.0, 0.5, 0.99609375]
>>> [v.item() for v in fq.calculate_qparams()]
[0.00390625, 0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..observer.base import ObserverBase
from ..observer.fixed import FixedQParamsObserver
from .base import FakeQuantize

__all__ = ["FixedQParamsFakeQuantize"]


class FixedQParamsFakeQuantize(FakeQuantize):
    """``FakeQuantize`` around a ``FixedQParamsObserver``: ``scale``/``zero_point`` are its constants."""

    def __init__(self, observer: Callable[..., ObserverBase] = FixedQParamsObserver, **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        obs = self.activation_post_process
        if type(obs) is not FixedQParamsObserver:
            raise TypeError(f"FixedQParamsFakeQuantize: observer={observer!r} built a {type(obs).__name__}; "
                            "it needs a FixedQParamsObserver (e.g. FixedQParamsObserver.with_args(scale=..., "
                            "zero_point=...))")
        self._set_qparams(obs.scale, obs.zero_point)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed ``(scale, zero_point)``; valid with no data."""
        return self.activation_post_process.calculate_qparams()
