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

Counting: on CPU, one ``aminmax`` read on the host, then integer bin indices and ``scatter_add_``
(several times faster than ``torch.histc``). On accelerators (or with ``sync_free = True``) nothing
is read on the host per batch: min/max stay tensors, the rebinning always runs (an identity when
the range did not move), and NaN/Inf get weight 0 in the ``scatter_add_`` (counted; a warning comes
at ``calculate_qparams``). Under ``torch.distributed``, ``calculate_qparams`` (or
``sync_observers``) first merges the ranks' histograms onto their common range and sums them
(``sync_statistics``), so every rank gets the qparams of the union of the data.

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

from ..qparams import calculate_qparams
from ..qscheme import QDtype, QScheme
from .base import ObserverBase, finite_aminmax
from .distributed import all_reduce_min_max, all_reduce_sum, is_distributed

__all__ = ["HistogramObserver"]

# Bin index = floor((x - min) * bins * _SHRINK / (max - min)): the shrink keeps x = max in the last bin
# through float32 rounding without a clamp pass (it narrows the last bin by bins * 2**-20 bin widths).
_SHRINK = 1 - 2.0**-20


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


def _tail_table(n: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(B+1,)`` columns ``F, Φ, Ψ, n`` at bin edges (bin units, uniform mass in each bin).

    ``F(c)`` = mass below ``c``, ``Φ(c) = ∫_{x<c} (c - x) p``, ``Ψ(c) = ∫_{x<c} (c - x)² p``; between
    edges ``j`` and ``j+1`` (``f = c - j``) they are ``F_j + n_j f``, ``Φ_j + F_j f + n_j f²/2`` and
    ``Ψ_j + 2Φ_j f + F_j f² + n_j f³/3``. Row ``B`` is an empty bin that extends them beyond the data.
    """
    zero = n.new_zeros(1)
    cdf = torch.cat([zero, n.cumsum(0)])
    phi = torch.cat([zero, (cdf[:-1] + n / 2).cumsum(0)])
    psi = torch.cat([zero, (2 * phi[:-1] + cdf[:-1] + n / 3).cumsum(0)])
    return cdf, phi, psi, torch.cat([n, zero])


def _rows(table: tuple[torch.Tensor, ...], c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(f, F_j, Φ_j, Ψ_j, n_j)`` for points ``c`` (any shape) in the edge interval ``j <= c < j+1``.

    (1-D ``index_select`` and an integer cast for the floor: on a busy CPU, 2-D gathers and ``floor``
    start parallel regions that cost milliseconds even on small tensors.)
    """
    j = c.clamp(0, table[0].numel() - 1).to(torch.int64)
    cols = [col.index_select(0, j.flatten()).view(c.shape) for col in table]
    return (c.clamp(min=0).sub_(j), *cols)


def _cdf_and_psi(table: tuple[torch.Tensor, ...], c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f, cdf, phi, psi, n = _rows(table, c)
    return cdf + n * f, psi + f * (2 * phi + f * (cdf + n * f / 3))


class _L2Model:
    """Expected squared quantization error of a histogram, in bin units (bin ``i`` spans ``[i, i+1]``).

    ``z0`` is the position of real 0. ``smooth(s, lo, hi)``: clipping at ``lo``/``hi`` plus ``s²/12``
    per unit of mass inside, except in the bin holding 0 (0 is on every grid; a ReLU spike there
    costs ~nothing), up to a constant; O(1) per candidate. ``exact(s, zp)``: the error of the grid
    ``{(q - zp) s}``, exactly; O(quant_max - quant_min) per candidate.
    """

    def __init__(self, hist: torch.Tensor, z0: float) -> None:
        n = hist.to(torch.float64).clamp_min(0)  # (B,)
        self.b, self.z0 = n.numel(), z0
        self.below, self.above = _tail_table(n), _tail_table(n.flip(0))  # above: mirrored, c -> B - c
        j0 = min(int(z0), self.b - 1) if 0 <= z0 <= self.b else None  # bin holding real 0
        self.smooth_mass = float(n.sum() - (n[j0] if j0 is not None else 0.0))

    def smooth(self, s: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        f_lo, tail_lo = _cdf_and_psi(self.below, lo)
        f_hi, tail_hi = _cdf_and_psi(self.above, self.b - hi)
        return (tail_lo + tail_hi) + (s * s / 12) * ((self.smooth_mass - f_lo) - f_hi)

    def exact(self, s: torch.Tensor, zp: torch.Tensor, qdtype: QDtype) -> torch.Tensor:
        """With ``top`` the highest grid point and ``β`` the cell edges (midpoints between grid points),
        ``Σ_cells ∫ (x - x_q)² p = ∫ (x - top)² p - 2 s Σ_β Φ(β)``."""
        m = torch.arange(qdtype.quant_min, qdtype.quant_max, dtype=s.dtype, device=s.device) + 0.5  # (Q,)
        beta = torch.addcmul((self.z0 - zp * s)[:, None], m[None, :], s[:, None])  # (K, Q)
        f, cdf, phi, _, n = _rows(self.below, beta)
        sum_phi = torch.addcmul(phi, f, torch.addcmul(cdf, f, n, value=0.5)).sum(1)  # Σ_β Φ(β)
        top = self.z0 + (qdtype.quant_max - zp) * s  # (K,)
        return _cdf_and_psi(self.below, top)[1] + _cdf_and_psi(self.above, self.b - top)[1] - 2 * s * sum_phi


_EXACT_MAX_STEPS = 4096  # exact refinement costs O(quant_max - quant_min) per candidate: up to 12-bit grids


def _search_clip_range(hist: torch.Tensor, lo: float, hi: float, qscheme: QScheme, qdtype: QDtype,
                       eps: float) -> tuple[float, float]:
    """The ``(cmin, cmax)`` whose ``calculate_qparams`` grid minimises the expected L2 error.

    Stage 1 (O(1) per candidate): the smooth model, clip points on a coarse-to-fine grid.
    Stage 2 (O(steps) per candidate): the exact model around it, scale ±3 % then ±0.5 %, zero point ±2.
    """
    b = hist.numel()
    if not hi > lo or not float(hist.sum()) > 0:
        return lo, hi
    w = (hi - lo) / b
    z0 = -lo / w  # real 0 in bin units
    model = _L2Model(hist, z0)
    qmin, qmax = qdtype.quant_min, qdtype.quant_max
    steps, s_min = float(qmax - qmin), eps / w
    f64 = dict(dtype=torch.float64, device=hist.device)
    mid = 0 if qdtype.signed else (qmin + qmax + 1) // 2

    def axis(a: float, c: float, k: int) -> torch.Tensor:
        return torch.linspace(a, c, k if c > a else 1, **f64)

    def grid(u_lo: float, u_hi: float) -> tuple[float, float]:
        """``(s, zp)`` that ``calculate_qparams`` gives the range ``[u_lo, u_hi]`` (bin units)."""
        u_lo, u_hi = min(u_lo, z0), max(u_hi, z0)
        if qscheme.is_symmetric:
            return max(2 * max(z0 - u_lo, u_hi - z0) / steps, s_min), float(mid)
        s = max((u_hi - u_lo) / steps, s_min)
        return s, float(min(max(qmin - round((u_lo - z0) / s), qmin), qmax))

    if qscheme.is_symmetric:  # one parameter a = max(|cmin|, |cmax|): B candidates, then 2 x 65 finer
        a_max = max(abs(z0), abs(b - z0))
        cand, step, best, best_e = axis(a_max / b, a_max, b), a_max / b, a_max, float("inf")
        for _ in range(3):
            s = torch.clamp(2 * cand / steps, min=s_min)
            e = model.smooth(s, z0 + (qmin - mid) * s, z0 + (qmax - mid) * s)
            k = int(e.argmin())
            if float(e[k]) < best_e:
                best, best_e = float(cand[k]), float(e[k])
            cand, step = axis(max(best - 2 * step, step / 64), min(best + 2 * step, a_max), 65), step / 16
        s0, zp0 = grid(z0 - best, z0 + best)
    else:  # (cmin, cmax) on a 65 x 65 grid, then 2 windows of ±2 steps, 33 x 33, 8x finer each
        zc = min(max(z0, 0.0), float(b))  # cmin in [0, zc], cmax in [zc, B]: zero is included
        d_lo, d_hi = zc / 64, (b - zc) / 64
        u_lo, u_hi = axis(0.0, zc, 65), axis(zc, float(b), 65)
        pair, best_e = (0.0, float(b)), float("inf")
        for _ in range(3):
            lo_, hi_ = u_lo.clamp(max=z0)[:, None], u_hi.clamp(min=z0)[None, :]  # (K, 1), (1, K)
            e = model.smooth(torch.clamp((hi_ - lo_) / steps, min=s_min), lo_, hi_)  # (K, K)
            i, j = divmod(int(e.argmin()), e.shape[1])
            if float(e[i, j]) < best_e:
                pair, best_e = (float(u_lo[i]), float(u_hi[j])), float(e[i, j])
            u_lo = axis(max(pair[0] - 2 * d_lo, 0.0), min(pair[0] + 2 * d_lo, zc), 33)
            u_hi = axis(max(pair[1] - 2 * d_hi, zc), min(pair[1] + 2 * d_hi, float(b)), 33)
            d_lo, d_hi = d_lo / 8, d_hi / 8
        s0, zp0 = grid(*pair)

    if steps <= _EXACT_MAX_STEPS:  # stage 2 (the smooth stage ignored the zero point's rounding)
        s_mm, zp_mm = grid(0.0, float(b))  # min/max's grid is a candidate: never worse than it (model)
        for rel, n_s, d_zp in ((0.03, 13, 2), (0.005, 21, 1)):
            s_c = torch.clamp(s0 * (1 + torch.linspace(-rel, rel, n_s, **f64)), min=s_min)  # (n_s,)
            zp_c = torch.arange(zp0 - d_zp, zp0 + d_zp + 1, **f64) if not qscheme.is_symmetric else \
                torch.tensor([zp0], **f64)
            zp_c = zp_c[(zp_c >= qmin) & (zp_c <= qmax)]
            s_g = torch.cat([s_c.repeat(zp_c.numel()), torch.tensor([s_mm], **f64)])
            zp_g = torch.cat([zp_c.repeat_interleave(s_c.numel()), torch.tensor([zp_mm], **f64)])
            k = int(model.exact(s_g, zp_g, qdtype).argmin())
            s0, zp0 = float(s_g[k]), float(zp_g[k])
    s_real = s0 * w
    if qscheme.is_symmetric:  # calculate_qparams: scale = max(|cmin|, |cmax|) / (steps / 2)
        return -s_real * steps / 2, s_real * steps / 2
    return (qmin - zp0) * s_real, (qmax - zp0) * s_real


class HistogramObserver(ObserverBase):
    """Running histogram of the observed values; qparams from the L2-optimal clipping range.

    Args:
        bins: number of equal-width bins over the running ``[min_val, max_val]`` (int ≥ 2).
        qscheme: ``per_tensor_affine`` (default) or ``per_tensor_symmetric``.
        qdtype: the target grid (default ``quint8``).
        eps: floor of the scale.

    Buffers: ``min_val``, ``max_val`` (0-d, ±inf before any data) and ``histogram`` ``(bins,)``
    float32 counts. Attribute ``sync_free`` (``None``: chosen by device) forces the accelerator code
    path, which never reads a value on the host in ``forward``.
    """

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        bins: int = 2048,
        qscheme: QScheme | str = QScheme.PER_TENSOR_AFFINE,
        qdtype: QDtype | str = "quint8",
        eps: float = 1e-8,
    ) -> None:
        super().__init__(qscheme, qdtype, None, eps)
        if isinstance(bins, bool) or not isinstance(bins, int):
            raise TypeError(f"HistogramObserver: bins={bins!r} must be an int >= 2")
        if bins < 2:
            raise ValueError(f"HistogramObserver: bins={bins!r} must be an int >= 2")
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
    def is_calibrated(self) -> bool:
        return bool(self.min_val <= self.max_val)

    def reset_min_max_vals(self) -> None:
        """Forget everything observed (range and histogram)."""
        for buf, value in ((self.min_val, float("inf")), (self.max_val, float("-inf")), (self.histogram, 0),
                           (self.nonfinite_count, 0), (self._reduced_histogram, 0)):
            buf.fill_(value)
        self._reduced_range.copy_(torch.tensor([float("inf"), float("-inf")]))
        self._needs_sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fold ``x`` into the histogram (widening the range if needed) and return ``x`` unchanged."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"HistogramObserver observes tensors, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"HistogramObserver observes floating-point tensors, got dtype {x.dtype}")
        if x.numel() == 0:
            return x
        if x.device != self.histogram.device:  # the statistics follow the data (first batch, or a moved model)
            self.to(x.device)
        sync_free = self.sync_free if self.sync_free is not None else x.device.type != "cpu"
        xs = x.detach().reshape(-1).to(torch.float32)
        (self._observe_sync_free if sync_free else self._observe_host)(xs)
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
        k = self.bins * _SHRINK / (new_hi - new_lo) if new_hi > new_lo else 0.0
        idx = (x - new_lo).mul_(k).to(torch.int64)  # floor, in [0, bins - 1] (x >= new_lo, _SHRINK)
        self.histogram.scatter_add_(0, idx, self.histogram.new_ones(1).expand_as(x))

    def _observe_sync_free(self, x: torch.Tensor) -> None:
        """Accelerators: tensor min/max, ``scatter_add_`` of weights 1 (finite) / 0 (NaN, Inf)."""
        finite = torch.isfinite(x)
        mn = torch.where(finite, x, float("inf")).amin()
        mx = torch.where(finite, x, float("-inf")).amax()
        self.nonfinite_count += x.numel() - finite.sum()
        new_lo, new_hi = torch.minimum(self.min_val, mn), torch.maximum(self.max_val, mx)
        self._set_range(new_lo, new_hi)
        width = new_hi - new_lo
        k = torch.where(width > 0, self.bins * _SHRINK / width, 0.0)
        pos = ((x - torch.where(torch.isfinite(new_lo), new_lo, 0.0)) * k).clamp_(0, self.bins - 1)
        idx = torch.where(finite, pos, 0.0).to(torch.int64)
        self.histogram.scatter_add_(0, idx, finite.to(self.histogram.dtype))

    def _set_range(self, new_lo: torch.Tensor, new_hi: torch.Tensor) -> None:
        """Widen the range to ``[new_lo, new_hi]``, rebinning the histogram onto it (tensor ops only)."""
        self.histogram.copy_(_rebin(self.histogram, self.min_val, self.max_val, new_lo, new_hi))
        self.min_val.copy_(new_lo)
        self.max_val.copy_(new_hi)

    def sync_statistics(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        """Merge the histograms of all ranks (a collective; no-op on a single process).

        The common range is the MIN/MAX of the ranks' ranges; each rank rebins onto it and the
        histograms are summed, so every rank then holds the statistics of the union of the data.
        What was already reduced last time is counted once, not once per rank.
        """
        if is_distributed(group):
            owner = type(self).__name__
            lo, hi = all_reduce_min_max(self.min_val, self.max_val, group, owner)
            base = _rebin(self._reduced_histogram, self._reduced_range[0], self._reduced_range[1], lo, hi)
            mine = _rebin(self.histogram, self.min_val, self.max_val, lo, hi).to(torch.float64)
            merged = (all_reduce_sum(mine - base, group) + base).clamp_min_(0)
            self.histogram.copy_(torch.where(lo <= hi, merged, 0.0))
            self.min_val.copy_(lo)
            self.max_val.copy_(hi)
            self._reduced_histogram.copy_(self.histogram)
            self._reduced_range.copy_(torch.stack([lo, hi]))
        self._needs_sync = False

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` (0-d float32 / int64) of the L2-optimal clipping range.

        Under ``torch.distributed`` first merges the ranks' histograms (a collective: call it on every
        rank, or ``sync_observers(model)`` on every rank beforehand).
        """
        if self._needs_sync and is_distributed():
            self.sync_statistics()
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
        cmin, cmax = _search_clip_range(self.histogram.cpu(), lo, hi, self.qscheme, self.qdtype, self.eps)
        dev = self.min_val.device
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
        self._needs_sync = False

    def extra_repr(self) -> str:
        return (f"bins={self.bins}, {super().extra_repr()}, "
                f"min_val={self.min_val.item():.6g}, max_val={self.max_val.item():.6g}")
