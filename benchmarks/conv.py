"""Conv2d 3×3, 64→64, 56×56, pad 1, batch 1 and 8: fp32 / bf16 / torch.ao / lowbit int8, interleaved.

Run: ``python benchmarks/conv.py [--quick] [--threads 1 2]`` (method: ``common.py``; prints the ISA first). Whole
float-in/float-out layers unless named "kernel"; speed-ups vs fp32 NCHW eager. Writes
``benchmarks/results/conv.json``.

Methods: fp32 NCHW | fp32 channels_last | bf16 channels_last | ao static (x86 engine, reduce_range
7-bit activations, channels_last, quantize→qconv→dequantize) | lowbit static u8 (8-bit act; on CPUs without
VNNI the exact weight split: one oneDNN call on 2 × 64 channels) | lowbit static u8 act-split (the same layer on the
previous route, the activation codes split per call: ``onednn.WSPLIT_CONV = False``, for the A/B) | lowbit static u7
(7-bit act, one exact call) | kernel u7 (one ``onednn.qconv_pointwise`` on u8 codes ≤ 127, u8 out).
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
from lowbit.kernels import onednn
from lowbit.nn.quantized import Conv2d as QConv2d

warnings.filterwarnings("ignore")


def lowbit_static(conv: nn.Conv2d, x: torch.Tensor, qd: Q.QDtype, act_split: bool = False) -> Callable[[], torch.Tensor]:
    w = conv.weight.detach()
    s = w.abs().flatten(1).amax(1) / 127
    wq = Q.quantize_per_channel(w, s, torch.zeros_like(s, dtype=torch.long), 0, Q.qint8)
    span = qd.quant_max - qd.quant_min
    z = (qd.quant_min + qd.quant_max + 1) // 2
    m = QConv2d.from_reference(conv, wq, float(conv(x).abs().amax()) * 2 / span, z, qd)
    m.input_grid = (float(x.abs().amax()) * 2 / span, z, qd)
    if not act_split:
        return lambda: m(x).dequantize()

    def run() -> torch.Tensor:
        onednn.WSPLIT_CONV = False
        try:
            return m(x).dequantize()
        finally:
            onednn.WSPLIT_CONV = True
    return run


def methods_for(batch: int) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1).eval()
    x = torch.randn(batch, 64, 56, 56)
    xcl = x.contiguous(memory_format=torch.channels_last)
    conv_cl = nn.Conv2d(64, 64, 3, padding=1).eval()
    conv_cl.load_state_dict(conv.state_dict())
    conv_cl = conv_cl.to(memory_format=torch.channels_last)
    conv_bf = nn.Conv2d(64, 64, 3, padding=1).eval()
    conv_bf.load_state_dict(conv.state_dict())
    conv_bf = conv_bf.to(torch.bfloat16, memory_format=torch.channels_last)
    xbf = xcl.bfloat16()
    torch.backends.quantized.engine = "x86"
    w = conv.weight.detach()
    s = (w.abs().flatten(1).amax(1) / 127).double()
    wq = torch.quantize_per_channel(w, s, torch.zeros(64, dtype=torch.long), 0, torch.qint8)
    s_in, s_out = float(x.abs().amax()) / 63.5, float(conv(x).abs().amax()) / 63.5
    aoq = torch.ao.nn.quantized.Conv2d(64, 64, 3, padding=1)
    aoq.set_weight_bias(wq, conv.bias.detach())
    aoq.scale, aoq.zero_point = s_out, 64
    codes = torch.randint(0, 128, (batch, 64, 56, 56), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    wq8 = torch.round(w / s.float()[:, None, None, None]).clamp(-127, 127).to(torch.int8)
    packed = torch.ops.onednn.qconv_prepack(wq8, s.float(), 1.0, 0, [1, 1], [1, 1], [1, 1], 1, None)
    zpw = torch.zeros(64, dtype=torch.long)
    meth: dict[str, Callable[[], Any]] = {
        "fp32 NCHW": lambda: conv(x),
        "fp32 channels_last": lambda: conv_cl(xcl),
        "bf16 channels_last": lambda: conv_bf(xbf),
        "ao static": lambda: aoq(torch.quantize_per_tensor(xcl, s_in, 64, torch.quint8)).dequantize(),
        "lowbit static u8": lowbit_static(conv, x, Q.quint8),
        "lowbit static u8 act-split": lowbit_static(conv, x, Q.quint8, act_split=True),
        "lowbit static u7": lowbit_static(conv, x, Q.quint8.with_range(0, 127)),
        "kernel u7": lambda: torch.ops.onednn.qconv_pointwise(codes, 0.01, 64, packed, s.float(), zpw, conv.bias,
                                                              [1, 1], [1, 1], [1, 1], 1, 0.05, 64, torch.uint8,
                                                              "none", [], ""),
    }
    with torch.inference_mode():
        ref = conv(x)
        err = {k: float((f().float() - ref).norm() / ref.norm()) for k, f in meth.items() if not k.startswith("kernel")}
    return meth, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    a = p.parse_args()
    print(common.isa_line(), flush=True)
    batches = [1] if a.quick else [1, 8]
    if a.quick:
        a.rounds = min(a.rounds, 3)
    res: dict[str, Any] = {"vnni": onednn.has_vnni(), "runs": []}
    for threads in a.threads:
        torch.set_num_threads(threads)
        for batch in batches:
            meth, err = methods_for(batch)
            t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
            summ = t.summary("fp32 NCHW")
            gop = 2 * batch * 64 * 64 * 9 * 56 * 56 / 1e9
            for name, row in summ["methods"].items():
                row["rel_err"] = err.get(name)
                row["gops"] = gop / (row["ms"] * 1e-3)
            res["runs"].append({"threads": threads, "batch": batch, **summ})
            print(f"t={threads} batch {batch} clean {t.n_clean}/{a.rounds} load {summ['other_load_median']:.2f} | "
                  + " ".join(f"{k}={v['speedup_vs_fp32 NCHW']:.2f}" for k, v in summ["methods"].items()), flush=True)
    print(common.write_results(a.out or "conv", res))


if __name__ == "__main__":
    main()
