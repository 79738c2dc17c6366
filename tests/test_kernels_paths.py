"""Every kernel code path, chosen on purpose, scanned over a shape grid against the exact integer oracle.

The backends pick their code path from the CPU (``onednn.has_vnni()``), the quantized engine and the
shape, so a test suite run on one machine would cover only that machine's paths. Here each path is
forced (the selection is monkeypatched) and a spy asserts that the intended path actually ran:

=================  ====================================================================================
``vnni-single``    oneDNN, one ``qlinear_pointwise`` call (VNNI/AMX CPUs; full int8 weights only where
                   the CPU really has VNNI, saturation-safe weights elsewhere — the same path, exact)
``avx2-single``    oneDNN on a CPU without VNNI, saturation-safe weights: one call
``avx2-split``     oneDNN on a CPU without VNNI, full int8 weights: the activations' 7-bit halves in one call
                   (``_split_run``; linear, and convs whose halves' sums could leave float32's exact range)
``avx2-wsplit``    conv, same case: the weights' 7-bit halves, one call on the codes (``_wsplit_conv``;
                   depthwise: two), the codes bit for bit the exact accumulator's float32 epilogue
``fbgemm-float``   no VNNI, M ≤ ``SMALL_M``: fbgemm with float output (split for full weights)
``fbgemm-requant`` no VNNI, M ≤ ``SMALL_M``, u8 output: one fbgemm call with fused requantization
``plan``           a converted static Linear's eager plan (``kernels.plan``, no VNNI): each route above with its
                   decisions made once; codes bit for bit ``onednn.linear``'s (and ``tests/test_static_plan.py``)
``int_mm``         ``torch._int_mm`` on CPU (with the K == 1 guard), affine weights
``int_mm-strict``  the CUDA layout (s8 activations, padded operands) run on CPU
``int_mm-cuda``    ``torch._int_mm`` on CUDA (when present)
``reference``      float simulation
=================  ====================================================================================

With unit scales and no bias the float output *is* the int32 accumulator (|acc| < 2²⁴, exact in
float32), compared with ``torch.equal`` against ``Σ (q_x - z_x)(q_w - z_w)`` in int64; every wrong
shape is listed at once. Shapes: M, K, N each over sizes including 1, odd sizes and SIMD-block edges.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from typing import Any

import pytest
import torch

import lowbit as Q
from lowbit import kernels as K
from lowbit import native
from helpers import force
from lowbit.kernels import OutGrid, avx2, conv_split, int_mm, onednn, small_m

torch.set_num_threads(1)
MS = (1, 2, 3, 5, 16, 17, 33, 64)
KS = (1, 2, 3, 4, 7, 8, 15, 16, 33, 64, 65)
NS = (1, 2, 3, 7, 8, 16, 17, 33)
GRID = list(itertools.product(MS, KS, NS))      # 704 shapes


def operands(m: int, k: int, n: int, *, safe: bool, zp_w: bool, device: str = "cpu") -> tuple[Q.QTensor, Q.QTensor]:
    """Activations u8 or s8 (alternating with the shape) with a random zero point; int8 weights with unit scales:
    full range (with a saturating pair of 127s when k > 1) or 7-bit (``safe``: exact even through vpmaddubsw)."""
    g = torch.Generator().manual_seed(m * 10_000 + k * 100 + n)
    if (m + k + n) % 2:
        x = Q.QTensor(torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8), 1.0,
                      int(torch.randint(0, 256, (), generator=g)), Q.quint8)
    else:
        x = Q.QTensor(torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8), 1.0,
                      int(torch.randint(-128, 128, (), generator=g)), Q.qint8)
    lo, hi = (-64, 63) if safe else (-128, 127)
    codes = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    if not safe and k > 1:
        codes[:, :2] = 127                       # 255 · 254 > 32767: saturates vpmaddubsw
    zps = torch.randint(-3, 4, (n,), generator=g) if zp_w else torch.zeros(n, dtype=torch.int64)
    w = Q.QTensor(codes, torch.ones(n), zps, Q.qint8, 0)
    return (x.to(device), w.to(device)) if device != "cpu" else (x, w)


def exact_acc(x: Q.QTensor, w: Q.QTensor) -> torch.Tensor:
    return (x.int_repr().long().cpu() - int(x.zero_point)) @ (w.int_repr().long().cpu() - w.zero_point.cpu()[:, None]).t()


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts which oneDNN-backend code path ran (spies around its internal routes)."""
    ran: Counter[str] = Counter()
    for name in ("_split_run", "_wsplit_conv", "_fbgemm_linear", "_fbgemm_requant"):
        real = getattr(onednn, name)

        def spy(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            ran[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(onednn, name, spy)
    for name in ("native_linear", "_native_dw", "gemm_conv"):  # counted only where they ran (None: not taken)
        real_taken = getattr(onednn, name)

        def taken_spy(*a: Any, _real: Any = real_taken, _name: str = name, **kw: Any) -> Any:
            y = _real(*a, **kw)
            if y is not None:
                ran[_name] += 1
            return y

        monkeypatch.setattr(onednn, name, taken_spy)
    real_requant, fbgemm_requant = onednn.native_requant, avx2._fbgemm_requant  # (onednn._fbgemm_requant: a spy)

    def requant_spy(q: torch.Tensor, sx: float, zx: int, w: torch.Tensor, w_scale: torch.Tensor, bias: Any, out: Any,
                    relu: bool, cache: Any, *rest: Any) -> Any:  # counted where it ran, its codes checked against fbgemm's
        y = real_requant(q, sx, zx, w, w_scale, bias, out, relu, cache, *rest)
        if y is not None:
            ran["native_requant"] += 1
            weight = Q.QTensor(w, w_scale, torch.zeros(w.shape[0], dtype=torch.int64), Q.qint8, 0)
            ref = fbgemm_requant({}, weight, bias, q, sx, zx, out, relu)
            ran["native_requant_differs"] += int(not torch.equal(y.int_repr(), ref.int_repr()))
        return y

    monkeypatch.setattr(onednn, "native_requant", requant_spy)
    return ran


def scan(backend: str, *, safe: bool, zp_w: bool, out: OutGrid | None = None, device: str = "cpu",
         shapes: list[tuple[int, int, int]] = GRID) -> list[str]:
    """Run ``backend`` (pinned; it must not fall back) over ``shapes``; return the wrong ones."""
    wrong = []
    before = K.counts[(backend, "linear")]
    with K.use_backend(backend):
        for m, k, n in shapes:
            x, w = operands(m, k, n, safe=safe, zp_w=zp_w, device=device)
            y = K.linear(x, w, None, out, cache={})
            want = exact_acc(x, w)
            if out is None:
                ok = y.shape == (m, n) and torch.equal(y.cpu().double(), want.double())
            else:   # requantized: within one code of rounding the exact value (ties may round either way)
                ref = torch.clamp(torch.round(want.double() / out.scale) + out.zero_point, 0, 255)
                ok = int((y.int_repr().cpu().double() - ref).abs().max()) <= 1
            if not ok:
                wrong.append(f"M={m} K={k} N={n}")
    assert K.counts[(backend, "linear")] == before + len(shapes), f"{backend} declined some shapes (fell back)"
    return wrong


# the real CPU's answer, captured before any test monkeypatches has_vnni
_REAL_VNNI = onednn.has_vnni()


def test_onednn_vnni_single_call(monkeypatch: pytest.MonkeyPatch, paths: Counter[str]) -> None:
    force(monkeypatch, vnni=True, fbgemm=False)
    # full int8 weights are exact in one call only on a real VNNI/AMX CPU; 7-bit ones on any CPU
    wrong = scan("onednn", safe=not _REAL_VNNI, zp_w=False)
    assert not wrong, f"wrong int32 sums: {wrong}"
    assert not paths, f"expected the single-call path only, ran {dict(paths)}"


@pytest.mark.parametrize("pin", ["best", "avx2"])
def test_onednn_vnni_few_rows_take_the_routes_without_vnni(monkeypatch: pytest.MonkeyPatch, paths: Counter[str],
                                                           pin: str) -> None:
    """torch's x86 engine on a VNNI CPU: up to small_m.vnni_rows rows the float output runs lowbit.native (its VNNI kernels
    where the CPU has them, else the AVX2 ones, pinned here too), exact for every int8 weight; more rows, oneDNN's single
    call."""
    force(monkeypatch, vnni=True, fbgemm=True)
    if not native.available():
        pytest.skip(f"lowbit.native is off: {native.reason()}")
    few = [s for s in GRID if s[0] <= onednn.vnni_rows(s[1], s[2])]
    with native.force_avx2() if pin == "avx2" else contextlib.nullcontext():
        wrong = scan("onednn", safe=False, zp_w=False, shapes=few)
    assert not wrong, f"wrong int32 sums: {wrong}"
    assert dict(paths) == {"native_linear": len(few)}, dict(paths)
    paths.clear()
    # more rows than small_m.vnni_rows (VNNI_M, or more for small layers): oneDNN's single call
    many = [(onednn.vnni_rows(k, n) + d, k, n) for d, (k, n) in enumerate(itertools.product((1, 33, 65), (1, 17)), 1)]
    assert not scan("onednn", safe=not _REAL_VNNI, zp_w=False, shapes=many)
    assert not paths, f"expected the single-call path only, ran {dict(paths)}"


def test_onednn_avx2_single_call_with_safe_weights(monkeypatch: pytest.MonkeyPatch, paths: Counter[str]) -> None:
    force(monkeypatch, vnni=False, fbgemm=False)
    wrong = scan("onednn", safe=True, zp_w=False)
    assert not wrong, f"wrong int32 sums: {wrong}"
    assert not paths, f"expected the single-call path only, ran {dict(paths)}"


def test_onednn_avx2_split_with_full_weights(monkeypatch: pytest.MonkeyPatch, paths: Counter[str]) -> None:
    force(monkeypatch, vnni=False, fbgemm=False)
    shapes = [s for s in GRID if s[1] > 1]       # k == 1 weights are always saturation-safe (one code per row)
    wrong = scan("onednn", safe=False, zp_w=False, shapes=shapes)
    assert not wrong, f"wrong int32 sums: {wrong}"
    # 7-bit activations (none here: u8 / full s8 grids) would skip the split; every call here splits
    assert paths["_split_run"] == len(shapes) and set(paths) == {"_split_run"}


@pytest.mark.parametrize("safe", [True, False], ids=["safe", "full"])
def test_onednn_fbgemm_small_m_float(monkeypatch: pytest.MonkeyPatch, paths: Counter[str], safe: bool) -> None:
    force(monkeypatch, vnni=False, fbgemm=True)
    shapes = [s for s in GRID if s[0] <= onednn.SMALL_M]
    wrong = scan("onednn", safe=safe, zp_w=False, shapes=shapes)
    assert not wrong, f"wrong int32 sums: {wrong}"
    # lowbit.native's one call takes every M (the same floats: tests/test_native.py), fbgemm runs without it
    by_native = len(shapes) if native.available() else 0
    assert paths["_fbgemm_linear"] + paths["native_linear"] == len(shapes) and paths["native_linear"] == by_native
    assert set(paths) <= {"_fbgemm_linear", "native_linear"}


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "fbgemm"])
def test_onednn_fbgemm_requantized_at_every_m(monkeypatch: pytest.MonkeyPatch, paths: Counter[str], use_native: bool) -> None:
    """A u8 output with no split, at every M (past ``SMALL_M`` too): lowbit.native's one call (fbgemm's codes bit for
    bit, checked by the spy), fbgemm's ``quantized::linear`` without it."""
    force(monkeypatch, vnni=False, fbgemm=True)
    with contextlib.nullcontext() if use_native else native.disabled():
        wrong = scan("onednn", safe=True, zp_w=False, out=OutGrid(64.0, 128, Q.quint8), shapes=GRID)
    assert not wrong, f"wrong requantized codes: {wrong}"
    by_native = len(GRID) if use_native and native.available() else 0
    assert paths["native_requant"] == by_native and paths["native_requant_differs"] == 0
    assert paths["_fbgemm_requant"] == len(GRID) - by_native
    assert set(paths) <= {"_fbgemm_requant", "native_requant", "native_requant_differs"}


@pytest.mark.parametrize("fbgemm", [True, False], ids=["fbgemm", "onednn"])
@pytest.mark.parametrize("safe", [True, False], ids=["safe", "full"])
def test_static_plan_routes(monkeypatch: pytest.MonkeyPatch, paths: Counter[str], fbgemm: bool, safe: bool) -> None:
    """``kernels.plan.linear_plan`` on every route of a CPU without VNNI (fbgemm requant / float + split, oneDNN /
    split): the generic backend's codes bit for bit, within one code of the exact accumulator requantized."""
    from lowbit.kernels.plan import linear_plan

    force(monkeypatch, vnni=False, fbgemm=fbgemm)
    out = OutGrid(64.0, 128, Q.quint8)
    wrong = []
    for m, k, n in GRID[::5]:
        x, w = operands(m, k, n, safe=safe, zp_w=False)
        run = linear_plan(w, None, out, False, x.qdtype)
        assert run is not None
        before, ran = K.counts[("onednn", "linear")], sum(paths.values())
        y = run(x.int_repr(), float(x.scale), int(x.zero_point))
        assert K.counts[("onednn", "linear")] == before + 1
        small = fbgemm and m <= onednn.SMALL_M
        by_native = fbgemm and native.available()  # lowbit.native's one call at every M (same codes)
        route = "native_linear" if by_native else "_fbgemm_linear" if small else "_split_run"  # unsafe weights: split
        split = not onednn.saturation_safe(w.int_repr())       # (K = 1 weights are always safe)
        if sum(paths.values()) - ran != int(split) or (split and not paths[route]):
            wrong.append(f"M={m} K={k} N={n}: route")
        want = onednn.linear(x, w, None, out, False, cache={})
        ref = torch.clamp(torch.round(exact_acc(x, w).double() / out.scale) + out.zero_point, 0, 255)
        if not torch.equal(y.int_repr(), want.int_repr()) or int((y.int_repr().double() - ref).abs().max()) > 1:
            wrong.append(f"M={m} K={k} N={n}")
    assert not wrong, f"plan codes or routes differ: {wrong}"


def test_int_mm_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = scan("int_mm", safe=False, zp_w=True)
    assert not wrong, f"wrong int32 sums: {wrong}"


def test_int_mm_strict_layout_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int_mm, "STRICT_DEVICES", {"cpu", "cuda"})
    wrong = scan("int_mm", safe=False, zp_w=True)
    assert not wrong, f"wrong int32 sums: {wrong}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int_mm_cuda() -> None:
    wrong = scan("int_mm", safe=False, zp_w=True, device="cuda")
    assert not wrong, f"wrong int32 sums: {wrong}"


_UNDER_CAP = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import test_kernels_paths as T
from lowbit.kernels import onednn
torch.set_num_threads(1)
assert not onednn.has_vnni(), "the ISA cap must count as no VNNI"
shapes = T.GRID[::3]
for backend, zp_w in (("onednn", False), ("int_mm", True)):
    wrong = T.scan(backend, safe=False, zp_w=zp_w, shapes=shapes)
    assert not wrong, f"{backend} under the cap: wrong int32 sums {wrong}"
T.int_mm.STRICT_DEVICES.add("cpu")  # the layout CUDA needs, forced here: its _int_mm call is guarded too
wrong = T.scan("int_mm", safe=False, zp_w=True, shapes=shapes)
T.int_mm.STRICT_DEVICES.discard("cpu")
assert not wrong, f"int_mm's strict layout under the cap: wrong int32 sums {wrong}"
wrong, _ = T.conv_scan(safe=False)
assert not wrong, f"onednn conv under the cap: wrong int32 sums {wrong}"
print("exact", len(shapes))
"""


def test_real_avx2_kernels_under_an_isa_cap() -> None:
    """Not forced: oneDNN and torch really run their AVX2 kernels (``ONEDNN_MAX_CPU_ISA=AVX2``,
    ``ATEN_CPU_CAPABILITY=avx2``), on a VNNI machine too, and lowbit must pick exact paths by itself
    (there torch's ``_int_mm`` and a single oneDNN call saturate; both are guarded)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(Q.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _UNDER_CAP, str(Path(__file__).parent)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "exact" in r.stdout, r.stderr[-3000:]


def test_isa_cap_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    for cap, capped in (("", False), ("ALL", False), ("avx2", True), ("AVX512_CORE", True), ("SSE41", True),
                        ("AVX2_VNNI", False), ("AVX512_CORE_VNNI", False), ("AVX512_CORE_AMX", False)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert onednn.isa_capped() is capped, cap


def test_reference() -> None:
    wrong = scan("reference", safe=False, zp_w=True, shapes=GRID[::3])
    assert not wrong, f"wrong sums: {wrong}"


# ---------------------------------------------------------------- convolutions: oneDNN single call vs split

CONVS = [(dim, cin, cout, ks, groups, stride)
         for dim in (1, 2, 3) for cin, cout, groups in ((1, 1, 1), (1, 3, 1), (3, 2, 1), (4, 4, 2), (7, 5, 1), (6, 6, 6),
                                                        (17, 8, 1))
         for ks, stride in ((1, 1), (3, 2))
         if dim != 3 or cin <= 7]


def conv_operands(dim: int, cin: int, cout: int, ks: int, groups: int, safe: bool
                  ) -> tuple[Q.QTensor, Q.QTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dim * 1000 + cin * 37 + cout * 5 + ks)
    spatial = (7,) * dim if dim < 3 else (5,) * dim
    x = Q.QTensor(torch.randint(0, 256, (2, cin, *spatial), generator=g, dtype=torch.uint8), 1.0,
                  int(torch.randint(0, 256, (), generator=g)), Q.quint8)
    lo, hi = (-64, 63) if safe else (-128, 127)
    codes = torch.randint(lo, hi + 1, (cout, cin // groups, *(ks,) * dim), generator=g, dtype=torch.int8)
    if not safe and codes[0].numel() > 1:
        codes.view(cout, -1)[:, :2] = 127           # a pair that saturates vpmaddubsw
    w = Q.QTensor(codes, torch.ones(cout), torch.zeros(cout, dtype=torch.int64), Q.qint8, 0)
    acc = getattr(torch.nn.functional, f"conv{dim}d")
    return x, w, acc


def conv_scan(safe: bool) -> tuple[list[str], int]:
    """Run oneDNN (pinned; must not fall back) over ``CONVS``; (wrong cases, how many weights were unsafe)."""
    wrong, unsafe = [], 0
    for dim, cin, cout, ks, groups, stride in CONVS:
        x, w, conv = conv_operands(dim, cin, cout, ks, groups, safe)
        spec = K.ConvSpec(dim, (stride,) * dim, (ks // 2,) * dim, (1,) * dim, groups)
        with K.use_backend("onednn"):
            before = K.counts[("onednn", "conv")]
            y = K.conv(x, w, None, spec, None, cache={})
            assert K.counts[("onednn", "conv")] == before + 1, "oneDNN declined (fell back)"
        # the exact oracle: integer-valued float64 conv of (q_x - z_x) (padding adds 0) and q_w
        want = conv((x.int_repr().double() - int(x.zero_point)), w.int_repr().double(), None, spec.stride,
                    spec.padding, spec.dilation, groups)
        if y.shape != want.shape or not torch.equal(y.double(), want):
            wrong.append(f"conv{dim}d cin={cin} cout={cout} k={ks} groups={groups} stride={stride}")
        unsafe += int(not onednn.saturation_safe(w.int_repr()))
    return wrong, unsafe


@pytest.mark.parametrize("variant", ["vnni-single", "avx2-single", "avx2-split", "avx2-wsplit"])
def test_onednn_conv_paths(monkeypatch: pytest.MonkeyPatch, paths: Counter[str], variant: str) -> None:
    force(monkeypatch, vnni=variant == "vnni-single", fbgemm=False)
    monkeypatch.setattr(onednn, "WSPLIT_CONV", variant != "avx2-split")
    monkeypatch.setattr(conv_split, "GEMM_MIN_COUT", 1)  # (these convs' few channels: gemm_conv on every one-group 2-d)
    safe = variant == "avx2-single" or (variant == "vnni-single" and not _REAL_VNNI)
    wrong, unsafe = conv_scan(safe)
    assert not wrong, f"wrong int32 sums: {wrong}"
    if variant == "avx2-split":
        assert paths["_split_run"] == unsafe > 0 and set(paths) == {"_split_run"}
    elif variant == "avx2-wsplit":  # 2-d convs of one group: lowbit.native's any-code Linear on their patches instead
        assert paths["_wsplit_conv"] + paths["gemm_conv"] == unsafe > 0
        assert paths["gemm_conv"] == (8 if native.available() else 0), dict(paths)  # (cin 1, 3, 7, 17: 3x3/2; 1x1 but cin 1)
        assert set(paths) <= {"_wsplit_conv", "gemm_conv"}
    else:
        assert not paths, f"expected the single-call path only, ran {dict(paths)}"


@pytest.mark.parametrize("kind", ["linear", "conv2d", "conv1d"])
@pytest.mark.parametrize("relu", [False, True])
def test_split_large_epilogue_is_the_exact_sum_requantized(monkeypatch: pytest.MonkeyPatch, kind: str, relu: bool) -> None:
    """A large split output (above 4096 codes: the one-pass store's view route) is the exact integer accumulator
    put through the epilogue's float32 operations (``fl(acc) · fl(s_x s_w) + b``, ReLU, ``· inv + z``, round half
    to even, clamp), bit for bit, with the channels innermost in memory (a conv's output stays channels-last)."""
    force(monkeypatch, vnni=False, fbgemm=False)
    g = torch.Generator().manual_seed(7)
    cin, cout = 24, 40
    x = Q.QTensor(torch.randint(0, 256, (2000, cin) if kind == "linear" else
                                (3, cin, 60, 60) if kind == "conv2d" else (40, cin, 70), generator=g,
                                dtype=torch.uint8), 0.02, 131, Q.quint8)
    wshape = (cout, cin) if kind == "linear" else (cout, cin, 3, 3) if kind == "conv2d" else (cout, cin, 3)
    w = Q.QTensor(torch.randint(-128, 128, wshape, generator=g, dtype=torch.int8), torch.rand(cout, generator=g) / 40,
                  torch.zeros(cout, dtype=torch.long), Q.qint8, 0)
    bias, out = torch.randn(cout, generator=g), OutGrid(0.05, 7, Q.quint8)
    ran: list[bool] = []
    route = "_split_run" if kind == "linear" else "_wsplit_conv"  # (convs: the weights' halves)
    monkeypatch.setattr(onednn, "gemm_conv", lambda *a: None)  # (its one-group 2-d convs: test_conv_weight_split_...)
    real = getattr(onednn, route)
    monkeypatch.setattr(onednn, route, lambda *a: ran.append(True) or real(*a))
    with K.use_backend("onednn"):
        if kind == "linear":
            y = K.linear(x, w, bias, out, relu, cache={})
        else:
            dim = 2 if kind == "conv2d" else 1
            y = K.conv(x, w, bias, K.ConvSpec(dim, (1,) * dim, (1,) * dim, (1,) * dim, 1), out, relu, cache={})
    assert ran and y.int_repr().numel() > 4096
    xc, wc = (x.int_repr().double() - 131), w.int_repr().double()
    if kind == "linear":
        acc, shape = xc @ wc.t(), [1, -1]
    else:
        conv = torch.nn.functional.conv2d if kind == "conv2d" else torch.nn.functional.conv1d
        acc, shape = conv(xc, wc, padding=1), [1, -1] + [1] * (x.int_repr().dim() - 2)
    v = acc.float().mul_((w.scale * 0.02).reshape(shape)).add_(bias.reshape(shape))  # exact sums below 2**24
    inv = torch.tensor(0.05).reciprocal()
    want = v.mul_(inv).add_(7.0).round_().clamp_(7 if relu else 0, 255).to(torch.uint8)
    assert torch.equal(y.int_repr(), want)
    if kind != "linear":  # channels innermost in memory, as the kernel wrote them
        assert y.int_repr().stride(1) == 1


# (dim, cin, cout, k, groups, stride, padding, dilation): depthwise, grouped, strided, padded, dilated, 1×1, 1d/3d
WSPLIT_CONVS = [(2, 8, 16, 3, 1, 1, 1, 1), (2, 16, 16, 3, 16, 2, 1, 1), (2, 12, 8, 3, 4, 1, 0, 1), (2, 24, 40, 1, 1, 1, 0, 1),
                (2, 6, 6, 5, 6, 1, 2, 1), (2, 5, 7, 3, 1, 2, 0, 2), (1, 7, 5, 3, 1, 2, 2, 2), (1, 9, 9, 3, 9, 1, 1, 1),
                (3, 4, 6, 3, 2, 1, 1, 1), (3, 3, 3, 3, 3, 2, 1, 1)]


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("zx", [0, 131, 255])
def test_conv_weight_split_codes_are_the_exact_sum_requantized(monkeypatch: pytest.MonkeyPatch, paths: Counter[str],
                                                               relu: bool, zx: int) -> None:
    """The weight split (``conv_split._wsplit_conv``) on every conv form, saturating weights (127/-128 pairs), codes 0 and
    255, input zero points at both ends and output grids at 0/128/255: the codes are bit for bit the exact
    accumulator's float32 epilogue ``fl(acc) · fl(s_x s_w) + b`` (ReLU) ``· inv + z``, rounded, clamped; float
    outputs are ``fl(acc) · fl(s_x s_w) + b`` bit for bit (sums below 2²⁴ here)."""
    force(monkeypatch, vnni=False, fbgemm=False)
    monkeypatch.setattr(conv_split, "GEMM_MIN_COUT", 1)  # (gemm_conv on every one-group 2-d conv, whatever its width)
    wrong = []
    for i, (dim, cin, cout, ks, groups, stride, pad, dil) in enumerate(WSPLIT_CONVS):
        g = torch.Generator().manual_seed(100 * i + zx)
        q = torch.randint(0, 256, (2, cin, *(9 - dim,) * dim), generator=g, dtype=torch.uint8)
        q.view(-1)[:5], q.view(-1)[-5:] = 0, 255
        if dim == 2 and i % 2:
            q = q.contiguous(memory_format=torch.channels_last)
        x = Q.QTensor(q, 0.03, zx, Q.quint8)
        codes = torch.randint(-128, 128, (cout, cin // groups, *(ks,) * dim), generator=g, dtype=torch.int8)
        codes.view(cout, -1)[::2, :2], codes.view(cout, -1)[1::2, :2] = 127, -128  # pairs that saturate vpmaddubsw
        w = Q.QTensor(codes, torch.rand(cout, generator=g) / 50 + 1e-3, torch.zeros(cout, dtype=torch.long), Q.qint8, 0)
        bias = torch.randn(cout, generator=g)
        spec = K.ConvSpec(dim, (stride,) * dim, (pad,) * dim, (dil,) * dim, groups)
        conv = getattr(torch.nn.functional, f"conv{dim}d")
        acc = conv(q.double() - zx, codes.double(), None, spec.stride, spec.padding, spec.dilation, groups)
        shape = [1, -1] + [1] * dim
        v = acc.float().mul_((w.scale * 0.03).reshape(shape)).add_(bias.reshape(shape))
        zo = (0, 128, 255)[i % 3]
        out = OutGrid(float(v.abs().max()) / 90, zo, Q.quint8)
        with K.use_backend("onednn"):
            before = K.counts[("onednn", "conv")]
            y, yf = K.conv(x, w, bias, spec, out, relu, cache={}), K.conv(x, w, bias, spec, None, relu, cache={})
            assert K.counts[("onednn", "conv")] == before + 2, "oneDNN declined (fell back)"
        inv = torch.tensor(out.scale).reciprocal()
        want = (v.relu() if relu else v).mul(inv).add_(float(zo)).round_().clamp_(zo if relu else 0, 255).to(torch.uint8)
        if not (torch.equal(y.int_repr(), want) and torch.equal(yf, v.relu() if relu else v)):
            wrong.append(WSPLIT_CONVS[i])
    assert not wrong, f"codes differ from the exact sums requantized: {wrong}"
    # 2-d depthwise convs with a u8 output: lowbit.native's one pass; 2-d convs of one group, either output, at any
    # input zero point: lowbit.native's any-code Linear on their pixels (1x1, stride 1, no padding) or on their patches
    # (the same codes, checked above against the exact sums)
    dw = sum(c[0] == 2 and c[4] == c[1] == c[2] for c in WSPLIT_CONVS) if native.available() else 0
    one = [c for c in WSPLIT_CONVS if c[0] == 2 and c[4] == 1]
    pw = 2 * len(one) if native.available() else 0
    assert pw == (2 * 3 if native.available() else 0)  # (3x3, 1x1, strided dilated 3x3)
    assert paths["_wsplit_conv"] == 2 * len(WSPLIT_CONVS) - dw - pw and paths["_native_dw"] == dw
    assert paths["gemm_conv"] == pw
    assert set(paths) <= {"_wsplit_conv", "_native_dw", "gemm_conv"}


def test_gemm_conv_leaves_weights_the_split_declines_to_the_activation_split(monkeypatch: pytest.MonkeyPatch,
                                                                           paths: Counter[str]) -> None:
    """Weights inside the split's exact bound (``127 Σ|w| < 2²⁴``, ``small_m.split_exact``) that ``weight_halves``
    declines (``255 Σ|w >> 1|``: ``-1 >> 1 = -1``) ran the activation split before ``gemm_conv``, whose floats round
    its half sums: they still do, bit for bit (``gemm_conv`` replaces the weight split only)."""
    force(monkeypatch, vnni=False, fbgemm=False)
    monkeypatch.setattr(conv_split, "GEMM_MIN_COUT", 1)
    cin, cout = 70000, 2
    codes = torch.full((cout, cin, 1, 1), -1, dtype=torch.int8)
    codes[:, :2] = -128
    assert avx2.weight_halves(codes) is None and small_m.split_exact(codes.view(cout, -1), None)
    q = torch.randint(200, 256, (1, cin, 2, 2), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    x = Q.QTensor(q.contiguous(memory_format=torch.channels_last), 0.03, 3, Q.quint8)
    w = Q.QTensor(codes, torch.full((cout,), 0.01), torch.zeros(cout, dtype=torch.long), Q.qint8, 0)
    spec = K.ConvSpec(2, (1, 1), (0, 0), (1, 1), 1)
    with K.use_backend("onednn"):
        y = K.conv(x, w, None, spec, None, False, cache={})
        monkeypatch.setattr(conv_split, "GEMM_MIN_COUT", 1 << 30)
        ref = K.conv(x, w, None, spec, None, False, cache={})
    assert paths["_split_run"] == 2 and "gemm_conv" not in paths and torch.equal(y, ref)


def test_conv_weight_split_declines_sums_past_float32(monkeypatch: pytest.MonkeyPatch, paths: Counter[str]) -> None:
    """Weights whose ``q_w >> 1`` sums could reach 2²⁴ (``255 · Σ |hi| ≥ 2²⁴``: 1100 weights of -128 a channel) keep
    the activation split, with the same exact sums."""
    force(monkeypatch, vnni=False, fbgemm=False)
    g = torch.Generator().manual_seed(3)
    x = Q.QTensor(torch.randint(120, 137, (2, 1100, 5), generator=g, dtype=torch.uint8), 1.0, 128, Q.quint8)
    codes = torch.full((3, 1100, 1), -128, dtype=torch.int8)
    codes[1] = 1  # (hi 0, lo 1: this channel alone would split)
    w = Q.QTensor(codes, torch.ones(3), torch.zeros(3, dtype=torch.long), Q.qint8, 0)
    assert avx2.weight_halves(codes[1:2]) is not None and avx2.weight_halves(codes) is None
    with K.use_backend("onednn"):
        y = K.conv(x, w, None, K.ConvSpec(1, (1,), (0,), (1,), 1), None, cache={})
    want = torch.nn.functional.conv1d(x.int_repr().double() - 128, codes.double())
    assert torch.equal(y.double(), want) and set(paths) == {"_split_run"}


def test_conv_weight_split_packs_the_unsplit_weight_only_when_a_call_needs_it(monkeypatch: pytest.MonkeyPatch,
                                                                              paths: Counter[str]) -> None:
    """8-bit activations on saturating weights take the weight split and leave the unsplit pack unmade; a 7-bit input
    (one exact call) then makes it once, in the same cache entry, with the codes of a fresh cache and the exact sums."""
    force(monkeypatch, vnni=False, fbgemm=False)
    x, w, conv = conv_operands(2, 8, 6, 3, 2, safe=False)
    spec, cache = K.ConvSpec(2, (1, 1), (1, 1), (1, 1), 2), {}
    with K.use_backend("onednn"):
        y8 = K.conv(x, w, None, spec, None, cache=cache)
        assert cache["onednn.conv"][1] == (None, True) and set(paths) == {"_wsplit_conv"}
        x7 = Q.QTensor(x.int_repr() // 2, 1.0, 60, Q.quint8.with_range(0, 127))
        y7 = K.conv(x7, w, None, spec, None, cache=cache)
        packed = cache["onednn.conv"][1][0]
        assert packed is not None and paths["_wsplit_conv"] == 1 and set(paths) == {"_wsplit_conv"}
        assert torch.equal(K.conv(x7, w, None, spec, None, cache=cache), y7) and cache["onednn.conv"][1][0] is packed
        assert torch.equal(K.conv(x7, w, None, spec, None, cache={}), y7)
    for xi, y in ((x, y8), (x7, y7)):
        want = conv(xi.int_repr().double() - int(xi.zero_point), w.int_repr().double(), None, 1, 1, 1, 2)
        assert torch.equal(y.double(), want)
