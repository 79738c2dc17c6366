"""Session 36: observer state, fixed-qparams mappings, KL on one-sided data, prepare_qat's qconfigs, graph-mode
chunk / split (each test fails before its fix; torch.ao.quantization is the oracle where it has a behaviour)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.ao.quantization.observer as tao
from torch import nn

import lowbit as Q

# -- 1. eps travels in state_dict, as torch.ao's eps buffer --------------------------------------------------------

_PAIRS = [
    (Q.MinMaxObserver, tao.MinMaxObserver),
    (Q.PerChannelMinMaxObserver, tao.PerChannelMinMaxObserver),
    (Q.HistogramObserver, tao.HistogramObserver),
    (Q.MovingAverageMinMaxObserver, tao.MovingAverageMinMaxObserver),
    (Q.MovingAveragePerChannelMinMaxObserver, tao.MovingAveragePerChannelMinMaxObserver),
]


@pytest.mark.parametrize("ours, theirs", _PAIRS, ids=[p[0].__name__ for p in _PAIRS])
def test_observer_state_dict_keys_are_torch_aos(ours, theirs):
    sd, tsd = ours().state_dict(), theirs().state_dict()
    assert list(sd) == list(tsd)
    assert sd["eps"].shape == tsd["eps"].shape == (1,) and sd["eps"].dtype == torch.float64  # exact round trip
    # torch.ao's strict load of a lowbit checkpoint finds every key, and adopts the eps
    o = ours(eps=1e-3)
    o(torch.randn(4, 8))
    t = theirs()
    t.load_state_dict(o.state_dict())
    assert float(t.eps) == pytest.approx(1e-3)


def test_fixed_and_placeholder_observers_save_what_torch_aos_save():
    assert list(Q.FixedQParamsObserver(1 / 256, 0).state_dict()) == ["scale", "zero_point"]
    assert list(Q.PlaceholderObserver().state_dict()) == list(tao.PlaceholderObserver().state_dict()) == []
    assert list(Q.FakeQuantize().state_dict()) == sorted(tq.FakeQuantize().state_dict(), key=list(
        Q.FakeQuantize().state_dict()).index)  # same key set
    assert set(Q.FakeQuantize().state_dict()) == set(tq.FakeQuantize().state_dict())


@pytest.mark.parametrize("cls", [Q.MinMaxObserver, Q.MovingAverageMinMaxObserver, Q.HistogramObserver,
                                 Q.EntropyObserver, Q.PercentileObserver, Q.MSEObserver])
def test_non_default_eps_survives_save_and_load(cls):
    """A checkpoint of an observer with eps=1e-2 on a range below it, loaded into a default observer, gave the
    default eps's scale (1e-8 floor) silently: the eps was not saved."""
    obs = cls(eps=1e-2)
    obs(torch.linspace(0, 1e-4, 100))
    fresh = cls()
    fresh.load_state_dict(obs.state_dict())
    assert fresh.eps == pytest.approx(1e-2)
    for a, b in zip(fresh.calculate_qparams(), obs.calculate_qparams()):
        assert torch.equal(a, b)
    assert float(fresh.calculate_qparams()[0]) >= 1e-2 * (1 - 1e-6)  # the floor holds (the default gives ~4e-7)


def test_per_channel_eps_and_default_eps_round_trip_exactly():
    obs = Q.PerChannelMinMaxObserver(eps=0.5)
    obs(torch.randn(3, 5) * 1e-3)
    fresh = Q.PerChannelMinMaxObserver()
    fresh.load_state_dict(obs.state_dict())
    assert torch.equal(fresh.calculate_qparams()[0], torch.full((3,), 0.5))
    d = Q.MinMaxObserver()
    d.load_state_dict(Q.MinMaxObserver().state_dict())
    assert d.eps == 1e-8  # the default's float32 value keeps the exact Python float


def test_checkpoints_without_eps_still_load():
    """lowbit's checkpoints before session 36 have no eps key: a strict load keeps the observer's own eps."""
    obs = Q.MinMaxObserver()
    obs(torch.randn(16))
    old = {k: v for k, v in obs.state_dict().items() if k != "eps"}
    fresh = Q.MinMaxObserver(eps=1e-4)
    fresh.load_state_dict(old)  # strict
    assert fresh.eps == 1e-4 and torch.equal(fresh.max_val, obs.max_val)
    model = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), Q.DeQuantStub())
    prepared = Q.prepare(model, Q.get_minmax_qconfig())
    prepared(torch.randn(8, 4))
    stats = Q.get_observer_state_dict(prepared)
    assert any(k.endswith(".eps") for k in stats)
    old_stats = {k: v for k, v in stats.items() if not k.endswith(".eps")}
    again = Q.prepare(model, Q.get_minmax_qconfig())
    Q.load_observer_state_dict(again, old_stats)
    Q.load_observer_state_dict(again, stats)


def test_learnable_fake_quant_floor_follows_a_loaded_eps():
    f = Q.LearnableFakeQuantize(observer=Q.MovingAverageMinMaxObserver.with_args(eps=1e-2))
    g = Q.LearnableFakeQuantize()
    g.load_state_dict(f.state_dict())
    assert g.eps == pytest.approx(1e-2)


# -- 2. the default mappings pin torch.ao's fixed grids for sigmoid / tanh / hardsigmoid / softmax --------------------

def _fixed_entries(mapping) -> dict:
    """``{object type: (scale, zero_point)}`` for the mapping's fixed-qparams entries (lowbit's or torch.ao's)."""
    out = {}
    for op, qc in mapping.to_dict()["object_type"]:
        if isinstance(op, str) or qc is None:
            continue  # torch.ao's method names ("sigmoid_"): lowbit resolves a method call through its function
        obs = qc.activation()
        obs = getattr(obs, "activation_post_process", obs)
        if "FixedQParams" in type(obs).__name__:
            out[op] = (float(obs.scale), int(obs.zero_point))
    return out


@pytest.mark.parametrize("qat", [False, True])
def test_default_mappings_have_torch_aos_fixed_qparams_entries(qat):
    ours = Q.get_default_qat_qconfig_mapping() if qat else Q.get_default_qconfig_mapping()
    theirs = tq.get_default_qat_qconfig_mapping() if qat else tq.get_default_qconfig_mapping()
    assert _fixed_entries(ours) == _fixed_entries(theirs)
    assert _fixed_entries(ours)[torch.tanh] == (2 / 256, 128) and _fixed_entries(ours)[nn.Sigmoid] == (1 / 256, 0)
    kind = Q.FixedQParamsFakeQuantize if qat else Q.FixedQParamsObserver
    assert isinstance(ours.object_type_qconfigs[nn.Softmax].activation(), kind)


class _Fixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(7))
        self.sig, self.hs, self.sm = nn.Sigmoid(), nn.Hardsigmoid(), nn.Softmax(-1)

    def forward(self, x):
        lin = self.lins
        return (self.sig(lin[0](x)), torch.tanh(lin[1](x)), self.hs(lin[2](x)), lin[3](x).sigmoid(),
                torch.nn.functional.hardsigmoid(lin[4](x)), lin[6](self.sm(lin[5](x))))


def _ao_oracle(prepared: nn.Module) -> nn.Module:
    """torch.ao's converted model as the oracle: its int8 kernels on a CPU with VNNI; its reference model (quantize /
    dequantize around float ops: the same grids, ties aside) without, where fbgemm's and oneDNN's u8 x s8 kernels
    saturate their int16 pair sums on full-range 8-bit activations (docs/design.md, "Kernels on CPUs without VNNI")."""
    from torch.ao.quantization.quantize_fx import convert_fx, convert_to_reference_fx

    from lowbit.kernels import onednn

    return (convert_fx if onednn.has_vnni() else convert_to_reference_fx)(prepared)


def test_prepare_fx_default_mapping_fixed_grids_match_torch_ao():
    """Before, sigmoid / tanh / hardsigmoid outputs were observed (a histogram grid, e.g. 0.0027 for a sigmoid seen in
    [0.03, 0.97]) and the Linear after a softmax quantized its input on the observed range; torch.ao pins 1/256 and
    2/256 grids. With min/max everywhere else, lowbit's int8 outputs are torch.ao's within one step of the grid."""
    from torch.ao.quantization.quantize_fx import prepare_fx

    torch.manual_seed(0)
    model = _Fixed().eval()
    x = torch.randn(64, 8) * 3
    tqc = tq.QConfig(activation=tao.MinMaxObserver.with_args(dtype=torch.quint8),
                     weight=tao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = prepare_fx(copy.deepcopy(model), tq.get_default_qconfig_mapping().set_global(tqc), (x,))
        tp(x)
        ours = Q.prepare_fx(model, Q.get_default_qconfig_mapping().set_global(Q.get_minmax_qconfig()), (x,))
        ours(x)
        converted = Q.convert_fx(ours)
        t_out, l_out = _ao_oracle(tp)(x), converted(x)
    steps = [1 / 256, 2 / 256, 1 / 256, 1 / 256, 1 / 256]
    for i, (t, mine, step) in enumerate(zip(t_out, l_out, steps)):
        t, mine = t.dequantize(), mine.dequantize() if hasattr(mine, "dequantize") else mine
        assert torch.equal(torch.round(mine / step) * step, mine), i  # on the fixed grid
        assert (t - mine).abs().max().item() <= step + 1e-6, i
    t, mine = t_out[5].dequantize(), l_out[5].dequantize() if hasattr(l_out[5], "dequantize") else l_out[5]
    assert (t - mine).abs().max().item() <= 1.01 * float(converted.get_submodule("lins.6").scale)
    sm_obs = [m for m in converted.modules() if type(m).__name__ == "Quantize"]
    assert any(abs(float(q.scale) - 1 / 256) < 1e-9 and int(q.zero_point) == 0 for q in sm_obs), sm_obs


# -- 3. KL calibration on one-sided data follows TensorRT's entropy calibration -------------------------------------

def _tensorrt_kl_bins(hist: torch.Tensor, unsigned: bool, start_bin: int = 128) -> int:
    """TensorRT's entropy calibration (pytorch-quantization's ``_compute_amax_entropy``, 8 bits, stride 1), written
    from its definition: the zero bin counts as its neighbour; for each ``i >= start_bin``, P = the first ``i`` bins
    with the rest added to the last, Q = the ``i`` bins merged into ``2^(7 + unsigned)`` equal groups, each group's
    mass spread over its non-empty bins; the last ``i`` of least KL(P || Q) (infinite where Q is 0 and P is not)."""
    bins = hist.to(torch.float64).clone()
    bins[0] = bins[1]
    levels = 1 << (7 + int(unsigned))
    best, best_i = float("inf"), -1
    for i in range(start_bin, bins.numel() + 1):
        h = bins[:i]
        group = torch.arange(i) * levels // i
        nonempty = (h > 0).to(torch.float64)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, group, h)
        count = torch.zeros(levels, dtype=torch.float64).index_add_(0, group, nonempty)
        q = torch.where(h > 0, mass[group] / count[group].clamp_min(1), 0.0)
        p = h.clone()
        p[-1] += bins[i:].sum()
        p, q = p / p.sum(), q / q.sum()
        m = p > 0
        kl = float("inf") if bool((q[m] == 0).any()) else float((p[m] * (p[m] / q[m]).log()).sum())
        if kl <= best:
            best, best_i = kl, i
    return best_i


@pytest.mark.parametrize("seed", range(4))
def test_entropy_range_of_relu_outputs_matches_tensorrt(seed):
    """A ReLU's output (half the mass exactly 0, a long tail): the zero spike in the first bin made every candidate
    but the smallest pay for it, so the range was clipped near 6 whatever the data (seeds 0, 1, 3: 6.2 where TensorRT
    picks 21.4, 4.1, 4.3), and candidates below 256 bins (TensorRT's start_bin 128) were never scored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.relu(torch.randn(100000, generator=g)), torch.rand(30, generator=g) * 20 + 4])
    obs = Q.EntropyObserver(bins=1024)  # (<= 1024 candidates from bin 128 on: every one is scored, as stride 1)
    obs(x)
    i = _tensorrt_kl_bins(obs.histogram.reshape(-1), unsigned=True)
    cmin, cmax = obs.clip_range()
    assert float(cmin) == 0.0
    assert float(cmax) == pytest.approx(i * float(x.max()) / 1024, rel=1e-6)


def test_entropy_range_of_signed_data_matches_tensorrt():
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(50000, generator=g), torch.randn(20, generator=g) * 15])
    obs = Q.EntropyObserver(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8, bins=1024)
    obs(x)
    from lowbit.observer.channel_histogram import magnitude_histogram

    mag, amax = magnitude_histogram(obs.histogram.reshape(1, -1), obs.min_val.reshape(1), obs.max_val.reshape(1))
    i = _tensorrt_kl_bins(mag[0], unsigned=False)
    assert float(obs.clip_range()[1]) == pytest.approx(i * float(amax) / 1024, rel=1e-6)


# -- 4. prepare_qat keeps a post-training .qconfig (as torch.ao) and now says so ------------------------------------

def _qat_model() -> nn.Module:
    return nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.ReLU(), Q.DeQuantStub())


def test_prepare_qat_warns_about_a_kept_post_training_qconfig():
    """torch.ao's prepare_qat keeps a PTQ ``.qconfig`` silently: the QAT Linear's weight_fake_quant is then an
    observer and training never sees the grid. lowbit keeps it too (same modules as torch.ao) and warns naming them."""
    m = _qat_model()
    m.qconfig = Q.get_default_qconfig()
    with pytest.warns(UserWarning, match=r"'1' \(PerChannelMinMaxObserver as weight_fake_quant\).*post-training qconfig"):
        p = Q.prepare_qat(m)
    t = nn.Sequential(tq.QuantStub(), nn.Linear(4, 4), nn.ReLU(), tq.DeQuantStub())
    t.qconfig = tq.get_default_qconfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tq.prepare_qat(t.train())
    assert type(p[1].weight_fake_quant).__name__ == type(tp[1].weight_fake_quant).__name__ == "PerChannelMinMaxObserver"


@pytest.mark.parametrize("qconfig", [None, "qat", "x86", "lsq", "dynamic_qat"])
def test_prepare_qat_with_qat_qconfigs_does_not_warn(qconfig):
    qc = {None: None, "qat": Q.get_default_qat_qconfig(), "x86": Q.get_default_qat_qconfig("x86"),
          "lsq": Q.get_lsq_qat_qconfig(), "dynamic_qat": Q.get_dynamic_qat_qconfig()}[qconfig]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Q.prepare_qat(_qat_model(), qc)
        emb = nn.Sequential(nn.Embedding(10, 4))
        emb[0].qconfig = Q.get_embedding_qat_qconfig()
        Q.prepare_qat(emb)


# -- 5. a dynamic QAT Linear under convert's default mapping: the warning names the missing entry --------------------

def test_convert_of_dynamic_qat_linear_names_the_missing_mapping_entry():
    """Before: "no prepared module found (run prepare() ...)" though the model was prepared and trained; the cause is
    that convert's default (static) mapping has no entry for lowbit.nn.qat.dynamic.Linear (torch.ao's neither)."""
    from lowbit.nn.qat import dynamic as qatd
    from lowbit.nn.quantized import dynamic as qd

    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    p = Q.prepare_qat(m, Q.get_dynamic_qat_qconfig(), mapping={nn.Linear: qatd.Linear})
    p(torch.randn(8, 4))
    with pytest.warns(UserWarning, match=r"no entry in convert's mapping.*lowbit\.nn\.qat\.dynamic\.Linear") as rec:
        _, report = Q.convert(p.eval(), return_report=True)
    assert not any("no prepared module found" in str(w.message) for w in rec)
    assert "pass mapping=" in report.left_float["0"]
    out = Q.convert(p.eval(), mapping={qatd.Linear: qd.Linear})  # the entry the message names
    assert isinstance(out[0], qd.Linear) and isinstance(out[2], qd.Linear)
    with pytest.warns(UserWarning, match="no prepared module found"):  # an unprepared model keeps the old message
        Q.convert(nn.Sequential(nn.Linear(2, 2)))


# -- 6. graph mode: chunk / split / unbind as torch.ao; star-unpacking or looping over the parts is named -------------

class _Chunks(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.lin = how, nn.Linear(8, 8)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.how == "torch.chunk":
            u, v = torch.chunk(y, 2, dim=-1)
        elif self.how == "method":
            u, v = y.chunk(2, -1)
        elif self.how == "torch.split":
            u, v = torch.split(y, [4, 4], dim=-1)
        elif self.how == "split_size":
            u, v = torch.split(y, y.size(-1) // 2, -1)
        else:
            parts = y.split(4, -1)
            u, v = parts[0], parts[-1]
        return self.a(u) + self.b(v)


@pytest.mark.parametrize("how", ["torch.chunk", "method", "torch.split", "split_size", "index"])
def test_chunk_and_split_in_graph_mode_match_torch_ao(how):
    from torch.ao.quantization.quantize_fx import prepare_fx

    torch.manual_seed(0)
    model, x = _Chunks(how).eval(), torch.randn(16, 8)
    tqc = tq.QConfig(activation=tao.MinMaxObserver.with_args(dtype=torch.quint8),
                     weight=tao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = prepare_fx(copy.deepcopy(model), tq.QConfigMapping().set_global(tqc), (x,))
        tp(x)
        expected = _ao_oracle(tp)(x)
    ours = Q.prepare_fx(copy.deepcopy(model), Q.get_minmax_qconfig(), (x,))
    assert not ours.lowbit_report.untraceable
    ours(x)
    reference = Q.convert_to_reference_fx(copy.deepcopy(ours))(x)
    got = Q.convert_fx(ours)(x)
    got = got.dequantize() if not isinstance(got, torch.Tensor) else got
    # since session 38 the parts keep the codes of `lin`'s output (an indexed chunk / split is a grid-preserving op),
    # where torch.ao observes each part and quantizes it again: lowbit equals its own reference model, is no further
    # from float than torch.ao, and differs from it by at most one step of the output grid
    assert torch.equal(got, reference.dequantize() if not isinstance(reference, torch.Tensor) else reference)
    f = model(x)
    assert (got - f).pow(2).mean() <= (expected - f).pow(2).mean()
    assert (got - expected).abs().max().item() <= 0.0093  # one step of the output grid here (0.00923)


class _StarUnpack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.a = nn.Linear(8, 8), nn.Linear(2, 4)

    def forward(self, x):
        first, *rest = self.lin(x).split(2, dim=-1)
        return self.a(first) + self.a(rest[0])


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = _StarUnpack(), nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.inner(x))


@pytest.mark.parametrize("model", [_StarUnpack, _Outer])
def test_star_unpacking_a_split_names_the_node_and_the_line(model):
    """torch.fx cannot iterate a traced tensor (torch.ao's prepare_fx raises "Proxy object cannot be iterated"); lowbit
    prepares the children one by one, and the warning and report now name the split node, the source line and the
    traceable spellings (before: torch.fx's bare message)."""
    torch.manual_seed(0)
    m, x = model().eval(), torch.randn(16, 8)
    path = "<root>" if model is _StarUnpack else "inner"
    with pytest.warns(UserWarning, match=r"node 'split', split\) at test_observer_s36\.py:\d+ `first, \*rest = "):
        p = Q.prepare_fx(m, Q.get_minmax_qconfig(), (x,))
    assert "unpacked into a fixed number of names" in p.lowbit_report.untraceable[path]
    p(x)
    assert (Q.convert_fx(p)(x) - m(x)).abs().max().item() < 0.1  # the children are still quantized


# -- 7. best_of_ranges: max_rows counts samples (leading dimension) and keeps the batch that reaches it whole ---------

def test_best_of_max_rows_is_what_the_docstring_says(monkeypatch):
    """The docstring said "at most max_rows rows (tokens / pixels)"; the code counts the leading dimension of the
    layer's input (images / sequences) and keeps whole batches until that count reaches max_rows."""
    import lowbit.algorithms.best_of as best_of

    kept: list[int] = []
    real = best_of._rel_all

    def spy(ys, outs):
        kept.append(sum(y.shape[0] for y in ys))
        return real(ys, outs)

    monkeypatch.setattr(best_of, "_rel_all", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU()).eval()
    batches = [torch.randn(3, 2, 8, 8) for _ in range(5)]  # 3 images of 36 output pixels each
    Q.best_of_ranges(model, batches, activations=["minmax"], weights=["minmax"], max_rows=4, progress=False)
    assert set(kept) == {6}  # two whole batches: 3 < 4, then 6 >= 4 (not 4 pixels, not 4 images)
    doc = best_of.__doc__ + best_of.best_of_ranges.__doc__
    assert "leading dimension" in doc and "rows (tokens / pixels)" not in doc
