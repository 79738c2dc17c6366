"""Lucid's documented variants as options next to the torch.ao-compatible defaults
(reference/lucid_quantization.md §2.3, §2.5, §2.10):

1. ``HistogramObserver(search="quantile")``: lucid's six-candidate quantile scan, checked against a
   line-by-line transcription of lucid's loop (the oracle), and shown to lose to our L2 search.
2. ``QConfigMapping(resolution="exact")``: exact name > exact type > global, no inheritance, no regex,
   ``.qconfig`` attributes ignored by ``prepare``.
3. ``nniqat.ConvBn*(..., bn_fold="running_stats")``: the eval-mode fold in training, BN never run.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
import lowbit.nn.intrinsic.qat as nniqat
from lowbit.observer.histogram import HistogramObserver, _L2Model, _quantile_clip_range


AFFINE, SYMMETRIC = (Q.per_tensor_affine, Q.quint8), (Q.per_tensor_symmetric, Q.qint8)
SCHEMES = pytest.mark.parametrize("scheme", [AFFINE, SYMMETRIC], ids=["affine_quint8", "symmetric_qint8"])


# ---- 1. HistogramObserver(search="quantile") ------------------------------------------------------------

def lucid_scan(counts: list[float], lo: float, hi: float, levels: int) -> tuple[float, float]:
    """lucid's ``HistogramObserver._search_clip_range`` (+ ``_quantile_from_hist``), loop for loop."""
    total = sum(counts)
    if total <= 0.0 or hi <= lo:
        return lo, hi
    width = (hi - lo) / len(counts)
    centers = [lo + (i + 0.5) * width for i in range(len(counts))]

    def quantile(q):
        acc = 0.0
        for c, n in zip(centers, counts):
            acc += n
            if acc >= q * total:
                return c
        return centers[-1]

    best_err, best = float("inf"), (lo, hi)
    for frac in (0.0, 1e-5, 1e-4, 1e-3, 5e-3, 1e-2):
        cmin, cmax = quantile(frac), quantile(1.0 - frac)
        if cmax <= cmin:
            continue
        step = (cmax - cmin) / max(levels, 1)
        err = sum(n * ((c - min(max(c, cmin), cmax)) ** 2 + step * step / 12.0)
                  for c, n in zip(centers, counts) if n != 0.0)
        if err < best_err:
            best_err, best = err, (cmin, cmax)
    return best


def levels(qd):
    return qd.quant_max - qd.quant_min


def observed(x, bins=2048, scheme=AFFINE, search="quantile"):
    obs = HistogramObserver(bins=bins, qscheme=scheme[0], qdtype=scheme[1], search=search)
    obs(x)
    return obs


def model_err(obs, qparams):
    """Our exact error model (``_L2Model.exact``) of the grid ``qparams`` on ``obs``'s histogram."""
    lo, hi = obs.min_val.item(), obs.max_val.item()
    w = (hi - lo) / obs.bins
    s, z = qparams
    e = _L2Model(obs.histogram, -lo / w).exact(torch.tensor([s.item() / w], dtype=torch.float64),
                                               torch.tensor([float(z)], dtype=torch.float64), obs.qdtype)
    return float(e[0]) * w * w


counts_st = st.lists(st.one_of(st.just(0.0), st.integers(0, 1000).map(float),
                               st.floats(0, 50, width=32)), min_size=2, max_size=64)


@settings(max_examples=150, deadline=None)
@given(counts_st, st.floats(-10, 10), st.floats(1e-3, 20), st.sampled_from([Q.quint8, Q.qint8, Q.qint4]))
def test_quantile_scan_is_lucids_loop(counts, lo, width, qd):
    hist = torch.tensor(counts, dtype=torch.float32)
    assert _quantile_clip_range(hist, lo, lo + width, qd) == lucid_scan(hist.tolist(), lo, lo + width, levels(qd))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=300), st.integers(2, 300),
       st.sampled_from([AFFINE, SYMMETRIC]))
def test_quantile_observer_property_valid_qparams_from_lucids_range(values, bins, scheme):
    obs = observed(torch.tensor(values), bins, scheme)
    lo, hi = obs.min_val.item(), obs.max_val.item()
    cmin, cmax = lucid_scan(obs.histogram.tolist(), lo, hi, levels(scheme[1]))
    assert lo <= cmin <= cmax <= hi
    s, z = obs.calculate_qparams()
    expect = Q.calculate_qparams(torch.tensor(cmin), torch.tensor(cmax), *scheme)
    assert torch.equal(s, expect[0]) and torch.equal(z, expect[1])
    assert math.isfinite(s.item()) and s.item() > 0 and scheme[1].quant_min <= int(z) <= scheme[1].quant_max


def test_spec_quirks_bin_centres_and_skipped_candidates():
    # frac = 0 is "no clipping", yet half a bin narrower than the raw range on each side
    obs = observed(torch.tensor([-1.0, 3.0]), bins=8)  # bin width 0.5
    assert _quantile_clip_range(obs.histogram, -1.0, 3.0, Q.quint8) == (-0.75, 2.75)
    s, z = obs.calculate_qparams()
    torch.testing.assert_close(s, torch.tensor(3.5 / 255))
    assert int(z) == round(0.75 / s.item())  # 55: -0.75 is on the grid, -1.0 is clipped
    l2_s = observed(torch.tensor([-1.0, 3.0]), bins=8, search="l2").calculate_qparams()[0]
    assert l2_s.item() > s.item()  # our search keeps both spikes
    # cmin is centres[0] even when bin 0 is empty (the target 0 is met at once)
    assert _quantile_clip_range(torch.tensor([0.0, 5.0, 0.0, 0.0]), 0.0, 4.0, Q.quint8) == (0.5, 1.5)
    # every candidate has cmax <= cmin: the raw range
    assert _quantile_clip_range(torch.tensor([5.0, 0.0, 0.0, 0.0]), 0.0, 4.0, Q.quint8) == (0.0, 4.0)
    assert _quantile_clip_range(torch.zeros(4), 0.0, 4.0, Q.quint8) == (0.0, 4.0)


def test_quantile_scan_clips_heavy_tails_but_keeps_a_lone_outlier():
    g = torch.Generator().manual_seed(0)
    t3 = torch.randn(100_000, generator=g) / torch.randn(3, 100_000, generator=g).pow(2).mean(0).sqrt()
    obs = observed(t3)
    lo, hi = obs.min_val.item(), obs.max_val.item()
    cmin, cmax = _quantile_clip_range(obs.histogram, lo, hi, Q.quint8)
    assert cmax < hi - (hi - lo) / obs.bins  # a frac > 0 candidate won: the tail is clipped
    # one value at 50 among 1e5 normals: clipping it costs ~46² = 2100, its range only ~1e5·(54/255)²/12 = 380
    x = torch.cat([torch.randn(100_000, generator=g), torch.tensor([50.0])])
    obs = observed(x)
    w = (50.0 - obs.min_val.item()) / obs.bins
    assert _quantile_clip_range(obs.histogram, obs.min_val.item(), 50.0, Q.quint8)[1] == 50.0 - w / 2


DISTS = {
    "normal": lambda g: torch.randn(50_000, generator=g),
    "student_t3": lambda g: torch.randn(50_000, generator=g) / torch.randn(3, 50_000, generator=g).pow(2).mean(0).sqrt(),
    "relu": lambda g: torch.relu(torch.randn(50_000, generator=g)),
    "uniform": lambda g: torch.rand(50_000, generator=g) * 3 - 1,
    "bimodal": lambda g: torch.cat([torch.randn(25_000, generator=g) - 4, torch.randn(25_000, generator=g) * 0.3 + 2]),
    "outlier": lambda g: torch.cat([torch.randn(50_000, generator=g), torch.tensor([40.0])]),
}


@SCHEMES
@pytest.mark.parametrize("dist", list(DISTS))
def test_l2_search_beats_the_quantile_scan_under_the_exact_model(dist, scheme):
    x = DISTS[dist](torch.Generator().manual_seed(3))
    l2, quantile = observed(x, scheme=scheme, search="l2"), observed(x, scheme=scheme, search="quantile")
    assert torch.equal(l2.histogram, quantile.histogram)
    e_l2, e_q = model_err(l2, l2.calculate_qparams()), model_err(quantile, quantile.calculate_qparams())
    assert e_l2 <= e_q, (e_l2, e_q)
    qd = scheme[1]
    data_err = [(Q.fake_quantize(x, *o.calculate_qparams(), qd.quant_min, qd.quant_max) - x).pow(2).sum()
                for o in (l2, quantile)]
    assert data_err[0] <= data_err[1] * 1.001  # and on the data itself (the model's bins are not the data)


def test_search_option_state_dict_repr_with_args_and_errors():
    x = DISTS["student_t3"](torch.Generator().manual_seed(1))
    obs = observed(x, bins=512)
    sd = obs.state_dict()
    assert set(sd) == {"eps", "histogram", "min_val", "max_val"}  # search is a setting, not state
    fresh_q, fresh_l2 = HistogramObserver(search="quantile"), HistogramObserver()
    fresh_q.load_state_dict(sd)
    fresh_l2.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh_q.calculate_qparams(), obs.calculate_qparams()))
    l2_ref = observed(x, bins=512, search="l2").calculate_qparams()
    assert all(torch.equal(a, b) for a, b in zip(fresh_l2.calculate_qparams(), l2_ref))
    assert "search='quantile'" in repr(obs) and "search='l2'" in repr(HistogramObserver())
    assert HistogramObserver.with_args(search="quantile")().search == "quantile"
    assert HistogramObserver().search == "l2"  # the default is unchanged
    for bad in ("mse", "Quantile", None, 1):
        with pytest.raises(ValueError, match=f"search={bad!r}"):
            HistogramObserver(search=bad)
    with pytest.raises(ValueError, match="search='L2'"):
        obs.search = "L2"


# ---- 2. QConfigMapping(resolution="exact") --------------------------------------------------------------

A, B, C = Q.get_minmax_qconfig(), Q.get_default_qconfig(), Q.get_default_qat_qconfig()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), act=nn.ReLU(),
                                                 inner=nn.Sequential(OrderedDict(fc=nn.Linear(4, 4)))))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


def propagated(mapping, model=None):
    model = Q.propagate_qconfig_(Net() if model is None else model, mapping)
    return {name: mod.qconfig for name, mod in model.named_modules()}


def test_exact_mode_does_not_reach_children():
    """The spec's example: ``set_module_name("encoder", qc)`` does not cover ``encoder.fc``."""
    hier = Q.QConfigMapping().set_global(A).set_module_name("encoder", B)
    exact = Q.QConfigMapping(resolution="exact").set_global(A).set_module_name("encoder", B)
    assert propagated(hier) == {"": A, "encoder": B, "encoder.fc": B, "encoder.act": B, "encoder.inner": B,
                                "encoder.inner.fc": B, "head": A}
    assert propagated(exact) == {"": A, "encoder": B, "encoder.fc": A, "encoder.act": A, "encoder.inner": A,
                                 "encoder.inner.fc": A, "head": A}
    # None excludes only the module named, not its subtree
    assert propagated(Q.QConfigMapping(resolution="exact").set_global(A).set_module_name("encoder", None)) == \
        {"": A, "encoder": None, "encoder.fc": A, "encoder.act": A, "encoder.inner": A, "encoder.inner.fc": A,
         "head": A}


def test_exact_mode_precedence_is_lucids_get_qconfig():
    m = (Q.QConfigMapping(resolution="exact").set_global(A).set_object_type(nn.Linear, B)
         .set_module_name("encoder.inner.fc", C).set_module_name("head", None).set_module_name("encoder", C))
    got = propagated(m)
    assert got == {name: m.get_qconfig(type(mod), name) for name, mod in Net().named_modules()}
    assert got["encoder.fc"] is B and got["encoder.inner.fc"] is C and got["head"] is None  # name > type
    assert got["encoder.act"] is A  # the parent's C is not inherited
    sub = type("MyLinear", (nn.Linear,), {})
    assert m.get_qconfig(sub, "x") is A  # exact types: a subclass is not matched


def test_exact_mode_prepare_ignores_attributes_and_converts():
    model = Net()
    model.encoder.fc.qconfig = None  # hierarchical: honoured; exact (lucid): ignored
    hier = Q.prepare(model, Q.QConfigMapping().set_global(A).set_module_name("encoder", None))
    exact = Q.prepare(model, Q.QConfigMapping(resolution="exact").set_global(A).set_module_name("encoder", None))
    observed_names = lambda m: {n for n, mod in m.named_modules() if hasattr(mod, "activation_post_process")}  # noqa: E731
    assert observed_names(hier) == {"head"}
    assert observed_names(exact) == {"encoder.fc", "encoder.inner.fc", "head"}
    exact(torch.randn(32, 4))
    q = Q.convert(exact)
    assert all(type(mod).__module__.startswith("lowbit.nn.quantized")
               for mod in (q.encoder.fc, q.encoder.inner.fc, q.head))


def test_exact_mode_errors_and_repr():
    for bad in ("flat", "Exact", None):
        with pytest.raises(ValueError, match=f"resolution={bad!r}"):
            Q.QConfigMapping(resolution=bad)
    with pytest.raises(ValueError, match=r"pattern='enc\.\*'.*resolution='exact'"):
        Q.QConfigMapping(resolution="exact").set_module_name_regex("enc.*", A)
    assert "resolution='exact'" in repr(Q.QConfigMapping(resolution="exact").set_global(A))
    assert "resolution" not in repr(Q.QConfigMapping().set_global(A))
    assert Q.QConfigMapping().resolution == "hierarchical"
    assert copy.deepcopy(Q.QConfigMapping(resolution="exact")).resolution == "exact"
    with pytest.raises(AttributeError):
        Q.QConfigMapping().resolution = "exact"  # fixed at construction (regexes may already be set)


# ---- 3. QAT ConvBn bn_fold="running_stats" --------------------------------------------------------------

QAT = Q.get_default_qat_qconfig()


def bn_pair(kind, seed=0):
    torch.manual_seed(seed)
    layer, bn, x = {
        "ConvBn2d": (nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), torch.randn(8, 3, 6, 6)),
        "ConvBnReLU1d": (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), torch.randn(8, 3, 9)),
        "LinearBn1d": (nn.Linear(5, 4), nn.BatchNorm1d(4), torch.randn(16, 5)),
    }[kind]
    with torch.no_grad():  # running statistics and affine parameters away from their init
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return layer, bn, x


@pytest.mark.parametrize("kind", ["ConvBn2d", "ConvBnReLU1d", "LinearBn1d"])
def test_running_stats_fold_is_the_eval_fold_at_every_step(kind):
    layer, bn, x = bn_pair(kind)
    q = getattr(nniqat, kind)(layer, bn, qconfig=QAT, bn_fold="running_stats").train()
    stats = [t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    w0 = layer.weight.detach().clone()
    for step in range(3):
        y = q(x + 0.1 * step)
        with torch.no_grad():
            twin = copy.deepcopy(q)
            twin.bn_fold = "batch_stats"
            torch.testing.assert_close(y, twin.eval()(x + 0.1 * step), atol=1e-5, rtol=1e-5)  # torch.ao eval
            torch.testing.assert_close(y, q.fold()(x + 0.1 * step), atol=1e-5, rtol=1e-5)  # what convert folds
        opt.zero_grad()
        y.pow(2).mean().backward()
        for p in (layer.weight, bn.weight, bn.bias):
            assert p.grad is not None and p.grad.abs().sum() > 0  # gradients reach W, gamma, beta
        opt.step()
        for a, b in zip(stats, (bn.running_mean, bn.running_var, bn.num_batches_tracked)):
            assert torch.equal(a, b)  # BN never ran
    assert not torch.equal(w0, layer.weight)


def test_batch_stats_stays_the_default():
    layer, bn, x = bn_pair("ConvBn2d")
    q = nniqat.ConvBn2d(layer, bn, qconfig=QAT)
    assert q.bn_fold == "batch_stats" and "bn_fold='batch_stats'" in repr(q)
    mean = bn.running_mean.clone()
    q.train()(x)
    assert int(bn.num_batches_tracked) == 1 and not torch.equal(mean, bn.running_mean)


def fused_model():
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), Q.DeQuantStub())
    with torch.no_grad():
        m[2].running_mean.uniform_(-0.5, 0.5)
        m[2].running_var.uniform_(0.5, 2)
    return Q.fuse_modules_qat(m.train(), [["1", "2", "3"]])


def test_set_bn_fold_mode_before_and_after_prepare_qat():
    before = Q.prepare_qat(Q.set_bn_fold_mode(fused_model(), "running_stats"), QAT)
    after = Q.set_bn_fold_mode(Q.prepare_qat(fused_model(), QAT), "running_stats")
    x = torch.randn(4, 3, 8, 8)
    for m in (before, after):
        assert type(m[1]) is nniqat.ConvBnReLU2d and m[1].bn_fold == "running_stats"
        m(x)
        assert int(m[1].bn.num_batches_tracked) == 0
    torch.testing.assert_close(before(x), after(x))
    assert Q.prepare_qat(fused_model(), QAT)[1].bn_fold == "batch_stats"
    with pytest.raises(ValueError, match="bn_fold='lucid'"):
        Q.set_bn_fold_mode(before, "lucid")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        Q.set_bn_fold_mode("model", "running_stats")
    with pytest.raises(ValueError, match="ConvBn2d: bn_fold=None"):
        nniqat.ConvBn2d(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), qconfig=QAT, bn_fold=None)
    with pytest.raises(ValueError, match="bn_fold='eval'"):
        before[1].bn_fold = "eval"


def test_convert_of_either_mode_gives_the_same_int8_conv():
    batch = Q.prepare_qat(fused_model(), QAT)
    running = Q.set_bn_fold_mode(copy.deepcopy(batch), "running_stats")
    x = torch.randn(16, 3, 8, 8)
    for m in (batch, running):
        m.eval()(x)  # the same calibration batch: eval-mode batch_stats is the running-stats fold
    qb, qr = Q.convert(batch), Q.convert(running)
    wb, wr = qb[1].weight(), qr[1].weight()
    assert torch.equal(wb.int_repr(), wr.int_repr())
    assert torch.equal(wb.q_per_channel_scales(), wr.q_per_channel_scales())
    torch.testing.assert_close(qb[1].bias, qr[1].bias)
    torch.testing.assert_close(qb[1].scale, qr[1].scale)
    torch.testing.assert_close(qb(x), qr(x))
    assert (qr(x) - running(x)).abs().max() <= 1.01 * float(qr[1].scale)  # the int8 conv keeps the QAT numerics
