"""MSEObserver: the clipping range whose integer grid gives the least squared error on the observed data.

The observed values are kept as a running histogram (``channel_histogram.py``). A candidate range
``(cmin, cmax) = (a · min, b · max)`` is mapped to its actual grid by ``calculate_qparams`` (zero
included, zero point rounded, scale floored at ``eps``), and scored on the histogram, each bin's
mass standing at ``S`` evenly spaced points inside it (4 per tensor, 2 per channel, raised up to 8 where
that leaves fewer than 8 points per step of the grid), except that one unit of mass stands exactly on
each end of the range (``min`` and ``max`` are observed values, the ones a clipped range moves the
most)::

    err(a, b) = Σ_points  n_point · (x - x̂)²,   x̂ = (clamp(round(x / s) + z, qmin, qmax) - z) · s

Search: symmetric schemes scan ``a = b`` (one ``amax`` per channel); affine per-tensor scans a
24 x 24 grid of ``(a, b)``; affine per-channel scans ``a = b``. The multipliers run from 0.05 to 1,
denser near 1; a second scan refines around the best with 4x finer steps. ``a = b = 1`` (the
min/max range) is always a candidate, so the result is never worse than ``MinMaxObserver`` on the
histogram model.

Evaluation (session 42: the same chosen ranges bit for bit as the one ``(C, K, P)`` expression it replaced,
20-100x faster per tensor): candidates on the same grid ``(s, z)`` are scored once; the terms are computed by the
same operations in cache-sized in-place blocks, each ``(c, k)`` row summed whole; a candidate whose sum over every
8th point (a lower bound: the terms are ``>= 0``) exceeds, by ``1e-9`` relative, the full error of the candidate
of least bound is not scored (its error is larger, so it is neither the first least nor tied with it). Per channel
(session 43, ``_channel_errors``): only the bins that hold mass are scored (a point of an empty bin adds ``+0``), and a
row is decided without its full error unless two grids are within ``2e-10`` relative (then those are scored whole).
Session 44: where the counts are integers (a weight, observed once) and fill more points than the grid has cells, a
candidate is scored per code cell (``mse_cells.py``: exact integer prefix sums, ``A`` within a proven ``B`` of the
float error), not per point; only grids whose ``[A - B, A + B]`` overlap the least one's are scored whole.

>>> import torch, lowbit as Q
>>> torch.manual_seed(0) and None
>>> x = torch.distributions.Laplace(0.0, 1.0).sample((20000,))   # heavy tails: clipping pays
>>> obs = Q.MSEObserver(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8)
>>> _ = obs(x)
>>> def err(s, z): return float(((Q.fake_quantize(x, s, z, -128, 127) - x) ** 2).sum())
>>> mm = Q.MinMaxObserver(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8); _ = mm(x)
>>> err(*obs.calculate_qparams()) < 0.95 * err(*mm.calculate_qparams())
True
"""

from __future__ import annotations

import torch

from ..qparams import calculate_qparams
from ..qscheme import QDtype, QScheme, per_tensor_affine, quint8
from .channel_histogram import _ClipRangeObserver
from .mse_cells import cell_bounds

__all__ = ["MSEObserver"]

_BLOCK = 1 << 17  # float64 elements per block of the error evaluation (1 MiB: stays in cache)
_SUBSET = 8  # every 8th point gives the lower bound that prunes candidates (_pruned_errors)


def _multipliers(k: int, device: torch.device) -> torch.Tensor:
    """``k`` values in ``[0.05, 1]``, denser near 1 (``1 - 0.95 t²``), 1 included."""
    t = torch.linspace(0, 1, k, dtype=torch.float64, device=device)
    return 1 - 0.95 * t * t


class MSEObserver(_ClipRangeObserver):
    """Clipping range that minimises the squared error of the quantized data, on the actual integer grid.

    Args:
        qscheme: per tensor (default ``per_tensor_affine``) or per channel (then ``ch_axis`` is required).
        qdtype: the target grid (default ``quint8``).
        ch_axis: the channel axis of a per-channel scheme, else ``None``.
        bins: histogram bins (default 2048 per tensor, 256 per channel).
        eps: floor of the scale.

    >>> import torch, lowbit as Q
    >>> obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    >>> _ = obs(torch.linspace(-1.0, 1.0, 4001).repeat(2, 1))   # uniform data: clipping only hurts
    >>> [round(v, 2) for v in obs.clip_range()[1].tolist()]
    [1.0, 1.0]
    """

    def __init__(self, qscheme: QScheme | str = per_tensor_affine, qdtype: QDtype | str = quint8,
                 ch_axis: int | None = None, bins: int | None = None, eps: float = 1e-8) -> None:
        super().__init__(qscheme, qdtype, ch_axis, eps, bins)

    def _sub(self, rows: int, bins: int) -> int:
        """Points per bin: 4 per tensor, 2 per channel, raised (up to 8) where that leaves fewer than 8 points per step
        of the grid (2 points per step, as 256 bins per channel gave qint8, scored a grid by where its steps fell
        relative to the points, not by its error: per-channel affine ranges were worse than min/max on average)."""
        base, steps = (4 if rows == 1 else 2), self.quant_max - self.quant_min
        return base if steps >= bins * base else min(8, max(base, -(-8 * steps // bins)))

    @staticmethod
    def _points(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C, P)`` points and weights: ``sub`` evenly spaced points per bin, ``P = B · sub + 2``."""
        nb = hist.shape[1]
        frac = (torch.arange(nb * sub, dtype=hist.dtype, device=hist.device) + 0.5) / (nb * sub)
        pts = lo.unsqueeze(1) + (hi - lo).unsqueeze(1) * frac                            # (C, P)
        wts = (hist / sub).repeat_interleave(sub, dim=1)                                  # (C, P)
        # min and max are observed values: one unit of mass exactly on each end, not spread over the end bins (a
        # lone outlier modelled inside its bin made clipping it look cheaper than it is)
        e_lo, e_hi = hist[:, :1].clamp(max=1.0), hist[:, -1:].clamp(max=1.0)              # (C, 1)
        wts[:, :sub] -= e_lo / sub
        wts[:, -sub:] -= e_hi / sub
        return torch.cat([pts, lo.unsqueeze(1), hi.unsqueeze(1)], 1), torch.cat([wts, e_lo, e_hi], 1)

    @staticmethod
    def _packed_points(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sub: int,
                       bins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The points and weights of ``_points`` in the bins ``bins`` (``(C, n)``) and the two ends, the same bits."""
        c, nb = hist.shape
        frac = (torch.arange(nb * sub, dtype=hist.dtype, device=hist.device) + 0.5) / (nb * sub)
        idx = (bins.unsqueeze(2) * sub + torch.arange(sub, device=hist.device)).reshape(c, -1)  # (C, n · sub)
        e_lo, e_hi = hist[:, :1].clamp(max=1.0), hist[:, -1:].clamp(max=1.0)              # (C, 1)
        per_bin = hist / sub
        per_bin[:, :1] -= e_lo / sub
        per_bin[:, -1:] -= e_hi / sub
        pts = torch.empty(c, idx.shape[1] + 2, dtype=hist.dtype, device=hist.device)
        wts = torch.empty_like(pts)
        torch.add(lo.unsqueeze(1), (hi - lo).unsqueeze(1) * frac[idx], out=pts[:, :-2])
        torch.gather(per_bin, 1, bins.repeat_interleave(sub, dim=1), out=wts[:, :-2])
        pts[:, -2], pts[:, -1], wts[:, -2:-1], wts[:, -1:] = lo, hi, e_lo, e_hi
        return pts, wts

    def _errors(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``(C, K)`` squared error of the grids of ``(a_k · lo, b_k · hi)`` (``a``, ``b``: ``(K,)`` or ``(C, K)``);
        per channel (``_channel_errors``) only the row-wise first ``argmin`` is exact, other entries may be ``+inf``."""
        c, nb = hist.shape
        sub = self._sub(c, nb)
        cmin, cmax = a * lo.unsqueeze(1), b * hi.unsqueeze(1)                            # (C, K)
        scale, zp = calculate_qparams(cmin, cmax, self.qscheme, self.qdtype, self.eps, validate=False)
        s, z = scale.to(hist.dtype), zp.to(hist.dtype)                                    # (C, K)
        if c > 1:
            return self._channel_errors(hist, lo, hi, sub, s, z)
        if int((hist > 0).sum()) * sub >= self.quant_max - self.quant_min:  # per code cell, as _channel_errors
            a, b, ok = cell_bounds(hist, lo, hi, sub, s, z, self.quant_min, self.quant_max)
            if bool(ok.all()):
                return self._settle(hist, lo, hi, sub, s, z, a, a - b, a + b, ok)
        pts, wts = self._points(hist, lo, hi, sub)
        if s.shape[1] > 1:  # candidates on the same grid (a ReLU's lo = 0: every a) score the same bits
            first: dict[tuple[float, float], int] = {}
            inverse = [first.setdefault(g, len(first)) for g in zip(s[0].tolist(), z[0].tolist())]
            if len(first) < len(inverse):
                keep = torch.tensor([inverse.index(i) for i in range(len(first))], device=s.device)
                errs = self._pruned_errors(pts, wts, s[:, keep], z[:, keep])
                return errs[:, torch.tensor(inverse, device=s.device)]
        return self._pruned_errors(pts, wts, s, z)

    def _channel_errors(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sub: int, s: torch.Tensor,
                        z: torch.Tensor) -> torch.Tensor:
        """``(C, K)`` whose row-wise first ``argmin`` is ``_grid_errors``'s (other entries may be ``+inf``).

        Rows of integer counts whose non-empty bins hold at least as many points as the grid has cells are scored per
        code cell (``mse_cells.cell_bounds``: ``A`` within ``B`` of the float error ``E``, ``B / A`` typically ``1e-10`` to
        ``1e-8``); a candidate with ``A - B`` above the row's least ``A + B`` has ``E`` above that candidate's. The
        other rows (and those ``cell_bounds`` does not vouch for) are scored on their points (``_packed_errors``).
        Either way ``_settle`` keeps the candidates not provably worse and scores near-ties whole.
        """
        c, nb = hist.shape
        cells = self.quant_max - self.quant_min
        out = torch.full_like(s, float("inf"))
        rest = torch.ones(c, dtype=torch.bool, device=hist.device)
        dense = ((hist > 0).sum(1) * sub >= cells).nonzero().squeeze(1)  # else the packed points are fewer
        if dense.numel():
            h, lo_d, hi_d, s_d, z_d = hist[dense], lo[dense], hi[dense], s[dense], z[dense]
            a, b, ok = cell_bounds(h, lo_d, hi_d, sub, s_d, z_d, self.quant_min, self.quant_max)
            if bool(ok.any()):
                rows = ok.nonzero().squeeze(1)
                out[dense[rows]] = self._settle(h[rows], lo_d[rows], hi_d[rows], sub, s_d[rows], z_d[rows],
                                                a[rows], a[rows] - b[rows], a[rows] + b[rows],
                                                torch.ones_like(rows, dtype=torch.bool))
                rest[dense[rows]] = False
        if bool(rest.any()):
            rows = rest.nonzero().squeeze(1)
            out[rows] = self._packed_errors(hist[rows], lo[rows], hi[rows], sub, s[rows], z[rows])
        return out

    def _packed_errors(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sub: int, s: torch.Tensor,
                       z: torch.Tensor) -> torch.Tensor:
        """``_channel_errors`` on the points: ``(C, K)`` whose row-wise first ``argmin`` is ``_grid_errors``'s, scoring
        only the bins that hold mass.

        A point of an empty bin has weight 0 and adds a term ``+0`` (all finite: the row is checked), so a row's
        error ``E`` and the sum ``E'`` over the points of its non-empty bins and its two ends (the same bits per
        term, summed in another order) are float sums of the same numbers ``>= 0``: each within ``(P - 1) u < 2e-12``
        of the exact sum. ``E'`` is found for every candidate by ``_pruned_errors`` on the packed points (rows of like
        counts padded with their own empty bins); a candidate whose ``E'`` exceeds the least ``E'`` of the row by
        ``2e-10`` relative has ``E`` above that candidate's ``E``. Entries: ``+inf`` for those; where one candidate is
        left (or several on one grid ``(s, z)``, as candidates clamped to ``a = 1``: the same bits), the first one's
        ``E'``; where several grids are left (near-ties), their ``E``, bit for bit. A depthwise 3x3 channel (9
        values) packs 2,050 points into at most 74. Rows with a non-finite or negative count, a non-finite end, a
        grid ``s <= 0``, or a least ``E'`` under ``1e-280``, and rows of ``P >= 16384`` points, are scored whole
        (``_pruned_errors``), as are all rows where 60 % of the bins or more hold mass (packing would save little).
        """
        c, nb = hist.shape
        nz = hist > 0
        counts = nz.sum(1)
        if nb * sub + 2 >= 16384 or int(counts.sum()) > 0.6 * c * nb:  # packing would save little
            return self._pruned_errors(*self._points(hist, lo, hi, sub), s, z)
        safe = ((torch.isfinite(hist) & (hist >= 0)).all(1) & torch.isfinite(lo) & torch.isfinite(hi)
                & (torch.isfinite(s) & (s > 0) & torch.isfinite(z)).all(1))
        order = torch.argsort(counts)
        rows_by_count = order[safe[order]]
        sizes = counts[rows_by_count].tolist()
        approx = torch.full_like(s, float("inf"))                                          # E' (C, K)
        g = 0
        while g < len(sizes):  # groups of like counts (at most 1.25x + 4 bins of padding per row)
            e = g + 1
            while e < len(sizes) and e - g < 512 and sizes[e] <= 1.25 * sizes[g] + 4:
                e += 1
            rows = rows_by_count[g:e]
            if sizes[e - 1] > 0.8 * nb:  # dense rows: packing would save little
                pts, wts = self._points(hist[rows], lo[rows], hi[rows], sub)
            else:
                bins = torch.argsort((~nz[rows]).to(torch.int8), dim=1, stable=True)[:, :max(sizes[e - 1], 1)]
                pts, wts = self._packed_points(hist[rows], lo[rows], hi[rows], sub, bins)
            approx[rows] = self._pruned_errors(pts, wts, s[rows], z[rows])
            g = e
        least = approx.min(1, keepdim=True).values                                        # (C, 1)
        sure = safe & torch.isfinite(least).squeeze(1) & (least.squeeze(1) > 1e-280)
        return self._settle(hist, lo, hi, sub, s, z, approx, approx * (1 - 1e-10), approx * (1 + 1e-10), sure)

    def _settle(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sub: int, s: torch.Tensor,
                z: torch.Tensor, approx: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                sure: torch.Tensor) -> torch.Tensor:
        """``(C, K)``: ``+inf`` for the candidates provably worse (``low`` above the row's least ``high``, where
        ``low <= E <= high``), ``approx`` for the first one if one grid ``(s, z)`` is left, else the full errors
        ``_grid_errors`` of those left; rows not ``sure`` are scored whole (``_pruned_errors``)."""
        near = ~(low > high.min(1, keepdim=True).values) & sure.unsqueeze(1)              # not provably worse
        first = near.to(torch.int8).argmax(1, keepdim=True)                               # (C, 1)
        one_grid = ((s == s.gather(1, first)) & (z == z.gather(1, first)) | ~near).all(1, keepdim=True)
        near &= ~one_grid | (torch.arange(s.shape[1], device=s.device) == first)  # one grid left (clamped): the first
        left = near.sum(1)
        out = torch.where(near, approx, float("inf"))
        if not bool(sure.all()):
            rows = (~sure).nonzero().squeeze(1)
            out[rows] = self._pruned_errors(*self._points(hist[rows], lo[rows], hi[rows], sub), s[rows], z[rows])
        tied = (left > 1).nonzero().squeeze(1)
        for g in range(0, tied.numel(), 64):  # near-ties: the full errors of the candidates left
            rows = tied[g:g + 64]
            n = int(left[rows].max())
            cols = torch.argsort((~near[rows]).to(torch.int8), dim=1, stable=True)[:, :n]  # the ones left, in order
            pts, wts = self._points(hist[rows], lo[rows], hi[rows], sub)
            errs = self._grid_errors(pts, wts, s[rows].gather(1, cols), z[rows].gather(1, cols))
            out[rows] = torch.full_like(s[rows], float("inf")).scatter_(
                1, cols, torch.where(near[rows].gather(1, cols), errs, float("inf")))
        return out

    def _pruned_errors(self, pts: torch.Tensor, wts: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``_grid_errors``, except ``+inf`` for the candidates that provably cannot be a row's (first) least error.

        Every term is ``>= 0``, so the sum over every ``_SUBSET``-th point (the same terms, the same bits) bounds a
        candidate's error from below: a float sum of ``n`` terms ``>= 0`` is within ``(n - 1) u`` (``< 1e-11`` here)
        of the exact one. With ``e0`` the full error of the candidate of least bound, a candidate whose bound exceeds
        ``e0`` by ``1e-9`` relative has a full error ``> e0``: it is neither the least nor tied with it. Rows with a
        non-finite bound or error, or an error under ``1e-280`` (subnormal sums), and long rows (``P >= 16384``, where
        a threaded sum of one row may be split) are scored whole. Among survivors ``k0`` is not scored again (``e0``).
        """
        c, p = pts.shape
        k = s.shape[1]
        if k < 8 or p >= 16384:
            return self._grid_errors(pts, wts, s, z)
        lb = self._grid_errors(pts[:, ::_SUBSET].contiguous(), wts[:, ::_SUBSET].contiguous(), s, z)  # (C, K)
        k0 = lb.argmin(1, keepdim=True)
        e0 = self._grid_errors(pts, wts, s.gather(1, k0), z.gather(1, k0))                 # (C, 1)
        sure = torch.isfinite(lb).all(1, keepdim=True) & torch.isfinite(e0) & (e0 > 1e-280)
        alive = ~(lb * (1 - 1e-9) > e0) | ~sure                                           # k0 always alive
        counts = alive.sum(1)
        if int(counts.max()) == k:
            return self._grid_errors(pts, wts, s, z)
        alive.scatter_(1, k0, False)  # k0's error is e0 already (each row summed whole: the same bits)
        counts -= 1
        out = torch.full_like(lb, float("inf"))
        rows_by_count = torch.argsort(counts)  # rows with alike survivor counts share a block
        for g in range(0, c, 64):
            rows = rows_by_count[g:g + 64]
            n = int(counts[rows].max())
            if n == 0:
                continue
            cols = torch.argsort((~alive[rows]).to(torch.int8), dim=1, stable=True)[:, :n]  # survivors first, in order
            errs = self._grid_errors(pts[rows], wts[rows], s[rows].gather(1, cols), z[rows].gather(1, cols))
            out[rows] = out[rows].scatter_(1, cols, torch.where(alive[rows].gather(1, cols), errs, float("inf")))
        return out.scatter_(1, k0, e0)

    def _grid_errors(self, pts: torch.Tensor, wts: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``(C, K)`` ``Σ_p wts · ((clamp(round(pts / s) + z, qmin, qmax) - z) · s - pts)²`` of the grids ``(s, z)``.

        The same elementwise operations, in the same order, as one ``(C, K, P)`` expression, and each ``(c, k)``
        row summed whole by ``sum`` (so the same bits), but in cache-sized blocks of ``(c, k)`` rows written in place
        into one reused buffer (a fresh ``(C, K, P)`` temporary per operation cost 20x more).
        """
        c, p = pts.shape
        k = s.shape[1]
        out = torch.empty(c, k, dtype=pts.dtype, device=pts.device)
        kc = min(k, max(2, _BLOCK // p))  # rows of candidates per block (at least 2: one output row per block
        rc = min(c, max(1, _BLOCK // (kc * p)))  # would let a threaded sum split a long row)
        buf = torch.empty(rc, kc, p, dtype=pts.dtype, device=pts.device)
        qmin, qmax = self.quant_min, self.quant_max
        zero = bool((z == 0).all())  # symmetric grids: + 0 and - 0 change no bit of the squared error (only a 0's sign)
        for r in range(0, c, rc):
            x = pts[r:r + rc].unsqueeze(1)                                                # (rc, 1, P)
            w = wts[r:r + rc].unsqueeze(1)
            for j in range(0, k, kc):
                ss, zz = s[r:r + rc, j:j + kc].unsqueeze(2), z[r:r + rc, j:j + kc].unsqueeze(2)  # (rc, kc, 1)
                t = buf[:ss.shape[0], :ss.shape[1]]
                torch.div(x, ss, out=t)
                if zero:
                    t.round_().clamp_(qmin, qmax).mul_(ss).sub_(x).pow_(2).mul_(w)
                else:
                    t.round_().add_(zz).clamp_(qmin, qmax).sub_(zz).mul_(ss).sub_(x).pow_(2).mul_(w)
                torch.sum(t, 2, out=out[r:r + rc, j:j + kc])
        return out

    def _best(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, a: torch.Tensor,
              b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the ``(a, b)`` of least error (the first, on ties)."""
        idx = self._errors(hist, lo, hi, a, b).argmin(1, keepdim=True)
        rows = hist.shape[0]
        return a.expand(rows, -1).gather(1, idx).squeeze(1), b.expand(rows, -1).gather(1, idx).squeeze(1)

    def _clip_range(self, hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = hist.device
        joint = self.qscheme.is_symmetric or hist.shape[0] > 1
        if joint:
            m = _multipliers(64 if hist.shape[0] == 1 else 24, dev)
            a, b = self._best(hist, lo, hi, m, m)
            step = (1 - m[1]).item()  # finest coarse step
            width = 2 * step * a.unsqueeze(1).clamp_min(0.05) ** 0.5
            offsets = torch.linspace(-1, 1, 17 if hist.shape[0] == 1 else 9, dtype=hist.dtype, device=dev)
            fine = (a.unsqueeze(1) + width * offsets).clamp(0.01, 1)
            fine = torch.cat([fine, a.unsqueeze(1)], 1)
            a, b = self._best(hist, lo, hi, fine, fine)
            return a * lo, b * hi
        m = _multipliers(24, dev)
        a, b = self._best(hist, lo, hi, m.repeat_interleave(24), m.repeat(24))
        d = 0.95 * (2 * (1 - a.clamp(max=1)) / 0.95) ** 0.5 / 23 + 1e-3                 # local coarse step
        e = 0.95 * (2 * (1 - b.clamp(max=1)) / 0.95) ** 0.5 / 23 + 1e-3
        t = torch.linspace(-1, 1, 9, dtype=hist.dtype, device=dev)
        fa = (a + d * t.repeat_interleave(9)).clamp(0.01, 1)
        fb = (b + e * t.repeat(9)).clamp(0.01, 1)
        a2, b2 = self._best(hist, lo, hi, torch.cat([fa, a]).unsqueeze(0), torch.cat([fb, b]).unsqueeze(0))
        return a2 * lo, b2 * hi
