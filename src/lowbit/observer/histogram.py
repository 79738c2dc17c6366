"""HistogramObserver: a running histogram and an L2-optimal clipping range (DESIGN §2, §5).

Forward folds each batch into ``bins`` equal-width bins over the running range ``[min_val, max_val]``.
When a batch widens the range, the old histogram is rebinned onto the new edges with each old bin's
mass split *proportionally* over the new bins it overlaps (exact under the uniform-within-bin model),
so widening loses almost nothing (torch.ao moves 16 sub-bins by their centres, lucid whole bins).

``calculate_qparams()`` picks the grid that minimises the expected squared error of ``fake_quantize``
on the observed data, modelling each bin's mass as spread uniformly over the bin (better than bin
centres). For a candidate clipping range ``(cmin, cmax)``, ``lowbit.calculate_qparams`` builds the
grid ``{(q - z) s}`` (zero included, zero point rounded), with ends ``lo = (qmin - z) s`` and
``hi = (qmax - z) s``; its error is::

    err = ∫_{x<lo} (x - lo)² p(x) dx + ∫_{x>hi} (x - hi)² p(x) dx      # clipping
        + Σ_cells ∫_cell (x - x_q)² p(x) dx                             # rounding, ≈ s²/12 · mass inside

The search runs in two vectorised stages, without loops over bins. (1) The smooth model (rounding
``≈ s²/12`` per unit of mass inside, the bin holding 0 excepted since 0 is on every grid, so a ReLU
spike costs ~nothing) costs O(1) per candidate from prefix sums of ``F``, ``∫F``, ``∫∫F``; it is
evaluated on a 65 x 65 grid of ``(cmin, cmax)`` and two 33 x 33 windows around the best (symmetric
schemes: ``B`` values of ``max(|cmin|, |cmax|)``, then two finer windows). (2) The exact model
(O(quant_max - quant_min) per candidate, via ``err = ∫(x - top)² p - 2 s Σ_edges ∫_{x<β}(β - x) p``)
refines the scale within ±3 % and ±0.5 % and the zero point by ±2. The unclipped range is always a
candidate. torch.ao's ``_non_linear_param_search`` instead moves one end at a time, stops at the
first increase, and ignores the zero-point rounding.

``search="quantile"`` is lucid's coarse scan instead, kept for parity with models calibrated there
(``_quantile_clip_range``): six quantile pairs of bin *centres*, scored with lucid's own error model.

Counting: on CPU, one ``aminmax`` read on the host, then integer bin indices and ``scatter_add_``
(several times faster than ``torch.histc``). On accelerators (or with ``sync_free = True``, or while
``torch.compile`` / ``torch.export`` trace) nothing is read on the host per batch: min/max stay
tensors, the rebinning always runs (its result kept only where the range moved), and NaN/Inf get
weight 0 in the ``scatter_add_`` (counted; a warning comes at ``calculate_qparams``). Traced,
``forward`` thus has no data-dependent branch: a calibrating model compiles with ``fullgraph=True``
and exports, its histogram bit-equal to eager's on finite data. ``calculate_qparams`` (the range
search, run at ``convert``) reads the histogram on the host: eager only. Under ``torch.distributed``,
``calculate_qparams`` (or ``sync_observers``) first merges the ranks' histograms onto their common
range and sums them (``sync_statistics``), so every rank gets the qparams of the union of the data.

>>> import torch, lowbit as Q
>>> obs = Q.HistogramObserver(bins=256)
>>> _ = obs(torch.linspace(-1.0, 3.0, 1001))
>>> scale, zp = obs.calculate_qparams()
>>> round(scale.item(), 4), int(zp)
(0.0157, 64)
"""

from __future__ import annotations

import warnings

import torch

from ..compile_state import tracing
from ..qparams import calculate_qparams
from ..qscheme import QDtype, QScheme
from .base import ObserverBase, check_bins, check_observed, finite_aminmax, refuse_meta
from .ddp import forget, note_forward, warn_overwritten
from .distributed import (agree_observer, all_reduce_min_max, all_reduce_sum, broadcast_first, is_distributed,
                          pending_sync, remember_group)
from .histogram_search import _L2Model, _quantile_clip_range, _search_clip_range  # noqa: F401 (_L2Model: tests)

__all__ = ["HistogramObserver"]

# Bin index = floor((x - min) * bins / (max - min)), clamped to bins - 1 (x = max): torch.histc's formula
# in the same float32 operation order, so a value on an interior edge lands in the bin above it, as in
# histc. Where float32 would overflow or underflow (a range beyond ~1e35 or a denormal width), the
# host path computes it in float64 and the accelerator path on halved operands.
_F32_SAFE = 1e35


def _bin_index(x: torch.Tensor, lo: torch.Tensor | float, width: torch.Tensor | float, bins: int) -> torch.Tensor:
    """``floor((x - lo) * bins / width)`` as float (not yet clamped), the operation order of ``torch.histc``."""
    return torch.sub(x, lo).mul_(bins).div_(width)


def _rebin(hist: torch.Tensor, old_lo: torch.Tensor, old_hi: torch.Tensor,
           new_lo: torch.Tensor, new_hi: torch.Tensor) -> torch.Tensor:
    """``hist`` over ``[old_lo, old_hi]`` re-expressed over ``[new_lo, new_hi] ⊇`` it, mass split by overlap.

    New bin ``j`` gets ``F(e_{j+1}) - F(e_j)`` where ``F`` is the old piecewise-linear CDF (a step at
    ``old_lo`` when the old range is a point). Tensor ops only (no host sync); an uninitialised old
    state (``old_lo = +inf``) gives zeros.
    """
    b = hist.numel()
    acc = torch.float32 if hist.device.type == "mps" else torch.float64  # MPS has no float64
    h = hist.to(acc)
    ol, oh, nl, nh = (v.to(acc) for v in (old_lo, old_hi, new_lo, new_hi))
    ok = torch.isfinite(ol) & torch.isfinite(oh) & torch.isfinite(nl) & torch.isfinite(nh)
    ol, oh = torch.where(ok, ol, 0.0), torch.where(ok, oh, 0.0)
    nl, nh = torch.where(ok, nl, 0.0), torch.where(ok, nh, 1.0)
    edges = nl + (nh - nl) * torch.arange(b + 1, dtype=acc, device=h.device) / b  # (B+1,)
    ow = (oh - ol) / b
    t = torch.where(ow > 0, (edges - ol) / torch.where(ow > 0, ow, 1.0), torch.where(edges > ol, float(b), 0.0))
    t = t.clamp(0, b)
    t[0], t[-1] = 0.0, float(b)  # the new range covers the old one: all mass lands inside
    j = t.to(torch.int64).clamp_(max=b - 1)  # floor (t >= 0)
    cum = torch.cat([h.new_zeros(1), h.cumsum(0)])
    cdf = cum.index_select(0, j) + (t - j) * h.index_select(0, j)
    out = cdf.diff().clamp_min(0)
    return torch.where(ok, out, 0.0).to(hist.dtype)


_SEARCHES = ("l2", "quantile")


class HistogramObserver(ObserverBase):
    """Running histogram of the observed values; qparams from the L2-optimal clipping range.

    Args:
        bins: number of equal-width bins over the running ``[min_val, max_val]`` (an int in ``[2, 2**24]``).
        qscheme: ``per_tensor_affine`` (default) or ``per_tensor_symmetric``.
        qdtype: the target grid (default ``quint8``).
        eps: floor of the scale.
        search: ``"l2"`` (default): the expected-L2 search of the module docstring; ``"quantile"``:
            lucid's six-candidate quantile scan (``_quantile_clip_range``). Either range then goes
            through ``calculate_qparams`` with ``qscheme``. A setting, not state: ``state_dict`` is
            the same, so a checkpoint loads into either.

    Buffers: ``min_val``, ``max_val`` (0-d, ±inf before any data) and ``histogram`` ``(bins,)``
    float32 counts. Attribute ``sync_free`` (``None``: chosen by device) forces the accelerator code
    path, which never reads a value on the host in ``forward``.

    >>> import torch, lowbit as Q
    >>> obs = Q.HistogramObserver(bins=4, search="quantile")
    >>> _ = obs(torch.tensor([0.0, 1.0, 2.0, 3.0]))         # one value in each bin of width 0.75
    >>> scale, zp = obs.calculate_qparams()                   # cmax = the last centre, 2.625, not 3
    >>> round(scale.item() * 255, 4), int(zp)
    (2.625, 0)
    """

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor
    _sync_settings: tuple[str, ...] = ("bins", "search")  # compared across ranks (agree_observer)

    def __init__(
        self,
        bins: int = 2048,
        qscheme: QScheme | str = QScheme.PER_TENSOR_AFFINE,
        qdtype: QDtype | str = "quint8",
        eps: float = 1e-8,
        search: str = "l2",
    ) -> None:
        super().__init__(qscheme, qdtype, None, eps)
        self.search = search
        check_bins(bins, "HistogramObserver", 2)
        if self.qscheme.is_per_channel:
            raise ValueError(f"HistogramObserver: qscheme={self.qscheme.value} is not supported; use "
                             "per_tensor_affine or per_tensor_symmetric (per channel: PerChannelMinMaxObserver)")
        self.bins = bins
        self.sync_free: bool | None = None
        self.register_buffer("histogram", torch.zeros(bins))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.register_buffer("nonfinite_count", torch.zeros((), dtype=torch.int64), persistent=False)
        # the statistics as of the last cross-rank reduction (every rank holds the same), so that a
        # second reduction adds only what each rank saw since, instead of counting the union N times
        self.register_buffer("_reduced_histogram", torch.zeros(bins), persistent=False)
        self.register_buffer("_reduced_range", torch.tensor([float("inf"), float("-inf")]), persistent=False)
        self._needs_sync = True

    @property
    def search(self) -> str:
        """``"l2"`` or ``"quantile"``: how ``calculate_qparams`` picks the clipping range."""
        return self._search

    @search.setter
    def search(self, value: str) -> None:
        if not isinstance(value, str) or value not in _SEARCHES:
            raise ValueError(f"HistogramObserver: search={value!r} must be one of {_SEARCHES}")
        self._search = value

    @property
    def is_calibrated(self) -> bool:
        if self.min_val.is_meta:
            refuse_meta(self)
        return bool(self.min_val <= self.max_val)

    def reset_min_max_vals(self) -> None:
        """Forget everything observed (range and histogram)."""
        for buf, value in ((self.min_val, float("inf")), (self.max_val, float("-inf")), (self.histogram, 0),
                           (self.nonfinite_count, 0), (self._reduced_histogram, 0)):
            buf.fill_(value)
        self._reduced_range.copy_(torch.tensor([float("inf"), float("-inf")]))
        forget(self)
        self._needs_sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fold ``x`` into the histogram (widening the range if needed) and return ``x`` unchanged."""
        check_observed(x, "HistogramObserver", self)
        if x.numel() == 0:
            return x
        if x.device != self.histogram.device:  # the statistics follow the data (first batch, or a moved model)
            self.to(x.device)
        # traced (torch.compile / torch.export): the tensor-only path, bit-equal to the host one on finite data
        sync_free = tracing() or (self.sync_free if self.sync_free is not None else x.device.type != "cpu")
        xs = x.detach().reshape(-1).to(torch.float32)
        note_forward(self, before=True)  # under torch.distributed: were the statistics overwritten (DDP)?
        (self._observe_sync_free if sync_free else self._observe_host)(xs)
        note_forward(self, before=False)
        self._needs_sync = True
        return x

    def _observe_host(self, x: torch.Tensor) -> None:
        """CPU: one host read of the batch range, ``scatter_add_`` of integer bin indices."""
        lo, hi = torch.stack(torch.aminmax(x)).tolist()
        if not (abs(lo) < float("inf") and abs(hi) < float("inf")):  # NaN/Inf: warn once, drop them
            lo, hi = torch.stack(finite_aminmax(x, type(self).__name__)).tolist()
            x = x[torch.isfinite(x)]
            if x.numel() == 0:
                return
        old_lo, old_hi = self.min_val.item(), self.max_val.item()
        new_lo, new_hi = min(lo, old_lo), max(hi, old_hi)
        if (new_lo, new_hi) != (old_lo, old_hi):
            self._set_range(torch.tensor(new_lo), torch.tensor(new_hi))
        width = new_hi - new_lo  # a Python float (double): no overflow
        if width <= 0:
            idx = torch.zeros(x.shape, dtype=torch.int64)
        else:
            f32 = width * self.bins < _F32_SAFE and width > 1e-30  # else float32 could overflow / go denormal
            xs = x if f32 else x.to(torch.float64)
            idx = _bin_index(xs, new_lo, width, self.bins).to(torch.int64).clamp_(0, self.bins - 1)
        self.histogram.scatter_add_(0, idx, self.histogram.new_ones(1).expand_as(x))

    def _observe_sync_free(self, x: torch.Tensor) -> None:
        """Accelerators: tensor min/max, ``scatter_add_`` of weights 1 (finite) / 0 (NaN, Inf)."""
        finite = torch.isfinite(x)
        mn = torch.where(finite, x, float("inf")).amin()
        mx = torch.where(finite, x, float("-inf")).amax()
        self.nonfinite_count += x.numel() - finite.sum()
        new_lo, new_hi = torch.minimum(self.min_val, mn), torch.maximum(self.max_val, mx)
        self._set_range(new_lo, new_hi)
        lo = torch.where(torch.isfinite(new_lo), new_lo, 0.0)
        width = torch.where(new_hi > new_lo, new_hi - new_lo, 1.0)
        pos = _bin_index(x, lo, width, self.bins)
        # float32 overflow (a range beyond ~1e35): the same on halved operands (exact scaling by 2)
        pos = torch.where(torch.isfinite(pos), pos, _bin_index(x * 0.5, lo * 0.5, new_hi * 0.5 - lo * 0.5, self.bins))
        pos = torch.where(new_hi > new_lo, pos, 0.0).clamp_(0, self.bins - 1)
        idx = torch.where(finite, pos, 0.0).to(torch.int64)
        self.histogram.scatter_add_(0, idx, finite.to(self.histogram.dtype))

    def _set_range(self, new_lo: torch.Tensor, new_hi: torch.Tensor) -> None:
        """Widen the range to ``[new_lo, new_hi]``, rebinning the histogram onto it (tensor ops only; the
        histogram is kept as is, bit for bit, where the range did not move)."""
        moved = (new_lo != self.min_val) | (new_hi != self.max_val)
        rebinned = _rebin(self.histogram, self.min_val, self.max_val, new_lo, new_hi)
        self.histogram.copy_(torch.where(moved, rebinned, self.histogram))
        self.min_val.copy_(new_lo)
        self.max_val.copy_(new_hi)

    def sync_statistics(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        """Merge the histograms of all ranks (a collective; no-op on a single process).

        The common range is the MIN/MAX of the ranks' ranges; each rank rebins onto it and the
        histograms are summed, so every rank then holds the statistics of the union of the data.
        What was already reduced last time is counted once, not once per rank. Statistics overwritten between
        forwards on some rank (``DistributedDataParallel(broadcast_buffers=True)``, see ``observer.ddp``): every rank
        adopts rank 0's (a warning), which summing would count once per rank.
        """
        remember_group(self, group)  # the group later lazy reductions use
        if is_distributed(group):
            marked = agree_observer(self, group)
            owner = type(self).__name__
            lo, hi = all_reduce_min_max(self.min_val, self.max_val, group, owner)
            if marked:
                warn_overwritten(self, marked)
                first = broadcast_first(torch.cat([torch.stack([self.min_val, self.max_val]), self.histogram]), group)
                lo, hi, merged = first[0], first[1], first[2:]
            else:
                base = _rebin(self._reduced_histogram, self._reduced_range[0], self._reduced_range[1], lo, hi)
                mine = _rebin(self.histogram, self.min_val, self.max_val, lo, hi).to(torch.float64)
                merged = (all_reduce_sum(mine - base, group, owner) + base).clamp_min_(0)
            self.histogram.copy_(torch.where(lo <= hi, merged, 0.0))
            self.min_val.copy_(lo)
            self.max_val.copy_(hi)
            self._reduced_histogram.copy_(self.histogram)
            self._reduced_range.copy_(torch.stack([lo, hi]))
        forget(self)
        self._needs_sync = False

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` (0-d float32 / int64) of the clipping range ``search`` picks.

        Under ``torch.distributed`` first merges the ranks' histograms (a collective: call it on every
        rank, or ``sync_observers(model)`` on every rank beforehand).
        """
        if self.min_val.is_meta:
            refuse_meta(self)
        pending_sync(self)  # over the group it was last reduced over (WORLD if none)
        lo, hi = self.min_val.item(), self.max_val.item()
        if not lo <= hi:
            raise RuntimeError(f"{type(self).__name__} has not observed any finite data; run calibration "
                               "batches before calculate_qparams()")
        skipped = int(self.nonfinite_count)
        if skipped:
            warnings.warn(f"{type(self).__name__}: ignored {skipped} NaN/Inf values in the observed data",
                          stacklevel=2)
            self.nonfinite_count.zero_()
        # the search runs on small (B,) tensors: on the host, whatever device holds the histogram
        if self.search == "quantile":
            cmin, cmax = _quantile_clip_range(self.histogram, lo, hi, self.qdtype)
        else:
            cmin, cmax = _search_clip_range(self.histogram.cpu(), lo, hi, self.qscheme, self.qdtype, self.eps)
        dev = self.min_val.device
        big = torch.finfo(torch.float32).max  # a grid end just past ±3.4e38 (double) must not become ±inf
        cmin, cmax = max(cmin, -big), min(cmax, big)
        return calculate_qparams(torch.tensor(cmin, device=dev), torch.tensor(cmax, device=dev),
                                 self.qscheme, self.qdtype, self.eps)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self.bins = self.histogram.numel()  # the checkpoint's histogram defines the bin count
        # loaded statistics count as already reduced across ranks
        self._reduced_histogram = self.histogram.detach().clone()
        self._reduced_range = torch.stack([self.min_val, self.max_val]).detach().clone()
        forget(self)
        self._needs_sync = False

    def extra_repr(self) -> str:
        return (f"bins={self.bins}, search={self.search!r}, {super().extra_repr()}, "
                f"min_val={self.min_val.item():.6g}, max_val={self.max_val.item():.6g}")
