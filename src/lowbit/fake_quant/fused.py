"""FusedMovingAvgObsFakeQuantize: moving-average min/max observation and fake quantization in one step.

``torch.ao``'s fused QAT fake-quant, numerically identical to it. Each forward, with
``c = averaging_constant`` and ``[qmin, qmax]`` the grid::

    observer on:    m, M = min(x), max(x)          # per tensor, or per slice along ch_axis: (C,)
                    min_val += c * (m - min_val);  max_val += c * (M - max_val)    (first batch seeds)
    fake quant on:  (scale, zero_point) = choose_qparams(min_val, max_val)        # below
                    y = (clamp(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale
    dy/dx = 1[qmin <= round(x / scale) + zero_point <= qmax]                      # straight-through

``choose_qparams`` is fbgemm's ``ChooseQuantizationParams`` (what ``torch.fused_moving_avg_obs_fake_quant``
uses), *not* ``lowbit.calculate_qparams``: the range is widened to include 0 and::

    affine:     scale = (max - min) / (qmax - qmin)                     (float64, rounded to float32)
                zero_point = round(qmin - min / scale) or round(qmax - max / scale), whichever is
                             computed from the smaller terms, clamped to the grid
    symmetric:  if min < 0 < max:  scale = max(|min| / (h + 1), max / h),  h = (qmax - qmin) // 2
                                   zero_point = round_half_even((qmin + qmax) / 2)  (0 for qint8, 128 for quint8)
                else as affine (all-positive data keeps zero_point = qmin)
    scale < 6.1e-5 is raised to 6.1e-5 (the range widened to match); a zero scale becomes 0.1

On CPU float32 the forward is one ``torch.fused_moving_avg_obs_fake_quant`` call (per tensor, or per
channel along axis 0 — the only axis torch's kernel supports); elsewhere (other devices or dtypes,
``ch_axis != 0``) lowbit's composite computes the same numbers. NaN/±Inf in ``x`` are handled as
the min/max observers do (ignored by the statistics, warned once; NaN stays NaN in ``y``): torch's kernel
would fold them into the running range, so such a batch is redone on the composite path.

``calculate_qparams()`` returns the grid above for the current statistics — the grid the forward
fake-quantizes with, so ``convert`` reproduces the QAT model. (Departure: ``torch.ao`` returns its
observer's ``calculate_qparams()``, a different formula: ``amax / 127.5`` instead of
``max(|min| / 128, max / 127)`` for symmetric qint8, zero point 127 instead of 128 for symmetric quint8.)

>>> import torch, lowbit as Q
>>> fq = Q.FusedMovingAvgObsFakeQuantize(averaging_constant=0.5)
>>> _ = fq(torch.tensor([-1.0, 3.0])); _ = fq(torch.tensor([-3.0, 5.0]))
>>> fq.activation_post_process.min_val.item(), fq.activation_post_process.max_val.item()
(-2.0, 4.0)
>>> round(fq.scale.item(), 6), fq.zero_point.item()       # scale = 6 / 255
(0.023529, 85)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..compile_state import tracing
from ..functional import check_ch_axis, fake_quantize
from ..observer.base import ObserverBase
from ..observer.minmax import MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver
from ..qparams import _keep_grid_finite
from .base import FakeQuantize

__all__ = ["FusedMovingAvgObsFakeQuantize", "choose_qparams_fbgemm", "fused_moving_avg_obs_fake_quant"]

_SMALL_SCALE = 6.1e-5  # fbgemm's SMALL_SCALE_THRESHOLD (float32 constant)


_HUGE = 1e38  # observed ranges beyond this skip torch's fused kernel (its grid ends would overflow to ±inf)


def choose_qparams_fbgemm(min_val: torch.Tensor, max_val: torch.Tensor, quant_min: int, quant_max: int,
                          symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's ``ChooseQuantizationParams``, elementwise on ``()`` or ``(C,)`` float32 ranges.

    Returns ``(scale float32, zero_point int64)``; mirrors the C++ float32/float64 steps one by one.

    >>> import torch
    >>> from lowbit.fake_quant import choose_qparams_fbgemm
    >>> s, z = choose_qparams_fbgemm(torch.tensor(-1.0), torch.tensor(2.54), -128, 127, True)
    >>> round(s.item(), 6), z.item()                          # max(1 / 128, 2.54 / 127)
    (0.02, 0)
    """
    f32, f64 = torch.float32, torch.float64
    lo, hi = min_val.detach().to(f32), max_val.detach().to(f32)
    span = quant_max - quant_min
    straddles = (lo < 0) & (hi > 0)
    if symmetric:
        sq_min, sq_max = -(span // 2 + 1), span // 2
        # float32 divisions (float / int in C++), the larger one widened to float64, times the int
        max_scale = torch.maximum((lo / sq_min).abs(), (hi / sq_max).abs()).to(f64)
        lo = torch.where(straddles, (max_scale * sq_min).to(f32), lo)
        hi = torch.where(straddles, (max_scale * sq_max).to(f32), hi)
    zero = torch.zeros((), dtype=f32, device=lo.device)
    lo, hi = torch.minimum(lo, zero), torch.maximum(hi, zero)
    scale = (hi.to(f64) - lo.to(f64)) / span
    s32 = scale.to(f32)
    scale = torch.where((s32 == 0) | torch.isinf(torch.reciprocal(s32)), torch.full_like(scale, 0.1), scale)
    small = scale < _SMALL_SCALE
    if tracing() or small.is_meta or bool(small.any()):  # (traced / meta: always the torch.where form)
        thr = torch.tensor(_SMALL_SCALE, dtype=f32, device=lo.device)
        amplifier = thr / scale.to(f32)                                   # float32, as in C++
        new_hi = torch.where(lo == 0, thr * span, torch.where(hi == 0, hi, hi * amplifier))
        new_lo = torch.where(lo == 0, lo, torch.where(hi == 0, -thr * span, lo * amplifier))
        lo, hi = torch.where(small, new_lo, lo), torch.where(small, new_hi, hi)
        scale = torch.where(small, thr.to(f64), scale)
    scale = scale.to(f32).to(f64)                                        # fbgemm keeps a float32 scale
    lo64, hi64 = lo.to(f64), hi.to(f64)
    from_min, from_max = quant_min - lo64 / scale, quant_max - hi64 / scale
    err_min = abs(quant_min) - (lo64 / scale).abs()
    err_max = abs(quant_max) - (hi64 / scale).abs()
    initial = torch.where(err_min < err_max, from_min, from_max)
    if symmetric:
        mid = torch.tensor((quant_min + quant_max) / 2, dtype=f64, device=lo.device)
        initial = torch.where((lo < 0) & (hi > 0), mid, initial)
    zero_point = torch.round(initial).clamp(quant_min, quant_max).to(torch.int64)  # off the grid: the bound
    # lowbit beyond fbgemm: a grid end past ±3.4e38 (a range at float32's limit) is clipped by < 1 step
    return _keep_grid_finite(scale.to(f32), zero_point, quant_min, quant_max), zero_point


class FusedMovingAvgObsFakeQuantize(FakeQuantize):
    """``FakeQuantize`` around a moving-average min/max observer, observed and fake-quantized in one step.

    ``observer`` must build a ``MovingAverageMinMaxObserver`` or a
    ``MovingAveragePerChannelMinMaxObserver``; ``scale``/``zero_point`` are updated only while fake
    quantization is on (as torch's fused kernel does).

    >>> import torch, lowbit as Q
    >>> fq = Q.FusedMovingAvgObsFakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    >>> fq(torch.randn(4, 3)).shape, fq.scale.shape
    (torch.Size([4, 3]), torch.Size([4]))
    """

    _use_torch_kernel = True  # the CPU float32 path through torch's fused op (tests switch it off)

    def __init__(self, observer: Callable[..., ObserverBase] = MovingAverageMinMaxObserver,
                 **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        obs = self._observer
        if not isinstance(obs, (MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver)):
            raise TypeError(f"FusedMovingAvgObsFakeQuantize: observer={observer!r} built a {type(obs).__name__}; "
                            "it needs MovingAverageMinMaxObserver or MovingAveragePerChannelMinMaxObserver")
        self.is_symmetric_quant = obs.qscheme.is_symmetric

    @property
    def _observer(self) -> MovingAverageMinMaxObserver | MovingAveragePerChannelMinMaxObserver:
        return self.activation_post_process  # type: ignore[return-value]  # checked in __init__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"FusedMovingAvgObsFakeQuantize expects a floating-point tensor, got {got}")
        if x.numel() == 0:
            return x
        observe, quant = self._switch("observer_enabled"), self._switch("fake_quant_enabled")
        observe = observe and not self._meta_run(x)
        if quant and not self._switch("observer_enabled"):
            self._check_grid(x)
        if self.ch_axis is not None:
            self._size_channels(x)
        if self._fits_torch_kernel(x, observe):
            y = self._torch_kernel(x, observe, quant)
            if y is not None:
                return y
        if observe:
            self.activation_post_process(x.detach())
        if not quant:
            return x
        self._set_qparams(*self._fused_qparams())
        return fake_quantize(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.ch_axis,
                             validate=x.device.type == "cpu" and not tracing())

    # -- torch's fused kernel --------------------------------------------------------------------
    def _fits_torch_kernel(self, x: torch.Tensor, observe: bool) -> bool:
        obs = self._observer
        # not while torch.compile / export traces: torch's kernel refuses the int64 zero point there (its meta
        # function wants int32 / float, eager takes int64), and the composite traces to the same numbers
        return (self._use_torch_kernel and not tracing() and x.device.type == "cpu" and x.dtype == torch.float32
                and self.scale.device.type == "cpu" and self.quant_max - self.quant_min < 1 << 16
                and (self.ch_axis is None or self.ch_axis % x.dim() == 0)
                and (observe or obs.is_calibrated))       # torch's kernel fails on a never-seen range

    def _torch_kernel(self, x: torch.Tensor, observe: bool, quant: bool) -> torch.Tensor | None:
        """One ``torch.fused_moving_avg_obs_fake_quant`` call; ``None`` (state restored) when the batch
        held NaN/±Inf, which torch folds into the running range."""
        obs = self._observer
        lo, hi = obs.min_val, obs.max_val
        per_channel = self.ch_axis is not None
        saved: tuple[Any, ...] = ()                       # scale/zero_point need no backup: recomputed on failure
        if observe:
            saved = (lo.clone(), hi.clone()) if per_channel else (lo.item(), hi.item())
        try:
            y = torch.fused_moving_avg_obs_fake_quant(
                x, _SWITCH[observe], _SWITCH[quant], lo, hi, self.scale.view(-1),
                self.zero_point.view(-1), obs.averaging_constant, self.quant_min, self.quant_max, 0, per_channel,
                self.is_symmetric_quant)
            if not observe:
                ok = True
            elif per_channel:
                ok = bool(((lo.abs() < _HUGE) & (hi.abs() < _HUGE)).all())
            else:  # a range near float32's limit: the fallback keeps the grid ends finite (torch's overflow)
                ok = max(abs(lo.item()), abs(hi.item())) < _HUGE
        except RuntimeError:
            ok = False
        if not ok:
            for buf, old in zip((lo, hi), saved):
                if isinstance(old, torch.Tensor):
                    buf.copy_(old)
                else:
                    buf.fill_(old)
            return None
        if observe and not obs._needs_sync:
            obs._needs_sync = True
        if quant and not observe:
            y = torch.where(torch.isnan(x), x.detach(), y)  # unobserved NaN: keep it (torch maps it to a code)
        return y

    # -- qparams ---------------------------------------------------------------------------------
    def _size_channels(self, x: torch.Tensor) -> None:
        """Give the per-channel statistics and qparams their ``(C,)`` shape before the first batch."""
        axis = check_ch_axis(self.ch_axis, x.dim(), x.shape)  # type: ignore[arg-type]
        c = x.shape[axis]
        obs = self._observer
        if obs.min_val.dim() == 1 and obs.min_val.numel() != c:
            raise ValueError(f"FusedMovingAvgObsFakeQuantize: a tensor of shape {tuple(x.shape)} has {c} channels "
                             f"along ch_axis={self.ch_axis}, but this module has recorded {obs.min_val.numel()}")
        if obs.min_val.dim() == 0:
            obs._store(torch.full((c,), float("inf"), device=obs.min_val.device),
                       torch.full((c,), float("-inf"), device=obs.max_val.device))
        if self.scale.shape != (c,):
            self._set_qparams(torch.ones(c, device=self.scale.device), torch.zeros(c, dtype=torch.int64,
                                                                                  device=self.scale.device))

    def _fused_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused grid of the current statistics; a channel (or tensor) with no data yet: ``(1.0, 0)``."""
        obs = self._observer
        s, z = choose_qparams_fbgemm(obs.min_val, obs.max_val, self.quant_min, self.quant_max,
                                     self.is_symmetric_quant)
        seen = torch.isfinite(obs.min_val) & torch.isfinite(obs.max_val)
        neutral_z = min(max(0, self.quant_min), self.quant_max)
        return torch.where(seen, s, 1.0), torch.where(seen, z, neutral_z)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``choose_qparams`` of the observed range (raises if nothing was observed; syncs across ranks)."""
        obs = self._observer
        obs.calculate_qparams()  # validation, and the cross-rank reduction under torch.distributed
        return choose_qparams_fbgemm(obs.min_val, obs.max_val, self.quant_min, self.quant_max,
                                     self.is_symmetric_quant)


# the switches as torch's kernel reads them (any non-zero is on), from the module's own reading (== 1): a buffer written
# to 2 in place was on in the kernel, off on the composite path and when compiled
_SWITCH = {False: torch.tensor([0], dtype=torch.uint8), True: torch.tensor([1], dtype=torch.uint8)}


def fused_moving_avg_obs_fake_quant(x: torch.Tensor, observer_on: torch.Tensor, fake_quant_on: torch.Tensor,
                                    running_min: torch.Tensor, running_max: torch.Tensor, scale: torch.Tensor,
                                    zero_point: torch.Tensor, averaging_const: float, quant_min: int, quant_max: int,
                                    ch_axis: int, per_row_fake_quant: bool = False,
                                    symmetric_quant: bool = False) -> torch.Tensor:
    """The functional form of ``FusedMovingAvgObsFakeQuantize`` (``torch.fused_moving_avg_obs_fake_quant``'s
    signature); updates ``running_min``/``running_max``/``scale``/``zero_point`` in place.

    ``per_row_fake_quant``: statistics and grid per slice along ``ch_axis`` (buffers of shape ``(C,)``);
    else per tensor (buffers ``()`` or ``(1,)``). ``observer_on``/``fake_quant_on`` are 0/1 tensors.
    An all-``inf`` running range (never observed) is seeded by the first batch; NaN in ``x`` is
    ignored by the statistics.

    >>> import torch
    >>> lo, hi = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    >>> s, z, on = torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1])
    >>> y = fused_moving_avg_obs_fake_quant(torch.tensor([-1.0, 3.0]), on, on, lo, hi, s, z, 0.01, 0, 255, 0)
    >>> lo.item(), hi.item(), round(s.item(), 6), z.item()
    (-1.0, 3.0, 0.015686, 64)
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"fused_moving_avg_obs_fake_quant: x must be a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    axis = check_ch_axis(ch_axis, x.dim(), x.shape) if per_row_fake_quant else None
    # every argument checked before any buffer is written (a bad call must not leave NaN or stale statistics)
    fn = "fused_moving_avg_obs_fake_quant"
    if isinstance(averaging_const, bool) or not isinstance(averaging_const, (int, float)) or not 0 < averaging_const <= 1:
        raise ValueError(f"{fn}: averaging_const={averaging_const!r} must be a number in (0, 1]")
    for k, v in (("quant_min", quant_min), ("quant_max", quant_max)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{fn}: {k}={v!r} must be an int")
    if quant_min >= quant_max:
        raise ValueError(f"{fn}: quant_min={quant_min} must be < quant_max={quant_max}")
    n = 1 if axis is None else x.shape[axis]
    for k, t in (("running_min", running_min), ("running_max", running_max), ("scale", scale), ("zero_point", zero_point)):
        if not isinstance(t, torch.Tensor) or t.numel() != n:
            raise ValueError(f"{fn}: {k} must be a tensor of {n} value(s) ("
                             + ("per tensor" if axis is None else f"one per slice along ch_axis={axis}") + "), got "
                             + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if bool(observer_on.reshape(-1)[0] == 1) and x.numel():
        xd = x.detach().to(torch.float32)
        if axis is None:
            finite = xd[torch.isfinite(xd)]
            if finite.numel():
                lo, hi = torch.aminmax(finite)
                _moving_update(running_min, running_max, lo, hi, averaging_const)
        else:
            rows = xd.movedim(axis, 0).reshape(x.shape[axis], -1)
            ok = torch.isfinite(rows)
            lo = torch.where(ok, rows, float("inf")).amin(1)
            hi = torch.where(ok, rows, float("-inf")).amax(1)
            seen = torch.isfinite(lo)
            _moving_update(running_min, running_max, torch.where(seen, lo, running_min),
                           torch.where(seen, hi, running_max), averaging_const)
    if bool(fake_quant_on.reshape(-1)[0] != 1):
        return x
    s, z = choose_qparams_fbgemm(running_min, running_max, quant_min, quant_max, symmetric_quant)
    seen = torch.isfinite(running_min) & torch.isfinite(running_max)
    s, z = torch.where(seen, s, 1.0), torch.where(seen, z, min(max(0, quant_min), quant_max))
    scale.copy_(s.reshape(scale.shape))
    zero_point.copy_(z.reshape(zero_point.shape))
    return fake_quantize(x, s.reshape(-1) if axis is not None else s.reshape(()),
                         z.reshape(-1) if axis is not None else z.reshape(()), quant_min, quant_max, axis)


def _moving_update(running_min: torch.Tensor, running_max: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   c: float) -> None:
    """``running += c * (new - running)``; an infinite (unseen) running value takes ``new`` as is."""
    lo, hi = lo.reshape(running_min.shape), hi.reshape(running_max.shape)
    running_min.copy_(torch.where(torch.isinf(running_min), lo, running_min + c * (lo - running_min)))
    running_max.copy_(torch.where(torch.isinf(running_max), hi, running_max + c * (hi - running_max)))
