"""Session 50 (b1conv50), with the route turned on (off by default): a static int8 conv's planned oneDNN call at
small sizes goes through torch.ao's
``quantized::conv2d(_relu)`` on a pack the plan keeps (``conv_plan._ao_route``: its primitive cached, ~10-25 µs a call
less at batch 1), only where a rule allows it (``_ao_geometry``: dense or grouped, not depthwise, no dilation, no 7-bit
clamp, an AVX-512 VNNI CPU, oneDNN not capped; ``_ao_fits``: the input at least the kernel's size and at most
``AO_MACS`` multiply-adds). Its codes are the oneDNN route's, bit for bit; a layer's state change rebuilds the plan and
with it the pack.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

import lowbit as Q
from lowbit import kernels as K
from lowbit.kernels import conv_plan as CP
from lowbit.kernels import isa, onednn
from lowbit.nn.quantized import Conv2d, ConvReLU2d

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _ao_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route is off by default (``AO_MACS`` 0: slower in a whole model); these tests turn it on at 32M."""
    monkeypatch.setattr(CP, "AO_MACS", 32_000_000, raising=False)


def _routes() -> None:
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")


def _ao_cpu() -> None:
    if not (onednn.available() and onednn.has_vnni() and "avx512_vnni" in isa._cpu_flags()):
        pytest.skip("torch.ao's cached route needs oneDNN on an uncapped AVX-512 VNNI CPU")


def _layer(cin: int, cout: int, k: Any, stride: Any = 1, padding: Any = 0, groups: int = 1, dilation: int = 1,
           relu: bool = False, seed: int = 0, zo: int = 128, qd: Any = Q.quint8) -> Conv2d:
    g = torch.Generator().manual_seed(seed)
    kh, kw = (k, k) if isinstance(k, int) else k
    codes = torch.randint(-128, 128, (cout, cin // groups, kh, kw), generator=g, dtype=torch.int8)
    w = Q.QTensor(codes, torch.rand(cout, generator=g) / 200 + 1e-4, torch.zeros(cout, dtype=torch.long), Q.qint8, 0)
    mod = (ConvReLU2d if relu else Conv2d)(cin, cout, (kh, kw), stride, padding, dilation=dilation, groups=groups)
    mod.set_weight_bias(w, torch.randn(cout, generator=g))
    mod.set_output_grid(0.05, zo, qd)
    return mod


def _x(shape: tuple[int, ...], zx: int = 3, seed: int = 1, cl: bool = True) -> Q.QTensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if cl:
        codes = codes.contiguous(memory_format=torch.channels_last)
    return Q.QTensor(codes, 0.02, zx, Q.quint8)


class _Count:
    """Counts calls of torch.ao's ops through the plan (``conv_plan._ao_ops`` is read per call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        ops = getattr(CP, "_ao_ops", None)  # (getattr / raising=False: the tests run, and fail, on a tree without it)
        if ops is None:
            return

        def wrap(op: Any) -> Any:
            def counted(*a: Any) -> Any:
                self.n += 1
                return op(*a)
            return counted
        monkeypatch.setattr(CP, "_ao_ops", tuple(wrap(op) for op in ops))


def _reference_codes(mod: Conv2d, x: Q.QTensor, monkeypatch: pytest.MonkeyPatch, main: list[bool] | None = None
                     ) -> torch.Tensor:
    """The codes of today's oneDNN route: a copy of the layer with the torch.ao route off (``AO_MACS`` 0). ``main``
    gets whether the plan's main oneDNN call served (its lane armed: not the rewritten odd windows / strided columns,
    not the native small first-conv pass)."""
    with monkeypatch.context() as m:
        m.setattr(CP, "AO_MACS", 0, raising=False)
        ref = copy.deepcopy(mod)
        ref._cache.clear()
        y = ref(x)
        assert y._tq is None  # (the oneDNN route's output: plain codes)
        if main is not None:
            run = ref._cache["plan"][2]
            lane = getattr(run, "lane", None)  # (the small first-conv pass has a lane too since session 51: its own)
            main.append(lane is not None and lane.armed() and not getattr(run, "small", False))
        return y.int_repr()


def _geometries(n: int, seed: int) -> list[dict[str, Any]]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        g = rng.choice([1, 1, 1, 2, 4])
        k = rng.choice([1, 1, 3, 3, 5, 2, (3, 1), (1, 3)])
        kh, kw = (k, k) if isinstance(k, int) else k
        pad = (rng.randint(0, kh - 1), rng.randint(0, kw - 1))
        h, w = rng.randint(kh, 14), rng.randint(kw, 14)
        out.append(dict(cin=g * rng.choice([2, 3, 8, 16]), cout=g * rng.choice([2, 5, 8, 24]), k=(kh, kw),
                        stride=(rng.choice([1, 1, 2]), rng.choice([1, 2])), padding=pad, groups=g,
                        relu=rng.random() < 0.5, zo=rng.choice([0, 100, 255]), batch=rng.choice([1, 1, 2, 4]),
                        hw=(h, w), zx=rng.choice([0, 3, 128, 255]), cl=rng.random() < 0.8))
    return out


@pytest.mark.parametrize("geo", _geometries(36, 50), ids=lambda d: f"{d['cin']}-{d['cout']}k{d['k']}g{d['groups']}")
def test_ao_route_codes_are_the_onednn_routes(geo: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _ao_cpu()
    mod = _layer(geo["cin"], geo["cout"], geo["k"], geo["stride"], geo["padding"], geo["groups"], relu=geo["relu"],
                 zo=geo["zo"])
    x = _x((geo["batch"], geo["cin"], *geo["hw"]), geo["zx"], cl=geo["cl"])
    main: list[bool] = []
    want = _reference_codes(mod, x, monkeypatch, main)
    spy = _Count(monkeypatch)
    for _ in range(3):  # (run, then the lane)
        y = mod(x)
        assert torch.equal(y.int_repr(), want)
        assert y.int_repr().is_contiguous(memory_format=torch.channels_last) == want.is_contiguous(
            memory_format=torch.channels_last)
        assert y.scale == mod.scale and y.zero_point == mod.zero_point and y.dtype == Q.quint8
    assert spy.n == (3 if main[0] else 0)  # (torch.ao's op serves every call the main oneDNN call served)


def test_the_sweep_mostly_takes_the_ao_route(monkeypatch: pytest.MonkeyPatch) -> None:
    _ao_cpu()
    served = 0
    for geo in _geometries(36, 50):
        mod = _layer(geo["cin"], geo["cout"], geo["k"], geo["stride"], geo["padding"], geo["groups"], relu=geo["relu"])
        spy = _Count(monkeypatch)
        mod(_x((geo["batch"], geo["cin"], *geo["hw"]), geo["zx"], cl=geo["cl"]))
        served += spy.n
    assert served >= 24


@pytest.mark.parametrize("case", ["depthwise", "dilation", "narrow", "short", "seven_bit", "above_cutoff"])
def test_declines_keep_the_onednn_route(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins: where the rule declines, the oneDNN route serves (codes as before)."""
    _routes()
    shape = (1, 16, 9, 9)
    if case == "depthwise":
        mod = _layer(16, 16, 3, padding=1, groups=16)
    elif case == "dilation":
        mod = _layer(16, 8, 3, padding=2, dilation=2)
    elif case == "narrow":  # (width below the kernel's: the class torch.ao's op crashed in)
        mod, shape = _layer(16, 8, (1, 3), padding=(0, 1)), (1, 16, 9, 2)
    elif case == "short":
        mod, shape = _layer(16, 8, (3, 1), padding=(1, 0)), (1, 16, 2, 9)
    elif case == "seven_bit":
        mod = _layer(16, 8, 1, qd=Q.quint8.with_range(0, 127), zo=10)
    else:  # batch 8 of a 3x3 64 -> 64 on 24²: 8 · 24² · 64 · 64 · 9 > AO_MACS
        mod, shape = _layer(64, 64, 3, padding=1, relu=True), (8, 64, 24, 24)
    x = _x(shape)
    want = _reference_codes(mod, x, monkeypatch)
    spy = _Count(monkeypatch)
    for _ in range(3):
        assert torch.equal(mod(x).int_repr(), want)
    assert spy.n == 0


def test_small_batch_served_large_batch_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer, two batch sizes: the cutoff is per input shape (8 · 24² · 64² · 9 > AO_MACS >= 24² · 64² · 9)."""
    _ao_cpu()
    mod = _layer(64, 64, 3, padding=1)
    x1, x8 = _x((1, 64, 24, 24)), _x((8, 64, 24, 24))
    w1, w8 = _reference_codes(mod, x1, monkeypatch), _reference_codes(mod, x8, monkeypatch)
    spy = _Count(monkeypatch)
    for _ in range(2):
        assert torch.equal(mod(x1).int_repr(), w1)
        assert torch.equal(mod(x8).int_repr(), w8)
    assert spy.n == 2


def _fresh(mod: Conv2d, x: Q.QTensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    return _reference_codes(mod, x, monkeypatch)


@pytest.mark.parametrize("change", ["load_state_dict", "set_weight_bias", "inplace_weight", "inplace_bias",
                                    "data_swap", "output_grid"])
def test_state_changes_rebuild_the_pack(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every change of the layer's state is served with the new state's codes by a new pack (pins: the plan, and the
    pack with it, is rebuilt; a pack kept across a change would give the old weight's codes)."""
    _ao_cpu()
    mod, x = _layer(16, 24, 1, relu=True), _x((1, 16, 8, 8))
    spy = _Count(monkeypatch)
    for _ in range(3):
        mod(x)
    other = _layer(16, 24, 1, relu=True, seed=9)
    if change == "load_state_dict":
        mod.load_state_dict(other.state_dict())
    elif change == "set_weight_bias":
        mod.set_weight_bias(other.weight(), other.bias)
    elif change == "inplace_weight":
        mod.weight_int8.copy_(other.weight_int8)
    elif change == "inplace_bias":
        mod.bias.add_(5.0)
    elif change == "data_swap":
        mod.weight_int8.data = other.weight_int8.clone()
    else:
        mod.set_output_grid(0.07, 30, Q.quint8)
    want = _fresh(mod, x, monkeypatch)
    n = spy.n
    for _ in range(3):
        assert torch.equal(mod(x).int_repr(), want)
    assert spy.n == n + 3


@pytest.mark.parametrize("backend", ["reference", "onednn"])
def test_pinned_backends_take_their_routes(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins: a pinned backend never takes the plan, so never torch.ao's op."""
    _routes()
    mod, x = _layer(16, 24, 1), _x((1, 16, 8, 8))
    with K.use_backend(backend):
        want = K.conv(x, mod.weight(), mod.bias, mod._spec, K.OutGrid(float(mod.scale), int(mod.zero_point),
                                                                        Q.quint8), False)
    spy = _Count(monkeypatch)
    with K.use_backend(backend):
        for _ in range(3):
            assert torch.equal(mod(x).int_repr(), want.int_repr())
    assert spy.n == 0


def test_no_vnni_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VNNI (or oneDNN capped below it, ``ONEDNN_MAX_CPU_ISA=AVX2``) torch.ao's x86 engine may pack for
    fbgemm's saturating kernels: the rule declines."""
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available")
    monkeypatch.setattr(onednn, "has_vnni", lambda: False)
    spec = Q.nn.quantized.Conv2d(16, 24, 1)._spec  # (on main: no such rule, an AttributeError)
    assert not CP._ao_geometry(torch.Size([24, 16, 1, 1]), spec, False, "none", False)
    monkeypatch.undo()
    assert CP._ao_geometry(torch.Size([24, 16, 1, 1]), spec, False, "none", False) == (
        onednn.has_vnni() and "avx512_vnni" in isa._cpu_flags())


def test_thread_engine_does_not_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack is made under the x86 engine whatever the thread's engine is, and the engine is restored."""
    _ao_cpu()
    if "qnnpack" not in torch.backends.quantized.supported_engines:
        pytest.skip("no qnnpack engine")
    mod, x = _layer(16, 24, 3, padding=1, relu=True), _x((1, 16, 8, 8))
    want = _reference_codes(mod, x, monkeypatch)
    old = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "qnnpack"
        spy = _Count(monkeypatch)
        for _ in range(3):
            assert torch.equal(mod(x).int_repr(), want)
        assert torch.backends.quantized.engine == "qnnpack"
    finally:
        torch.backends.quantized.engine = old
    assert spy.n in (0, 3)  # (the plan may decline under qnnpack: then the oneDNN route)


def test_next_layer_reads_the_ao_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch.ao output (held as a quantized tensor) fed to the next conv gives that conv's codes on plain codes."""
    _ao_cpu()
    a, b = _layer(16, 24, 1, relu=True), _layer(24, 8, 3, padding=1, seed=4)
    x = _x((1, 16, 8, 8))
    for _ in range(3):
        y = a(x)
        assert y._tq is not None
        plain = Q.QTensor(y.int_repr().clone(), y.scale, y.zero_point, Q.quint8)
        assert torch.equal(b(y).int_repr(), _reference_codes(b, plain, monkeypatch))


def test_compiled_qconv_cfg_is_served_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled ``lowbit::qconv_cfg`` enters the plan's lane as the module does: torch.ao's op serves it too, with
    the codes of the op's full body on the oneDNN route (a fresh cache, ``AO_MACS`` 0)."""
    _ao_cpu()
    from lowbit.compile_state import conv_config, qdtype_key
    from lowbit.pt2 import kernel_ops

    mod = _layer(8, 16, 3, padding=1, relu=True)
    x = torch.randint(0, 256, (1, 8, 9, 11), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    x = x.contiguous(memory_format=torch.channels_last)
    sp = mod._spec
    cfg = conv_config(qdtype_key(Q.quint8), qdtype_key(mod.weight_qdtype), qdtype_key(mod.out_qdtype), mod._relu,
                      list(sp.stride), list(sp.padding), list(sp.dilation), sp.groups, False, [0, 0])
    args = [x, torch.tensor(0.02), torch.tensor(131), mod.weight_int8, mod.weight_scale, mod.weight_zero_point,
            mod.bias, mod.scale, mod.zero_point]
    with monkeypatch.context() as m:
        m.setattr(CP, "AO_MACS", 0, raising=False)
        want = kernel_ops.qconv_cfg(*[None if t is None else t.clone() for t in args], cfg)
    spy = _Count(monkeypatch)
    for _ in range(4):  # (run, the lane, then the fast entry into the lane)
        assert torch.equal(kernel_ops.qconv_cfg(*args, cfg), want)
    assert spy.n == 4


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin: with the default ``AO_MACS`` (0) the plan keeps the qconv_pointwise route."""
    _routes()
    monkeypatch.undo()
    assert getattr(CP, "AO_MACS", 0) == 0
    mod, x = _layer(16, 24, 1), _x((1, 16, 8, 8))
    spy = _Count(monkeypatch)
    for _ in range(3):
        assert mod(x)._tq is None
    assert spy.n == 0
