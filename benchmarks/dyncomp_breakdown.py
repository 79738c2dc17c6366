"""One compiled MiniLM b32 dynamic call, part by part, lowbit against float32 (issue #10: compiled lowbit below its
int8 Amdahl bound).

Run: ``python benchmarks/dyncomp_breakdown.py [--rounds 9] [--calls 3] [--entry-ab]`` (prints the ISA; run it at 1
thread: ``OMP_NUM_THREADS=1``). ``--entry-ab``: the compiled call with and without ``dynamic_linear``'s fast entry
(dyncomp50), alternating in one process.

Both models are compiled as ``int8_advantage.py`` compiles them (float32 ``torch.compile``; lowbit's
``quantize_dynamic`` model with ``fullgraph=True``). Every call the generated programs make is wrapped so that it adds
the calling thread's CPU time (``time.thread_time_ns``) to its label, its own time only (a labelled call inside another
is taken out of the outer one):

- ``gemm``: ``extern_kernels.addmm`` (float32: MKL, the bias copied into the output first) /
  ``onednn.qlinear_pointwise`` (lowbit: AMX int8, float32 out) and lowbit.native's ``dyn_linear`` (few rows);
- lowbit's per-token passes: ``native.row_grid`` (row grids + u8 codes), ``native.row_epilogue`` (per-row grid,
  ``Σŵ`` correction and bias, in place);
- ``op body``: the rest of ``lowbit::dynamic_linear``'s call (the dispatcher round trip, checks, plan lookups,
  allocations, Python);
- inductor's C++ kernels by kind (``layer_norm``: residual add + LayerNorm, ``gelu``, ``embed``, ``mask``, ``tanh``)
  and ``sdpa`` (``aten._scaled_dot_product_flash_attention_for_cpu``);
- ``frame``: the call less all of the above: dynamo's guards and frame, the wrapper's Python (``assert_size_stride``,
  buffer bookkeeping, ``empty_strided``).

Medians over rounds of the per-call sums (µs), the two models interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._inductor.codecache import PyCodeCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import int8_advantage as IA

from lowbit import native

KINDS = (("layer_norm", "layer_norm"), ("gelu", "gelu"), ("embed", "embedding"), ("mask", "where"), ("tanh", "tanh"))


class Probe:
    """Per label: calling-thread CPU ns of its own (children taken out) and call counts."""

    def __init__(self) -> None:
        self.cpu: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[int] = []  # children's ns of each open call

    def reset(self) -> None:
        self.cpu.clear(), self.calls.clear()

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(0)
            c0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.thread_time_ns() - c0
                inner = self.stack.pop()
                self.cpu[label] += dt - inner
                self.calls[label] += 1
                if self.stack:
                    self.stack[-1] += dt
        return call


class _Extern:
    """``extern_kernels`` with every attribute wrapped under one label."""

    def __init__(self, inner: Any, probe: Probe, label: str) -> None:
        self._inner, self._probe, self._label = inner, probe, label

    def __getattr__(self, name: str) -> Any:
        return self._probe.wrap(self._label, getattr(self._inner, name))


def _kind(name: str) -> str:
    for label, key in KINDS:
        if key in name:
            return f"inductor.{label}"
    return "inductor.other"


@contextlib.contextmanager
def labelled(probe: Probe, modules: list[Any]) -> Iterator[None]:
    """Wrap the generated programs' kernels, SDPA, the lowbit op and its native / oneDNN steps (restored on exit)."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is not None:
            saved.append((owner, name, fn))
            setattr(owner, name, probe.wrap(label, fn) if not isinstance(label, _Extern) else label)
    for mod in modules:
        for name in list(vars(mod)):
            if re.match(r"cpp_fused_", name):
                patch(mod, name, _kind(name))
        if hasattr(mod, "extern_kernels"):
            saved.append((mod, "extern_kernels", mod.extern_kernels))
            mod.extern_kernels = _Extern(mod.extern_kernels, probe, "gemm.fp32_addmm")
    patch(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, "default", "sdpa")
    patch(torch.ops.lowbit.dynamic_linear, "default", "lowbit.op_body")
    for name in ("row_grid", "row_epilogue"):
        patch(native, name, f"lowbit.{name}")
    patch(native, "dyn_linear", "gemm.native_dyn_linear")
    patch(torch.ops.onednn, "qlinear_pointwise", "gemm.onednn_int8")
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def measure(calls: dict[str, Callable[[], Any]], modules: list[Any], rounds: int, reps: int) -> dict[str, Any]:
    probe = Probe()
    per: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in calls}
    with torch.inference_mode(), labelled(probe, modules):
        for f in calls.values():
            f(), f()
        for r in common.round_bar(rounds, "dyncomp rounds"):
            for name, f in (list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]):
                f()
                probe.reset()
                c0 = time.thread_time_ns()
                for _ in range(reps):
                    f()
                whole = time.thread_time_ns() - c0
                for k, v in probe.cpu.items():
                    per[name][k].append(v / reps / 1e3)
                    per[name][k + "#calls"].append(probe.calls[k] / reps)
                per[name]["frame"].append((whole - sum(probe.cpu.values())) / reps / 1e3)
                per[name]["whole"].append(whole / reps / 1e3)
    return {name: {k: statistics.median(v) for k, v in d.items()} for name, d in per.items()}


def show(res: dict[str, Any]) -> None:
    labels = sorted({k for d in res.values() for k in d if not k.endswith("#calls") and k not in ("whole", "frame")})
    names = list(res)
    print(f"    {'part':28s} " + " ".join(f"{n:>22s}" for n in names))
    for k in labels + ["frame", "whole"]:
        cells = []
        for n in names:
            v, c = res[n].get(k), res[n].get(k + "#calls")
            cells.append(f"{'':>22s}" if v is None else f"{v:12.0f} ({c or 1:3.0f} calls)" if c else f"{v:22.0f}")
        print(f"    {k:28s} " + " ".join(cells))
    for n in names:
        d = res[n]
        gemm = sum(v for k, v in d.items() if k.startswith("gemm.") and not k.endswith("#calls"))
        print(f"    {n}: GEMM {gemm / 1e3:.2f} ms, the rest {(d['whole'] - gemm) / 1e3:.2f} ms, whole {d['whole'] / 1e3:.2f} ms")


def entry_ab(calls: dict[str, Callable[[], Any]], rounds: int, reps: int) -> None:
    """The compiled lowbit call with ``dynamic_linear``'s fast entry (dyncomp50) and without it (the full op body on
    every call), alternating in one process (the machine's load moves both alike), fp32 compiled in the same rounds:
    medians of the thread CPU time and of the paired per-round saving."""
    from lowbit.pt2 import module_ops as MO
    fast, t = MO._dyn_fast, defaultdict(list)
    arms = {"entry": fast, "no entry": lambda *a: None}
    with torch.inference_mode():
        for r in common.round_bar(rounds, "dyncomp rounds"):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in order + ["fp32"]:
                if name in arms:
                    MO._dyn_fast = arms[name]
                f = calls["fp32 compiled" if name == "fp32" else "lowbit compiled"]
                f()
                c0 = time.thread_time_ns()
                for _ in range(reps):
                    f()
                t[name].append((time.thread_time_ns() - c0) / reps / 1e3)
    MO._dyn_fast = fast
    med = statistics.median
    save = med([a - b for a, b in zip(t["no entry"], t["entry"], strict=True)])
    print(f"fast entry A/B ({rounds} rounds of {reps} calls, µs): with {med(t['entry']):.0f}, without "
          f"{med(t['no entry']):.0f}, paired saving {save:.0f}; fp32 compiled {med(t['fp32']):.0f} -> compiled / fp32 "
          f"compiled {med([f / e for f, e in zip(t['fp32'], t['entry'], strict=True)]):.2f}x with, "
          f"{med([f / e for f, e in zip(t['fp32'], t['no entry'], strict=True)]):.2f}x without")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=common.positive_int, default=9)
    p.add_argument("--calls", type=common.positive_int, default=3, help="model calls per sample")
    p.add_argument("--entry-ab", action="store_true", help="also time the compiled call with and without "
                   "dynamic_linear's fast entry, alternating")
    a = p.parse_args()
    print(common.isa_line(), f"| threads {torch.get_num_threads()} | load average {os.getloadavg()[0]:.2f}", flush=True)
    models = IA.models(["minilm"])
    if not models:
        raise SystemExit("MiniLM is not available here (lowbit.data.minilm_available())")
    (_, _, _, fp32_build, build), = models.values()
    n0 = len(PyCodeCache.modules)
    calls = {"fp32 compiled": fp32_build(), "lowbit compiled": build()}
    res = measure(calls, list(PyCodeCache.modules[n0:]), a.rounds, a.calls)
    print(f"MiniLM b32 dynamic, one call, calling thread's CPU µs (medians of {a.rounds} rounds of {a.calls} calls):")
    show(res)
    if a.entry_ab:
        entry_ab(calls, 2 * a.rounds + 1, a.calls)


if __name__ == "__main__":
    main()
