"""The eager fast paths of the Linear family (issue #10): the same numbers as the generic building blocks.

- ``quantize_per_token``'s lean qparams/codes are bit-identical to ``calculate_qparams`` + ``quantize``;
- the dynamic ``Linear`` forward (``per_token.dynamic_linear``: ``torch._int_mm`` at M = 1, one oneDNN call
  otherwise, on VNNI CPUs) matches ``per_token_linear`` on the reference backend, is counted in
  ``kernels.counts``, and leaves pinned backends, non-finite rows and affine weights to the generic path;
- the static M = 1 GEMV route of the oneDNN backend is exact (int32 sums) and requantizes within one code
  of ``int_mm`` (one folded rounding).

Both ISA branches run on any CPU: ``onednn.has_vnni`` is pinned; on a CPU without VNNI the forced-VNNI
cases use 7-bit weights (exact through the saturating AVX2 kernels too).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit import kernels, native
from lowbit.functional import quantize
from lowbit.kernels import OutGrid, isa, onednn
from lowbit.nn.quantized import dynamic as nnqd
from lowbit.nn.quantized.dynamic import no_vnni, per_token
from lowbit.qparams import calculate_qparams

from helpers import force

_REAL_VNNI = onednn.has_vnni() if onednn.available() else False


def _generic_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo, hi = x.amin(1), x.amax(1)
    s, z = calculate_qparams(lo, hi, Q.per_channel_affine, Q.quint8, validate=False)
    return quantize(x, s, z, Q.quint8, ch_axis=0, validate=False), s, z


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 300), exp=st.integers(-6, 6), kind=st.sampled_from(
    ["normal", "ties", "positive", "negative", "zero_row"]), seed=st.integers(0, 2**16))
def test_quantize_per_token_bit_identical_to_calculate_qparams(m: int, k: int, exp: int, kind: str, seed: int) -> None:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 10.0 ** exp
    if kind == "ties":
        x = torch.round(x * 4) / 4
    elif kind == "positive":
        x = x.abs()
    elif kind == "negative":
        x = -x.abs()
    elif kind == "zero_row":
        x[0] = 0
    got = per_token.quantize_per_token(x)
    q, s, z = _generic_codes(x)
    assert torch.equal(got.int_repr(), q) and torch.equal(got.scale, s) and torch.equal(got.zero_point, z)


def _force_vnni(monkeypatch: pytest.MonkeyPatch, vnni: bool) -> None:
    if not onednn.available():
        pytest.skip("oneDNN int8 ops not available in this torch build")
    monkeypatch.setattr(onednn, "has_vnni", lambda: vnni)


def _dyn(k: int, n: int, seed: int, *, seven_bit: bool, bias: bool = True) -> nnqd.Linear:
    torch.manual_seed(seed)
    mod = nnqd.Linear.from_float(nn.Linear(k, n, bias=bias))
    if seven_bit:  # exact through vpmaddubsw as well (a CPU without VNNI forced onto the VNNI route)
        w = mod.weight()
        codes = w.int_repr().clamp(-64, 63)
        mod.set_weight_bias(Q.QTensor(codes, w.scale, w.zero_point, w.qdtype, axis=0), mod.bias)
    return mod


def _generic(mod: nnqd.Linear, x: torch.Tensor) -> torch.Tensor:
    with kernels.use_backend("reference"):
        return per_token.per_token_linear(per_token.quantize_per_token(x), mod.weight(), mod.bias, {})


@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "no_vnni"])
@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_dynamic_forward_matches_generic(monkeypatch: pytest.MonkeyPatch, vnni: bool, m: int, bias: bool) -> None:
    _force_vnni(monkeypatch, vnni)
    mod = _dyn(48, 20, m, seven_bit=vnni and not _REAL_VNNI, bias=bias)
    x = torch.randn(m, 48) * torch.rand(m, 1) * 5
    kernels.counts.clear()
    y = mod(x)
    ran = dict(kernels.counts)
    ref = _generic(mod, x)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5), float((y - ref).abs().max())
    assert not any(b == "reference" for b, _ in ran), ran
    if vnni:
        assert ran == {("int_mm" if m == 1 else "onednn", "linear"): 1}, ran


@pytest.mark.parametrize("m", [1, 5, onednn.SMALL_M, onednn.SMALL_M + 1, 70])
@pytest.mark.parametrize("engine_fbgemm", [True, False], ids=["fbgemm", "onednn"])
def test_dynamic_no_vnni_route_bit_identical_to_generic(monkeypatch: pytest.MonkeyPatch, m: int,
                                                        engine_fbgemm: bool) -> None:
    """Without VNNI the module's route (no per-call wrapping) gives the generic path's floats bit for bit at every M,
    one row included (lowbit.native's one call or the onednn backend's float route, or fbgemm's split, on an fbgemm
    engine; oneDNN above ``SMALL_M`` rows on another). Until session 26 one row took a weight split on fbgemm, equal
    only up to float32 rounding."""
    _force_vnni(monkeypatch, False)
    if not engine_fbgemm:
        monkeypatch.setattr(isa, "_FBGEMM", ())
    mod = _dyn(96, 24, m, seven_bit=False)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g) * torch.rand(m, 1, generator=g) * 4 + torch.rand(m, 1, generator=g)
    kernels.counts.clear()
    y = mod(x)
    assert dict(kernels.counts) == {("onednn", "linear"): 1}
    want = per_token.per_token_linear(per_token.quantize_per_token(x), mod.weight(), mod.bias, {})
    assert torch.equal(y, want), float((y - want).abs().max())


@pytest.mark.parametrize("m", [2 * onednn.SMALL_M + 2, 70, 301])
def test_dynamic_no_vnni_row_chunks_bit_identical_to_one_call(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    """Large outputs without VNNI run in row chunks of ``_OUT_CHUNK`` output floats (above ``_CHUNK_ABOVE``), each of
    more than ``SMALL_M`` rows so that every chunk takes the one-call route: the generic path's floats bit for bit,
    counted once. Fails if a chunk is lost, overlaps, or falls to fbgemm's few-row route (another rounding order).
    (The chunks serve the oneDNN / fbgemm route, taken where lowbit.native's one call is not: switched off here.)"""
    _force_vnni(monkeypatch, False)
    monkeypatch.setattr(no_vnni, "_native_rows8", lambda *a: None)
    monkeypatch.setattr(no_vnni, "_OUT_CHUNK", 24 * 40)  # 40 rows of N = 24 per chunk, at least SMALL_M + 1
    monkeypatch.setattr(no_vnni, "_CHUNK_ABOVE", 0)
    mod = _dyn(96, 24, m, seven_bit=False)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g) * torch.rand(m, 1, generator=g) * 4 + torch.rand(m, 1, generator=g)
    rows: list[int] = []
    real = onednn.linear

    def spy(xq: Any, *args: Any) -> Any:
        rows.append(xq.int_repr().shape[0])
        return real(xq, *args)

    monkeypatch.setattr(onednn, "linear", spy)
    kernels.counts.clear()
    y = mod(x)
    assert dict(kernels.counts) == {("onednn", "linear"): 1}
    assert sum(rows) == m and len(rows) == min(-(-m // 40), m // (onednn.SMALL_M + 1)) > 1, rows
    assert min(rows) > onednn.SMALL_M, rows
    monkeypatch.setattr(onednn, "linear", real)
    want = per_token.per_token_linear(per_token.quantize_per_token(x), mod.weight(), mod.bias, {})
    assert torch.equal(y, want), float((y - want).abs().max())


@pytest.mark.parametrize("m", [1, 2, 7, onednn.SMALL_M])
def test_dynamic_few_rows_without_vnni_are_integer_exact(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    """Few rows without VNNI on fbgemm: full-range codes (0 and 255 in every row) against weights whose pairs saturate
    ``vpmaddubsw`` (127, 127 / -128, -128): with unit weight scales and no bias, ``y`` is ``s_x`` times the exact
    integer sum ``Σ (q_x - z_x) q_w`` bit for bit (every intermediate is an integer below 2²⁴)."""
    _force_vnni(monkeypatch, False)
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch built without fbgemm")
    monkeypatch.setattr(torch.backends.quantized, "engine", "x86")
    g = torch.Generator().manual_seed(m)
    k, n = 97, 11
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[:, :4] = torch.tensor([127, 127, -128, -128], dtype=torch.int8)
    mod = nnqd.Linear(k, n, bias=False)
    mod.set_weight_bias(Q.QTensor(codes, torch.ones(n), torch.zeros(n, dtype=torch.long), Q.qint8, axis=0), None)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 3).clamp(-3.9, 5.9)
    x[:, :4] = torch.tensor([6.0, 6.0, -4.0, -4.0])  # the row's extremes on the saturating pairs: codes 255, 255, 0, 0
    xq = per_token.quantize_per_token(x)
    assert (xq.int_repr()[:, :2] == 255).all() and (xq.int_repr()[:, 2:4] == 0).all()
    kernels.counts.clear()
    y = mod(x)
    assert dict(kernels.counts) == {("onednn", "linear"): 1}
    exact = ((xq.int_repr().long() - xq.zero_point[:, None]) @ codes.long().t()).float()
    assert torch.equal(y, exact * xq.scale[:, None])


@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "no_vnni"])
def test_dynamic_m1_is_integer_exact(monkeypatch: pytest.MonkeyPatch, vnni: bool) -> None:
    """Unit weight scales, no bias: ``y / s_x`` is the exact integer sum ``Σ (q_x - z_x) q_w``."""
    _force_vnni(monkeypatch, vnni)
    g = torch.Generator().manual_seed(1)
    k, n = 70, 9
    mod = nnqd.Linear(k, n, bias=False)
    lo, hi = (-64, 63) if vnni and not _REAL_VNNI else (-128, 127)
    codes = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    mod.set_weight_bias(Q.QTensor(codes, torch.ones(n), torch.zeros(n, dtype=torch.long), Q.qint8, axis=0), None)
    x = torch.randn(1, k, generator=g)
    xq = per_token.quantize_per_token(x)
    exact = (xq.int_repr().long() - xq.zero_point[:, None]) @ codes.long().t()
    y = mod(x)
    assert torch.allclose(y / xq.scale[:, None], exact.double().float(), rtol=1e-6, atol=1e-3)


def test_dynamic_generic_path_for_pins_nonfinite_rows_and_affine_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    _force_vnni(monkeypatch, True)
    mod = _dyn(16, 8, 0, seven_bit=not _REAL_VNNI)
    x = torch.randn(4, 16)
    kernels.counts.clear()
    with kernels.use_backend("reference"):
        y = mod(x)
    assert dict(kernels.counts) == {("reference", "linear"): 1}
    assert torch.allclose(y, _generic(mod, x), rtol=1e-5, atol=1e-5)
    x[2, 3] = float("nan")
    y = mod(x)
    assert bool(torch.isnan(y[2]).all()) and bool(torch.isfinite(y[[0, 1, 3]]).all())
    x[2, 3], x[0, 1], x[3, 4] = 0.0, float("inf"), -float("inf")  # ±Inf rows too: NaN out (they were clamped to ~1e37)
    y = mod(x)
    assert bool(torch.isnan(y[[0, 3]]).all()) and torch.allclose(y[[1, 2]], mod(x[[1, 2]]), rtol=1e-5, atol=1e-5)
    xq = per_token.quantize_per_token(x)
    assert xq.scale[[0, 3]].isnan().all() and xq.zero_point[[0, 3]].tolist() == [0, 0]  # not -2^63
    x[0, 1] = x[3, 4] = 0.0
    w = mod.weight()  # an affine weight (non-zero zero points): the fast paths decline
    mod.set_weight_bias(Q.QTensor(w.int_repr().clamp(-60, 60), w.scale, torch.full((8,), 2), w.qdtype, axis=0),
                        mod.bias)
    x[2, 3] = 0.0
    assert torch.allclose(mod(x), _generic(mod, x), rtol=1e-5, atol=1e-5)


def _static_operands(k: int, n: int, seed: int, seven_bit: bool) -> tuple[Q.QTensor, Q.QTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-64, 63) if seven_bit else (-128, 127)
    w = Q.QTensor(torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 50,
                  torch.zeros(n, dtype=torch.long), Q.qint8, axis=0)
    x = Q.QTensor(torch.randint(0, 256, (1, k), generator=g, dtype=torch.uint8), 0.03, 100, Q.quint8)
    return x, w, torch.randn(n, generator=g)


@pytest.mark.parametrize("out", [None, OutGrid(0.05, 128, Q.quint8), OutGrid(0.05, 0, Q.qint8)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("fbgemm,shared", [(False, True), (True, True), (True, False)],
                         ids=["onednn_engine", "x86_engine", "x86_engine_avx_vnni"])
def test_static_gemv_route_matches_int_mm(monkeypatch: pytest.MonkeyPatch, out: OutGrid | None, relu: bool,
                                          fbgemm: bool, shared: bool) -> None:
    """One row on a VNNI CPU: torch._int_mm's GEMV on the onednn engine or with AVX-VNNI only; on the x86 engine with
    AVX-512 VNNI the routes without VNNI (lowbit.native's kernels: the same floats, codes within one of the folded
    rounding)."""
    force(monkeypatch, vnni=True, fbgemm=fbgemm, shared=shared)
    fbgemm = fbgemm and shared  # (the shared routes ran)
    ran: list[Any] = []
    real = onednn._gemv
    monkeypatch.setattr(onednn, "_gemv", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    x, w, b = _static_operands(96, 24, 3, not _REAL_VNNI)
    with kernels.use_backend("onednn"):
        got = kernels.linear(x, w, b, out, relu, cache={})
    with kernels.use_backend("int_mm"):
        want = kernels.linear(x, w, b, out, relu, cache={})
    assert bool(ran) != fbgemm, "the M = 1 GEMV route ran on the x86 engine" if fbgemm else "the GEMV route did not run"
    if out is None:
        assert torch.equal(got, want)
    else:  # one folded rounding: within one code of the reference at ties, the same codes elsewhere
        diff = (got.int_repr().int() - want.int_repr().int()).abs()
        assert got.qdtype == out.qdtype and int(diff.max()) <= 1 and int((diff > 0).sum()) <= 1


@settings(max_examples=30, deadline=None)
@given(r=st.integers(1, 9), c=st.integers(1, 40), block=st.integers(1, 64), z=st.integers(-128, 255),
       qd=st.sampled_from(["quint8", "qint8", "quint8_7bit", "qint32"]), seed=st.integers(0, 2**16))
def test_blocked_codes_bit_identical(r: int, c: int, block: int, z: int, qd: str, seed: int) -> None:
    """``lowbit.blocked.codes`` (row blocks, int8 cast + xor for uint8) gives ``quantize``'s codes, ties included."""
    from lowbit import blocked

    qdtype = {"quint8": Q.quint8, "qint8": Q.qint8, "quint8_7bit": Q.quint8.with_range(0, 127),
              "qint32": Q.qint32}[qd]
    z = max(qdtype.quant_min, min(qdtype.quant_max, z))
    g = torch.Generator().manual_seed(seed)
    s = float(torch.rand((), generator=g)) * 0.1 + 1e-3
    x = torch.randint(-600, 600, (r, c), generator=g).float() * (s / 2)  # many exact ties
    x += torch.randn(r, c, generator=g) * s * (seed % 2)
    want = quantize(x, s, z, qdtype)
    inv = torch.scalar_tensor(float(torch.tensor(s).reciprocal()))
    got = blocked.codes(x, inv, torch.scalar_tensor(float(z)), qdtype.quant_min, qdtype.quant_max, qdtype.storage, block)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # per row (the per-token grids): row m on its own (inv, z)
    xq = per_token.quantize_per_token(x)
    inv_r = torch.reciprocal(xq.scale)[:, None]
    got = blocked.codes(x, inv_r, xq.zero_point.float()[:, None], 0, 255, torch.uint8, block)
    assert torch.equal(got, xq.int_repr())


def test_large_inputs_take_the_one_pass_store_with_the_same_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-tensor ``Quantize`` and per-token codes of a large input (above 4096 codes) are stored in one pass
    (``lowbit.qstore``: a view of the quantized tensor's storage, no copy); the same codes as the float ops."""
    from lowbit import qstore
    from lowbit.nn.quantized.stubs import Quantize

    monkeypatch.setattr(native, "_lib", lambda: None)  # (the torch path: lowbit.native takes this size in one pass)
    x = torch.randn(200, 33) * 3
    x[0, :4] = torch.tensor([0.025, 0.075, -0.025, 100.0])  # ties on the 0.05 grid, saturation
    q = Quantize(0.05, 131, Q.quint8)
    calls: list[int] = []
    real = qstore.plain  # (Quantize decides qstore.codes' route once per grid and stores inline: its mark is the
    monkeypatch.setattr(qstore, "plain", lambda *a, **kw: calls.append(1) or real(*a, **kw))  # quantized tensor kept)
    qx = q(x)
    assert qx._tu is not None and qx._c is None
    fast = (qx.int_repr(), per_token.quantize_per_token(x).int_repr())
    assert len(calls) == 1 and qx._tu is not None and qx._tu.data_ptr() == qx.int_repr().data_ptr()  # (a view)
    monkeypatch.setattr(qstore, "exact", lambda fused: False)  # the float ops (a new grid decides again)
    slow = (Quantize(0.05, 131, Q.quint8)(x).int_repr(), per_token.quantize_per_token(x).int_repr())
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(fast, slow))


@pytest.mark.parametrize("qdtype,zero_point", [(Q.quint8.with_range(0, 127), 60), (Q.quint8.with_range(0, 127), 0),
                                               (Q.qint8.with_range(-64, 63), -3), (Q.quint8, 131), (Q.qint8, -7)],
                         ids=["u7", "u7-z0", "s7", "u8", "s8"])
def test_quantize_skips_the_upper_clamp_only_where_no_value_reaches_it(qdtype: Q.QDtype, zero_point: int) -> None:
    """``Quantize``'s eager store leaves out the upper clamp of ``v = fl(x · inv)`` when the NaN check's max ``top``
    gives ``top · inv ≤ qmax - z``: its codes equal the float oracle ``clamp(round(fl(fl(x · inv) + z)))`` with the
    maximum just below, on and just above the bound (float32 neighbours), at ±inf, on ties, for empty, one-element
    and vector-plus-tail lengths, and with the scale changed in place (the grid cache follows it)."""
    from lowbit.nn.quantized.stubs import Quantize

    g = torch.Generator().manual_seed(5)
    q = Quantize(0.0371, zero_point, qdtype)
    for step, scale in enumerate((0.0371, 0.21, 1e-3)):
        with torch.no_grad():
            q.scale.fill_(scale)
        inv = torch.tensor(scale, dtype=torch.float32).reciprocal()
        bound = torch.tensor(float(qdtype.quant_max - zero_point), dtype=torch.float32)
        edge = bound / inv  # the x whose product lands on or next to the bound
        tops = [edge, torch.nextafter(edge, torch.tensor(1e30)), torch.nextafter(edge, torch.tensor(-1e30)),
                (bound - 0.5) / inv, (bound + 0.5) / inv, torch.tensor(float("inf")), torch.tensor(-50.0) * scale]
        for n, top in itertools.product((0, 1, 7, 8, 9, 33, 4100), tops):
            x = (torch.rand(n, generator=g) - 0.7) * (bound / inv) * 2.2
            if n:
                x = torch.minimum(x, top)
                x[n // 2] = top
            if n > 3:
                x[:3] = (torch.tensor([0.5, -1.5, 2.5]) - zero_point) / inv  # ties on the grid
                x = torch.minimum(x, top)
            want = torch.add(torch.mul(x, inv), float(zero_point)).round_().clamp_(qdtype.quant_min, qdtype.quant_max)
            got = q(x)
            assert torch.equal(got.int_repr(), want.to(qdtype.storage)), (step, n, float(top))
            assert got.int_repr().max().item() <= qdtype.quant_max if n else got.shape == (0,)
