"""MSEObserver's range search, made faster (session 42): the same chosen ranges, bit for bit.

``_OldMSE`` keeps the search as it was before (one ``(C, K, P)`` float64 expression per scan, rows chunked),
and every test compares ``clip_range()`` / ``calculate_qparams()`` of the two on the same statistics with
``torch.equal``: random, heavy-tailed, one-sided (ReLU), constant, tiny, huge, NaN/Inf-carrying, few and many
bins, per tensor and per channel, symmetric and affine, every grid the observer supports.
"""

from __future__ import annotations

import pytest
import torch

import lowbit as Q
from lowbit.qparams import calculate_qparams


class _OldMSE(Q.MSEObserver):
    """The search before session 42 (``_errors`` / ``_best`` copied verbatim)."""

    def _errors(self, hist, lo, hi, a, b):  # type: ignore[no-untyped-def]
        c, nb = hist.shape
        sub = self._sub(c, nb)
        frac = (torch.arange(nb * sub, dtype=hist.dtype, device=hist.device) + 0.5) / (nb * sub)
        pts = lo.unsqueeze(1) + (hi - lo).unsqueeze(1) * frac
        wts = (hist / sub).repeat_interleave(sub, dim=1)
        e_lo, e_hi = hist[:, :1].clamp(max=1.0), hist[:, -1:].clamp(max=1.0)
        wts[:, :sub] -= e_lo / sub
        wts[:, -sub:] -= e_hi / sub
        pts = torch.cat([pts, lo.unsqueeze(1), hi.unsqueeze(1)], 1)
        wts = torch.cat([wts, e_lo, e_hi], 1)
        cmin, cmax = a * lo.unsqueeze(1), b * hi.unsqueeze(1)
        scale, zp = calculate_qparams(cmin, cmax, self.qscheme, self.qdtype, self.eps, validate=False)
        s, z = scale.to(hist.dtype).unsqueeze(2), zp.to(hist.dtype).unsqueeze(2)
        q = torch.clamp(torch.round(pts.unsqueeze(1) / s) + z, self.quant_min, self.quant_max)
        return (((q - z) * s - pts.unsqueeze(1)) ** 2 * wts.unsqueeze(1)).sum(2)

    def _best(self, hist, lo, hi, a, b):  # type: ignore[no-untyped-def]
        c = hist.shape[0]
        k = a.shape[-1]
        chunk = max(1, (1 << 22) // (k * (hist.shape[1] * self._sub(c, hist.shape[1]) + 2)))
        best_a = torch.empty(c, dtype=hist.dtype, device=hist.device)
        best_b = torch.empty_like(best_a)
        for s in range(0, c, chunk):
            aa = a if a.dim() == 1 else a[s:s + chunk]
            bb = b if b.dim() == 1 else b[s:s + chunk]
            idx = self._errors(hist[s:s + chunk], lo[s:s + chunk], hi[s:s + chunk], aa, bb).argmin(1, keepdim=True)
            best_a[s:s + chunk] = aa.expand(idx.shape[0], -1).gather(1, idx).squeeze(1)
            best_b[s:s + chunk] = bb.expand(idx.shape[0], -1).gather(1, idx).squeeze(1)
        return best_a, best_b


SCHEMES = [(Q.per_tensor_affine, Q.quint8), (Q.per_tensor_affine, Q.qint8), (Q.per_tensor_symmetric, Q.qint8),
           (Q.per_tensor_symmetric, Q.quint8), (Q.per_tensor_affine, Q.quint4), (Q.per_tensor_affine, Q.qint32),
           (Q.per_channel_affine, Q.quint8), (Q.per_channel_symmetric, Q.qint8), (Q.per_channel_symmetric, Q.qint4),
           (Q.per_channel_affine_float_qparams, Q.quint8), (Q.per_channel_affine, Q.quint4)]


def _data(kind: str, g: torch.Generator) -> torch.Tensor:
    shape = (3, 5, 40)
    if kind == "normal":
        return torch.randn(shape, generator=g) * 2 + 0.3
    if kind == "laplace":  # heavy tails: the search clips
        u = torch.rand(shape, generator=g) - 0.5
        return -u.sign() * torch.log1p(-2 * u.abs()) * 0.7
    if kind == "cauchy":
        return torch.tan(torch.pi * (torch.rand(shape, generator=g) - 0.5)).clamp(-1e4, 1e4)
    if kind == "relu":  # lo = 0 exactly: every a gives the same grid
        return torch.relu(torch.randn(shape, generator=g))
    if kind == "relu6_spike":
        x = torch.randn(shape, generator=g).clamp(0, 6)
        x[0, 0, :3] = 6.0
        return x
    if kind == "negative":
        return -torch.rand(shape, generator=g) * 3 - 0.5
    if kind == "constant":
        return torch.full(shape, 0.75)
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "tiny":
        return torch.randn(shape, generator=g) * 1e-30
    if kind == "subnormal":
        return torch.randn(shape, generator=g) * 1e-40
    if kind == "huge":
        return torch.randn(shape, generator=g) * 1e30
    if kind == "nan_inf":
        x = torch.randn(shape, generator=g)
        x[0, 1, 2], x[1, 2, 3], x[2, 3, 4] = float("nan"), float("inf"), float("-inf")
        return x
    if kind == "few":  # a handful of distinct values
        return torch.randint(-3, 5, shape, generator=g).float() * 0.25
    raise AssertionError(kind)


KINDS = ["normal", "laplace", "cauchy", "relu", "relu6_spike", "negative", "constant", "zeros", "tiny", "subnormal",
         "huge", "nan_inf", "few"]


def _pair(qscheme, qdtype, bins=None):  # type: ignore[no-untyped-def]
    """The new observer and the old one, alike."""
    ch = 1 if qscheme.is_per_channel else None
    return (Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=ch, bins=bins),
            _OldMSE(qscheme=qscheme, qdtype=qdtype, ch_axis=ch, bins=bins))


def _assert_same(new: Q.MSEObserver, old: Q.MSEObserver) -> None:
    (n0, n1), (o0, o1) = new.clip_range(), old.clip_range()
    assert torch.equal(n0, o0) and torch.equal(n1, o1), (n0, o0, n1, o1)
    (s, z), (so, zo) = new.calculate_qparams(), old.calculate_qparams()
    assert torch.equal(s, so) and torch.equal(z, zo)


@pytest.mark.filterwarnings("ignore:MSEObserver")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qscheme,qdtype", SCHEMES, ids=lambda v: getattr(v, "value", None) or repr(v))
def test_same_ranges_as_the_old_search(kind: str, qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(KINDS.index(kind))
    new, old = _pair(qscheme, qdtype, None if qscheme.is_per_channel else 256)  # default bins: the tests below
    for _ in range(2):  # two batches: the second may widen the range (rebinned counts, non-integer bins)
        x = _data(kind, g)
        new(x)
        old(x)
    _assert_same(new, old)


@pytest.mark.parametrize("bins", [8, 9, 100, 2047, 8191])
@pytest.mark.parametrize("qscheme,qdtype", [(Q.per_tensor_affine, Q.quint8), (Q.per_tensor_symmetric, Q.qint8),
                                            (Q.per_channel_affine, Q.qint8)], ids=["pta", "pts", "pca"])
def test_same_ranges_for_any_bins(bins: int, qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(bins)
    new, old = _pair(qscheme, qdtype, bins)
    for scale in (1.0, 3.0):
        u = torch.rand(4, 3, 50, generator=g) - 0.5
        x = -u.sign() * torch.log1p(-2 * u.abs()) * scale + 0.1
        new(x)
        old(x)
    _assert_same(new, old)


def test_same_ranges_on_many_random_histograms() -> None:
    """Random histograms and ranges set directly (any shape of mass, lo / hi of any sign and size)."""
    g = torch.Generator().manual_seed(42)
    for trial in range(24):
        qscheme, qdtype = SCHEMES[trial % len(SCHEMES)]
        new, old = _pair(qscheme, qdtype)
        x = torch.randn(2, 6, 16, generator=g)
        new(x)
        old(x)
        rows = new.min_val.numel()
        mag = 10.0 ** torch.randint(-6, 7, (1,), generator=g).item()
        lo = -torch.rand(rows, generator=g) * mag * (trial % 3 != 0)  # a third one-sided (lo = 0)
        hi = torch.rand(rows, generator=g) * mag + 1e-3 * mag
        hist = torch.rand(new.histogram.shape, generator=g) ** 4 * torch.randint(1, 1000, (1,), generator=g)
        for o in (new, old):
            o.min_val.copy_(lo.reshape(o.min_val.shape))
            o.max_val.copy_(hi.reshape(o.max_val.shape))
            o.histogram.copy_(hist)
        _assert_same(new, old)


@pytest.mark.parametrize("threads,bins", [(1, None), (2, 8192)])
def test_same_ranges_at_any_thread_count(threads: int, bins: int | None) -> None:
    """Each (row, candidate) error is summed whole whatever the block (a block keeps >= 2 candidates, so a threaded
    sum never splits one row, even past torch's 32768-element grain: 8192 bins x 4 points)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for qscheme, qdtype in [(Q.per_tensor_affine, Q.quint8), (Q.per_channel_symmetric, Q.qint8)]:
            new, old = _pair(qscheme, qdtype, bins if qscheme == Q.per_tensor_affine else None)
            x = torch.randn(4, 8, 300, generator=g) ** 3
            new(x)
            old(x)
            _assert_same(new, old)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qscheme,qdtype", [(Q.per_tensor_affine, Q.quint8), (Q.per_channel_affine, Q.quint8)],
                         ids=["per_tensor", "per_channel"])
def test_search_builds_no_large_temporary(qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    """The errors are evaluated in cache-sized blocks: no operation allocates more than 4 MiB (before: every
    operation of the per-tensor affine scan allocated a 576 x 8194 float64 temporary, 37.8 MB; 0.6-0.9 s)."""
    obs = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=1 if qscheme.is_per_channel else None)
    obs(torch.randn(2, 96, 30))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        obs.calculate_qparams()
    biggest = max((e.self_cpu_memory_usage for e in prof.events()), default=0)
    assert 0 < biggest <= 4 << 20, biggest


@pytest.mark.parametrize("qscheme,qdtype", [(Q.per_tensor_affine, Q.quint8), (Q.per_channel_symmetric, Q.qint8)],
                         ids=["per_tensor", "per_channel"])
def test_pruned_candidates_are_only_ones_that_lose(qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    """The lower bound prunes (some +inf), every kept error is the full error bit for bit, and each row's first
    least error is the same as scoring every candidate."""
    ch = 0 if qscheme.is_per_channel else None
    obs = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=ch)
    g = torch.Generator().manual_seed(7)
    obs(torch.randn(32, 400, generator=g) ** 3)
    rows = obs.min_val.numel()
    lo, hi = obs.min_val.reshape(rows).double(), obs.max_val.reshape(rows).double()
    sub = obs._sub(rows, obs.bins)
    frac = (torch.arange(obs.bins * sub, dtype=torch.float64) + 0.5) / (obs.bins * sub)
    pts = torch.cat([lo.unsqueeze(1) + (hi - lo).unsqueeze(1) * frac, lo.unsqueeze(1), hi.unsqueeze(1)], 1)
    wts = torch.rand(pts.shape, generator=g, dtype=torch.float64)
    m = 1 - 0.95 * torch.linspace(0, 1, 24, dtype=torch.float64) ** 2
    s, z = calculate_qparams(m * lo.unsqueeze(1), m * hi.unsqueeze(1), qscheme, qdtype, validate=False)
    s, z = s.double(), z.double()
    full = obs._grid_errors(pts, wts, s, z)
    pruned = obs._pruned_errors(pts, wts, s, z)
    kept = torch.isfinite(pruned)
    assert (~kept).sum() > 0.25 * kept.numel()  # the bound does prune
    assert torch.equal(pruned[kept], full[kept])
    assert torch.equal(pruned.argmin(1), full.argmin(1))
