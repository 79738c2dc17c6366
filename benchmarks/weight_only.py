"""Weight-only int4/int8 Linear: speed of one layer vs fp32, and SmolLM2-135M perplexity / size.

Run: ``python benchmarks/weight_only.py [--quick] [--skip-llm] [--tokens 8192] [--out NAME]`` (timing method:
``common.py``; 1 thread; prints the ISA first). Writes ``benchmarks/results/weight_only.json`` (or ``NAME.json``).

Speed: ``nn.Linear(768, 2048)`` at M = 1 and 64 tokens, fp32 ``F.linear`` vs ``WeightOnlyLinear``
int4 g128 (torch's ``_weight_int4pack_mm_for_cpu``, bf16 activations), int4 g128 reference path
(dequantize + ``F.linear``) and int8 per channel (``(x @ qᵀ) * s``).

LLM: SmolLM2-135M-Instruct (``lowbit.data.load_smollm2``): ``quantize_weight_only`` rows quantize every
Linear except ``lm_head``; ``quantize_llm`` rows (block-by-block GPTQ + AWQ + hmse clip, ``lowbit.llm``)
also the tied ``lm_head`` / embedding; ``w8a8`` rows every block Linear (dynamic per-token int8
activations, ``torch._int_mm``). Perplexity on the first ``--tokens`` tokens of ``lee_background.cor``
in windows of 512; calibration on the ``--calib-windows`` x 512 tokens that follow them (default 16:
8192 tokens), so it never sees the evaluated text. ``--only`` picks rows by substring.
Size: bytes of the unique tensors of ``state_dict()`` (the tied embedding / lm_head counted once).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
import lowbit.data as D
from lowbit.nn.quantized import WeightOnlyLinear


def state_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages in ``model.state_dict()`` (tied tensors counted once)."""
    seen: dict[int, int] = {}
    for t in model.state_dict().values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def speed(quick: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    lin = nn.Linear(768, 2048)
    mods = {"int4_g128_kernel": WeightOnlyLinear.from_float(lin, 4, 128),
            "int4_g128_reference": WeightOnlyLinear.from_float(lin, 4, 128, kernel="reference"),
            "int8_per_channel": WeightOnlyLinear.from_float(lin, 8, -1)}
    out = {}
    for m in (1, 64):
        x = torch.randn(m, 768)
        methods = {"fp32": lambda x=x: lin(x), **{k: (lambda q=q, x=x: q(x)) for k, q in mods.items()}}
        t = common.bench(methods, rounds=3 if quick else 7)
        out[f"M={m}"] = t.summary(base="fp32")
        print(f"M={m}: " + ", ".join(f"{k} {v['ms']:.3f} ms ({v['speedup_vs_fp32']:.2f}x)"
                                      for k, v in out[f"M={m}"]["methods"].items())
              + f"  [clean rounds {t.n_clean}/{len(t.loads)}]", flush=True)
    return out


def llm(tokens: int, only: list[str] | None = None, calib_windows: int = 8) -> dict[str, Any]:
    tok, model = D.load_smollm2()
    bg, _, _ = D.load_lee_corpus()
    ids = torch.tensor(tok("\n".join(bg)).input_ids)
    ev, cal = ids[:tokens], ids[tokens : tokens + calib_windows * 512].reshape(calib_windows, 512)
    calib = [c[None] for c in cal]
    cw = f"calib {calib_windows}x512"
    wo, llm_ = Q.quantize_weight_only, Q.quantize_llm
    configs: dict[str, Any] = {
        "fp32": None,
        "int8 per-channel rtn": (wo, dict(bits=8, group_size=-1, method="rtn")),
        "int8 per-channel rtn + int8 tied head": (llm_, dict(bits=8, group_size=-1, method="rtn", awq=False, clip="rtn",
                                                             symmetric=True, calib=calib)),
        "int4 g128 rtn": (wo, dict(bits=4, group_size=128, method="rtn")),
        "int4 g128 mse": (wo, dict(bits=4, group_size=128, method="mse")),
        f"int4 g128 gptq act_order, float activations ({cw})": (wo, dict(bits=4, group_size=128, method="gptq",
                                                                        calib=calib)),
        f"int4 g128 quantize_llm default + int8 tied head ({cw})": (llm_, dict(calib=calib)),
        f"int4 g128 quantize_llm no awq + int8 tied head ({cw})": (llm_, dict(calib=calib, awq=False)),
        f"int4 g128 quantize_llm default + int4 tied head ({cw})": (llm_, dict(calib=calib, head="int4")),
        f"w8a8 dynamic per-token + smoothquant 0.5 ({cw})": (Q.quantize_w8a8, dict(calib=calib, alpha=0.5)),
        f"w8a8 dynamic per-token, no smoothing ({cw})": (Q.quantize_w8a8, dict(calib=calib, alpha=None)),
    }
    rows = {}
    for name, cfg in configs.items():
        if only and not any(o in name for o in only):
            continue
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qm = model if cfg is None else cfg[0](model, **cfg[1])
        tq = time.perf_counter() - t0
        t0 = time.perf_counter()
        ppl = D.perplexity(qm, ev, 512)
        rows[name] = {"ppl": ppl, "MB": state_bytes(qm) / 2**20, "quantize_s": tq,
                      "eval_s": time.perf_counter() - t0}
        print(f"{name:22s} ppl {ppl:7.3f}  size {rows[name]['MB']:7.1f} MB  quantize {tq:6.1f} s  "
              f"eval {rows[name]['eval_s']:6.1f} s", flush=True)
        del qm
    return {"tokens": tokens, "window": 512, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-llm", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--tokens", type=common.positive_int, default=8192)
    p.add_argument("--calib-windows", type=common.positive_int, default=16,
                   help="GPTQ calibration: this many 512-token windows")
    p.add_argument("--only", nargs="*", help="LLM configs whose name contains one of these (e.g. gptq fp32)")
    p.add_argument("--out", default="weight_only", help="results name (benchmarks/results/OUT.json; rows already "
                                                        "there are kept, the measured ones replaced)")
    a = p.parse_args()
    print(common.isa_line() + " | 1 thread", flush=True)
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    if not a.skip_speed:
        res["speed_1thread"] = speed(a.quick)
    if not a.skip_llm and D.smollm2_available():
        res["smollm2"] = llm(a.tokens, a.only, a.calib_windows)
    old = common.RESULTS / f"{a.out.removesuffix('.json')}.json"
    if old.is_file():  # a partial run (--only, --skip-*) updates the rows it measured
        prev = json.loads(old.read_text())
        prev.pop("machine", None)
        if "smollm2" in prev and "smollm2" in res:
            prev["smollm2"]["rows"].update(res.pop("smollm2")["rows"])
        prev.update(res)
        res = prev
    print(common.write_results(a.out, res))


if __name__ == "__main__":
    main()
