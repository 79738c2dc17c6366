"""``lowbit quantize``: quantize a model end to end and report accuracy, size and latency.

With no arguments it runs the built-in example: the small residual CNN of ``lowbit.examples``
trained on Fashion-MNIST (Debian ``dataset-fashion-mnist``; scikit-learn's 8x8 digits, upscaled,
when that package is absent), then static PTQ, QAT and dynamic quantization, and prints::

    method   accuracy  Δ vs fp32  size (KiB)  size ratio  latency ratio vs fp32 (batch 64)

It writes ``model_<method>.pt`` (state dicts that load with ``torch.load(weights_only=True)``),
``report.md`` and ``report.json`` to ``--out``; files appear there only once everything succeeded.

For your own model: ``--model pkg.module:factory [--weights w.pt] --calib data.{pt,npz,npy}|images/
[--eval x --labels y] --method ptq|qat|dynamic``. Errors are one line on stderr, exit status 2.

>>> build_parser().parse_args(["quantize", "--method", "ptq"]).method
['ptq']
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["main", "build_parser", "CLIError"]

METHODS = ("ptq", "qat", "dynamic")


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


# ---------------------------------------------------------------- progress + output


def _progress(it: Iterable[Any], desc: str, total: int | None, quiet: bool) -> Iterator[Any]:
    if quiet or not sys.stderr.isatty():
        yield from it
        return
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        yield from it
        return
    yield from tqdm(it, desc=desc, total=total, leave=False, file=sys.stderr)


def _state_bytes(model: nn.Module) -> int:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


# ---------------------------------------------------------------- data


def _load_array(path: str, what: str) -> torch.Tensor:
    p = Path(path)
    if not p.exists():
        raise CLIError(f"{what} file not found: {path}")
    if p.is_dir():
        return _load_images(p, what)
    suffix = p.suffix.lower()
    try:
        if suffix == ".pt":
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                obj = next((obj[k] for k in ("x", "inputs", "data", "y", "labels") if k in obj), None)
            if not isinstance(obj, torch.Tensor):
                raise CLIError(f"{what} {path}: expected a tensor (or a dict with key 'x'/'inputs'/'y')")
            return obj
        if suffix == ".npz":
            with np.load(p) as z:
                key = next((k for k in ("x", "inputs", "data", "y", "labels") if k in z.files), z.files[0] if z.files else None)
                if key is None:
                    raise CLIError(f"{what} {path}: the .npz holds no array")
                return torch.from_numpy(np.array(z[key]))
        if suffix == ".npy":
            return torch.from_numpy(np.load(p))
    except CLIError:
        raise
    except Exception as e:  # corrupt file: one clear line
        raise CLIError(f"{what} {path}: cannot read ({type(e).__name__}: {e})") from e
    raise CLIError(f"{what} {path}: unsupported format {suffix!r} (use .pt, .npz, .npy or a folder of images)")


def _load_images(folder: Path, what: str) -> torch.Tensor:
    files = sorted(f for f in folder.iterdir() if f.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp"))
    if not files:
        raise CLIError(f"{what} folder {folder} holds no .png/.jpg/.bmp images")
    try:
        from PIL import Image
    except ImportError as e:
        raise CLIError("reading an image folder needs Pillow: pip install pillow") from e
    arrs = [np.asarray(Image.open(f).convert("L"), dtype=np.float32) / 255.0 for f in files]
    if len({a.shape for a in arrs}) != 1:
        raise CLIError(f"{what} folder {folder}: images differ in size")
    return torch.from_numpy(np.stack(arrs)).unsqueeze(1)


def _builtin_data(n_train: int, seed: int) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import data

    if data.fashion_mnist_available():
        xtr, ytr = data.load_fashion_mnist("train")
        xte, yte = data.load_fashion_mnist("test")
        idx = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(seed))[:n_train]
        return "Fashion-MNIST", data.normalize_images(xtr[idx]), ytr[idx], data.normalize_images(xte), yte
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise CLIError("no built-in dataset: install Debian's dataset-fashion-mnist or scikit-learn") from e
    d = load_digits()
    x = torch.nn.functional.interpolate(torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0,
                                        size=(28, 28), mode="bilinear", align_corners=False)
    x, y = (x - x.mean()) / x.std(), torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.75 * len(x))
    return "sklearn digits (8x8 upscaled)", x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


# ---------------------------------------------------------------- model


def _load_model(spec: str, weights: str | None) -> nn.Module:
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise CLIError(f"--model {spec!r}: expected 'package.module:factory'")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise CLIError(f"--model {spec!r}: cannot import {mod_name!r} ({type(e).__name__}: {e})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"--model {spec!r}: {mod_name} has no callable {attr!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise CLIError(f"--model {spec!r}: the factory returned {type(model).__name__}, not an nn.Module")
    if weights is not None:
        if not Path(weights).is_file():
            raise CLIError(f"--weights file not found: {weights}")
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except Exception as e:
            raise CLIError(f"--weights {weights}: does not load into the model ({type(e).__name__}: {e})") from e
    return model.eval()


def _check_runs(model: nn.Module, x: torch.Tensor, what: str) -> None:
    try:
        with torch.no_grad():
            model(x[:2])
    except Exception as e:
        raise CLIError(f"{what} of shape {tuple(x.shape)} does not fit the model ({type(e).__name__}: {e})") from e


# ---------------------------------------------------------------- methods


def _qconfig(name: str, qat: bool) -> Any:
    import lowbit as Q

    if qat:
        return Q.get_default_qat_qconfig()
    from .speed_guard import get_speed_qconfig

    recipes: dict[str, Callable[[], Any]] = {"default": Q.get_default_qconfig, "histogram": Q.get_default_qconfig,
                                             "minmax": Q.get_minmax_qconfig, "speed": get_speed_qconfig}
    if name not in recipes:
        raise CLIError(f"--qconfig {name!r}: choose one of {sorted(recipes)}")
    return recipes[name]()


def _has_stubs(model: nn.Module) -> bool:
    from .stubs import QuantStub

    return any(isinstance(m, QuantStub) for m in model.modules())


def _fusion_groups(model: nn.Module) -> list[list[str]]:
    groups = getattr(model, "fusion_groups", None)
    return groups() if callable(groups) else []


def _ptq(model: nn.Module, calib: torch.Tensor, qconfig: Any, quiet: bool,
         batch: int = 256) -> tuple[nn.Module, nn.Module]:
    """Fuse (when the model lists its fusion groups), prepare, calibrate, convert; return (prepared, quantized)."""
    import lowbit as Q

    m = model if _has_stubs(model) else Q.QuantWrapper(model)
    m = Q.fuse_modules(m.eval(), _fusion_groups(m)) if _fusion_groups(m) else m
    prepared = Q.prepare(m, qconfig)
    with torch.no_grad():
        chunks = range(0, len(calib), batch)
        for i in _progress(chunks, "calibrate", len(chunks), quiet):
            prepared(calib[i: i + batch])
    return prepared, Q.convert(prepared)


def _qat(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: float, quiet: bool) -> nn.Module:
    import lowbit as Q
    from .examples import train

    m = model if _has_stubs(model) else Q.QuantWrapper(model)
    m = Q.fuse_modules_qat(m.train(), _fusion_groups(m)) if _fusion_groups(m) else m.train()
    prepared = Q.prepare_qat(m, Q.get_default_qat_qconfig())
    bar = iter(_progress(iter(int, 1), "QAT", None, quiet))

    def schedule(mod: nn.Module, step: int, total: int) -> None:
        next(bar)
        # the usual schedule: BN statistics, then observers, frozen for the last steps (never before step 1)
        if step == max(1, int(0.6 * total)):
            mod.apply(Q.freeze_bn_stats)
        if step == max(1, int(0.8 * total)):
            mod.apply(Q.disable_observer)

    train(prepared, x, y, epochs=epochs, lr=2e-4, seed=1, on_step=schedule)
    return Q.convert(prepared.eval())


def _dynamic(model: nn.Module) -> nn.Module:
    import lowbit as Q

    return Q.quantize_dynamic(model.eval())  # the default dynamic mapping: Linear, RNN/LSTM/GRU and their cells


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, quiet: bool, desc: str) -> float:
    model.eval()
    hits = 0
    with torch.no_grad():
        chunks = range(0, len(x), 500)
        for i in _progress(chunks, f"eval {desc}", len(chunks), quiet):
            hits += int((model(x[i: i + 500]).argmax(-1) == y[i: i + 500]).sum())
    return 100.0 * hits / len(x)


def _latency_ratios(models: dict[str, nn.Module], x: torch.Tensor, rounds: int = 7) -> dict[str, dict[str, float]]:
    """Median ms per call and median of per-round ratios fp32/method, methods interleaved."""
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.no_grad():
        for m in models.values():
            m(x)
        for r in range(rounds):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for k in order:
                t = time.perf_counter()
                for _ in range(3):
                    models[k](x)
                times[k].append((time.perf_counter() - t) / 3)
    base = times["fp32"]
    return {k: {"ms": 1e3 * statistics.median(v), "ratio": statistics.median(b / t for b, t in zip(base, v))}
            for k, v in times.items()}


# ---------------------------------------------------------------- report


def _table(rows: list[dict[str, Any]]) -> str:
    head = "| method | accuracy (%) | Δ vs fp32 (pts) | size (KiB) | size ratio | latency (ms, batch 64) | speed-up vs fp32 |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['method']} | {r['accuracy']:.2f} | {r['delta']:+.2f} | {r['size_kib']:.1f} | "
                     f"{r['size_ratio']:.2f}x | {r['latency_ms']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def _write_outputs(out: Path, write_all: Callable[[Path], None]) -> list[str]:
    """Let ``write_all`` fill a temporary folder; move its files into ``out`` only when it succeeded."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".lowbit-", dir=out.parent))
    except OSError as e:
        raise CLIError(f"--out {out}: cannot write there ({e.strerror or e})") from e
    try:
        write_all(tmp)
        names = sorted(f.name for f in tmp.iterdir())
        out.mkdir(exist_ok=True)
        for name in names:
            os.replace(tmp / name, out / name)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- command


def _quantize(args: argparse.Namespace) -> int:
    from . import examples, kernels

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    if args.backend != "auto":
        kernels.set_backend(args.backend)
    methods = args.method or list(METHODS)
    labels_for_qat: torch.Tensor | None = None
    if args.model is None:
        for flag in ("weights", "calib", "eval", "labels", "calib_labels"):
            if getattr(args, flag) is not None:
                raise CLIError(f"--{flag.replace('_', '-')} needs --model (the built-in example brings its own data)")
        name, xtr, ytr, xte, yte = _builtin_data(args.train_size, args.seed)
        if args.test_size:
            xte, yte = xte[: args.test_size], yte[: args.test_size]
        say(f"lowbit: built-in example — SmallCNN on {name} ({len(xtr)} train / {len(xte)} test images)")
        fp32 = examples.SmallCNN()
        steps = range(1)
        for _ in _progress(steps, "train fp32", 1, args.quiet):
            examples.train(fp32, xtr, ytr, epochs=args.epochs, lr=2e-3, seed=args.seed)
        fp32.eval()
        calib, labels_for_qat = xtr[: args.calib_size], ytr
        xqat = xtr
    else:
        fp32 = _load_model(args.model, args.weights)
        if args.calib is None:
            raise CLIError("--model needs --calib (calibration inputs: .pt, .npz, .npy or a folder of images)")
        calib = _load_array(args.calib, "--calib").float()
        _check_runs(fp32, calib, "--calib data")
        xte = _load_array(args.eval, "--eval").float() if args.eval else None
        yte = _load_array(args.labels, "--labels").long() if args.labels else None
        if (xte is None) != (yte is None):
            raise CLIError("--eval and --labels go together")
        if xte is not None and yte is not None:
            if len(xte) != len(yte):
                raise CLIError(f"--eval has {len(xte)} samples but --labels has {len(yte)}")
            _check_runs(fp32, xte, "--eval data")
        if "qat" in methods:
            if args.calib_labels is None:
                raise CLIError("--method qat needs --calib-labels (QAT fine-tunes on the --calib data)")
            labels_for_qat = _load_array(args.calib_labels, "--calib-labels").long()
            if len(labels_for_qat) != len(calib):
                raise CLIError(f"--calib has {len(calib)} samples but --calib-labels has {len(labels_for_qat)}")
        xqat = calib

    import copy

    qmodels: dict[str, nn.Module] = {}
    prepared_ptq: nn.Module | None = None
    for method in methods:
        say(f"lowbit: {method} ...")
        if method == "ptq":
            prepared_ptq, qmodels[method] = _ptq(copy.deepcopy(fp32), calib, _qconfig(args.qconfig, False), args.quiet)
        elif method == "qat":
            assert labels_for_qat is not None
            qmodels[method] = _qat(copy.deepcopy(fp32), xqat, labels_for_qat, args.qat_epochs, args.quiet)
        else:
            qmodels[method] = _dynamic(copy.deepcopy(fp32))

    all_models = {"fp32": fp32, **qmodels}
    bench_x = (xte if xte is not None else calib)[:64]
    lat = _latency_ratios(all_models, bench_x)
    fp32_size = _state_bytes(fp32)
    rows = []
    fp32_acc = _accuracy(fp32, xte, yte, args.quiet, "fp32") if xte is not None else float("nan")
    for k, m in all_models.items():
        acc = fp32_acc if k == "fp32" else (_accuracy(m, xte, yte, args.quiet, k) if xte is not None else float("nan"))
        size = _state_bytes(m)
        rows.append({"method": k, "accuracy": acc, "delta": acc - fp32_acc, "size_kib": size / 1024,
                     "size_ratio": fp32_size / size, "latency_ms": lat[k]["ms"], "speedup": lat[k]["ratio"]})
    table = _table(rows)
    print(table)

    from .debug import compare
    from .report import write_report

    cmp = compare(fp32, qmodels["ptq"], calib[:256]) if prepared_ptq is not None else None
    report: dict[str, Any] = {"model": args.model or "lowbit.examples:SmallCNN", "rows": rows,
                              "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if cmp is not None:
        report["layers"] = cmp.to_dict()["rows"]
        say(f"lowbit: per-layer SQNR of the PTQ model vs fp32\n{cmp}")

    def write_all(d: Path) -> None:
        for k, m in qmodels.items():
            torch.save(m.state_dict(), d / f"model_{k}.pt")
        (d / "report.json").write_text(json.dumps(report, indent=2))
        write_report(d, rows, compare_result=cmp, histograms=prepared_ptq, fmt="md",
                     notes=f"Model: `{report['model']}`; torch {torch.__version__}, {report['threads']} threads, "
                           f"{report['date']}. Latency: batch of 64, median of 7 interleaved rounds; speed-up = "
                           "median of per-round fp32/method ratios.")

    written = _write_outputs(Path(args.out), write_all)
    say(f"lowbit: wrote {', '.join(written)} to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit", description="int8 quantization for PyTorch")
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a model (no arguments: the built-in example)")
    q.add_argument("--model", help="package.module:factory returning an nn.Module")
    q.add_argument("--weights", help="state_dict (.pt) to load into the model")
    q.add_argument("--calib", help="calibration inputs: .pt, .npz, .npy or a folder of images")
    q.add_argument("--calib-labels", dest="calib_labels", help="labels of --calib (needed for --method qat)")
    q.add_argument("--eval", help="evaluation inputs (same formats as --calib)")
    q.add_argument("--labels", help="labels of --eval")
    q.add_argument("--method", action="append", choices=METHODS, help="repeatable; default: all three")
    q.add_argument("--qconfig", default="default",
                   help="static recipe: default (histogram), minmax, or speed (7-bit activations without VNNI)")
    q.add_argument("--backend", default="auto", choices=["auto", "reference", "onednn", "int_mm"])
    q.add_argument("--out", default="lowbit-out", help="output folder (default: lowbit-out)")
    q.add_argument("--quiet", action="store_true", help="no progress bars or messages")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    q.add_argument("--epochs", type=float, default=2.0, help="built-in example: fp32 training epochs")
    q.add_argument("--qat-epochs", dest="qat_epochs", type=float, default=0.5, help="QAT fine-tune epochs")
    q.add_argument("--train-size", dest="train_size", type=int, default=12000, help="built-in example: train images")
    q.add_argument("--test-size", dest="test_size", type=int, default=0, help="built-in example: test images (0: all)")
    q.add_argument("--calib-size", dest="calib_size", type=int, default=1000, help="built-in example: calib images")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _quantize(args)
    except CLIError as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
