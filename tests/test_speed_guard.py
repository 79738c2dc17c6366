"""lowbit.speed_guard (decisions from injected timings, swapped models still run and match) and the
7-bit-activation single-call oneDNN path on CPUs without VNNI (exact against the integer oracle)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit import native
from lowbit import speed_guard as SG
from lowbit.examples import SmallCNN
from lowbit.kernels import ConvSpec, OutGrid, isa, onednn, reference
from lowbit.nn.quantized import Linear as QLinear
from lowbit.nn.quantized._weighted import WeightedQuantModule
from lowbit.speed_guard import FloatFallback, get_speed_qconfig, keep_faster

torch.set_num_threads(1)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Q.QuantStub(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8),
                         Q.DeQuantStub())


def static(model: nn.Module, x: torch.Tensor, qconfig: Q.QConfig | None = None) -> tuple[nn.Module, nn.Module]:
    prepared = Q.prepare(model, qconfig or Q.get_minmax_qconfig())
    prepared(x)
    return prepared, Q.convert(prepared)


def fake_timer(table: dict[str, tuple[float, float]], calls: list[str] | None = None) -> SG.Timer:
    def timer(name, run_int8, run_float):  # type: ignore[no-untyped-def]
        run_int8(), run_float()  # both candidates must run on the captured input
        if calls is not None:
            calls.append(name)
        return table[name] if name in table or name != "<model>" else (2.0, 1.0)  # swaps win as a whole
    return timer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_decisions_follow_the_timings_and_margin() -> None:
    x = torch.randn(64, 16)
    fmodel = mlp()
    _, qmodel = static(fmodel, x)
    calls: list[str] = []
    times = {"1": (1e-3, 3e-3), "3": (2e-3, 1e-3), "4": (1e-3, 1.5e-3)}  # (int8 s, float s)
    report = keep_faster(qmodel, fmodel, x, margin=2.0, timer=fake_timer(times, calls))
    assert calls == ["1", "3", "4", "<model>"]
    got = {d.layer: (d.kept, d.shape, round(d.ratio, 6)) for d in report.decisions}
    assert got == {"1": (True, (64, 16), 3.0), "3": (False, (64, 32), 0.5), "4": (False, (64, 32), 1.5)}
    assert report.swapped == ["3", "4"] and report.model is qmodel and report.model_ms == (2000.0, 1000.0)
    assert isinstance(qmodel[1], QLinear) and isinstance(qmodel[3], FloatFallback)
    assert "swapped back to float" in str(report) and "int8" in str(report)


def test_ratio_equal_to_margin_swaps_back() -> None:
    x = torch.randn(8, 16)
    fmodel = mlp()
    _, qmodel = static(fmodel, x)
    report = keep_faster(qmodel, fmodel, (x,), timer=fake_timer({k: (1e-3, 1e-3) for k in "134"}))
    assert report.swapped == ["1", "3", "4"]


def test_swapped_static_model_runs_and_matches() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 16)
    fmodel = mlp()
    _, qmodel = static(fmodel, x)
    ref = qmodel(x)
    keep_faster(qmodel, fmodel, x, timer=fake_timer({"1": (2.0, 1.0), "3": (1.0, 2.0), "4": (2.0, 1.0)}))
    y = qmodel(x)
    assert isinstance(qmodel[1], FloatFallback) and isinstance(qmodel[3], QLinear)
    assert y.shape == ref.shape and rel(y, ref) < 0.05 and rel(y, fmodel(x)) < 0.05
    # the fallback output is on the replaced layer's grid: the next int8 layer sees the same kind of input
    h = qmodel[1](qmodel[0](x))
    assert isinstance(h, Q.QTensor) and float(h.scale) == qmodel[1].out[0] and h.qdtype == qmodel[1].out[2]


def test_float_fallback_requantizes_onto_the_grid() -> None:
    lin = nn.Linear(6, 5)
    x = Q.quantize_per_tensor(torch.randn(3, 6), 0.05, 128, Q.quint8)
    fb = FloatFallback(lin, (0.1, 10, Q.quint8))
    y = fb(x)
    expect = Q.quantize_per_tensor(lin(x.dequantize()), 0.1, 10, Q.quint8)
    assert torch.equal(y.int_repr(), expect.int_repr()) and float(y.scale) == pytest.approx(0.1)
    assert torch.equal(FloatFallback(lin, None)(x), lin(x.dequantize()))


def test_dynamic_layers_swap_to_their_float_twin_exactly() -> None:
    torch.manual_seed(2)
    fmodel = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    qmodel = Q.quantize_dynamic(fmodel)
    x = torch.randn(5, 16)
    report = keep_faster(qmodel, fmodel, x, timer=fake_timer({"0": (2.0, 1.0), "2": (2.0, 1.0)}))
    assert report.swapped == ["0", "2"] and all(isinstance(m, nn.Linear) for m in (qmodel[0], qmodel[2]))
    assert torch.equal(qmodel(x), fmodel(x))


def test_root_layer_and_unrun_layers() -> None:
    fmodel = nn.Linear(8, 4)
    qroot = Q.quantize_dynamic(nn.Sequential(fmodel))[0]
    report = keep_faster(qroot, fmodel, torch.randn(2, 8), timer=fake_timer({"": (2.0, 1.0)}))
    assert report.swapped == [""] and report.model is not qroot and isinstance(report.model, nn.Linear)

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    fm = Branchy()
    report = keep_faster(Q.quantize_dynamic(fm), fm, torch.randn(2, 4), timer=fake_timer({"a": (1.0, 2.0)}))
    assert [(d.layer, d.kept, d.note) for d in report.decisions] == [("a", True, ""), ("b", True, "not run")]


def test_convert_speed_check_and_conv_model(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    model = SmallCNN().eval()
    fused = Q.fuse_modules(model, SmallCNN.fusion_groups())
    x = torch.randn(8, 1, 28, 28)
    prepared = Q.prepare(fused, Q.get_minmax_qconfig())
    prepared(x)
    plain = Q.convert(prepared)
    names = [n for n, m in plain.named_modules() if isinstance(m, SG._QUANT_LAYERS)]
    assert names == ["conv1", "conv2", "conv3", "fc1", "fc2"]
    slow_int8 = {n: (2.0, 1.0) if n in ("conv2", "fc2") else (1.0, 2.0) for n in names}
    monkeypatch.setattr(SG, "_default_timer", lambda rounds: fake_timer(slow_int8))
    qmodel, report = Q.convert(prepared, return_report=True, speed_check=x)
    assert report.speed.swapped == ["conv2", "fc2"] and isinstance(qmodel.conv2, FloatFallback)
    assert isinstance(qmodel.conv1, WeightedQuantModule)
    y, ref = qmodel(x), plain(x)
    assert y.shape == ref.shape == (8, 10) and rel(y, ref) < 0.1 and rel(y, fused(x)) < 0.1
    assert "speed" not in vars(Q.convert(prepared, return_report=True)[1])  # no speed_check: unchanged


def test_builtin_timer_runs_without_asserting_speed() -> None:
    x = torch.randn(4, 16)
    fmodel = mlp()
    _, qmodel = static(fmodel, x)
    report = keep_faster(qmodel, fmodel, x, rounds=1, margin=1e-9)  # int8 kept unless absurdly slow
    for d in report.decisions:
        assert d.int8_ms > 0 and d.float_ms > 0 and math.isclose(d.ratio, d.float_ms / d.int8_ms, rel_tol=1e-6)
    assert report.swapped == [] and qmodel(x).shape == (4, 8)


def test_bad_arguments() -> None:
    x, fmodel = torch.randn(2, 16), mlp()
    _, qmodel = static(fmodel, x)
    for kw in ({"rounds": 0}, {"rounds": 1.5}, {"rounds": True}, {"margin": 0}, {"margin": -1.0},
               {"margin": float("inf")}, {"margin": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            keep_faster(qmodel, fmodel, x, **kw)
    with pytest.raises(TypeError, match="timer"):
        keep_faster(qmodel, fmodel, x, timer="fast")
    with pytest.raises(TypeError, match="nn.Module"):
        keep_faster("model", fmodel, x)
    with pytest.raises(ValueError, match="empty"):
        keep_faster(qmodel, fmodel, ())
    with pytest.raises(ValueError, match="'3'"):
        keep_faster(qmodel, nn.Sequential(nn.Identity(), nn.Linear(16, 32)), x, timer=fake_timer({}))
    with pytest.raises(TypeError, match="vnni"):
        get_speed_qconfig(vnni="no")


# ---- the speed recipe and the single-call 7-bit path ----
def test_speed_qconfig() -> None:
    assert get_speed_qconfig(vnni=False).activation().qdtype == Q.quint8.with_range(0, 127)
    assert get_speed_qconfig(vnni=True).activation().qdtype == Q.quint8
    x = torch.randn(32, 16)
    _, qmodel = static(mlp(), x, get_speed_qconfig(vnni=False))
    assert int(qmodel[1](qmodel[0](x)).int_repr().max()) <= 127


def exact(x: Q.QTensor, w: Q.QTensor, bias: torch.Tensor) -> torch.Tensor:
    acc = (x.int_repr().long() - x.zero_point) @ w.int_repr().long().t()
    return acc.double() * (x.scale.double() * w.scale.double()) + bias.double()


def full_weight(*shape: int) -> Q.QTensor:
    codes = torch.randint(-128, 128, shape, dtype=torch.int8)
    codes.view(shape[0], -1)[:, :2] = 127  # a pair that saturates vpmaddubsw with 8-bit activations
    return Q.QTensor(codes, torch.rand(shape[0]) * 0.01 + 1e-3, torch.zeros(shape[0], dtype=torch.long), Q.qint8, 0)


SEVEN_BIT = [(Q.quint8.with_range(0, 127), 0, 127, 60), (Q.qint8.with_range(-64, 63), -64, 63, -3),
             (Q.qint8.with_range(-128, -1), -128, -1, -70)]


@pytest.fixture
def no_vnni_single_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)

    def no_split(*a: object, **k: object) -> None:
        raise AssertionError("7-bit activations must not take the split path")
    monkeypatch.setattr(onednn, "_split_run", no_split)


OUTS = [None, OutGrid(0.05, 100, Q.quint8), OutGrid(0.04, -5, Q.qint8), OutGrid(0.05, 3, Q.quint8.with_range(0, 127))]


@pytest.mark.parametrize("qd,lo,hi,zp", SEVEN_BIT, ids=["u7", "s7", "s7neg"])
@pytest.mark.parametrize("out", OUTS, ids=["float", "u8", "s8", "u7"])
@pytest.mark.parametrize("rows", [(2,), (3, 5), (40,)], ids=["M2", "M15", "M40"])  # fbgemm (M <= 16) / oneDNN
def test_onednn_linear_seven_bit_activations_single_call_exact(no_vnni_single_call: None, monkeypatch: pytest.MonkeyPatch,
                                                                qd: Q.QDtype, lo: int, hi: int, zp: int,
                                                                out: OutGrid | None, rows: tuple[int, ...]) -> None:
    torch.manual_seed(4)
    splits: list[bool] = []
    fbgemm = onednn._fbgemm_linear
    monkeypatch.setattr(onednn, "_fbgemm_linear", lambda *a: splits.append(a[4]) or fbgemm(*a))
    natives: list[object] = []
    real_native = onednn.native_linear

    def native_linear(*a: object) -> object:  # lowbit.native's one call (the same floats: tests/test_native.py)
        y = real_native(*a)
        if y is not None:
            natives.append(y)
        return y

    monkeypatch.setattr(onednn, "native_linear", native_linear)
    w, b = full_weight(24, 70), torch.randn(24)
    assert not onednn.saturation_safe(w.int_repr())
    codes = torch.randint(lo, hi + 1, (*rows, 70), dtype=qd.storage)
    codes[..., :2] = hi
    x = Q.QTensor(codes, 0.02, zp, qd)
    cache: dict = {}
    y = onednn.linear(x, w, b, out, out is not None, cache=cache)
    engine = torch.backends.quantized.engine in isa._FBGEMM
    small = x.numel() <= onednn.SMALL_M * 70 and engine
    fused = engine and out is not None and out.qdtype.storage == torch.uint8  # fbgemm's requantized codes, at every M
    by_native = engine and out is None and native.available()  # lowbit.native's float epilogue, at every M
    assert splits == ([False] if small and not fused and not by_native else [])
    assert ("onednn.fbgemm" in cache) == (small and not fused and not by_native) and len(natives) == int(by_native)
    by_requant = fused and native.available()  # lowbit.native: fbgemm's codes in one call
    assert ("onednn.fbgemm_q" in cache) == (fused and not by_requant) and ("native.requant" in cache) == by_requant
    if out is None:
        assert torch.allclose(y.double(), exact(x, w, b), rtol=1e-5, atol=1e-4)
        return
    ref = reference.linear(x, w, b, out, True)
    assert int((y.int_repr().int() - ref.int_repr().int()).abs().max()) <= 1 and y.qdtype == out.qdtype


@pytest.mark.parametrize("qd,lo,hi,zp", SEVEN_BIT[:2], ids=["u7", "s7"])
def test_onednn_conv_seven_bit_activations_single_call_exact(no_vnni_single_call: None, qd: Q.QDtype, lo: int,
                                                              hi: int, zp: int) -> None:
    torch.manual_seed(5)
    w, b = full_weight(8, 6, 3, 3), torch.randn(8)
    x = Q.QTensor(torch.randint(lo, hi + 1, (2, 6, 9, 9), dtype=qd.storage), 0.02, zp, qd)
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    y = onednn.conv(x, w, b, spec, None, True, cache={})
    xf = (x.int_repr().double() - zp) * 0.02
    expect = F.conv2d(xf, w.dequantize().double(), b.double(), padding=1).relu()
    assert torch.allclose(y.double(), expect, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("zx", [0, 131, 255])
def test_small_m_fbgemm_split_is_exact_and_engine_gated(monkeypatch: pytest.MonkeyPatch, zx: int) -> None:
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)
    torch.manual_seed(6)
    w, b = full_weight(16, 33), torch.randn(16)
    x = Q.QTensor(torch.randint(0, 256, (4, 33), dtype=torch.uint8), 0.02, zx, Q.quint8)  # 8-bit: must split
    cache: dict = {}
    with native.disabled():  # (lowbit.native's one call comes first: tests/test_native.py)
        y = onednn.linear(x, w, b, None, False, cache=cache)
    assert cache["onednn.fbgemm"][1][1] is True and torch.allclose(y.double(), exact(x, w, b), rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(isa, "_FBGEMM", ())  # another quantized engine: oneDNN only
    cache = {}
    y2 = onednn.linear(x, w, b, None, False, cache=cache)
    assert "onednn.fbgemm" not in cache and torch.allclose(y2.double(), exact(x, w, b), rtol=1e-5, atol=1e-4)


def test_small_m_fused_fbgemm_repacks_after_bias_or_scale_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused few-row route (lowbit.native's one call, else fbgemm's requantizing op) follows in-place changes of
    the bias and the weight scales: its kept constants / pack are remade, and both give the same codes."""
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)
    if torch.backends.quantized.engine not in isa._FBGEMM:
        pytest.skip("fbgemm is not the quantized engine")
    torch.manual_seed(7)
    w, b, out = full_weight(12, 20), torch.randn(12), OutGrid(0.05, 90, Q.quint8)
    x = Q.QTensor(torch.randint(0, 128, (3, 20), dtype=torch.uint8), 0.02, 7, Q.quint8.with_range(0, 127))
    cache: dict = {}
    fb_cache: dict = {}
    for change in (None, lambda: b.add_(1.0), lambda: w.scale.mul_(1.5)):
        if change is not None:
            change()
        y = onednn.linear(x, w, b, out, False, cache=cache)
        with native.disabled():
            y_fb = onednn.linear(x, w, b, out, False, cache=fb_cache)
        ref = reference.linear(x, w, b, out, False)
        assert ("native.requant" if native.available() else "onednn.fbgemm_q") in cache and "onednn.fbgemm_q" in fb_cache
        assert torch.equal(y.int_repr(), y_fb.int_repr())
        assert int((y.int_repr().int() - ref.int_repr().int()).abs().max()) <= 1


def test_qat_model_float_twins_come_from_to_float() -> None:
    torch.manual_seed(8)
    x = torch.randn(32, 16)
    prepared = Q.prepare_qat(mlp())
    prepared(x)
    prepared.eval()
    qmodel = Q.convert(prepared)
    report = keep_faster(qmodel, prepared, x, timer=fake_timer({k: (2.0, 1.0) for k in "134"}))
    assert report.swapped == ["1", "3", "4"]
    assert all(type(qmodel[i].module) is nn.Linear for i in (1, 3, 4))  # plain float, no fake-quant
    assert rel(qmodel(x), Q.convert(prepared)(x)) < 0.1


def test_swaps_are_reverted_when_the_whole_model_is_not_faster() -> None:
    x = torch.randn(16, 16)
    fmodel = mlp()
    _, qmodel = static(fmodel, x)
    ref = qmodel(x)
    times = {"1": (2.0, 1.0), "3": (2.0, 1.0), "4": (1.0, 2.0), "<model>": (1.0, 1.5)}
    report = keep_faster(qmodel, fmodel, x, timer=fake_timer(times))
    assert report.swapped == [] and all(isinstance(qmodel[i], QLinear) for i in (1, 3, 4))
    assert [d.note for d in report.decisions][:2] == ["reverted: the whole model was not faster"] * 2
    assert torch.equal(qmodel(x), ref) and "whole model" in str(report)


def test_fallback_keeps_the_channels_last_layout_of_an_int8_conv() -> None:
    torch.manual_seed(9)
    fmodel = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1),
                           Q.DeQuantStub())
    x = torch.randn(2, 3, 10, 10)
    _, qmodel = static(fmodel, x)
    ref = qmodel(x)
    int8_codes = qmodel[1](qmodel[0](x)).int_repr()
    cl = int8_codes.is_contiguous(memory_format=torch.channels_last) and not int8_codes.is_contiguous()
    keep_faster(qmodel, fmodel, x, timer=fake_timer({"1": (2.0, 1.0), "2": (1.0, 2.0)}))
    fb = qmodel[1]
    assert isinstance(fb, FloatFallback) and fb.channels_last == cl
    codes = fb(qmodel[0](x)).int_repr()
    assert codes.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    assert rel(qmodel(x), ref) < 0.1
