"""MSEObserver's range search scored per code cell (session 44): the same chosen ranges, bit for bit.

Rows of integer counts (a weight, observed once) are scored by ``observer/mse_cells.py``: exact integer prefix sums at
the cells' bounds give each candidate's error ``A`` within a proven ``B`` of the float error ``_grid_errors`` returns;
only grids whose ``[A - B, A + B]`` reach the least one's are scored point by point. ``_OldMSE``
(tests/test_mse42_s42.py: the search before session 42, one ``(C, K, P)`` expression) is the oracle.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lowbit as Q
from lowbit.observer.mse_cells import cell_bounds
from lowbit.qparams import calculate_qparams
from test_mse42_s42 import _OldMSE

SCHEMES = [(Q.per_channel_symmetric, Q.qint8), (Q.per_channel_affine, Q.quint8), (Q.per_channel_symmetric, Q.quint8),
           (Q.per_channel_affine, Q.qint8), (Q.per_channel_symmetric, Q.qint4), (Q.per_channel_affine, Q.quint4),
           (Q.per_channel_affine_float_qparams, Q.quint8)]
IDS = [f"{q.value}-{d}" for q, d in SCHEMES]


def _weight(kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "random":  # a classifier's rows: 1280 values, ~80 % of the 256 bins hold mass
        return torch.randn(48, 1280, generator=g) * 0.05
    if kind == "heavy":  # Laplace and Student-t-like tails (a few far values per row)
        u = torch.rand(40, 768, generator=g) - 0.5
        w = -u.sign() * torch.log1p(-2 * u.abs()) * 0.02
        return w * (1 + 4 * (torch.rand(40, 768, generator=g) < 0.01))
    if kind == "conv1x1":
        return torch.randn(64, 96, 1, 1, generator=g) * 0.1
    if kind == "int":  # integer values: many points exactly on a grid, exact ties between grids
        return torch.randint(-7, 8, (32, 500), generator=g).float()
    if kind == "special":  # constant, all-zero, one outlier, positive-only far from 0, tiny, negative-only, 2 values
        w = torch.randn(10, 600, generator=g) * 0.1
        w[0] = 0.37
        w[1] = 0.0
        w[2, 5] = 40.0
        w[3] = w[3].abs() + 100.0
        w[4] *= 1e-30
        w[5] = -w[5].abs() - 0.01
        w[6] = torch.tensor([-0.5, 0.25]).repeat(300)
        w[7, :300] = 0.0
        w[8] = torch.rand(600, generator=g) * 1e-3 + 5.0
        w[9, 0] = 3e38
        return w
    if kind == "tiny1":  # one value per channel
        return torch.randn(24, 1, generator=g)
    if kind == "tiny2":
        return torch.randn(24, 2, generator=g)
    raise AssertionError(kind)


KINDS = ["random", "heavy", "conv1x1", "int", "special", "tiny1", "tiny2"]


def _same(w: torch.Tensor, qscheme, qdtype, bins: int | None = None, ch_axis: int | None = 0) -> None:  # type: ignore[no-untyped-def]
    ch_axis = ch_axis if qscheme.is_per_channel else None
    new = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=ch_axis, bins=bins)
    old = _OldMSE(qscheme=qscheme, qdtype=qdtype, ch_axis=ch_axis, bins=bins)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new(w)
        old(w)
    (n0, n1), (o0, o1) = new.clip_range(), old.clip_range()
    assert torch.equal(n0, o0) and torch.equal(n1, o1), ((n0 != o0) | (n1 != o1)).nonzero().flatten().tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qscheme,qdtype", SCHEMES, ids=IDS)
def test_same_weight_ranges_as_the_old_search(kind: str, qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    _same(_weight(kind, torch.Generator().manual_seed(KINDS.index(kind))), qscheme, qdtype)


@pytest.mark.parametrize("qscheme,qdtype", [(Q.per_tensor_symmetric, Q.qint8), (Q.per_tensor_affine, Q.quint8),
                                            (Q.per_tensor_affine, Q.quint4)], ids=["sym-qint8", "aff-quint8", "aff-q4"])
@pytest.mark.parametrize("kind", ["random", "heavy", "int", "tiny2"])
def test_same_per_tensor_ranges(kind: str, qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    _same(_weight(kind, torch.Generator().manual_seed(7)), qscheme, qdtype)


@pytest.mark.parametrize("bins", [8, 100, 1024])
def test_same_ranges_for_any_bins(bins: int) -> None:  # sub = 8, 3, 2 points per bin: P0 / P1 by bins
    g = torch.Generator().manual_seed(bins)
    _same(torch.randn(16, 2000, generator=g), Q.per_channel_symmetric, Q.qint8, bins)
    _same(torch.randn(16, 700, generator=g) ** 3, Q.per_channel_affine, Q.quint8, bins)


def test_dense_rows_are_decided_without_point_by_point_scores() -> None:
    """A (1000, 1280) classifier's rows (79 % of the bins hold mass) were scored on all 2,050 points per candidate
    (52 M terms, ~0.5 s at 1 thread); now per code cell, none point by point unless near-tied."""
    obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    obs(torch.randn(64, 1280, generator=torch.Generator().manual_seed(0)) * 0.05)
    scored: list[tuple[int, int]] = []
    grid = obs._grid_errors

    def spy(pts, wts, s, z):  # type: ignore[no-untyped-def]
        scored.append((pts.shape[1], s.numel()))
        return grid(pts, wts, s, z)

    obs._grid_errors = spy  # type: ignore[method-assign]
    obs.clip_range()
    assert sum(p * k for p, k in scored) < 64 * 2050, scored  # fewer terms than one full candidate per row


def test_pruned_errors_scores_its_reference_once() -> None:
    """``_pruned_errors`` scored its least-bound candidate fully twice (once as ``e0``, again among the survivors)."""
    obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    obs(torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)))
    hist, lo, hi = obs.histogram.double(), obs.min_val.double(), obs.max_val.double()
    pts, wts = obs._points(hist, lo, hi, obs._sub(4, obs.bins))
    m = 1 - 0.95 * torch.linspace(0, 1, 24, dtype=torch.float64) ** 2  # the coarse scan: the deep clips are pruned
    s, z = calculate_qparams(m * lo.unsqueeze(1), m * hi.unsqueeze(1), obs.qscheme, obs.qdtype, validate=False)
    s, z = s.double(), z.double()
    full = obs._grid_errors(pts, wts, s, z)
    pairs: list[int] = []
    grid = obs._grid_errors

    def spy(p, w, ss, zz):  # type: ignore[no-untyped-def]
        pairs.append(ss.numel() if p.shape[1] == pts.shape[1] else 0)
        return grid(p, w, ss, zz)

    obs._grid_errors = spy  # type: ignore[method-assign]
    got = obs._pruned_errors(pts, wts, s, z)
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], full[kept]) and torch.equal(got.argmin(1), full.argmin(1))
    most = int(kept.sum(1).max())
    assert 1 < most < 24, most
    assert sum(pairs) == 4 * most, pairs  # e0 (4 rows) and the other survivors; before: 4 * (most + 1)


def _grids(obs: Q.MSEObserver, lo: torch.Tensor, hi: torch.Tensor, m: torch.Tensor):  # type: ignore[no-untyped-def]
    s, z = calculate_qparams(m * lo.unsqueeze(1), m * hi.unsqueeze(1), obs.qscheme, obs.qdtype, validate=False)
    return s.double(), z.double()


@pytest.mark.parametrize("qscheme,qdtype", SCHEMES[:6], ids=IDS[:6])
def test_cell_bound_holds_on_random_histograms(qscheme, qdtype) -> None:  # type: ignore[no-untyped-def]
    """``|_grid_errors - A| <= B`` for random integer histograms, ranges (1e-6 to 1e6, one-signed or not) and
    candidates; ``B / A`` stays below 1e-6 on these (typically 1e-10 to 1e-8)."""
    g = torch.Generator().manual_seed(44)
    for trial in range(12):
        bins = [8, 64, 256, 300][trial % 4]
        obs = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=0, bins=bins)
        rows = 16
        hist = (torch.rand(rows, bins, generator=g, dtype=torch.float64) * 50).floor()
        hist *= torch.rand(rows, bins, generator=g) < [0.05, 0.5, 1.0][trial % 3]
        hist[:, 0] += 1
        hist[:, -1] += 1
        mag = 10.0 ** torch.randint(-6, 7, (1,), generator=g).item()
        lo = -torch.rand(rows, generator=g, dtype=torch.float64) * mag * (trial % 3 != 0)
        hi = torch.rand(rows, generator=g, dtype=torch.float64) * mag + 1e-3 * mag
        s, z = _grids(obs, lo, hi, 1 - 0.95 * torch.rand(rows, 20, generator=g, dtype=torch.float64))
        sub = obs._sub(rows, bins)
        full = obs._grid_errors(*obs._points(hist, lo, hi, sub), s, z)
        a, b, ok = cell_bounds(hist, lo, hi, sub, s, z, obs.quant_min, obs.quant_max)
        assert ok.all(), trial
        assert ((full - a).abs() <= b).all(), trial
        assert (b <= 1e-6 * full).all(), (trial, float((b / full).max()))


def test_cell_bounds_refuse_rows_it_cannot_vouch_for() -> None:
    """Fractional, negative or non-finite counts, an empty range, a grid with a fractional zero point (float qparams)
    or ``s <= 0``: not ``ok`` (those rows are scored point by point, as before)."""
    hist = torch.full((7, 16), 3.0, dtype=torch.float64)
    hist[1, 4] = 2.5
    hist[2, 4] = -1.0
    hist[3, 4] = float("nan")
    lo = torch.full((7,), -1.0, dtype=torch.float64)
    hi = torch.ones(7, dtype=torch.float64)
    lo[4] = hi[4] = 0.5
    s = torch.full((7, 3), 0.01, dtype=torch.float64)
    z = torch.zeros(7, 3, dtype=torch.float64)
    z[5, 1] = 0.5
    s[6, 2] = 0.0
    _, _, ok = cell_bounds(hist, lo, hi, 2, s, z, -128, 127)
    assert ok.tolist() == [True, False, False, False, False, False, False]


def test_exact_ties_between_dense_grids_go_to_the_first() -> None:
    """Distinct grids of the same error (the zero point moved by one, nothing clipped: the same bits) are near-tied
    in ``[A - B, A + B]``, scored whole, and the first wins, as when every candidate was scored."""
    obs = Q.MSEObserver(qscheme=Q.per_channel_affine, qdtype=Q.quint8, ch_axis=0)
    obs(torch.randn(4, 2000, generator=torch.Generator().manual_seed(5)))
    hist, lo, hi = obs.histogram.double(), obs.min_val.double(), obs.max_val.double()
    span = (hi - lo).unsqueeze(1)
    s = torch.cat([span / 100 * 1.01, span / 100, span / 100, span / 100, span / 80], 1)  # nothing clipped
    z = torch.tensor([[128.0, 129.0, 128.0, 127.0, 128.0]]).expand(4, -1).clone()
    z[1] = 128.0  # row 1: one grid three times (a clamped fine scan): no full score needed
    sub = obs._sub(4, obs.bins)
    full = obs._grid_errors(*obs._points(hist, lo, hi, sub), s, z)
    got = obs._channel_errors(hist, lo, hi, sub, s, z)
    assert torch.equal(got.argmin(1), full.argmin(1))
    assert torch.equal(full[0, 1], full[0, 2]) and torch.equal(full[0, 1], full[0, 3])  # the ties are real
    tied = torch.isfinite(got[0])
    assert tied[1:4].all() and torch.equal(got[0, tied], full[0, tied])  # scored whole, bit for bit
    assert int(torch.isfinite(got[1]).sum()) == 1


def test_random_candidates_pick_the_same_grid() -> None:
    """Integer histograms (dense, sparse, end bins of one count, empty rows) with random candidates, where the
    grids are often close: ``_channel_errors`` picks ``_grid_errors``'s first least error."""
    g = torch.Generator().manual_seed(4)
    for trial in range(30):
        qscheme, qdtype = SCHEMES[trial % len(SCHEMES)]
        obs = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype, ch_axis=0, bins=128)
        rows = 12
        hist = (torch.rand(rows, 128, generator=g, dtype=torch.float64) * 20).floor()
        hist *= torch.rand(rows, 128, generator=g) < [0.2, 0.9][trial % 2]
        hist[:, 0] = 1.0
        hist[:, -1] = 1.0
        hist[0] = 0.0
        lo = -torch.rand(rows, generator=g, dtype=torch.float64) * (trial % 3 != 0)
        hi = torch.rand(rows, generator=g, dtype=torch.float64) + 1e-3
        m = 1 - 0.02 * torch.rand(rows, 16, generator=g, dtype=torch.float64)  # close candidates
        m[:, :3] = 1.0
        s, z = _grids(obs, lo, hi, m)
        sub = obs._sub(rows, 128)
        full = obs._grid_errors(*obs._points(hist, lo, hi, sub), s, z)
        got = obs._channel_errors(hist, lo, hi, sub, s, z)
        assert torch.equal(got.argmin(1), full.argmin(1)), trial


def test_same_ranges_at_two_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(2)
        _same(torch.randn(32, 1280, generator=g), Q.per_channel_symmetric, Q.qint8)
        _same(torch.randn(32, 300, generator=g) ** 3, Q.per_channel_affine, Q.quint8)
    finally:
        torch.set_num_threads(before)


def test_search_builds_no_large_temporary() -> None:
    """The cell bounds are built in blocks: no operation allocates more than 4 MiB for a (1000, 1280) weight."""
    obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint4, ch_axis=0)
    obs(torch.randn(1000, 1280, generator=torch.Generator().manual_seed(3)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        obs.calculate_qparams()
    biggest = max((e.self_cpu_memory_usage for e in prof.events()), default=0)
    assert 0 < biggest <= 4 << 20, biggest


def test_nan_and_inf_inputs_give_the_same_clear_errors() -> None:
    obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    with pytest.warns(UserWarning, match="NaN or Inf"):
        obs(torch.full((3, 40), float("nan")))
    with pytest.raises(RuntimeError, match="MSEObserver has not observed any finite data"):
        obs.calculate_qparams()
    w = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    w[1] = float("inf")
    w[2, :5] = float("nan")
    obs = Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs(w)
    with pytest.raises(RuntimeError, match=r"channels \[1\] never held a finite value"):
        obs.calculate_qparams()
    w[1] = 0.5  # the non-finite values of row 2 are ignored: the same ranges as the old search
    _same(w, Q.per_channel_symmetric, Q.qint8)
