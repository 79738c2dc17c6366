"""Exact 8-bit convs without VNNI: the weight split against the previous activation split, in one process.

Run: ``python benchmarks/conv_split.py [--quick] [--threads 1 2] [--cases conv smallcnn mobilenetv2]`` (method:
``common.py``; prints the ISA first). Writes ``benchmarks/results/conv_split.json``.

The same converted model (lowbit's default recipe: 8-bit activations) runs on both routes, interleaved in the same
rounds: ``lowbit wsplit`` (``onednn.WSPLIT_CONV = True``, the default: the weights' 7-bit halves packed once, one
oneDNN call on the codes) and ``lowbit actsplit`` (``False``: the activation codes split per call), next to
torch.ao (x86 engine, its default 7-bit recipe) and fp32. Cases are ``compiled.py``'s: Conv 8×64×56² 3×3 +ReLU
(channels-last input), SmallCNN b64, MobileNetV2 b8 224² (random weights). On a VNNI CPU both routes are the one
fused call (nothing to compare).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.ao.nn.quantized as aonnq
import torch.ao.quantization as aoq
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import compiled as C

from lowbit.examples import SmallCNN
from lowbit.kernels import onednn

warnings.filterwarnings("ignore")
CASES = ("conv", "smallcnn", "mobilenetv2")


def on_route(model: torch.nn.Module, x: torch.Tensor, wsplit: bool) -> Callable[[], Any]:
    def run() -> Any:
        onednn.WSPLIT_CONV = wsplit
        try:
            return model(x)
        finally:
            onednn.WSPLIT_CONV = True
    return run


def methods(case: str) -> dict[str, Callable[[], Any]]:
    """``compiled.py``'s case (eager): the lowbit model on both routes, its torch.ao twin, fp32."""
    torch.manual_seed(0)
    if case == "conv":
        c = nn.Conv2d(64, 64, 3, padding=1).eval()
        x = torch.randn(8, 64, 56, 56).contiguous(memory_format=torch.channels_last)
        fp = nn.Sequential(c, nn.ReLU()).eval()
        lb, ao = C._static_pair(C._wrapped(c, False, relu=True), C._wrapped(c, True, relu=True), [x], [["1", "2"]])
    elif case == "smallcnn":
        fp, ao_fp = SmallCNN().eval(), SmallCNN().eval()
        ao_fp.load_state_dict(fp.state_dict())
        ao_fp.quant, ao_fp.dequant, ao_fp.skip = aoq.QuantStub(), aoq.DeQuantStub(), aonnq.FloatFunctional()
        lb, ao = C._static_pair(fp, ao_fp, [torch.randn(128, 1, 28, 28) for _ in range(2)], SmallCNN.fusion_groups())
        x = torch.randn(64, 1, 28, 28)
    else:
        fp, ao_fp = C.MobileNetV2().eval(), C.MobileNetV2(ao=True).eval()
        ao_fp.load_state_dict(fp.state_dict())
        lb, ao = C._static_pair(fp, ao_fp, [torch.randn(8, 3, 224, 224) for _ in range(2)], fp.fusion_groups())
        x = torch.randn(8, 3, 224, 224)
    with torch.inference_mode():
        same = torch.equal(on_route(lb, x, True)(), on_route(lb, x, False)())
    tqdm.write(f"  {case}: weight split vs activation split outputs {'bit-identical' if same else 'differ'}")
    return {"lowbit wsplit": on_route(lb, x, True), "lowbit actsplit": on_route(lb, x, False),
            "torch.ao": lambda: ao(x), "fp32": lambda: fp(x)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    a = p.parse_args()
    mach = common.machine()
    print(f"ISA: {mach['cpu']} | {' '.join(k for k, v in mach['isa'].items() if v)} | torch cpu capability "
          f"{mach['cpu_capability']} | VNNI (oneDNN) {onednn.has_vnni()}")
    if a.quick:
        a.rounds = min(a.rounds, 3)
    res: dict[str, Any] = {"vnni": onednn.has_vnni(), "runs": []}
    for threads in a.threads:
        torch.set_num_threads(threads)
        for case in tqdm(a.cases, desc=f"cases ({threads} thread{'s' if threads > 1 else ''})", file=sys.stdout):
            t = common.bench(methods(case), a.rounds, a.min_time, a.max_load, a.max_wait)
            summ = t.summary("lowbit actsplit")
            summ["ratios"] = {f"{k} / torch.ao": t.ratio("torch.ao", k) for k in ("lowbit wsplit", "lowbit actsplit")}
            res["runs"].append({"case": case, "threads": threads, **summ})
            tqdm.write(f"{case} t={threads} clean {t.n_clean}/{a.rounds} load {summ['other_load_median']:.2f} | "
                       + " ".join(f"{k}={v['ms']:.1f}ms" for k, v in summ["methods"].items())
                       + f" | wsplit vs actsplit {summ['methods']['lowbit wsplit']['speedup_vs_lowbit actsplit']:.2f}x | "
                       + " ".join(f"{k}={v:.2f}" for k, v in summ["ratios"].items()))
    print(common.write_results(a.out or "conv_split", res))


if __name__ == "__main__":
    main()
