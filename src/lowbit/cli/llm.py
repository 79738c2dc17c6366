"""``lowbit quantize-llm``: weight-only int4/int8 (or W8A8) quantization of a causal LM, with a report.

``MODEL`` is a Hugging Face causal-LM directory (``config.json`` + weights + tokenizer) or a ``.gguf``
file (``transformers`` dequantizes it; needs the ``gguf`` package). Text (``--text FILE``, default
the Lee corpus shipped with gensim) is tokenized once: perplexity is scored on its first
``--eval-tokens`` tokens (windows of ``--window``) and calibration uses the ``--calib-windows``
windows after them, so the scored text is never seen in calibration. Steps, each with a progress bar:

    load -> quantize (lowbit.quantize_llm: block-by-block GPTQ + AWQ + hmse clip, tied int8 head; or
    --method w8a8 / int8 / rtn) -> perplexity fp32 and quantized -> decode speed (batch 1) -> --out

``--out`` gets ``model_<method>.pt`` (state dict, ``torch.load(weights_only=True)``) and
``report.json`` / ``report.md``: perplexity, size (MB, tied tensors once), decode tokens/s.

>>> p = build_parser_into(__import__("argparse").ArgumentParser().add_subparsers())
>>> p.parse_args(["m.gguf", "--bits", "8"]).bits
8
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .common import CLIError, count, cpus, progress, stage
from .gguf_file import check_gguf
from .measure import state_bytes
from .output import OutputFolder, check_inputs_outside, strict_json

__all__ = ["build_parser_into", "run", "LLM_METHODS"]

LLM_METHODS = ("weight-only", "rtn", "int8", "w8a8")


def _group_size(text: str) -> int:
    """``--group-size``: a positive integer or -1 (per channel), else a message naming the value."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0 and v != -1:
        raise argparse.ArgumentTypeError(f"{v} must be a positive number of input features or -1 (per channel)")
    return v


def build_parser_into(sub: Any) -> argparse.ArgumentParser:
    """Add the ``quantize-llm`` subcommand to an argparse subparsers object; return its parser."""
    q = sub.add_parser("quantize-llm", help="int4/int8 weight-only or W8A8 quantization of a causal LM (HF dir or .gguf)")
    q.add_argument("model", help="Hugging Face causal-LM directory or .gguf file")
    q.add_argument("--method", default="weight-only", choices=LLM_METHODS,
                   help="weight-only: GPTQ+AWQ (default); rtn: rounding only; int8: int8 weight-only; w8a8: dynamic "
                        "int8 activations x int8 weights with SmoothQuant")
    q.add_argument("--bits", type=int, default=None, choices=(4, 8),
                   help="weight-only / rtn weight bits (default 4); int8 and w8a8 are 8-bit")
    q.add_argument("--group-size", dest="group_size", type=_group_size, default=None,
                   help="input features per weight group (-1: per channel); must divide every layer's input features "
                        "(default: 128, halved for a layer it does not divide, which is said)")
    q.add_argument("--no-awq", dest="awq", action="store_false", help="skip the AWQ scale search")
    q.add_argument("--head", default=None, choices=("int8", "int4", "none"),
                   help="lm_head / tied embedding (default int8; w8a8 leaves it float)")
    q.add_argument("--text", help="plain-text file for calibration and perplexity (default: the Lee corpus)")
    q.add_argument("--eval-tokens", dest="eval_tokens", type=count(2), default=2048)
    q.add_argument("--calib-windows", dest="calib_windows", type=count(1), default=8)
    q.add_argument("--window", type=count(2), default=512)
    q.add_argument("--speed-tokens", dest="speed_tokens", type=count(0), default=32,
                   help="new tokens timed per decode (0: skip the timing; else at least 2)")
    q.add_argument("--threads", type=count(0, cpus()), default=0,
                   help=f"torch threads, at most the {cpus()} CPUs (0: torch's default)")
    q.add_argument("--out", default="lowbit-out")
    q.add_argument("--quiet", action="store_true")
    q.add_argument("--traceback", action="store_true", help="let unexpected errors raise with their traceback")
    return q


def _load(path: str) -> tuple[Any, nn.Module]:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise CLIError(f"quantize-llm needs transformers: pip install transformers ({e})") from None
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        check_gguf(p)  # magic, header, every tensor's type and extent: named here, not by gguf's reshape errors
        kw: dict[str, Any] = {"gguf_file": p.name}
        p = p.parent
    elif p.is_dir() and (p / "config.json").is_file():
        kw = {}
        if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                                "vocab.json", "spiece.model")):
            raise CLIError(f"MODEL {path!r} holds no tokenizer (tokenizer.json / tokenizer_config.json / "
                           "tokenizer.model); save one beside the weights (tokenizer.save_pretrained(dir))")
    else:
        raise CLIError(f"MODEL {path!r} is neither a .gguf file nor a Hugging Face model directory (config.json)")
    try:
        with stage(f"loading {path}"):
            tok = AutoTokenizer.from_pretrained(str(p), **kw)
            model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32, **kw).eval()
    except CLIError as e:
        if kw:  # the GGUF reader's own errors (struct / numpy reshape) do not say the file is short or damaged
            raise CLIError(f"{e} (is {Path(path).name} a complete, uncorrupted GGUF file?)") from e.__cause__
        raise
    return tok, model


def _text(path: str | None) -> str:
    if path is None:
        from ..data import load_lee_corpus
        with stage("loading the Lee corpus (pip install gensim, or pass --text)"):
            return "\n".join(load_lee_corpus()[0])
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise CLIError(f"--text {path}: {e.strerror or e}") from None


@torch.no_grad()
def _ppl(model: nn.Module, ids: torch.Tensor, window: int, quiet: bool, desc: str) -> float:
    n = ids.numel() // window
    nll = 0.0
    for w in progress(ids[: n * window].reshape(n, window), desc, n, quiet):
        logits = model(w[None]).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
    mean = nll / (n * (window - 1))
    return math.exp(mean) if mean < 709.0 else math.inf  # float64: float32's exp overflowed above a mean NLL of ~88.7


@torch.no_grad()
def _decode_tok_s(model: nn.Module, prompt: torch.Tensor, new: int) -> float:
    def gen(k: int) -> float:
        t = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=k, min_new_tokens=k,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t
    gen(2)
    steps = [(gen(new) - gen(1)) / (new - 1) for _ in range(3)]
    return 1.0 / statistics.median(steps)


def run(args: argparse.Namespace) -> int:
    """The ``quantize-llm`` command (errors raise ``CLIError``)."""
    import lowbit as Q

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_tokens < args.window or args.window < 2 or args.calib_windows < 1:
        raise CLIError(f"--eval-tokens {args.eval_tokens} must hold one --window {args.window} (>= 2) and "
                       f"--calib-windows {args.calib_windows} must be >= 1")
    if args.speed_tokens == 1:
        raise CLIError("--speed-tokens 1: the decode timing needs at least 2 new tokens (0 skips it)")
    # flags the chosen method does not read are refused, not ignored
    # (--group-size parses to None, so an explicit 128 with int8 / w8a8 is told from the default; -1 is what they do)
    # (--head parses to None too: w8a8 leaves the head float, so even an explicit --head int8 is refused there)
    eight = args.method in ("int8", "w8a8")
    ignored = [f"--group-size {args.group_size}"] * (eight and args.group_size not in (None, -1))
    ignored += [f"--head {args.head}"] * (args.method == "w8a8" and args.head is not None)
    ignored += ["--no-awq"] * (eight and not args.awq)  # (their recipes run no AWQ: the flag changed nothing)
    if ignored:
        why = ["int8 and w8a8 weights are per channel"] * any(f.startswith("--group-size") for f in ignored)
        why += ["w8a8 quantizes the decoder blocks' Linears and leaves the head float"] * any(
            f.startswith("--head") for f in ignored)
        why += ["AWQ runs with --method weight-only and rtn only"] * ("--no-awq" in ignored)
        raise CLIError(f"{' and '.join(ignored)}: --method {args.method} does not use "
                       f"{'them' if len(ignored) > 1 else 'it'} ({'; '.join(why)})")
    if args.bits is not None and args.bits != 8 and args.method in ("int8", "w8a8"):  # (given: its parsed default is None)
        raise CLIError(f"--bits {args.bits} with --method {args.method}: its weights are 8-bit (for {args.bits}-bit "
                       "weights use --method weight-only or rtn)")
    if args.bits is None:
        args.bits = 4
    if args.head is None:
        args.head = "int8"
    check_inputs_outside(args.out, {"MODEL": args.model, "--text": args.text})
    with OutputFolder(args.out) as folder:
        text = _text(args.text)  # (a missing --text is named before the model loads)
        tok, fp32 = _load(args.model)
        ids = torch.tensor(tok(text).input_ids)
        need = args.eval_tokens + args.calib_windows * args.window
        if ids.numel() < need:
            raise CLIError(f"the text has {ids.numel()} tokens; --eval-tokens + --calib-windows x --window need {need}")
        ev = ids[: args.eval_tokens]
        calib = [ids[args.eval_tokens + i * args.window: args.eval_tokens + (i + 1) * args.window][None]
                 for i in range(args.calib_windows)]
        say(f"lowbit: {args.method} on {args.model}: {len(calib)} x {args.window} calibration tokens")
        t0 = time.perf_counter()
        with stage(f"--method {args.method}"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            head = None if args.head == "none" else args.head
            if args.method == "w8a8":
                qm = Q.quantize_w8a8(fp32, calib)
            elif args.method == "int8":
                qm = Q.quantize_llm(fp32, calib, bits=8, group_size=-1, method="rtn", awq=False, head=head,
                                    symmetric=True, clip="rtn", progress=not args.quiet)
            else:
                qm = Q.quantize_llm(fp32, calib, bits=args.bits, group_size=args.group_size, awq=args.awq, head=head,
                                    method="gptq" if args.method == "weight-only" else "rtn", progress=not args.quiet)
        quant_s = time.perf_counter() - t0
        for w in caught:  # what changed the recipe (e.g. a group size that does not divide a layer) is said, once
            if "group_size" in str(w.message) or "group size" in str(w.message):
                say(f"lowbit: {w.message}")
                break
        rows = []
        with stage("measuring"):
            for name, m in (("fp32", fp32), (args.method, qm)):
                row = {"model": name, "ppl": _ppl(m, ev, args.window, args.quiet, f"perplexity {name}"),
                       "size_mb": state_bytes(m) / 2**20}
                if args.speed_tokens > 1:
                    row["decode_tok_s"] = _decode_tok_s(m, ids[None, :64], args.speed_tokens)
                rows.append(row)
        base = rows[0]
        for r in rows:
            r["ppl_vs_fp32"] = r["ppl"] / base["ppl"] - 1
            if "decode_tok_s" in r:
                r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
        lines = ["| model | perplexity | Δ vs fp32 | size (MB) | decode tok/s (batch 1) | speed-up |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['ppl']:.3f} | {100 * r['ppl_vs_fp32']:+.2f} % | {r['size_mb']:.1f} | "
                  + (f"{r['decode_tok_s']:.1f} | {r['speedup']:.2f}x |" if "decode_tok_s" in r else "not timed | - |")
                  for r in rows]
        table = "\n".join(lines)
        print(table)
        groups = sorted({m._g if m._g != m.in_features else -1 for m in qm.modules() if hasattr(m, "_g")})
        bits = 8 if args.method in ("int8", "w8a8") else args.bits
        report = {"model": args.model, "method": args.method, "bits": bits,
                  "group_size": (-1 if args.method in ("int8", "w8a8") else groups[0] if len(groups) == 1 else groups),
                  "quantize_s": quant_s, "eval_tokens": (args.eval_tokens // args.window) * args.window,
                  "window": args.window,
                  "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
        with stage(f"writing --out {args.out}"):
            d = folder.staging
            torch.save(qm.state_dict(), d / f"model_{args.method.replace('-', '_')}.pt")
            (d / "report.json").write_text(strict_json(report) + "\n")
            (d / "report.md").write_text(f"# lowbit quantize-llm\n\n{args.model}, {args.method}\n\n{table}\n")
        written = folder.commit()
    say(f"lowbit: wrote {', '.join(written)} to {args.out}")
    return 0
