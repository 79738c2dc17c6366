"""The min/max observer family: running ranges, per tensor or per channel, cumulative or averaged.

Each batch ``x`` gives a batch range, over all elements (per tensor) or over every axis except
``ch_axis`` (per channel, shapes ``(C,)``), NaN and ±Inf ignored::

    m, M = min(x), max(x)                                   # () or (C,)
    cumulative:      min_val = min(min_val, m)             max_val = max(max_val, M)
    moving average:  min_val = min_val + c * (m - min_val)  max_val = max_val + c * (M - max_val)
                     (the first batch seeds min_val = m, max_val = M;  c = averaging_constant)

``calculate_qparams()`` maps ``(min_val, max_val)`` through ``lowbit.calculate_qparams``.
``min_val``/``max_val`` are buffers that start as scalar ``+inf``/``-inf`` ("nothing seen") and
become ``(C,)`` on a per-channel observer's first batch; a calibrated ``state_dict`` loads into a
fresh observer. Under ``torch.distributed`` the statistics are reduced across ranks when qparams
are computed (MIN/MAX exactly, moving averages as the mean of ranks; see ``distributed.py``).

Defined behaviour at the edges: an empty batch is a no-op; a batch with no finite value leaves
the statistics unchanged (warned once); a constant batch gives a valid scale (the range is widened
to include 0 and the scale floored at ``eps``); an integer tensor is a ``TypeError``.

>>> import torch, lowbit as Q
>>> obs = Q.MinMaxObserver()
>>> _ = obs(torch.tensor([-2.0, 1.0])); _ = obs(torch.tensor([3.0]))
>>> obs.min_val.item(), obs.max_val.item()
(-2.0, 3.0)
>>> ema = Q.MovingAverageMinMaxObserver(averaging_constant=0.5)
>>> _ = ema(torch.tensor([-2.0, 2.0])); _ = ema(torch.tensor([-4.0, 4.0]))
>>> ema.min_val.item(), ema.max_val.item()
(-3.0, 3.0)
"""

from __future__ import annotations

import numbers

import torch

from ..qparams import calculate_qparams
from ..qscheme import QDtype, QScheme, per_channel_symmetric, per_tensor_affine, qint8, quint8
from .base import ObserverBase, check_observed, finite_aminmax, refuse_meta
from .distributed import agree_observer, all_reduce_mean, all_reduce_min_max, is_distributed, pending_sync, remember_group

__all__ = [
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
]


class _MinMaxObserverBase(ObserverBase):
    """Shared machinery: buffers, batch range, folding, qparams, cross-rank reduction."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    _averaging = False  # class attribute: cumulative (False) or moving average (True)
    _sync_settings: tuple[str, ...] = ("averaging_constant",)  # compared across ranks (agree_observer)

    def __init__(
        self,
        qscheme: QScheme | str,
        qdtype: QDtype | str,
        ch_axis: int | None,
        eps: float,
        averaging_constant: float = 1.0,
    ) -> None:
        super().__init__(qscheme, qdtype, ch_axis, eps)
        name = type(self).__name__
        per_channel = ch_axis is not None
        if self.qscheme.is_per_channel != per_channel:
            other = "PerChannelMinMaxObserver" if self.qscheme.is_per_channel else "MinMaxObserver"
            raise ValueError(f"{name}: qscheme={self.qscheme.value} does not fit this observer; use {other}")
        c = averaging_constant
        if isinstance(c, torch.Tensor) and c.numel() == 1 and c.is_floating_point():  # as torch.ao, which takes one
            c = float(c)
        if not isinstance(c, numbers.Real) or isinstance(c, bool):  # (NumPy scalars too; True read as 1.0)
            raise TypeError(f"{name}: averaging_constant={averaging_constant!r} must be a number in (0, 1]")
        if not 0 < c <= 1:
            raise ValueError(f"{name}: averaging_constant={averaging_constant!r} must be in (0, 1]")
        self.averaging_constant = float(c)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self._needs_sync = True  # saw data since the last cross-rank reduction

    # -- observing ---------------------------------------------------------------------------
    def _batch_range(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(min, max)`` of the batch, ``()`` or ``(C,)``; ``None`` for an empty batch."""
        name = type(self).__name__
        if self.ch_axis is None:
            return None if x.numel() == 0 else finite_aminmax(x, name)
        if not -x.dim() <= self.ch_axis < x.dim():
            raise ValueError(f"{name}: ch_axis={self.ch_axis} is out of range for a tensor of shape {tuple(x.shape)}")
        if x.numel() == 0:
            return None
        channels = x.shape[self.ch_axis]
        if self.min_val.dim() == 1 and self.min_val.numel() != channels:
            raise ValueError(
                f"{name}: a tensor of shape {tuple(x.shape)} has {channels} channels along ch_axis={self.ch_axis}, "
                f"but this observer has recorded {self.min_val.numel()}"
            )
        return finite_aminmax(x.movedim(self.ch_axis, 0).reshape(channels, -1), name, dim=1)  # (C,), (C,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fold ``x``'s range into the statistics and return ``x`` unchanged."""
        check_observed(x, type(self).__name__, self)
        batch = self._batch_range(x)
        if batch is None:
            return x
        lo, hi = batch
        old_lo, old_hi = self.min_val.to(lo.device), self.max_val.to(hi.device)
        if self._averaging:
            c = self.averaging_constant
            seed_lo, seed_hi = torch.isinf(old_lo), torch.isinf(old_hi)                 # nothing seen yet
            new_lo = torch.where(seed_lo, lo, old_lo + c * (lo - old_lo))
            new_hi = torch.where(seed_hi, hi, old_hi + c * (hi - old_hi))
            new_lo = torch.where(torch.isfinite(lo), new_lo, old_lo)                   # batch had no data
            new_hi = torch.where(torch.isfinite(hi), new_hi, old_hi)
        else:
            new_lo, new_hi = torch.minimum(old_lo, lo), torch.maximum(old_hi, hi)
        self._store(new_lo, new_hi)
        self._needs_sync = True
        return x

    def _store(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Write the statistics in place (keeps buffer identity, e.g. for DDP's buffer broadcast), resizing
        on the scalar -> ``(C,)`` change; only a device change re-registers the buffer."""
        for name, value in (("min_val", lo), ("max_val", hi)):
            buf = getattr(self, name)
            if buf.device != value.device:
                self.register_buffer(name, value.to(torch.float32).clone())
                continue
            if buf.shape != value.shape:
                buf.resize_(value.shape)
            buf.copy_(value)

    # -- state ---------------------------------------------------------------------------------
    @property
    def is_calibrated(self) -> bool:
        """True once every statistic (every channel) holds a finite range."""
        if self.min_val.is_meta:
            refuse_meta(self)
        return bool(torch.isfinite(self.min_val).all() & torch.isfinite(self.max_val).all())

    def reset_min_max_vals(self) -> None:
        """Forget everything observed (back to the scalar ``±inf`` seed)."""
        device = self.min_val.device
        self.register_buffer("min_val", torch.tensor(float("inf"), device=device))
        self.register_buffer("max_val", torch.tensor(float("-inf"), device=device))
        self._needs_sync = True

    def sync_statistics(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        """Reduce the statistics across ranks (a collective; no-op on a single process).

        Cumulative observers take MIN/MAX (exact: equals one process on the union); averaging
        observers take the mean of the ranks that saw data (an approximation of one EMA over the
        union, which depends on batch order).
        """
        remember_group(self, group)  # the group later lazy reductions use
        if is_distributed(group):
            agree_observer(self, group)
            owner = type(self).__name__
            if self._averaging:
                lo, hi = all_reduce_mean(self.min_val, group, owner), all_reduce_mean(self.max_val, group, owner)
            else:
                lo, hi = all_reduce_min_max(self.min_val, self.max_val, group, owner)
            self._store(lo, hi)
        self._needs_sync = False

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._needs_sync = False  # loaded statistics count as already reduced

    # -- qparams -------------------------------------------------------------------------------
    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` from the observed range: float32 / int64, ``()`` or ``(C,)``.

        Under ``torch.distributed`` first reduces the statistics across ranks (a collective: call
        it on every rank, or ``sync_observers(model)`` on every rank beforehand).
        """
        pending_sync(self)  # over the group it was last reduced over (WORLD if none)
        if not self.is_calibrated:
            name = type(self).__name__
            if self.min_val.dim() == 1 and bool(torch.isfinite(self.min_val).any()):
                missing = (~torch.isfinite(self.min_val)).nonzero().flatten().tolist()
                raise RuntimeError(f"{name}: channels {missing} never held a finite value; cannot compute qparams")
            raise RuntimeError(
                f"{name} has not observed any finite data; run calibration batches before calculate_qparams()"
            )
        return calculate_qparams(self.min_val, self.max_val, self.qscheme, self.qdtype, self.eps)

    def extra_repr(self) -> str:
        avg = f", averaging_constant={self.averaging_constant}" if self._averaging else ""
        if self.min_val.is_meta:  # moved to meta: still prints
            return f"{super().extra_repr()}{avg}, min_val=<meta>, max_val=<meta>"
        return f"{super().extra_repr()}{avg}, min_val={self.min_val.tolist()}, max_val={self.max_val.tolist()}"


class MinMaxObserver(_MinMaxObserverBase):
    """Running min / max over all elements: the per-tensor activation observer of static PTQ.

    >>> import torch, lowbit as Q
    >>> obs = Q.MinMaxObserver()
    >>> _ = obs(torch.tensor([-1.0, 3.0]))
    >>> s, z = obs.calculate_qparams()                      # scale = 4/255, zero_point = round(1/s)
    >>> round(s.item(), 6), int(z), s.shape
    (0.015686, 64, torch.Size([]))
    """

    def __init__(self, qscheme: QScheme | str = per_tensor_affine, qdtype: QDtype | str = quint8,
                 eps: float = 1e-8) -> None:
        super().__init__(qscheme, qdtype, None, eps)


class MovingAverageMinMaxObserver(_MinMaxObserverBase):
    """Exponential moving average of the per-batch min / max (the default QAT activation observer).

    The first batch seeds the range; the range can shrink afterwards (``c = averaging_constant``).

    >>> import torch, lowbit as Q
    >>> obs = Q.MovingAverageMinMaxObserver(averaging_constant=0.1)
    >>> _ = obs(torch.tensor([0.0, 10.0])); _ = obs(torch.tensor([0.0, 0.0]))
    >>> obs.max_val.item()                                   # 10 + 0.1 * (0 - 10)
    9.0
    """

    _averaging = True

    def __init__(self, qscheme: QScheme | str = per_tensor_affine, qdtype: QDtype | str = quint8,
                 averaging_constant: float = 0.01, eps: float = 1e-8) -> None:
        super().__init__(qscheme, qdtype, None, eps, averaging_constant)


class PerChannelMinMaxObserver(_MinMaxObserverBase):
    """Running min / max of every slice along ``ch_axis``: the standard weight observer.

    Every axis except ``ch_axis`` is reduced, so qparams have shape ``(C,) = (x.shape[ch_axis],)``.

    >>> import torch, lowbit as Q
    >>> obs = Q.PerChannelMinMaxObserver(ch_axis=0)
    >>> _ = obs(torch.tensor([[0.5, -1.0], [2.0, 4.0]]))      # (C=2, 2)
    >>> s, z = obs.calculate_qparams()                       # symmetric qint8: amax / 127.5
    >>> [round(v, 6) for v in s.tolist()], z.tolist()
    ([0.007843, 0.031373], [0, 0])
    """

    def __init__(self, ch_axis: int = 0, qscheme: QScheme | str = per_channel_symmetric,
                 qdtype: QDtype | str = qint8, eps: float = 1e-8) -> None:
        _check_axis_arg(type(self).__name__, ch_axis)
        super().__init__(qscheme, qdtype, ch_axis, eps)


class MovingAveragePerChannelMinMaxObserver(_MinMaxObserverBase):
    """Per-channel exponential moving average of the batch min / max (smoothed weight ranges).

    >>> import torch, lowbit as Q
    >>> obs = Q.MovingAveragePerChannelMinMaxObserver(ch_axis=1, averaging_constant=0.5)
    >>> _ = obs(torch.tensor([[1.0, -2.0]])); _ = obs(torch.tensor([[3.0, -4.0]]))
    >>> obs.min_val.tolist(), obs.max_val.tolist()            # per column: EMA of the batch ranges
    ([2.0, -3.0], [2.0, -3.0])
    """

    _averaging = True

    def __init__(self, ch_axis: int = 0, qscheme: QScheme | str = per_channel_symmetric,
                 qdtype: QDtype | str = qint8, averaging_constant: float = 0.01, eps: float = 1e-8) -> None:
        _check_axis_arg(type(self).__name__, ch_axis)
        super().__init__(qscheme, qdtype, ch_axis, eps, averaging_constant)


def _check_axis_arg(owner: str, ch_axis: object) -> None:
    if not isinstance(ch_axis, int) or isinstance(ch_axis, bool):
        raise TypeError(f"{owner}: ch_axis={ch_axis!r} must be an int")

