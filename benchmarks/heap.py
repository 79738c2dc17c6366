"""Page faults per forward with glibc's defaults and with ``lowbit.keep_freed_memory()``, fresh processes.

Run: ``python benchmarks/heap.py [--threads 1 2] [--runs 2] [--forwards 5]`` (prints the ISA first). Writes
``benchmarks/results/heap.json``.

Each measurement is a new interpreter (glibc's adaptive mmap / trim thresholds depend on everything the process
allocated before, so an in-process A/B would measure history, not the setting): it builds MiniLM (``lowbit.data``,
batch 32 of the Lee corpus, 128 tokens, as ``e2e.py``) as lowbit's dynamic int8 model and torch.ao's, runs one
warm-up forward each, then ``--forwards`` forwards of each model alternating, and reports the median ms and the
minor page faults per forward (``getrusage``) of each. The settings alternate between runs. Both models gain alike:
the lowbit / torch.ao ratio is not what this measures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

_CHILD = r"""
import copy, json, resource, statistics, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
threads, keep, forwards = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
torch.set_num_threads(threads)
import lowbit as Q, lowbit.data as D
import torch.ao.quantization as aoq
applied = Q.keep_freed_memory() if keep else False
tok, model = D.load_minilm()
docs = D.load_lee_corpus()[1][:32]
enc = tok(docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
kw = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
torch.backends.quantized.engine = "x86"
models = {"lowbit dynamic": Q.quantize_dynamic(copy.deepcopy(model)),
          "torch.ao dynamic": aoq.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)}
ms = {k: [] for k in models}
faults = {k: 0 for k in models}
with torch.inference_mode():
    for m in models.values():
        m(**kw)
    for _ in range(forwards):
        for name, m in models.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            m(**kw)
            ms[name].append((time.perf_counter() - t) * 1e3)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"applied": applied, "tokens": list(enc["input_ids"].shape),
                  "ms": {k: statistics.median(v) for k, v in ms.items()},
                  "faults": {k: v / forwards for k, v in faults.items()},
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=common.positive_int, nargs="+", default=[1, 2])
    p.add_argument("--runs", type=common.positive_int, default=2, help="fresh processes per setting and thread count")
    p.add_argument("--forwards", type=common.positive_int, default=5)
    p.add_argument("--out", default=None, help="results name (default: heap)")
    a = p.parse_args()
    mach = common.machine()
    print(f"{mach.get('cpu', '?')} | ISA {mach.get('isa')} | torch {mach['torch']}", flush=True)
    jobs = [(t, keep) for t in a.threads for _ in range(a.runs) for keep in (False, True)]
    rows = []
    for threads, keep in tqdm(jobs, desc="fresh processes", file=sys.stdout):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(threads), "1" if keep else "0", str(a.forwards)],
                             capture_output=True, text=True, check=True)
        r = {"threads": threads, "keep_freed_memory": keep, **json.loads(out.stdout.strip().splitlines()[-1])}
        rows.append(r)
        tqdm.write(f"t={threads} {'kept   ' if keep else 'default'} | " + " | ".join(
            f"{k} {r['ms'][k]:.1f} ms, {r['faults'][k]:.0f} faults" for k in r["ms"]) + f" | maxrss {r['maxrss_mb']} MB")
    print(common.write_results(a.out or "heap", {"runs": rows}))


if __name__ == "__main__":
    main()
