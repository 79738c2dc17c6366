"""lowbit.HistogramObserver vs torch.ao's: observe time, calculate_qparams time, L2 error.

Run: ``python benchmarks/histogram_observer.py [--rounds 9] [--numel 1000000] [--threads 1 2] [--accuracy-only]
[--out PATH]`` (prints the ISA first).

Timing: for each thread count (``--threads``, default 1 and 2) and each round, fresh observers of both libraries see the
same 1M-element float32 normal batches, interleaved (the order alternates every round); a batch's
observe time is a round's median, and ``calculate_qparams`` is timed the same way. Reported: medians
over rounds and the median of the per-round ratios (lowbit / torch.ao; < 1 is faster).

Accuracy: on each distribution, both observers see the same batches (one warm batch + 3 more; the
"grow" streams widen the range every batch), then the mean squared error of ``fake_quantize(x)``
with each observer's qparams is measured on all observed data (lower is better), for
per-tensor affine quint8 and per-tensor symmetric qint8. Results go to
``benchmarks/results/histogram_observer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.ao.quantization.observer import HistogramObserver as AOHistogramObserver
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.observer.histogram import HistogramObserver

warnings.filterwarnings("ignore")

SCHEMES = {  # name: (lowbit qscheme, lowbit qdtype, torch qscheme, torch dtype)
    "affine_quint8": (Q.per_tensor_affine, Q.quint8, torch.per_tensor_affine, torch.quint8),
    "symmetric_qint8": (Q.per_tensor_symmetric, Q.qint8, torch.per_tensor_symmetric, torch.qint8),
}


def streams(numel: int) -> dict[str, Callable[[int, torch.Generator], torch.Tensor]]:
    t3 = torch.distributions.StudentT(torch.tensor(3.0))

    def student_t(i: int, g: torch.Generator) -> torch.Tensor:
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        return t3.sample((numel,))

    return {
        "normal": lambda i, g: torch.randn(numel, generator=g),
        "student_t3": student_t,
        "relu": lambda i, g: torch.relu(torch.randn(numel, generator=g)),
        "grow_normal": lambda i, g: torch.randn(numel, generator=g) * (1 + i),
        "grow_relu": lambda i, g: torch.relu(torch.randn(numel, generator=g) * (1 + i) + 0.2 * i),
        "lognormal": lambda i, g: torch.randn(numel, generator=g).exp(),
        # values on a lattice: k / 128 over [-8, 8] puts every value on a bin edge of the 2048 bins
        # (torch.histc's binning decides which bin); small integers, as after an upstream quantized layer
        "lattice": lambda i, g: torch.randint(-1024, 1025, (numel,), generator=g) / 128.0,
        "small_int": lambda i, g: torch.randint(0, 9, (numel,), generator=g).float(),
    }


def l2(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qdtype: Q.QDtype) -> float:
    fq = Q.fake_quantize(x, scale.reshape(()), zp.reshape(()), qdtype.quant_min, qdtype.quant_max)
    return (fq - x).pow(2).mean().item()


def accuracy(numel: int, n_batches: int = 4) -> list[dict]:
    rows = []
    for name, make in tqdm(streams(numel).items(), desc="L2 error", file=sys.stdout, leave=False):
        g = torch.Generator().manual_seed(1234)
        batches = [make(i, g) for i in range(n_batches)]
        x = torch.cat(batches)
        for scheme, (qs, qd, tqs, tqd) in SCHEMES.items():
            ours, ao = HistogramObserver(qscheme=qs, qdtype=qd), AOHistogramObserver(dtype=tqd, qscheme=tqs)
            for b in batches:
                ours(b)
                ao(b)
            mm = Q.calculate_qparams(x.min(), x.max(), qs, qd)
            e_ours, e_ao = l2(x, *ours.calculate_qparams(), qd), l2(x, *ao.calculate_qparams(), qd)
            e_mm = l2(x, *mm, qd)
            rows.append(dict(data=name, scheme=scheme, lowbit=e_ours, torch_ao=e_ao, minmax=e_mm, ratio=e_ours / e_ao))
    return rows


def _time(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def timing(numel: int, rounds: int, threads: int, batches_per_round: int = 5) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(numel, generator=g) for _ in range(batches_per_round + 1)]
    obs_t: dict[str, list[float]] = {"lowbit": [], "torch_ao": []}
    calc_t: dict[str, list[float]] = {"lowbit": [], "torch_ao": []}
    for r in tqdm(range(rounds + 1), desc=f"timing, {threads} thread(s)", file=sys.stdout, leave=False):  # round 0: warm-up
        mk = {"lowbit": HistogramObserver, "torch_ao": AOHistogramObserver}
        order = ["lowbit", "torch_ao"] if r % 2 == 0 else ["torch_ao", "lowbit"]
        obs = {k: mk[k]() for k in order}
        per = {k: [] for k in order}
        for b in data:
            for k in order:
                per[k].append(_time(lambda o=obs[k], b=b: o(b)))
        calc = {k: statistics.median(_time(obs[k].calculate_qparams) for _ in range(3)) for k in order}
        if r:
            for k in order:
                obs_t[k].append(statistics.median(per[k][1:]))  # steady state (first batch seeds the range)
                calc_t[k].append(calc[k])
    ratio = lambda d: statistics.median(a / b for a, b in zip(d["lowbit"], d["torch_ao"]))  # noqa: E731
    med = lambda d: {k: statistics.median(v) * 1e3 for k, v in d.items()}  # noqa: E731
    return dict(threads=threads, observe_ms=med(obs_t), observe_ratio=ratio(obs_t),
                calculate_qparams_ms=med(calc_t), calculate_qparams_ratio=ratio(calc_t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=common.positive_int, default=9)
    p.add_argument("--numel", type=common.positive_int, default=1_000_000)
    p.add_argument("--threads", type=common.positive_int, nargs="+", default=[1, 2], help="thread counts of the timing")
    p.add_argument("--accuracy-only", action="store_true", help="skip the timing part (prints, writes nothing)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "histogram_observer.json")
    args = p.parse_args()
    print(common.isa_line(), flush=True)

    load = os.getloadavg()[0]
    times = [] if args.accuracy_only else [timing(args.numel, args.rounds, t) for t in args.threads]
    print(f"\nTiming, {args.numel:,}-element float32 batches, median of {args.rounds} interleaved rounds "
          f"(load average {load:.1f} at start; the machine is shared)")
    print(f"{'threads':>7} | {'observe lowbit':>14} {'torch.ao':>9} {'ratio':>6} | "
          f"{'calc lowbit':>11} {'torch.ao':>9} {'ratio':>6}")
    for t in times:
        o, c = t["observe_ms"], t["calculate_qparams_ms"]
        print(f"{t['threads']:>7} | {o['lowbit']:>11.2f} ms {o['torch_ao']:>6.2f} ms {t['observe_ratio']:>6.2f} | "
              f"{c['lowbit']:>8.2f} ms {c['torch_ao']:>6.2f} ms {t['calculate_qparams_ratio']:>6.2f}")

    torch.set_num_threads(1)
    acc = accuracy(args.numel)
    print("\nL2 error (MSE of fake_quantize vs x on all observed data; ratio < 1: lowbit better)")
    print(f"{'data':>12} {'scheme':>16} | {'lowbit':>10} {'torch.ao':>10} {'min/max':>10} | {'ratio':>6}")
    for r in acc:
        print(f"{r['data']:>12} {r['scheme']:>16} | {r['lowbit']:>10.4e} {r['torch_ao']:>10.4e} "
              f"{r['minmax']:>10.4e} | {r['ratio']:>6.3f}")

    if args.accuracy_only:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=common.machine(), numel=args.numel, rounds=args.rounds,
                                        torch=torch.__version__, load=load, timing=times, l2=acc), indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
