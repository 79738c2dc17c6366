"""``lowbit.native``: the C row passes must be the torch ops they replace, bit for bit, in both C bodies (AVX2 + FMA
and scalar: ``force_scalar`` pins the scalar one on any CPU), split over threads or not, on every dynamic Linear
route that calls them (VNNI and non-VNNI routes pinned by ``has_vnni``, fbgemm's 7-bit and weight-split routes);
a non-finite row leaves the decision to the torch path; without the build every caller keeps its torch ops."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import functional, kernels, native
from lowbit.kernels import conv_split, small_m
from lowbit.nn.quantized.dynamic import Linear as DLinear
from lowbit.nn.quantized.dynamic import no_vnni
from lowbit.nn.quantized.dynamic import per_token as pt
from lowbit.nn.quantized.dynamic import reduced

from helpers import force, split_over

needs_native = pytest.mark.skipif(not native.available(), reason=f"lowbit.native not built: {native.reason()}")
BODIES = ["best", "scalar"]
STUB_BODIES = ["best", "avx2", "scalar"]  # the stubs' and row passes: AVX-512 where the CPU has it ("best"), AVX2 pinned


def _body(name: str) -> contextlib.AbstractContextManager[None]:
    if name == "avx2":
        return native.force_avx2()
    return native.force_scalar() if name == "scalar" else contextlib.nullcontext()


def _native_and_torch(body: str, f: Callable[[], Any]) -> tuple[Any, Any, dict[str, int]]:
    """``f()`` with the native passes (in ``body``), ``f()`` with the torch path, and the native passes that ran."""
    with _body(body):
        native.counts.clear()
        got = f()
        ran = dict(native.counts)
    with native.disabled():
        ref = f()
    return got, ref, ran


def _rows(seed: int) -> list[torch.Tensor]:
    """Random row sets: scales 1e-6..1e4, shifted, one-signed, quarter-step values (ties), zero / constant / -0.0 rows,
    tails of every length mod 8, and a strided view (row stride > K)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.zeros(3, 9), torch.full((2, 17), 2.5), torch.full((2, 8), -0.0), torch.tensor([[1e-30, -1e-30, 0.0]])]
    for i in range(60):
        m, k = 1 + int(torch.randint(0, 40, (), generator=g)), 1 + int(torch.randint(0, 90, (), generator=g))
        x = torch.randn(m, k, generator=g) * 10.0 ** float(torch.rand((), generator=g) * 10 - 6)
        x = x + torch.randn(m, 1, generator=g) * x.abs().mean() * (i % 3)
        if i % 4 == 1:
            x = x.abs()
        elif i % 4 == 2:
            x = -x.abs()
        if i % 5 == 0:
            x = torch.round(x * 4) / 4
        out.append(x)
    wide = torch.randn(20, 50, generator=g)
    out.append(wide[:, 3:40])  # row stride 50, K = 37
    return out


def _torch_grid(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    grids = pt._row_grids(x, pt._LEVELS[levels])
    assert grids is not None
    return grids


@needs_native
@pytest.mark.parametrize("body", STUB_BODIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_grid_is_the_torch_ops(body: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    with split_over(threads, monkeypatch), _body(body):
        for x in _rows(threads):
            s, nz = _torch_grid(x, 127)
            u = torch.mul(x, torch.reciprocal(s)).sub_(nz).clamp_max_(127)
            got = native.row_grid(x, 127.0, "u")
            assert got is not None and torch.equal(got[1], s) and torch.equal(got[2], nz) and torch.equal(got[0], u)
            free = native.row_grid(x, 255.0, "u", qmax=float("inf"))
            s, nz = _torch_grid(x, 255)
            assert free is not None and torch.equal(free[0], torch.mul(x, torch.reciprocal(s)).sub_(nz))
            codes = native.row_grid(x, 255.0, "codes")
            assert codes is not None and torch.equal(codes[0], pt._codes(x, torch.reciprocal(s), nz))
            assert torch.equal(codes[1], s) and torch.equal(codes[2], nz)


@needs_native
@pytest.mark.parametrize("body", STUB_BODIES)
def test_non_finite_rows_and_misfits_are_left_to_torch(body: str) -> None:
    with _body(body):
        for bad in (float("nan"), float("inf"), -float("inf")):
            for k in (5, 16, 21, 40):  # the bad value in the vector bodies (8, 16 and 32 lanes) and in the tails
                x = torch.randn(4, k)
                x[2, k - 1] = bad
                assert native.row_grid(x, 255.0, "codes") is None and pt._row_grids(x) is None
        wide = torch.tensor([[3e38, -3e38]])  # finite values, a range past float32
        assert native.row_grid(wide, 127.0, "u") is None and pt._row_grids(wide) is None
    assert native.row_grid(torch.randn(3, 4, dtype=torch.float64), 255.0, "codes") is None
    assert native.row_grid(torch.randn(4, 3).t(), 255.0, "codes") is None  # column stride 4
    assert native.row_grid(torch.randn(3, 4, requires_grad=True), 255.0, "codes") is None
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.uint8 tensor of shape \(3, 4\)"):
        native.row_grid(torch.randn(3, 4), 255.0, "codes", out=torch.empty(3, 4))


@needs_native
@pytest.mark.parametrize("body", STUB_BODIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_epilogue_is_addcmul_or_sub(body: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    with split_over(threads, monkeypatch), _body(body):
        for m, n in [(1, 1), (3, 7), (5, 8), (17, 45), (64, 129)]:
            raw = torch.randn(m, n, generator=g) * 300
            a = torch.round(torch.randn(m, 1, generator=g) * 100)
            w, s = torch.randn(n, generator=g) * 3, torch.rand(m, 1, generator=g) * 1e-2
            for bias in (None, torch.randn(n, generator=g)):
                fused = raw.clone().addcmul_(a, w).mul_(s)
                sub = raw.clone().sub_(a * w).mul_(s)
                if bias is not None:
                    fused, sub = fused.add_(bias), sub.add_(bias)
                assert torch.equal(native.row_epilogue(raw.clone(), a, w, s, bias, True), fused), (m, n)
                assert torch.equal(native.row_epilogue(raw.clone(), a, w, s, bias, False), sub), (m, n)
        assert native.row_epilogue(torch.randn(2, 3).t(), torch.ones(3, 1), torch.ones(2), torch.ones(3, 1), None,
                                   True) is None  # not contiguous: nothing written, the caller's torch ops run


def _layer(k: int, n: int, reduce_range: bool) -> DLinear:
    torch.manual_seed(k + n)
    lin = nn.Linear(k, n)
    lin.qconfig = Q.get_dynamic_qconfig(reduce_range=reduce_range)
    return DLinear.from_float(lin)


@needs_native
@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("reduce_range", [False, True])
def test_dynamic_linear_routes_are_bit_identical_with_and_without_native(vnni: bool, reduce_range: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    force(monkeypatch, vnni=vnni, fbgemm=True)
    monkeypatch.setattr(no_vnni, "_CHUNK_ABOVE", 1 << 12)  # the chunked non-VNNI route at small sizes too
    q = _layer(96, 70, reduce_range)
    g = torch.Generator().manual_seed(2)
    for m in (1, 2, 5, 16, 40, 300, 4000):  # one row, few rows, chunks, blocked epilogue
        x = torch.randn(m, 96, generator=g) * torch.rand(m, 1, generator=g) * 4 + torch.randn(m, 1, generator=g)
        kernels.counts.clear()
        native.counts.clear()
        y = q(x)
        fast = sum(v for (b, _), v in kernels.counts.items() if b != "reference")
        ran = {k: v for k, v in native.counts.items() if v}
        with native.disabled():
            ref = q(x)
        assert fast >= 1 and torch.equal(y, ref), (m, vnni, reduce_range)
        if reduce_range:
            want = {"row_grid": 1, "qlinear_rows": 1}  # the 7-bit recipe: its codes, then one Linear call
        elif not vnni:
            want = {"row_grid": 1, "qlinear_rows": 1}  # the codes, sums and epilogue in one call (native.dyn_linear)
        elif vnni and native.vnni() and m <= pt.small_m.VNNI_M and m * 70 <= pt._BLOCK:
            want = {"row_grid": 1, "qlinear" if m == 1 else "qlinear_rows": 1}  # its codes, then the VNNI kernels' call
        elif vnni and m > 1:
            want = {"row_grid": 1, "row_epilogue": 1}  # (a VNNI CPU's oneDNN rows: the codes, then the row epilogue)
        else:
            want = {}  # one row on a VNNI CPU without lowbit's VNNI kernels: torch._int_mm, the grid read on the host
        assert ran == want, (m, vnni, reduce_range, ran)
    x[5, 3] = float("nan")  # a non-finite row: the generic path's NaN row (its epilogue rounds the others alike)
    y = q(x)
    ok = torch.allclose(y[:5], ref[:5], rtol=1e-5, atol=1e-5) and torch.allclose(y[6:], ref[6:], rtol=1e-5, atol=1e-5)
    assert bool(y[5].isnan().all()) and ok


@needs_native
def test_per_token_7bit_scratch_u_is_not_the_output() -> None:
    q = _layer(384, 40, True)
    x, other = torch.randn(1500, 384), torch.randn(900, 384)
    y = q(x)
    assert q(other).shape == (900, 40) and torch.equal(q(x), y)
    with native.disabled():
        assert torch.equal(q(x), y)
    assert reduced._native_u7(x) is not None


def test_without_the_build_callers_keep_their_torch_ops(tmp_path) -> None:
    code = ("import torch, lowbit as Q; from lowbit import native; from torch import nn\n"
            "l = nn.Linear(8, 4); l.qconfig = Q.get_dynamic_qconfig()\n"
            "from lowbit.nn.quantized.dynamic import Linear\n"
            "y = Linear.from_float(l)(torch.randn(300, 8))\n"
            "print(native.available(), native.reason(), y.shape[0])")
    env = {**os.environ, "LOWBIT_NATIVE": "0", "LOWBIT_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "LOWBIT_NATIVE=0", "300"]
    env = {**env, "LOWBIT_NATIVE": "1", "PATH": "/nonexistent", "CC": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("False no C compiler"), out.stdout


class _Convs(nn.Module):
    """Dense, grouped and depthwise convs (odd channel counts: vector bodies and tails), ReLU, ReLU6, no bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 21, 5, padding=2), nn.ReLU())  # 120 taps: past kernels.conv_small
        self.b = nn.Sequential(nn.Conv2d(21, 42, 3, padding=1, groups=3), nn.ReLU6())
        self.c = nn.Conv2d(42, 42, 3, padding=1, groups=42)
        self.d = nn.Conv2d(42, 13, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


@needs_native
@pytest.mark.parametrize("body", BODIES)
def test_split_weight_conv_epilogue_is_the_torch_passes(body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    force(monkeypatch, vnni=False, fbgemm=False)  # 8-bit codes without VNNI: the split-weight convs
    monkeypatch.setattr(conv_split, "GEMM_MIN_COUT", 1)  # (gemm_conv whatever the width: the 21- and 13-channel convs)
    torch.manual_seed(0)
    model = _Convs().eval()
    calib = [torch.randn(4, 3, 12, 12) for _ in range(3)]
    qmodel, _ = Q.quantize_ptq(model, calib, recipe="default")
    x = torch.randn(5, 3, 12, 12)
    y, ref, ran = _native_and_torch(body, lambda: qmodel(x))
    # the grouped conv: the split's epilogue; the depthwise: whole (dwconv); the 5x5 and the 1x1 (one group): the
    # any-code Linear on their patches (qlinear; the 5x5's made tile by tile in the call, conv_gemm; the scalar body,
    # which has no many-row kernel: by im2col first)
    patches = "im2col" if body == "scalar" else "conv_gemm"
    counted = tuple(ran.get(k) for k in ("conv_epilogue", "dwconv", "qlinear", patches))
    assert counted == (1, 1, 2, 1) and torch.equal(y, ref), ran


class _Depthwise(nn.Module):
    def __init__(self, c: int, k: int, stride: int, dilation: int, bias: bool, act: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Conv2d(3, c, 1)
        self.dw = nn.Sequential(nn.Conv2d(c, c, k, stride, dilation * (k // 2), dilation, groups=c, bias=bias), act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dw(self.pre(x))


@needs_native
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("c,k,stride,dilation,bias,act", [(32, 3, 1, 1, True, nn.ReLU6()), (21, 3, 2, 1, False, nn.ReLU()),
                                                          (40, 5, 2, 2, True, nn.Identity()), (7, 5, 1, 1, True, nn.ReLU()),
                                                          (48, 4, 1, 1, True, nn.ReLU())])  # (16 taps: pairs end even)
def test_native_depthwise_conv_is_the_split_oneDNN_conv(body: str, c: int, k: int, stride: int, dilation: int, bias: bool,
                                                        act: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    force(monkeypatch, vnni=False, fbgemm=False)
    torch.manual_seed(c + k)
    model = _Depthwise(c, k, stride, dilation, bias, act).eval()
    qmodel, _ = Q.quantize_ptq(model, [torch.randn(2, 3, 15, 13) * 2 for _ in range(2)], recipe="default")
    x = torch.randn(3, 3, 15, 13) * 2.5
    y, ref, ran = _native_and_torch(body, lambda: qmodel(x))
    assert ran.get("dwconv") == 1 and torch.equal(y, ref)


def _dw_reference(q: torch.Tensor, zx: int, taps: torch.Tensor, stride: list[int], padding: list[int],
                  dilation: list[int], scale: torch.Tensor, bias: torch.Tensor | None, inv: float, z: int, lo: int,
                  hi: int) -> torch.Tensor:
    """``native.dwconv``'s codes spelled out: exact sums of ``(q - zx) w`` over the in-bounds taps (float64 conv of
    integers), then ``acc_code``'s float32 steps in its order (clamps to ``[lo - z, hi - z]`` only where finite)."""
    c = q.shape[1]
    w = taps.permute(2, 0, 1).unsqueeze(1).double()
    acc = torch.nn.functional.conv2d(q.double() - zx, w, None, stride, padding, dilation, groups=c)
    t = acc.float() * scale.view(1, c, 1, 1)
    if bias is not None:
        t = t + bias.view(1, c, 1, 1)
    v = t * torch.tensor(inv, dtype=torch.float32)
    if lo > 0:
        v = v.clamp(min=float(lo - z))
    if hi < 255:
        v = v.clamp(max=float(hi - z))
    return torch.round(v + float(z)).clamp(0, 255).to(torch.uint8)


def _dw_cases() -> list[tuple]:
    """Geometries for the depthwise bodies: channel counts with and without a 16-channel tail, odd and even taps
    (1 to 64), strides, dilations, paddings past the kernel (rows of padding only), odd output widths (a last
    pixel alone), zero points 0 / 128 / 255, clamps finite and not, and scales sending codes far past [0, 255]."""
    g = torch.Generator().manual_seed(28)
    out = []
    fixed = [(16, 3, 3, 1, 1, 1), (33, 3, 3, 2, 1, 1), (48, 5, 5, 1, 2, 2), (17, 1, 1, 1, 0, 1), (32, 8, 8, 1, 3, 1),
             (64, 2, 3, 2, 4, 1), (5, 3, 3, 1, 1, 1), (96, 3, 3, 2, 1, 1)]
    for i in range(36):
        if i < len(fixed):
            c, kh, kw, s, p, d = fixed[i]
        else:
            r = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
            c, kh, kw, s, p, d = r(1, 70), r(1, 5), r(1, 5), r(1, 3), r(0, 4), r(1, 2)
        zx = (0, 128, 255, int(torch.randint(0, 256, (), generator=g)))[i % 4]
        z = int(torch.randint(0, 256, (), generator=g))
        lo, hi = ((0, 255), (z, 255), (max(z - 40, 0), min(z + 40, 255)), (0, z))[i % 4]
        inv = (0.02, 3e9, 1.0, 1e-3, 3e9)[i % 5]  # 3e9: far past the int32 range, the saturating codes
        out.append((i, 1 + i % 3, c, kh, kw, [s, s], [p, p], [d, d], zx, z, lo, hi, inv, i % 2 == 0))
    return out


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", _dw_cases(), ids=lambda c: f"case{c[0]}")
def test_native_depthwise_bodies_give_the_exact_codes(case: tuple, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    i, n, c, kh, kw, stride, padding, dilation, zx, z, lo, hi, inv, with_bias = case
    g = torch.Generator().manual_seed(100 + i)
    h, w = (kh - 1) * dilation[0] + 3 + i % 7, (kw - 1) * dilation[1] + 2 + i % 5
    q = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g)
    q = q.contiguous(memory_format=torch.channels_last) if i % 2 else q
    weight = torch.randint(-128, 128, (c, 1, kh, kw), dtype=torch.int8, generator=g)
    weight[0] = -128  # the extreme weights
    taps = native.dw_weight(weight)
    scale = torch.rand(c, generator=g) * 1e-3 + 1e-5
    bias = torch.randn(c, generator=g) if with_bias else None
    args = (zx, taps, stride, padding, dilation, scale, bias, inv, z, lo, hi)
    ref = _dw_reference(q, *args)
    with split_over(threads, monkeypatch):
        for body in ("scalar", "avx2"):
            with _body(body):
                native.counts.clear()
                got = native.dwconv(q, *args)
            assert native.counts["dwconv"] == 1 and torch.equal(got, ref), (body, case)


@needs_native
@pytest.mark.parametrize("lo", [0, 100])
def test_native_bodies_agree_where_a_scale_product_is_not_finite(lo: int) -> None:
    """A sum of 0 times an infinite ``fl(s_x s_w)`` is NaN: every body takes it through the clamp's max as the vector
    instructions do (NaN -> ``lo - z``), so the scalar and AVX2 bodies give one code (``lo``, or 0 without a floor) in
    the depthwise conv, the split conv's epilogue and the Linear's codes, 32 columns and fewer."""
    c = 40
    scale = torch.full((c,), 1e-3)
    scale[0] = scale[17] = float("inf")
    q = torch.full((2, c, 5, 5), 7, dtype=torch.uint8)
    taps = native.dw_weight(torch.ones(c, 1, 3, 3, dtype=torch.int8))
    w = torch.ones(c, 4, dtype=torch.int8)
    plan = native.linear_plan(w, "codes", scale, grid=(1.0, 100, lo, 255))
    x = torch.full((3, 4), 5, dtype=torch.uint8)
    halves = [torch.zeros(2, c, 3, 3).contiguous(memory_format=torch.channels_last)] * 2
    got = {}
    for body in ("scalar", "avx2"):
        with _body(body):
            y = torch.zeros(3, c, dtype=torch.uint8)
            assert plan is not None and plan.run(x, 5, y)
            got[body] = (native.dwconv(q, 7, taps, [1, 1], [1, 1], [1, 1], scale, None, 1.0, 100, lo, 255), y,
                         native.conv_epilogue(halves, 1, scale, None, 1.0, 100, lo, 255))
    for a, b in zip(got["scalar"], got["avx2"]):
        assert a is not None and torch.equal(a, b)
    dw, lin, epi = got["avx2"]
    assert dw[:, 0].eq(lo).all() and lin[:, 0].eq(lo).all() and epi[:, 17].eq(lo).all()


@needs_native
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("relu", [False, True])
def test_quantized_add_is_the_torch_passes(body: str, relu: bool) -> None:
    from lowbit.nn.quantized.functional_modules import QFunctional

    g = torch.Generator().manual_seed(3)
    cases = [((5, 7, 9, 11), Q.quint8, Q.quint8, Q.quint8), ((2, 33), Q.qint8, Q.quint8, Q.qint8),
             ((3, 16, 6, 6), Q.quint8, Q.qint8, Q.quint8), ((1,), Q.quint8, Q.quint8, Q.quint8)]
    for shape, da, db, dout in cases:
        for last in (False, True):
            xa, xb = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g) * 2 + 0.5
            if last and len(shape) == 4:
                xa, xb = xa.to(memory_format=torch.channels_last), xb.to(memory_format=torch.channels_last)
            a = Q.quantize_per_tensor(xa, 0.031, 3 if da == Q.qint8 else 120, da)
            b = Q.quantize_per_tensor(xb, 0.017, -5 if db == Q.qint8 else 90, db)
            f = QFunctional(0.043, 0 if dout == Q.qint8 else 128, dout)
            got, ref, ran = _native_and_torch(body, lambda f=f, a=a, b=b: f.add_relu(a, b) if relu else f.add(a, b))
            assert ran.get("qadd") == 1 and torch.equal(got.int_repr(), ref.int_repr()), (shape, da, db, dout, last)
            assert got.int_repr().stride() == ref.int_repr().stride()


@needs_native
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_max_pool_of_codes_is_the_window_maximum(body: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One native pass pools channels-last codes as the float op pools their values (exact on 8-bit codes): uint8 and
    int8 (compared signed), channel counts with 32- and 16-wide steps and scalar tails, windows 1x1 to 3x3, strides
    below / at / above the window, odd sizes whose last rows and columns no window reads; and QTensor pooling takes it."""
    g = torch.Generator().manual_seed(5)
    cases = [((3, 16, 28, 28), 2, 2, 2, 2), ((2, 37, 9, 11), 3, 3, 2, 2), ((2, 64, 8, 8), 2, 2, 1, 1),
             ((1, 5, 4, 4), 4, 4, 4, 4), ((2, 48, 7, 6), 3, 2, 2, 3), ((1, 33, 5, 5), 1, 1, 2, 2)]
    with split_over(threads, monkeypatch), _body(body):
        for dt, lo, hi in ((torch.uint8, 0, 256), (torch.int8, -128, 128)):
            for shape, kh, kw, sh, sw in cases:
                q = torch.randint(lo, hi, shape, generator=g, dtype=dt).contiguous(memory_format=torch.channels_last)
                native.counts.clear()
                got = native.maxpool_codes(q, kh, kw, sh, sw)
                want = torch.nn.functional.max_pool2d(q.float(), (kh, kw), (sh, sw)).to(dt)
                assert native.counts.get("maxpool") == 1 and torch.equal(got, want), (dt, shape, kh, kw, sh, sw)
                assert got.is_contiguous(memory_format=torch.channels_last)
        qt = Q.quantize_per_tensor(torch.randn(2, 24, 10, 10, generator=g), 0.05, 128, Q.quint8)
        qt = qt.contiguous(memory_format=torch.channels_last)
        native.counts.clear()
        y = torch.nn.functional.max_pool2d(qt, 2)
        assert native.counts.get("maxpool") == 1
        assert torch.equal(y.dequantize(), torch.nn.functional.max_pool2d(qt.dequantize(), 2))
    assert native.maxpool_codes(q.contiguous(), 2, 2, 2, 2) is None  # NCHW codes: not this pass's layout


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_codes_to_channels_last_is_the_torch_copy(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """NCHW 8-bit codes into channels-last memory: the values torch's copy gives, three-channel images (their own
    loop) and others, pixel counts off the 64-pixel blocks; other layouts and dtypes are declined."""
    g = torch.Generator().manual_seed(6)
    with split_over(threads, monkeypatch):
        for shape in [(4, 3, 30, 31), (2, 1, 5, 5), (3, 37, 9, 7), (1, 64, 16, 16), (2, 3, 1, 1)]:
            for dt, lo, hi in ((torch.uint8, 0, 256), (torch.int8, -128, 128)):
                q = torch.randint(lo, hi, shape, generator=g, dtype=dt)
                y = native.to_channels_last(q)
                assert y is not None and torch.equal(y, q) and y.is_contiguous(memory_format=torch.channels_last), shape
    assert native.to_channels_last(torch.zeros(2, 3, 4, dtype=torch.uint8)) is None
    assert native.to_channels_last(torch.zeros(2, 3, 4, 4)) is None
    assert native.to_channels_last(torch.zeros(2, 4, 3, 3, dtype=torch.uint8)[:, ::2]) is None


@needs_native
@pytest.mark.parametrize("body", STUB_BODIES)
def test_quantize_stub_takes_channels_last_inputs_in_one_pass(body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A channels-last image batch goes through the stub's one native pass (elementwise over memory): channels-last
    codes equal to the contiguous input's (and the torch path's), below and above DeQuantize's native size; DeQuantize
    gives the float values ``dequantize`` gives, channels-last too (its native pass above ``_NATIVE_DQ_MIN``)."""
    from lowbit.functional import dense_format
    from lowbit.nn.quantized.stubs import DeQuantize, Quantize

    g = torch.Generator().manual_seed(8)
    for scale, zp, qd in [(0.02, 128, Q.quint8), (0.013, 3, Q.quint8.with_range(0, 127)), (0.05, -4, Q.qint8)]:
        stub = Quantize(scale, zp, qd)
        for shape in [(2, 3, 7, 9), (8, 16, 24, 24)]:  # 378 and 73 728 elements: torch's dequantize and the native one
            x = (torch.randn(*shape, generator=g) * 4).contiguous(memory_format=torch.channels_last)
            got, ref, ran = _native_and_torch(body, lambda stub=stub, x=x: stub(x))
            flat = stub(x.contiguous())
            assert ran.get("quantize") == 1, (qd, shape)
            assert got.int_repr().is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(got.int_repr(), ref.int_repr()) and torch.equal(got.int_repr(), flat.int_repr())
            y = DeQuantize()(got)
            assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, flat.dequantize())
    assert dense_format(torch.zeros(2, 3, 4, 5)[..., ::2]) is None


def test_channels_last_bad_inputs_are_errors_or_torchs_result() -> None:
    """Channels-last NaN / Inf inputs to the stub: a NaN is the stub's error naming it, +-Inf saturates as torch's
    quantize does; ``lowbit::contiguous_codes`` given codes it does not cover (NCHW, float) gives torch's copy."""
    from lowbit.nn.quantized.stubs import Quantize

    stub = Quantize(0.05, 128, Q.quint8)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    x[1, 2, 3, 4] = float("nan")
    with pytest.raises(RuntimeError, match="holds 1 NaN values"):
        stub(x)
    x[1, 2, 3, 4], x[0, 0, 0, 0] = float("inf"), -float("inf")
    codes = stub(x).int_repr()
    assert codes[1, 2, 3, 4] == 255 and codes[0, 0, 0, 0] == 0
    for t in (torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8), torch.randn(2, 3, 4, 4)):
        y = torch.ops.lowbit.contiguous_codes(t)
        assert y.is_contiguous() and torch.equal(y, t)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_codes_to_contiguous_is_the_torch_copy(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Channels-last 8-bit codes into NCHW memory: the values torch's copy gives, channel counts on and off the
    16-channel tiles, pixel counts on and off the 16-pixel tiles and 64-pixel blocks; other layouts and dtypes are
    declined."""
    g = torch.Generator().manual_seed(7)
    with split_over(threads, monkeypatch):
        for shape in [(64, 32, 7, 7), (2, 3, 5, 5), (3, 17, 9, 11), (1, 16, 4, 4), (5, 48, 16, 16), (2, 33, 1, 70),
                      (2, 1, 3, 3), (1, 16, 8, 8)]:
            for dt, lo, hi in ((torch.uint8, 0, 256), (torch.int8, -128, 128)):
                q = torch.randint(lo, hi, shape, generator=g, dtype=dt).contiguous(memory_format=torch.channels_last)
                y = native.to_contiguous(q)
                assert y is not None and torch.equal(y, q) and y.is_contiguous(), shape
    assert native.to_contiguous(torch.zeros(2, 3, 4, dtype=torch.uint8)) is None
    assert native.to_contiguous(torch.zeros(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)) is None
    assert native.to_contiguous(torch.zeros(2, 4, 3, 3, dtype=torch.uint8)) is None  # NCHW: not this pass's layout


@needs_native
@pytest.mark.parametrize("body", STUB_BODIES)
def test_quantize_stub_is_the_torch_passes(body: str) -> None:
    """The stub's one native pass gives the torch path's codes at every size (tails of each vector width, 32 and 16
    floats, and the scalar rest), on 8-bit, 7-bit and int8 grids, with +Inf saturating; a NaN is the torch path's error."""
    from lowbit.nn.quantized.stubs import Quantize

    g = torch.Generator().manual_seed(4)
    grids = [(0.02, 128, Q.quint8), (0.013, 3, Q.quint8.with_range(0, 127)), (0.05, -4, Q.qint8), (0.1, 0, Q.quint8)]
    for scale, zp, qd in grids:
        stub = Quantize(scale, zp, qd)
        for shape in [(1, 768), (7, 13), (3, 5, 9, 9), (1,), (2, 3, 61, 47), (1, 63), (1, 47), (300, 257)]:
            x = torch.randn(*shape, generator=g) * 4
            x.view(-1)[0] = float("inf")  # saturates like torch's quantize
            got, ref, ran = _native_and_torch(body, lambda stub=stub, x=x: stub(x))
            assert ran.get("quantize") == 1 and torch.equal(got.int_repr(), ref.int_repr()), (scale, zp, qd, shape)
        x = torch.randn(4, 20, generator=g)
        x[2, 17] = float("nan")  # NaN: the torch path's error, nothing from the native pass
        with pytest.raises(RuntimeError, match="holds 1 NaN values"):
            stub(x)


@needs_native
@pytest.mark.parametrize("body", STUB_BODIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_dequantize_is_torchs(body: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``native.dequantize``: torch's per-tensor dequantize bit for bit (uint8 and int8 codes, every code, lengths on and
    off the 32- and 16-code vector steps, channels-last kept); non-dense or non-8-bit codes declined; bad grids raise."""
    g = torch.Generator().manual_seed(11)
    with split_over(threads, monkeypatch), _body(body):
        for dt, lo, hi in ((torch.uint8, 0, 256), (torch.int8, -128, 128)):
            for shape in [(256,), (1,), (15,), (31,), (33,), (3, 47), (2, 5, 7, 9), (1000,)]:
                q = torch.randint(lo, hi, shape, generator=g, dtype=dt)
                if len(shape) == 4:
                    q = q.contiguous(memory_format=torch.channels_last)
                if shape == (256,):
                    q = torch.arange(lo, hi).to(dt)  # every code
                for scale, zp in ((0.0123, lo + 3), (1e-30, hi - 1), (3e7, 0)):
                    y = native.dequantize(q, scale, zp)
                    want = functional.as_torch_quantized(q.contiguous(), scale, zp).dequantize()
                    assert y is not None and torch.equal(y, want) and y.stride() == q.stride(), (dt, shape, scale, zp)
                    assert torch.equal(y, (q.float() - zp) * torch.tensor(scale, dtype=torch.float32))
    assert native.dequantize(torch.zeros(4, 6, dtype=torch.uint8)[:, ::2], 0.1, 0) is None  # strided
    assert native.dequantize(torch.zeros(4), 0.1, 0) is None  # not codes
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale="):
            native.dequantize(torch.zeros(4, dtype=torch.uint8), scale, 0)
    with pytest.raises(ValueError, match="zero_point=300"):
        native.dequantize(torch.zeros(4, dtype=torch.uint8), 0.1, 300)
    for scale, zp, name in ((True, 0, "scale=True"), (0.1, 2.5, "zero_point=2.5"), (0.1, True, "zero_point=True")):
        with pytest.raises(ValueError, match=name):  # a bool or a fractional zero point is not a grid: never codes of one
            native.dequantize(torch.zeros(4, dtype=torch.uint8), scale, zp)
    empty = native.dequantize(torch.zeros(0, 3, dtype=torch.uint8), 0.1, 3)
    assert empty is None or (empty.shape == (0, 3) and empty.dtype == torch.float32)
    with pytest.raises(ValueError, match="zero_point=200"):
        native.dequantize(torch.zeros(4, dtype=torch.int8), 0.1, 200)


@needs_native
@pytest.mark.parametrize("body", STUB_BODIES)
def test_dequantize_stub_native_pass_is_torchs(body: str) -> None:
    """DeQuantize's native pass (plain codes and Quantize's / the split's codes on scale 1, from ``_NATIVE_DQ_MIN``
    codes; a kernel's own quantized output stays torch's one op) gives what ``QTensor.dequantize`` gives."""
    from lowbit.nn.quantized import stubs

    g = torch.Generator().manual_seed(12)
    n = stubs._NATIVE_DQ_MIN
    for qd, zp in ((Q.quint8, 131), (Q.quint8.with_range(0, 127), 0), (Q.qint8, -7)):
        for shape in ((n,), (3, n // 2 + 5), (1, n - 1)):
            codes = torch.randint(qd.quant_min, qd.quant_max + 1, shape, generator=g).to(qd.storage)
            plain = Q.QTensor(codes, 0.0371, zp, qd)
            tu = Q.QTensor._trusted(None, plain.scale, plain.zero_point, qd, None, None,
                                    functional.as_torch_quantized(codes.clone(), 1.0, zp))
            for qt in (plain, tu):
                got, ref, ran = _native_and_torch(body, lambda qt=qt: stubs.DeQuantize()(qt))
                assert torch.equal(got, plain.dequantize()) and torch.equal(ref, got)
                assert ran.get("dequantize", 0) == (1 if codes.numel() >= n else 0), (qd, shape)


def test_prune_removes_only_stale_builds_of_other_versions(tmp_path: Any) -> None:
    """A new build removes other versions' objects unused for ``_STALE_S`` seconds (and session 13's ``rowquant-*.so``),
    never the one it made, recent ones, or other files."""
    import time

    keep = tmp_path / "lowbit-native-new.so"
    names = ["lowbit-native-new.so", "lowbit-native-old.so", "rowquant-old.so", "lowbit-native-recent.so", "notes.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    past = time.time() - native._STALE_S - 60
    for name in ("lowbit-native-new.so", "lowbit-native-old.so", "rowquant-old.so", "notes.txt"):
        os.utime(tmp_path / name, (past, past))
    native._prune(keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lowbit-native-new.so", "lowbit-native-recent.so", "notes.txt"]


@needs_native
@pytest.mark.parametrize("body", BODIES)
def test_quantize_into_is_its_formula_for_any_clamp_bounds(body: str) -> None:
    """``quantize_into``: ``clamp(round(fl(clamp(fl(x · inv), lo, hi) + z)), storage)`` in float32 torch ops, for clamp
    bounds inside, across and outside the storage range (the AVX2 body folds the two clamps into one), int8 and uint8,
    ties, ±Inf, -0.0 and every tail length; a NaN anywhere (in the vector body or the tail) reports ``False``."""
    g = torch.Generator().manual_seed(11)
    bounds = [(None, None), (-3.0, 40.0), (-500.0, 500.0), (200.0, 300.0), (-300.0, -200.0), (5.0, 5.0), (-0.0, 0.0)]
    for n, (lo, hi), sgn, z in itertools.product((1, 15, 16, 17, 100), bounds, (False, True), (0, 7, -9)):
        if not sgn and z < 0:
            continue
        x = torch.randn(n, generator=g) * 60
        x[: min(n, 4)] = torch.tensor([0.5, 2.5, -0.0, float("inf")])[: min(n, 4)]  # ties (inv 1), -0.0, saturation
        for inv in (1.0, 0.37):
            v = (x * torch.tensor(inv)).clamp(-math.inf if lo is None else lo, math.inf if hi is None else hi)
            want = (v + z).round().clamp(-128 if sgn else 0, 127 if sgn else 255).to(torch.int8 if sgn else torch.uint8)
            out = torch.empty(n, dtype=torch.int8 if sgn else torch.uint8)
            with _body(body):
                assert native.quantize_into(x, inv, z, lo, hi, out), (n, lo, hi, sgn, z, inv)
            assert torch.equal(out, want), (n, lo, hi, sgn, z, inv)
        for at in {0, n // 2, n - 1}:
            y = x.clone()
            y[at] = float("nan")
            with _body(body):
                assert not native.quantize_into(y, 1.0, z, lo, hi, out), (n, at)


def _big_k(n: int, k: int) -> torch.Tensor:
    """int8 weights with ``127 · max Σ|w| ≥ 2²⁴``: the 7-bit split's float32 half sums may round on them."""
    w = torch.where(torch.arange(n)[:, None] % 3 == 0, -128, 127).expand(n, k).to(torch.int8).contiguous()
    w[:, ::7] = 5
    assert not small_m.split_exact(w, None) and small_m.int32_exact(w, None)
    return w


def _exact_floats(q: torch.Tensor, zx: int, w: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """``fl(fl(acc) · sc)`` with ``acc = Σ (q - z_x) w`` taken in int64 (an oracle independent of the routes)."""
    acc = torch.mm(q.reshape(-1, q.shape[-1]).long() - zx, w.long().t())
    return acc.float().mul_(sc).reshape(*q.shape[:-1], -1)


@needs_native
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("k,big", [(37, False), (768, False), (3000, True)])
def test_small_m_linear_is_the_fbgemm_split_route(body: str, k: int, big: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # 8-bit codes without VNNI, few rows: native.qlinear replaces _fbgemm_linear (the activation split), bit for bit,
    # for u8 and float outputs, ReLU, no bias, 3-d inputs; weights whose split sums could pass 2^24 (big) take it too,
    # where the build-less route is the exact float64 sums (the split would round them: checked to differ below)
    force(monkeypatch, vnni=False, fbgemm=True)
    from lowbit.kernels import OutGrid, avx2

    g = torch.Generator().manual_seed(k)
    n = 45
    w = _big_k(n, k) if big else torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    wq = Q.QTensor(w, torch.rand(n, generator=g) * 1e-3 + 1e-4, torch.zeros(n, dtype=torch.int64), Q.qint8, axis=0)
    split_rounds = 0
    for m in (1, 2, 3, 4):
        for lead in ((m,), (1, m)):
            x = Q.quantize_per_tensor(torch.randn(*lead, k, generator=g) * 2, 0.02, 131, Q.quint8)
            if big:  # same-signed codes far from z: the split's hi sums pass 2^24, where fl(hi) rounds
                codes = torch.randint(200, 256, (*lead, k), generator=g, dtype=torch.uint8)
                x = Q.QTensor(codes, torch.tensor(0.02), torch.tensor(2), Q.quint8)
                exact = _exact_floats(codes, 2, w, wq.scale * 0.02)
                old = avx2._fbgemm_linear(avx2._fbgemm_pack(w), codes, 0.02, 2, True, wq.scale, None, None, False)
                split_rounds += not torch.equal(old, exact)
                assert torch.equal(kernels.linear(x, wq, None, None, False), exact), (m, lead)
            for bias in (None, torch.randn(n, generator=g)):
                for out in (None, OutGrid(0.05 * (k / 37) ** 0.5, 120, Q.quint8)):
                    for relu in (False, True):
                        got, ref, ran = _native_and_torch(body, lambda x=x, b=bias, o=out, r=relu: kernels.linear(x, wq, b, o, r))
                        if out is not None:
                            got, ref = got.int_repr(), ref.int_repr()
                        ok = ran.get("qlinear", 0) == 1 and torch.equal(got, ref)
                        assert ok, (m, lead, bias is None, out is None, relu)
    assert split_rounds > 0 if big else True


@needs_native
@pytest.mark.parametrize("body", BODIES)
def test_big_k_static_linear_sums_are_exact_at_every_m(body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # past the split's float32 bound, a static Linear without VNNI gives fl(acc) at every M (few rows, past SMALL_M,
    # through the module's plan), with or without the native build: what a VNNI CPU gives
    force(monkeypatch, vnni=False, fbgemm=True)
    from lowbit.nn.quantized import Linear

    g = torch.Generator().manual_seed(4)
    k, n = 3000, 40
    w = Q.QTensor(_big_k(n, k), torch.rand(n, generator=g) * 1e-3 + 1e-4, torch.zeros(n, dtype=torch.long), Q.qint8, 0)
    bias = torch.randn(n, generator=g)
    mod = Linear(k, n)
    mod.set_weight_bias(w, bias)
    mod.set_output_grid(0.3, 0, Q.quint8)
    for m in (1, 7, 33, 100):
        codes = torch.randint(200, 256, (m, k), generator=g, dtype=torch.uint8)
        x = Q.QTensor(codes, 0.02, 2, Q.quint8)
        got, ref, ran = _native_and_torch(body, lambda x=x: mod(x))
        want = Q.quantize_per_tensor(_exact_floats(codes, 2, w.int_repr(), w.scale * 0.02) + bias, 0.3, 0, Q.quint8)
        ok = torch.equal(got.int_repr(), ref.int_repr()) and torch.equal(got.int_repr(), want.int_repr())
        assert ran.get("qlinear", 0) == 1 and ok, m


@needs_native
def test_sums_past_int32_take_the_exact_float64_route(monkeypatch: pytest.MonkeyPatch) -> None:
    # 255 · Σ|w| ≥ 2^31 (K = 66000 weights of -128): int32 accumulators could wrap, so no native plan runs; the
    # float64 sums are exact (|acc| < 2^53) and give fl(acc)
    force(monkeypatch, vnni=False, fbgemm=True)
    k, n = 66000, 2
    w = torch.full((n, k), -128, dtype=torch.int8)
    assert not small_m.int32_exact(w, None)
    wq = Q.QTensor(w, torch.tensor([1e-3, 2e-3]), torch.zeros(n, dtype=torch.long), Q.qint8, 0)
    codes = torch.full((3, k), 255, dtype=torch.uint8)
    codes[1] = 0
    x = Q.QTensor(codes, 0.5, 0, Q.quint8)
    native.counts.clear()
    y = kernels.linear(x, wq, None, None, False)
    assert not native.counts.get("qlinear") and torch.equal(y, _exact_floats(codes, 0, w, wq.scale * 0.5))
    assert y[0, 0].item() == pytest.approx(-255 * 128 * k * 5e-4, rel=1e-6)  # past 2^31 / 2 in magnitude: no wrap


@needs_native
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("k,bias", [(96, True), (768, False), (3000, True)])
def test_dynamic_8bit_rows_without_vnni_are_one_native_call(body: str, k: int, bias: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the 8-bit recipe without VNNI at every M, one row included: the codes, the exact sums and the generic epilogue in
    # one native call (native.dyn_linear on a "rows_sub" plan), the floats of the route without the build (fbgemm's
    # split or, where its sums could pass 2^24 as at K = 3000, float64 sums) and of the generic per_token_linear; a
    # row's floats are the same alone and in a batch
    force(monkeypatch, vnni=False, fbgemm=True)
    torch.manual_seed(k)
    lin = nn.Linear(k, 45, bias=bias)
    lin.qconfig = Q.get_dynamic_qconfig()
    q = DLinear.from_float(lin)
    assert small_m.split_exact(q.weight().int_repr(), None) == (k != 3000)
    for m in (1, 2, 3, 4, 40):
        for x in (torch.randn(m, k) * 3 + 1, torch.rand(m, k) * 5):  # mixed signs; one-signed (z_x at an end)
            got, ref, ran = _native_and_torch(body, lambda q=q, x=x: q(x))
            generic = pt.per_token_linear(pt.quantize_per_token(x), q.weight(), q.bias, {})
            ok = torch.equal(got, ref) and torch.equal(got, generic) and torch.equal(q(x[-1:]), got[-1:])
            assert {a: v for a, v in ran.items() if v} == {"row_grid": 1, "qlinear_rows": 1} and ok, (m, k, bias, ran)


def test_bad_arguments_raise_naming_the_value() -> None:
    # argument values a caller got wrong raise whether or not the build is here; tensors that do not fit return None
    x, q8 = torch.randn(3, 8), torch.zeros(3, 8, dtype=torch.uint8)
    cases = [
        (lambda: native.row_grid(x, 255.0, "bytes"), "mode='bytes'"),
        (lambda: native.row_grid(x, 0.0, "u"), "levels=0.0"),
        (lambda: native.row_grid(x, float("nan"), "codes"), "levels=nan"),
        (lambda: native.row_grid(x, 255.0, "codes", qmax=300.0), "qmax=300.0"),
        (lambda: native.conv_epilogue([torch.zeros(1, 4, 2, 2)], 1, torch.ones(2), None, 1.0, 0, 0, 300), "hi=300"),
        (lambda: native.conv_epilogue([torch.zeros(1, 4, 2, 2)], 1, torch.ones(2), None, 1.0, 256, 0, 255),
         "zero_point=256"),
        (lambda: native.conv_epilogue([torch.zeros(1, 4, 2, 2)], 1, torch.ones(2), None, float("inf"), 0, 0, 255),
         "inv=inf"),
        (lambda: native.conv_epilogue([torch.zeros(1, 4, 2, 2)], 0, torch.ones(2), None, 1.0, 0, 0, 255), "groups=0"),
        (lambda: native.qadd(q8, 0, 1.0, q8, 0, 1.0, 0, 0, 255, torch.int16), "storage=torch.int16"),
        (lambda: native.qadd(q8, 0, 1.0, q8, 0, 1.0, 0, 0, 255, torch.int8), "hi=255"),
        (lambda: native.qadd(q8, 0, -1.0, q8, 0, 1.0, 0, 0, 255, torch.uint8), "ka=-1.0"),
        (lambda: native.quantize_into(x, 0.0, 0, None, None, q8), "inv=0.0"),
        (lambda: native.maxpool_codes(torch.zeros(1, 2, 4, 4, dtype=torch.uint8), 2, 0, 2, 2), "kernel (2, 0)"),
        (lambda: native.quantize_into(x, 1.0, 300, None, None, q8), "zero_point=300"),
        (lambda: native.quantize_into(x, 1.0, 0, 5.0, 1.0, q8), "lo=5.0, hi=1.0"),
        (lambda: native.dw_weight(torch.zeros(4, 2, 3, 3, dtype=torch.int8)), "shape (4, 2, 3, 3)"),
        (lambda: native.dwconv(torch.zeros(1, 4, 5, 5, dtype=torch.uint8), 300, torch.zeros(3, 3, 4, dtype=torch.int16),
                               [1, 1], [1, 1], [1, 1], torch.ones(4), None, 1.0, 0, 0, 255), "zx=300"),
        (lambda: native.dwconv(torch.zeros(1, 4, 5, 5, dtype=torch.uint8), 0, torch.zeros(3, 3, 4, dtype=torch.int16),
                               [0, 1], [1, 1], [1, 1], torch.ones(4), None, 1.0, 0, 0, 255), "stride=[0, 1]"),
        (lambda: native.qlinear(q8, -1, torch.zeros(2, 8, dtype=torch.int8), torch.ones(2), None, None, False), "zx=-1"),
        (lambda: native.qlinear(q8, 0, torch.zeros(2, 8, dtype=torch.int8), torch.ones(2), None, (1.0, 0, 9, 3), False),
         "lo=9, hi=3"),
        (lambda: native.empty_codes((2,), 0, torch.int8), "dtype=torch.int8"),
        (lambda: native.empty_codes((2,), 200, torch.qint8), "zero_point=200"),
    ]
    for call, named in cases:
        with pytest.raises(ValueError, match=re.escape(named)):
            call()
    with native.disabled():  # the same errors with the native passes off
        with pytest.raises(ValueError, match="mode='bytes'"):
            native.row_grid(x, 255.0, "bytes")
