"""The hardware's int8 advantage for a model, measured at the kernel: every Conv / Linear layer's raw int8 call
against the raw float32 call of the same shape, summed per model.

Run: ``python benchmarks/int8_advantage.py [--models smallcnn minilm] [--rounds 15]`` (1 thread; prints the ISA).
Also ``python benchmarks/compiled.py --kernels``.

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
MiniLM b32 4.12-4.17x at the kernels, model bound 3.08x.
"""

from __future__ import annotations

import argparse
import copy
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


def advantage(layers: list[tuple[str, nn.Module, torch.Size]], codes_out: bool, rounds: int,
              lowbit: dict[str, tuple[nn.Module, Any]] | None = None, whole: Callable[[], Any] | None = None,
              min_time: float = 0.002) -> dict[str, Any]:
    """Per layer and summed: median thread-time µs of the int8 and float32 calls (and of lowbit's converted layer,
    where ``lowbit`` has it), interleaved; ``whole``: the float32 model's call, timed in the same rounds (the model
    bound)."""
    calls = [(n, shape, *_pair(m, shape, codes_out)) for n, m, shape in layers]
    if whole is not None:  # (a pseudo-layer: its "int8" and "fp32" both the float32 model)
        calls.append(("<model>", torch.Size(), whole, whole))
    own = {n: (lambda m=m, q=q: m(q)) for n, (m, q) in (lowbit or {}).items()}
    reps = []
    with torch.inference_mode():
        for _, _, i8, f32 in calls:  # warm-up (first-call primitive creation) and a repeat count per layer
            for f in (i8, f32, i8, f32):
                f()
            t0 = time.perf_counter()
            f32()
            reps.append(max(1, int(min_time / max(time.perf_counter() - t0, 1e-7))))
        t: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            for (name, _, i8, f32), n in zip(calls, reps, strict=True):
                kinds = [("int8", i8), ("fp32", f32)] + ([("lowbit", own[name])] if name in own else [])
                for kind, f in kinds if r % 2 == 0 else kinds[::-1]:
                    t0 = time.thread_time_ns()
                    for _ in range(n):
                        f()
                    t.setdefault((name, kind), []).append((time.thread_time_ns() - t0) / n / 1e3)
    rows = []
    model = statistics.median(t.pop(("<model>", "int8")) + t.pop(("<model>", "fp32"))) if whole is not None else None
    for name, shape, _, _ in calls[:len(layers)]:
        dnn, f32 = statistics.median(t[(name, "int8")]), statistics.median(t[(name, "fp32")])
        lb = statistics.median(t[(name, "lowbit")]) if name in own else None
        i8 = dnn if lb is None else min(dnn, lb)
        rows.append({"layer": name, "input": list(shape), "onednn_us": dnn, "lowbit_layer_us": lb, "int8_us": i8,
                     "fp32_us": f32, "ratio": f32 / i8})
    s8, s32 = sum(r["int8_us"] for r in rows), sum(r["fp32_us"] for r in rows)
    out = {"layers": rows, "int8_us": s8, "fp32_us": s32, "ratio": s32 / s8}
    if model is not None:
        out.update(fp32_compiled_model_us=model, model_bound=model / (model - s32 + s8))
    return out


def _smallcnn_lowbit(fp: nn.Module, x: torch.Tensor) -> dict[str, tuple[nn.Module, Any]]:
    """SmallCNN converted as ``compiled.py`` converts it (fused, default qconfig, two random calibration batches)."""
    lb = Q.prepare(Q.fuse_modules(copy.deepcopy(fp).eval(), SmallCNN.fusion_groups()), Q.get_default_qconfig())
    with torch.inference_mode():
        for _ in range(2):
            lb(torch.randn(128, 1, 28, 28))
    return quantized_inputs(Q.convert(lb), x)


def _compiled_call(model: nn.Module, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    c = torch.compile(model, dynamic=False)
    with torch.inference_mode():
        c(*args, **kwargs)
    return lambda: c(*args, **kwargs)


Model = tuple[list[tuple[str, nn.Module, torch.Size]], bool, Any, Callable[[], Any]]


def models(names: list[str]) -> dict[str, Model]:
    """``{label: (layers with input shapes, static, lowbit's converted layers or None, the float32 model compiled)}``
    of the benchmark's models."""
    out: dict[str, Model] = {}
    if "smallcnn" in names:
        torch.manual_seed(0)
        fp, x = SmallCNN().eval(), torch.randn(64, 1, 28, 28)
        out["SmallCNN b64 static"] = (layer_inputs(fp, x), True, _smallcnn_lowbit(fp, x), _compiled_call(fp, x))
    if "minilm" in names and D.minilm_available():
        tok, model = D.load_minilm()
        docs = [f"sentence number {i} about the quantization of neural networks on CPUs" for i in range(32)]
        enc = tok(docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
        kw = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        out["MiniLM b32 dynamic"] = (layer_inputs(model.eval(), **kw), False, None, _compiled_call(model, **kw))
    return out


def report(names: list[str], rounds: int) -> dict[str, Any]:
    """Measure and print each model's kernel-level int8 : float32 ratio (1 thread)."""
    torch.set_num_threads(1)
    res = {}
    for label, (layers, static, own, whole) in models(names).items():
        r = res[label] = advantage(layers, static, rounds, own, whole)
        print(f"{label}: {len(layers)} layers, int8 kernels {r['int8_us']:.0f} us, fp32 kernels {r['fp32_us']:.0f} us "
              f"-> kernel-level int8 advantage {r['ratio']:.2f}x (1 thread); fp32 compiled model "
              f"{r['fp32_compiled_model_us']:.0f} us -> model bound {r['model_bound']:.2f}x")
        for row in r["layers"]:
            lb = "" if row["lowbit_layer_us"] is None else f" (oneDNN {row['onednn_us']:.1f}, lowbit layer " \
                                                            f"{row['lowbit_layer_us']:.1f})"
            print(f"    {row['layer']:40s} {str(tuple(row['input'])):22s} int8 {row['int8_us']:8.1f} us  "
                  f"fp32 {row['fp32_us']:8.1f} us  {row['ratio']:.2f}x{lb}")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["smallcnn", "minilm"], choices=["smallcnn", "minilm"])
    p.add_argument("--rounds", type=common.positive_int, default=15)
    a = p.parse_args()
    print(common.isa_line(), flush=True)
    print(common.write_results("int8_advantage", report(a.models, a.rounds)))


if __name__ == "__main__":
    main()
