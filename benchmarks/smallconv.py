"""A first conv's small window: ``native.smallconv``'s bodies against oneDNN's call, one layer, in one process.

Run: ``python benchmarks/smallconv.py [--quick] [--threads 1 2]`` (method: ``common.py``; prints the ISA first).
Writes ``benchmarks/results/smallconv.json``.

Per shape (an image model's first conv: 1 or 3 input channels; a few wider windows up to the 64-tap limit), the same
u8 codes, weights and grids run through ``native.smallconv`` in the body this CPU runs (``best``: VNNI where it has
AVX-512 VNNI + BW), its AVX2 body pinned, and oneDNN's ``qconv_pointwise`` on the weight packed for that input (the
NCHW codes copied to channels-last first, as ``kernels.conv_plan`` does), interleaved in the same rounds. The table
is oneDNN's time over each body's (> 1: the native pass is faster), next to the window's padded taps and whether
``kernels.conv_small`` routes that layer natively on this CPU. Codes are checked first (oneDNN's may differ by one at
exact float ties of the epilogue: counted and printed with the largest difference; on a CPU without VNNI oneDNN's
u8 × s8 pairs saturate on these full-range codes, so its codes differ by more, and a line says so).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit import native
from lowbit.kernels import ConvSpec, OutGrid, conv_small, onednn

# (batch, C_in, H, W, C_out, k, stride, padding): SmallCNN's conv1, MobileNetV2 / EfficientNet-Lite0's stem at
# batch 8 and 1, a 1-channel 64², a wide RGB 3x3, 4 -> 32 4x4 (64 taps), 1 -> 32 7x7 stride 2
SHAPES = [(64, 1, 28, 28, 16, 3, 1, 1), (8, 3, 224, 224, 32, 3, 2, 1), (1, 3, 224, 224, 32, 3, 2, 1),
          (8, 1, 64, 64, 32, 3, 1, 1), (8, 3, 112, 112, 64, 3, 1, 1), (8, 4, 56, 56, 32, 4, 1, 1),
          (8, 1, 56, 56, 32, 7, 2, 3)]


def methods(shape: tuple[int, ...]) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    n, cin, h, w, cout, k, s, p = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (n, cin, h, w), dtype=torch.uint8, generator=g)
    wt = torch.randint(-128, 128, (cout, cin, k, k), dtype=torch.int8, generator=g)
    sw, sx, zx = torch.rand(cout, generator=g) * 1e-3 + 1e-5, 0.02, 7
    bias, s_out, z_out = torch.randn(cout, generator=g), 0.1, 5
    packed = native.smallconv_weight(wt)
    inv = float(torch.tensor(s_out, dtype=torch.float32).reciprocal())
    geo = ([s, s], [p, p], [1, 1])
    pack = torch.ops.onednn.qconv_prepack(wt, sw, 1.0, zx, *geo, 1, list(q.shape))
    zeros = torch.zeros(cout, dtype=torch.long)

    def best() -> Any:
        return native.smallconv(q, zx, packed, *geo, sw * sx, bias, inv, z_out, 0, 255)

    def avx2() -> Any:
        with native.force_avx2():
            return native.smallconv(q, zx, packed, *geo, sw * sx, bias, inv, z_out, 0, 255)

    def onednn() -> Any:
        cl = native.to_channels_last(q)
        return torch.ops.onednn.qconv_pointwise(cl, sx, zx, pack, sw, zeros, bias, *geo, 1, s_out, z_out, torch.uint8,
                                                "none", [], "")
    a, b, c = best(), avx2(), onednn()
    weight = Q.QTensor(wt, sw, torch.zeros(cout, dtype=torch.long), Q.qint8, 0)
    info = {"taps": conv_small.taps(wt.shape), "bodies_equal": bool(torch.equal(a, b)),
            "onednn_tie_codes": int((a != c).sum()), "onednn_max_code_diff": int((a.int() - c.int()).abs().max()),
            "outputs": a.numel(),
            "routed": conv_small.takes(weight, ConvSpec(2, (s, s), (p, p), (1, 1), 1), OutGrid(s_out, z_out, Q.quint8))}
    return {f"native {native.smallconv_body()}": best, "native avx2": avx2, "oneDNN": onednn}, info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    a = p.parse_args()
    mach = common.machine()
    print(f"ISA: {mach['cpu']} | {' '.join(k for k, v in mach['isa'].items() if v)} | torch cpu capability "
          f"{mach['cpu_capability']} | native {native.reason()} | small-window body {native.smallconv_body()!r}")
    if not native.available():
        print("lowbit.native is not built: nothing to time")
        return
    if a.quick:
        a.rounds = min(a.rounds, 3)
    shapes = SHAPES[:3] if a.quick else SHAPES
    res: dict[str, Any] = {"body": native.smallconv_body(), "runs": []}
    rows = []
    for threads in a.threads:
        torch.set_num_threads(threads)
        for shape in tqdm(shapes, desc=f"shapes ({threads} thread{'s' if threads > 1 else ''})", file=sys.stdout):
            ms, info = methods(shape)
            t = common.bench(ms, a.rounds, a.min_time, a.max_load, a.max_wait)
            summ = t.summary()
            summ["ratios"] = {f"oneDNN / {k}": t.ratio("oneDNN", k) for k in ms if k != "oneDNN"}
            res["runs"].append({"shape": shape, "threads": threads, **info, **summ})
            label = "N{}×{}×{}×{} → {} k{} s{}".format(*shape[:7])
            rows.append([label, threads, info["taps"], "yes" if info["routed"] else "no",
                         *(summ["methods"][k]["ms"] * 1e3 for k in ms), *summ["ratios"].values(),
                         f"{info['onednn_tie_codes']}/{info['outputs']} (max {info['onednn_max_code_diff']})", t.n_clean])
            if not info["bodies_equal"]:
                raise AssertionError(f"{label}: the native bodies disagree")
            if info["onednn_max_code_diff"] > 1:
                tqdm.write(f"  {label}: oneDNN's codes differ by up to {info['onednn_max_code_diff']}, not ties: without "
                           f"VNNI (here {onednn.has_vnni()}) its u8 x s8 pairs saturate on full-range codes; timed all "
                           "the same", file=sys.stdout)
    names = list(ms)
    print(common.md_table(["shape", "threads", "taps", "routed", *(f"{k} µs" for k in names),
                           *(f"oneDNN / {k}" for k in names if k != "oneDNN"), "oneDNN codes differing (max diff)", "clean"],
                          rows))
    print(common.write_results(a.out or "smallconv", res))


if __name__ == "__main__":
    main()
