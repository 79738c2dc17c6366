"""Per-call overhead of the static and dynamic int8 Linear at small M: where the time goes.

Run: ``python benchmarks/overhead.py [--shapes 1x768x768 16x768x768] [--rounds 7]``; prints the ISA,
writes ``benchmarks/results/overhead.json``. 1 thread, interleaved like ``common.bench``. Each row times
one layer of the call stack (the whole model, one module, the kernel dispatcher, the raw torch op), so
the differences between rows are the per-call costs of each layer; torch.ao's twins are the yardstick.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from linear import converted_pair as models  # fp32 / lowbit / torch.ao static and dynamic

from lowbit import kernels
from lowbit.nn.quantized.dynamic.per_token import dynamic_linear, quantize_per_token

warnings.filterwarnings("ignore")


def methods(m: int, k: int, n: int) -> dict[str, Callable[[], Any]]:
    x, mods = models(m, k, n)
    st = mods["lowbit static"]
    quant, qlin, dequant = st[0], st[1], st[2]
    xq = quant(x)
    yq = qlin(xq)
    weight, out = qlin._prepared()
    cache = qlin._cache
    st7 = mods["lowbit static x86"]  # torch.ao's own x86 recipe (7-bit activations): one exact kernel call
    xq7 = st7[0](x)
    st7[1](xq7)
    codes7 = st7[0](x).int_repr()
    plan7 = st7[1]._cache["plan"][2] if "plan" in st7[1]._cache else None  # kernels.plan (CPUs without VNNI)
    dyn = mods["lowbit dynamic"][0]
    dargs = (dyn.weight_int8, dyn.weight_scale, dyn.weight_zero_point, dyn.dtype, dyn.bias, dyn._cache)
    return {
        "fp32 nn.Linear": lambda: mods["fp32"](x),
        "ao static (q -> linear -> dq)": lambda: mods["ao static"](x),
        "lowbit static (Quantize -> Linear -> DeQuantize)": lambda: st(x),
        "  Quantize (float -> QTensor)": lambda: quant(x),
        "  Linear module (QTensor in)": lambda: qlin(xq),
        "  kernels.linear (dispatch + backend)": lambda: kernels.linear(xq, weight, qlin.bias, out, False, cache),
        "  DeQuantize (QTensor -> float)": lambda: dequant(yq),
        "lowbit static, x86 recipe (Quantize -> Linear -> DeQuantize)": lambda: st7(x),
        "  Quantize (x86 recipe)": lambda: st7[0](x),
        "  Linear module (x86 recipe, QTensor in)": lambda: st7[1](xq7),
        # (its own copy: reading xq7's codes would drop the scale-1 tensor the Linear module row feeds to fbgemm)
        **({"  kernels.plan run (x86 recipe)": lambda: plan7(codes7, xq7.scale.item(), xq7.zero_point.item())}
           if plan7 is not None else {}),
        "ao dynamic": lambda: mods["ao dynamic"](x),
        "lowbit dynamic (module)": lambda: mods["lowbit dynamic"](x),
        "  per_token.dynamic_linear": lambda: dynamic_linear(x, *dargs),
        "  quantize_per_token": lambda: quantize_per_token(x),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=common.mkn, nargs="+", default=[(1, 768, 768), (16, 768, 768)], metavar="MxKxN")
    p.add_argument("--rounds", type=common.positive_int, default=7)
    p.add_argument("--min-time", type=common.positive_float, default=0.05)
    p.add_argument("--max-wait", type=common.nonnegative_float, default=2.0)
    p.add_argument("--out", default=None, help="results name (default overhead); use one for scratch runs")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(common.isa_line() + " | 1 thread", flush=True)
    res: dict[str, Any] = {"threads": 1, "runs": []}
    for m, k, n in a.shapes:
        shape = f"{m}x{k}x{n}"
        meth = methods(m, k, n)
        t = common.bench(meth, a.rounds, a.min_time, max_wait=a.max_wait)
        rows = {name: t.median(name) * 1e6 for name in meth}
        print(f"\n{shape}: clean rounds {t.n_clean}/{a.rounds}, other load {t.summary()['other_load_median']:.2f}")
        for name, us in rows.items():
            print(f"  {name:62s} {us:8.1f} us")
        res["runs"].append({"shape": shape, "us": rows, "clean_rounds": t.n_clean})
    print(common.write_results(a.out or "overhead", res))


if __name__ == "__main__":
    main()
