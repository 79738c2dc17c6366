"""Calibration recipes: QConfigs that pick the clipping-range observers.

``get_calibration_qconfig(activation, weight)`` names the method for each side::

    activation:  "histogram" (HistogramObserver, L2 search; the default recipe), "minmax",
                 "percentile" (PercentileObserver, 99.99), "entropy" (EntropyObserver, KL),
                 "mse" (MSEObserver, least squared error on the integer grid)
    weight:      "minmax" (PerChannelMinMaxObserver), "mse" (per-channel MSEObserver),
                 "percentile" (per-channel PercentileObserver, 99.99)

activations per-tensor affine ``quint8``, weights per-channel symmetric ``qint8`` (axis 0), as in
``get_default_qconfig()``. ``get_accurate_qconfig()`` is the recipe the accurate PTQ pipeline uses:
MSE-searched activation ranges and MSE-searched per-channel weight ranges.

>>> import lowbit as Q
>>> qc = Q.get_accurate_qconfig()
>>> type(qc.activation()).__name__, type(qc.weight()).__name__, qc.weight().ch_axis
('MSEObserver', 'MSEObserver', 0)
>>> type(Q.get_calibration_qconfig("entropy").activation()).__name__
'EntropyObserver'
"""

from __future__ import annotations

from typing import Any

from .observer import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver
from .observer.entropy import EntropyObserver
from .observer.mse import MSEObserver
from .observer.percentile import PercentileObserver
from .qconfig import QConfig
from .qscheme import per_channel_symmetric, per_tensor_affine, qint8, quint8

__all__ = ["ACTIVATION_METHODS", "WEIGHT_METHODS", "activation_observer", "weight_observer",
           "get_calibration_qconfig", "get_accurate_qconfig"]

_ACT = {"qscheme": per_tensor_affine, "qdtype": quint8}
_W = {"qscheme": per_channel_symmetric, "qdtype": qint8, "ch_axis": 0}

ACTIVATION_METHODS: dict[str, Any] = {
    "histogram": HistogramObserver.with_args(**_ACT),
    "minmax": MinMaxObserver.with_args(**_ACT),
    "percentile": PercentileObserver.with_args(percentile=99.99, **_ACT),
    "entropy": EntropyObserver.with_args(**_ACT),
    "mse": MSEObserver.with_args(**_ACT),
}
WEIGHT_METHODS: dict[str, Any] = {
    "minmax": PerChannelMinMaxObserver.with_args(**_W),
    "mse": MSEObserver.with_args(**_W),
    "percentile": PercentileObserver.with_args(percentile=99.99, **_W),
}


def _pick(table: dict[str, Any], method: str, side: str) -> Any:
    if not isinstance(method, str) or method not in table:
        raise ValueError(f"lowbit.recipes: {side}={method!r} must be one of {sorted(table)}")
    return table[method]


def activation_observer(method: str) -> Any:
    """The zero-arg activation observer factory of ``method`` (see the module docstring)."""
    return _pick(ACTIVATION_METHODS, method, "activation")


def weight_observer(method: str) -> Any:
    """The zero-arg per-channel weight observer factory of ``method``."""
    return _pick(WEIGHT_METHODS, method, "weight")


def get_calibration_qconfig(activation: str = "histogram", weight: str = "minmax") -> QConfig:
    """A static-PTQ ``QConfig`` with the named calibration methods (defaults: today's default recipe)."""
    return QConfig(activation=activation_observer(activation), weight=weight_observer(weight))


def get_accurate_qconfig() -> QConfig:
    """Static PTQ with MSE-searched ranges on both sides (per-tensor activations, per-channel weights)."""
    return get_calibration_qconfig("mse", "mse")
