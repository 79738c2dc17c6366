"""Exact bilinear resampling in QAT / prepared models (``qtensor.resample.bilinear_on_grid``) against float
``F.interpolate``: forward, and forward + backward.

Run: ``python benchmarks/bilinear_qat.py [--rounds 9] [--quick] [--out NAME]`` (1 thread; prints the ISA first).

Per shape, methods run interleaved (``common``'s method: order reversed every other round, an idleness gate, a cold
cache before each sample; medians over clean rounds, ratios as medians of per-round ratios):

- ``float``: ``F.interpolate(x, mode="bilinear")`` (forward), or it and ``.sum().backward()`` (fwd+bwd);
- ``qat_old`` / ``qat_new``: what a QAT model's shared grid runs for the same upsample: ``y = fq(F.interpolate(x))``
  (a fake-quant on the input's grid, observer off) then ``bilinear_on_grid(x, y, ...)``, the int8 kernel's codes:
  ``_old_on_grid`` below (session 40's code, kept verbatim for this figure) or the current one;
- ``grid_old`` / ``grid_new`` (forward only): ``bilinear_on_grid`` alone, ``y`` given.

Reported: ms per call and the ratio to ``float`` (time / float's; > 1 is slower). Results go to
``benchmarks/results/<out>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.qtensor.resample import bilinear_args, bilinear_blend, bilinear_on_grid

SHAPES = {  # name: (input shape, interpolate kwargs, channels_last)
    "8x16x32x32->64x64": ((8, 16, 32, 32), {"size": (64, 64)}, False),
    "8x16x32x32 x2 align": ((8, 16, 32, 32), {"scale_factor": 2, "align_corners": True}, False),
    "8x16x32x32->64x64 NHWC": ((8, 16, 32, 32), {"size": (64, 64)}, True),
    "1x32x56x56 x1.5": ((1, 32, 56, 56), {"scale_factor": 1.5}, False),
    "4x16x64x64->24x40": ((4, 16, 64, 64), {"size": (24, 40)}, False),
}


def _old_on_grid(x: torch.Tensor, y: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int,
                 size: Any = None, scale_factor: Any = None, align_corners: Any = None) -> torch.Tensor:
    """Session 40's ``bilinear_on_grid`` (per tensor): ``bilinear_codes`` on int32 codes, ``bilinear_blend``."""
    with torch.no_grad():
        s32, z32 = s.to(torch.float32), z.to(torch.float32)
        q = (x.detach() / s32).round_().add_(z32).clamp_(qmin, qmax).to(torch.int32)
        out, scales = bilinear_args(x.shape, size, scale_factor, None)
        cl = q.is_contiguous(memory_format=torch.channels_last)
        v = bilinear_blend(q.to(torch.float32), out, bool(align_corners), scales)
        codes = ((v - z32) + z32).round_().clamp_(qmin, qmax).to(torch.int32)
        codes = codes.contiguous(memory_format=torch.channels_last) if cl else codes
        exact = (codes.to(torch.float32) - z32) * s32
    return y + (exact - y).detach()


def _time(methods: dict[str, Callable[[], Any]], rounds: int, min_time: float) -> common.Timing:
    """``common.bench``'s interleaved rounds, outside inference mode (the backward needs autograd)."""
    counts = {}
    for k, f in methods.items():
        f()
        t = time.perf_counter()
        f()
        counts[k] = max(1, int(min_time / max(time.perf_counter() - t, 1e-9)))
    names, times, loads, meter = list(methods), {k: [] for k in methods}, [], common.LoadMeter()
    for r in common.round_bar(rounds, "bilinear QAT rounds"):
        common.wait_idle(0.15, 3.0)
        meter.start()
        for k in names if r % 2 == 0 else names[::-1]:
            common._flush()
            t = time.perf_counter()
            for _ in range(counts[k]):
                methods[k]()
            times[k].append((time.perf_counter() - t) / counts[k])
        loads.append(meter.stop())
    return common.Timing(times, loads, 0.15)


def run_shape(shape: tuple[int, ...], kw: dict[str, Any], channels_last: bool, rounds: int,
              min_time: float) -> dict[str, Any]:
    torch.manual_seed(0)
    fq = Q.get_default_qat_qconfig().activation()
    x = torch.randn(shape).relu_()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    fq(x)
    fq.disable_observer()
    x = fq(x).detach().requires_grad_()
    s, z, qmin, qmax = fq.scale, fq.zero_point, fq.quant_min, fq.quant_max
    y = fq(F.interpolate(x, mode="bilinear", **kw)).detach()
    new = lambda y: bilinear_on_grid(x, y, s, z, qmin, qmax, None, **kw)  # noqa: E731
    old = lambda y: _old_on_grid(x, y, s, z, qmin, qmax, **kw)  # noqa: E731
    if not torch.equal(new(y), old(y)):
        raise AssertionError(f"{shape} {kw}: the new bilinear_on_grid differs from the old one")

    def qat(fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(fq(F.interpolate(x, mode="bilinear", **kw)))

    def fwd_bwd(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            x.grad = None
            f().sum().backward()
        return go

    fl = lambda: F.interpolate(x, mode="bilinear", **kw)  # noqa: E731
    res = {}
    for phase, methods in (
            ("forward", {"float": fl, "qat_old": lambda: qat(old), "qat_new": lambda: qat(new),
                         "grid_old": lambda: old(y), "grid_new": lambda: new(y)}),
            ("fwd+bwd", {"float": fwd_bwd(fl), "qat_old": fwd_bwd(lambda: qat(old)),
                         "qat_new": fwd_bwd(lambda: qat(new))})):
        tm = _time(methods, rounds, min_time)
        res[phase] = {k: {"ms": tm.median(k) * 1e3,
                          "x_float": statistics.median(a / b for a, b in zip(tm.times[k], tm.times["float"])),
                          "spread": tm.spread(k)} for k in methods}
        res[phase]["noisy"] = tm.noisy
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=common.positive_int, default=9)
    p.add_argument("--min-time", type=common.positive_float, default=0.05)
    p.add_argument("--quick", action="store_true", help="smoke run: one shape, 3 rounds")
    p.add_argument("--out", default="bilinear_qat")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(common.isa_line(), flush=True)
    print("threads 1", flush=True)
    shapes = dict(list(SHAPES.items())[:1]) if a.quick else SHAPES
    rounds = 3 if a.quick else a.rounds
    out: dict[str, Any] = {"machine": common.machine(), "threads": 1, "rounds": rounds, "shapes": {}}
    rows = []
    for name, (shape, kw, cl) in shapes.items():
        r = run_shape(shape, kw, cl, rounds, a.min_time)
        out["shapes"][name] = r
        for phase, m in r.items():
            rows.append([name, phase + (" (noisy)" if m["noisy"] else "")]
                        + [f"{m[k]['ms']:.2f} ({m[k]['x_float']:.2f}x)" if k in m else "-"
                           for k in ("float", "qat_old", "qat_new", "grid_old", "grid_new")])
        print(common.md_table(["shape", "phase", "float ms", "qat old", "qat new", "grid old", "grid new"],
                              rows[-2:]), flush=True)
    print(common.md_table(["shape", "phase", "float ms", "qat old", "qat new", "grid old", "grid new"], rows))
    print("results:", common.write_results(a.out, out))


if __name__ == "__main__":
    main()
