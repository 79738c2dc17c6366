"""``lowbit.native``'s int8 Linears without VNNI (``native/gemm.py``, ``linear.c``) against their references, bit for bit.

The "requant" mode is checked against torch's own fbgemm ``quantized::linear(_relu)`` (the op it replaces), the
"float" mode against the exact integer sums scaled in float32, every sum kernel (the one-row dot products, the packed
many-row kernel from ``native.BCAST_M`` rows, int16 words) with row counts past a row chunk (``native.MAX_ROWS``), both C
bodies (AVX2 and scalar), split over 1 and 2 threads; then the routes that take them: the static Linear with a u8
output (``kernels.small_m``), the 7-bit per-token dynamic Linear, and the Quantize stub's plain codes.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import native
from lowbit.native.gemm import pack_bcast, pack_vnni

from helpers import force, num_threads, split_over

needs_native = pytest.mark.skipif(not native.available(), reason=f"lowbit.native not built: {native.reason()}")
needs_fbgemm = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm in torch")


def _body(name: str) -> contextlib.AbstractContextManager[None]:
    """Each C body pinned: "vnni" (the AVX-512 VNNI Linears; skipped where the CPU lacks them), "avx2" (even on a
    VNNI CPU), "scalar"."""
    if name == "vnni" and not native.vnni():
        pytest.skip("this CPU has no AVX-512 VNNI (or lowbit.native's VNNI kernels are off): the VNNI body cannot run")
    if name == "avx2" and "AVX2" not in native.reason():
        pytest.skip("this CPU has no AVX2 + FMA: the AVX2 body cannot run")
    return native.force_scalar() if name == "scalar" else native.force_avx2() if name == "avx2" else contextlib.nullcontext()


def _fbgemm_linear(q: torch.Tensor, sx: float, zx: int, w: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                   so: float, zo: int, relu: bool) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wq = torch._make_per_channel_quantized_tensor(w, sw.double(), torch.zeros(w.shape[0], dtype=torch.long), 0)
        xt = torch._make_per_tensor_quantized_tensor(q, sx, zx)
    op = torch.ops.quantized.linear_relu if relu else torch.ops.quantized.linear
    return op(xt, torch.ops.quantized.linear_prepack(wq, bias), so, zo).int_repr()


@needs_native
@needs_fbgemm
@pytest.mark.parametrize("body,threads", [("vnni", 1), ("vnni", 2), ("avx2", 1), ("avx2", 2), ("scalar", 1)])
def test_requant_mode_is_fbgemm_quantized_linear(body: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Codes ≤ 127 against any int8 weight and 8-bit codes against saturation-safe weights, M from 1 (the dot
    products) to 133 (the packed kernels' row blocks with every remainder, over three row chunks), K with every tail,
    N over 1-4 blocks of 16 columns in a chunk and past it, zero points 0 / 57, bias or none, ReLU, output scales that
    saturate both ends: fbgemm's codes exactly."""
    _body(body)  # (skips now where the CPU lacks this body, before any reference is computed)
    g = torch.Generator().manual_seed(threads)
    wrong, cases = [], []
    # fbgemm's codes first, on 1 thread (exact integer codes, the same at any thread count; at 2 threads on 2 shared
    # cores each of these 2560 small calls waited on torch's pool: [avx2-2] 87 s, [avx2-1] 4 s), then lowbit's, split
    # over ``threads``; the same inputs in the same order as when both ran in one loop
    with num_threads(1):
        for m, k, n, seven in itertools.product((1, 2, 3, 11, 15, 18, 64, 133), (5, 32, 100, 769),
                                                (1, 7, 20, 40, 70),
                                                (True, False)):
            hi_x, w_lo, w_hi = (127, -128, 127) if seven else (255, -64, 64)
            q = torch.randint(0, hi_x + 1, (m, k), generator=g, dtype=torch.uint8)
            w = torch.randint(w_lo, w_hi + 1, (n, k), generator=g, dtype=torch.int8)
            sw = torch.rand(n, generator=g) * 0.01 + 1e-4
            for zx, has_bias, relu in itertools.product((0, 57), (False, True), (False, True)):
                bias = torch.randn(n, generator=g) * 3 if has_bias else None
                sx, so, zo = 0.02, (0.05 if k < 100 else 0.4), 60
                ref = _fbgemm_linear(q, sx, zx, w, sw, bias, so, zo, relu)
                atws = torch.tensor(sx, dtype=torch.float32) * sw
                mult = atws / torch.tensor(so, dtype=torch.float32)
                bterm = None if bias is None else bias / atws
                cases.append(((m, k, n, seven, zx, has_bias, relu), q, zx, w, mult, bterm, zo, relu, ref))
    with split_over(threads, monkeypatch):
        for case, q, zx, w, mult, bterm, zo, relu, ref in cases:
            with _body(body):
                got = native.qlinear_requant(q, zx, w, None, mult, bterm, zo, zo if relu else 0, 255, True)
            if got is None or not torch.equal(got, ref):
                wrong.append(case)
    assert len(cases) == 2560 and not wrong, wrong[:5]


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_vnni_packing_from_one_row_and_the_dot_products_give_the_same_sums(threads: int,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With AVX-512 VNNI a plan packs its weights (``pack_vnni``) on its first call, one row included, and every row
    count runs the packed kernel (``blk_bcast_vnni``: 6 rows × up to 4 column vectors, chunks of 64 columns); a plan
    packed for the AVX2 kernels (``pack_bcast``, made under ``force_avx2``) runs the VNNI dot products
    (``blk_dot_vnni``) instead. All give the exact sums, over K tails, N over 1-4 blocks of a chunk and several
    chunks, and row counts with every remainder of the 6-row blocks."""
    _body("vnni")
    g = torch.Generator().manual_seed(31)
    with split_over(threads, monkeypatch):
        for k, n in itertools.product((4, 63, 64, 129, 770), (1, 16, 33, 70, 200)):
            w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
            for m in (1, 2, 7, 13):
                q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
                want = ((q.int() - 7) @ w.int().t()).float()
                for avx2_first in (False, True):
                    plan = native.linear_plan(w, "float", torch.ones(n))
                    assert plan is not None
                    if avx2_first:
                        with native.force_avx2():  # (packs for the AVX2 kernels: 2 m >= BCAST_M rows)
                            assert plan.run(q.repeat(2, 1), 7, torch.empty(2 * m, n))
                    y = torch.full((m, n), float("nan"))
                    assert plan.run(q, 7, y)
                    assert (plan._wv is not None and plan._wv.numel() > 0) == (not avx2_first), (k, n, m, avx2_first)
                    assert torch.equal(y, want), (k, n, m, avx2_first)
                    if not avx2_first:  # packed for VNNI, then the AVX2 bodies: their dot products, the same sums
                        with native.force_avx2():
                            y2 = torch.full((m, n), float("nan"))
                            assert plan.run(q, 7, y2) and torch.equal(y2, want), (k, n, m)


@needs_native
@pytest.mark.parametrize("body", ["vnni", "avx2", "scalar"])
def test_float_mode_is_the_exact_sums_scaled_for_both_kernels(body: str) -> None:
    """"float": ``fl(fl(Σ (q - z) w) · sc) + b`` (ReLU), the same floats from the pair kernel (codes ≤ 127) and the
    int16 kernel (any codes); strided rows and a ``quint8`` input read as they are."""
    g = torch.Generator().manual_seed(9)
    for m, k, n in itertools.product((1, 2, 5, 33, 70), (3, 32, 65, 300), (4, 9, 66)):
        base = torch.randint(0, 256, (m, k + 3), generator=g, dtype=torch.uint8)
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sc, bias = torch.rand(n, generator=g) * 1e-3, torch.randn(n, generator=g)
        for q, pairs in ((base[:, :k], False), (base[:, :k] // 2, True)):  # (a strided view: row stride k + 3)
            exact = (q.int() - 19) @ w.int().t()
            for relu in (False, True):
                want = exact.float() * sc + bias
                want = want.relu() if relu else want
                with _body(body):
                    got = native.qlinear(q, 19, w, sc, bias, None, relu, pairs=pairs)
                assert got is not None and torch.equal(got, want), (m, k, n, pairs, relu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tq = torch._make_per_tensor_quantized_tensor(torch.randint(0, 128, (2, 40), dtype=torch.uint8), 1.0, 3)
    w = torch.randint(-128, 128, (8, 40), dtype=torch.int8)
    plan = native.linear_plan(w, "float", torch.ones(8), pairs=True)
    y = torch.empty(2, 8)
    assert plan is not None and plan.run(tq, 3, y) and torch.equal(y, ((tq.int_repr().int() - 3) @ w.int().t()).float())


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("body", ["best", "avx2"])
def test_many_row_tiles_give_every_row_its_sums(threads: int, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past one L2 tile of the many-row kernels (``linear.c`` ``tile_rows``: 256 KiB of codes, 2 bytes a code for
    8-bit codes without VNNI), with a part tile and a part row chunk at the end, columns past one chunk, both plan kinds:
    every row's exact sums, in "codes" mode too (where a lost or repeated tile would leave or overwrite codes)."""
    g = torch.Generator().manual_seed(26)
    with split_over(threads, monkeypatch):
        for m, k, pairs in ((777, 1000, False), (777, 1000, True), (300, 4100, False)):  # tiles of 128 / 256 / 0 rows
            q = torch.randint(0, 128 if pairs else 256, (m, k), generator=g, dtype=torch.uint8)
            w = torch.randint(-128, 128, (70, k), generator=g, dtype=torch.int8)
            want = ((q.int() - 5) @ w.int().t()).float()
            plan = native.linear_plan(w, "float", torch.ones(70), pairs=pairs)
            codes = native.linear_plan(w, "codes", torch.ones(70), pairs=pairs, grid=(1 / 64.0, 100, 0, 255))
            y, c = torch.full((m, 70), float("nan")), torch.zeros(m, 70, dtype=torch.uint8)
            with _body(body) if body == "avx2" else contextlib.nullcontext():
                assert plan is not None and plan.run(q, 5, y) and codes is not None and codes.run(q, 5, c)
            assert torch.equal(y, want), (m, k, pairs)
            assert torch.equal(c, (want / 64).round().add(100).clamp(0, 255).to(torch.uint8)), (m, k, pairs)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("body", ["best", "avx2", "scalar"])
def test_codes_of_every_column_chunk_are_the_epilogue_steps(threads: int, body: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """"codes" and "float" mode over several 64-column chunks (``linear.c``'s CB; the 32-code steps of the codes
    epilogue, its 8-code steps and scalar tail): each chunk's ``z_x Σ w`` (made once per chunk), grids clamped and not,
    output scales sending codes past both ends of [0, 255] and past the int32 range, per-column scales and biases."""
    g = torch.Generator().manual_seed(28)
    wrong = []
    with split_over(threads, monkeypatch):
        for m, k, n in ((1, 40, 200), (70, 24, 200), (133, 100, 137), (9, 16, 96)):
            q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
            w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
            sc = torch.rand(n, generator=g) * 1e-2 + 1e-4
            bias = torch.randn(n, generator=g) * 3
            for zx, (inv, z, lo, hi) in itertools.product((0, 1, 128, 255), ((4.0, 100, 0, 255), (0.5, 0, 0, 255),
                                                                               (3e9, 7, 0, 255), (2.0, 200, 30, 240))):
                t = ((q.int() - zx) @ w.int().t()).float() * sc + bias
                v = t * torch.tensor(inv, dtype=torch.float32)
                v = v.clamp(min=float(lo - z)) if lo > 0 else v
                v = v.clamp(max=float(hi - z)) if hi < 255 else v
                want = torch.round(v + float(z)).clamp(0, 255).to(torch.uint8)
                codes = native.linear_plan(w, "codes", sc, bias, grid=(inv, z, lo, hi))
                floats = native.linear_plan(w, "float", sc, bias)
                c, y = torch.zeros(m, n, dtype=torch.uint8), torch.full((m, n), float("nan"))
                with _body(body):
                    ok = codes is not None and codes.run(q, zx, c) and floats is not None and floats.run(q, zx, y)
                if not (ok and torch.equal(c, want) and torch.equal(y, t)):
                    wrong.append((m, k, n, zx, inv, z, lo, hi))
    assert not wrong, wrong[:5]


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_sign_codes_of_every_row_length_give_the_exact_sums(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 any-code many-row kernel (``blk_bcast_s``) on each shape of ``sign_codes``' rows: fewer than 32 codes
    as one array (``sign_flat``, dense) or row by row (strided), whole vectors only, tails of 8 / 16 / 24 codes by vector
    loads, other tails through the padded block; dense and strided rows; rows past one per-thread tile (session 27:
    each thread makes its tile's codes). Every row's exact sums, and the 128-crossing codes at both ends."""
    g = torch.Generator().manual_seed(27)
    with split_over(threads, monkeypatch):
        for k in (8, 16, 24, 32, 40, 56, 64, 100, 136, 144, 152, 301):
            m = 3300 if k == 40 else 70  # (k = 40: tiles of 3264 rows, so a second, part tile)
            for wide in (0, 8):
                q = torch.randint(0, 256, (m, k + wide), generator=g, dtype=torch.uint8)[:, :k]
                q[0], q[1] = 0, 255
                w = torch.randint(-128, 128, (24, k), generator=g, dtype=torch.int8)
                plan = native.linear_plan(w, "float", torch.ones(24), pairs=False)
                y = torch.full((m, 24), float("nan"))
                with _body("avx2"):
                    assert plan is not None and plan.run(q, 3, y)
                assert torch.equal(y, ((q.int() - 3) @ w.int().t()).float()), (k, wide)


@needs_native
@pytest.mark.parametrize("body", ["vnni", "avx2", "scalar"])
def test_rows_sub_mode_is_the_generic_per_token_epilogue(body: str) -> None:
    """"rows_sub" (the 8-bit dynamic Linear's one call without VNNI): ``fl(fl(fl(fl(Σ (q - zx) w) · sc) - fl(a · fw)) · s)
    + b`` with the torch ops' float32 roundings in their order, by every body, rows past the many-row kernel's blocks
    and a row chunk, any u8 codes against any int8 weights."""
    g = torch.Generator().manual_seed(5)
    for m, k, n in itertools.product((1, 2, 7, 70), (3, 64, 301), (5, 24)):
        q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sc, fw, bias = torch.rand(n, generator=g) * 1e-2, torch.randn(n, generator=g), torch.randn(n, generator=g)
        a, s = torch.randn(m, generator=g) * 50, torch.rand(m, generator=g) * 0.1
        for b in (None, bias):
            t = ((q.int() - 128) @ w.int().t()).float() * sc
            want = t.sub(a[:, None] * fw).mul(s[:, None])
            want = want if b is None else want + b
            plan = native.linear_plan(w, "rows_sub", sc, b, fw=fw)
            y = torch.empty(m, n)
            with _body(body):
                assert plan is not None and plan.run(q, 128, y, (a, s))
            assert torch.equal(y, want), (m, k, n, b is None)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_any_code_many_row_kernel_is_exact_at_the_ends_of_both_ranges(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 kernels for any u8 codes (``blk_bcast_s`` from 2 rows on packed weights, ``blk_sgn`` for one row on
    the plain ones: ``|q - 128|`` against ``w`` or ``~w``, where a ``vpmaddubsw`` pair reaches -32768 exactly) at the
    ends of both ranges: codes 0 / 127 / 128 / 255 against weights -128 / -127 / 127 / 0, mixed with random ones;
    every ``k`` tail past its groups of 4 and 32, rows past a row chunk, input zero points 0 / 128 / 255, a one-row
    view of a wider row. A plan packed under the best body (VNNI where the CPU has it) gives the same sums when the
    AVX2 body runs it."""
    g = torch.Generator().manual_seed(25)
    # (without VNNI the best body is the AVX2 body: run_plan reads the ISA only through use_avx2 / use_vnni, equal for
    # isa 1 and 2 there; so the pinned run repeats the same kernels and runs only where the two differ)
    bodies = ("best", "avx2") if native.vnni() else ("best",)
    with split_over(threads, monkeypatch):
        for m, k in itertools.product((1, 2, 5, 66), (1, 3, 4, 31, 33, 64, 385, 1000)):  # (66 × 1000: the threaded pass)
            for qv, wv in itertools.product((0, 127, 128, 255, None), (-128, -127, 127, 0, None)):
                q = (torch.randint(0, 256, (m, k + 7), generator=g, dtype=torch.uint8) if qv is None
                     else torch.full((m, k + 7), qv, dtype=torch.uint8))
                q = q[:, :k] if m == 1 else q[:, :k].contiguous()  # (one row: its codes in a wider row)
                w = (torch.randint(-128, 128, (19, k), generator=g, dtype=torch.int8) if wv is None
                     else torch.full((19, k), wv, dtype=torch.int8))
                w[::5, ::3] = -128  # (a random and a constant weight alike meet -128 columns)
                plan = native.linear_plan(w, "float", torch.ones(19), pairs=False)
                assert plan is not None
                for zx in (0, 128, 255):
                    want = ((q.int() - zx) @ w.int().t()).float()
                    for body in bodies:
                        y = torch.full((m, 19), float("nan"))
                        with _body(body) if body == "avx2" else contextlib.nullcontext():
                            assert plan.run(q, zx, y)
                        assert torch.equal(y, want), (m, k, qv, wv, zx, body)


@needs_native
@pytest.mark.parametrize("body", ["vnni", "avx2"])
@pytest.mark.parametrize("k", [1024, 4096, 3072])
def test_row_strides_that_alias_in_l1_give_the_same_sums(body: str, k: int) -> None:
    """Rows 1-4 KiB apart (the VNNI kernel copies such codes onto a padded stride first) and a strided view of them:
    the exact sums, by both SIMD bodies, at row counts around its 16- and 8-row blocks."""
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-128, 128, (20, k), generator=g, dtype=torch.int8)
    for m in (3, 4, 9, 16, 25):
        base = torch.randint(0, 256, (m, k + 4096), generator=g, dtype=torch.uint8)
        for q in (base[:, :k].contiguous(), base[:, :k]):
            plan = native.linear_plan(w, "float", torch.ones(20), wsum=w.sum(1, dtype=torch.int32), pairs=False)
            y = torch.empty(m, 20)
            with _body(body):
                assert plan is not None and plan.run(q, 7, y), (m, k)
            assert torch.equal(y, ((q.int() - 7) @ w.int().t()).float()), (m, k, q.stride())


@needs_native
def test_plans_decline_what_does_not_fit_and_name_wrong_values() -> None:
    w = torch.randint(-128, 128, (8, 16), dtype=torch.int8)
    one = torch.ones(8)
    for bad, match in ((lambda: native.linear_plan(w, "fast", one), "mode='fast'"),
                       (lambda: native.linear_plan(w, "codes", one), "needs grid"),
                       (lambda: native.linear_plan(w, "codes", one, grid=(float("inf"), 0, 0, 255)), "inv=inf"),
                       (lambda: native.linear_plan(w, "requant", one, codes=(300, 0, 255)), "zero_point=300"),
                       (lambda: native.linear_plan(w, "rows", one), "needs fw"),
                       (lambda: native.linear_plan(w, "rows_sub", one), "needs fw"),
                       (lambda: native.linear_plan(w, "split", one, fw=one), "mode='split'"),  # (gone, session 26)
                       (lambda: native.qlinear_requant(torch.zeros(1, 16, dtype=torch.uint8), 0, w, None, one, None, 0, 200,
                                                       100, True), "lo=200, hi=100"),
                       (lambda: native.qlinear_requant(torch.zeros(1, 16, dtype=torch.uint8), -1, w, None, one, None, 0, 0,
                                                       255, True), "zx=-1"),
                       (lambda: native.qlinear(torch.zeros(1, 16, dtype=torch.uint8), 256, w, one, None, None, False),
                        "zx=256")):
        with pytest.raises(ValueError, match=match):
            bad()
    assert native.linear_plan(w.t(), "float", one) is None  # not contiguous
    assert native.linear_plan(w, "float", torch.ones(7)) is None  # a vector of the wrong length
    assert native.linear_plan(w.float(), "float", one) is None
    plan = native.linear_plan(w, "float", one)
    assert plan is not None
    y = torch.empty(65, 8)
    q65 = torch.randint(0, 128, (65, 16), dtype=torch.uint8)
    assert plan.run(q65, 0, y) and torch.equal(y, (q65.int() @ w.int().t()).float())  # past one row chunk (MAX_ROWS)
    assert not plan.run(torch.zeros(2, 15, dtype=torch.uint8), 0, y[:2])  # another K
    assert not plan.run(torch.zeros(2, 16, dtype=torch.int8), 0, y[:2])
    assert not plan.run(torch.zeros(2, 16, dtype=torch.uint8), 0, torch.empty(2, 9))
    with native.disabled():
        assert not plan.run(torch.zeros(2, 16, dtype=torch.uint8), 0, y[:2])
    with pytest.raises(ValueError, match="zx=256"):
        plan.run(torch.zeros(2, 16, dtype=torch.uint8), 256, y[:2])
    for bad_w in (w.float(), w[0], 3):  # each packing names itself and what it got
        for pack in (pack_bcast, pack_vnni):
            with pytest.raises(ValueError, match=f"{pack.__name__}: w must be a 2-d int8 tensor .*got"):
                pack(bad_w)  # type: ignore[arg-type]
    rows = native.linear_plan(w, "rows", one, fw=one, pairs=True)  # (without pairs the plan makes Σ w: blk_sgn reads it)
    assert rows is not None
    with pytest.raises(ValueError, match="zx=3 .*'rows'"):  # per-token rows carry their zero points in (a, s)
        rows.run(torch.zeros(2, 16, dtype=torch.uint8), 3, y[:2], (torch.zeros(2), torch.ones(2)))
    rows_z = native.linear_plan(w, "rows", one, wsum=w.sum(1, dtype=torch.int32), fw=one)  # with Σ w: a zero point too
    q5 = torch.randint(0, 256, (5, 16), dtype=torch.uint8)
    y5 = torch.empty(5, 8)
    for body in ("vnni", "avx2", "scalar"):  # (the VNNI CPU's dynamic rows: zero point 128, a = 128 - z_x)
        if (body == "vnni" and not native.vnni()) or (body == "avx2" and "AVX2" not in native.reason()):
            continue  # (a body this CPU lacks; the others still run)
        with _body(body):
            assert rows_z is not None and rows_z.run(q5, 128, y5, (torch.full((5,), 2.0), torch.full((5,), 0.5)))
        want = (((q5.int() - 128) @ w.int().t()).float() + 2.0 * one) * 0.5
        assert torch.equal(y5, want), body


@needs_native
@needs_fbgemm
@pytest.mark.parametrize("relu", [False, True])
def test_static_linear_few_rows_is_one_native_call_with_fbgemm_codes(relu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A converted ``QuantStub → Linear → DeQuantStub`` on torch.ao's x86 recipe (7-bit activations and outputs), on a
    CPU without VNNI: at every row count the Linear is one native call, and the model's outputs equal the fbgemm
    route's (native off) for 1-d, 2-d and 3-d inputs."""
    force(monkeypatch, vnni=False, fbgemm=True)
    torch.manual_seed(3)
    body = nn.Sequential(nn.Linear(48, 40), nn.ReLU()) if relu else nn.Linear(48, 40)
    prep = Q.prepare(nn.Sequential(Q.QuantStub(), body, Q.DeQuantStub()).eval(), Q.get_default_qconfig("x86"))
    prep(torch.randn(64, 48) * 2)
    qm = Q.convert(Q.fuse_modules(prep, [["1.0", "1.1"]]) if relu else prep)
    for shape in ((48,), (1, 48), (5, 48), (16, 48), (2, 3, 48), (17, 48), (40, 48), (3, 50, 48)):
        x = torch.randn(*shape) * 2
        native.counts.clear()
        y = qm(x)
        took = native.counts["qlinear_requant"]
        with native.disabled():
            ref = qm(x)
        assert torch.equal(y, ref) and took == 1, (shape, took)


@needs_native
@needs_fbgemm
@pytest.mark.parametrize("recipe", ["default", "x86"])
def test_avx512_vnni_few_rows_give_the_codes_of_a_cpu_without_vnni(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``VNNI_M`` rows a CPU with AVX-512 VNNI takes the static Linear's routes without VNNI (pinned both ways
    here, on any CPU): the same outputs as a CPU without VNNI, with lowbit.native on or off, for lowbit's default recipe
    (8-bit codes against full int8 weights: the float route) and torch.ao's x86 recipe (fbgemm's requantization)."""
    from lowbit.kernels import onednn

    torch.manual_seed(4)
    body = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 24))
    qc = Q.get_default_qconfig("x86") if recipe == "x86" else Q.get_default_qconfig()
    prep = Q.prepare(nn.Sequential(Q.QuantStub(), body, Q.DeQuantStub()).eval(), qc)
    prep(torch.randn(64, 64) * 2)
    qm = Q.convert(prep)
    # a VNNI route with lowbit.native off runs fbgemm unsplit, exact only on a real VNNI CPU (it saturates elsewhere)
    combos = [(v, off) for v, off in itertools.product((False, True), (False, True)) if onednn.has_vnni() or not (v and off)]
    for m in (1, 2, 9, onednn.VNNI_M):
        x = torch.randn(m, 64) * 2
        outs = []
        for vnni, off in combos:
            force(monkeypatch, vnni=vnni, fbgemm=True)
            with native.disabled() if off else contextlib.nullcontext():
                outs.append(qm(x))
        assert all(torch.equal(outs[0], y) for y in outs[1:]), (recipe, m)


@needs_native
@needs_fbgemm
def test_per_token_7bit_few_rows_are_the_fbgemm_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 7-bit per-token dynamic Linear at every row count: the row codes and one "rows" call, the same floats as
    fbgemm's route, with and without bias, after the bias tensor is replaced, on both bodies."""
    force(monkeypatch, vnni=False, fbgemm=True)
    torch.manual_seed(4)
    lin = nn.Linear(80, 36)
    qm = Q.quantize_dynamic(nn.Sequential(lin), {nn.Linear: Q.get_dynamic_qconfig(reduce_range=True)})
    for body, m in itertools.product(("best", "scalar"), (1, 2, 7, 16, 17, 70)):
        x = torch.randn(m, 80) * torch.rand(m, 1) * 3 + torch.randn(m, 1)
        native.counts.clear()
        with _body(body):
            y = qm(x)
        took = native.counts["qlinear_rows"]
        with native.disabled():
            ref = qm(x)
        assert torch.equal(y, ref) and took == 1, (body, m)
    qm[0].bias = torch.randn(36)  # another bias tensor: the plan is made again
    x = torch.randn(3, 80)
    y = qm(x)
    with native.disabled():
        assert torch.equal(y, qm(x))


@needs_native
@pytest.mark.parametrize("qdtype,zp", [(Q.quint8, 131), (Q.quint8.with_range(0, 127), 60), (Q.qint8, -7)])
def test_quantize_stub_small_inputs_give_plain_codes_equal_to_the_torch_path(qdtype: Q.QDtype, zp: int) -> None:
    from lowbit.nn.quantized.stubs import Quantize

    stub = Quantize(0.05, zp, qdtype)
    x = torch.randn(7, 33) * 4
    x[0, :4] = torch.tensor([0.025, 0.075, -0.025, 1e9])  # ties, saturation
    native.counts.clear()
    qx = stub(x)
    assert native.counts["quantize"] == 1 and qx._c is not None and qx._tu is None
    with native.disabled():
        ref = stub(x)
    assert torch.equal(qx.int_repr(), ref.int_repr()) and qx.int_repr().dtype == ref.int_repr().dtype
    x[1, 1] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):  # (the native pass reports it; the stub's check names it)
        stub(x)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_dynamic_vnni_fused_call_is_the_two_call_path(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX-512 VNNI the per-token dynamic Linear of few rows runs as one native call (``native.dyn_linear``:
    the row grids and codes, then the one-row or the rows plan): the floats of the two-call path (``_grid_codes`` and
    ``_vnni_native``) bit for bit, for one row (K > 1 and K = 1), 2-32 rows, with and without bias, over row scales from
    1e-6 to 1e4, constant rows and zero rows; a non-finite row is declined (``None``) and the module gives the generic
    path's result. Skipped where the VNNI kernels cannot run."""
    from lowbit import kernels
    from lowbit.kernels import onednn
    from lowbit.nn.quantized.dynamic import Linear as DLinear
    from lowbit.nn.quantized.dynamic import per_token

    if not (native.vnni() and onednn.has_vnni()):
        pytest.skip("no AVX-512 VNNI here (or oneDNN capped below it, or lowbit.native's VNNI kernels off): "
                    "the dynamic Linear's VNNI route is not taken")
    real = native.dyn_linear
    took: list[bool] = []

    def spy(*a: Any) -> Any:
        y = real(*a)
        took.append(y is not None)
        return y
    g = torch.Generator().manual_seed(21)
    with split_over(threads, monkeypatch):
        for k, n, bias in ((48, 40, True), (1, 24, False), (96, 7, False), (768, 64, True)):
            torch.manual_seed(k + n)
            mod = DLinear.from_float(nn.Linear(k, n, bias=bias))
            for m in (1, 2, 5, 16, 32):
                x = torch.randn(m, k, generator=g) * 10.0 ** (torch.rand(m, 1, generator=g) * 10 - 6)
                x[0] = 0.0 if m > 1 else x[0]
                if m > 2:
                    x[1] = 2.5  # a constant row
                took.clear()
                monkeypatch.setattr(native, "dyn_linear", spy)
                y = mod(x)
                monkeypatch.setattr(native, "dyn_linear", lambda *a: None)
                want = mod(x)
                monkeypatch.setattr(native, "dyn_linear", real)
                assert took == [True] and torch.equal(y, want), (k, n, bias, m, took)
        mod = DLinear.from_float(nn.Linear(48, 8))
        x1 = torch.randn(1, 48, generator=g)
        want = mod(x1)
        real_plans = per_token._vnni_plans
        monkeypatch.setattr(per_token, "_vnni_plans", lambda p, b: (real_plans(p, b)[0], None, real_plans(p, b)[2]))
        kernels.counts.clear()
        assert torch.equal(mod(x1), want)  # no one-row plan: _int_mm's route (its floats), never the rows plan's
        assert dict(kernels.counts) == {("int_mm", "linear"): 1}
        monkeypatch.setattr(per_token, "_vnni_plans", real_plans)
        plan = per_token._plan(mod.weight_int8, mod.weight_scale, mod.weight_zero_point, mod.dtype, mod._cache)
        hit = per_token._vnni_plans(plan, mod.bias)
        x = torch.randn(3, 48, generator=g)
        for wrong in (x.double(), x[:, :40], x.t().contiguous().t(), x.reshape(1, 3, 48), x[:0]):  # dtype, K, layout, rank, empty
            assert native.dyn_linear(wrong, None, hit[2], plan.scale) is None
        assert native.dyn_linear(x[:1], hit[1], hit[2], plan.scale.double()) is None  # scales not float32
        assert native.dyn_linear(x, hit[1], hit[2], plan.scale) is None  # the one-row plan given 3 rows
        for bad in (float("inf"), float("nan")):
            x = torch.randn(3, 48, generator=g)
            x[1, 5] = bad
            assert native.dyn_linear(x, None, hit[2], plan.scale) is None  # a non-finite row: declined
            y = mod(x)
            monkeypatch.setattr(native, "dyn_linear", lambda *a: None)
            want = mod(x)
            monkeypatch.setattr(native, "dyn_linear", real)
            assert torch.allclose(y, want, rtol=0, atol=0, equal_nan=True)  # (the generic path's result)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_im2col_is_torchs_unfold_tap_by_tap(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``native.im2col``: row ``(n OH + i) OW + j`` holds output pixel ``(n, i, j)``'s window tap by tap (``(di KW + dj)
    C + c``), padding at the input zero point: ``F.unfold`` of ``q - z_x`` (which pads with 0), reordered, for
    kernels 1-5, strides, paddings and dilations, channels 1-17; an NCHW input or a bad geometry is refused."""
    g = torch.Generator().manual_seed(11)
    with split_over(threads, monkeypatch):
        for c, (kh, kw), s, p, d, zx in itertools.product((1, 3, 17), ((1, 1), (3, 3), (5, 2)), (1, 2), (0, 1, 2),
                                                         (1, 2), (0, 200)):
            q = torch.randint(0, 256, (2, c, 9, 8), generator=g, dtype=torch.uint8)
            ql = q.contiguous(memory_format=torch.channels_last)
            cols = native.im2col(ql, zx, (kh, kw), [s, s], [p, p], [d, d])
            if (9 + 2 * p - d * (kh - 1) - 1) < 0 or (8 + 2 * p - d * (kw - 1) - 1) < 0:
                assert cols is None
                continue
            u = torch.nn.functional.unfold(q.float() - zx, (kh, kw), dilation=d, padding=p, stride=s)  # (n, c kh kw, L)
            want = u.view(2, c, kh * kw, -1).permute(0, 3, 2, 1).reshape(-1, kh * kw * c)
            assert cols is not None and torch.equal(cols.float() - zx, want), (c, kh, kw, s, p, d, zx)
    assert native.im2col(torch.zeros(1, 2, 3, 3, dtype=torch.uint8), 0, (1, 1), [1, 1], [0, 0], [1, 1]) is None  # NCHW
    with pytest.raises(ValueError, match="stride"):
        native.im2col(torch.zeros(1, 2, 3, 3, dtype=torch.uint8), 0, (1, 1), [0, 1], [0, 0], [1, 1])
    for kernel in ((0, 3), (3,), (2.0, 2), (True, 1)):
        with pytest.raises(ValueError, match=r"kernel=.* must be two ints >= 1"):
            native.im2col(torch.zeros(1, 2, 3, 3, dtype=torch.uint8), 0, kernel, [1, 1], [0, 0], [1, 1])  # type: ignore[arg-type]


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("body", ["best", "avx2"])
def test_conv_patches_made_in_the_call_are_im2cols_rows(threads: int, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LinearPlan.run_conv`` (``linear.c`` ``lb_conv_gemm``: each thread makes its row tiles' patches where the kernels
    read them) gives ``run`` on ``native.im2col``'s rows, output for output: windows 1x1 to 5x5, strides, paddings,
    dilations, zero points 0 and 200, both plan kinds (7-bit codes with ``pairs``; any codes), "float" / "codes" /
    "requant", rows past one tile (the 3x3 of 40 channels at 2 x 30 x 29: 1740 rows of 360 codes, tiles of 192 rows for
    any codes, 704 for 7-bit ones)."""
    g = torch.Generator().manual_seed(271)
    # (the last: 27 codes a row, fewer than 32 and not a multiple of 4)
    cases = [(3, (1, 1), 2, 0, 1), (5, (3, 3), 1, 1, 1), (40, (3, 3), 1, 1, 1), (7, (5, 2), 2, 2, 1), (4, (3, 3), 1, 2, 2),
             (3, (3, 3), 1, 1, 1)]
    with split_over(threads, monkeypatch):
        for (c, (kh, kw), s, p, d), zx, pairs in itertools.product(cases, (0, 200), (False, True)):
            hw = 30 if c == 40 else 11
            q = torch.randint(0, 128 if pairs else 256, (2, c, hw, hw - 1), generator=g, dtype=torch.uint8)
            q = q.contiguous(memory_format=torch.channels_last)
            w = torch.randint(-128, 128, (19, kh * kw * c), generator=g, dtype=torch.int8)
            rows = native.im2col(q, zx, (kh, kw), [s, s], [p, p], [d, d])
            assert rows is not None
            plans = [native.linear_plan(w, "float", torch.rand(19, generator=g), torch.randn(19, generator=g), pairs=pairs),
                     native.linear_plan(w, "codes", torch.rand(19, generator=g) * 1e-3, None, pairs=pairs,
                                        grid=(0.5, 90, 0, 255)),
                     native.linear_plan(w, "requant", torch.rand(19, generator=g) * 1e-3, None, pairs=pairs,
                                        codes=(7, 0, 255))]
            for plan in plans:
                assert plan is not None
                dtype = torch.float32 if plan.mode == "float" else torch.uint8
                want, got = torch.empty(rows.shape[0], 19, dtype=dtype), torch.empty(rows.shape[0], 19, dtype=dtype)
                with _body(body) if body == "avx2" else contextlib.nullcontext():
                    assert plan.run(rows, zx, want)
                    assert plan.run_conv(q, zx, (kh, kw), [s, s], [p, p], [d, d], got)
                assert torch.equal(got, want), (c, kh, kw, s, p, d, zx, pairs, plan.mode)


@needs_native
def test_conv_patches_in_the_call_decline_what_does_not_fit_and_name_wrong_values() -> None:
    """``run_conv`` returns ``False`` (nothing written) for an NCHW input, a window whose taps are not the plan's K,
    one output row, a per-token rows plan, a window past the padded input; wrong values raise naming them."""
    w = torch.randint(-128, 128, (4, 18), dtype=torch.int8)
    plan = native.linear_plan(w, "float", torch.ones(4))
    q = torch.zeros(1, 2, 5, 5, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    out = torch.full((25, 4), 7.0)
    assert plan is not None and plan.run_conv(q, 0, (3, 3), [1, 1], [1, 1], [1, 1], out)
    assert not plan.run_conv(q.contiguous(), 0, (3, 3), [1, 1], [1, 1], [1, 1], out)  # NCHW
    assert not plan.run_conv(q, 0, (3, 2), [1, 1], [1, 1], [1, 1], out)  # 12 taps, not 18
    assert not plan.run_conv(q, 0, (3, 3), [5, 5], [0, 0], [1, 1], torch.empty(1, 4))  # one output pixel
    assert not plan.run_conv(q, 0, (3, 3), [1, 1], [0, 0], [3, 3], out)  # the dilated window past the input
    empty = torch.zeros(1, 2, 0, 3, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    assert not plan.run_conv(empty, 0, (3, 3), [1, 1], [2, 1], [1, 1], torch.empty(6, 4))  # no pixels (im2col declines)
    rows = native.linear_plan(w, "rows_sub", torch.ones(4), fw=torch.ones(4))
    assert rows is not None and not rows.run_conv(q, 0, (3, 3), [1, 1], [1, 1], [1, 1], out)
    with pytest.raises(ValueError, match="zx=300"):
        plan.run_conv(q, 300, (3, 3), [1, 1], [1, 1], [1, 1], out)
    with pytest.raises(ValueError, match="stride"):
        plan.run_conv(q, 0, (3, 3), [0, 1], [1, 1], [1, 1], out)
    for kernel in ((0, 3), (3,), (2.0, 2), (True, 1)):
        with pytest.raises(ValueError, match=r"kernel=.* must be two ints >= 1"):
            plan.run_conv(q, 0, kernel, [1, 1], [1, 1], [1, 1], out)  # type: ignore[arg-type]
