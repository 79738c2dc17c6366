"""Per-option ablation of ``lowbit.quantize_llm`` on SmolLM2-135M int4: perplexity, file size, quantize time.

Run: ``python benchmarks/weight_only_ablation.py [--rows SUBSTR ...] [--calib-windows 16] [--tokens 8192]``
(1 thread). Each row quantizes the float model with one set of options and scores the perplexity of the
first ``--tokens`` tokens of ``lee_background.cor`` (windows of 512, as ``benchmarks/weight_only.py``);
calibration is ``--calib-windows`` windows of 512 tokens taken *after* the evaluated text, so the
evaluation never sees calibration text. Rows run one at a time and the JSON
(``benchmarks/results/weight_only_ablation.json``) is rewritten after each, so a long run can be polled
and resumed (rows already in the file are skipped unless ``--redo``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from weight_only import state_bytes

import lowbit as Q
import lowbit.data as D

D01 = dict(damp=0.01)
# name -> quantize_llm options (bits=4, the default group size, head="int8" unless given); "clip" picks each group's
# range: min/max ("rtn"), or the clipping search weighted by diag(XᵀX) ("hmse", plain mse without GPTQ)
ROWS: dict[str, dict[str, Any]] = {
    "rtn min/max": dict(method="rtn", clip="rtn", awq=False),
    "rtn + clip search": dict(method="rtn", clip="hmse", awq=False),
    "gptq + act-order + awq + float target, hmse clip, damp 0.01": dict(awq=True, clip="hmse", float_target=True,
                                                                        **D01),
    "gptq + act-order + awq + refine, min/max, damp 0.01": dict(awq=True, clip="rtn", refine=True, **D01),
    "gptq + act-order, min/max, damp 0.01": dict(awq=False, clip="rtn", **D01),
    "gptq + act-order + awq, hmse clip, damp 0.01": dict(awq=True, clip="hmse", **D01),
    "gptq + act-order + awq, min/max, damp 0.01": dict(awq=True, clip="rtn", **D01),
    "gptq + act-order + awq + refine, min/max, damp 0.01, int4 head": dict(awq=True, clip="rtn", refine=True,
                                                                          head="int4", **D01),
    "rtn + awq, min/max": dict(method="rtn", clip="rtn", awq=True),
    "gptq, min/max, damp 0.01": dict(awq=False, clip="rtn", act_order=False, **D01),
    "gptq + act-order + awq + refine, min/max, damp search (0.01, 0.03, 0.1)": dict(awq=True, clip="rtn",
                                                                                   refine=True),
}
CALIB_FREE = ("rtn min/max", "rtn + clip search")  # no activations used: the calibration set does not matter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", help="run the rows whose name contains one of these")
    p.add_argument("--tokens", type=common.positive_int, default=8192)
    p.add_argument("--calib-windows", type=common.positive_int, default=16)
    p.add_argument("--redo", action="store_true", help="rerun rows already in the results file")
    p.add_argument("--out", default="weight_only_ablation")
    a = p.parse_args()
    if a.rows and not any(r in name for name in ROWS for r in a.rows):
        p.error(f"--rows {' '.join(a.rows)}: no row name contains any of these; rows: {'; '.join(ROWS)}")
    print(common.isa_line() + " | 1 thread", flush=True)
    torch.set_num_threads(1)
    tok, model = D.load_smollm2()
    bg, _, _ = D.load_lee_corpus()
    ids = torch.tensor(tok("\n".join(bg)).input_ids)
    ev = ids[: a.tokens]
    cal = ids[a.tokens : a.tokens + a.calib_windows * 512]
    if cal.numel() < a.calib_windows * 512:
        raise ValueError(f"--calib-windows {a.calib_windows}: only {cal.numel()} tokens follow the evaluated text")
    calib = [c[None] for c in cal.reshape(a.calib_windows, 512)]
    path = common.RESULTS / f"{a.out.removesuffix('.json')}.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    res.pop("machine", None)
    res.update({"tokens": a.tokens, "window": 512, "fp32_ppl": res.get("fp32_ppl")})
    rows = res.setdefault("rows", {})
    if res["fp32_ppl"] is None:
        res["fp32_ppl"] = D.perplexity(model, ev, 512)
    print(f"fp32 ppl {res['fp32_ppl']:.3f}; calibration {a.calib_windows}x512 tokens after the first {a.tokens}",
          flush=True)
    for name, opts in ROWS.items():
        key = name if name in CALIB_FREE else f"{name} (calib {a.calib_windows}x512)"
        if (a.rows and not any(r in name for r in a.rows)) or (key in rows and not a.redo):
            continue
        kw = dict(bits=4, head="int8", progress=True, **opts)  # default group size: 128, 64 for 576 features
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qm = Q.quantize_llm(model, calib, **kw)
        tq = time.perf_counter() - t0
        ppl = D.perplexity(qm, ev, 512)
        rows[key] = {"ppl": ppl, "vs_fp32_pct": 100 * (ppl / res["fp32_ppl"] - 1), "MB": state_bytes(qm) / 2**20,
                     "quantize_s": tq, "cpu_s": time.process_time(), "options": {k: v for k, v in kw.items()
                                                                                   if k != "progress"}}
        print(f"{key:70s} ppl {ppl:7.3f} ({rows[key]['vs_fp32_pct']:+.2f} %)  {rows[key]['MB']:6.1f} MB  "
              f"quantize {tq:6.0f} s", flush=True)
        common.write_results(a.out, res)
        del qm
    print(common.md_table(["row", "ppl", "vs fp32 %", "MB", "quantize s"],
                          [[k, r["ppl"], r["vs_fp32_pct"], r["MB"], r["quantize_s"]] for k, r in rows.items()]))


if __name__ == "__main__":
    main()
