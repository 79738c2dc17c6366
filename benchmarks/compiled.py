"""Eager vs ``torch.compile``: lowbit eager | lowbit compiled | torch.ao | fp32 | fp32 compiled, interleaved.

Run: ``python benchmarks/compiled.py [--quick] [--threads 1 2] [--cases linear conv smallcnn smallcnn-x86 minilm
mobilenetv2 mobilenetv2-x86] [--cosine] [--kernels]`` (``--cosine``: MiniLM's embedding cosine to fp32 per recipe, eager
and compiled, as ``e2e.py`` measures it; ``--kernels``: SmallCNN's and MiniLM's kernel-level int8 : fp32 ratio,
``int8_advantage.py``, the bar for ``compiled / fp32 compiled``)
(method: ``common.py``; prints the ISA first). Writes ``benchmarks/results/compiled.json``.

Every method is a whole float-in/float-out model built by the public workflows:

- linear: ``QuantStub → Linear → DeQuantStub`` (static, default qconfig: 8-bit activations) and
  ``quantize_dynamic`` of an ``nn.Linear`` (per-token), M × K × N in ``SHAPES``;
- conv: ``QuantStub → Conv2d 3×3 64→64 (+ReLU) → DeQuantStub`` on 8 × 64 × 56 × 56, channels-last input;
- smallcnn: ``lowbit.examples.SmallCNN`` (random weights, fused, batch 64), static (smallcnn-x86: lowbit on
  torch.ao's own x86 recipe ``get_default_qconfig("x86")``, 7-bit activations, like its torch.ao twin);
- minilm: MiniLM sentence encoder (``lowbit.data.load_minilm``, if installed), dynamic, batch 32: the default
  (per-token u8) and, interleaved with it, ``MINILM_RECIPES`` (per-token 7-bit, torch.ao's x86 recipe);
- mobilenetv2: a MobileNetV2 (torchvision's layout, ReLU instead of ReLU6 as in torchvision's
  quantizable variant, random weights, 1000 classes) static, batch 8 at 224 × 224 (mobilenetv2-x86: lowbit on
  torch.ao's x86 recipe, as smallcnn-x86).

torch.ao twins use the x86 engine and its default qconfigs (reduce_range 7-bit activations) on the
same float weights; ``lowbit compiled`` is ``torch.compile(model, fullgraph=True)`` (the int8 steps
are ``torch.ops.lowbit`` custom ops, bit-identical to eager; float glue such as MiniLM's attention is
fused by inductor and may differ in the last bits: checked before timing, printed). Each case is built and compiled
at each ``--threads`` count before it is timed there: inductor's C++ kernels keep the count they were compiled at
(compiled at 1 they have no parallel region, compiled at 2 they run 2 threads at any count), for lowbit and fp32 alike.
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
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit import data as D
from lowbit.examples import SmallCNN

warnings.filterwarnings("ignore")
SHAPES = [(16, 768, 768), (128, 768, 3072), (512, 4096, 4096)]
# MiniLM's other dynamic recipes, timed next to the default (per-token u8): per-token 7-bit, torch.ao's x86 recipe
MINILM_RECIPES: dict[str, dict[str, Any]] = {"u7 per token": {"reduce_range": True}, "x86 recipe": {"backend": "x86"}}
CASES = ("linear", "conv", "smallcnn", "smallcnn-x86", "minilm", "mobilenetv2", "mobilenetv2-x86")


class _Stubs:
    """The stub/functional classes of one toolkit (lowbit's or torch.ao's)."""

    def __init__(self, ao: bool) -> None:
        self.QuantStub = aoq.QuantStub if ao else Q.QuantStub
        self.DeQuantStub = aoq.DeQuantStub if ao else Q.DeQuantStub
        self.FloatFunctional = aonnq.FloatFunctional if ao else Q.nn.quantized.FloatFunctional


def _wrapped(layer: nn.Module, ao: bool, relu: bool = False) -> nn.Module:
    st = _Stubs(ao)
    mods = [st.QuantStub(), copy.deepcopy(layer)] + ([nn.ReLU()] if relu else []) + [st.DeQuantStub()]
    return nn.Sequential(*mods).eval()


def _cbr(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int, st: _Stubs) -> None:
        super().__init__()
        hidden = cin * expand
        layers = ([_cbr(cin, hidden, 1)] if expand != 1 else []) + [
            _cbr(hidden, hidden, 3, stride, groups=hidden), _cbr(hidden, cout, 1, relu=False)]
        self.conv = nn.Sequential(*layers)
        self.use_res = stride == 1 and cin == cout
        self.skip = st.FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip.add(x, self.conv(x)) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 1.0 (torchvision's layer layout and key names; ReLU for ReLU6, with quant stubs)."""

    CFG = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, ao: bool = False, num_classes: int = 1000) -> None:
        super().__init__()
        st = _Stubs(ao)
        feats: list[nn.Module] = [_cbr(3, 32, 3, 2)]
        cin = 32
        for t, c, n, s in self.CFG:
            for i in range(n):
                feats.append(_InvertedResidual(cin, c, s if i == 0 else 1, t, st))
                cin = c
        feats.append(_cbr(cin, 1280, 1))
        self.features = nn.Sequential(*feats)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))
        self.quant, self.dequant = st.QuantStub(), st.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(self.quant(x)))
        return self.dequant(self.classifier(torch.flatten(x, 1)))

    def fusion_groups(self) -> list[list[str]]:
        groups = []
        for name, m in self.named_modules():
            if isinstance(m, nn.Sequential) and len(m) in (2, 3) and isinstance(m[0], nn.Conv2d):
                groups.append([f"{name}.{i}" for i in range(len(m))])
        return groups


def _static_pair(fp32: nn.Module, fp32_ao: nn.Module, calib: list[torch.Tensor],
                 groups: list[list[str]] | None = None, backend: str | None = None) -> tuple[nn.Module, nn.Module]:
    """(lowbit converted, torch.ao converted) twins of the same float weights; lowbit on its default qconfig,
    or on torch.ao's recipe for ``backend`` (``get_default_qconfig("x86")``: the same recipe as the twin)."""
    lb = Q.fuse_modules(copy.deepcopy(fp32).eval(), groups) if groups else copy.deepcopy(fp32).eval()
    prep = Q.prepare(lb, Q.get_default_qconfig(backend))
    torch.backends.quantized.engine = "x86"
    ao = copy.deepcopy(fp32_ao).eval()
    ao.qconfig = aoq.get_default_qconfig("x86")
    ao = aoq.fuse_modules(ao, groups) if groups else ao
    aoq.prepare(ao, inplace=True)
    with torch.inference_mode():
        for xb in calib:
            prep(xb)
            ao(xb)
    aoq.convert(ao, inplace=True)
    return Q.convert(prep), ao


def _methods(fp32: nn.Module, lowbit: nn.Module, ao: nn.Module, args: tuple[Any, ...],
             kwargs: dict[str, Any] | None = None, exact: bool = True,
             variants: dict[str, nn.Module] | None = None) -> dict[str, Callable[[], Any]]:
    """The five methods, plus ``lowbit <v> eager`` / ``lowbit <v> compiled`` for each other lowbit recipe ``v``
    in ``variants`` (interleaved in the same rounds)."""
    kwargs = kwargs or {}
    torch._dynamo.reset()
    fp_c = torch.compile(fp32, dynamic=False)
    out: dict[str, Callable[[], Any]] = {}
    for tag, model in {"": lowbit, **{f" {k}": v for k, v in (variants or {}).items()}}.items():
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        with torch.inference_mode():
            ref, got = model(*args, **kwargs), compiled(*args, **kwargs)
        ref_t = ref if isinstance(ref, torch.Tensor) else ref[0]
        got_t = got if isinstance(got, torch.Tensor) else got[0]
        # int8 steps are bit-identical; float ops between them (MiniLM's attention, LayerNorm, GELU) are
        # compiled by inductor, whose float32 kernels round differently from eager (~1e-7 per layer, as for
        # fp32); per-token int8 grids then move codes, and over 6 layers MiniLM's outputs drift measurably
        # (printed; with backend="aot_eager" the compiled model is bit-identical)
        rel = float((ref_t - got_t).norm() / ref_t.norm().clamp(min=1e-30))
        same = torch.equal(ref_t, got_t)
        tqdm.write(f"  lowbit{tag} compiled vs eager: {'bit-identical' if same else f'rel. diff {rel:.2e}'}")
        if exact and not same:
            raise AssertionError(f"lowbit{tag} compiled differs from lowbit{tag} eager (relative {rel:.2e})")
        out[f"lowbit{tag} eager"] = lambda m=model: m(*args, **kwargs)
        out[f"lowbit{tag} compiled"] = lambda m=compiled: m(*args, **kwargs)
    with torch.inference_mode():
        fp_c(*args, **kwargs)
    return {**out, "torch.ao": lambda: ao(*args, **kwargs), "fp32": lambda: fp32(*args, **kwargs),
            "fp32 compiled": lambda: fp_c(*args, **kwargs)}


def cases(names: list[str], quick: bool) -> list[tuple[str, Callable[[], dict[str, Callable[[], Any]]]]]:
    """``(label, build)`` per case; ``build()`` returns the five methods."""
    out: list[tuple[str, Callable[[], dict[str, Callable[[], Any]]]]] = []
    if "linear" in names:
        for m, k, n in SHAPES[:2] if quick else SHAPES:
            def static(m: int = m, k: int = k, n: int = n) -> dict[str, Callable[[], Any]]:
                torch.manual_seed(0)
                lin, x = nn.Linear(k, n).eval(), torch.randn(m, k)
                lb, ao = _static_pair(_wrapped(lin, False), _wrapped(lin, True), [x])
                return _methods(lin, lb, ao, (x,))

            def dynamic(m: int = m, k: int = k, n: int = n) -> dict[str, Callable[[], Any]]:
                torch.manual_seed(0)
                lin, x = nn.Linear(k, n).eval(), torch.randn(m, k)
                torch.backends.quantized.engine = "x86"
                ao = aoq.quantize_dynamic(nn.Sequential(copy.deepcopy(lin)), {nn.Linear}, dtype=torch.qint8)
                return _methods(lin, Q.quantize_dynamic(nn.Sequential(copy.deepcopy(lin))), ao, (x,))
            out += [(f"Linear {m}x{k}x{n} static", static), (f"Linear {m}x{k}x{n} dynamic", dynamic)]
    if "conv" in names:
        def conv() -> dict[str, Callable[[], Any]]:
            torch.manual_seed(0)
            c = nn.Conv2d(64, 64, 3, padding=1).eval()
            x = torch.randn(8, 64, 56, 56).contiguous(memory_format=torch.channels_last)
            fp = nn.Sequential(c, nn.ReLU()).eval()
            lb, ao = _static_pair(_wrapped(c, False, relu=True), _wrapped(c, True, relu=True), [x], [["1", "2"]])
            return _methods(fp, lb, ao, (x,))
        out.append(("Conv 8x64x56x56 3x3 +ReLU static", conv))
    for case, backend in (("smallcnn", None), ("smallcnn-x86", "x86")):
        if case not in names:
            continue

        def smallcnn(backend: str | None = backend) -> dict[str, Callable[[], Any]]:
            torch.manual_seed(0)
            fp = SmallCNN().eval()
            ao_fp = SmallCNN().eval()
            ao_fp.load_state_dict(fp.state_dict())
            ao_fp.quant, ao_fp.dequant, ao_fp.skip = aoq.QuantStub(), aoq.DeQuantStub(), aonnq.FloatFunctional()
            calib = [torch.randn(128, 1, 28, 28) for _ in range(2)]
            lb, ao = _static_pair(fp, ao_fp, calib, SmallCNN.fusion_groups(), backend)
            return _methods(fp, lb, ao, (torch.randn(64, 1, 28, 28),))
        out.append(("SmallCNN b64 static" + (" (lowbit on torch.ao's x86 qconfig)" if backend else ""), smallcnn))
    if "minilm" in names and D.minilm_available():
        def minilm() -> dict[str, Callable[[], Any]]:
            tok, model = D.load_minilm()
            docs = [f"sentence number {i} about the quantization of neural networks on CPUs" for i in range(32)]
            enc = tok(docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
            torch.backends.quantized.engine = "x86"
            ao = aoq.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
            kw = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
            variants = {name: Q.quantize_dynamic(copy.deepcopy(model), {nn.Linear: Q.get_dynamic_qconfig(**qc)})
                        for name, qc in MINILM_RECIPES.items()}
            return _methods(model, Q.quantize_dynamic(copy.deepcopy(model)), ao, (), kw, exact=False, variants=variants)
        out.append(("MiniLM b32 dynamic", minilm))
    for case, backend in (("mobilenetv2", None), ("mobilenetv2-x86", "x86")):
        if case not in names:
            continue

        def mobilenet(backend: str | None = backend) -> dict[str, Callable[[], Any]]:
            torch.manual_seed(0)
            fp, ao_fp = MobileNetV2().eval(), MobileNetV2(ao=True).eval()
            ao_fp.load_state_dict(fp.state_dict())
            calib = [torch.randn(8, 3, 224, 224) for _ in range(2)]
            lb, ao = _static_pair(fp, ao_fp, calib, fp.fusion_groups(), backend)
            return _methods(fp, lb, ao, (torch.randn(8, 3, 224, 224),))
        out.append(("MobileNetV2 b8 static" + (" (lowbit on torch.ao's x86 qconfig)" if backend else ""), mobilenet))
    return out


def minilm_cosine() -> dict[str, dict[str, float]]:
    """Mean cosine to fp32 of ``e2e.py``'s sentence embeddings (``lowbit.data.embed_sentences``, the 50 Lee-corpus
    documents when gensim's copy is installed) for each MiniLM dynamic recipe, eager and compiled."""
    tok, model = D.load_minilm()
    try:
        docs = D.load_lee_corpus()[1]
    except ImportError:
        docs = [f"sentence number {i} about quantization of neural networks" for i in range(50)]
    with torch.inference_mode():
        ref = D.embed_sentences(tok, model, docs)
    recipes: dict[str, Any] = {"default": None}
    recipes.update({k: {nn.Linear: Q.get_dynamic_qconfig(**v)} for k, v in MINILM_RECIPES.items()})
    out: dict[str, dict[str, float]] = {}
    for name, spec in tqdm(recipes.items(), desc="MiniLM cosine", file=sys.stdout):
        m = Q.quantize_dynamic(copy.deepcopy(model), spec)
        torch._dynamo.reset()
        c = torch.compile(m, fullgraph=True)
        with torch.inference_mode():
            out[name] = {mode: float((D.embed_sentences(tok, f, docs) * ref).sum(1).mean())
                         for mode, f in (("eager", m), ("compiled", c))}
        tqdm.write(f"MiniLM {name}: cosine to fp32 eager {out[name]['eager']:.4f}, compiled {out[name]['compiled']:.4f} "
                   f"({len(docs)} documents)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES, help="none: only --cosine")
    p.add_argument("--cosine", action="store_true", help="MiniLM recipes' embedding cosine to fp32, eager and compiled")
    p.add_argument("--kernels", action="store_true", help="kernel-level int8 : fp32 ratio of SmallCNN and MiniLM")
    a = p.parse_args()
    if a.quick:
        a.rounds = min(a.rounds, 3)
    mach = common.machine()
    print(f"ISA: {mach.get('cpu')} | {', '.join(k for k, v in mach.get('isa', {}).items() if v)} | "
          f"torch cpu capability {mach['cpu_capability']} | heap: {mach.get('heap')}", flush=True)
    res: dict[str, Any] = {"runs": []}
    todo = cases(a.cases, a.quick)
    for label, build in tqdm(todo, desc="cases", file=sys.stdout):
        for threads in a.threads:
            # built and compiled at the count it is timed at: inductor's C++ kernels keep the count they were compiled
            # at (compiled at 1 they have no parallel region; at 2 they run 2 threads at any count), the lowbit and
            # the fp32 model alike (session 49)
            torch.set_num_threads(threads)
            meth = build()
            t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
            s = t.summary("fp32")
            ratios = {}
            for tag in [k[len("lowbit"):-len(" eager")] for k in meth if k.startswith("lowbit") and k.endswith(" eager")]:
                ratios.update({f"lowbit{tag} eager / torch.ao": t.ratio("torch.ao", f"lowbit{tag} eager"),
                               f"lowbit{tag} compiled / torch.ao": t.ratio("torch.ao", f"lowbit{tag} compiled"),
                               f"lowbit{tag} compiled / fp32 compiled": t.ratio("fp32 compiled", f"lowbit{tag} compiled")})
            res["runs"].append({"case": label, "threads": threads, **s, "ratios": ratios})
            tqdm.write(f"{label} t={threads} clean {t.n_clean}/{a.rounds} | "
                       + " ".join(f"{k}={v['ms']:.3g}ms" for k, v in s["methods"].items()) + " | "
                       + " ".join(f"{k}={v:.2f}x" for k, v in ratios.items()), file=sys.stdout)
    if a.cosine and D.minilm_available():
        res["minilm_cosine"] = minilm_cosine()
    if a.kernels:
        import int8_advantage
        res["int8_advantage"] = int8_advantage.report(["smallcnn", "minilm"], a.rounds, tuple(a.threads))
    print(common.write_results(a.out or "compiled", res))


if __name__ == "__main__":
    main()
