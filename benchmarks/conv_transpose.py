"""ConvTranspose2d 64→32, 32×32, batch 8 (a UNet decoder's upsampler; k=2 s=2 and k=4 s=2 p=1): fp32 / torch.ao /
lowbit int8 on its oneDNN path (``kernels/conv_transpose.py``) / lowbit int8 on the float-simulation reference.

Run: ``python benchmarks/conv_transpose.py [--quick] [--threads 1]`` (method: ``common.py``; prints the ISA first).
Whole float-in/float-out layers (quantize → layer → dequantize for the int8 ones); speed-ups vs fp32 NCHW eager.
Writes ``benchmarks/results/conv_transpose.json``.

Methods: fp32 NCHW | fp32 channels_last | ao static (torch.ao's quantized ConvTranspose2d, x86 engine, 7-bit
activations as its recipe) | lowbit u8 (8-bit activations; the stride phases as one oneDNN conv) | lowbit u8
reference (the same layer pinned to ``kernels.use_backend("reference")``, the route every transposed conv took before).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit import kernels
from lowbit.kernels import onednn
from lowbit.nn.quantized import ConvTranspose2d as QConvT2d

warnings.filterwarnings("ignore")
SHAPES = {"k2 s2": dict(kernel_size=2, stride=2), "k4 s2 p1": dict(kernel_size=4, stride=2, padding=1)}


def methods_for(batch: int, geometry: dict[str, int]) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(64, 32, **geometry).eval()
    x = torch.randn(batch, 64, 32, 32)
    xcl = x.contiguous(memory_format=torch.channels_last)
    conv_cl = nn.ConvTranspose2d(64, 32, **geometry).eval()
    conv_cl.load_state_dict(conv.state_dict())
    conv_cl = conv_cl.to(memory_format=torch.channels_last)
    w = conv.weight.detach()
    s = w.abs().transpose(0, 1).flatten(1).amax(1) / 127
    wq = Q.quantize_per_channel(w, s, torch.zeros(32, dtype=torch.long), 1, Q.qint8)
    s_out = float(conv(x).abs().amax()) / 127.5
    m = QConvT2d.from_reference(conv, wq, s_out, 128, Q.quint8)
    m.input_grid = (float(x.abs().amax()) / 127.5, 128, Q.quint8)

    def ref() -> torch.Tensor:
        with kernels.use_backend("reference"):
            return m(x).dequantize()

    meth: dict[str, Callable[[], Any]] = {"fp32 NCHW": lambda: conv(x), "fp32 channels_last": lambda: conv_cl(xcl)}
    try:  # torch.ao's quantized ConvTranspose2d (x86 engine; per-tensor weights, its default there)
        torch.backends.quantized.engine = "x86"
        s_t = float(w.abs().amax()) / 127
        aoq = torch.ao.nn.quantized.ConvTranspose2d(64, 32, **geometry)
        aoq.set_weight_bias(torch.quantize_per_tensor(w, s_t, 0, torch.qint8), conv.bias.detach())
        aoq.scale, aoq.zero_point = s_out, 128
        s_in = float(x.abs().amax()) / 63.5
        aoq(torch.quantize_per_tensor(x, s_in, 64, torch.quint8))
        meth["ao static"] = lambda: aoq(torch.quantize_per_tensor(x, s_in, 64, torch.quint8)).dequantize()
    except RuntimeError as e:  # pragma: no cover (a build without it)
        print(f"torch.ao ConvTranspose2d unavailable: {e}".splitlines()[0])
    meth["lowbit u8"] = lambda: m(x).dequantize()
    meth["lowbit u8 reference"] = ref
    with torch.inference_mode():
        y = conv(x)
        err = {k: float((f().float() - y).norm() / y.norm()) for k, f in meth.items()}
    return meth, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    a = p.parse_args()
    print(common.isa_line(), flush=True)
    batch = 8
    if a.quick:
        a.rounds = min(a.rounds, 3)
    res: dict[str, Any] = {"vnni": onednn.has_vnni(), "runs": []}
    for threads in a.threads:
        torch.set_num_threads(threads)
        for shape, geometry in SHAPES.items():
            meth, err = methods_for(batch, geometry)
            before = kernels.counts[("onednn", "conv_transpose")]
            t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
            assert kernels.counts[("onednn", "conv_transpose")] > before  # the int8 path ran
            summ = t.summary("fp32 NCHW")
            for name, row in summ["methods"].items():
                row["rel_err"] = err.get(name)
            res["runs"].append({"threads": threads, "batch": batch, "shape": shape, **summ})
            print(f"t={threads} {shape} batch {batch} clean {t.n_clean}/{a.rounds} load "
                  f"{summ['other_load_median']:.2f}")
            rows = [[k, f"{v['ms']:.3f}", f"{v['speedup_vs_fp32 NCHW']:.2f}",
                     f"{summ['methods']['lowbit u8 reference']['ms'] / v['ms']:.2f}", f"{err[k]:.4f}"]
                    for k, v in summ["methods"].items()]
            print(common.md_table(["method", "ms", "x fp32 NCHW", "x lowbit reference", "rel err"], rows), flush=True)
    print(common.write_results(a.out or "conv_transpose", res))


if __name__ == "__main__":
    main()
