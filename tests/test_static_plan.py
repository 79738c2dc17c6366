"""The static Linear's eager plan (``lowbit.kernels.plan``) gives the generic path's codes, bit for bit, on every route.

Each route of ``onednn.linear`` on a CPU without VNNI is forced (``has_vnni`` patched False; torch's engine x86
or fbgemm disabled) and a quantized ``Linear`` module — which runs its plan — is compared with the generic
dispatcher (``onednn.linear`` on the same weight, input and output grid) over activation grids (u8, full s8,
7-bit u8 / s8), output grids (u8, s8, 7-bit u8), weights (full int8: the split; 7-bit: one call), ReLU, M below
and above ``SMALL_M`` and 3-d inputs. Spies check the route that ran and ``kernels.counts`` that no fallback did.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import lowbit as Q
from lowbit import kernels as K
from lowbit import native
from helpers import force
from lowbit.kernels import onednn
from lowbit.kernels.plan import linear_plan
from lowbit.nn.quantized import Linear, LinearReLU

torch.set_num_threads(1)

X_GRIDS = [(Q.quint8, 131), (Q.qint8, -7), (Q.quint8.with_range(0, 127), 60), (Q.qint8.with_range(-64, 63), -3)]
OUT_GRIDS = [(0.05, 100, Q.quint8), (0.04, -5, Q.qint8), (0.05, 3, Q.quint8.with_range(0, 127))]


def _layer(k: int, n: int, full: bool, relu: bool, out: tuple[float, int, Q.QDtype], seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 127) if full else (-64, 63)
    codes = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    if full:
        codes[:, :2] = 127                                    # saturates vpmaddubsw with 8-bit activations
    w = Q.QTensor(codes, torch.rand(n, generator=g) / 50 + 1e-3, torch.zeros(n, dtype=torch.long), Q.qint8, 0)
    mod = (LinearReLU if relu else Linear)(k, n)
    mod.set_weight_bias(w, torch.randn(n, generator=g))
    mod.set_output_grid(*out)
    return mod


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    ran: Counter[str] = Counter()
    for name in ("_split_run", "_fbgemm_linear"):
        real = getattr(onednn, name)
        monkeypatch.setattr(onednn, name, lambda *a, _r=real, _n=name, **kw: ran.update([_n]) or _r(*a, **kw))
    real_native = onednn.native_linear

    def native_linear(*a: object, **kw: object) -> object:  # counted only when it ran (None: not taken)
        y = real_native(*a, **kw)
        if y is not None:
            ran.update(["native_linear"])
        return y

    monkeypatch.setattr(onednn, "native_linear", native_linear)
    return ran


@pytest.mark.parametrize("fbgemm", [True, False], ids=["fbgemm", "onednn-only"])
def test_plan_matches_generic_on_every_route(monkeypatch: pytest.MonkeyPatch, routes: Counter[str], fbgemm: bool) -> None:
    force(monkeypatch, vnni=False, fbgemm=fbgemm)
    k, n = 70, 24
    wrong, seen = [], set()
    cases = itertools.product(X_GRIDS, OUT_GRIDS, (True, False), (False, True), ((1, k), (5, k), (2, 3, k), (40, k)))
    for i, ((xqd, zx), out, full, relu, shape) in enumerate(cases):
        mod = _layer(k, n, full, relu, out, i)
        g = torch.Generator().manual_seed(1000 + i)
        x = Q.QTensor(torch.randint(xqd.quant_min, xqd.quant_max + 1, shape, generator=g, dtype=xqd.storage), 0.02, zx,
                      xqd)
        before, fell = K.counts[("onednn", "linear")], K.counts[("reference", "linear")] + K.counts[("int_mm", "linear")]
        routes.clear()
        native_before = native.counts["qlinear"]
        y = mod(x)
        assert K.counts[("onednn", "linear")] == before + 1
        assert K.counts[("reference", "linear")] + K.counts[("int_mm", "linear")] == fell
        plan = mod._cache.get("plan")
        assert plan is not None and plan[2] is not None, "the module did not build its plan"
        got_routes = dict(routes)
        if native.counts["qlinear"] > native_before and not got_routes:  # the plan's own call of native_linear's plan
            got_routes = {"native_linear (plan)": 1}
        weight, grid = mod._prepared()
        want = onednn.linear(x, weight, mod.bias, grid, relu, cache={})
        seven = xqd.quant_max - xqd.quant_min <= 127
        rows = x.int_repr().numel() // k
        small = fbgemm and rows <= onednn.SMALL_M
        split = full and not seven
        # (few rows, u8 output: lowbit.native's one call replaces _fbgemm_linear, the same codes: tests/test_native.py;
        # the plan calls native_linear's plan itself, per input grid, since session 26)
        by_native = fbgemm and native.available() and grid.qdtype.storage == torch.uint8  # at every M
        expect = ({"native_linear (plan)": 1} if split and by_native and xqd.storage == torch.uint8
                  else {"native_linear": 1} if split and by_native
                  else {"_fbgemm_linear": 1} if small and (split or grid.qdtype.storage != torch.uint8)
                  else {} if small else {"_split_run": 1} if split else {})
        seen.add(tuple(sorted(expect)) + (small,))
        if got_routes != expect:
            wrong.append(f"case {i}: routes {got_routes} != {expect}")
        if not (y.qdtype == want.qdtype and torch.equal(y.int_repr(), want.int_repr()) and torch.equal(y.scale, want.scale)):
            wrong.append(f"case {i}: x {xqd!r} out {out} full={full} relu={relu} shape={shape}: codes differ")
    assert not wrong, "\n".join(wrong[:20])
    assert len(seen) == (4 if fbgemm else 2) + 4 * (fbgemm and native.available())  # every route of this setting ran


def test_plan_follows_state_changes_pins_and_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is rebuilt after an in-place weight / grid change and a new input grid, and is bypassed while a
    backend is pinned (the generic path runs: its counts, its codes); on a VNNI CPU it gives the generic path's codes."""
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)
    mod = _layer(32, 8, True, False, OUT_GRIDS[0], 3)
    x = Q.QTensor(torch.randint(0, 256, (4, 32), dtype=torch.uint8), 0.02, 128, Q.quint8)
    y0 = mod(x)
    first = mod._cache["plan"]
    with torch.no_grad():
        mod.weight_int8.neg_()                                 # in place: a new version
    y1 = mod(x)
    assert mod._cache["plan"] is not first and not torch.equal(y0.int_repr(), y1.int_repr())
    weight, grid = mod._prepared()
    assert torch.equal(y1.int_repr(), onednn.linear(x, weight, mod.bias, grid, False, cache={}).int_repr())
    x7 = Q.QTensor(x.int_repr() >> 1, 0.04, 64, Q.quint8.with_range(0, 127))
    mod(x7)
    assert mod._cache["plan"][1] == x7.qdtype
    with K.use_backend("reference"):
        before = K.counts[("reference", "linear")]
        mod(x)
        assert K.counts[("reference", "linear")] == before + 1
    monkeypatch.setattr(onednn, "has_vnni", lambda: True)  # AVX-512 VNNI: a plan too (the routes without VNNI for few rows)
    monkeypatch.setattr(onednn, "shares_routes", lambda: True)
    run = mod._plan(x, linear_plan)
    assert run is not None
    weight, grid = mod._prepared()
    for m in (4, onednn.VNNI_M + 8, onednn.vnni_rows(32, 8), onednn.vnni_rows(32, 8) + 8):  # the generic path's codes
        xm = Q.QTensor(torch.randint(0, 256, (m, 32), dtype=torch.uint8), 0.02, 128, Q.quint8)
        before = native.counts["qlinear"]
        assert torch.equal(mod(xm).int_repr(), onednn.linear(xm, weight, mod.bias, grid, False, cache={}).int_repr())
        # up to vnni_rows rows the native float route (the plan's own call), past them oneDNN's one call
        assert (native.counts["qlinear"] > before) == (native.available() and m <= onednn.vnni_rows(32, 8)), m


def test_converted_model_runs_the_plan_not_the_reference() -> None:
    """A converted Quantize → Linear → DeQuantize model on this CPU takes an int8 route in every forward (never the
    float reference), on lowbit's default recipe and on torch.ao's x86 recipe."""
    torch.manual_seed(0)
    for qconfig in (Q.get_default_qconfig(), Q.get_default_qconfig("x86")):
        model = torch.nn.Sequential(Q.QuantStub(), torch.nn.Linear(64, 32), Q.DeQuantStub()).eval()
        prep = Q.prepare(model, qconfig)
        x = torch.randn(16, 64)
        prep(x)
        qm = Q.convert(prep)
        ref_before = K.counts[("reference", "linear")]
        fast_before = sum(v for (b, op), v in K.counts.items() if op == "linear" and b != "reference")
        for m in (1, 16, 40):
            qm(torch.randn(m, 64))
        assert K.counts[("reference", "linear")] == ref_before
        assert sum(v for (b, op), v in K.counts.items() if op == "linear" and b != "reference") == fast_before + 3


def test_fbgemm_output_tensor_rides_along(monkeypatch: pytest.MonkeyPatch) -> None:
    """A requantizing fbgemm call leaves its quantized tensor on the output QTensor (``_tq``, the 7-bit clamp in it;
    the plain codes made only when read); the next layer feeds it to fbgemm as it is and DeQuantize dequantizes it:
    the same codes and floats as the generic path's, layer by layer."""
    force(monkeypatch, vnni=False, fbgemm=True)
    from lowbit.nn.quantized.stubs import DeQuantize

    out7 = (0.05, 3, Q.quint8.with_range(0, 127))
    first, second = _layer(48, 32, False, True, out7, 11), _layer(32, 16, True, False, OUT_GRIDS[0], 12)
    g = torch.Generator().manual_seed(5)
    for m in (1, 4, onednn.SMALL_M):
        x = Q.QTensor(torch.randint(0, 128, (m, 48), generator=g, dtype=torch.uint8), 0.02, 60, Q.quint8.with_range(0, 127))
        y1 = first(x)
        assert y1._tq is not None and y1._c is None  # (no plain codes made yet)
        y3 = second(first(x.reshape(1, m, 48)))  # 3-d: the same codes through the (rows, K) views
        assert y3.shape == (1, m, 16) and torch.equal(y3.int_repr().reshape(m, 16), second(first(x)).int_repr())
        y2, d1 = second(y1), DeQuantize()(y1)  # both from y1's fbgemm tensor
        assert y1._tq is not None and torch.equal(y1._tq.int_repr(), y1.int_repr()) and int(y1.int_repr().max()) <= 127
        w1, g1 = first._prepared()
        assert torch.equal(y1.int_repr(), onednn.linear(x, w1, first.bias, g1, True, cache={}).int_repr())
        w2, g2 = second._prepared()
        plain = Q.QTensor(y1.int_repr().clone(), y1.scale, y1.zero_point, y1.qdtype)  # no _tq: wrapped again
        assert torch.equal(y2.int_repr(), onednn.linear(plain, w2, second.bias, g2, False, cache={}).int_repr())
        assert torch.equal(d1, plain.dequantize())
        assert torch.equal(DeQuantize()(second(y1)), y2.dequantize())  # (y1's codes read: a copy, the natives dropped)


@pytest.mark.parametrize("fbgemm", [True, False], ids=["fbgemm", "onednn-only"])
def test_transposed_float_input_gives_the_contiguous_codes(monkeypatch: pytest.MonkeyPatch, fbgemm: bool) -> None:
    """A transposed (non-contiguous) float input runs every route — the default recipe's split through fbgemm
    included, whose stacked halves follow the codes' strides (a ``view`` of them failed) — with the codes and
    floats of its contiguous copy."""
    force(monkeypatch, vnni=False, fbgemm=fbgemm)
    torch.manual_seed(0)
    for qconfig in (Q.get_default_qconfig(), Q.get_default_qconfig("x86")):
        prep = Q.prepare(torch.nn.Sequential(Q.QuantStub(), torch.nn.Linear(64, 96), Q.DeQuantStub()).eval(), qconfig)
        prep(torch.randn(16, 64))
        qm = Q.convert(prep)
        for m in (3, 40):
            x = torch.randn(64, m).t()
            assert not x.is_contiguous()
            assert torch.equal(qm(x), qm(x.contiguous())), f"{qconfig.activation} M={m}"


@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("hardtanh", [True, False], ids=["qclamp", "clamp"])
def test_quantize_codes_on_scale_one_go_into_fbgemm(monkeypatch: pytest.MonkeyPatch, hardtanh: bool,
                                                    use_native: bool) -> None:
    """``Quantize``'s codes stay in its quantized tensor on scale 1 (``_tu``); a fbgemm Linear takes it with a pack
    whose weight scales are float32 ``s_x · s_w``: the same codes as the generic path on the plain codes, over input
    grids (zero points 0 / 60 / 127, ties and saturation to 0 and 127), output grids, ReLU and M; the 7-bit output clamp
    by the quantized ``clamp`` or, where its probe fails, by ``clamp_`` on the viewed codes. With ``lowbit.native``,
    small inputs' codes are plain and the Linear is one native call: the same codes again."""
    force(monkeypatch, vnni=False, fbgemm=True)
    if not use_native:
        monkeypatch.setattr(native, "_lib", lambda: None)
    from lowbit.kernels import plan
    from lowbit.nn.quantized.stubs import DeQuantize, Quantize

    if not hardtanh:
        monkeypatch.setattr(plan, "_qclamp_exact", lambda *a: False)
    u7 = Q.quint8.with_range(0, 127)
    g = torch.Generator().manual_seed(3)
    wrong = []
    for i, ((s, z), out, relu, m) in enumerate(itertools.product(((0.05, 60), (0.0123, 0), (0.31, 127)),
                                                                  (OUT_GRIDS[0], OUT_GRIDS[2]), (False, True),
                                                                  ((1,), (7,), (32,), (), (2, 3), (4, 2, 4)))):
        mod, quant = _layer(40, 24, False, relu, out, 100 + i), Quantize(s, z, u7)
        x = torch.randn(*m, 40, generator=g) * 4 * s * 40  # (1-d and 3-d: fbgemm on the (rows, K) view)
        x.view(-1, 40)[0, :4] = torch.tensor([0.5, 1.5, -2.5, 1e9]) * s  # ties, saturation
        qx = quant(x)
        plain_codes = use_native and native.available()  # (small inputs: the native Quantize's plain codes)
        assert (qx._tu is None and qx._c is not None) if plain_codes else (qx._tu is not None and qx._c is None)
        before = K.counts[("onednn", "linear")]
        y = mod(qx)
        assert K.counts[("onednn", "linear")] == before + 1 and (plain_codes or qx._c is None)  # (plain codes not made)
        plain = Q.QTensor(quant(x).int_repr().clone(), qx.scale, qx.zero_point, u7)
        w, grid = mod._prepared()
        want = onednn.linear(plain, w, mod.bias, grid, relu, cache={})
        nxt = _layer(24, 8, False, False, OUT_GRIDS[0], 200 + i)  # the output's fbgemm tensor (_tq) into the next call
        y2 = nxt(mod(quant(x)))
        w2, grid2 = nxt._prepared()
        want2 = onednn.linear(Q.QTensor(want.int_repr().clone(), want.scale, want.zero_point, want.qdtype), w2, nxt.bias,
                              grid2, False, cache={})
        if not (torch.equal(y.int_repr(), want.int_repr()) and torch.equal(DeQuantize()(mod(quant(x))), want.dequantize())
                and torch.equal(DeQuantize()(quant(x)), plain.dequantize()) and torch.equal(y2.int_repr(), want2.int_repr())
                and y.shape == want.shape == (*m, 24)):
            wrong.append((s, z, out, relu, m))
    assert not wrong


def test_split_output_keeps_its_scale_one_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split's float epilogue stores its codes with ``quantize_per_tensor`` at scale 1 and keeps that tensor on the
    output (``_tu``): DeQuantize is its ``dequantize · s`` and the next fbgemm layer takes it with its own pack; the
    same codes and floats as from the plain codes."""
    force(monkeypatch, vnni=False, fbgemm=True)
    from lowbit.nn.quantized.stubs import DeQuantize

    u7 = Q.quint8.with_range(0, 127)
    first, second = _layer(48, 32, True, False, (0.05, 3, u7), 21), _layer(32, 16, False, True, OUT_GRIDS[0], 22)
    g = torch.Generator().manual_seed(6)
    for m in (1, 5, onednn.SMALL_M):
        x = Q.QTensor(torch.randint(0, 256, (m, 48), generator=g, dtype=torch.uint8), 0.02, 131, Q.quint8)
        y1 = first(x)
        assert y1._tu is not None and y1._c is None
        y2, d1 = second(y1), DeQuantize()(y1)
        plain = Q.QTensor(y1.int_repr().clone(), y1.scale, y1.zero_point, y1.qdtype)
        w1, g1 = first._prepared()
        w2, g2 = second._prepared()
        assert torch.equal(plain.int_repr(), onednn.linear(x, w1, first.bias, g1, False, cache={}).int_repr())
        assert torch.equal(d1, plain.dequantize())
        assert torch.equal(y2.int_repr(), onednn.linear(plain, w2, second.bias, g2, True, cache={}).int_repr())


@pytest.mark.skipif(not native.available(), reason="lowbit.native not built")
@pytest.mark.parametrize("full", [True, False], ids=["split", "no-split"])
def test_a_grid_first_seen_with_native_off_still_runs_native_afterwards(monkeypatch: pytest.MonkeyPatch,
                                                                        full: bool) -> None:
    """The plan's per-input-grid native slots are filled only while ``lowbit.native`` runs: a grid first seen inside
    ``native.disabled()`` takes the torch route there and the native call afterwards (a plan declined while switched
    off used to stay declined for that grid), with the same codes either way."""
    force(monkeypatch, vnni=False, fbgemm=True)
    mod = _layer(96, 24, full, False, OUT_GRIDS[0], 7)
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (40, 96), generator=g, dtype=torch.uint8)
    mod(Q.QTensor(codes, 0.02, 131, Q.quint8))  # (the plan is made, native on)
    x = Q.QTensor(codes, 0.03, 131, Q.quint8)  # a new input grid
    with native.disabled():
        off = mod(x)
    before = native.counts["qlinear"] + native.counts["qlinear_requant"]
    on = mod(x)
    assert native.counts["qlinear"] + native.counts["qlinear_requant"] == before + 1
    assert torch.equal(on.int_repr(), off.int_repr())
