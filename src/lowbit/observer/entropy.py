"""EntropyObserver: the clipping threshold that minimises the KL divergence (TensorRT-style calibration).

The observed values are kept as a running histogram (``channel_histogram.py``); its ``|x|`` histogram
``h`` has ``B`` bins over ``[0, amax]``, and its first bin takes the count of the second,
``h_0 := h_1`` (TensorRT's ``bins[0] = bins[1]``: after a ReLU that bin holds every exact zero, a
spike no grid can spread, which otherwise drives the search to the smallest threshold). With ``L``
the levels the grid spends on one sign (half the grid, ``(qmax - qmin + 1) // 2``, when the data has
both signs; the whole grid when it has one sign), every candidate threshold ``T_i = i · amax / B``
for ``(qmax - qmin + 1) // 2 <= i <= B`` (TensorRT's ``start_bin = 128`` for 8 bits, signed or not)
is scored::

    P_i = h[0:i], with the mass beyond (h[i:]) added to its last bin         # the clipped distribution
    Q_i = h[0:i] merged into L equal groups, each group's mass spread over its non-empty bins
    KL_i = Σ_j p_j log(p_j / q_j)      (P, Q normalised; a last bin that is empty while P holds mass
                                        there makes KL_i infinite: no smoothing)

and ``T = T_i`` of the smallest ``KL_i``, the largest such ``i`` on a tie (TensorRT's last argmin; at most 1024
candidates per tensor, 64 per channel, evenly spaced in ``i``; O(L) each from prefix sums). The clipping
range is ``(max(min, -T), min(max, T))``, mapped through ``calculate_qparams``. Per channel, each
channel gets its own ``T``. ``bins`` must be at least ``L``.

>>> import torch, lowbit as Q
>>> torch.manual_seed(0) and None
>>> obs = Q.EntropyObserver()
>>> _ = obs(torch.cat([torch.randn(20000), torch.tensor([40.0])]))    # a Gaussian and one far outlier
>>> cmin, cmax = obs.clip_range()
>>> bool(3.0 < cmax < 10.0), bool(-10.0 < cmin < -3.0)               # the outlier is not worth the grid
(True, True)
"""

from __future__ import annotations

import torch

from ..qscheme import QDtype, QScheme, per_tensor_affine, quint8
from .channel_histogram import _ClipRangeObserver, magnitude_histogram

__all__ = ["EntropyObserver"]

_MAX_CANDIDATES = 1024


def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x * x.clamp_min(1e-300).log(), 0.0)


def kl_thresholds(mag: torch.Tensor, levels: int, start: int | None = None) -> torch.Tensor:
    """``(C,)`` bin counts ``i`` (threshold after ``i`` bins) minimising KL(P_i || Q_i), per row of ``mag`` (C, B),
    over the candidates ``start <= i <= B`` (default ``start = levels``); ``mag[:, 0]`` is read as ``mag[:, 1]``.

    O(L) per candidate from prefix sums: with ``n`` the mass, ``C_k = Σ_{j<k} h_j``,
    ``H_k = Σ_{j<k} h_j log h_j``, groups ``g = [a_g, a_{g+1})``, ``a_g = ⌈g i / L⌉``, of mass ``S_g``
    and ``m_g`` non-empty bins, and ``P = n - C_{i-1}`` (last bin plus the clipped tail)::

        n · KL_i = H_{i-1} - C_{i-1} log n + P log(P / n) - Σ_g S'_g log(S_g / (m_g C_i)) - P log(q_{i-1})

    where ``S'_g`` leaves bin ``i-1`` out of its group ``l = ⌊(i-1) L / i⌋`` (``L - 1`` when ``i >= L``; a
    candidate below ``L`` bins leaves groups empty) and ``q_{i-1} = S_l / (m_l C_i)``. A
    candidate whose last bin is empty while mass lies beyond it has ``q_{i-1} = 0``: KL is infinite.
    """
    c, b = mag.shape
    h = mag.to(torch.float64, copy=True)
    if b > 1:
        h[:, 0] = h[:, 1]  # TensorRT: the zero bin (a ReLU's exact zeros) counts as its neighbour
    start = levels if start is None else start
    if not 1 <= start <= b:
        raise ValueError(f"kl_thresholds: start={start} must be in [1, {b}] (the histogram's bins)")
    most = _MAX_CANDIDATES if c == 1 else 64  # per channel: fewer candidates, C times over
    step = max(1, -(-(b - start) // (most - 1)))
    cand = torch.arange(start, b + 1, step, device=h.device)
    if int(cand[-1]) != b:
        cand = torch.cat([cand, cand.new_tensor([b])])
    zero = h.new_zeros(c, 1)
    cum = torch.cat([zero, h.cumsum(1)], 1)                                 # (C, B+1)
    hcum = torch.cat([zero, _xlogx(h).cumsum(1)], 1)
    nzcum = torch.cat([zero, (h > 0).to(h.dtype).cumsum(1)], 1)
    g = torch.arange(levels + 1, device=h.device)
    edges = (g.unsqueeze(0) * cand.unsqueeze(1) + levels - 1) // levels    # (K, L+1): a_g = ceil(g i / L)
    last_group = ((cand - 1) * levels) // cand                              # (K,): l = floor((i-1) L / i)
    best = torch.empty(c, dtype=torch.int64, device=h.device)
    k = cand.numel()
    chunk = max(1, (1 << 21) // (k * (levels + 1)))
    for s in range(0, c, chunk):
        cu, hc, nz, hh = cum[s:s + chunk], hcum[s:s + chunk], nzcum[s:s + chunk], h[s:s + chunk]
        rows = cu.shape[0]
        at = edges.reshape(1, -1).expand(rows, -1)
        sums = (cu.gather(1, at).view(rows, k, levels + 1)).diff(dim=2)    # (c', K, L)
        nonempty = (nz.gather(1, at).view(rows, k, levels + 1)).diff(dim=2)
        n = cu[:, -1:]                                                      # (c', 1)
        c_i = cu[:, cand]                                                   # (c', K)
        c_prev, h_prev = cu[:, cand - 1], hh[:, cand - 1]                   # C_{i-1}, h_{i-1}
        tail_p = n - c_prev                                                 # P
        per_bin = sums / (nonempty.clamp_min(1) * c_i.unsqueeze(2).clamp_min(1e-300))  # q of a non-empty bin
        log_q = torch.where(sums > 0, per_bin.clamp_min(1e-300).log(), 0.0)
        at_last = last_group.view(1, k, 1).expand(rows, k, 1)              # the group of bin i-1
        s_prime = sums.scatter_add(2, at_last, -h_prev.unsqueeze(2))
        log_q_last = log_q.gather(2, at_last).squeeze(2)
        cross = (s_prime * log_q).sum(2)
        kl = (hc[:, cand - 1] - c_prev * n.log() + _xlogx(tail_p) - tail_p * n.log() - cross
              - tail_p * log_q_last)
        kl = torch.where((h_prev <= 0) & (tail_p > 0), float("inf"), kl)
        best[s:s + chunk] = cand[k - 1 - kl.flip(1).argmin(1)]  # the last minimum, as TensorRT
    return best


class EntropyObserver(_ClipRangeObserver):
    """Clipping threshold of least KL divergence between the observed and the quantized distribution.

    Args:
        qscheme: per tensor (default ``per_tensor_affine``) or per channel (then ``ch_axis`` is required).
        qdtype: the target grid (default ``quint8``).
        ch_axis: the channel axis of a per-channel scheme, else ``None``.
        bins: histogram bins (default 2048 per tensor, 256 per channel); at least the grid's levels per sign.
        eps: floor of the scale.

    >>> import torch, lowbit as Q
    >>> obs = Q.EntropyObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    >>> _ = obs(torch.linspace(-1.0, 1.0, 4000).repeat(3, 1))   # uniform data: nothing worth clipping
    >>> [round(v, 2) for v in obs.clip_range()[1].tolist()]
    [1.0, 1.0, 1.0]
    """

    def __init__(self, qscheme: QScheme | str = per_tensor_affine, qdtype: QDtype | str = quint8,
                 ch_axis: int | None = None, bins: int | None = None, eps: float = 1e-8) -> None:
        super().__init__(qscheme, qdtype, ch_axis, eps, bins)
        levels = self.quant_max - self.quant_min + 1
        if self.bins < levels // 2:
            raise ValueError(f"EntropyObserver: bins={self.bins} is fewer than the {levels // 2} levels per sign "
                             f"of the {self.qdtype!r} grid")

    def _clip_range(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mag, amax = magnitude_histogram(hist, lo, hi)
        n_levels = self.quant_max - self.quant_min + 1
        two_sided = bool(((lo < 0) & (hi > 0)).any()) or self.qscheme.is_symmetric
        levels = min(n_levels // 2 if two_sided else n_levels, self.bins)
        start = min(max(n_levels // 2, 1), self.bins)
        t = amax * kl_thresholds(mag, levels, start).to(amax.dtype) / self.bins
        return torch.maximum(lo, -t), torch.minimum(hi, t)
