"""Where a compiled int8 model's call goes at 1 and at 2 threads, step by step, and which steps run on one thread
(issue #10: ``lowbit compiled / fp32 compiled`` falls from ~3x at 1 thread to ~2x at 2).

Run: ``python benchmarks/thread_breakdown.py [--models smallcnn minilm] [--rounds 9] [--calls 3]`` (prints the ISA).

The compiled model (``compiled.py``'s SmallCNN b64 static / MiniLM b32 dynamic, ``torch.compile(fullgraph=True)``)
runs with every step lowbit's ops take labelled: each ``lowbit.native`` pass (row grids, epilogues, quantize,
small conv, pooling, the VNNI GEMMs: ``LinearPlan.run`` / ``run_conv``) and each oneDNN int8 call
(``torch.ops.onednn.qlinear_pointwise`` / ``qconv_pointwise``) is wrapped so that it adds its wall time and *the
calling thread's* CPU time (``time.thread_time_ns``) to its label. Rounds alternate 1 and 2 threads
(``torch.set_num_threads``); per label the median over rounds of the per-call sums. What is not labelled
(``rest``) is the compiled graph's own work: inductor's float kernels (SDPA, LayerNorm, GELU, the final
dequantize), the lowbit ops' Python and dynamo's frame.

Reading it: the caller's CPU time of a step split over 2 threads falls to about half (plus the barrier wait);
a step that runs on one thread keeps its 1-thread time (``t2/t1`` ≈ 1). Wall times at 2 threads carry the other
processes' load on a shared machine (printed); the caller's CPU time does not, so ``t2/t1`` of the CPU column is
the figure to read there. ``--fp32`` also profiles the float32 model compiled (``torch.profiler``, per-op wall on the
calling thread) at both counts: the same split for the float side. ``--ops``: each lowbit op's total (its Python,
dispatch and the steps inside) and the frame (the whole call less the ops: dynamo's wrapper and guards).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import int8_advantage as IA

from lowbit import native
from lowbit.kernels import conv_plan
from lowbit.native import gemm, rows

NATIVE = ("row_grid", "row_epilogue", "conv_epilogue", "qadd", "quantize_into", "dequantize", "dwconv", "smallconv",
          "maxpool_codes", "to_channels_last", "to_contiguous", "im2col", "qlinear", "qlinear_requant", "qlinear_rows",
          "dyn_linear")
ONEDNN = ("qlinear_pointwise", "qconv_pointwise")


class Probe:
    """Per label: wall ns and calling-thread CPU ns summed over the calls since ``reset()``, and the call count."""

    def __init__(self) -> None:
        self.wall: dict[str, int] = defaultdict(int)
        self.cpu: dict[str, int] = defaultdict(int)
        self.proc: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth = 0

    def reset(self) -> None:
        self.wall.clear(), self.cpu.clear(), self.proc.clear(), self.calls.clear()

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # (a labelled step inside another: counted in the outer one only)
                return fn(*args, **kwargs)
            self.depth += 1
            p0, c0, w0 = time.process_time_ns(), time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                w1, c1, p1 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
                self.depth -= 1
                self.wall[label] += w1 - w0
                self.cpu[label] += c1 - c0
                self.proc[label] += p1 - p0
                self.calls[label] += 1
        return call


@contextlib.contextmanager
def labelled(probe: Probe) -> Iterator[None]:
    """Wrap lowbit's native passes, the VNNI plan runs and oneDNN's int8 calls (restored on exit)."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        saved.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else fn))
        setattr(owner, name, probe.wrap(label, fn))
    for name in NATIVE:
        patch(native, name, f"native.{name}")
    lib = native._lib()  # (the small first conv's lane calls the C entry itself: native.smallconv_prepared)
    if lib is not None:
        patch(lib, "lb_smallconv", "native.smallconv")
    patch(gemm.LinearPlan, "run", "native.LinearPlan.run")
    patch(gemm.LinearPlan, "run_conv", "native.LinearPlan.run_conv")
    patch(gemm.LinearPlan, "run_checked", "native.LinearPlan.run")  # (the lane's entry: kernels/lane.py)
    for name in ("_quantize", "_dequantize"):  # (rows' own calls, by global name: the stubs' passes)
        patch(rows, name, f"native.{name[1:]}")
    for name in ONEDNN:
        patch(torch.ops.onednn, name, f"onednn.{name}")
    if getattr(conv_plan, "_qconv_op", None) is not None:  # (the conv plan's own entry: OpOverload._op, bypassing the
        patch(conv_plan, "_qconv_op", "onednn.qconv_pointwise")  # packet patched above)
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def breakdown(call: IA.PerCount, rounds: int, calls: int, threads: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Per thread count: ``{label: (caller cpu µs, all threads' cpu µs, wall µs, calls)}`` per model call (medians
    over rounds), ``whole`` the model call and ``rest`` whole - Σ labels, and the other processes' load. ``call``:
    one, or one per count."""
    call = IA._at_count(call)
    probe = Probe()
    per: dict[int, dict[str, list[tuple[float, ...]]]] = {n: defaultdict(list) for n in threads}
    loads: dict[int, list[float]] = {n: [] for n in threads}
    meter = common.LoadMeter()
    with torch.inference_mode(), labelled(probe):
        for n in threads:
            torch.set_num_threads(n)
            call(), call()
        for r in common.round_bar(rounds, "thread breakdown rounds"):
            for n in threads if r % 2 == 0 else threads[::-1]:
                torch.set_num_threads(n)
                call()
                probe.reset()
                meter.start()
                p0, c0, w0 = time.process_time_ns(), time.thread_time_ns(), time.perf_counter_ns()
                for _ in range(calls):
                    call()
                w1, c1, p1 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
                loads[n].append(meter.stop())
                sc = sp = sw = 0
                for k in probe.wall:
                    per[n][k].append((probe.cpu[k] / calls / 1e3, probe.proc[k] / calls / 1e3,
                                      probe.wall[k] / calls / 1e3, probe.calls[k] / calls))
                    sc, sp, sw = sc + probe.cpu[k], sp + probe.proc[k], sw + probe.wall[k]
                per[n]["whole"].append(((c1 - c0) / calls / 1e3, (p1 - p0) / calls / 1e3, (w1 - w0) / calls / 1e3, 1))
                per[n]["rest"].append(((c1 - c0 - sc) / calls / 1e3, (p1 - p0 - sp) / calls / 1e3,
                                       (w1 - w0 - sw) / calls / 1e3, 1))
    torch.set_num_threads(threads[0])
    med = statistics.median
    return {n: {"steps": {k: tuple(med(v[i] for v in vals) for i in range(4)) for k, vals in per[n].items()},
                "other_load": med(loads[n])} for n in threads}


def show(label: str, res: dict[int, dict[str, Any]], threads: tuple[int, ...]) -> None:
    a, b = threads[0], threads[-1]
    print(f"{label}: per call, µs (cpu: the calling thread's CPU time; all: every thread's; wall); other load "
          + ", ".join(f"t{n} {res[n]['other_load']:.2f}" for n in threads) + " CPUs")
    steps = res[a]["steps"]
    order = sorted((k for k in steps if k not in ("whole", "rest")), key=lambda k: -steps[k][0]) + ["rest", "whole"]
    print(f"    {'step':30s} {'calls':>5s} " + " ".join(f"{'cpu t%d' % n:>8s} {'all t%d' % n:>8s} {'wall t%d' % n:>8s}"
                                                     for n in threads)
          + f" | t{b}/t{a}: {'cpu':>5s} {'all':>5s} {'wall':>5s}")
    for k in order:
        if k not in res[b]["steps"]:
            continue
        cells = " ".join(" ".join(f"{v:8.0f}" for v in res[n]["steps"][k][:3]) for n in threads)
        rat = " ".join(f"{res[b]['steps'][k][i] / max(steps[k][i], 1e-9):5.2f}" for i in range(3))
        print(f"    {k:30s} {steps[k][3]:5.0f} {cells} |        {rat}")


def fp32_profile(call: IA.PerCount, threads: tuple[int, ...], calls: int, rounds: int) -> None:
    """The float32 model compiled, ``torch.profiler``'s self wall time per op on the calling thread (top 8), per count."""
    from torch.profiler import profile
    call = IA._at_count(call)
    tot: dict[int, dict[str, list[float]]] = {n: defaultdict(list) for n in threads}
    with torch.inference_mode():
        for r in common.round_bar(rounds, "thread breakdown rounds"):
            for n in threads if r % 2 == 0 else threads[::-1]:
                torch.set_num_threads(n)
                call()
                with profile() as p:
                    for _ in range(calls):
                        call()
                for e in p.key_averages():
                    tot[n][e.key].append(e.self_cpu_time_total / calls)
    torch.set_num_threads(threads[0])
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in tot.items()}
    top = sorted(med[threads[0]], key=lambda k: -med[threads[0]][k])[:8]
    for k in top:
        print(f"    {k[:60]:60s} " + " ".join(f"t{n} {med[n].get(k, float('nan')):9.0f}" for n in threads)
              + f"  t{threads[-1]}/t{threads[0]} {med[threads[-1]].get(k, float('nan')) / med[threads[0]][k]:.2f}")


def op_totals(call: IA.PerCount, rounds: int, calls: int, threads: tuple[int, ...]) -> None:
    """Per lowbit custom op of the compiled call (``torch.ops.lowbit.<op>.default``, which inductor's wrapper looks up
    per call: patched here), its calls' caller CPU time per model call (the op's Python, dispatch and native work),
    and ``frame``: the whole call less the ops (dynamo's wrapper, guards, the graph's own kernels). Medians over rounds.
    With the labelled table: an op's Python = its total - the labelled steps inside it."""
    call = IA._at_count(call)
    probe = Probe()
    saved = []
    for name in [n for n in dir(torch.ops.lowbit) if not n.startswith("_")]:
        pk = getattr(torch.ops.lowbit, name, None)
        ov = getattr(pk, "default", None)
        if ov is not None:
            saved.append((pk, ov))
            pk.default = probe.wrap(f"op.{name}", ov)
    acc: dict[int, dict[str, list[float]]] = {n: defaultdict(list) for n in threads}
    try:
        with torch.inference_mode():
            for r in range(rounds):
                for n in threads if r % 2 == 0 else threads[::-1]:
                    torch.set_num_threads(n)
                    call()
                    probe.reset()
                    c0 = time.thread_time_ns()
                    for _ in range(calls):
                        call()
                    whole = (time.thread_time_ns() - c0) / calls / 1e3
                    ops = {k: v / calls / 1e3 for k, v in probe.cpu.items()}
                    for k, v in ops.items():
                        acc[n][k].append(v)
                    acc[n]["frame (whole - ops)"].append(whole - sum(ops.values()))
                    acc[n]["whole"].append(whole)
    finally:
        for pk, ov in saved:
            pk.default = ov
        torch.set_num_threads(threads[0])
    med = statistics.median
    for k in sorted(acc[threads[0]], key=lambda k: (k == "whole", k.startswith("frame"), k)):
        print(f"    {k:30s} " + " ".join(f"cpu t{n} {med(acc[n][k]):8.0f}" for n in threads if acc[n].get(k)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["smallcnn", "minilm"], choices=["smallcnn", "minilm"])
    p.add_argument("--rounds", type=common.positive_int, default=9)
    p.add_argument("--calls", type=common.positive_int, default=3, help="model calls per sample")
    p.add_argument("--threads", type=common.positive_int, nargs="+", default=[1, 2])
    p.add_argument("--fp32", action="store_true", help="also profile the float32 model compiled per op")
    p.add_argument("--ops", action="store_true", help="also each lowbit op's total and the frame (op_totals)")
    p.add_argument("--compile-threads", type=common.positive_int, default=None,
                   help="compile once, at this count (inductor's C++ kernels keep the count they are compiled at: "
                        "at 1 they are serial at any count); default: each count's own compiled models")
    a = p.parse_args()
    threads = tuple(a.threads)
    print(common.isa_line(), f"| threads {threads} | load average {os.getloadavg()[0]:.2f} | OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset: waiting threads spin)')} | compiled at "
          f"{a.compile_threads or 'each count'}", flush=True)
    for label, (_, _, _, fp32_build, build) in IA.models(a.models).items():
        mine: dict[int, Callable[[], Any]] = {}
        fp32_call: dict[int, Callable[[], Any]] = {}
        for n in (a.compile_threads,) if a.compile_threads else threads:
            torch.set_num_threads(n)
            mine[n], fp32_call[n] = build(), fp32_build()
        if a.compile_threads:
            mine = {n: mine[a.compile_threads] for n in threads}
            fp32_call = {n: fp32_call[a.compile_threads] for n in threads}
        show(f"{label} lowbit compiled", breakdown(mine, a.rounds, a.calls, threads), threads)
        if a.ops:
            print(f"{label} lowbit compiled, per op (the calling thread's CPU µs per model call):")
            op_totals(mine, a.rounds, a.calls, threads)
        show(f"{label} fp32 compiled (no labels: whole)", breakdown(fp32_call, a.rounds, a.calls, threads), threads)
        if a.fp32:
            print(f"{label} fp32 compiled, profiler self wall µs per call:")
            fp32_profile(fp32_call, threads, a.calls, max(3, a.rounds // 3))


if __name__ == "__main__":
    main()
