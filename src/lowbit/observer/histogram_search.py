"""The clipping-range searches behind ``HistogramObserver.calculate_qparams``.

``_search_clip_range`` (``search="l2"``) minimises the expected squared quantization error of the
histogram under ``_L2Model`` (mass spread uniformly within each bin): a coarse-to-fine scan with the
O(1) smooth model, refined with the exact one. ``_quantile_clip_range`` (``search="quantile"``) is
lucid's six-candidate scan of quantile pairs of bin centres, scored with lucid's own error model.

>>> import torch, lowbit as Q
>>> h = torch.tensor([0.0, 10.0, 10.0, 0.0])
>>> lo, hi = _search_clip_range(h, 0.0, 4.0, Q.per_tensor_affine, Q.quint8, 1e-8)
>>> 0.0 <= lo < hi <= 4.0
True
"""

from __future__ import annotations

import torch

from ..qparams import symmetric_zero_point
from ..qscheme import QDtype, QScheme


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
    mid = symmetric_zero_point(qdtype, "HistogramObserver") if qscheme.is_symmetric else 0

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


_QUANTILE_FRACS = (0.0, 1e-5, 1e-4, 1e-3, 5e-3, 1e-2)  # lucid's candidate tail fractions


def _quantile_clip_range(hist: torch.Tensor, lo: float, hi: float, qdtype: QDtype) -> tuple[float, float]:
    """Lucid's ``HistogramObserver`` search: the best of six quantile clip ranges, in bin centres.

    With counts ``n_i``, centres ``c_i = lo + (i + 1/2) w`` and ``N = Σ n_i``, each ``frac`` gives
    ``cmin`` / ``cmax`` = the first centre whose cumulative count reaches ``frac·N`` / ``(1 - frac)·N``
    (``frac = 0``: ``c_0`` and the last non-empty bin's centre, half a bin inside the raw range);
    pairs with ``cmax <= cmin`` are skipped. Each is scored, ``Δ = (cmax - cmin) / (qmax - qmin)``::

        err = Σ_{n_i > 0} n_i [(c_i - clip(c_i, cmin, cmax))² + Δ²/12]

    and the lowest wins, ties to the first; ``(lo, hi)`` if nothing qualifies or the histogram is empty.

    >>> h = torch.tensor([1.0, 0.0, 0.0, 1.0])                  # bins of width 1 over [0, 4]
    >>> from lowbit.qscheme import quint8
    >>> _quantile_clip_range(h, 0.0, 4.0, quint8)  # centres 0.5 and 3.5
    (0.5, 3.5)
    """
    n = hist.detach().to("cpu", torch.float64)  # (B,)
    cum = n.cumsum(0)  # (B,): sequential, as lucid's running sum
    if not (float(cum[-1]) > 0 and hi > lo):
        return lo, hi
    b = n.numel()
    centres = lo + (torch.arange(b, dtype=torch.float64) + 0.5) * ((hi - lo) / b)  # (B,)
    fracs = torch.tensor(_QUANTILE_FRACS, dtype=torch.float64)  # (K,)
    cmin, cmax = (centres[torch.searchsorted(cum, t * cum[-1]).clamp_(max=b - 1)]  # first cum >= t·N: (K,)
                  for t in (fracs, 1 - fracs))
    step = (cmax - cmin) / max(qdtype.quant_max - qdtype.quant_min, 1)
    clipped = torch.minimum(torch.maximum(centres[None, :], cmin[:, None]), cmax[:, None])  # (K, B)
    err = (n * ((centres - clipped) ** 2 + (step * step / 12)[:, None])).sum(1)  # empty bins add 0
    err = torch.where(cmax > cmin, err, float("inf"))
    k = int(err.argmin())  # the first minimum
    return (float(cmin[k]), float(cmax[k])) if bool(err[k] < float("inf")) else (lo, hi)
