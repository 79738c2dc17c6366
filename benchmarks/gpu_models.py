"""Converted lowbit models moved to CUDA: do they run, match the CPU model, and how fast are they?

Run on a GPU machine: ``python benchmarks/gpu_models.py`` (about a minute); ``--dry-run`` runs the same
script on CPU (tiny batches) to check it end to end. Writes ``gpu_models.json`` to ``--out-dir``.

Models (random weights: nothing is downloaded), each converted on CPU, then ``.to(device)``:
  SmallCNN (``lowbit.examples``) static int8 via ``quantize_ptq(recipe="default")`` — batch 256;
  an MLP stack (4 × Linear 1024→4096→1024, GELU) under ``quantize_dynamic`` (per-token int8) and
  ``quantize_weight_only`` (int4 g128, int8 per channel) — 2048 tokens.
For each: the largest |device − CPU| output difference relative to the output's scale, the argmax (CNN)
agreement between device and CPU, the relative error to fp32, and the time per forward of fp32, bf16
and the lowbit model on the device (CUDA events, medians of interleaved rounds; speed-up = median of
per-round fp32/method ratios). Then ``torch.compile`` of each lowbit model on the device: ran /
failed (the exception's first line), and whether it gave the eager outputs.
Progress: one line per model and per step.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpu  # noqa: E402

import lowbit as Q  # noqa: E402
from lowbit.examples import SmallCNN  # noqa: E402


def timer(device: torch.device, f: Callable[[], Any], reps: int) -> float:
    """Seconds per call over ``reps`` calls (``gpu.timer``: CUDA events on CUDA)."""
    return gpu.timer(device)(f, reps)


def mlp(d: int, h: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for _ in range(layers)])


def floats(out: Any) -> torch.Tensor:
    return (out.dequantize() if hasattr(out, "dequantize") else out).float()


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def case(name: str, fp: nn.Module, qm: nn.Module, x: torch.Tensor, device: torch.device, a: argparse.Namespace) -> dict:
    print(f"[{name}] checking device vs CPU", flush=True)
    row: dict[str, Any] = {"model": name, "batch": tuple(x.shape)}
    with torch.inference_mode():
        ref = fp(x).float()
        cpu = floats(qm(x))
        fpd, qd = copy.deepcopy(fp).to(device), copy.deepcopy(qm).to(device)
        xd = x.to(device)
        try:
            dev = floats(qd(xd)).cpu()
        except Exception as e:  # a device path that does not run is the finding
            row["device_error"] = first_line(e)
            traceback.print_exc()
            return row
        scale = float(cpu.abs().amax()) or 1.0
        row["max_diff_vs_cpu_rel"] = float((dev - cpu).abs().amax()) / scale
        row["bit_equal_to_cpu"] = bool(torch.equal(dev, cpu))
        row["rel_err_vs_fp32"] = float((dev - ref).norm() / ref.norm())
        if ref.dim() == 2 and ref.shape[1] == 10:
            row["argmax_agree_cpu"] = float((dev.argmax(1) == cpu.argmax(1)).float().mean())
        bf = copy.deepcopy(fp).to(device).bfloat16()
        xb = xd.bfloat16()
        meth = {"fp32": lambda: fpd(xd), "bf16": lambda: bf(xb), "lowbit": lambda: qd(xd)}
        print(f"[{name}] timing fp32 / bf16 / lowbit on {device.type}", flush=True)
        times: dict[str, list[float]] = {k: [] for k in meth}
        for f in meth.values():
            for _ in range(a.warmup):
                f()
        for r in range(a.rounds):
            for k in (list(meth) if r % 2 == 0 else list(meth)[::-1]):
                times[k].append(timer(device, meth[k], a.reps))
        row["ms"] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row["speedup_vs_fp32"] = {k: statistics.median(f32 / t for f32, t in zip(times["fp32"], v)) for k, v in times.items()}
        print(f"[{name}] torch.compile on {device.type}", flush=True)
        try:
            torch._dynamo.reset()
            cm = torch.compile(qd)
            got = floats(cm(xd)).cpu()
            row["compile"] = {"ran": True, "equal_to_eager": bool(torch.equal(got, dev)),
                              "max_diff_rel": float((got - dev).abs().amax()) / scale}
            ct = [timer(device, lambda: cm(xd), a.reps) for _ in range(a.rounds)]
            row["compile"]["ms"] = statistics.median(ct) * 1e3
        except Exception as e:
            row["compile"] = {"ran": False, "error": first_line(e)}
    print(f"[{name}] {json.dumps(row)}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny batches: checks the script only")
    p.add_argument("--rounds", type=common.positive_int, default=5)
    p.add_argument("--reps", type=common.positive_int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args()
    if a.dry_run:
        device, nb, nt, a.rounds, a.reps, a.warmup = torch.device("cpu"), 8, 16, 2, 2, 1
        d, h, layers = 64, 256, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_models.py: no CUDA device (use --dry-run to check the script on CPU)")
        device, nb, nt, d, h, layers = torch.device("cuda"), 256, 2048, 1024, 4096, 4
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    res: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                           "torch": torch.__version__, "dry_run": a.dry_run,
                           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)", "runs": [],
                           "host": common.machine()}
    host = res["host"]
    print(f"{res['device']} | host {host.get('cpu')} | ISA {host.get('isa')} | torch {torch.__version__}", flush=True)
    cnn = SmallCNN().eval()
    x = torch.randn(nb, 1, 28, 28)
    print("[SmallCNN] quantize_ptq on CPU", flush=True)
    q_cnn, _ = Q.quantize_ptq(cnn, [x[i:i + 4] for i in range(0, min(nb, 64), 4)], recipe="default")
    res["runs"].append(case("SmallCNN static", cnn, q_cnn, x, device, a))
    net = mlp(d, h, layers).eval()
    xt = torch.randn(nt, d)
    print("[MLP] quantize_dynamic / quantize_weight_only on CPU", flush=True)
    models = {"MLP dynamic int8": Q.quantize_dynamic(copy.deepcopy(net), {nn.Linear}),
              "MLP weight-only int4 g128": Q.quantize_weight_only(net, bits=4, group_size=min(128, d)),
              "MLP weight-only int8": Q.quantize_weight_only(net, bits=8, group_size=min(128, d))}
    for name, qm in models.items():
        res["runs"].append(case(name, net, qm, xt, device, a))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("gpu_models_dry_run.json" if a.dry_run else "gpu_models.json")
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
