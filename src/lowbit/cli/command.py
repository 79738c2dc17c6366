"""``lowbit quantize``: argument parsing, the run from inputs to report, and ``main``.

The order is fixed so that nothing is wasted and nothing is half-written: parse and check every
argument, check ``--out`` and create its staging folder, load and check the model and data, then
quantize, measure, write into the staging folder, and swap it in for ``--out`` (see ``output``).
Every error ends as one line on stderr and exit status 2; Ctrl-C (or SIGTERM) as one line and status
130; in all cases ``--out`` is left as it was.

>>> build_parser().parse_args(["quantize", "--method", "ptq"]).method
['ptq']
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from . import common
from .common import CLIError, one_line, progress, stage
from .common import count as _count
from .common import cpus as _cpus
from .inputs import builtin_data, check_data, check_labels, check_runs, check_spec, load_array, load_model
from .measure import accuracy, latency_ratios, state_bytes, table
from .methods import METHODS, QCONFIGS, Job
from .output import OutputFolder, check_inputs_outside, strict_json

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``lowbit: error: ...``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"lowbit: error: {' '.join(message.split())}\n")


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive finite number")
    return v


def _seed(text: str) -> int:
    """``--seed``: an integer torch's generators take, ``[-2**63, 2**64)``."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -2**63 <= v < 2**64:  # torch.manual_seed raised 'Overflow when unpacking long long' with a traceback
        raise argparse.ArgumentTypeError(f"{v} is outside [-2**63, 2**64) (torch's seed range)")
    return v


def _steps(text: str) -> int:
    """``--distill``: a number of optimisation steps, an integer >= 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    if v > 2 ** 63 - 1:  # (refused by quantize_ptq too, after the model and data loaded)
        raise argparse.ArgumentTypeError(f"{v} must be <= 2**63 - 1")
    return v


#: ``--qat-epochs`` when it is not given (parsed as ``None``, so that a value given without QAT can be refused)
QAT_EPOCHS = 0.5

#: the flags passed to ``quantize_ptq`` as options only ``--recipe accurate`` reads (argparse dest -> option; their
#: defaults are ``ptq_checks.ACCURATE_ONLY``'s): another value with another recipe is refused (``_check_args``)
RECIPE_FLAGS = {"distill": "distill"}

#: the built-in example's own flags and their defaults (with --model, another value would be ignored: refused)
_EXAMPLE = {"epochs": 2.0, "train_size": 12000, "test_size": 0, "calib_size": 1000}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lowbit", description="int8 quantization for PyTorch")
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a model (no arguments: the built-in example)")
    q.add_argument("--model", help="package.module:factory returning an nn.Module")
    q.add_argument("--weights", help="state_dict (.pt) to load into the model")
    q.add_argument("--calib", help="calibration inputs: .pt, .npz, .npy or a folder of images (pixels / 255, or / 65535 "
                   "for 16-bit; (N, 3, H, W) when any image has colour, else (N, 1, H, W))")
    q.add_argument("--calib-labels", dest="calib_labels", help="labels of --calib (needed for --method qat)")
    q.add_argument("--eval", help="evaluation inputs (same formats as --calib)")
    q.add_argument("--labels", help="labels of --eval")
    q.add_argument("--method", action="append", choices=list(METHODS),
                   help="repeatable; default: ptq, qat (when labels are at hand) and dynamic. " +
                        "; ".join(f"{m.name}: {m.help}" for m in METHODS.values() if m.help))
    q.add_argument("--qconfig", default="default", choices=QCONFIGS,
                   help="static recipe: default (histogram; under --recipe accurate: that recipe's MSE-searched "
                        "ranges), histogram, minmax, or speed (7-bit activations without VNNI)")
    q.add_argument("--recipe", default="default", choices=["default", "accurate", "balanced"],
                   help="ptq recipe: default (eager prepare/convert), accurate (quantize_ptq: graph mode, "
                        "AdaRound + bias correction; slowest) or balanced (quantize_ptq: graph mode, default "
                        "grids, quadratic rounding + bias correction; minutes)")
    q.add_argument("--distill", type=_steps, default=0,
                   help="--recipe accurate: that many steps of end-to-end distillation after rounding (weight codes, "
                        "biases and activation steps learned on the model output; default 0: off)")
    q.add_argument("--backend", default="auto", choices=["auto", "reference", "onednn", "int_mm"])
    q.add_argument("--out", default="lowbit-out", help="output folder, replaced as a whole (default: lowbit-out)")
    q.add_argument("--quiet", action="store_true", help="no progress bars or messages")
    q.add_argument("--traceback", action="store_true", help="let unexpected errors raise with their traceback")
    q.add_argument("--seed", type=_seed, default=0, help="the built-in example's data and training, and --recipe "
                   "accurate's AdaRound sampling (default 0)")
    q.add_argument("--threads", type=_count(0, _cpus()), default=0,
                   help=f"torch threads, at most the {_cpus()} CPUs (0: torch's default)")
    q.add_argument("--epochs", type=_positive_float, default=_EXAMPLE["epochs"], help="built-in example: fp32 training epochs")
    q.add_argument("--qat-epochs", dest="qat_epochs", type=_positive_float, default=None,
                   help=f"QAT fine-tune epochs (default {QAT_EPOCHS}; --method qat only)")
    q.add_argument("--train-size", dest="train_size", type=_count(1), default=_EXAMPLE["train_size"],
                   help="built-in example: train images")
    q.add_argument("--test-size", dest="test_size", type=_count(0), default=_EXAMPLE["test_size"],
                   help="built-in example: test images (0: all)")
    q.add_argument("--calib-size", dest="calib_size", type=_count(1), default=_EXAMPLE["calib_size"],
                   help="built-in example: calib images")
    from .llm import build_parser_into as _llm_parser  # `lowbit quantize-llm`: causal LMs (cli/llm.py)
    _llm_parser(sub)
    return p


DEFAULT_METHODS = ("ptq", "qat", "dynamic")


def _default_methods(args: argparse.Namespace) -> list[str]:
    """ptq, qat and dynamic; for a user model without ``--calib-labels``, the methods that need no labels."""
    if args.model is not None and args.calib_labels is None:
        return [m for m in DEFAULT_METHODS if not METHODS[m].needs_labels]
    return list(DEFAULT_METHODS)


def _check_args(args: argparse.Namespace, methods: list[str]) -> None:
    """Every check that needs no file read: flag combinations and the ``--model`` spec. A flag that no method asked
    for would use is refused, not ignored. Fills in ``--qat-epochs``'s default."""
    for flag, default in (("recipe", "default"), ("qconfig", "default")):
        if getattr(args, flag) != default and "ptq" not in methods:
            raise CLIError(f"--{flag} {getattr(args, flag)} applies to --method ptq, which is not among the methods "
                           f"to run ({', '.join(methods)})")
    from ..ptq_checks import ignored_options  # quantize_ptq's own rule: the options only the accurate recipe reads

    for opt, v, d in ignored_options(args.recipe, {opt: getattr(args, dest) for dest, opt in RECIPE_FLAGS.items()}):
        raise CLIError(f"--{opt.replace('_', '-')} {v} applies to --recipe accurate, not --recipe {args.recipe} (it "
                       f"would be ignored); leave it out (default {d})")
    if args.qat_epochs is not None and "qat" not in methods:  # (given: its parsed default is None)
        raise CLIError(f"--qat-epochs {args.qat_epochs:g} applies to --method qat, which is not among the methods to "
                       f"run ({', '.join(methods)})")
    if args.qat_epochs is None:
        args.qat_epochs = QAT_EPOCHS
    if args.model is None:
        for flag in ("weights", "calib", "eval", "labels", "calib_labels"):
            if getattr(args, flag) is not None:
                raise CLIError(f"--{flag.replace('_', '-')} needs --model (the built-in example brings its own data)")
        return
    check_spec(args.model)
    for flag, default in _EXAMPLE.items():
        if getattr(args, flag) != default:
            raise CLIError(f"--{flag.replace('_', '-')} sets up the built-in example; with --model it would be ignored "
                           "(the model comes trained, its data is --calib / --eval)")
    if args.calib is None:
        raise CLIError("--model needs --calib (calibration inputs: .pt, .npz, .npy or a folder of images)")
    if (args.eval is None) != (args.labels is None):
        raise CLIError("--eval and --labels go together")
    needs_labels = [m for m in methods if METHODS[m].needs_labels]
    if needs_labels and args.calib_labels is None:
        raise CLIError(f"--method {needs_labels[0]} needs --calib-labels (it fine-tunes on the --calib data)")
    if args.calib_labels is not None and not needs_labels:
        raise CLIError(f"--calib-labels is read by --method qat only, which is not among the methods to run "
                       f"({', '.join(methods)}); accuracy is measured on --eval / --labels")


def _fitting(model: nn.Module, raw: torch.Tensor, what: str, data: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, model output on two of them)``: float32 inputs, or the integers as int64 where the model takes
    integers and not floats (token ids for an embedding)."""
    x = check_data(raw, what)
    try:
        return x, check_runs(model, x, data)
    except CLIError as as_float:
        if raw.is_floating_point():
            raise
        try:  # token ids: an embedding takes int64 indices
            ids = raw.long()
            return ids, check_runs(model, ids, data)
        except CLIError as as_ids:
            if as_float.__cause__ is None or as_ids.__cause__ is None:  # it ran, and its output was refused: that one
                raise (as_float if as_float.__cause__ is None else as_ids) from None
            # it ran neither way: both reasons (which applies depends on what the model takes)
            raise CLIError(f"{data} of shape {tuple(raw.shape)} does not fit the model, as float32 "
                           f"({one_line(as_float.__cause__)}) nor as int64 indices ({one_line(as_ids.__cause__)})"
                           ) from as_ids


def _inputs(args: argparse.Namespace, methods: list[str], say: Any) -> tuple[nn.Module, torch.Tensor, Any, Any, Any]:
    """(fp32 model, calib, calib labels or None, eval x or None, eval y or None), all checked."""
    from .. import examples

    needs_labels = any(METHODS[m].needs_labels for m in methods)
    if args.model is None:
        name, xtr, ytr, xte, yte = builtin_data(args.train_size, args.seed)
        if args.test_size:
            xte, yte = xte[: args.test_size], yte[: args.test_size]
        say(f"lowbit: built-in example — SmallCNN on {name} ({len(xtr)} train / {len(xte)} test images)")
        fp32 = examples.SmallCNN()
        bar = iter(progress(iter(int, 1), "train fp32", None, args.quiet))
        with stage("training the fp32 example"):
            examples.train(fp32, xtr, ytr, epochs=args.epochs, lr=2e-3, seed=args.seed,
                           on_step=lambda *_: next(bar))
        return fp32.eval(), xtr[: args.calib_size], ytr[: args.calib_size] if needs_labels else None, xte, yte
    fp32 = load_model(args.model, args.weights)
    calib, out = _fitting(fp32, load_array(args.calib, "--calib"), f"--calib {args.calib}", "--calib data")
    calib_out = out
    classes = out.shape[-1] if out.dim() >= 2 else None
    xte = yte = calib_labels = None
    if args.eval is not None:
        xte, out = _fitting(fp32, load_array(args.eval, "--eval"), f"--eval {args.eval}", "--eval data")
        if out.dim() != 2:
            raise CLIError(f"--eval: accuracy needs (batch, classes) model outputs, got shape {tuple(out.shape)}")
        yte = check_labels(load_array(args.labels, "--labels", labels=True), f"--labels {args.labels}", len(xte), out.shape[-1])
    if needs_labels:
        if len(calib) < 2:  # a training batch of one: BatchNorm and the loss need more
            raise CLIError(f"--method qat fine-tunes on --calib: it needs at least 2 samples, got {len(calib)}")
        if calib_out.dim() != 2:
            raise CLIError(f"--method qat trains with cross-entropy on (batch, classes) model outputs, got shape "
                           f"{tuple(calib_out.shape)} on --calib")
        calib_labels = check_labels(load_array(args.calib_labels, "--calib-labels", labels=True),
                                    f"--calib-labels {args.calib_labels}", len(calib), classes)
    return fp32, calib, calib_labels, xte, yte


def _quantize(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    methods = list(dict.fromkeys(args.method or _default_methods(args)))
    _check_args(args, methods)
    check_inputs_outside(args.out, {f"--{f.replace('_', '-')}": getattr(args, f)
                                    for f in ("weights", "calib", "eval", "labels", "calib_labels")})
    with OutputFolder(args.out) as folder:          # --out is checked (and its staging folder made) first
        fp32, calib, calib_labels, xte, yte = _inputs(args, methods, say)
        qmodels: dict[str, nn.Module] = {}
        extras: dict[str, Any] = {}
        for method in methods:
            say(f"lowbit: {method} ...")
            job = Job(copy.deepcopy(fp32), calib, calib_labels, args, extras)
            with stage(f"--method {method}"):
                qmodels[method] = METHODS[method].run(job)

        all_models = {"fp32": fp32, **qmodels}
        with stage("measuring"):
            timed = (xte if xte is not None else calib)[:64]
            lat = latency_ratios(all_models, timed, quiet=args.quiet)
            fp32_size = state_bytes(fp32)
            rows = []
            fp32_acc = accuracy(fp32, xte, yte, args.quiet, "fp32") if xte is not None else float("nan")
            for k, m in all_models.items():
                acc = fp32_acc if k == "fp32" else (accuracy(m, xte, yte, args.quiet, k) if xte is not None
                                                    else float("nan"))
                size = state_bytes(m)
                rows.append({"method": k, "accuracy": acc, "delta": acc - fp32_acc, "size_kib": size / 1024,
                             "size_ratio": fp32_size / size, "latency_ms": lat[k]["ms"], "speedup": lat[k]["ratio"],
                             "latency_batch": len(timed)})
        print(table(rows))

        from ..debug import compare
        from ..debug.compare import _pairs
        from ..report import write_report

        prepared_ptq = extras.get("prepared_ptq")
        cmp = None
        if "ptq" in qmodels and not _pairs(fp32, qmodels["ptq"]):
            say("lowbit: no layer of the model is one lowbit quantizes statically (Linear, Conv, ...): the PTQ model "
                "only quantizes its input and output, and there is no per-layer table")
        elif "ptq" in qmodels:
            with stage("comparing layers"):
                cmp = compare(fp32, qmodels["ptq"], calib[:256])
        report: dict[str, Any] = {"model": args.model or "lowbit.examples:SmallCNN", "rows": rows,
                                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                                  "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        recipe = extras.get("ptq_report")  # quantize_ptq's steps (--recipe accurate / balanced): what each changed
        if recipe is not None:
            report["ptq_recipe"] = recipe
            say(f"lowbit: {recipe}")
        if cmp is not None:
            report["layers"] = cmp.to_dict()["rows"]
            say(f"lowbit: per-layer SQNR of the PTQ model vs fp32\n{cmp}")

        with stage(f"writing --out {args.out}"):
            d = folder.staging
            for k, m in qmodels.items():
                torch.save(m.state_dict(), d / f"model_{k}.pt")
            (d / "report.json").write_text(strict_json(report) + "\n")
            write_report(d, rows, compare_result=cmp, histograms=prepared_ptq, fmt="md",
                         notes=f"Model: `{report['model']}`; torch {torch.__version__}, {report['threads']} threads, "
                               f"{report['date']}. Latency: batch of {len(timed)}, median of 7 interleaved rounds; speed-up = "
                               "median of per-round fp32/method ratios."
                               + (f"\n\nPTQ recipe (`--recipe {args.recipe}`):\n\n```\n{recipe}\n```" if recipe else ""))
        written = folder.commit()
    say(f"lowbit: wrote {', '.join(written)} to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lowbit`` command; returns the exit status (0, 2 on errors, 130 on Ctrl-C)."""
    args = build_parser().parse_args(argv)
    previous = _on_sigterm(_interrupt)
    common.RAISE_UNEXPECTED = bool(args.traceback)
    try:
        if args.command == "quantize-llm":
            from .llm import run as _run_llm
            with _settings_restored():  # (its --threads outlived main() before: the caller's process at that count)
                return _run_llm(args)
        return _quantize_restoring(args)
    except CLIError as e:
        print(f"lowbit: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lowbit: interrupted; --out {Path(args.out)} left as it was", file=sys.stderr)
        return 130
    finally:
        common.RAISE_UNEXPECTED = False
        _on_sigterm(previous)


@contextlib.contextmanager
def _settings_restored() -> Iterator[None]:
    """The process settings a command changes (``--threads``, the global RNG seeded by ``--seed``) put back after it:
    a second ``main()`` in the same process starts from the caller's settings."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def _quantize_restoring(args: argparse.Namespace) -> int:
    """``_quantize`` with the process settings it changes (``--threads``, ``--backend``, the global RNG seeded by
    ``--seed``) put back afterwards: a second ``main()`` in the same process starts from the caller's settings."""
    from .. import kernels

    with _settings_restored():  # --backend pins this run only (main() used set_backend: the pin outlived it)
        with kernels.use_backend(args.backend) if args.backend != "auto" else contextlib.nullcontext():
            return _quantize(args)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C: the staging folder goes, --out stays as it was


def _on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM (main thread, POSIX only); return the previous one."""
    if handler is None or not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)
