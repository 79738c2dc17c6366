"""Session 51 (#10, 2 threads): the per-token dynamic Linear's many-row route on a CPU with AMX int8 is one
``lowbit.native`` call (``per_token._amx_rows``: AMX tile sums in ``linear.c``'s ``sums_amx`` and the row epilogue
fused) in place of oneDNN's ``qlinear_pointwise`` and a separate epilogue pass (the oneDNN call's per-call set-up,
~40 µs, ran on the calling thread only).

- the native plans' AMX sums equal the VNNI kernels' (``native.force_vnni``) and the exact sums through each mode's
  epilogue, 1 and 2 threads, odd rows and columns, K a multiple of 64 (the AMX condition) and not;
- ``dynamic_linear`` on the AMX route gives the oneDNN route's floats bit for bit (``per_token.AMX_ROWS`` off), fused
  and unfused epilogues (outputs under and past ``_BLOCK``), bias or not, 1 and 2 threads; M = 1, few rows and K not a
  multiple of 64 keep their routes; the module on a 3-d input, eager and compiled (fullgraph) alike;
- an AVX2-only oneDNN (``ONEDNN_MAX_CPU_ISA=AVX2``, a subprocess) and the ``force_avx2`` pin run without AMX.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import native
from lowbit.kernels import onednn
from lowbit.nn.quantized.dynamic import per_token as PT
from lowbit.qscheme import qint8

from helpers import split_over

needs_native = pytest.mark.skipif(not native.available(), reason=f"lowbit.native not built: {native.reason()}")
AMX = native.available() and native.amx()
ROUTE = AMX and onednn.has_vnni()  # (oneDNN held to AVX2: the no-VNNI routes, never onednn_rows)


def _weights(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g) * 0.05
    ws = (w.abs().amax(1) / 127).clamp(min=1e-8)
    return torch.round(w / ws[:, None]).clamp(-128, 127).to(torch.int8), ws, torch.zeros(n, dtype=torch.int64)


@needs_native
@pytest.mark.parametrize("mode", ["float", "rows", "rows_sub"])
def test_amx_sums_equal_vnni_sums_and_exact(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's outputs with AMX (where the CPU has it) equal the VNNI kernels' and the exact sums' epilogue: rows 2 to
    133 (odd, past a 64-row chunk and a 16-row tile), columns 1 to 130 (partial 16-column blocks and 64-column chunks),
    K 64 / 128 / 384 (AMX) and 200 (VNNI only), 1 and 2 threads. Before: no ``native.force_vnni``."""
    g = torch.Generator().manual_seed(51)
    wrong = []
    for n, m, k in itertools.product((1, 17, 64, 130), (2, 16, 33, 133), (64, 128, 200, 384)):
        q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sc, bias = torch.rand(n, generator=g) * 1e-2 + 1e-4, torch.randn(n, generator=g)
        a, s, fw = torch.randn(m, generator=g) * 50, torch.rand(m, generator=g) + 0.01, torch.randn(n, generator=g)
        t = ((q.long() - 128) @ w.long().t()).float() * sc
        want = {"float": t + bias,
                "rows": torch.addcmul(t, a[:, None], fw[None, :]) * s[:, None] + bias,
                "rows_sub": (t - a[:, None] * fw[None, :]) * s[:, None] + bias}[mode]
        extra = {"fw": fw} if mode != "float" else {}
        outs = []
        for threads, pin in itertools.product((1, 2), (None, "vnni")):
            plan = native.linear_plan(w, mode, sc, bias, **extra)
            assert plan is not None
            y = torch.empty(m, n)
            with split_over(threads, monkeypatch), (native.force_vnni() if pin else _null()):
                assert plan.run(q, 128, y, (a, s) if mode != "float" else None)
            outs.append(y)
        if not all(torch.equal(o, want) for o in outs):
            wrong.append((n, m, k))
    assert not wrong, wrong[:5]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_force_vnni_pins_amx_off() -> None:
    """``native.amx()`` is off inside ``force_vnni`` and ``force_avx2`` (this thread), whatever the CPU."""
    with native.force_vnni():
        assert not native.amx()
    with native.force_avx2():
        assert not native.amx()
    assert native.amx() == AMX


class _Taken:
    """Counts the ``_amx_rows`` calls that gave the output (patched in for the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n, real = 0, PT._amx_rows

        def call(*args: object) -> torch.Tensor | None:
            y = real(*args)  # type: ignore[arg-type]
            self.n += y is not None
            return y
        monkeypatch.setattr(PT, "_amx_rows", call)


def _route(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, wz: torch.Tensor, bias: torch.Tensor | None,
           amx: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, int]:
    monkeypatch.setattr(PT, "AMX_ROWS", amx)
    taken = _Taken(monkeypatch)
    y = PT.dynamic_linear(x, wq, ws, wz, qint8, bias, {})
    return y, taken.n


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_route_floats_are_the_onednn_route_floats(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dynamic_linear``'s AMX route gives the oneDNN route's floats bit for bit: M 129 / 512 (odd, past
    ``small_m.VNNI_M``), K 64 / 384 / 1536, N 1 / 17 / 384 / 1536 (1536 x 512 past ``_BLOCK``: the unfused epilogue),
    bias or not, wide and narrow rows. On an AMX CPU the native call runs (before: oneDNN, no native Linear)."""
    g = torch.Generator().manual_seed(151)
    wrong, taken = [], 0
    for (m, k, n), with_bias in itertools.product(((129, 64, 17), (512, 384, 384), (129, 384, 1), (512, 384, 1536),
                                                   (200, 1536, 384), (300, 128, 1000)), (True, False)):
        wq, ws, wz = _weights(n, k, g)
        bias = torch.randn(n, generator=g) if with_bias else None
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4 + torch.randn(m, 1, generator=g)
        with split_over(threads, monkeypatch):
            ref, n_ref = _route(x, wq, ws, wz, bias, False, monkeypatch)
            y, n_amx = _route(x, wq, ws, wz, bias, True, monkeypatch)
        assert n_ref == 0
        taken += n_amx
        if not torch.equal(ref, y):
            wrong.append((m, k, n, with_bias, (ref - y).abs().max().item()))
    assert not wrong, wrong
    assert taken == (12 if ROUTE else 0)


def test_other_routes_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """M = 1 (``dyn_linear`` / ``_int_mm``), few rows (the native VNNI call) and K not a multiple of 64 (oneDNN) keep
    their routes and floats on both settings. Pin."""
    g = torch.Generator().manual_seed(251)
    for m, k, n in ((1, 384, 384), (7, 384, 100), (129, 200, 65), (300, 100, 33)):
        wq, ws, wz = _weights(n, k, g)
        x = torch.randn(m, k, generator=g)
        ref, _ = _route(x, wq, ws, wz, None, False, monkeypatch)
        y, n_amx = _route(x, wq, ws, wz, None, True, monkeypatch)
        assert torch.equal(ref, y), (m, k, n)
        if m > 128:
            assert n_amx == 0, (m, k, n)


@pytest.mark.parametrize("threads", [1, 2])
def test_module_3d_eager_and_compiled_equal_onednn_route(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantize_dynamic model (Linear 128 -> 192 with bias, Linear 192 -> 70 without) on a 3-d input of 3 x 70 rows:
    eager and compiled (fullgraph, the fast entry serving later calls) on the AMX route equal eager on the oneDNN
    route, bit for bit."""
    torch.manual_seed(3)
    x = torch.randn(3, 70, 128)
    qm = Q.quantize_dynamic(nn.Sequential(nn.Linear(128, 192), nn.Linear(192, 70, bias=False)).eval())
    with torch.no_grad():
        qm[0].weight_int8.add_(0), qm[1].weight_int8.add_(0)
    taken = _Taken(monkeypatch)
    with split_over(threads, monkeypatch), torch.inference_mode():
        monkeypatch.setattr(PT, "AMX_ROWS", False)
        want = qm(x)
        assert taken.n == 0
        monkeypatch.setattr(PT, "AMX_ROWS", True)
        assert torch.equal(qm(x), want)
        c = torch.compile(qm, fullgraph=True, dynamic=False)
        for _ in range(3):
            assert torch.equal(c(x), want)
        assert taken.n == (2 * 4 if ROUTE else 0)


_AVX2_SCRIPT = """
import torch, lowbit as Q
from torch import nn
from lowbit import native
from lowbit.kernels import onednn
from lowbit.nn.quantized.dynamic import per_token as PT
taken = []
amx_rows = PT._amx_rows
PT._amx_rows = lambda *a: taken.append(1) or amx_rows(*a)
torch.manual_seed(0)
qm = Q.quantize_dynamic(nn.Sequential(nn.Linear(128, 64)).eval())
x = torch.randn(300, 128)
with torch.inference_mode():
    y = qm(x)
    ref = torch.nn.functional.linear(x, qm[0].weight_int8.float() * qm[0].weight_scale[:, None], qm[0].bias)
print("VNNI", onednn.has_vnni(), "ERR", float((y - ref).abs().max()), "AMX", len(taken))
"""


def test_avx2_onednn_subprocess_runs() -> None:
    """With oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, a subprocess) the dynamic Linear takes the no-VNNI routes,
    never ``_amx_rows``, and stays close to the float Linear. Pin."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    assert words[words.index("VNNI") + 1] == "False", out.stdout
    assert float(words[words.index("ERR") + 1]) < 0.05, out.stdout
    assert words[words.index("AMX") + 1] == "0", out.stdout
