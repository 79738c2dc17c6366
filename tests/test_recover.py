"""Accuracy recovery (``lowbit.algorithms``) and ``quantize_ptq``: small nets, kernels pinned.

- AdaRound never does worse than round-to-nearest on the layer objective it optimises (property test);
- learned codes survive ``convert_fx`` / ``convert`` exactly (frozen weight grid);
- bias correction removes the per-channel mean output error on the calibration data;
- cross-layer equalization keeps the float function (ReLU / identity pairs, depthwise -> pointwise),
  equalizes the ranges, and replaces a ReLU6 clamp by ReLU (reported);
- ``quantize_ptq``: ``default`` equals ``prepare_fx`` → ``convert_fx``; ``accurate`` beats it on a
  depthwise net, in graph mode and (``reconstruct_eager``) eager mode; bad input raises.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import adaround_codes, reconstruct
from lowbit.algorithms.equalize import equalize_prepared
from lowbit.algorithms.layers import split, weight_codes


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _sqnr(ref, out):
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


class DwNet(nn.Module):
    """conv-bn-relu6 → depthwise-bn-relu6 (badly scaled channels) → pointwise-bn → residual → pool → fc."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16),
                                nn.ReLU6())
        self.pw = nn.Sequential(nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.fc = nn.Linear(16, 5)
        with torch.no_grad():  # channel ranges spread over 3 decades, as in MobileNetV2's depthwise layers
            self.dw[0].weight.mul_(torch.logspace(-1.5, 1.5, 16).view(16, 1, 1, 1))
            for bn in (self.stem[1], self.dw[1], self.pw[1]):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.bias.uniform_(-0.2, 0.5)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.pw(self.dw(h))
        return self.fc(nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


def _data(n=4, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, 12, 12, generator=g) for _ in range(n)]


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([3, 4, 8]))
def test_adaround_never_worse_than_nearest_on_its_objective(seed, bits):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 10, generator=g)
    x = torch.randn(128, 10, generator=g)
    y = x @ w.t()
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    s = w.abs().amax(1, keepdim=True) / hi
    z = torch.zeros_like(s)
    near = torch.clamp(torch.round(w / s), lo, hi)
    def sample():
        i = torch.randint(128, (32,), generator=g)
        return (lambda w_: x[i] @ w_.t()), y[i]

    q = adaround_codes(w, s, z, lo, hi, sample, lambda w_: float((x @ w_.t() - y).pow(2).mean()), iters=150)
    err = lambda c: float((x @ ((c - z) * s).t() - y).pow(2).mean())  # noqa: E731
    assert q.min() >= lo and q.max() <= hi and bool((q == q.round()).all())
    assert bool(((q - w / s).abs() < 1 + 1e-5).all())  # only ever the floor or the ceiling
    assert err(q) <= err(near) + 1e-9  # the learned codes are kept only when they score no worse


def test_adaround_rejects_negative_iters():
    with pytest.raises(ValueError, match="iters=-1"):
        adaround_codes(torch.ones(2, 2), torch.ones(2, 1), torch.zeros(2, 1), -8, 7,
                       lambda: (lambda w: w, torch.ones(2, 2)), iters=-1)


def _prepared(model, calib):
    p = Q.prepare_fx(copy.deepcopy(model).eval(), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            p(b)
    return p


def test_learned_codes_survive_convert_fx_and_run_on_int8_modules():
    torch.manual_seed(0)
    model, calib = DwNet().eval(), _data()
    p = _prepared(model, calib)
    changes = reconstruct(p, calib, iters=40, batch_size=8, progress=False)
    assert [c.name for c in changes] == ["stem.0", "dw.0", "pw.0", "fc"]
    assert any(c.codes_changed > 0 for c in changes)
    mods = dict(p.named_modules())
    learned = {c.name: weight_codes(mods[c.name])[0] for c in changes}
    q = Q.convert_fx(p)
    qmods = dict(q.named_modules())
    for name, codes in learned.items():
        assert type(qmods[name]).__module__.startswith("lowbit.nn.quantized"), name
        torch.testing.assert_close(qmods[name].weight().int_repr().float(), codes, rtol=0, atol=0, msg=name)


def test_bias_correction_removes_mean_channel_error():
    torch.manual_seed(1)
    lin = nn.Sequential(nn.Linear(32, 8)).eval()
    with torch.no_grad():
        lin[0].weight.add_(0.05)  # rounding errors that do not cancel
    calib = [torch.rand(64, 32) * 4 for _ in range(2)]
    qc = Q.QConfig(activation=Q.MinMaxObserver.with_args(), weight=Q.PerChannelMinMaxObserver.with_args(
        ch_axis=0, qdtype=Q.qint8.with_range(-8, 7)))  # a coarse 4-bit weight grid makes the bias visible
    p = Q.prepare_fx(lin, Q.QConfigMapping().set_global(qc), example_inputs=(calib[0],))
    before = copy.deepcopy(p)
    for b in calib:
        p(b)
        before(b)
    x = torch.cat(calib)
    err_before = (Q.convert_fx(before)(x) - lin(x)).mean(0).abs().max()
    reconstruct(p, calib, adaround=False, bias_correction=True, progress=False)
    err_after = (Q.convert_fx(p)(x) - lin(x)).mean(0).abs().max()
    assert err_after < 0.2 * err_before


def test_equalize_keeps_function_and_equalizes_ranges():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                          nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        model[0].weight.mul_(torch.logspace(-2, 1, 8).view(8, 1, 1, 1))
    x = torch.randn(4, 3, 6, 6)
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    pairs = equalize_prepared(p, [x], sweeps=4)
    assert [(e.first, e.second) for e in pairs] == [("0", "2"), ("2", "4")]  # incl. depthwise -> pointwise
    assert pairs[0].ratio_before > 50 and pairs[0].ratio_after < 1.5
    torch.testing.assert_close(p(x), model(x), atol=1e-4, rtol=1e-4)


def test_equalize_replaces_relu6_and_reports_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU6(), nn.Linear(4, 2)).eval()
    x = torch.randn(8, 4)
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    assert equalize_prepared(copy.deepcopy(p), [x]) == []  # default: a ReLU6 pair is left alone
    (pair,) = equalize_prepared(p, [x], relu6="replace")
    assert pair.relu6_replaced and type(split(dict(p.named_modules())["0"])[1]) is nn.ReLU


def _dw_chain():
    """DwNet without the residual: stem -> depthwise -> pointwise -> pool -> fc, stem channels peaking
    from ~0.01 to far above the ReLU6 clamp."""
    torch.manual_seed(0)
    net = DwNet()
    with torch.no_grad():
        net.stem[0].weight.mul_(torch.logspace(-2.5, 1, 16).view(16, 1, 1, 1))
    return nn.Sequential(net.stem, net.dw, net.pw, nn.AdaptiveAvgPool2d(1), nn.Flatten(), net.fc).eval()


def test_equalize_range_stretches_clamped_channels_and_keeps_function():
    model = _dw_chain()
    calib, x = _data(), torch.cat(_data(2, seed=5))
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    pairs = equalize_prepared(p, calib, relu6="range", weights=False)
    # stem -> depthwise only: dw -> pw has a dense second layer, where a stretch would become weight error
    assert [(e.first, e.second) for e in pairs] == [("0.0", "1.0")] and 0 < pairs[0].stretched < 16
    with torch.no_grad():
        for b in calib:  # exact on the calibration data (observers are identities until convert)
            torch.testing.assert_close(p(b), model(b), atol=1e-4, rtol=1e-4)
        stem = dict(p.named_modules())["0.0"]
        top = torch.cat([stem(b) for b in calib]).amax((0, 2, 3))
    live = top > 0
    assert bool((top[live] >= 6 / 1.5 - 1e-4).all())  # every live channel reaches at least t / headroom
    base = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    for b in calib:
        base(b)
        p(b)
    stretched, plain = _sqnr(model(x), Q.convert_fx(p)(x)), _sqnr(model(x), Q.convert_fx(base)(x))
    # The end-to-end gain on this toy chain differs between CPUs: +2.4 dB on an AVX-512 Xeon (33.5 vs 31.1),
    # -2.9 dB on an AVX2 EPYC (31.1 vs 33.9; the same there with every kernel backend pinned and under
    # ATEN_CPU_CAPABILITY=default, cause not isolated — the float calibration pass is the suspect). What holds
    # on both: the stretch costs little here. MobileNetV2 (tests/test_realdata_imagenet.py) measures the gain.
    assert stretched > plain - 4.0, (stretched, plain)



@pytest.mark.parametrize("bn", [True, False])
def test_equalize_range_stretches_a_float_first_layer(bn):
    """Mixed precision keeps the stem float (``set_module_name("0.0", None)``): its run stays float modules (the conv
    with its BN folded in, as torch.ao folds it, then the ReLU6), and the stretch still fills the clamp of its channels
    into the int8 depthwise's input grid, divided out of the conv's rows. The float function is kept on the
    calibration data, and the stem stays float through convert."""
    model = _dw_chain()
    if not bn:  # conv -> ReLU6 -> depthwise: the BN folded into the conv by hand
        conv, norm = model[0][0], model[0][1]
        with torch.no_grad():
            g = norm.weight / torch.sqrt(norm.running_var + norm.eps)
            fused = nn.Conv2d(3, 16, 3, padding=1)
            fused.weight.copy_(conv.weight * g.view(-1, 1, 1, 1))
            fused.bias.copy_(norm.bias - g * norm.running_mean)
        model[0] = nn.Sequential(fused, nn.ReLU6())
    calib, x = _data(), torch.cat(_data(2, seed=5))
    mapping = Q.get_default_qconfig_mapping().set_module_name("0.0", None)
    p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(calib[0],))
    pairs = equalize_prepared(p, calib, relu6="range", weights=False)
    assert [(e.first, e.second) for e in pairs] == [("0.0", "1.0")] and 0 < pairs[0].stretched < 16
    mods = dict(p.named_modules())
    with torch.no_grad():
        for b in calib:
            torch.testing.assert_close(p(b), model(b), atol=1e-4, rtol=1e-4)
        # the clamp's input: the float conv's output (its BN folded in, as torch.ao folds it: session 41)
        top = torch.cat([mods["0.0"](b) for b in calib]).amax((0, 2, 3))
    live = top > 0
    assert bool((top[live] >= 6 / 1.5 - 1e-4).all())
    for b in calib:
        p(b)
    q = Q.convert_fx(p)
    assert type(q.get_submodule("0.0")) is nn.Conv2d  # still float
    assert _sqnr(model(x), q(x)) > 25


def test_equalize_range_stretches_into_a_float_second_layer():
    """Mixed precision keeps the depthwise float (``set_module_name("1.0", None)``): the int8 stem's clamp still
    stretches its channels, and the float layer's input channels absorb ``s_i`` exactly (no weight grid)."""
    model = _dw_chain()
    calib, x = _data(), torch.cat(_data(2, seed=5))
    mapping = Q.get_default_qconfig_mapping().set_module_name("1.0", None)
    p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(calib[0],))
    pairs = equalize_prepared(p, calib, relu6="range", weights=False)
    assert [(e.first, e.second) for e in pairs] == [("0.0", "1.0")] and 0 < pairs[0].stretched < 16
    with torch.no_grad():
        for b in calib:
            torch.testing.assert_close(p(b), model(b), atol=1e-4, rtol=1e-4)
    for b in calib:
        p(b)
    q = Q.convert_fx(p)
    assert type(q.get_submodule("1.0")) is nn.Conv2d
    assert _sqnr(model(x), q(x)) > 25

def test_equalize_range_bad_input():
    p = Q.prepare_fx(_dw_chain(), Q.get_default_qconfig_mapping(), example_inputs=(_data(1)[0],))
    with pytest.raises(ValueError, match="needs calib"):
        equalize_prepared(p, None, relu6="range")
    with pytest.raises(ValueError, match="headroom"):
        equalize_prepared(p, _data(1), relu6="range", headroom=0.5)
    with pytest.raises(ValueError, match="relu6="):
        equalize_prepared(p, _data(1), relu6="stretch")
    with pytest.raises(ValueError, match="equalize="):
        Q.quantize_ptq(DwNet().eval(), _data(1), equalize="yes", progress=False)


def test_quantize_ptq_composes_equalize_with_rounding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                          nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(4 * 12 * 12, 3)).eval()
    with torch.no_grad():
        model[0].weight.mul_(torch.logspace(-2, 1, 8).view(8, 1, 1, 1))
    calib, x = _data(), _data(1, seed=3)[0]
    q, rep = Q.quantize_ptq(model, calib, iters=20, equalize=True, progress=False)
    assert [s for s, _ in rep.steps][:3] == ["fuse", "equalize", "calibrate"] and len(rep.equalized) == 2
    assert _sqnr(model(x), q(x)) > 24, _sqnr(model(x), q(x))  # measured 27.5 dB (seed 0; unseeded it ranged 21-33)


def test_equalize_rejects_eager_models():
    with pytest.raises(TypeError, match="prepare_fx model"):
        equalize_prepared(nn.Linear(2, 2))


def test_quantize_ptq_default_is_todays_behaviour():
    model, calib = DwNet().eval(), _data()
    qmodel, report = Q.quantize_ptq(model, calib, recipe="default", progress=False)
    ref = Q.convert_fx(_prepared(model, calib))
    x = _data(1, seed=5)[0]
    torch.testing.assert_close(qmodel(x), ref(x), rtol=0, atol=0)
    assert [s for s, _ in report.steps] == ["fuse", "calibrate", "convert"] and not report.layers


def test_quantize_ptq_float_output_drops_only_the_last_rounding():
    """``float_output`` (accurate, default True): the Linear read only by dequantize returns its float result, the
    same int8 kernel one output rounding less: within half an output step of the 8-bit model where nothing clips."""
    torch.manual_seed(3)
    model, calib, x = DwNet().eval(), _data(), _data(2, seed=9)[0]
    kw = dict(recipe="accurate", iters=0, refine=0, progress=False)
    q8, r8 = Q.quantize_ptq(model, calib, float_output=False, **kw)
    qf, rf = Q.quantize_ptq(model, calib, **kw)
    assert r8.float_output == [] and "float output" not in dict(r8.steps)
    assert rf.float_output == ["fc"] and type(qf.fc).__name__ == "LinearFloatOut", rf.float_output
    step, zp = float(q8.fc.scale), int(q8.fc.zero_point)
    y8, yf = q8(x), qf(x)
    inside = ((yf / step + zp) > 0.5) & ((yf / step + zp) < 254.5)  # no clipping on the 8-bit grid there
    assert inside.float().mean() > 0.9 and not torch.equal(y8, yf)
    assert float((y8 - yf)[inside].abs().max()) <= step / 2 + 1e-6
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=f"float_output={bad!r} must be True or False"):
            Q.quantize_ptq(model, calib, float_output=bad, **kw)


def test_quantize_ptq_accurate_beats_default_and_reports():
    torch.manual_seed(3)
    model, calib, x = DwNet().eval(), _data(), _data(2, seed=9)[0]
    ref = model(x)
    qd, _ = Q.quantize_ptq(model, calib, recipe="default", progress=False)
    qa, rep = Q.quantize_ptq(model, calib, recipe="accurate", iters=60, progress=False)
    assert _sqnr(ref, qa(x)) > _sqnr(ref, qd(x)) + 1.0
    assert [s for s, _ in rep.steps] == ["fuse", "equalize", "calibrate", "refine grids", "round", "correct bias",
                                         "convert", "float output"]
    assert len(rep.layers) == 4 and "AdaRound" in str(rep) and rep.float_output == ["fc"]
    assert all(type(m).__module__.startswith("lowbit.nn.quantized") for n, m in qa.named_modules()
               if n in ("stem.0", "dw.0", "pw.0", "fc"))


def test_quantize_ptq_max_float_layers_keeps_the_rest_int8_and_reports_the_returned_model():
    torch.manual_seed(3)
    model, calib, x = DwNet().eval(), _data(), _data(2, seed=9)[0]
    q0, r0 = Q.quantize_ptq(model, calib, recipe="default", progress=False)
    q, rep = Q.quantize_ptq(model, calib, recipe="default", max_float_layers=1, progress=False)
    assert len(rep.float_layers) == 1 and rep.steps[-1][0] == "float layers" and "float layers" in str(rep)
    # the figure reported is the returned model's own (first calibration batch), and it improved
    with torch.no_grad():
        assert rep.sqnr_db == pytest.approx(_sqnr(model(calib[0]), q(calib[0])), abs=1e-3) and rep.sqnr_db > r0.sqnr_db
        assert _sqnr(model(x), q(x)) > _sqnr(model(x), q0(x))  # other inputs too
    kinds = {n: type(m).__module__ for n, m in q.named_modules() if n in ("stem.0", "dw.0", "pw.0", "fc")}
    (kept,) = rep.float_layers
    assert all(k.startswith("lowbit.nn.quantized") == (n != kept) for n, k in kinds.items()), kinds
    # accurate: the float twins compute with the float weights (rounding writes its codes into the prepared
    # model's weights and bias correction shifts its biases: a twin built from those changed nothing)
    qa, ra = Q.quantize_ptq(model, calib, iters=5, equalize=False, max_float_layers=2, progress=False)
    fresh = dict(Q.prepare_fx(copy.deepcopy(model), Q.QConfigMapping().set_global(Q.get_accurate_qconfig()),
                              example_inputs=(calib[0],)).named_modules())
    for name in ra.float_layers:
        twin, want = split(qa.get_submodule(name).float_mod)[0], split(fresh[name])[0]
        assert torch.equal(twin.weight, want.weight) and torch.equal(twin.bias, want.bias), name


def test_reconstruct_eager_mode_improves_sqnr():
    torch.manual_seed(4)
    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8),
                          nn.MaxPool2d(4), nn.Flatten(), nn.Linear(8 * 2 * 2, 4), Q.DeQuantStub()).eval()
    with torch.no_grad():
        model[3].weight.mul_(torch.logspace(-1, 1, 8).view(8, 1, 1, 1))
    calib, x = _data(8, 16), _data(1, 64, seed=7)[0]
    ref = model(x)

    def prepared():
        p = Q.prepare(copy.deepcopy(model), Q.get_default_qconfig())
        for b in calib:
            p(b)
        return p

    plain = Q.convert(prepared())
    p = prepared()
    changes = reconstruct(p, calib, iters=60, progress=False)
    assert [c.name for c in changes] == ["1", "3", "6"]
    tuned = Q.convert(p)
    assert _sqnr(ref, tuned(x)) > _sqnr(ref, plain(x))


@pytest.mark.parametrize("kw, err, match", [
    (dict(recipe="fast"), ValueError, "recipe='fast'"),
    (dict(iters=-2), ValueError, "iters=-2"),
    (dict(iters=True), ValueError, "iters=True"),
    (dict(batch_size=0), ValueError, "batch_size=0"),  # was accepted: AdaRound steps on empty batches
    (dict(batch_size=2.5), ValueError, "batch_size=2.5"),
    (dict(blocks="no"), TypeError, "blocks='no'"),
    (dict(learn_grids="off"), TypeError, "learn_grids='off'"),
    (dict(max_float_layers=-1), ValueError, "max_float_layers=-1"),
    (dict(max_float_layers=True), ValueError, "max_float_layers=True"),
    (dict(streams=2), ValueError, "streams=2"),
    (dict(streams=True), ValueError, "streams=True"),
])
def test_quantize_ptq_bad_arguments(kw, err, match):
    with pytest.raises(err, match=match):
        Q.quantize_ptq(DwNet().eval(), _data(1), progress=False, **kw)


def test_quantize_ptq_bad_calib():
    with pytest.raises(ValueError, match="calib is empty"):
        Q.quantize_ptq(DwNet().eval(), [], progress=False)
    with pytest.raises(TypeError, match="single tensor"):
        Q.quantize_ptq(DwNet().eval(), torch.randn(2, 3, 8, 8), progress=False)
    with pytest.raises(TypeError, match="nn.Module"):
        Q.quantize_ptq("model", _data(1), progress=False)


def test_quantize_ptq_non_finite_empty_or_half_inputs_are_named():
    x = _data(2)
    nan = [x[0], x[1].clone().index_fill_(0, torch.tensor([0]), float("nan"))]
    with pytest.raises(ValueError, match=r"calib batch 1, input 0 holds \d+ NaN/Inf"):
        Q.quantize_ptq(DwNet().eval(), nan, progress=False)
    with pytest.raises(ValueError, match=r"calib batch 0, input 0 is empty \(shape \(0, "):
        Q.quantize_ptq(DwNet().eval(), [x[0][:0]], progress=False)
    bad = DwNet().eval()
    name, p = next(iter(bad.named_parameters()))
    with torch.no_grad():
        p.view(-1)[0] = float("inf")
    with pytest.raises(ValueError, match=f"parameter '{name}' holds NaN/Inf"):
        Q.quantize_ptq(bad, x, progress=False)
    assert torch.isinf(p).any()  # the user's model is left as it was
    with pytest.raises(TypeError, match=r"torch.float16; lowbit quantizes float32 models: call model.float\(\)"):
        Q.quantize_ptq(DwNet().eval().half(), [t.half() for t in x], progress=False)


def cli_quantize_accurate(tmp_path, monkeypatch, *extra: str, recipe: str = "accurate") -> int:
    """``lowbit quantize --method ptq --recipe RECIPE`` on a small user model (in ``tmp_path``)."""
    from lowbit import cli

    (tmp_path / "usermodel.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU6(), nn.Linear(16, 3))\n")
    monkeypatch.chdir(tmp_path)
    torch.save(torch.randn(64, 8), tmp_path / "calib.pt")
    sys.modules.pop("usermodel", None)  # this file's module, not another test's (nor left for the next one)
    try:
        return cli.main(["quantize", "--model", "usermodel:make", "--calib", "calib.pt", "--method", "ptq",
                         "--recipe", recipe, *extra, "--quiet", "--out", "o"])
    finally:
        sys.modules.pop("usermodel", None)


def test_cli_recipe_accurate(tmp_path, capsys, monkeypatch):
    rc = cli_quantize_accurate(tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| ptq |" in out and (tmp_path / "o" / "model_ptq.pt").is_file()


@pytest.mark.parametrize("stride, padding, groups", [(1, 1, 1), (2, 1, 4), (2, 2, 1), (1, 0, 4)])
def test_adaround_window_equals_full_conv(stride, padding, groups):
    from lowbit.algorithms.layers import layer_sample

    conv = nn.Conv2d(4, 8, 5 if padding == 2 else 3, stride, padding, groups=groups)
    x = torch.randn(6, 4, 37, 29)
    with torch.no_grad():
        full = conv(x)
        sample = layer_sample(conv, [x], [full], batch_size=3, window=7, g=torch.Generator().manual_seed(0))
        for _ in range(10):
            run, target = sample()
            torch.testing.assert_close(run(conv.weight), target, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qconfig, want", [("default", "MSEObserver"), ("histogram", "HistogramObserver")])
def test_cli_recipe_accurate_uses_the_recipes_grids(tmp_path, capsys, monkeypatch, qconfig, want):
    """``lowbit quantize --recipe accurate`` calibrates with the grids ``quantize_ptq(recipe="accurate")``
    picks (MSE-searched ranges) unless ``--qconfig`` names others."""
    import lowbit.ptq

    seen: list[set[str]] = []
    real = lowbit.ptq.prepare_fx

    def spy(*a, **kw):  # the observers quantize_ptq's prepared model calibrates with
        prepared = real(*a, **kw)
        seen.append({type(m).__name__ for m in prepared.modules() if type(m).__name__.endswith("Observer")})
        return prepared

    monkeypatch.setattr(lowbit.ptq, "prepare_fx", spy)
    rc = cli_quantize_accurate(tmp_path, monkeypatch, "--qconfig", qconfig)
    assert rc == 0, capsys.readouterr().out
    assert seen and want in seen[0], seen
