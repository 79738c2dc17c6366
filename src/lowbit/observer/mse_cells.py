"""The squared error of a grid on a per-channel histogram, per code cell, with a proven bound (``MSEObserver``).

``MSEObserver._grid_errors`` scores a grid ``(s, z)`` on ``P = N + 2`` points: ``N = B · sub`` evenly spaced points
``x_i = lo + (hi - lo)(i + 0.5) / N`` (weight ``n_i / sub``, ``n_i`` the count of the point's bin, less one unit on
each end bin) and the two ends ``lo``, ``hi``. Where the counts are integers, the sum over the ``N`` points is, in
index units (``Δ = (hi - lo) / N``, ``σ = s / Δ``, code ``q``'s center at index ``μ_q = m0 + q σ``,
``m0 = (-z s - lo) / Δ - 0.5``)::

    Σ_i n_i (i - m0 - q_i σ)² = Y2 - 2 σ K1 + σ² J00,   Y2 = Σ n (i - m0)²,  K1 = Σ n q_i (i - m0),  J00 = Σ n q_i²

and with the cell bounds ``β_q = ceil(μ_q + σ / 2)`` (the first point of code ``q + 1``) and the prefix sums
``P0[j] = Σ_{i<j} n_i``, ``P1[j] = Σ_{i<j} n_i i``, summing by parts::

    Σ n q_i = qmax P0[N] - Σ_q P0[β_q],   Σ n q_i i = qmax P1[N] - Σ_q P1[β_q],   J00 = qmax² P0[N] - Σ_q (2q + 1) P0[β_q]

so a candidate costs one gather per code, not one term per point (a dense qint8 row: 255 codes for 2,050 points).
Every sum of counts is an integer below ``2^52`` (checked), so exact in float64 in any order; only the last few
products with ``m0`` and ``σ`` round. ``cell_bounds`` returns that approximation ``A`` of ``E`` (the float error
``_grid_errors`` returns) with ``B`` such that ``|E - A| <= B``: the rounding of the final products
(``16 u Σ|terms|``), points and cell centers off by at most ``η = 40 u (|x|max + |code|max + s)`` (as placed by float
arithmetic in either computation; a point that many ulps from a cell boundary may take the next code, costing at
most ``2 η s``), the float terms' own rounding (``2 u |x̂| |d| + 12 u d²`` each) and their summation in any order
(``(P - 1) u E``). Rows where the counts are not integers, a range or grid is not finite, a zero point is not an
integer, or the magnitudes leave that regime are marked not ``ok``: the caller scores them point by point.

>>> import torch, lowbit as Q
>>> from lowbit.observer.mse_cells import cell_bounds
>>> obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint4, ch_axis=0, bins=8)
>>> hist = torch.tensor([[3.0, 0, 1, 5, 7, 0, 0, 2]], dtype=torch.float64)     # counts of 8 bins over [-1, 1]
>>> lo, hi = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
>>> s, z = torch.tensor([[0.13, 0.1, 0.05]], dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64)
>>> a, b, ok = cell_bounds(hist, lo, hi, 2, s, z, -8, 7)
>>> e = obs._grid_errors(*obs._points(hist, lo, hi, 2), s, z)                   # point by point
>>> bool(ok[0]), bool(((e - a).abs() <= b).all()), bool((b < 1e-9 * e).all())
(True, True, True)
"""

from __future__ import annotations

import torch

__all__ = ["cell_bounds"]

_U = 2.0**-53
_CHUNK = 1 << 17  # cell bounds (rows x candidates x codes) per block
_BITS_2_52 = 0x4330000000000000  # 2.0**52's bits: (x + 2^52).view(int64) - this = round(x), 0 <= x < 2^51


def cell_bounds(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sub: int, s: torch.Tensor, z: torch.Tensor,
                qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, B, ok)``: ``(C, K)`` approximations and bounds, ``|E - A| <= B`` in the rows where ``ok`` (``(C,)``).

    ``hist`` ``(C, nb)`` float64 counts over ``[lo, hi]`` ``(C,)``, ``sub`` points per bin, grids ``s``, ``z``
    ``(C, K)`` float64 on the codes ``qmin..qmax``; ``E`` is ``MSEObserver._grid_errors`` on ``_points``.
    """
    c, nb = hist.shape
    k, n = s.shape[1], nb * sub
    dt, dev = hist.dtype, hist.device
    lo, hi = lo.unsqueeze(1), hi.unsqueeze(1)                                              # (C, 1)
    ok = ((torch.isfinite(hist) & (hist >= 0) & (hist == hist.round())).all(1) & torch.isfinite(lo).squeeze(1)
          & torch.isfinite(hi).squeeze(1) & (hi > lo).squeeze(1)
          & (torch.isfinite(s) & (s > 0) & torch.isfinite(z) & (z == z.round())).all(1))
    okc = ok.unsqueeze(1)
    hist = torch.where(okc, hist, 0.0)
    lo, hi = torch.where(okc, lo, 0.0), torch.where(okc, hi, 1.0)
    s, z = torch.where(okc, s, 1.0), torch.where(okc, z, 0.0)
    e_lo, e_hi = hist[:, :1].clamp(max=1.0), hist[:, -1:].clamp(max=1.0)                  # one unit on each end
    per_bin = hist.clone()
    per_bin[:, :1] -= e_lo
    per_bin[:, -1:] -= e_hi
    # prefix sums by bins (n_i is constant over a bin's sub points): P0, P1 at the bin starts, totals T0, T1, T2
    r, b_idx = torch.arange(sub, dtype=dt, device=dev), torch.arange(nb, dtype=dt, device=dev)
    zero = torch.zeros(c, 1, dtype=dt, device=dev)
    first = sub * b_idx                                                                    # a bin's first point
    in1 = sub * first + sub * (sub - 1) // 2                                               # Σ i over a bin
    in2 = sub * first * first + first * (sub * (sub - 1)) + (sub - 1) * sub * (2 * sub - 1) // 6  # Σ i²
    pb0 = torch.cat([zero, (per_bin * sub).cumsum(1)], 1)                                  # (C, nb + 1)
    pb1 = torch.cat([zero, (per_bin * in1).cumsum(1)], 1)
    t0, t1, t2 = pb0[:, -1:], pb1[:, -1:], (per_bin * in2).sum(1, keepdim=True)            # (C, 1)
    delta = (hi - lo) / n
    sig = s / delta                                                                         # (C, K)
    m0 = (-z * s - lo) / delta - 0.5
    o = m0.round()
    qabs, cells = float(max(-qmin, qmax)), qmax - qmin
    big = t0 * (2 * (n + o.abs()) ** 2 + (qabs + cells) * (n + o.abs()) + qabs**2 + cells * (2 * qabs + 1))
    ok &= (torch.isfinite(sig) & (sig < 2.0**40) & (m0.abs() < 2.0**40) & (big < 2.0**52)).all(1)
    okc = ok.unsqueeze(1)
    sig, m0, o = torch.where(okc, sig, 1.0), torch.where(okc, m0, 0.0), torch.where(okc, o, 0.0)

    # Σ_q P0[β_q], Σ_q (2q + 1) P0[β_q], Σ_q P1[β_q] over the cells' upper bounds q = qmin .. qmax - 1
    qs = torch.arange(qmin, qmax, dtype=dt, device=dev)                                    # (V - 1,)
    wq = 2 * qs + 1
    base = m0 + 0.5 * sig + 0.5  # β_q = ceil(μ_q + σ/2) as round(μ_q + σ/2 + 0.5): another at a tie (equal error)
    s0, s0w, s1 = (torch.empty(c, k, dtype=dt, device=dev) for _ in range(3))
    rc = max(1, min(_CHUNK // max(1, k * cells), _CHUNK // (n + 1)))  # rows per block
    rise = r * first.unsqueeze(1) + r * (r - 1) / 2                                        # Σ_{t<r} (first + t)
    bounds = torch.empty(min(rc, c), k, cells, dtype=dt, device=dev)                      # reused blocks
    picked = torch.empty(min(rc, c), k * cells, dtype=dt, device=dev)
    p0, p1 = (torch.empty(min(rc, c), n + 1, dtype=dt, device=dev) for _ in range(2))
    for g in range(0, c, rc):
        rows = slice(g, g + rc)
        nr, pb = per_bin[rows].shape[0], per_bin[rows].unsqueeze(2)
        t0p, t1p = p0[:nr], p1[:nr]                                                       # P0, P1 (rc, N + 1)
        torch.mul(pb, r, out=t0p[:, :n].view(nr, nb, sub)).add_(pb0[rows, :-1].unsqueeze(2))
        torch.mul(pb, rise, out=t1p[:, :n].view(nr, nb, sub)).add_(pb1[rows, :-1].unsqueeze(2))
        t0p[:, n:], t1p[:, n:] = t0[rows], t1[rows]
        b = torch.mul(sig[rows].unsqueeze(2), qs, out=bounds[:nr]).add_(base[rows].unsqueeze(2))
        ib = b.clamp_(0, n).add_(2.0**52).view(torch.int64).sub_(_BITS_2_52).view(nr, -1)  # β, rounded, int64
        g0 = torch.gather(t0p, 1, ib, out=picked[:nr]).view(-1, cells)                    # exact: integer sums
        s0[rows], s0w[rows] = g0.sum(1).view(-1, k), torch.mv(g0, wq).view(-1, k)
        s1[rows] = torch.gather(t1p, 1, ib, out=picked[:nr]).view(-1, cells).sum(1).view(-1, k)

    j0, j1, j00 = qmax * t0 - s0, qmax * t1 - s1, qmax * qmax * t0 - s0w                   # Σ n q, Σ n q i, Σ n q²
    q1, q2 = t1 - o * t0, t2 - 2 * o * t1 + o * o * t0                                     # about o (exact)
    j1o = j1 - o * j0
    g = m0 - o
    e_idx = (q2 - 2 * g * q1 + g * g * t0) - 2 * sig * (j1o - g * j0) + sig * sig * j00
    terms = q2 + 2 * g.abs() * q1.abs() + g * g * t0 + 2 * sig * (j1o.abs() + g.abs() * j0.abs()) + sig * sig * j00
    d2 = delta * delta / sub

    def end(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # the float terms of the two ends, as _grid_errors
        return torch.div(x, s).round_().add_(z).clamp_(qmin, qmax).sub_(z).mul_(s).sub_(x).pow_(2).mul_(w)

    a = d2 * e_idx + end(lo, e_lo) + end(hi, e_hi)
    xmax = torch.maximum(lo.abs(), hi.abs())
    ymax = torch.maximum((qmin - z).abs(), (qmax - z).abs()) * s
    eta = 40 * _U * (xmax + ymax + s)
    w = hist.sum(1, keepdim=True)
    alpha = 16 * _U * terms * d2 + 4 * _U * a.abs() + w * (eta * eta + 2 * eta * s)
    beta = (2 * eta + 2.2 * _U * ymax) * w.sqrt()
    gamma = (n + 40) * _U * 1.02
    e_hi = 2.1 * (a.abs() + alpha) + 2.1 * beta * beta                                     # >= E
    bound = (alpha + beta * e_hi.sqrt() + gamma * e_hi).clamp_min(1e-290)
    ok &= (torch.isfinite(a) & torch.isfinite(bound) & (eta <= 1e-6 * s) & (s > 1e-150) & (s < 1e150)
           & (d2 > 1e-290) & (xmax < 1e150)).all(1)
    return a, bound, ok
