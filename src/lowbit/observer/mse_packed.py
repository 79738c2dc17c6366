"""MSEObserver's per-channel scoring on packed points: the bins that hold mass, summed in any order (session 43).

A weight channel's histogram is mostly empty (a depthwise 3x3 channel: 9 values in 256 bins; a 1x1 conv over 96
inputs: ~30 % of the bins), and a point of an empty bin adds a term ``+0`` to a candidate's error. ``packed_points``
keeps the points of the given bins (the same bits as the full rows); ``approx_errors`` computes each term's
``d = (clamp(round(x / s) + z, qmin, qmax) - z) · s - x`` by the same operations as the exact score, and sums
``Σ w · d²`` by a batched matrix product; ``bounded_errors`` scores a quarter, then half, then all of the points
only for the candidates that may still be least. Every sum here is a float sum of numbers ``>= 0`` close to the
exact terms, so within ``(P + 2) u`` (``< 4e-12`` for ``P < 16384``) of the exact sum: sub-sums bound a candidate
from below, complete sums bound it within that from either side.

>>> import torch
>>> pts = torch.tensor([[0.1, 0.52, 0.0, 1.0]], dtype=torch.float64)
>>> wts = torch.tensor([[1.0, 2.0, 1.0, 1.0]], dtype=torch.float64)
>>> s, z = torch.tensor([[0.25, 0.5]], dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
>>> e = approx_errors(pts, wts, s, z, -128, 127)       # 0.1 -> 0.0 / 0.0; 0.52 -> 0.5 / 0.5
>>> [round(v, 6) for v in e[0].tolist()]
[0.0108, 0.0108]
"""

from __future__ import annotations

import torch

_BLOCK = 1 << 15  # float64 elements per block (256 KiB: within a core's L2)
_MARGIN = 1e-9  # relative: a sub-sum above the reference's complete sum by this much is a larger error


def packed_points(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sub: int,
                  bins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, n · sub + 2)`` points and weights of the bins ``bins`` (``(C, n)``) and the two ends: the same values,
    bit for bit, as those columns of the full rows (``MSEObserver._points``: point ``i = bin · sub + j`` at
    ``lo + (hi - lo) · (i + 1/2) / (B · sub)``, weight ``hist[bin] / sub``, less ``min(hist, 1) / sub`` in the end
    bins, whose unit stands on ``lo`` / ``hi``)."""
    c, nb = hist.shape
    frac = (torch.arange(nb * sub, dtype=hist.dtype, device=hist.device) + 0.5) / (nb * sub)
    idx = (bins.unsqueeze(2) * sub + torch.arange(sub, device=hist.device)).reshape(c, -1)  # (C, n · sub)
    e_lo, e_hi = hist[:, :1].clamp(max=1.0), hist[:, -1:].clamp(max=1.0)                 # (C, 1)
    per_bin = hist / sub
    per_bin[:, :1] -= e_lo / sub
    per_bin[:, -1:] -= e_hi / sub
    pts = torch.empty(c, idx.shape[1] + 2, dtype=hist.dtype, device=hist.device)
    wts = torch.empty_like(pts)
    torch.add(lo.unsqueeze(1), (hi - lo).unsqueeze(1) * frac[idx], out=pts[:, :-2])
    torch.gather(per_bin, 1, bins.repeat_interleave(sub, dim=1), out=wts[:, :-2])
    pts[:, -2], pts[:, -1], wts[:, -2:-1], wts[:, -1:] = lo, hi, e_lo, e_hi
    return pts, wts


def approx_errors(pts: torch.Tensor, wts: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int,
                  qmax: int) -> torch.Tensor:
    """``(C, K)`` ``Σ_p wts · d²`` of the grids ``(s, z)`` (``(C, K)``): ``d`` bit for bit the exact score's, ``d²``
    weighted and summed by ``bmm`` (within ``(P + 1) u`` of the exact sum of the exact score's terms)."""
    c, p = pts.shape
    k = s.shape[1]
    out = torch.empty(c, k, dtype=pts.dtype, device=pts.device)
    kc = min(k, max(1, _BLOCK // max(p, 1)))
    rc = min(c, max(1, _BLOCK // (kc * max(p, 1))))
    buf = torch.empty(rc, kc, p, dtype=pts.dtype, device=pts.device)
    zero = bool((z == 0).all())  # symmetric grids: + 0 and - 0 change no bit of d²
    for r in range(0, c, rc):
        x = pts[r:r + rc].unsqueeze(1)                                                    # (rc, 1, P)
        w = wts[r:r + rc].unsqueeze(2)                                                    # (rc, P, 1)
        for j in range(0, k, kc):
            ss, zz = s[r:r + rc, j:j + kc].unsqueeze(2), z[r:r + rc, j:j + kc].unsqueeze(2)  # (rc, kc, 1)
            t = buf[:ss.shape[0], :ss.shape[1]]
            torch.div(x, ss, out=t)
            if zero:
                t.round_().clamp_(qmin, qmax).mul_(ss).sub_(x).pow_(2)
            else:
                t.round_().add_(zz).clamp_(qmin, qmax).sub_(zz).mul_(ss).sub_(x).pow_(2)
            out[r:r + rc, j:j + kc] = torch.bmm(t, w).squeeze(2)
    return out


def _alive_sums(pts: torch.Tensor, wts: torch.Tensor, s: torch.Tensor, z: torch.Tensor, alive: torch.Tensor,
                qmin: int, qmax: int) -> torch.Tensor:
    """``approx_errors`` where ``alive`` (``(C, K)``), 0 elsewhere; rows of like survivor counts share a block."""
    c, k = s.shape
    counts = alive.sum(1)
    if int(counts.min()) == k:
        return approx_errors(pts, wts, s, z, qmin, qmax)
    out = torch.zeros_like(s)
    rows_by_count = torch.argsort(counts)
    for g in range(0, c, 64):
        rows = rows_by_count[g:g + 64]
        n = int(counts[rows].max())
        if n == 0:
            continue
        cols = torch.argsort((~alive[rows]).to(torch.int8), dim=1, stable=True)[:, :n]  # the alive first
        errs = approx_errors(pts[rows], wts[rows], s[rows].gather(1, cols), z[rows].gather(1, cols), qmin, qmax)
        out[rows] = torch.zeros_like(s[rows]).scatter_(1, cols, torch.where(alive[rows].gather(1, cols), errs, 0.0))
    return out


def bounded_errors(pts: torch.Tensor, wts: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int,
                   qmax: int) -> torch.Tensor:
    """``(C, K)``: ``approx_errors`` (complete sums) for the candidates that may be a row's least, ``+inf`` for the
    ones that provably are not.

    The points are scored in four slices (every 8th; the 4th of each 8; the 2nd and 6th; the odd ones): after the
    first, the candidate of least sub-sum is scored whole (``e0``), and after each slice a candidate whose running
    sub-sum exceeds ``e0`` by ``1e-9`` relative is dropped (its exact error is larger). Rows with a non-finite
    sum or ``e0 <= 1e-280`` keep every candidate.
    """
    c, p = pts.shape
    k = s.shape[1]
    if k < 4 or p < 64:
        return approx_errors(pts, wts, s, z, qmin, qmax)
    dev = pts.device
    order = torch.cat([torch.arange(o, p, st, device=dev) for o, st in ((0, 8), (4, 8), (2, 4), (1, 2))])
    edges = [0, -(-p // 8), -(-p // 8) + len(range(4, p, 8)), -(-p // 2), p]
    pts, wts = pts[:, order], wts[:, order]
    total = approx_errors(pts[:, :edges[1]], wts[:, :edges[1]], s, z, qmin, qmax)
    k0 = total.argmin(1, keepdim=True)
    e0 = approx_errors(pts, wts, s.gather(1, k0), z.gather(1, k0), qmin, qmax)         # (C, 1)
    unsure = ~(torch.isfinite(total).all(1, keepdim=True) & torch.isfinite(e0) & (e0 > 1e-280))
    alive = ~(total * (1 - _MARGIN) > e0) | unsure
    for a, b in zip(edges[1:-1], edges[2:]):
        total += _alive_sums(pts[:, a:b], wts[:, a:b], s, z, alive, qmin, qmax)
        alive &= ~(total * (1 - _MARGIN) > e0) | unsure
    return torch.where(alive, total, float("inf"))
