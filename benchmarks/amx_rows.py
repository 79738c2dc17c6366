"""The per-token dynamic Linear's many-row route on an AMX CPU: lowbit's native AMX call (``per_token._amx_rows``)
against the oneDNN route it replaces (``qlinear_pointwise`` + ``row_epilogue``), per MiniLM b32 shape and for the
whole compiled model, at 1 and 2 threads (issue #10, session 51).

Run: ``python benchmarks/amx_rows.py [--rounds 400] [--model-rounds 15] [--no-model]`` (prints the ISA and load).

Per shape, the two routes alternate call by call in one process on the same codes (``per_token.AMX_ROWS`` on / off;
their outputs checked equal first): per call the wall time, the calling thread's CPU time and every thread's, median
and 20th percentile. The model part alternates the compiled MiniLM b32 dynamic (``int8_advantage.models``, compiled
per thread count) with the route on and off and the float32 model compiled, and prints the paired saving and
``fp32 compiled / lowbit compiled`` on each clock. On a shared machine read the CPU columns (``OMP_WAIT_POLICY=PASSIVE``
keeps the waiting thread off the CPU). Session 51, Xeon (AMX), load 9-11: caller CPU 61.2 -> 58.1 ms at 1 thread and
40.2 -> 35.8 ms at 2 threads; outputs bit-identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import int8_advantage as IA

from lowbit import native
from lowbit.nn.quantized.dynamic import per_token as PT
from lowbit.qscheme import qint8

SHAPES = ((512, 384, 384), (512, 384, 1536), (512, 1536, 384))


def _clock(f: Any) -> tuple[float, float, float]:
    w0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
    f()
    return (time.perf_counter_ns() - w0) / 1e3, (time.thread_time_ns() - c0) / 1e3, (time.process_time_ns() - p0) / 1e3


def shapes(rounds: int) -> None:
    torch.manual_seed(0)
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for m, k, n in SHAPES:
            w, b = torch.randn(n, k) * 0.05, torch.randn(n)
            ws = w.abs().amax(1) / 127
            wq, wz = torch.round(w / ws[:, None]).clamp(-128, 127).to(torch.int8), torch.zeros(n, dtype=torch.int64)
            x, cache = torch.randn(m, k), {}
            PT.dynamic_linear(x, wq, ws, wz, qint8, b, cache)
            plan = PT._plan(wq, ws, wz, qint8, cache)
            q, sc, nz = PT._grid_codes(x)

            def run(amx: bool, a: tuple[Any, ...] = (plan, q, sc, nz, ws, wz, b)) -> torch.Tensor:
                PT.AMX_ROWS = amx
                return PT.onednn_rows(a[0], a[1], a[2], a[3].clone(), a[4], a[5], a[6])
            assert torch.equal(run(True), run(False))
            res: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
            for i in common.round_bar(rounds, f"{m}x{k}->{n} t={nt}"):
                for amx in (True, False) if i % 2 else (False, True):
                    res[amx].append(_clock(lambda amx=amx: run(amx)))
            PT.AMX_ROWS = True
            for amx in (False, True):
                v = res[amx]
                cells = []
                for j, name in enumerate(("wall", "caller", "all")):
                    xs = sorted(r[j] for r in v)
                    cells.append(f"{name} {statistics.median(xs):7.1f} (p20 {xs[len(xs) // 5]:7.1f})")
                print(f"t{nt} {m}x{k}->{n} {'AMX   ' if amx else 'oneDNN'} µs: " + " ".join(cells), flush=True)


def model(rounds: int) -> None:
    (_, _, _, fp32_build, build), = IA.models(["minilm"]).values()
    calls = {}
    for nt in (1, 2):
        torch.set_num_threads(nt)
        calls[nt] = (build(), fp32_build())
    res: dict[tuple[int, Any], list[tuple[float, float, float]]] = {}
    with torch.inference_mode():
        for r in common.round_bar(rounds, "compiled MiniLM rounds"):
            for nt in (1, 2) if r % 2 else (2, 1):
                torch.set_num_threads(nt)
                for mode in ("fp32", False, True) if r % 2 else (True, False, "fp32"):
                    f = calls[nt][1] if mode == "fp32" else calls[nt][0]
                    PT.AMX_ROWS = mode is True or mode == "fp32"
                    f()
                    res.setdefault((nt, mode), []).append(_clock(f))
    PT.AMX_ROWS = True
    for nt in (1, 2):
        for j, name in enumerate(("wall", "caller", "all")):
            old, new, fp = res[(nt, False)], res[(nt, True)], res[(nt, "fp32")]
            print(f"t{nt} {name:6s}: oneDNN route {statistics.median(o[j] for o in old) / 1e3:7.2f} ms, AMX route "
                  f"{statistics.median(a[j] for a in new) / 1e3:7.2f} ms (paired saving "
                  f"{statistics.median(o[j] - a[j] for o, a in zip(old, new, strict=True)) / 1e3:.2f} ms); fp32 compiled / "
                  f"lowbit {statistics.median(f[j] / o[j] for f, o in zip(fp, old, strict=True)):.2f}x -> "
                  f"{statistics.median(f[j] / a[j] for f, a in zip(fp, new, strict=True)):.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=common.positive_int, default=400, help="calls per route and shape")
    p.add_argument("--model-rounds", type=common.positive_int, default=15)
    p.add_argument("--no-model", action="store_true")
    a = p.parse_args()
    print(common.isa_line(), f"| native AMX {native.amx()} | load average {os.getloadavg()[0]:.2f} | OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}", flush=True)
    if not native.amx():
        print("no AMX sums here (native.amx() is False): both routes are the oneDNN route")
        return
    shapes(a.rounds)
    if not a.no_model:
        model(a.model_rounds)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
