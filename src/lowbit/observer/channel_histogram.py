"""Running histograms per tensor or per channel: the statistic behind the clipping-range observers.

``_ClipRangeObserver`` folds every batch into ``bins`` equal-width bins over a running range, one
histogram per channel (``ch_axis``, shapes ``(C, bins)`` / ``(C,)``) or one for the whole tensor
(``(bins,)`` / ``()``). A wider batch rebins the old counts onto the new edges, each old bin's mass
split over the new bins it overlaps (uniform-within-bin model, as ``HistogramObserver``).
Subclasses only say how a histogram becomes a clipping range::

    _clip_range(hist (C, B) float64, lo (C,), hi (C,)) -> (cmin (C,), cmax (C,))   # lo <= cmin <= cmax <= hi

and ``calculate_qparams()`` maps ``(cmin, cmax)`` through ``lowbit.calculate_qparams`` (which widens
the range to include 0 and floors the scale at ``eps``). Defined edge behaviour: an empty batch is a
no-op; NaN/±Inf values are ignored (warned once per observer type); a constant tensor (or channel)
gives the min/max qparams of that constant; ``calculate_qparams`` before any finite data raises
``RuntimeError`` naming the observer (a channel that never saw finite data is named too).

Under ``torch.distributed`` the ranks' histograms are merged onto their common range and summed
(``sync_statistics``, called lazily from ``calculate_qparams`` or by ``sync_observers``), so every
rank gets the qparams of the union of the data.

>>> import torch
>>> from lowbit.observer.channel_histogram import _rebin_rows
>>> h = torch.tensor([[2.0, 2.0]], dtype=torch.float64)           # 4 values over [0, 2]
>>> _rebin_rows(h, torch.tensor([0.0]), torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([4.0]))
tensor([[4., 0.]], dtype=torch.float64)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..compile_state import compiler_disabled, tracing
from ..qparams import calculate_qparams
from ..qscheme import QDtype, QScheme
from .base import ObserverBase, check_bins, check_observed, refuse_meta
from .ddp import forget, note_forward, warn_overwritten
from .distributed import (agree_observer, all_reduce_min_max, all_reduce_sum, broadcast_first, is_distributed,
                          pending_sync, remember_group)

__all__: list[str] = []

_SHRINK = 1 - 2.0**-20  # keeps x = max inside the last bin through float32 rounding (see histogram.py)
_warned: set[str] = set()


def _rebin_rows(hist: torch.Tensor, old_lo: torch.Tensor, old_hi: torch.Tensor,
                new_lo: torch.Tensor, new_hi: torch.Tensor) -> torch.Tensor:
    """Each row of ``hist`` ``(C, B)`` over ``[old_lo, old_hi]`` re-expressed over ``[new_lo, new_hi] ⊇`` it.

    New bin ``j`` of row ``c`` gets ``F_c(e_{j+1}) - F_c(e_j)``, ``F_c`` the old piecewise-linear CDF
    (a step when the old range is a point). Rows with a non-finite old range give zeros.
    """
    c, b = hist.shape
    if c == 0:
        return hist
    h = hist.to(torch.float64)
    ol, oh, nl, nh = (v.to(torch.float64).reshape(c, 1) for v in (old_lo, old_hi, new_lo, new_hi))
    ok = torch.isfinite(ol) & torch.isfinite(oh) & torch.isfinite(nl) & torch.isfinite(nh)  # (C, 1)
    ol, oh = torch.where(ok, ol, 0.0), torch.where(ok, oh, 0.0)
    nl, nh = torch.where(ok, nl, 0.0), torch.where(ok, nh, 1.0)
    edges = nl + (nh - nl) * torch.arange(b + 1, dtype=torch.float64, device=h.device) / b  # (C, B+1)
    ow = (oh - ol) / b
    t = torch.where(ow > 0, (edges - ol) / torch.where(ow > 0, ow, 1.0),
                    torch.where(edges > ol, float(b), 0.0)).clamp(0, b)
    t[:, 0], t[:, -1] = 0.0, float(b)  # the new range covers the old one
    j = t.to(torch.int64).clamp_(max=b - 1)
    cum = torch.cat([h.new_zeros(c, 1), h.cumsum(1)], 1)
    cdf = cum.gather(1, j) + (t - j) * h.gather(1, j)
    return torch.where(ok, cdf.diff(dim=1).clamp_min(0), 0.0).to(hist.dtype)


class _ClipRangeObserver(ObserverBase):
    """Per-tensor or per-channel running histogram; subclasses turn it into a clipping range."""

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor
    _sync_settings: tuple[str, ...] = ("bins",)  # compared across ranks (agree_observer)

    def __init__(self, qscheme: QScheme | str, qdtype: QDtype | str, ch_axis: int | None, eps: float,
                 bins: int | None) -> None:
        super().__init__(qscheme, qdtype, ch_axis, eps)
        name = type(self).__name__
        if self.qscheme.is_per_channel:
            if ch_axis is None:
                raise ValueError(f"{name}: qscheme={self.qscheme.value} needs ch_axis (an int)")
        elif ch_axis is not None:
            raise ValueError(f"{name}: ch_axis={ch_axis} given with the per-tensor qscheme={self.qscheme.value}; "
                             "use a per_channel_* qscheme")
        if bins is None:
            bins = 256 if self.qscheme.is_per_channel else 2048  # per channel: (C, bins) floats per observer
        self.bins = check_bins(bins, name, 8)
        per_channel = self.ch_axis is not None
        self.register_buffer("histogram", torch.zeros((0, bins) if per_channel else (bins,)))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.register_buffer("_reduced_histogram", torch.zeros(0), persistent=False)
        self.register_buffer("_reduced_lo", torch.tensor(float("inf")), persistent=False)
        self.register_buffer("_reduced_hi", torch.tensor(float("-inf")), persistent=False)
        self._needs_sync = True

    # -- observing -------------------------------------------------------------------------------
    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``(C, N)`` float32 (per tensor: ``(1, numel)``)."""
        name = type(self).__name__
        if self.ch_axis is None:
            return x.detach().reshape(1, -1).to(torch.float32)
        if not -x.dim() <= self.ch_axis < x.dim():
            raise ValueError(f"{name}: ch_axis={self.ch_axis} is out of range for a tensor of shape {tuple(x.shape)}")
        channels = x.shape[self.ch_axis]
        if self.min_val.dim() == 1 and self.min_val.numel() != channels:
            raise ValueError(f"{name}: a tensor of shape {tuple(x.shape)} has {channels} channels along "
                             f"ch_axis={self.ch_axis}, but this observer has recorded {self.min_val.numel()}")
        return x.detach().movedim(self.ch_axis, 0).reshape(channels, -1).to(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fold ``x`` into the histogram(s), widening the range if needed; return ``x`` unchanged."""
        name = type(self).__name__
        check_observed(x, name, self)
        if x.numel() == 0:
            return x
        rows = self._rows(x)  # (C, N)
        if rows.device != self.histogram.device:
            self.to(rows.device)
        traced = tracing()
        if traced and self.ch_axis is not None and self.min_val.dim() == 0:  # the (C,) buffers do not exist yet
            if torch.compiler.is_exporting():
                raise RuntimeError(f"{name} (per channel, ch_axis={self.ch_axis}): the first batch sizes its (C,) "
                                   "statistics, which torch.export cannot trace (a buffer resize); observe one "
                                   "batch eagerly before exporting")
            _seed_channels(self, rows.shape[0])  # torch.compile: one graph break, at the first batch only
        finite = torch.isfinite(rows)
        if traced:  # no data-dependent branch: the masked reductions (the same values), no warning
            lo = torch.where(finite, rows, float("inf")).amin(1)
            hi = torch.where(finite, rows, float("-inf")).amax(1)
        else:
            all_finite = bool(finite.all())
            if not all_finite and name not in _warned:
                _warned.add(name)
                warnings.warn(f"{name}: observed data contains NaN or Inf; those values are ignored", stacklevel=2)
            lo = torch.where(finite, rows, float("inf")).amin(1) if not all_finite else rows.amin(1)
            hi = torch.where(finite, rows, float("-inf")).amax(1) if not all_finite else rows.amax(1)
        note_forward(self, before=True)  # under torch.distributed: were the statistics overwritten (DDP)?
        old_lo, old_hi, hist = self._state(rows.shape[0])
        new_lo, new_hi = torch.minimum(old_lo, lo), torch.maximum(old_hi, hi)
        if traced:  # rebinned rows kept only where the range moved (bit for bit what eager keeps)
            moved = ((new_lo != old_lo) | (new_hi != old_hi)).unsqueeze(1)
            hist = torch.where(moved, _rebin_rows(hist, old_lo, old_hi, new_lo, new_hi), hist)
        elif not (torch.equal(new_lo, old_lo) and torch.equal(new_hi, old_hi)):
            hist = _rebin_rows(hist, old_lo, old_hi, new_lo, new_hi)
        width = (new_hi - new_lo).unsqueeze(1)
        base = torch.where(torch.isfinite(new_lo), new_lo, 0.0).unsqueeze(1)
        vals = torch.where(finite, rows, base)
        k = torch.where(width > 0, self.bins * _SHRINK / torch.where(width > 0, width, 1.0), 0.0)
        wide = ~(torch.isfinite(width) & torch.isfinite(k)).all()
        # a range past float32's max (e.g. ±2e38), or one so narrow (e.g. 1e-40) that bins / width overflows to
        # inf (0 * inf = NaN bin indices): the values are placed in float64 (traced: both computed, one kept)
        if traced:
            pos = torch.where(wide, self._positions(vals.double(), base.double(), width.double()),
                              self._positions(vals, base, width))
        else:
            pos = self._positions(*(t.double() for t in (vals, base, width)) if bool(wide)
                                  else (vals, base, width))
        offset = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1) * self.bins
        flat = hist.reshape(-1).clone()
        flat.scatter_add_(0, (pos + offset).reshape(-1), finite.reshape(-1).to(flat.dtype))
        self._store(new_lo, new_hi, flat.view_as(hist))
        note_forward(self, before=False)
        self._needs_sync = True
        return x

    def _positions(self, vals: torch.Tensor, base: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
        """Bin numbers ``clamp(floor((v - base) * bins * (1 - 2⁻²⁰) / width), 0, bins - 1)`` (int64; width 0: bin 0)."""
        k = torch.where(width > 0, self.bins * _SHRINK / torch.where(width > 0, width, 1.0), 0.0)
        return ((vals - base) * k).clamp_(0, self.bins - 1).to(torch.int64)

    def _state(self, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo (C,), hi (C,), hist (C, B))`` views of the buffers, seeded for ``channels`` rows."""
        if self.ch_axis is None:
            return self.min_val.reshape(1), self.max_val.reshape(1), self.histogram.reshape(1, -1)
        if self.min_val.dim() == 0:  # first batch: C rows of "nothing seen"
            dev = self.histogram.device
            return (torch.full((channels,), float("inf"), device=dev), torch.full((channels,), float("-inf"), device=dev),
                    torch.zeros(channels, self.bins, device=dev))
        return self.min_val, self.max_val, self.histogram

    def _store(self, lo: torch.Tensor, hi: torch.Tensor, hist: torch.Tensor) -> None:
        shape = () if self.ch_axis is None else lo.shape
        for name, value in (("min_val", lo.reshape(shape)), ("max_val", hi.reshape(shape)),
                            ("histogram", hist.reshape(self.bins) if self.ch_axis is None else hist)):
            buf = getattr(self, name)
            if buf.shape != value.shape:
                buf.resize_(value.shape)
            buf.copy_(value)

    # -- state -----------------------------------------------------------------------------------
    @property
    def is_calibrated(self) -> bool:
        if self.min_val.is_meta:
            refuse_meta(self)
        return bool((self.min_val <= self.max_val).all()) and self.min_val.numel() > 0

    def reset_min_max_vals(self) -> None:
        """Forget everything observed."""
        dev = self.histogram.device
        self.register_buffer("min_val", torch.tensor(float("inf"), device=dev))
        self.register_buffer("max_val", torch.tensor(float("-inf"), device=dev))
        self.register_buffer("histogram", torch.zeros((0, self.bins) if self.ch_axis is not None else (self.bins,),
                                                      device=dev))
        self._mark_reduced()  # nothing reduced yet: the next reduction must not subtract the forgotten union
        forget(self)
        self._needs_sync = True

    def _mark_reduced(self) -> None:
        """Record the current statistics as the ones every rank holds after a reduction (``sync_statistics``, a
        loaded checkpoint; a reset: nothing), so the next reduction sums only what each rank saw since."""
        rows = 1 if self.min_val.dim() == 0 else self.min_val.numel()
        self._reduced_histogram = self.histogram.detach().reshape(-1).clone()
        self._reduced_lo = self.min_val.detach().reshape(-1).expand(rows).clone()
        self._reduced_hi = self.max_val.detach().reshape(-1).expand(rows).clone()

    def sync_statistics(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        """Merge the ranks' histograms (a collective; no-op on a single process).

        The common range is the MIN/MAX of the ranks' ranges; each rank rebins onto it and the
        histograms are summed. What was reduced last time is counted once, not once per rank. Statistics
        overwritten between forwards on some rank (DDP's buffer broadcast, ``observer.ddp``): rank 0's, with a warning.
        """
        remember_group(self, group)  # the group later lazy reductions use
        if is_distributed(group):
            marked = agree_observer(self, group)
            lo, hi = all_reduce_min_max(self.min_val, self.max_val, group, type(self).__name__)
            rows = 1 if lo.dim() == 0 else lo.numel()
            lo_r, hi_r = lo.reshape(rows), hi.reshape(rows)
            old_lo, old_hi, mine = self._state(rows)
            if marked:
                warn_overwritten(self, marked)
                first = broadcast_first(torch.cat([old_lo.unsqueeze(1), old_hi.unsqueeze(1), mine], 1), group)
                lo_r, hi_r, merged = first[:, 0].contiguous(), first[:, 1].contiguous(), first[:, 2:]
                self._store(lo_r, hi_r, merged)
                self._reduced_histogram = merged.reshape(-1).clone()
                self._reduced_lo, self._reduced_hi = lo_r.clone(), hi_r.clone()
                forget(self)
                self._needs_sync = False
                return
            mine = _rebin_rows(mine.to(torch.float64), old_lo, old_hi, lo_r, hi_r)
            if self._reduced_histogram.numel() == rows * self.bins:
                base = _rebin_rows(self._reduced_histogram.reshape(rows, self.bins).to(torch.float64),
                                   self._reduced_lo.expand(rows), self._reduced_hi.expand(rows), lo_r, hi_r)
            else:
                base = torch.zeros_like(mine)
            merged = (all_reduce_sum(mine - base, group, type(self).__name__) + base).clamp_min_(0)
            merged = torch.where((lo_r <= hi_r).unsqueeze(1), merged, 0.0).to(torch.float32)
            self._store(lo_r, hi_r, merged)
            self._reduced_histogram = merged.reshape(-1).clone()
            self._reduced_lo, self._reduced_hi = lo_r.clone(), hi_r.clone()
        forget(self)
        self._needs_sync = False

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self.bins = self.histogram.shape[-1]
        self._mark_reduced()  # loaded statistics count as already reduced: later reductions add only what is new
        forget(self)
        self._needs_sync = False

    # -- qparams ---------------------------------------------------------------------------------
    def _clip_range(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # pragma: no cover - abstract

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cmin, cmax)``: the clipping range ``calculate_qparams`` quantizes (``()`` or ``(C,)``)."""
        if self.min_val.is_meta:
            refuse_meta(self)
        pending_sync(self)  # over the group it was last reduced over (WORLD if none)
        name = type(self).__name__
        if self.min_val.numel() == 0 or not bool(torch.isfinite(self.min_val).any()):
            raise RuntimeError(f"{name} has not observed any finite data; run calibration batches before "
                               "calculate_qparams()")
        if not self.is_calibrated:
            missing = (~torch.isfinite(self.min_val)).nonzero().flatten().tolist()
            raise RuntimeError(f"{name}: channels {missing} never held a finite value; cannot compute qparams")
        key = self._state_key()
        cached = self.__dict__.get("_clip_cache")
        if key is not None and cached is not None and _same_state(cached[0], key):
            return cached[1].clone(), cached[2].clone()
        rows = self.min_val.numel()
        lo, hi = self.min_val.reshape(rows).double(), self.max_val.reshape(rows).double()
        hist = self.histogram.reshape(rows, self.bins).double()
        cmin, cmax = self._clip_range(hist, lo, hi)
        cmin = torch.minimum(torch.maximum(cmin, lo), hi)
        cmax = torch.maximum(torch.minimum(cmax, hi), cmin)
        shape = self.min_val.shape
        cmin, cmax = cmin.to(torch.float32).reshape(shape), cmax.to(torch.float32).reshape(shape)
        # the search is the costly part (MSE: a 24 x 24 grid on 2048 bins) and the rounding passes ask again and
        # again for the same observer's qparams: remember the answer for exactly this state
        if key is not None:
            self.__dict__["_clip_cache"] = (key, cmin, cmax)
        return cmin.clone(), cmax.clone()

    def _state_key(self) -> tuple[Any, ...] | None:
        """What ``clip_range`` depends on: the statistics buffers themselves (held, so never another tensor at the
        same address) with their in-place version counters, and every plain setting (``bins``, ``percentile``...);
        ``None`` (no caching) for inference tensors, which keep no version counter."""
        if any(t.is_inference() for t in (self.min_val, self.max_val, self.histogram)):
            return None
        bufs = tuple((t, t._version) for t in (self.min_val, self.max_val, self.histogram))
        plain = tuple(sorted((k, v) for k, v in vars(self).items()
                             if isinstance(v, (bool, int, float, str)) and k != "_needs_sync"))
        return bufs, plain, self.qscheme, self.qdtype, self.eps, self.ch_axis

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` (float32 / int64, ``()`` or ``(C,)``) of ``clip_range()``."""
        cmin, cmax = self.clip_range()
        return calculate_qparams(cmin, cmax, self.qscheme, self.qdtype, self.eps)

    def extra_repr(self) -> str:
        return f"bins={self.bins}, {super().extra_repr()}"


def _seed_rows(obs: _ClipRangeObserver, channels: int) -> None:
    """Size a per-channel observer's buffers for ``channels`` rows of "nothing seen" (``+inf`` / ``-inf`` / zeros)."""
    dev = obs.histogram.device
    obs.register_buffer("min_val", torch.full((channels,), float("inf"), device=dev))
    obs.register_buffer("max_val", torch.full((channels,), float("-inf"), device=dev))
    obs.register_buffer("histogram", torch.zeros(channels, obs.bins, device=dev))


_seed_channels = compiler_disabled(_seed_rows, reason="lowbit: a per-channel histogram observer sizes its (C,) "
                                  "buffers at its first batch; observe one batch eagerly before compiling")


def _same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Two ``_state_key``s: the same buffer objects at the same versions, the same settings."""
    return all(x is y and u == v for (x, u), (y, v) in zip(a[0], b[0])) and a[1:] == b[1:]


def bin_edges(lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """``(C, B+1)`` edges of the equal-width bins over each row's ``[lo, hi]``."""
    return lo.unsqueeze(1) + (hi - lo).unsqueeze(1) * torch.arange(bins + 1, dtype=lo.dtype, device=lo.device) / bins


def cdf_at(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Mass below ``x`` ``(C, K)`` under the uniform-within-bin model of ``hist`` ``(C, B)``."""
    c, b = hist.shape
    width = (hi - lo).unsqueeze(1)
    t = torch.where(width > 0, (x - lo.unsqueeze(1)) / torch.where(width > 0, width, 1.0) * b,
                    torch.where(x >= lo.unsqueeze(1), float(b), 0.0)).clamp(0, b)
    j = t.to(torch.int64).clamp_(max=b - 1)
    cum = torch.cat([hist.new_zeros(c, 1), hist.cumsum(1)], 1)
    return cum.gather(1, j) + (t - j) * hist.gather(1, j)


def magnitude_histogram(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The histogram of ``|x|``: ``(C, B)`` counts over ``[0, amax]`` and ``amax`` ``(C,)``.

    Bin ``j`` gets ``G(e_{j+1}) - G(e_j)`` with ``G(t) = F(t) - F(-t)`` (mass in ``[-t, t]``).
    """
    b = hist.shape[1]
    amax = torch.maximum(lo.abs(), hi.abs())
    edges = bin_edges(torch.zeros_like(amax), amax, b)  # (C, B+1)
    g = cdf_at(hist, lo, hi, edges) - cdf_at(hist, lo, hi, -edges)
    g[:, 0] = 0.0
    g[:, -1] = hist.sum(1)
    return g.diff(dim=1).clamp_min(0), amax
