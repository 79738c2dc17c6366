"""HistogramObserver: L2 error vs torch.ao's (the oracle to beat), the exact error model, the rebinning,
the sync-free (accelerator) path forced on CPU, edge cases, state_dict, and 2-rank merging."""

import io
import warnings

import numpy as np
import pytest
import torch
from dist_helpers import needs_gloo, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization.observer import HistogramObserver as AOHistogramObserver

import lowbit as Q
from lowbit.observer.histogram import HistogramObserver, _L2Model, _rebin

AFFINE = (Q.per_tensor_affine, Q.quint8, torch.per_tensor_affine, torch.quint8)
SYMMETRIC = (Q.per_tensor_symmetric, Q.qint8, torch.per_tensor_symmetric, torch.qint8)
N = 200_000


def stream(kind, seed=0, n_batches=4):
    g = torch.Generator().manual_seed(seed)
    if kind == "student_t3":  # heavy tails: t(3) = normal / sqrt(chi2(3) / 3)
        return [torch.randn(N, generator=g) / (torch.randn(3, N, generator=g).pow(2).mean(0)).sqrt()
                for _ in range(n_batches)]
    make = {
        "normal": lambda i: torch.randn(N, generator=g),
        "relu": lambda i: torch.relu(torch.randn(N, generator=g)),
        "grow_normal": lambda i: torch.randn(N, generator=g) * (1 + i),        # the range widens every batch
        "grow_relu": lambda i: torch.relu(torch.randn(N, generator=g) * (1 + i) + 0.2 * i),
    }[kind]
    return [make(i) for i in range(n_batches)]


def l2(x, qparams, qdtype):
    s, z = qparams
    fq = Q.fake_quantize(x, s.reshape(()), z.reshape(()), qdtype.quant_min, qdtype.quant_max)
    return (fq - x).pow(2).mean().item()


def observe(obs, batches):
    for b in batches:
        obs(b)
    return obs


@pytest.mark.parametrize("scheme", [AFFINE, SYMMETRIC], ids=["affine_quint8", "symmetric_qint8"])
@pytest.mark.parametrize("kind", ["normal", "student_t3", "relu", "grow_normal", "grow_relu"])
def test_l2_error_at_most_torch_ao(kind, scheme):
    qs, qd, tqs, tqd = scheme
    batches = stream(kind)
    x = torch.cat(batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = l2(x, observe(AOHistogramObserver(dtype=tqd, qscheme=tqs), batches).calculate_qparams(), qd)
    ours = l2(x, observe(HistogramObserver(qscheme=qs, qdtype=qd), batches).calculate_qparams(), qd)
    minmax = l2(x, Q.calculate_qparams(x.min(), x.max(), qs, qd), qd)
    assert ours <= ao, (ours, ao)
    assert ours < minmax


@pytest.mark.parametrize("kind", ["relu", "student_t3"])
def test_symmetric_scale_is_near_the_true_optimum(kind):
    """A brute-force scan of the actual MSE over scales finds nothing meaningfully better."""
    x = stream(kind, seed=3, n_batches=1)[0]
    s, z = observe(HistogramObserver(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8), [x]).calculate_qparams()
    scan = min(l2(x, (torch.tensor(c), z), Q.qint8) for c in (s * torch.linspace(0.8, 1.2, 81)).tolist())
    assert l2(x, (s, z), Q.qint8) <= scan * 1.001


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(2, 5000), st.floats(1e-3, 1e3), st.floats(-3, 3),
       st.sampled_from(["normal", "relu", "cauchy"]), st.sampled_from([AFFINE, SYMMETRIC]), st.sampled_from([64, 2048]))
def test_qparams_valid_and_never_worse_than_minmax_under_the_model(seed, n, scale, shift, kind, scheme, bins):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x = {"normal": x, "relu": x.relu(), "cauchy": x / torch.randn(n, generator=g)}[kind] * scale + shift * scale
    qs, qd = scheme[0], scheme[1]
    obs = observe(HistogramObserver(bins=bins, qscheme=qs, qdtype=qd), x.chunk(3))
    s, z = obs.calculate_qparams()
    assert torch.isfinite(s) and s > 0 and qd.quant_min <= int(z) <= qd.quant_max
    lo, hi = obs.min_val.double(), obs.max_val.double()
    if not hi > lo:  # every value equal (e.g. ReLU of two negatives): no histogram to search, min/max's grid
        ref = Q.calculate_qparams(lo.float(), hi.float(), qs, qd)
        assert torch.equal(s, ref[0]) and torch.equal(z, ref[1])
        return
    w = (hi - lo) / bins
    model = _L2Model(obs.histogram, float(-lo / w))
    err = lambda sz: model.exact((sz[0].double() / w).reshape(1), sz[1].double().reshape(1), qd)  # noqa: E731
    assert err((s, z)) <= err(Q.calculate_qparams(lo.float(), hi.float(), qs, qd)) * (1 + 1e-6) + 1e-9


def test_exact_model_equals_brute_force_integral():
    """``_L2Model.exact`` = ∫ (x - fake_quantize(x))² over the piecewise-uniform density, numerically."""
    g = torch.Generator().manual_seed(1)
    hist = torch.rand(16, generator=g, dtype=torch.float64) * 10
    model, z0 = _L2Model(hist, 5.3), 5.3
    s, zp = torch.tensor([0.7, 1.3], dtype=torch.float64), torch.tensor([3.0, 1.0], dtype=torch.float64)
    qd = Q.quint4.with_range(0, 9)
    u = (torch.arange(16 * 4000, dtype=torch.float64) + 0.5) / 4000  # midpoint rule, bin units
    density = hist.repeat_interleave(4000) / 4000
    for k in range(2):
        fq = ((torch.round((u - z0) / s[k]) + zp[k]).clamp(0, 9) - zp[k]) * s[k] + z0
        brute = ((u - fq) ** 2 * density).sum()
        torch.testing.assert_close(model.exact(s, zp, qd)[k], brute, rtol=1e-4, atol=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 64), st.floats(-5, 5), st.floats(0.1, 5), st.floats(0, 3), st.floats(0, 3), st.integers(0, 2**31))
def test_rebin_conserves_mass_and_is_proportional(bins, lo, width, grow_lo, grow_hi, seed):
    hist = torch.rand(bins, generator=torch.Generator().manual_seed(seed)) * 100
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    new_lo, new_hi = lo - grow_lo, lo + width + grow_hi
    out = _rebin(hist, t(lo), t(lo + width), t(new_lo), t(new_hi))
    torch.testing.assert_close(out.sum(), hist.sum(), rtol=1e-5, atol=1e-3)
    assert (out >= 0).all()
    # at every new edge, the cumulative mass is the old piecewise-linear CDF there (uniform mass in each bin)
    old_cdf = np.concatenate([[0.0], np.cumsum(hist.double().numpy())])
    new_edges = np.linspace(new_lo, new_hi, bins + 1)
    expected = np.interp(new_edges, np.linspace(lo, lo + width, bins + 1), old_cdf)
    np.testing.assert_allclose(np.concatenate([[0.0], np.cumsum(out.double().numpy())]), expected,
                               rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(_rebin(hist, t(lo), t(lo + width), t(lo), t(lo + width)), hist, rtol=1e-5, atol=1e-3)


def test_rebin_splits_bins_proportionally():
    hist = torch.tensor([4.0, 8.0, 0.0, 2.0])  # over [0, 4]
    t = lambda v: torch.tensor(v)  # noqa: E731
    assert _rebin(hist, t(0.0), t(4.0), t(0.0), t(8.0)).tolist() == [12.0, 2.0, 0.0, 0.0]
    assert _rebin(hist, t(0.0), t(4.0), t(-2.0), t(6.0)).tolist() == [0.0, 12.0, 2.0, 0.0]
    torch.testing.assert_close(_rebin(hist, t(0.0), t(4.0), t(-1.0), t(5.0)), torch.tensor([2.0, 10.0, 1.0, 1.0]))
    assert _rebin(hist, t(1.0), t(1.0), t(0.0), t(4.0)).tolist() == [0.0, 14.0, 0.0, 0.0]  # a point mass


def test_widening_loses_little():
    batches = stream("grow_normal", seed=5)
    obs = observe(HistogramObserver(), batches)
    lo, hi = obs.min_val.item(), obs.max_val.item()
    direct = torch.histc(torch.cat(batches), obs.bins, lo, hi)
    assert obs.histogram.sum().item() == pytest.approx(direct.sum().item(), rel=1e-6)
    assert (obs.histogram - direct).abs().sum() / direct.sum() < 0.02


@pytest.mark.parametrize("scheme", [AFFINE, SYMMETRIC], ids=["affine", "symmetric"])
def test_sync_free_path_matches_host_path(scheme):
    host, free = HistogramObserver(qscheme=scheme[0], qdtype=scheme[1]), HistogramObserver(qscheme=scheme[0],
                                                                                           qdtype=scheme[1])
    free.sync_free = True
    for b in stream("grow_relu", seed=2) + stream("normal", seed=4, n_batches=1):
        host(b)
        free(b)
    assert free.min_val == host.min_val and free.max_val == host.max_val
    assert free.histogram.sum().item() == pytest.approx(5 * N, rel=1e-6)
    assert host.histogram.sum().item() == pytest.approx(5 * N, rel=1e-6)
    assert (free.histogram - host.histogram).abs().sum() <= 1e-4 * N  # float rounding at bin edges only
    s_h, z_h = host.calculate_qparams()
    s_f, z_f = free.calculate_qparams()
    torch.testing.assert_close(s_f, s_h, rtol=1e-3, atol=0)
    assert abs(int(z_f) - int(z_h)) <= 1


@pytest.mark.parametrize("sync_free", [False, True])
def test_nan_and_inf_are_ignored(sync_free):
    clean = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    dirty = torch.cat([clean, torch.tensor([float("nan"), float("inf"), -float("inf")])])
    ref, obs = observe(HistogramObserver(), [clean]), HistogramObserver()
    obs.sync_free = sync_free
    with pytest.warns(UserWarning, match="NaN"):
        obs(dirty)
        qparams = obs.calculate_qparams()
    assert obs.min_val == ref.min_val and obs.max_val == ref.max_val
    assert obs.histogram.sum().item() == 10_000
    assert torch.equal(qparams[0], ref.calculate_qparams()[0])
    only_bad = HistogramObserver()
    only_bad.sync_free = sync_free
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        only_bad(torch.tensor([float("nan"), float("inf")]))
    assert not only_bad.is_calibrated and only_bad.histogram.sum() == 0


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("value", [0.0, 3.5, -2.0])
def test_constant_tensor_gives_finite_scale(value, sync_free):
    obs = HistogramObserver()
    obs.sync_free = sync_free
    obs(torch.full((100,), value))
    obs(torch.full((7,), value))
    s, z = obs.calculate_qparams()
    assert torch.isfinite(s) and s > 0 and Q.quint8.quant_min <= int(z) <= Q.quint8.quant_max
    assert torch.equal(s, Q.calculate_qparams(value, value)[0])
    obs(torch.tensor([value + 1.0]))  # widening from a point range keeps all the mass
    assert obs.histogram.sum().item() == 108


def test_empty_tensor_is_a_noop_and_uncalibrated_raises():
    obs = HistogramObserver()
    x = torch.empty(0, 3)
    assert obs(x) is x
    assert not obs.is_calibrated
    with pytest.raises(RuntimeError, match="HistogramObserver"):
        obs.calculate_qparams()
    obs(torch.tensor([1.0, 2.0]))
    assert obs.is_calibrated and obs(x) is x and obs.histogram.sum() == 2
    obs.reset_min_max_vals()
    assert not obs.is_calibrated and obs.histogram.sum() == 0
    with pytest.raises(RuntimeError, match="HistogramObserver"):
        obs.calculate_qparams()


def test_forward_is_identity_and_symmetric_qint8_works():
    x = torch.randn(4, 8)
    obs = HistogramObserver(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8)
    assert obs(x) is x
    s, z = obs.calculate_qparams()
    assert s.shape == () and z.dtype == torch.int64 and int(z) == 0 and s > 0


@pytest.mark.parametrize("bins, err", [(1, ValueError), (0, ValueError), (2.5, TypeError), (True, TypeError),
                                       ("8", TypeError)])
def test_bins_validation_names_the_value(bins, err):
    with pytest.raises(err, match=f"bins={bins!r}"):
        HistogramObserver(bins=bins)


def test_bad_arguments():
    with pytest.raises(ValueError, match="per_channel_affine"):
        HistogramObserver(qscheme=Q.per_channel_affine)
    with pytest.raises(TypeError, match="int64"):
        HistogramObserver()(torch.arange(4))
    with pytest.raises(TypeError, match="list"):
        HistogramObserver()([1.0])


def test_state_dict_round_trip():
    obs = observe(HistogramObserver(bins=512), stream("grow_relu", seed=9, n_batches=2))
    sd = obs.state_dict()
    assert set(sd) == {"eps", "histogram", "min_val", "max_val"}  # torch.ao's keys (eps since session 36)
    fresh = HistogramObserver()  # 2048 bins: the checkpoint's 512 are adopted
    fresh.load_state_dict(sd)
    assert fresh.bins == 512 and fresh.is_calibrated
    for a, b in zip(fresh.calculate_qparams(), obs.calculate_qparams()):
        assert torch.equal(a, b)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True)["histogram"], obs.histogram)  # no pickled code


def test_qconfig_factory_from_seed_003():
    qcfg = Q.QConfig(
        activation=HistogramObserver.with_args(qscheme=Q.per_tensor_affine, qdtype=Q.quint8),
        weight=Q.PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=Q.per_channel_symmetric, qdtype=Q.qint8),
    )
    act, act2 = qcfg.activation(), qcfg.activation()
    assert type(act).__name__ == "HistogramObserver" and act is not act2
    act(torch.randn(64))
    assert act.is_calibrated and not act2.is_calibrated


# -- two gloo ranks, each calibrating half the batches, agree with one process on all of them -------------

WORLD = 2


def _worker(rank):
    batches = stream("grow_normal", seed=11)
    obs = observe(HistogramObserver(), batches[rank::WORLD])
    first = obs.calculate_qparams()  # reduces (collective)
    second = obs.calculate_qparams()  # nothing new: local, no double counting
    obs(batches[0] * 0.5)  # new data on both ranks: the next reduction adds only it
    third = obs.calculate_qparams()
    return dict(first=first, second=second, third=third, hist=obs.histogram.clone())


@needs_gloo
def test_two_ranks_merge_histograms():
    ranks = run_ranks(_worker, world=WORLD, pg_timeout_s=30)
    batches = stream("grow_normal", seed=11)
    union = observe(HistogramObserver(), batches)
    expected = union.calculate_qparams()
    x = torch.cat(batches)
    for r in ranks:
        assert torch.equal(r["first"][0], ranks[0]["first"][0])  # every rank agrees
        assert torch.equal(r["first"][0], r["second"][0])
        assert l2(x, r["first"], Q.quint8) <= l2(x, expected, Q.quint8) * 1.002
        assert r["hist"].sum().item() == pytest.approx(4 * N + WORLD * N, rel=1e-6)  # union + both new batches
    union(batches[0] * 0.5)
    union(batches[0] * 0.5)
    torch.testing.assert_close(ranks[0]["third"][0], union.calculate_qparams()[0], rtol=2e-3, atol=0)
