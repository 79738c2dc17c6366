"""Greedy generation speed of SmolLM2-135M: fp32 vs int8 vs int4 weight-only, eager and compiled.

Run: ``python benchmarks/generate.py [--batches 1 8] [--prompt 128] [--new 128] [--threads 1] [--no-compile]``.
Writes ``benchmarks/results/generate.json`` and prints the CPU's ISA.

Models: fp32 (as loaded); int8 = every Linear int8 per channel + the tied embedding/``lm_head`` int8 per
row; int4 = every block Linear int4 g128 (g64 where 576 features) + the head as in ``lowbit.quantize_llm``'s
default (int8 rows, tie kept). Speed does not depend on how the codes were chosen, so the weights are
rounded to nearest here (no calibration). Each model decodes ``--new`` tokens greedily
(``generate(do_sample=False, min_new_tokens=new)``) after a ``--prompt``-token prompt (``lee_background``
text, a different window per batch row). Per configuration: the prefill time (``max_new_tokens=1``), the
whole run, and from them the decode time per step ``(t_all - t_prefill) / (new - 1)`` and decode
tokens/s ``= batch / step``; the median of ``--rounds`` interleaved rounds. "compiled" wraps
a copy's ``model.forward`` in ``torch.compile(dynamic=True)`` (compile time reported as ``warmup_s``, not
counted; weight-only Linears are one opaque op there, ``torch.ops.lowbit.weight_only_linear``, so
compiling fuses the rest of the model, not the dequantization); its rows record whether the greedy
tokens equal eager's (``same_tokens_as_eager``) and the decode speed-up over eager. A kind that fails to
compile is reported with its error under ``errors``.
The weight bytes a decode step reads (``MB/token``) and the rate it implies are printed to show where
the time goes: at batch 1 decoding is bound by streaming the weights.
"""

from __future__ import annotations

import argparse
import copy
import statistics
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
from lowbit.llm import quantize_head


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameter/buffer storages (what one decode step streams, roughly)."""
    seen: dict[int, int] = {}
    for t in model.state_dict().values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def build(model: nn.Module, kind: str) -> nn.Module:
    if kind == "fp32":
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "int8":
            qm = Q.quantize_weight_only(model, bits=8, group_size=-1, method="rtn")
        else:
            qm = Q.quantize_weight_only(model, bits=4, method="rtn")
    return quantize_head(qm, bits=8)


LAST: list[torch.Tensor] = []  # the tokens of the latest gen_time call


def gen_time(model: nn.Module, ids: torch.Tensor, new: int) -> float:
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t
    if out.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} tokens, expected {new}")
    LAST[:] = [out]
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=common.positive_int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=common.positive_int, default=128)
    p.add_argument("--new", type=common.positive_int, default=128, help="tokens to decode (>= 2: a step is timed)")
    p.add_argument("--rounds", type=common.positive_int, default=3)
    p.add_argument("--threads", type=common.positive_int, default=1)
    p.add_argument("--kinds", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", default="generate", help="results file name (benchmarks/results/OUT.json)")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    a = p.parse_args()
    if a.new < 2:
        p.error(f"--new {a.new}: the decode step is (all - prefill) / (new - 1), so at least 2 tokens")
    torch.set_num_threads(a.threads)
    info = common.machine()
    print(f"CPU: {info.get('cpu')}  ISA: {info.get('isa')}  torch cpu capability: {info['cpu_capability']}  "
          f"threads: {a.threads}", flush=True)
    tok, base = D.load_smollm2()
    bg, _, _ = D.load_lee_corpus()
    ids = torch.tensor(tok("\n".join(bg)).input_ids)
    if max(a.batches) * a.prompt > ids.numel():
        p.error(f"--batches {max(a.batches)} x --prompt {a.prompt}: the prompts take distinct windows of the "
                f"{ids.numel()}-token lee_background text")
    models = {k: build(base, k) for k in a.kinds}
    modes = [m for m in a.modes if not (a.no_compile and m == "compiled")]
    rows: dict[str, Any] = {}
    errors: dict[str, str] = {}
    outs: dict[tuple[int, str, str], torch.Tensor] = {}  # (batch, kind, mode) -> generated tokens
    for mode in modes:
        runs: dict[str, nn.Module] = {}
        for k, m in models.items():
            if mode == "compiled":  # a fresh copy per kind, so no compiled graph is shared between kinds
                m = copy.deepcopy(m)
                m.forward = torch.compile(m.forward, dynamic=True)
            runs[k] = m
        for b in a.batches:
            prompt = torch.stack([ids[i * a.prompt:(i + 1) * a.prompt] for i in range(b)])  # (b, prompt)
            times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "all": []} for k in runs}
            compile_s: dict[str, float] = {}
            with torch.inference_mode():
                for k, m in list(runs.items()):  # warm-up (and compilation)
                    t = time.perf_counter()
                    try:
                        gen_time(m, prompt, 2)
                        gen_time(m, prompt, a.new)
                    except Exception as e:  # a kind that does not compile is reported, not fatal
                        errors[f"{mode} b={b} {k}"] = f"{type(e).__name__}: {str(e)[:300]}"
                        print(f"{mode} batch {b}: {k} failed: {errors[f'{mode} b={b} {k}']}", flush=True)
                        del runs[k]
                        continue
                    compile_s[k] = time.perf_counter() - t
                for r in common.round_bar(a.rounds, "generate rounds"):
                    for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                        times[k]["prefill"].append(gen_time(runs[k], prompt, 1))
                        times[k]["all"].append(gen_time(runs[k], prompt, a.new))
                        outs[(b, k, mode)] = LAST[0]
            for k in runs:
                pre, tot = statistics.median(times[k]["prefill"]), statistics.median(times[k]["all"])
                step = (tot - pre) / (a.new - 1)
                mb = weight_bytes(models[k]) / 2**20
                rows[f"{mode} b={b} {k}"] = {"prefill_s": pre, "total_s": tot, "decode_ms_per_step": step * 1e3,
                                             "decode_tok_s": b / step, "weights_MB": mb,
                                             "weights_GB_s_at_b1": mb / 1024 / step, "warmup_s": compile_s[k]}
                if mode == "compiled" and (b, k, "eager") in outs:  # does compiling change the greedy tokens?
                    rows[f"{mode} b={b} {k}"]["same_tokens_as_eager"] = torch.equal(outs[(b, k, mode)],
                                                                                    outs[(b, k, "eager")])
                if mode == "compiled" and f"eager b={b} {k}" in rows:
                    rows[f"{mode} b={b} {k}"]["speedup_vs_eager"] = (rows[f"eager b={b} {k}"]["decode_ms_per_step"]
                                                                     / (step * 1e3))
            base_rate = rows[f"{mode} b={b} fp32"]["decode_tok_s"] if "fp32" in runs else None
            for k in runs:
                row = rows[f"{mode} b={b} {k}"]
                if base_rate:
                    row["decode_speedup_vs_fp32"] = row["decode_tok_s"] / base_rate
                print(f"{mode:8s} batch {b}: {k:5s} decode {row['decode_tok_s']:7.1f} tok/s "
                      f"({row['decode_ms_per_step']:6.2f} ms/step, {row.get('decode_speedup_vs_fp32', 1):.2f}x fp32)  "
                      f"prefill {row['prefill_s'] * 1e3:7.1f} ms  weights {row['weights_MB']:6.1f} MB "
                      f"-> {row['weights_GB_s_at_b1']:5.1f} GB/s  warm-up {row['warmup_s']:.0f} s", flush=True)
    print(common.write_results(a.out, {"prompt": a.prompt, "new": a.new, "threads": a.threads, "rows": rows,
                                       "errors": errors}))


if __name__ == "__main__":
    main()
