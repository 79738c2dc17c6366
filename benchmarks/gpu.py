"""CUDA (Hopper) int8 vs bf16 at LLM shapes: ``torch._int_mm``, bf16 GEMM and lowbit Linear. One script.

Run on a GPU machine: ``python benchmarks/gpu.py`` (a few minutes on an H100/H200); on any machine
``python benchmarks/gpu.py --dry-run`` runs tiny shapes on CPU to check the script end to end.
Writes ``benchmarks/results/gpu.json`` (or ``--out-dir``), with the date and the device name.

Shapes: M ∈ {1, 16, 512, 2048, 4096} × (K, N) ∈ {4096², 4096×14336, 14336×4096}. Methods:
  bf16 GEMM (``F.linear``, the baseline) | fp16 GEMM | int8 ``_int_mm`` raw (s8 × s8 → s32; CUDA needs
  M > 16, so smaller M is zero-padded to 32 rows — counted in the time) | lowbit static Linear (qint8 in,
  quint8 out, ``int_mm`` backend + the compiled epilogue of ``kernels.cuda_fused``) | lowbit dynamic Linear
  (per-token, float in/out) | both again with ``LOWBIT_CUDA_FUSED=0`` (the torch-op epilogues: the A/B).
Timing: CUDA events, ``--warmup`` calls then ``--reps`` calls per sample, ``--rounds`` samples
interleaved across methods (order alternating); the median is reported, the speed-up is the
median of per-round ratios against bf16, and TOP/s uses 2·M·K·N. Error: relative to fp32.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
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
import common  # noqa: E402

MS = [1, 16, 512, 2048, 4096]
KN = [(4096, 4096), (4096, 14336), (14336, 4096)]


def timer(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """Seconds per call of ``f`` over ``reps`` calls (CUDA events, or perf_counter on CPU)."""
    def run(f: Callable[[], Any], reps: int) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                f()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t) / reps
    return run


def _unfused(mod: nn.Module, x: Any) -> Any:
    """``mod(x)`` with ``kernels.cuda_fused`` switched off (``LOWBIT_CUDA_FUSED=0``): the A/B of the fused epilogues."""
    old = os.environ.get("LOWBIT_CUDA_FUSED")
    os.environ["LOWBIT_CUDA_FUSED"] = "0"
    try:
        return mod(x)
    finally:
        if old is None:
            del os.environ["LOWBIT_CUDA_FUSED"]
        else:
            os.environ["LOWBIT_CUDA_FUSED"] = old


def methods_for(m: int, k: int, n: int, device: torch.device) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    import lowbit as Q
    from lowbit.nn.quantized import Linear as QLinear
    from lowbit.nn.quantized.dynamic import Linear as DLinear

    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
    x32 = torch.randn(m, k, generator=g)
    ref = lin(x32).detach()
    lin = lin.to(device)
    x = x32.to(device)
    xb, wb, bb = x.bfloat16(), lin.weight.detach().bfloat16(), lin.bias.detach().bfloat16()
    xh, wh, bh = x.half(), lin.weight.detach().half(), lin.bias.detach().half()
    w = lin.weight.detach()
    sw = w.abs().amax(1) / 127
    wq = Q.quantize_per_channel(w, sw, torch.zeros_like(sw, dtype=torch.long), 0, Q.qint8)
    rows = max(m, 32) if device.type == "cuda" else m  # CUDA _int_mm: M > 16
    xi = torch.randint(-127, 128, (rows, k), dtype=torch.int8, device=device)
    wi_t = wq.int_repr().t()  # (K, N) column-major view
    s_in = float(x.abs().amax()) / 127
    qlin = QLinear.from_reference(lin, wq, float(ref.abs().amax()) / 127, 128, Q.quint8)
    xq = Q.QTensor(Q.quantize(x, s_in, 0, Q.qint8), s_in, 0, Q.qint8)
    dlin = DLinear.from_float(lin.cpu()).to(device)
    lin.to(device)
    meth: dict[str, Callable[[], Any]] = {
        "bf16": lambda: F.linear(xb, wb, bb),
        "fp16": lambda: F.linear(xh, wh, bh),
        "int8 _int_mm raw": lambda: torch._int_mm(xi, wi_t),
        "lowbit static": lambda: qlin(xq),
        "lowbit dynamic": lambda: dlin(x),
        "lowbit static, torch-op epilogue": lambda: _unfused(qlin, xq),
        "lowbit dynamic, torch-op epilogue": lambda: _unfused(dlin, x),
    }
    err: dict[str, float] = {}
    with torch.inference_mode():
        for name, f in (("bf16", meth["bf16"]), ("fp16", meth["fp16"]), ("lowbit dynamic", meth["lowbit dynamic"]),
                        ("lowbit static", lambda: qlin(xq).dequantize()), ("int8 _int_mm raw", meth["int8 _int_mm raw"])):
            try:
                y = f().float().cpu()
            except Exception as e:  # a method that does not run on this device is reported, not fatal
                print(f"  {name} failed at {m}x{k}x{n}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                del meth[name]
                continue
            if name != "int8 _int_mm raw":
                err[name] = float((y - ref).norm() / ref.norm())
    return meth, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks the script only")
    p.add_argument("--rounds", type=common.positive_int, default=5)
    p.add_argument("--reps", type=common.positive_int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args()
    if a.dry_run:
        device, shapes, a.rounds, a.reps, a.warmup = torch.device("cpu"), [(1, 64, 32), (40, 96, 64)], 2, 2, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu.py: no CUDA device (use --dry-run to check the script on CPU)")
        device, shapes = torch.device("cuda"), [(m, k, n) for m in MS for k, n in KN]
        torch.backends.cuda.matmul.allow_tf32 = False
    run = timer(device)
    res: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "dry_run": a.dry_run, "runs": [], "host": common.machine()}
    host = res["host"]
    print(f"{res['device']} | host {host.get('cpu')} | ISA {host.get('isa')} | torch {torch.__version__}", flush=True)
    for m, k, n in shapes:
        meth, err = methods_for(m, k, n, device)
        times: dict[str, list[float]] = {name: [] for name in meth}
        with torch.inference_mode():
            for f in meth.values():
                for _ in range(a.warmup):
                    f()
            names = list(meth)
            for r in common.round_bar(a.rounds, "gpu rounds"):
                for name in names if r % 2 == 0 else names[::-1]:
                    times[name].append(run(meth[name], a.reps))
        row: dict[str, Any] = {"M": m, "K": k, "N": n, "methods": {}}
        for name, ts in times.items():
            med = statistics.median(ts)
            row["methods"][name] = {
                "ms": med * 1e3, "tops": 2 * m * k * n / med / 1e12,
                "speedup_vs_bf16": statistics.median(b / t for b, t in zip(times["bf16"], ts)),
                "rel_err": err.get(name)}
        res["runs"].append(row)
        print(f"{m:5d}x{k}x{n:<6d} " + " ".join(f"{nm}={v['ms']:.3f}ms({v['speedup_vs_bf16']:.2f}x)"
                                                 for nm, v in row["methods"].items()), flush=True)
        del meth
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("gpu_dry_run.json" if a.dry_run else "gpu.json")
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
