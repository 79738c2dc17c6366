"""MSEObserver's per-channel weight search, made faster (session 43): the same chosen ranges, bit for bit.

Per channel, the search now scores only the bins that hold mass (a depthwise 3x3 channel: 9 values in 256 bins;
a 1x1 conv over 96 inputs: 29 % of the bins) and decides a row without its full error unless two grids are
near-tied. ``_OldMSE`` (tests/test_mse42_s42.py: the search before session 42) is the oracle: ``torch.equal``
ranges on weight-like shapes, special channels and every per-channel grid.
"""

from __future__ import annotations

import pytest
import torch

import lowbit as Q
from lowbit.qparams import calculate_qparams
from test_mse42_s42 import _OldMSE

SCHEMES = [(Q.per_channel_symmetric, Q.qint8), (Q.per_channel_affine, Q.qint8), (Q.per_channel_affine, Q.quint8),
           (Q.per_channel_symmetric, Q.quint8), (Q.per_channel_symmetric, Q.qint4), (Q.per_channel_affine, Q.quint4),
           (Q.per_channel_affine_float_qparams, Q.quint8)]
IDS = [f"{q.value}-{d}" for q, d in SCHEMES]


def _weight(kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "depthwise":
        return torch.randn(96, 1, 3, 3, generator=g) * 0.2
    if kind == "conv1x1":
        return torch.randn(48, 24, 1, 1, generator=g) * 0.1
    if kind == "conv3x3":
        return torch.randn(16, 8, 3, 3, generator=g) * 0.05
    if kind == "dense":  # 60 % of the bins or more hold mass: scored as before
        return torch.randn(8, 4096, generator=g)
    if kind == "mixed":  # sparse rows packed, dense ones (80 % of the bins or more) scored on their full rows
        w = torch.randn(20, 2000, generator=g)
        w[:16, 9:] = 0.0
        return w
    if kind == "laplace":
        u = torch.rand(40, 200, generator=g) - 0.5
        return -u.sign() * torch.log1p(-2 * u.abs()) * 0.02
    if kind == "special":  # constant, all-zero, single-nonzero, huge-outlier, negative-only, tiny, two-valued
        w = torch.randn(12, 27, generator=g) * 0.1
        w[0] = 0.37
        w[1] = 0.0
        w[2] = 0.0
        w[2, 5] = -0.8
        w[3, 7] = 40.0
        w[4] = -w[4].abs() - 0.01
        w[5] *= 1e-30
        w[6] = torch.tensor([-0.5, 0.25]).repeat(14)[:27]
        w[7, 0] = 3e38
        return w
    raise AssertionError(kind)


KINDS = ["depthwise", "conv1x1", "conv3x3", "dense", "mixed", "laplace", "special"]


def _same(w: torch.Tensor, qscheme, qdtype, bins: int | None = None) -> None:  # type: ignore[no-untyped-def]
    new = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=0, bins=bins)
    old = _OldMSE(qscheme=qscheme, qdtype=qdtype, ch_axis=0, bins=bins)
    new(w)
    old(w)
    (n0, n1), (o0, o1) = new.clip_range(), old.clip_range()
    assert torch.equal(n0, o0) and torch.equal(n1, o1), ((n0 != o0) | (n1 != o1)).nonzero().flatten().tolist()
    (s, z), (so, zo) = new.calculate_qparams(), old.calculate_qparams()
    assert torch.equal(s, so) and torch.equal(z, zo)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qscheme,qdtype", SCHEMES, ids=IDS)
def test_same_weight_ranges_as_the_old_search(kind: str, qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    _same(_weight(kind, torch.Generator().manual_seed(KINDS.index(kind))), qscheme, qdtype)


@pytest.mark.parametrize("bins", [8, 64, 1024])
def test_same_weight_ranges_for_any_bins(bins: int) -> None:
    g = torch.Generator().manual_seed(bins)
    _same(torch.randn(32, 1, 3, 3, generator=g), Q.per_channel_symmetric, Q.qint8, bins)
    _same(torch.randn(16, 40, generator=g) ** 3, Q.per_channel_affine, Q.quint8, bins)


@pytest.mark.slow
def test_same_ranges_on_a_large_linear_weight() -> None:
    """(3072, 768), heavy-tailed like a transformer's weights: 29 % of the bins hold mass."""
    g = torch.Generator().manual_seed(3)
    u = torch.rand(3072, 768, generator=g) - 0.5
    _same(-u.sign() * torch.log1p(-2 * u.abs()) * 0.02, Q.per_channel_symmetric, Q.qint8)


def _scored_widths(obs: Q.MSEObserver) -> list[int]:
    """The row lengths ``_grid_errors`` was given while ``obs`` searched."""
    widths: list[int] = []
    grid = obs._grid_errors

    def spy(pts, wts, s, z):  # type: ignore[no-untyped-def]
        widths.append(pts.shape[1])
        return grid(pts, wts, s, z)

    obs._grid_errors = spy  # type: ignore[method-assign]
    obs.clip_range()
    return widths


def test_depthwise_rows_are_scored_on_their_nonempty_bins_only() -> None:
    """A 3x3 depthwise channel's 9 values fill at most 9 of 256 bins: at most 9 x 8 + 2 points are scored per row
    (before: every row at its full 2,050 points, 0.71 s for (960, 1, 3, 3) at 1 thread; now 0.09 s)."""
    obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    obs(torch.randn(64, 1, 3, 3, generator=torch.Generator().manual_seed(0)))
    widths = _scored_widths(obs)
    assert widths and max(widths) <= 9 * 8 + 2, widths


def test_sparse_weight_scores_a_fraction_of_the_points() -> None:
    """A 1x1 conv over 96 inputs (MobileNetV2's expansion layers): the rows are scored on their packed points
    (before: every row at 2,050 points; since session 44 they are scored per code cell, none on its points)."""
    obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    obs(torch.randn(64, 96, 1, 1, generator=torch.Generator().manual_seed(1)))
    widths = _scored_widths(obs)
    assert max(widths, default=0) <= 96 * 8 + 2, widths


def _full_points(obs: Q.MSEObserver, hist, lo, hi):  # type: ignore[no-untyped-def]
    return obs._points(hist, lo, hi, obs._sub(hist.shape[0], hist.shape[1]))


def test_near_ties_get_their_full_errors() -> None:
    """Distinct grids of the same error (the zero point moved, nothing clipped: the same bits) are scored whole and
    the first wins, as when every candidate was scored; a row with one grid repeated needs no full score."""
    obs = Q.MSEObserver(qscheme=Q.per_channel_affine, qdtype=Q.quint8, ch_axis=0)
    g = torch.Generator().manual_seed(5)
    obs(torch.randn(4, 1, 3, 3, generator=g))
    hist, lo, hi = obs.histogram.double(), obs.min_val.double(), obs.max_val.double()
    span = (hi - lo).unsqueeze(1)
    s = torch.cat([span / 100 * 1.01, span / 100, span / 100, span / 100, span / 80], 1)  # (4, 5): nothing clipped
    z = torch.tensor([[128.0, 128.0, 129.0, 127.0, 128.0]]).expand(4, -1).clone()
    z[1] = 128.0  # row 1: one grid three times (a clamped fine scan)
    sub = obs._sub(4, obs.bins)
    full = obs._grid_errors(*_full_points(obs, hist, lo, hi), s, z)
    got = obs._channel_errors(hist, lo, hi, sub, s, z)
    assert torch.equal(got.argmin(1), full.argmin(1))
    assert torch.equal(full[0, 1], full[0, 2]) and torch.equal(full[0, 1], full[0, 3])  # the ties are real
    tied = torch.isfinite(got[0])
    assert tied[1:4].all() and torch.equal(got[0, tied], full[0, tied])  # scored whole, bit for bit
    assert int(torch.isfinite(got[1]).sum()) == 1


def test_random_sparse_histograms_pick_the_same_candidate() -> None:
    """Histograms set directly (sparse, fractional, end bins below one count, rows with no mass, negative counts
    that fall back to the whole-row score) and random candidate grids: the first least error is the same."""
    g = torch.Generator().manual_seed(43)
    for trial in range(40):
        qscheme, qdtype = SCHEMES[trial % len(SCHEMES)]
        obs = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=0, bins=64)
        rows = 24
        hist = torch.rand(rows, 64, generator=g, dtype=torch.float64) * (torch.rand(rows, 64, generator=g) < 0.1)
        hist *= 10.0 ** torch.randint(-2, 4, (rows, 1), generator=g)
        hist[0] = 0.0
        hist[1, 3] = -0.5 if trial % 2 else 0.0
        mag = 10.0 ** torch.randint(-5, 6, (1,), generator=g).item()
        lo = -torch.rand(rows, generator=g, dtype=torch.float64) * mag * (trial % 3 != 0)
        hi = torch.rand(rows, generator=g, dtype=torch.float64) * mag + 1e-3 * mag
        m = 1 - 0.95 * torch.rand(rows, 16, generator=g, dtype=torch.float64)
        m[:, :3] = 1.0  # a repeated grid
        scale, zp = calculate_qparams(m * lo.unsqueeze(1), m * hi.unsqueeze(1), qscheme, qdtype, validate=False)
        s, z = scale.double(), zp.double()
        full = obs._grid_errors(*_full_points(obs, hist, lo, hi), s, z)
        got = obs._channel_errors(hist, lo, hi, obs._sub(rows, 64), s, z)
        assert torch.equal(got.argmin(1), full.argmin(1)), trial


def test_search_at_two_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(2)
        _same(torch.randn(64, 32, 1, 1, generator=g) ** 3, Q.per_channel_symmetric, Q.qint8)
        _same(torch.randn(64, 1, 3, 3, generator=g), Q.per_channel_affine, Q.quint8)
    finally:
        torch.set_num_threads(before)
