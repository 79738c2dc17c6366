"""End to end: SmallCNN (batch 64) and MiniLM (dynamic, batch 32), fp32 vs lowbit vs torch.ao.

Run: ``python benchmarks/e2e.py [--quick] [--threads 1 2] [--skip-smallcnn | --skip-minilm]`` (method: ``common.py``). Writes
``benchmarks/results/e2e.json``.

SmallCNN (``lowbit.examples``; trained ``--epochs`` on Fashion-MNIST when the data is there, else
random weights), fused conv-bn-relu, static PTQ calibrated on 512 images:
  fp32 | lowbit u8 (default recipe: 8-bit activations) | lowbit x86 qconfig (``get_default_qconfig("x86")``,
  torch.ao's x86 recipe: 7-bit ``reduce_range`` activations, as ``get_speed_qconfig(vnni=False)``) | lowbit
  u8 + speed guard (``convert(..., speed_check=batch)``) | torch.ao (x86
  engine, default qconfig: reduce_range 7-bit activations, on an identical torch.ao twin) | lowbit u8 with
  ``lowbit.native`` switched off (the same codes through torch ops; ``--skip-native-ab`` drops it).
  Accuracy: test-set top-1 (or agreement with fp32 on random weights).
MiniLM (``lowbit.data.load_minilm``, 50 Lee-corpus docs, batch 32, max 128 tokens), dynamic int8
Linear: fp32 | lowbit ``quantize_dynamic`` (per-token u8, the default) | lowbit 7-bit per token
(``get_dynamic_qconfig(reduce_range=True)``) | lowbit on torch.ao's x86 recipe (``get_dynamic_qconfig(backend="x86")``:
per-tensor u7, torch.ao's outputs bit for bit) | torch.ao ``quantize_dynamic`` | the two per-token recipes again
with ``lowbit.native`` switched off (its row passes as torch ops: the same outputs; ``--skip-native-ab`` drops
them). Accuracy: mean cosine of the sentence embeddings to fp32.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.ao.nn.quantized as aonnq
import torch.ao.quantization as aoq
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit import data as D
from lowbit import native
from lowbit.examples import SmallCNN, train

warnings.filterwarnings("ignore")


class AOSmallCNN(SmallCNN):
    """``SmallCNN`` with torch.ao stubs and FloatFunctional, for torch.ao eager quantization."""

    def __init__(self, src: SmallCNN) -> None:
        super().__init__()
        self.load_state_dict(src.state_dict())
        self.quant, self.dequant, self.skip = aoq.QuantStub(), aoq.DeQuantStub(), aonnq.FloatFunctional()


def cnn_data(quick: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, bool]:
    if D.fashion_mnist_available():
        xtr, ytr = D.load_fashion_mnist("train", limit=6000 if quick else 20000)
        xte, yte = D.load_fashion_mnist("test", limit=2000)
        return D.normalize_images(xtr), ytr, D.normalize_images(xte), yte, True
    g = torch.Generator().manual_seed(0)
    return torch.randn(2048, 1, 28, 28, generator=g), None, torch.randn(1024, 1, 28, 28, generator=g), None, False


def smallcnn(a: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    xtr, ytr, xte, yte, real = cnn_data(a.quick)
    model = SmallCNN()
    if real:
        torch.set_num_threads(max(a.threads))
        train(model, xtr, ytr, epochs=a.epochs, batch_size=128)
    model.eval()
    fused = Q.fuse_modules(model, SmallCNN.fusion_groups())
    calib = xtr[:512]

    def lowbit(qconfig: Q.QConfig, speed: bool = False) -> tuple[nn.Module, Any]:
        prep = Q.prepare(fused, qconfig)
        for i in range(0, len(calib), 128):
            prep(calib[i:i + 128])
        if speed:
            qm, rep = Q.convert(prep, return_report=True, speed_check=calib[:64])
            return qm, rep.speed
        return Q.convert(prep), None

    q8, _ = lowbit(Q.get_default_qconfig())
    q7, _ = lowbit(Q.get_default_qconfig("x86"))  # torch.ao's own x86 recipe: the like-for-like comparison
    torch.set_num_threads(1)
    qg, speed = lowbit(Q.get_default_qconfig(), speed=True)
    torch.backends.quantized.engine = "x86"
    ao = AOSmallCNN(model).eval()
    ao.qconfig = aoq.get_default_qconfig("x86")
    ao = aoq.fuse_modules(ao, SmallCNN.fusion_groups())
    aoq.prepare(ao, inplace=True)
    with torch.inference_mode():
        for i in range(0, len(calib), 128):
            ao(calib[i:i + 128])
    aoq.convert(ao, inplace=True)
    models = {"fp32": model, "lowbit u8": q8, "lowbit x86 qconfig (u7)": q7, "lowbit u8 + speed guard": qg,
              "torch.ao x86": ao}
    acc: dict[str, float] = {}
    with torch.inference_mode():
        ref = model(xte).argmax(1)
        for k, m in models.items():
            pred = m(xte).argmax(1)
            acc[k] = float((pred == (yte if real else ref)).float().mean())
    xb = xte[:64]
    meth: dict[str, Callable[[], Any]] = {k: (lambda m=m: m(xb)) for k, m in models.items()}
    if not a.skip_native_ab and native.available():  # the default recipe with its torch-op passes (the same codes)
        meth["lowbit u8, native off"] = lambda: _native_off_call(q8, xb)
    out: dict[str, Any] = {"real_data": real, "metric": "top1" if real else "agreement with fp32", "accuracy": acc,
                           "speed_guard": [vars(d) for d in speed.decisions] if speed is not None else None,
                           "speed_guard_table": str(speed), "runs": []}
    print(str(speed))
    print("accuracy", {k: round(v, 4) for k, v in acc.items()})
    for threads in a.threads:
        torch.set_num_threads(threads)
        t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
        s = t.summary("fp32")
        out["runs"].append({"threads": threads, **s})
        print(f"SmallCNN b64 t={threads} clean {t.n_clean}/{a.rounds} | "
              + " ".join(f"{k}={v['ms']:.1f}ms ({v['speedup_vs_fp32']:.2f}x)" for k, v in s["methods"].items()),
              flush=True)
    return out


def minilm(a: argparse.Namespace) -> dict[str, Any] | None:
    if not D.minilm_available():
        print("MiniLM: not installed, skipped")
        return None
    tok, model = D.load_minilm()
    try:
        docs = D.load_lee_corpus()[1]
    except ImportError:
        docs = [f"sentence number {i} about quantization of neural networks" for i in range(50)]
    batch = docs[:32]
    enc = tok(batch, padding=True, truncation=True, max_length=128, return_tensors="pt")
    lb = Q.quantize_dynamic(copy.deepcopy(model))
    lb7 = Q.quantize_dynamic(copy.deepcopy(model), {nn.Linear: Q.get_dynamic_qconfig(reduce_range=True)})
    lbx = Q.quantize_dynamic(copy.deepcopy(model), {nn.Linear: Q.get_dynamic_qconfig(backend="x86")})
    torch.backends.quantized.engine = "x86"
    ao = aoq.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    models = {"fp32": model, "lowbit dynamic": lb, "lowbit dynamic u7 (per token)": lb7,
              "lowbit dynamic x86 recipe (per tensor u7)": lbx, "torch.ao dynamic": ao}
    cos: dict[str, float] = {}
    ref = D.embed_sentences(tok, model, docs)
    for k, m in models.items():
        e = D.embed_sentences(tok, m, docs)
        cos[k] = float((e * ref).sum(1).mean())
    meth = {k: (lambda m=m: m(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]))
            for k, m in models.items()}
    if not a.skip_native_ab and native.available():  # the per-token recipes with their torch-op row passes
        for k, m in (("lowbit dynamic, native off", lb), ("lowbit dynamic u7, native off", lb7)):
            meth[k] = lambda m=m: _native_off(m, enc)
    out: dict[str, Any] = {"tokens": list(enc["input_ids"].shape), "cosine_to_fp32": cos, "runs": []}
    print("MiniLM cosine", {k: round(v, 4) for k, v in cos.items()})
    for threads in a.threads:
        torch.set_num_threads(threads)
        t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
        s = t.summary("fp32")
        out["runs"].append({"threads": threads, **s})
        print(f"MiniLM b32 t={threads} clean {t.n_clean}/{a.rounds} | "
              + " ".join(f"{k}={v['ms']:.1f}ms ({v['speedup_vs_fp32']:.2f}x)" for k, v in s["methods"].items()),
              flush=True)
    return out


def _native_off_call(model: nn.Module, x: torch.Tensor) -> Any:
    with native.disabled():
        return model(x)


def _native_off(model: nn.Module, enc: Any) -> Any:
    with native.disabled():
        return model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--epochs", type=common.positive_float, default=1.0)
    p.add_argument("--skip-minilm", action="store_true")
    p.add_argument("--skip-smallcnn", action="store_true")
    p.add_argument("--skip-native-ab", action="store_true", help="no columns with lowbit.native switched off")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.epochs = min(a.rounds, 3), min(a.epochs, 0.3)
    mach = common.machine()
    print(f"{mach.get('cpu', '?')} | ISA {mach.get('isa')} | torch {mach['torch']} | native: {mach.get('lowbit_native')} | "
          f"heap: {mach.get('heap')}")
    res = {"smallcnn": None if a.skip_smallcnn else smallcnn(a), "minilm": None if a.skip_minilm else minilm(a)}
    print(common.write_results(a.out or "e2e", res))


if __name__ == "__main__":
    main()
