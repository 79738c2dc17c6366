"""Shared timing machinery for the lowbit benchmarks: interleaved rounds, an idleness gate, JSON output.

Method (the one of ``shared/reference/perf_cpu.md``):

* every method's call count ``n`` is calibrated so that one sample takes at least ``min_time``;
* all methods then run **interleaved** for ``rounds`` rounds, the order reversed every other round,
  so that a change of machine load hits every method alike;
* before each round we wait (at most ``max_wait`` s) until the *other* processes use less than
  ``max_load`` CPUs, measured from ``/proc/stat`` (busy jiffies of the whole machine) minus this
  process's own ``utime + stime`` (``/proc/self/stat``); the load during the round is measured the
  same way and a round is **clean** when it stayed below ``max_load``;
* before each sample a 64 MiB buffer is rewritten, so that every sample starts from the same cold caches: without
  it the method that follows fp32 (whose weights flush the last-level cache) starts every other round colder than
  the rest (1×4096²: lowbit static 713 µs after fp32, 643-656 µs elsewhere, session 26);
* reported: per method the median time over clean rounds (all rounds when fewer than 3 were clean,
  flagged ``noisy``), and a speed-up as the **median of the per-round paired ratios**
  ``t_base / t_method`` (> 1: the method is faster), which cancels most of a slow drift in load.

Every benchmark prints ``isa_line()`` (or its own ISA line) first. Those built on ``add_common_args`` take
``--quick`` for a smoke run and ``--out NAME``; results go to ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"
_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_jiffies() -> tuple[float, float] | None:
    """``(busy jiffies of all CPUs, this process's jiffies)`` or ``None`` off Linux."""
    try:
        with open("/proc/stat") as f:
            cpu = [float(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            me = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0.0)  # idle + iowait
    busy = sum(cpu[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is in user)
    return busy, float(me[11]) + float(me[12])  # utime, stime


class LoadMeter:
    """CPUs used by *other* processes between ``start()`` and ``stop()`` (``nan`` if unknown)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._j0: tuple[float, float] | None = None

    def start(self) -> None:
        self._t0, self._j0 = time.perf_counter(), _busy_jiffies()

    def stop(self) -> float:
        j1, dt = _busy_jiffies(), time.perf_counter() - self._t0
        if self._j0 is None or j1 is None or dt <= 0:
            return float("nan")
        return max(0.0, ((j1[0] - self._j0[0]) - (j1[1] - self._j0[1])) / _TCK / dt)


def other_load(window: float = 0.25) -> float:
    """Load of the other processes over ``window`` seconds, in CPUs."""
    m = LoadMeter()
    m.start()
    time.sleep(window)
    return m.stop()


def wait_idle(max_load: float, max_wait: float, window: float = 0.25) -> float:
    """Wait until ``other_load() < max_load`` or ``max_wait`` seconds passed; return the last load seen."""
    deadline = time.perf_counter() + max_wait
    while True:
        load = other_load(window)
        if not load >= max_load or time.perf_counter() >= deadline:  # nan counts as idle
            return load


@dataclass
class Timing:
    """Per-round seconds per call for each method, and the other processes' load during each round."""

    times: dict[str, list[float]]
    loads: list[float]
    max_load: float
    clean: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clean = [not (ld >= self.max_load) for ld in self.loads]

    @property
    def n_clean(self) -> int:
        return sum(self.clean)

    @property
    def noisy(self) -> bool:
        return self.n_clean < 3

    def _rounds(self) -> list[int]:
        idx = [i for i, c in enumerate(self.clean) if c]
        return idx if len(idx) >= 3 else list(range(len(self.loads)))

    def median(self, name: str) -> float:
        """Median seconds per call over the clean rounds (all rounds if fewer than 3 were clean)."""
        return statistics.median(self.times[name][i] for i in self._rounds())

    def ratio(self, base: str, name: str) -> float:
        """Median over rounds of ``t_base / t_name`` (> 1: ``name`` is faster than ``base``)."""
        return statistics.median(self.times[base][i] / self.times[name][i] for i in self._rounds())

    def spread(self, name: str) -> float:
        """(max - min) / median of ``name``'s per-round times over the rounds used: a noise figure."""
        v = [self.times[name][i] for i in self._rounds()]
        return (max(v) - min(v)) / statistics.median(v)

    def summary(self, base: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"rounds": len(self.loads), "clean_rounds": self.n_clean, "noisy": self.noisy,
                               "other_load_median": statistics.median(self.loads) if self.loads else None,
                               "methods": {}}
        for k in self.times:
            row: dict[str, Any] = {"ms": self.median(k) * 1e3, "spread": self.spread(k)}
            if base is not None and base in self.times:
                row["speedup_vs_" + base] = self.ratio(base, k)
            out["methods"][k] = row
        return out


_FLUSH: list[torch.Tensor] = []


def round_bar(n: int, desc: str = "rounds") -> Any:
    """``range(n)`` with a progress bar on stderr (every timing loop a user waits on shows where it is; stdout keeps
    the tables). ``LOWBIT_BENCH_QUIET=1`` turns the bars off.

    >>> list(round_bar(3, "demo"))
    [0, 1, 2]
    """
    quiet = os.environ.get("LOWBIT_BENCH_QUIET", "").strip() not in ("", "0")
    return tqdm(range(n), desc=desc, file=sys.stderr, leave=False, mininterval=0.5, disable=quiet)


def _flush() -> None:
    """Rewrite a 64 MiB buffer (made on first use): past any last-level cache, so the next sample starts cold."""
    if not _FLUSH:
        _FLUSH.append(torch.zeros(64 << 20, dtype=torch.uint8))
    _FLUSH[0].add_(1)


def bench(methods: dict[str, Callable[[], Any]], rounds: int = 7, min_time: float = 0.02,
          max_load: float = 0.15, max_wait: float = 3.0, gate: bool = True,
          clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Time ``methods`` interleaved for ``rounds`` rounds (see the module docstring). ``clock``: wall time by
    default; ``time.thread_time`` (this thread's CPU time) suits one-thread runs on a loaded machine."""
    if not methods:
        raise ValueError("bench: methods is empty")
    if rounds < 1 or min_time <= 0:
        raise ValueError(f"bench: rounds={rounds!r} must be >= 1 and min_time={min_time!r} > 0")
    counts: dict[str, int] = {}
    with torch.inference_mode():
        for k, f in methods.items():
            f()
            f()
            t = clock()
            f()
            counts[k] = max(1, int(min_time / max(clock() - t, 1e-9)))
        names = list(methods)
        times: dict[str, list[float]] = {k: [] for k in names}
        loads: list[float] = []
        meter = LoadMeter()
        for r in round_bar(rounds, f"bench {'/'.join(names)[:40]}"):
            if gate:
                wait_idle(max_load, max_wait)
            meter.start()
            for k in names if r % 2 == 0 else names[::-1]:
                f, n = methods[k], counts[k]
                _flush()
                t = clock()
                for _ in range(n):
                    f()
                times[k].append((clock() - t) / n)
            loads.append(meter.stop())
    return Timing(times, loads, max_load)


def machine() -> dict[str, Any]:
    """CPU model, family, the ISA flags that matter for int8, versions, date (UTC)."""
    info: dict[str, Any] = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        kv = dict(ln.split(":", 1) for ln in lines if ":" in ln)
        kv = {k.strip(): v.strip() for k, v in kv.items()}
        flags = set(kv.get("flags", "").split())
        info.update(cpu=kv.get("model name", "?"), family=kv.get("cpu family", "?"), model=kv.get("model", "?"),
                    isa={f: f in flags for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                                                 "amx_int8")})
    except OSError:
        info["cpu"] = platform.processor()
    try:  # lowbit's C row passes: built, and which bodies (AVX2 + FMA or scalar), or why not
        from lowbit import native
        info["lowbit_native"] = native.reason()
        from lowbit import runtime
        info["heap"] = "kept (keep_freed_memory)" if runtime._state["applied"] else "glibc defaults"
    except ImportError:
        pass
    return info


def isa_line() -> str:
    """The one line every benchmark prints first (the team rule): CPU, the int8 ISA flags it has, torch's CPU
    capability, and whether oneDNN runs VNNI here (``has_vnni``, which honours an ``ONEDNN_MAX_CPU_ISA`` cap)."""
    mach = machine()
    flags = " ".join(k for k, v in mach.get("isa", {}).items() if v) or "no AVX2"
    try:
        from lowbit.kernels import onednn
        vnni = f" | VNNI (oneDNN) {onednn.has_vnni()}"
    except ImportError:
        vnni = ""
    return f"ISA: {mach.get('cpu', '?')} | {flags} | torch cpu capability {mach['cpu_capability']}{vnni} | torch {mach['torch']}"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (thread counts, rounds, sizes), else argparse's error naming the value."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return v


def _finite(text: str, zero_ok: bool) -> float:
    """A finite number > 0 (``zero_ok``: >= 0), else argparse's error naming the value."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 <= v if zero_ok else 0 < v) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number {'>=' if zero_ok else '>'} 0")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds per sample, a load limit)."""
    return _finite(text, False)


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (seconds to wait)."""
    return _finite(text, True)


def mkn(text: str) -> tuple[int, int, int]:
    """argparse type: ``"16x768x3072"`` -> ``(16, 768, 3072)``, three integers >= 1."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not MxKxN with positive integers, e.g. 16x768x3072")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` plus ``machine()`` to ``benchmarks/results/<name>.json`` (``name`` with or without the
    ``.json`` suffix, as ``--out`` is given; an absolute ``name`` is that path, e.g. a scratch file); return the path."""
    path = RESULTS / f"{name.removesuffix('.json')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1, default=str) + "\n")
    return path


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table; floats printed with 3 significant digits."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


class _KeepFreedMemory(argparse.Action):
    """``--keep-freed-memory``: ``lowbit.keep_freed_memory()`` as the arguments are parsed, before anything is timed
    (process-wide: every method of the run gains alike; ``machine()["heap"]`` records it)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        from lowbit import keep_freed_memory

        setattr(namespace, self.dest, keep_freed_memory())


def add_common_args(parser: Any) -> None:
    parser.add_argument("--keep-freed-memory", action=_KeepFreedMemory, nargs=0, default=False,
                        help="glibc keeps memory freed by tensors for reuse (lowbit.keep_freed_memory): no page "
                             "faults on the next call's tensors; every method of the run alike")
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument("--min-time", type=positive_float, default=0.02, help="seconds per sample (calibrated call count)")
    parser.add_argument("--max-load", type=positive_float, default=0.15, help="other processes' CPUs for a clean round")
    parser.add_argument("--max-wait", type=nonnegative_float, default=3.0, help="seconds to wait for idleness per round")
    parser.add_argument("--quick", action="store_true", help="smoke run: few shapes, 3 rounds")
    parser.add_argument("--out", default=None, help="results name (default: the script's)")


def _fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def tables(names: Sequence[str] = ("linear", "conv", "e2e")) -> str:
    """Markdown tables (speed-ups, median of per-round ratios) from ``benchmarks/results/<name>.json``."""
    parts = []
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        mach = d["machine"]
        parts.append(f"### {name} — {mach['date']}, {mach.get('cpu', '?')} (family {mach.get('family', '?')}), "
                     f"torch {mach['torch']}")
        if name.startswith(("linear", "conv")):
            base = "fp32 eager" if name.startswith("linear") else "fp32 NCHW"
            runs = d["runs"]
            methods = list(runs[0]["methods"])
            for threads in sorted({r["threads"] for r in runs}):
                rows = []
                for r in (r for r in runs if r["threads"] == threads):
                    shape = f"{r['M']}×{r['K']}×{r['N']}" if "M" in r else f"batch {r['batch']}"
                    rows.append([shape, f"{r['clean_rounds']}/{r['rounds']}", f"{r['other_load_median']:.2f}",
                                 f"{r['methods'][base]['ms']:.3f}"]
                                + [_fmt_x(r["methods"][m].get(f"speedup_vs_{base}")) for m in methods[1:]])
                parts.append(f"\n{threads} thread(s): speed-up vs {base} (×, > 1 faster)\n")
                parts.append(md_table(["shape", "clean", "load", f"{base} ms"] + methods[1:], rows))
            errs = {m: v.get("rel_err") for m, v in runs[-1]["methods"].items()}
            parts.append("\nrel. error vs fp32 (last shape): "
                         + ", ".join(f"{m} {e:.4f}" for m, e in errs.items() if e is not None))
        elif name.startswith("e2e"):
            for part in ("smallcnn", "minilm"):
                blk = d.get(part)
                if not blk:
                    continue
                acc = blk.get("accuracy") or blk.get("cosine_to_fp32")
                for r in blk["runs"]:
                    rows = [[m, f"{v['ms']:.1f}", _fmt_x(v.get("speedup_vs_fp32")), f"{acc.get(m, float('nan')):.4f}"]
                            for m, v in r["methods"].items()]
                    parts.append(f"\n{part}, {r['threads']} thread(s), clean rounds {r['clean_rounds']}/{r['rounds']}, "
                                 f"other load {r['other_load_median']:.2f}\n")
                    metric = blk.get("metric", "cosine to fp32")
                    parts.append(md_table(["model", "ms", "speed-up vs fp32", metric], rows))
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    import sys as _sys
    print(tables(_sys.argv[1:] or ("linear", "conv", "e2e")))
