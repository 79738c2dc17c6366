"""Raw int8 Linear kernels on the same u8 codes: lowbit.native's plan against fbgemm's and oneDNN's calls.

Run: ``python benchmarks/raw_linear.py [--threads 1 2] [--shapes 16x768x3072 ...] [--rounds 7] [--body best|avx2]
[--out NAME]``. Every method computes torch's fbgemm ``quantized::linear`` on the same codes (u8 activations on
``(s_x, z_x)``, per-channel int8 weights, a u8 output grid), checked equal to fbgemm's codes before timing, and is
timed without any module glue:

- ``native``: a ``native.linear_plan`` in "requant" mode, its weights packed (one ``lb_linear_run`` per call; on a
  VNNI CPU the AVX-512 VNNI kernels, ``--body avx2`` pins the AVX2 bodies as the tests do);
- ``fbgemm``: ``quantized::linear`` on a prepacked weight (torch's x86 engine below its oneDNN switch);
- ``onednn``: ``onednn::qlinear_pointwise`` on a prepacked weight, u8 output (the VNNI CPU's call above
  ``small_m.VNNI_M`` rows).

Codes below 128 (pairs that cannot saturate without VNNI), so one plan serves both bodies. Prints the ISA, a table of
medians of interleaved rounds (``common.bench``) with ratios to ``native`` (> 1: native faster), and writes
``results/<out>.json``. Session 31's kernel A/B (``benchmarks/README.md``) used this comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import common

from lowbit import native
from lowbit.kernels import onednn

SHAPES = [(1, 768, 768), (1, 768, 3072), (1, 4096, 4096), (4, 768, 768), (16, 768, 768), (16, 768, 3072),
          (16, 4096, 4096), (64, 768, 3072), (128, 768, 768), (128, 4096, 4096), (512, 768, 3072)]


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not MxKxN (three integers, e.g. 16x768x3072)") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: M, K and N must be at least 1")
    return m, k, n


def methods(m: int, k: int, n: int) -> dict[str, Any]:
    """The three calls on one shape's codes, after checking that they give fbgemm's codes (the native body: the
    caller's pin)."""
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randint(0, 128, (m, k), generator=g, dtype=torch.uint8)
    sx, zx, so, zo = 0.02, 64, 0.5, 3
    mult = torch.tensor(sx, dtype=torch.float32) * ws / torch.tensor(so, dtype=torch.float32)
    plan = native.linear_plan(w, "requant", mult, None, pairs=True, codes=(zo, 0, 255))
    if plan is None:
        raise SystemExit(f"lowbit.native is not available here: {native.reason()}")
    out = torch.empty(m, n, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wq = torch._make_per_channel_quantized_tensor(w, ws.double(), torch.zeros(n, dtype=torch.long), 0)
        xq = torch._make_per_tensor_quantized_tensor(x, sx, zx)
    packed = torch.ops.quantized.linear_prepack(wq, None)
    opk = torch.ops.onednn.qlinear_prepack(w, None)
    zw = torch.zeros(n, dtype=torch.long)
    calls = {"native": lambda: plan.run(x, zx, out),
             "fbgemm": lambda: torch.ops.quantized.linear(xq, packed, so, zo),
             "onednn": lambda: torch.ops.onednn.qlinear_pointwise(x, sx, zx, opk, ws, zw, None, so, zo, torch.uint8,
                                                                  "none", [], "")}
    want = calls["fbgemm"]().int_repr()
    calls["native"]()
    if not torch.equal(out, want):
        raise AssertionError(f"{m}x{k}x{n}: lowbit.native's codes differ from fbgemm's")
    if not torch.equal(calls["onednn"](), want):  # (oneDNN's requantization rounds some ties the other way)
        tqdm.write(f"  {m}x{k}x{n}: oneDNN's codes differ from fbgemm's in some ties (timed all the same)")
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="+", default=SHAPES, metavar="MxKxN")
    p.add_argument("--body", choices=("best", "avx2"), default="best", help="native body: the CPU's best, or AVX2 pinned")
    common.add_common_args(p)
    a = p.parse_args()
    if a.quick:
        a.rounds = min(a.rounds, 3)
    if not native.available():
        raise SystemExit(f"lowbit.native is not available here: {native.reason()}")
    mach = common.machine()
    print(f"{mach.get('cpu', '?')} | ISA {mach.get('isa')} | vnni={onednn.has_vnni()} | torch {mach['torch']} | "
          f"native: {native.reason()} | body {a.body}")
    res: dict[str, Any] = {"body": a.body, "runs": []}
    for threads in a.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): median µs of interleaved rounds; ratio = method time / native time")
        print(common.md_table(["M×K×N", "clean", "native µs", "fbgemm µs", "oneDNN µs", "fbgemm / native",
                               "oneDNN / native"], []))
        shapes = [(16, 768, 3072), (1, 768, 768)] if a.quick else a.shapes
        for m, k, n in tqdm(shapes, desc=f"shapes, {threads} thread(s)", leave=False):
            with native.force_avx2() if a.body == "avx2" else contextlib.nullcontext():  # (this thread's pin)
                t = common.bench(methods(m, k, n), a.rounds, a.min_time, a.max_load, a.max_wait)
            us = {name: t.median(name) * 1e6 for name in t.times}
            fb, od = t.ratio("fbgemm", "native"), t.ratio("onednn", "native")
            tqdm.write(f"| {m}×{k}×{n} | {t.n_clean}/{len(t.loads)} | {us['native']:.1f} | {us['fbgemm']:.1f} | "
                       f"{us['onednn']:.1f} | {fb:.2f} | {od:.2f} |")
            res["runs"].append({"threads": threads, "M": m, "K": k, "N": n, "us": us, "fbgemm_over_native": fb,
                                "onednn_over_native": od, **t.summary()})
    print(common.write_results(a.out or "raw_linear", res))


if __name__ == "__main__":
    main()
