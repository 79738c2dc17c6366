"""Session 49 (#10, 2 threads): lowbit's native Linear (``linear.c`` ``run_plan``) splits a layer with fewer 64-column
blocks than threads (16-column without VNNI) over its rows, where it ran on one thread before (SmallCNN's fc1, 64 x
1568 -> 64: one block).

- ``LinearPlan.split`` says so: two threads by rows for such a layer on 2 threads, the column split elsewhere, one
  thread on 1 (the 1-thread path is the one before);
- the outputs are the same bit for bit at 1 and 2 threads and equal to the exact integer sums through each mode's
  epilogue ("float", "codes", "requant", "rows"), both VNNI and AVX2 bodies, rows 1 to 133 (past a 64-row chunk),
  columns 1 to 64 (odd counts), odd K, zero points 0 and 57; ``run_conv`` the same against ``run`` on ``im2col``'s
  rows; empty inputs declined at both counts; the converted SmallCNN's output the same at 1 and 2 threads.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import lowbit as Q
from lowbit import native
from lowbit.examples import SmallCNN

from helpers import num_threads, split_over

needs_native = pytest.mark.skipif(not native.available(), reason=f"lowbit.native not built: {native.reason()}")


def _body(name: str) -> contextlib.AbstractContextManager[None]:
    """"best" (VNNI where the CPU has it), "avx2" (the AVX2 many-row kernels even on a VNNI CPU)."""
    if name == "avx2" and "AVX2" not in native.reason():
        pytest.skip("this CPU has no AVX2 + FMA")
    return native.force_avx2() if name == "avx2" else contextlib.nullcontext()


def _packed(plan: native.LinearPlan, k: int, body: str) -> None:
    """A first call of 2 rows under ``body`` (packs the plan's many-row weights)."""
    with _body(body):
        assert plan.run(torch.zeros(2, k, dtype=torch.uint8), 0, torch.empty(2, plan.n) if plan.mode in ("float", "rows")
                        else torch.empty(2, plan.n, dtype=torch.uint8),
                        (torch.zeros(2), torch.ones(2)) if plan.mode == "rows" else None)


@needs_native
@pytest.mark.parametrize("body", ["best", "avx2"])
def test_few_column_blocks_split_over_rows_on_two_threads(body: str) -> None:
    """Fewer column blocks than threads: 2 threads by rows (before: 1 thread, the one block); enough blocks: the
    column split as before; 1 thread: 1 thread."""
    unit = 64 if body == "best" and native.vnni() else 16
    for n, m, threads, want in ((unit, 64, 2, (2, True)), (1, 64, 2, (2, True)), (10, 2, 2, (2, True)),
                                (2 * unit, 64, 2, (2, False)), (unit, 64, 1, (1, False))):
        w = torch.randint(-128, 128, (n, 4100), dtype=torch.int8)  # (n k past 64 KiB: no row split for blk_bcast_s)
        plan = native.linear_plan(w, "float", torch.ones(n))
        assert plan is not None
        _packed(plan, 4100, body)
        with _body(body):
            assert plan.split(m, threads) == want, (n, m, threads, plan.split(m, threads))


@needs_native
def test_split_names_wrong_values() -> None:
    plan = native.linear_plan(torch.ones(4, 8, dtype=torch.int8), "float", torch.ones(4))
    assert plan is not None
    with pytest.raises(ValueError, match="m=-1"):
        plan.split(-1, 2)
    with pytest.raises(ValueError, match="threads=0"):
        plan.split(4, 0)


def _want(mode: str, acc: torch.Tensor, sc: torch.Tensor, bias: torch.Tensor, a: torch.Tensor,
          s: torch.Tensor, fw: torch.Tensor) -> torch.Tensor:
    """Each mode's epilogue on the exact sums ``acc`` (``linear.c``'s float32 steps, in its order)."""
    f = acc.float()
    if mode == "float":
        return f * sc + bias
    if mode == "codes":  # grid (inv 0.25, z 100, 0, 255)
        return torch.round((f * sc + bias) * 0.25 + 100.0).clamp(0, 255).to(torch.uint8)
    return torch.addcmul(f * sc, a[:, None], fw[None, :]) * s[:, None] + bias  # rows: fl(fl(t + a fw) s) + bias


@needs_native
@pytest.mark.parametrize("body", ["best", "avx2"])
@pytest.mark.parametrize("mode", ["float", "codes", "rows"])
def test_row_split_outputs_are_the_one_thread_outputs(body: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """1 and 2 threads (every pass split at 2) give the same outputs bit for bit, equal to the exact sums through the
    mode's epilogue: N 1-64 (under one VNNI block, one AVX2 block and past it), M 1-133, odd K, zero points 0 / 57."""
    g = torch.Generator().manual_seed(49)
    wrong = []
    for n, m, k in itertools.product((1, 10, 17, 64), (1, 2, 7, 64, 133), (1, 33, 1568)):
        zx = 0 if mode == "rows" else 57 * (k % 2)
        q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sc, bias = torch.rand(n, generator=g) * 1e-2 + 1e-4, torch.randn(n, generator=g)
        a, s, fw = torch.randn(m, generator=g) * 50, torch.rand(m, generator=g) + 0.01, torch.randn(n, generator=g)
        acc = (q.long() - zx) @ w.long().t()
        want = _want(mode, acc, sc, bias, a, s, fw)
        extra = {"grid": (0.25, 100, 0, 255)} if mode == "codes" else {"fw": fw} if mode == "rows" else {}
        outs = []
        for threads in (1, 2):
            plan = native.linear_plan(w, mode, sc, bias, **extra)
            assert plan is not None
            y = torch.empty(m, n, dtype=want.dtype)
            with split_over(threads, monkeypatch), _body(body):
                assert plan.run(q, zx, y, (a, s) if mode == "rows" else None)
            outs.append(y)
        if not (torch.equal(outs[0], outs[1]) and torch.equal(outs[1], want)):
            wrong.append((n, m, k, zx))
    assert not wrong, wrong[:5]


@needs_native
@pytest.mark.parametrize("body", ["best", "avx2"])
def test_requant_and_conv_row_split_are_the_one_thread_outputs(body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """"requant" mode at 1 and 2 threads (one column block, rows split), and ``run_conv`` (patches made by each
    thread) with 10 outputs (one block) and 3x3 x 1024 channels (n k past the 64 KiB the conv's row split needed
    before) against ``run`` on ``im2col``'s rows at 1 thread."""
    g = torch.Generator().manual_seed(149)
    for m, k, n in ((64, 1568, 64), (133, 301, 9)):
        q = torch.randint(0, 128, (m, k), generator=g, dtype=torch.uint8)
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        mult = torch.rand(n, generator=g) * 1e-3
        outs = []
        for threads in (1, 2):
            plan = native.linear_plan(w, "requant", mult, None, pairs=True, codes=(7, 0, 255))
            assert plan is not None
            y = torch.empty(m, n, dtype=torch.uint8)
            with split_over(threads, monkeypatch), _body(body):
                assert plan.run(q, 3, y)
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), (m, k, n)
    x = torch.randint(0, 256, (2, 1024, 5, 4), generator=g, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    w = torch.randint(-128, 128, (10, 9 * 1024), generator=g, dtype=torch.int8)
    plan = native.linear_plan(w, "float", torch.rand(10, generator=g), torch.randn(10, generator=g))
    assert plan is not None
    rows = native.im2col(x, 5, (3, 3), [1, 1], [1, 1], [1, 1])
    assert rows is not None
    want, got = torch.empty(rows.shape[0], 10), torch.empty(rows.shape[0], 10)
    with _body(body):
        with num_threads(1):
            assert plan.run(rows, 5, want)
        with split_over(2, monkeypatch):
            assert plan.split(rows.shape[0], 2, conv=True) == (2, True)
            assert plan.run_conv(x, 5, (3, 3), [1, 1], [1, 1], [1, 1], got)
    assert torch.equal(got, want)


@needs_native
def test_empty_inputs_are_declined_at_both_thread_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A pin: 0 rows were declined before too.)"""
    plan = native.linear_plan(torch.ones(10, 33, dtype=torch.int8), "float", torch.ones(10))
    assert plan is not None
    for threads in (1, 2):
        with split_over(threads, monkeypatch):
            assert not plan.run(torch.empty(0, 33, dtype=torch.uint8), 0, torch.empty(0, 10))


@needs_native
def test_smallcnn_converted_is_the_same_at_one_and_two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A pin at the model: fc1 is the layer that now splits; its codes and everything after are unchanged.)"""
    torch.manual_seed(0)
    m = Q.prepare(Q.fuse_modules(SmallCNN().eval(), SmallCNN.fusion_groups()), Q.get_default_qconfig())
    with torch.inference_mode():
        m(torch.randn(64, 1, 28, 28))
        qm = Q.convert(m)
        x = torch.randn(64, 1, 28, 28)
        outs = []
        for threads in (1, 2):
            with split_over(threads, monkeypatch):
                outs.append(qm(x))
    assert torch.equal(outs[0], outs[1])
