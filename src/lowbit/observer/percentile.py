"""PercentileObserver: clip the range at a percentile of the observed values.

The values seen so far are kept as a running histogram (``bins`` equal-width bins over the running
range, per tensor or per channel; ``channel_histogram.py``). With ``p = percentile / 100`` and ``F``
the histogram's piecewise-linear CDF (mass spread uniformly in each bin)::

    affine:     cmin = F⁻¹(1 - p),   cmax = F⁻¹(p)                    # both tails clipped
    symmetric:  T = G⁻¹(p) with G the CDF of |x|;  (cmin, cmax) = (max(min, -T), min(max, T))

then ``scale, zero_point = calculate_qparams(cmin, cmax, qscheme, qdtype)``. ``percentile=100``
gives exactly the min/max range (the qparams of ``MinMaxObserver`` / ``PerChannelMinMaxObserver``).

>>> import torch, lowbit as Q
>>> obs = Q.PercentileObserver(percentile=99.0)
>>> _ = obs(torch.cat([torch.linspace(0.0, 1.0, 990), torch.full((10,), 50.0)]))   # 1 % outliers
>>> cmin, cmax = obs.clip_range()
>>> round(cmin.item(), 3), round(cmax.item(), 2)                                     # the outliers are clipped
(0.01, 1.0)
"""

from __future__ import annotations

import torch

from ..qscheme import QDtype, QScheme, per_tensor_affine, quint8
from .channel_histogram import _ClipRangeObserver, magnitude_histogram

__all__ = ["PercentileObserver"]


def _inverse_cdf(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, q: float) -> torch.Tensor:
    """``(C,)`` value below which a fraction ``q`` of each row's mass lies (linear within a bin)."""
    b = hist.shape[1]
    cum = torch.cat([hist.new_zeros(hist.shape[0], 1), hist.cumsum(1)], 1)  # (C, B+1)
    target = (q * cum[:, -1:]).clamp_max(cum[:, -1:])                       # (C, 1)
    j = torch.searchsorted(cum[:, 1:].contiguous(), target).clamp_(max=b - 1)  # first bin reaching the target
    h = hist.gather(1, j)
    frac = torch.where(h > 0, (target - cum.gather(1, j)) / torch.where(h > 0, h, 1.0), 0.0).clamp(0, 1)
    return (lo + (hi - lo) * ((j + frac).squeeze(1) / b))


class PercentileObserver(_ClipRangeObserver):
    """Clipping range at the ``percentile``-th percentile of the observed values (both tails, or ``|x|``).

    Args:
        percentile: in ``(50, 100]``; 100 is the plain min/max range. Default 99.99.
        qscheme: per tensor (default ``per_tensor_affine``) or per channel (then ``ch_axis`` is required).
        qdtype: the target grid (default ``quint8``).
        ch_axis: the channel axis of a per-channel scheme, else ``None``.
        bins: histogram bins (default 2048 per tensor, 256 per channel).
        eps: floor of the scale.

    Buffers ``min_val``/``max_val`` (``()`` or ``(C,)``) and ``histogram`` (``(bins,)`` or ``(C, bins)``).

    >>> import torch, lowbit as Q
    >>> w = torch.tensor([[0.5, -1.0], [2.0, 4.0]])                  # (C=2, 2)
    >>> obs = Q.PercentileObserver(percentile=100.0, qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    >>> ref = Q.PerChannelMinMaxObserver(ch_axis=0)
    >>> _ = obs(w), ref(w)
    >>> torch.equal(obs.calculate_qparams()[0], ref.calculate_qparams()[0])   # 100 % = min/max
    True
    """

    _sync_settings: tuple[str, ...] = ("bins", "percentile")  # compared across ranks (agree_observer)

    def __init__(self, percentile: float = 99.99, qscheme: QScheme | str = per_tensor_affine,
                 qdtype: QDtype | str = quint8, ch_axis: int | None = None, bins: int | None = None,
                 eps: float = 1e-8) -> None:
        super().__init__(qscheme, qdtype, ch_axis, eps, bins)
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 50 < percentile <= 100:
            raise ValueError(f"PercentileObserver: percentile={percentile!r} must be a number in (50, 100]")
        self.percentile = float(percentile)

    def _clip_range(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.percentile / 100
        if p >= 1.0:
            return lo, hi
        if self.qscheme.is_symmetric:
            mag, amax = magnitude_histogram(hist, lo, hi)
            t = _inverse_cdf(mag, torch.zeros_like(amax), amax, p)
            return torch.maximum(lo, -t), torch.minimum(hi, t)
        return _inverse_cdf(hist, lo, hi, 1 - p), _inverse_cdf(hist, lo, hi, p)

    def extra_repr(self) -> str:
        return f"percentile={self.percentile}, {super().extra_repr()}"
