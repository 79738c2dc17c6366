"""Observers that collect nothing: a fixed grid, or a dtype carrier for dynamic quantization.

``FixedQParamsObserver`` returns the constants it was built with, for ops whose output range is
known a priori (sigmoid/softmax ``[0, 1]`` → ``scale = 1/256, zero_point = 0`` on quint8; tanh
``[-1, 1]`` → ``scale = 2/256, zero_point = 128``)::

    calculate_qparams() = (scale, zero_point)        # independent of any observed data

``PlaceholderObserver`` / ``NoopObserver`` only carry ``qdtype`` (and ``is_dynamic``): their
``calculate_qparams()`` raises, because the qparams are computed at run time or elsewhere.

>>> import torch, lowbit as Q
>>> obs = Q.FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
>>> scale, zero_point = obs.calculate_qparams()          # valid with no calibration
>>> round(scale.item(), 6), int(zero_point.item())
(0.003906, 0)
>>> before = obs.scale.item()
>>> _ = obs(torch.randn(4, 4))
>>> obs.scale.item() == before
True
"""

from __future__ import annotations

import torch

from ..functional import _F32_MAX, _F32_TINY
from ..qparams import symmetric_zero_point
from ..qscheme import QDtype, QScheme, per_tensor_affine, quint8
from .base import ObserverBase

__all__ = ["FixedQParamsObserver", "PlaceholderObserver", "NoopObserver"]


def _identity(owner: ObserverBase, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{type(owner).__name__} takes tensors, got {type(x).__name__}")
    return x


class FixedQParamsObserver(ObserverBase):
    """A per-tensor observer whose ``(scale, zero_point)`` are fixed at construction.

    Buffers ``scale`` (float32, 0-d) and ``zero_point`` (int64, 0-d) travel in ``state_dict``.
    ``qscheme`` and ``eps`` are metadata only: the scale is never derived, so never floored.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    _saves_eps = False  # torch.ao's FixedQParamsObserver saves scale and zero_point only

    def __init__(self, scale: float, zero_point: int, qscheme: QScheme | str = per_tensor_affine,
                 qdtype: QDtype | str = quint8, eps: float = 1e-8) -> None:
        super().__init__(qscheme, qdtype, None, eps)
        name = type(self).__name__
        if self.qscheme.is_per_channel:
            raise ValueError(f"{name}: qscheme={self.qscheme.value} is per channel; fixed qparams are per tensor")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not _F32_TINY <= scale <= _F32_MAX:
            raise ValueError(f"{name}: scale={scale!r} must be a finite positive float (in float32, as it is stored)")
        if isinstance(zero_point, bool) or not isinstance(zero_point, int):
            raise TypeError(f"{name}: zero_point={zero_point!r} must be an int")
        if not self.qdtype.quant_min <= zero_point <= self.qdtype.quant_max:
            raise ValueError(
                f"{name}: zero_point={zero_point} is outside the {self.qdtype!r} grid "
                f"[{self.qdtype.quant_min}, {self.qdtype.quant_max}]"
            )
        if self.qscheme.is_symmetric and zero_point != symmetric_zero_point(self.qdtype, name):
            raise ValueError(f"{name}: zero_point={zero_point} conflicts with qscheme={self.qscheme.value}, whose zero "
                             f"point is pinned at {symmetric_zero_point(self.qdtype, name)} on {self.qdtype!r}; use "
                             "that zero point or an affine qscheme")
        self.register_buffer("scale", torch.tensor(float(scale), dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor(zero_point, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Identity; nothing is recorded."""
        return _identity(self, x)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed ``(scale, zero_point)`` (copies of the buffers); never raises."""
        return self.scale.clone(), self.zero_point.clone()

    def reset_min_max_vals(self) -> None:
        """Nothing to reset: the qparams are constants."""

    def extra_repr(self) -> str:
        if self.scale.is_meta:  # moved to meta: still prints
            return f"{super().extra_repr()}, scale=<meta>, zero_point=<meta>"
        return f"{super().extra_repr()}, scale={self.scale.item()}, zero_point={self.zero_point.item()}"


class PlaceholderObserver(ObserverBase):
    """Carries ``qdtype`` (and ``is_dynamic``) for a site whose qparams come from elsewhere.

    Used by dynamic quantization (activations quantized with qparams computed per batch at run
    time) and wherever a config needs a dtype but no statistics. ``calculate_qparams()`` raises.
    ``per_token`` (dynamic activations): one grid per token (lowbit's default) or, ``False``, one grid
    per input tensor (torch.ao's dynamic ops; the dynamic ``Linear`` takes it on ``quint8[0, 127]``).
    ``qdtype=torch.float16`` marks float16 weight storage (``get_dynamic_qconfig(torch.float16)``,
    torch's ``PlaceholderObserver(dtype=torch.float16)``); such an observer has no integer grid.

    >>> import lowbit as Q
    >>> obs = Q.PlaceholderObserver(qdtype=Q.quint8, is_dynamic=True)
    >>> obs.qdtype, obs.is_dynamic, obs.is_calibrated
    (lowbit.quint8, True, False)
    >>> Q.PlaceholderObserver(qdtype=torch.float16).qdtype
    torch.float16
    """

    _saves_eps = False  # no state at all, as torch.ao's

    def __init__(self, qscheme: QScheme | str = per_tensor_affine, qdtype: QDtype | str | torch.dtype = quint8,
                 eps: float = 1e-8, is_dynamic: bool = False, per_token: bool = True) -> None:
        float16 = qdtype in (torch.float16, "float16")
        super().__init__(qscheme, quint8 if float16 else qdtype, None, eps)  # type: ignore[arg-type]
        if float16:  # float16 weight storage (dynamic quantization): no integer grid at all
            self.qdtype = torch.float16  # type: ignore[assignment]
        if not isinstance(is_dynamic, bool):
            raise TypeError(f"{type(self).__name__}: is_dynamic={is_dynamic!r} must be a bool")
        self.is_dynamic = is_dynamic
        if not isinstance(per_token, bool):
            raise TypeError(f"{type(self).__name__}: per_token={per_token!r} must be a bool")
        self.per_token = per_token

    @property
    def is_calibrated(self) -> bool:
        """Always False: there is nothing for ``calculate_qparams`` to work from."""
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Identity; nothing is recorded."""
        return _identity(self, x)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(
            f"{type(self).__name__} collects no statistics; qparams are computed at runtime "
            "(dynamic quantization) or supplied elsewhere."
        )

    def reset_min_max_vals(self) -> None:
        """Nothing to reset."""

    def extra_repr(self) -> str:
        return f"qdtype={self.qdtype!r}, is_dynamic={self.is_dynamic}" + ("" if self.per_token else ", per_token=False")


class NoopObserver(PlaceholderObserver):
    """A ``PlaceholderObserver`` by another name (the seeds' spelling for "do not observe")."""
