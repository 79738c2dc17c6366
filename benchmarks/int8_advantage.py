"""The hardware's int8 advantage for a model, measured at the kernel: every Conv / Linear layer's raw int8 call
against the raw float32 call of the same shape, summed per model.

Run: ``python benchmarks/int8_advantage.py [--models smallcnn minilm] [--rounds 15] [--threads 1 2] [--compiled]
[--caller-cpu]``
(prints the ISA and the load average). Also ``python benchmarks/compiled.py --kernels`` (at its ``--threads``).
``--threads``: every count in every round (``torch.set_num_threads``), a table per count; the clock is this thread's
CPU time at 1 thread and wall time past it (see ``advantage``), so on a shared machine trust the paired ratios only and
rerun quietly. ``--compiled``: lowbit's model compiled (``compiled.py``'s fullgraph) timed in the same rounds, its
``compiled / fp32 compiled`` ratio printed next to the advantage (the median of the per-round ratios).

Per layer, with its input shape recorded from the float model on the benchmark's batch (SmallCNN b64 on
28 × 28, MiniLM b32 on ``compiled.py``'s 32 sentences):

- int8: oneDNN's op with the weight packed for that input (``onednn.qconv_prepack`` / ``qlinear_prepack``), u8 codes
  in; a static layer gives u8 codes out (requantized in the epilogue), a dynamic one (MiniLM) float32 out; no
  quantize / dequantize / layout glue, no Python around it;
- float32: ``F.conv2d`` on a channels-last input (oneDNN) / ``F.linear`` (MKL);
- for SmallCNN also lowbit's own converted layer on its recorded QTensor input (its kernel choice: the native small
  conv and VNNI GEMMs where oneDNN's per-call primitive costs more than the layer; its Python included, ~10-20 µs):
  the model's int8 sum takes the faster of the two per layer.

Both timed interleaved in the same rounds with ``time.thread_time_ns`` (median per layer), and the model's ratio is
``Σ fp32 / Σ int8`` over its layers: the most an int8 model can gain over float32 on this CPU for these layers, to set
against ``lowbit compiled / fp32 compiled`` (what the whole program gains, with the glue, pooling, activations and
the per-call costs). Pooling, adds, LayerNorm, attention's batched matmuls and softmax are not in either sum; the
model bound ``T / (T - Σ fp32 + Σ int8)``, with ``T`` the float32 model compiled (``torch.compile``, timed in the
same rounds), is what the whole program could gain if only these layers went int8 and the rest cost what it costs
in float32 (Amdahl): a ceiling for MiniLM, whose rest (attention, LayerNorm, GELU) stays float32; not for SmallCNN,
whose rest (pooling, ReLU, the residual add) runs on 1-byte codes in the int8 model and is faster there too.

Measured (session 48, Xeon AVX-512 VNNI + AMX, shared 2 vCPUs, 1 thread): SmallCNN b64 2.60-2.82x at the kernels;
MiniLM b32 4.12-4.17x at the kernels, model bound 3.08x. At 2 threads (session 49) see benchmarks/README.md: taken
with 3-5 other processes on the 2 vCPUs, so only a quiet rerun gives the figures.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit import data as D
from lowbit.examples import SmallCNN


def layer_inputs(model: nn.Module, *args: Any, **kwargs: Any) -> list[tuple[str, nn.Module, torch.Size]]:
    """``(name, layer, input shape)`` of every ``nn.Conv2d`` / ``nn.Linear`` call of ``model(*args, **kwargs)``."""
    seen: list[tuple[str, nn.Module, torch.Size]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, inp, n=n: seen.append((n, mod, inp[0].shape)))
             for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.inference_mode():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def quantized_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[nn.Module, Any]]:
    """``{name: (converted layer, its QTensor input)}`` of the lowbit-converted ``model(x)``'s Conv / Linear layers."""
    seen: dict[str, tuple[nn.Module, Any]] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, inp, n=n: None if n in seen else seen.update({n: (mod, inp[0])}))
             for n, m in model.named_modules() if hasattr(m, "weight_int8")]
    try:
        with torch.inference_mode():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _pair(layer: nn.Module, shape: torch.Size, codes_out: bool) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(int8 call, float32 call)`` of ``layer`` on an input of ``shape`` (random data, per-channel weight grid)."""
    w = layer.weight.detach().float()
    bias = None if layer.bias is None else layer.bias.detach().float()
    w_scale = (w.flatten(1).abs().amax(1).clamp(min=1e-8) / 127).double().float()
    w_q = torch.clamp(torch.round(w / w_scale.view(-1, *[1] * (w.dim() - 1))), -128, 127).to(torch.int8)
    w_zp = torch.zeros(w.shape[0], dtype=torch.int64)
    s_out, z_out, dt = (0.05, 128, torch.uint8) if codes_out else (1.0, 0, torch.float32)
    if isinstance(layer, nn.Conv2d):
        x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        q = torch.randint(0, 256, shape, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        geo = (list(layer.stride), list(layer.padding), list(layer.dilation), layer.groups)
        packed = torch.ops.onednn.qconv_prepack(w_q, w_scale, 1.0, 128, *geo, list(shape))

        def int8() -> Any:
            return torch.ops.onednn.qconv_pointwise(q, 0.02, 128, packed, w_scale, w_zp, bias, *geo, s_out, z_out, dt,
                                                    "none", [], "")

        def fp32() -> Any:
            return F.conv2d(x, w, bias, layer.stride, layer.padding, layer.dilation, layer.groups)
        return int8, fp32
    rows = shape.numel() // shape[-1]
    x = torch.randn(rows, shape[-1])
    q = torch.randint(0, 256, (rows, shape[-1]), dtype=torch.uint8)
    packed = torch.ops.onednn.qlinear_prepack(w_q, None)
    return (lambda: torch.ops.onednn.qlinear_pointwise(q, 0.02, 128, packed, w_scale, w_zp, bias, s_out, z_out, dt,
                                                        "none", [], ""),
            lambda: F.linear(x, w, bias))


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)


PerCount = Callable[[], Any] | dict[int, Callable[[], Any]]


def _at_count(f: PerCount) -> Callable[[], Any]:
    """``f``, or of a ``{thread count: call}`` the call of the current count."""
    return (lambda: f[torch.get_num_threads()]()) if isinstance(f, dict) else f


def advantage(layers: list[tuple[str, nn.Module, torch.Size]], codes_out: bool, rounds: int,
              lowbit: dict[str, tuple[nn.Module, Any]] | None = None, whole: PerCount | None = None,
              min_time: float = 0.002, threads: tuple[int, ...] = (1,),
              compiled: PerCount | None = None, caller_cpu: bool = False) -> dict[int, dict[str, Any]]:
    """Per thread count, per layer and summed: median µs of the int8 and float32 calls (and of lowbit's converted
    layer, where ``lowbit`` has it), interleaved; ``whole``: the float32 model's call, timed in the same rounds (the
    model bound); ``compiled``: lowbit's model compiled, timed in the same rounds (``compiled / fp32 compiled``, the
    median of the per-round ratios). Either may be ``{thread count: call}``: each count's call then runs at its count
    (a model compiled at that count: inductor's C++ kernels take the count they are compiled at).

    Each round runs every thread count in turn (``torch.set_num_threads``), so the counts share the machine's load.
    Clock: this thread's CPU time (``time.thread_time_ns``) at 1 thread, as before; wall time past 1 (the other
    threads' work is not this thread's CPU time), so on a shared machine the figures past 1 thread carry the other
    processes' load (``other_load``: their CPUs, median over the rounds) and only the paired ratios are to be trusted.
    ``caller_cpu``: this thread's CPU time at every count, a proxy for a quiet machine's wall time that the other
    processes barely move, meaningful with ``OMP_WAIT_POLICY=PASSIVE`` (else the pool's spin-waits count): a step
    split evenly over 2 threads shows about half its 1-thread time, one run on the calling thread all of it.
    ``wall_us`` (every count) gives the scaling: ``int8_scaling`` / ``fp32_scaling`` = the 1-thread wall sum over
    this count's."""
    calls = [(n, shape, *_pair(m, shape, codes_out)) for n, m, shape in layers]
    if whole is not None:  # (a pseudo-layer: its "int8" and "fp32" both the float32 model)
        calls.append(("<model>", torch.Size(), _at_count(whole), _at_count(whole)))
    own = {n: (lambda m=m, q=q: m(q)) for n, (m, q) in (lowbit or {}).items()}
    if compiled is not None:
        own["<model>"] = _at_count(compiled)
    reps: list[int] = []
    t: dict[tuple[int, str, str], list[float]] = {}  # (threads, layer, kind): thread-time µs (1 thread) / wall µs
    wall: dict[tuple[int, str, str], list[float]] = {}
    loads: dict[int, list[float]] = {n: [] for n in threads}
    meter = common.LoadMeter()
    with torch.inference_mode():
        for nt in threads:  # warm-up at every count (oneDNN makes its primitives per thread count)
            _set_threads(nt)
            for name, _, i8, f32 in calls:
                for f in (i8, f32, i8, f32) + ((own[name], own[name]) if name in own else ()):
                    f()
        _set_threads(threads[0])
        for _, _, _, f32 in calls:  # a repeat count per layer, at the first count
            t0 = time.perf_counter()
            f32()
            reps.append(max(1, int(min_time / max(time.perf_counter() - t0, 1e-7))))
        for r in range(rounds):
            for nt in threads if r % 2 == 0 else threads[::-1]:
                _set_threads(nt)
                for f in calls[0][2:]:  # (untimed: the first parallel region after a switch of the count costs up to
                    f()                 # ~1 ms on a loaded machine, which would land on the first layer)
                meter.start()
                for (name, _, i8, f32), n in zip(calls, reps, strict=True):
                    kinds = [("int8", i8), ("fp32", f32)] + ([("lowbit", own[name])] if name in own else [])
                    for kind, f in kinds if r % 2 == 0 else kinds[::-1]:
                        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                        for _ in range(n):
                            f()
                        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                        wall.setdefault((nt, name, kind), []).append((w1 - w0) / n / 1e3)
                        t.setdefault((nt, name, kind), []).append(((c1 - c0) if nt == 1 or caller_cpu else (w1 - w0))
                                                                  / n / 1e3)
                loads[nt].append(meter.stop())
    _set_threads(threads[0])
    return {nt: _summary(t, wall, nt, threads[0], calls[:len(layers)], own, whole is not None, compiled is not None,
                         loads[nt], caller_cpu) for nt in threads}


def _summary(t: dict[tuple[int, str, str], list[float]], wall: dict[tuple[int, str, str], list[float]], nt: int,
             base: int, calls: list[Any], own: dict[str, Any], has_model: bool, has_compiled: bool,
             loads: list[float], caller_cpu: bool = False) -> dict[str, Any]:
    med = statistics.median
    rows = []
    for name, shape, _, _ in calls:
        dnn, f32 = med(t[(nt, name, "int8")]), med(t[(nt, name, "fp32")])
        lb = med(t[(nt, name, "lowbit")]) if name in own else None
        i8 = dnn if lb is None else min(dnn, lb)
        rows.append({"layer": name, "input": list(shape), "onednn_us": dnn, "lowbit_layer_us": lb, "int8_us": i8,
                     "fp32_us": f32, "ratio": f32 / i8})
    s8, s32 = sum(r["int8_us"] for r in rows), sum(r["fp32_us"] for r in rows)
    clock = "thread time" if nt == 1 else "caller's CPU time" if caller_cpu else "wall"
    out: dict[str, Any] = {"threads": nt, "clock": clock, "layers": rows,
                           "int8_us": s8, "fp32_us": s32, "ratio": s32 / s8,
                           "other_load": med(loads) if loads else None}

    def wall_sum(n: int, kind: str) -> float:  # the int8 sum takes the faster of oneDNN and lowbit's layer, as above
        total = 0.0
        for name, *_ in calls:
            v = med(wall[(n, name, "int8")]) if kind == "int8" else med(wall[(n, name, "fp32")])
            if kind == "int8" and name in own:
                v = min(v, med(wall[(n, name, "lowbit")]))
            total += v
        return total
    out["wall_int8_us"], out["wall_fp32_us"] = wall_sum(nt, "int8"), wall_sum(nt, "fp32")
    if nt != base:
        out["int8_scaling"] = wall_sum(base, "int8") / out["wall_int8_us"]
        out["fp32_scaling"] = wall_sum(base, "fp32") / out["wall_fp32_us"]
    if has_model:
        model = med(t[(nt, "<model>", "int8")] + t[(nt, "<model>", "fp32")])
        out.update(fp32_compiled_model_us=model, model_bound=model / (model - s32 + s8))
        if has_compiled:
            mine = t[(nt, "<model>", "lowbit")]
            pair = [(a + b) / 2 / c for a, b, c in zip(t[(nt, "<model>", "int8")], t[(nt, "<model>", "fp32")], mine,
                                                       strict=True)]
            out.update(lowbit_compiled_model_us=med(mine), compiled_ratio=med(pair))
    return out


def _smallcnn_lowbit(fp: nn.Module) -> nn.Module:
    """SmallCNN converted as ``compiled.py`` converts it (fused, default qconfig, two random calibration batches)."""
    lb = Q.prepare(Q.fuse_modules(copy.deepcopy(fp).eval(), SmallCNN.fusion_groups()), Q.get_default_qconfig())
    with torch.inference_mode():
        for _ in range(2):
            lb(torch.randn(128, 1, 28, 28))
    return Q.convert(lb)


def _compiled_call(model: nn.Module, *args: Any, fullgraph: bool = False, **kwargs: Any) -> Callable[[], Any]:
    """A copy of ``model`` compiled at the current thread count (a copy: dynamo does not guard on the count, so the
    same module compiled again would reuse its first code) and warmed up."""
    c = torch.compile(copy.deepcopy(model), dynamic=False, fullgraph=fullgraph)
    with torch.inference_mode():
        c(*args, **kwargs)
    return lambda: c(*args, **kwargs)


# (layers with input shapes, static, lowbit's converted layers or None, builders of the float32 model compiled and of
# the lowbit model compiled as compiled.py compiles it: each compiles at the current thread count)
Model = tuple[list[tuple[str, nn.Module, torch.Size]], bool, Any, Callable[[], Callable[[], Any]],
              Callable[[], Callable[[], Any]]]


def models(names: list[str]) -> dict[str, Model]:
    """``{label: Model}`` of the benchmark's models (see ``Model``)."""
    out: dict[str, Model] = {}
    if "smallcnn" in names:
        torch.manual_seed(0)
        fp, x = SmallCNN().eval(), torch.randn(64, 1, 28, 28)
        lb = _smallcnn_lowbit(fp)
        out["SmallCNN b64 static"] = (layer_inputs(fp, x), True, quantized_inputs(lb, x), lambda: _compiled_call(fp, x),
                                      lambda: _compiled_call(lb, x, fullgraph=True))
    if "minilm" in names and D.minilm_available():
        tok, model = D.load_minilm()
        docs = [f"sentence number {i} about the quantization of neural networks on CPUs" for i in range(32)]
        enc = tok(docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
        kw = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        qm = Q.quantize_dynamic(copy.deepcopy(model))
        out["MiniLM b32 dynamic"] = (layer_inputs(model.eval(), **kw), False, None, lambda: _compiled_call(model, **kw),
                                     lambda: _compiled_call(qm, fullgraph=True, **kw))
    return out


def report(names: list[str], rounds: int, threads: tuple[int, ...] = (1,), compiled: bool = False,
           caller_cpu: bool = False) -> dict[str, Any]:
    """Measure and print each model's kernel-level int8 : float32 ratio at each thread count (``compiled``: also
    lowbit's model compiled against the float32 model compiled, in the same rounds)."""
    res: dict[str, Any] = {}
    for label, (layers, static, own, fp32_build, build) in models(names).items():
        whole, mine = {}, {}
        for nt in threads:  # each compiled at the count it runs at
            _set_threads(nt)
            whole[nt] = fp32_build()
            if compiled:
                mine[nt] = build()
        _set_threads(threads[0])
        per = advantage(layers, static, rounds, own, whole, threads=threads, compiled=mine if compiled else None,
                        caller_cpu=caller_cpu)
        res[label] = {str(nt): r for nt, r in per.items()}
        for nt, r in per.items():
            scale = "" if "int8_scaling" not in r else \
                f"; {threads[0]} -> {nt} threads (wall): int8 kernels {r['int8_scaling']:.2f}x, fp32 kernels " \
                f"{r['fp32_scaling']:.2f}x"
            comp = "" if "compiled_ratio" not in r else \
                f"; lowbit compiled {r['lowbit_compiled_model_us']:.0f} us -> compiled / fp32 compiled " \
                f"{r['compiled_ratio']:.2f}x"
            print(f"{label}, {nt} thread(s) ({r['clock']}, other load {r['other_load']:.2f} CPUs): {len(layers)} layers, "
                  f"int8 kernels {r['int8_us']:.0f} us, fp32 kernels {r['fp32_us']:.0f} us -> kernel-level int8 advantage "
                  f"{r['ratio']:.2f}x; fp32 compiled model {r['fp32_compiled_model_us']:.0f} us -> model bound "
                  f"{r['model_bound']:.2f}x{comp}{scale}")
        for row in zip(*(per[nt]["layers"] for nt in threads), strict=True):
            cells = []
            for nt, c in zip(threads, row, strict=True):
                lb = "" if c["lowbit_layer_us"] is None else f" (oneDNN {c['onednn_us']:.1f}, lowbit {c['lowbit_layer_us']:.1f})"
                cells.append(f"t{nt}: int8 {c['int8_us']:7.1f} fp32 {c['fp32_us']:7.1f} {c['ratio']:.2f}x{lb}")
            print(f"    {row[0]['layer']:32s} {str(tuple(row[0]['input'])):20s} " + " | ".join(cells))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["smallcnn", "minilm"], choices=["smallcnn", "minilm"])
    p.add_argument("--rounds", type=common.positive_int, default=15)
    p.add_argument("--threads", type=common.positive_int, nargs="+", default=[1],
                   help="thread counts, each timed in every round (1: thread time; more: wall time)")
    p.add_argument("--compiled", action="store_true",
                   help="also time lowbit's model compiled (compiled.py's fullgraph) in the same rounds")
    p.add_argument("--caller-cpu", action="store_true",
                   help="the calling thread's CPU time at every count (run with OMP_WAIT_POLICY=PASSIVE): a proxy for "
                        "quiet wall time on a loaded machine")
    p.add_argument("--out", default="int8_advantage", help="results name")
    a = p.parse_args()
    print(common.isa_line(), f"| threads {a.threads} | load average {os.getloadavg()[0]:.2f}", flush=True)
    print(common.write_results(a.out, report(a.models, a.rounds, tuple(a.threads), a.compiled, a.caller_cpu)))


if __name__ == "__main__":
    main()
