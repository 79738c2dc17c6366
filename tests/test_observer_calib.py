"""Calibration observers (percentile, entropy/KL, MSE): parity at their min/max limit with torch.ao,
properties of the chosen ranges, per-channel use, distributed merging and bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_helpers import needs_gloo, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization.observer import MinMaxObserver as AOMinMax
from torch.ao.quantization.observer import PerChannelMinMaxObserver as AOPerChannel

import lowbit as Q
import lowbit.debug
from lowbit.observer.entropy import kl_thresholds

CALIB = (Q.PercentileObserver, Q.EntropyObserver, Q.MSEObserver)
PER_CHANNEL = dict(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0)


def sq_err(x, scale, zp, qdtype, ch_axis=None):
    return float(((Q.fake_quantize(x, scale, zp, qdtype.quant_min, qdtype.quant_max, ch_axis) - x) ** 2).sum())


# ---------------------------------------------------------------- parity at the min/max limit


@pytest.mark.parametrize("scheme, qdtype, torch_scheme, torch_dtype", [
    (Q.per_tensor_affine, Q.quint8, torch.per_tensor_affine, torch.quint8),
    (Q.per_tensor_symmetric, Q.qint8, torch.per_tensor_symmetric, torch.qint8),
])
def test_percentile_100_matches_torch_ao_minmax(scheme, qdtype, torch_scheme, torch_dtype):
    g = torch.Generator().manual_seed(0)
    ours = Q.PercentileObserver(percentile=100.0, qscheme=scheme, qdtype=qdtype)
    ref = AOMinMax(qscheme=torch_scheme, dtype=torch_dtype, eps=1e-8)
    for i in range(3):
        x = torch.randn(500, generator=g) * (i + 1) + 0.5
        ours(x), ref(x)
    s, z = ours.calculate_qparams()
    s_ref, z_ref = ref.calculate_qparams()
    torch.testing.assert_close(s, s_ref.reshape(()), rtol=1e-6, atol=0)
    assert int(z) == int(z_ref)


def test_percentile_100_per_channel_matches_torch_ao():
    w = torch.randn(8, 16) * torch.linspace(0.1, 4, 8)[:, None]
    ours = Q.PercentileObserver(percentile=100.0, **PER_CHANNEL)
    ref = AOPerChannel(ch_axis=0, qscheme=torch.per_channel_symmetric, dtype=torch.qint8, eps=1e-8)
    ours(w), ref(w)
    torch.testing.assert_close(ours.calculate_qparams()[0], ref.calculate_qparams()[0], rtol=1e-6, atol=0)


# ---------------------------------------------------------------- properties


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.sampled_from([90.0, 99.0, 99.9]), shift=st.floats(-2, 2))
def test_percentile_matches_torch_quantile_within_a_bin(seed, p, shift):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(seed)) + shift
    obs = Q.PercentileObserver(percentile=p, bins=2048)
    obs(x)
    cmin, cmax = obs.clip_range()
    width = float(x.max() - x.min()) / 2048
    xs, n = x.sort().values, x.numel()
    for value, frac in ((cmin, 1 - p / 100), (cmax, p / 100)):     # between the neighbouring order statistics
        k = frac * n
        lo, hi = xs[max(int(k) - 1, 0)], xs[min(int(k) + 1, n - 1)]
        assert float(lo) - width - 1e-6 <= float(value) <= float(hi) + width + 1e-6


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["normal", "laplace", "relu", "uniform"]),
       scheme=st.sampled_from(["affine", "symmetric"]))
def test_mse_never_worse_than_minmax_on_the_data(seed, kind, scheme):
    g = torch.Generator().manual_seed(seed)
    x = {"normal": lambda: torch.randn(4000, generator=g),
         "laplace": lambda: torch.randn(4000, generator=g).sign() * torch.rand(4000, generator=g).log().neg(),
         "relu": lambda: torch.randn(4000, generator=g).relu(),
         "uniform": lambda: torch.rand(4000, generator=g) * 3 - 1}[kind]()
    qscheme, qdtype = (Q.per_tensor_affine, Q.quint8) if scheme == "affine" else (Q.per_tensor_symmetric, Q.qint8)
    mse, mm = Q.MSEObserver(qscheme=qscheme, qdtype=qdtype), Q.MinMaxObserver(qscheme=qscheme, qdtype=qdtype)
    mse(x), mm(x)
    assert sq_err(x, *mse.calculate_qparams(), qdtype) <= 1.01 * sq_err(x, *mm.calculate_qparams(), qdtype)


def test_all_clip_heavy_tails_and_mse_beats_minmax():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=g).sign() * torch.rand(50_000, generator=g).log().neg()  # Laplace
    base = sq_err(x, *_mm(x), Q.quint8)
    for cls in (Q.MSEObserver, Q.EntropyObserver, Q.PercentileObserver):
        obs = cls()
        obs(x)
        cmin, cmax = obs.clip_range()
        assert float(cmax) < float(x.max()) and float(cmin) > float(x.min()), cls.__name__
        if cls is Q.MSEObserver:  # KL and percentiles are not squared-error criteria
            assert sq_err(x, *obs.calculate_qparams(), Q.quint8) < base, cls.__name__


def _mm(x):
    obs = Q.MinMaxObserver()
    obs(x)
    return obs.calculate_qparams()


def test_kl_threshold_brute_force_matches_prefix_sum_formula():
    """The O(L) closed form equals the textbook P/Q construction on a small histogram."""
    g = torch.Generator().manual_seed(3)
    h = (torch.rand(64, generator=g) * 10).floor().double()
    h[5] = 0.0
    levels = 8
    hb = h.clone()
    hb[0] = hb[1]  # TensorRT's bins[0] = bins[1] (session 36)

    def brute(i):
        h = hb
        p = h[:i].clone()
        p[i - 1] += h[i:].sum()
        q = torch.zeros(i, dtype=torch.float64)
        for grp in range(levels):
            idx = [j for j in range(i) if (j * levels) // i == grp]
            nz = [j for j in idx if h[j] > 0]
            for j in nz:
                q[j] = h[idx].sum() / len(nz)
        p, q = p / p.sum(), q / q.sum()
        if bool(((p > 0) & (q == 0)).any()):
            return float("inf")
        m = p > 0
        return float((p[m] * (p[m] / q[m]).log()).sum())

    best = min(range(levels, 65), key=lambda i: (brute(i), -i))  # the last minimum on a tie, as TensorRT
    assert int(kl_thresholds(h.unsqueeze(0), levels)[0]) == best


def test_entropy_keeps_the_range_of_uniform_data_and_nonnegative_data_uses_the_whole_grid():
    x = torch.linspace(0.0, 2.0, 20001)
    obs = Q.EntropyObserver()
    obs(x)
    cmin, cmax = obs.clip_range()
    assert float(cmin) == 0.0 and float(cmax) > 1.98


@pytest.mark.parametrize("cls", CALIB)
def test_per_channel_ranges_are_per_channel(cls):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 200, generator=g) * torch.tensor([0.1, 0.5, 1.0, 2.0, 4.0, 8.0])[:, None]
    obs = cls(**PER_CHANNEL)
    obs(w)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == (6,) and zp.shape == (6,) and bool((zp == 0).all())
    assert bool((scale[1:] > scale[:-1]).all())                       # follows each channel's spread
    amax = w.abs().amax(1)
    assert bool((scale * 127.5 <= amax * 1.0001).all()) and bool((scale * 127.5 >= amax * 0.2).all())


@pytest.mark.parametrize("cls", CALIB)
def test_usable_in_a_qconfig_end_to_end(cls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Q.QuantStub(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4),
                                Q.DeQuantStub()).eval()
    qconfig = Q.QConfig(activation=cls.with_args(), weight=cls.with_args(**PER_CHANNEL))
    prepared = Q.prepare(model, qconfig)
    x = torch.randn(256, 16)
    prepared(x)
    qmodel = Q.convert(prepared)
    assert lowbit.debug.sqnr(model(x), qmodel(x)) > 25


def test_accurate_recipe_graph_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(128, 16)
    prepared = Q.prepare_fx(model, Q.get_accurate_qconfig(), example_inputs=(x,))
    prepared(x)
    assert lowbit.debug.sqnr(model(x), Q.convert_fx(prepared)(x)) > 25
    with pytest.raises(ValueError, match="activation='kl'"):
        Q.get_calibration_qconfig(activation="kl")


def test_batches_merge_like_one_batch():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2000, generator=g) * (1 + i) for i in range(4)]
    whole, parts = Q.PercentileObserver(percentile=99.0), Q.PercentileObserver(percentile=99.0)
    whole(torch.cat(xs))
    for x in xs:
        parts(x)
    torch.testing.assert_close(torch.stack(parts.clip_range()), torch.stack(whole.clip_range()), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("cls", CALIB)
def test_state_dict_round_trip_per_channel(cls):
    obs = cls(**PER_CHANNEL)
    obs(torch.randn(4, 50))
    fresh = cls(**PER_CHANNEL)
    fresh.load_state_dict(obs.state_dict())
    assert torch.equal(fresh.calculate_qparams()[0], obs.calculate_qparams()[0])


@pytest.mark.parametrize("cls", CALIB)
def test_remembered_qparams_follow_every_change_of_state(cls):
    """``clip_range`` remembers its answer for the observer's exact state (the rounding passes ask many times):
    every change of the statistics or of a setting gives what a fresh observer of that state gives."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 300, generator=g) * (1 + 3 * i) for i in range(3)]

    def fresh(*batches, **kw):
        o = cls(**PER_CHANNEL, **kw)
        for x in batches:
            o(x)
        return o.calculate_qparams()

    obs = cls(**PER_CHANNEL)
    obs(xs[0])
    first = obs.calculate_qparams()
    first[0].mul_(2)  # the caller owns what it gets back
    assert all(torch.equal(a, b) for a, b in zip(obs.calculate_qparams(), fresh(xs[0])))
    obs(xs[1])  # more data: recomputed
    assert all(torch.equal(a, b) for a, b in zip(obs.calculate_qparams(), fresh(xs[0], xs[1])))
    obs.load_state_dict(_observer_of(cls, xs[2]).state_dict())
    assert all(torch.equal(a, b) for a, b in zip(obs.calculate_qparams(), fresh(xs[2])))
    obs.reset_min_max_vals()
    obs(xs[0])
    assert all(torch.equal(a, b) for a, b in zip(obs.calculate_qparams(), fresh(xs[0])))
    if cls is Q.PercentileObserver:  # a setting changed after the first answer
        obs.percentile = 90.0
        assert all(torch.equal(a, b) for a, b in zip(obs.calculate_qparams(), fresh(xs[0], percentile=90.0)))


def _observer_of(cls, x):
    o = cls(**PER_CHANNEL)
    o(x)
    return o


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("cls", CALIB)
def test_nan_inf_ignored_with_a_warning(cls):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    clean, dirty = cls(), cls()
    clean(x)
    with pytest.warns(UserWarning, match="NaN or Inf"):
        dirty(torch.cat([x, torch.tensor([float("nan"), float("inf"), -float("inf")])]))
    assert torch.equal(clean.calculate_qparams()[0], dirty.calculate_qparams()[0])


@pytest.mark.parametrize("cls", CALIB)
def test_no_finite_data_empty_and_uncalibrated(cls):
    obs = cls()
    assert obs(torch.empty(0)).numel() == 0                           # empty: a no-op
    with pytest.raises(RuntimeError, match=f"{cls.__name__} has not observed any finite data"):
        obs.calculate_qparams()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs(torch.full((10,), float("nan")))
    with pytest.raises(RuntimeError, match="has not observed any finite data"):
        obs.calculate_qparams()
    pc = cls(**PER_CHANNEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pc(torch.stack([torch.ones(5), torch.full((5,), float("nan"))]))
    with pytest.raises(RuntimeError, match=r"channels \[1\]"):
        pc.calculate_qparams()


@pytest.mark.parametrize("cls", CALIB)
@pytest.mark.parametrize("value", [0.0, 3.0, -2.0])
def test_constant_data_gives_the_minmax_qparams(cls, value):
    x = torch.full((100,), value)
    obs, ref = cls(), Q.MinMaxObserver()
    obs(x), ref(x)
    s, z = obs.calculate_qparams()
    s_ref, z_ref = ref.calculate_qparams()
    assert torch.isfinite(s) and float(s) > 0
    torch.testing.assert_close(s, s_ref) and None
    assert int(z) == int(z_ref)


@pytest.mark.parametrize("cls", CALIB)
def test_bad_arguments_name_the_value(cls):
    with pytest.raises(TypeError, match="int64"):
        cls()(torch.arange(4))
    with pytest.raises(TypeError, match="bins=2.5"):
        cls(bins=2.5)
    with pytest.raises(ValueError, match="bins=4"):
        cls(bins=4)
    with pytest.raises(ValueError, match="needs ch_axis"):
        cls(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8)
    with pytest.raises(ValueError, match="ch_axis=0 given with the per-tensor"):
        cls(ch_axis=0)
    obs = cls(**{**PER_CHANNEL, "ch_axis": 2})
    with pytest.raises(ValueError, match="ch_axis=2 is out of range"):
        obs(torch.randn(3, 4))
    obs = cls(**PER_CHANNEL)
    obs(torch.randn(3, 4))
    with pytest.raises(ValueError, match="has recorded 3"):
        obs(torch.randn(5, 4))


def test_percentile_and_entropy_argument_checks():
    with pytest.raises(ValueError, match="percentile=40"):
        Q.PercentileObserver(percentile=40)
    with pytest.raises(ValueError, match="percentile=101"):
        Q.PercentileObserver(percentile=101)
    with pytest.raises(ValueError, match="bins=64 is fewer than the 128 levels"):
        Q.EntropyObserver(bins=64)


# ---------------------------------------------------------------- distributed

WORLD = 2


def _data(rank=None):
    g = torch.Generator().manual_seed(5)
    acts = [torch.randn(3000, generator=g) * (1 + i) for i in range(4)]
    weights = [torch.randn(4, 300, generator=g) * torch.linspace(0.5, 3, 4)[:, None] for _ in range(4)]
    return (acts, weights) if rank is None else (acts[rank::WORLD], weights[rank::WORLD])


def _observed(cls, acts, weights):
    """A per-tensor ``cls`` fed ``acts`` and a per-channel one fed ``weights``."""
    obs, pc = cls(), cls(**PER_CHANNEL)
    for a in acts:
        obs(a)
    for w in weights:
        pc(w)
    return obs, pc


def _worker(rank):
    acts, weights = _data(rank)
    out = {}
    for cls in CALIB:
        obs, pc = _observed(cls, acts, weights)
        first = (obs.calculate_qparams(), pc.calculate_qparams())
        second = (obs.calculate_qparams(), pc.calculate_qparams())          # no double counting
        out[cls.__name__] = (first, second, obs.histogram.sum().item())
    return out


@needs_gloo
def test_two_ranks_give_the_union_qparams():
    ranks = run_ranks(_worker, world=WORLD, pg_timeout_s=60)
    acts, weights = _data()
    x, w = torch.cat(acts), torch.cat(weights, 1)
    for cls in CALIB:
        union, pc = _observed(cls, acts, weights)
        for r in ranks:
            first, second, mass = r[cls.__name__]
            assert mass == pytest.approx(x.numel(), rel=1e-6)
            assert torch.equal(first[0][0], second[0][0]) and torch.equal(first[0][0], ranks[0][cls.__name__][0][0][0])
            torch.testing.assert_close(first[0][0], union.calculate_qparams()[0], rtol=0.03, atol=0)
            # per channel (sparse 256-bin histograms, rebinned when merged): as good on the union data
            assert sq_err(w, *first[1], Q.qint8, 0) <= 1.05 * sq_err(w, *pc.calculate_qparams(), Q.qint8, 0), cls
