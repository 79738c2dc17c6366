"""Instructions and simulated cache misses per call of the small-M Linear paths, under callgrind: load-independent.

Run: ``python benchmarks/instructions.py [--shapes 1x768x768 16x768x768] [--methods ...] [--out NAME]``; it starts
itself again under ``valgrind --tool=callgrind --cache-sim=yes`` (a few minutes: torch runs ~50x slower there) and
prints the ISA, then, per method, the instructions (``Ir``), L1 instruction-cache misses (``I1mr``) and L1 data-cache read misses
(``D1mr``) of one call. Each figure is differential: the events of ``n2`` calls minus those of ``n1`` calls, over
``n2 - n1``, so the start-up and the measuring calls themselves cancel; the counts are exact, whatever else runs on
the machine (other agents' load moves wall-clock timings by ±10-50 % on a shared 2-core box, not these).

Why the misses: after fbgemm's GEMV has swept a 512 KiB L2 with the weights, every op and every Python line of the
glue around it runs from L3; the time a call costs beyond its kernels follows the code it touches (``I1mr``) more
than its instruction count. Callgrind's caches are a model (L1 32 KiB 8-way, last level the host's L3; no L2), not
this CPU: read the figures as relative, method against method.

The methods are ``benchmarks/linear.py``'s models (``converted_pair``): lowbit static with torch.ao's x86 recipe
and with its default, torch.ao static x86, the dynamic Linear's default and per-token 7-bit recipes, torch.ao
dynamic. 1 thread.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ALL = ("lowbit static x86", "ao static", "lowbit static", "lowbit dynamic u7", "lowbit dynamic", "ao dynamic")


def _events(path: str) -> dict[str, int]:
    """The ``summary`` line of a callgrind dump, as ``{event: count}``."""
    names: list[str] = []
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                names = line.split()[1:]
            elif line.startswith(("summary:", "totals:")):
                return dict(zip(names, map(int, line.split()[1:])))
    raise RuntimeError(f"no summary line in callgrind dump {path}")


def _ctl(*args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(os.getpid())], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)


def _per_call(f: Any, prefix: str, n1: int, n2: int) -> dict[str, float]:
    """Events of one call of ``f``: (events of n2 calls - events of n1 calls) / (n2 - n1)."""
    for _ in range(20):
        f()
    totals = []
    for n in (n1, n2):
        gc.collect()  # (a collection inside one window would add its cost to that window only)
        gc.disable()
        _ctl("-z")
        for _ in range(n):
            f()
        before = set(glob.glob(prefix + "*"))
        _ctl("-d")
        gc.enable()
        new = sorted(set(glob.glob(prefix + "*")) - before, key=os.path.getmtime)
        if not new:
            raise RuntimeError("callgrind_control wrote no dump: is this process running under callgrind?")
        totals.append(_events(new[-1]))
    return {e: (totals[1][e] - totals[0][e]) / (n2 - n1) for e in totals[0]}


def child(a: argparse.Namespace) -> None:
    """The measuring process (under callgrind)."""
    import torch
    from tqdm import tqdm

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from linear import converted_pair

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)

    rows = []
    _ctl("-i", "on")
    for shape in a.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        x, mods = converted_pair(m, k, n)
        for name in tqdm(a.methods, desc=shape, file=sys.stderr):
            ev = _per_call(lambda mod=mods[name], x=x: mod(x), a.prefix, a.n1, a.n2)
            rows.append({"shape": shape, "method": name, **{e: ev[e] for e in ("Ir", "I1mr", "D1mr") if e in ev}})
    _ctl("-i", "off")
    Path(a.prefix + ".json").write_text(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x768x768", "16x768x768"], help="MxKxN")
    p.add_argument("--methods", nargs="+", default=list(ALL), choices=ALL)
    p.add_argument("--n1", type=int, default=30, help="calls of the first dump")
    p.add_argument("--n2", type=int, default=130, help="calls of the second dump")
    p.add_argument("--out", default=None, help="results name (default instructions); use one for scratch runs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prefix", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if not 0 < a.n1 < a.n2:
        p.error(f"need 0 < --n1 < --n2, got n1={a.n1}, n2={a.n2}")
    for s in a.shapes:
        parts = s.split("x")
        if len(parts) != 3 or not all(v.isdigit() and int(v) > 0 for v in parts):
            p.error(f"--shapes: {s!r} is not MxKxN with positive integers")
    if a.child:
        child(a)
        return
    missing = [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    if missing:
        sys.exit(f"instructions.py needs {' and '.join(missing)} (valgrind's callgrind) on PATH")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    print(common.isa_line() + " | 1 thread | per call, callgrind", flush=True)
    tmp = tempfile.mkdtemp(prefix="lowbit_cg_")
    prefix = os.path.join(tmp, "cg.out")
    cmd = ["valgrind", "-q", "--tool=callgrind", "--cache-sim=yes", "--instr-atstart=no", f"--callgrind-out-file={prefix}",
           sys.executable, __file__, "--child", "--prefix", prefix, "--n1", str(a.n1), "--n2", str(a.n2),
           "--shapes", *a.shapes, "--methods", *a.methods]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False)  # (tqdm's progress goes to stderr)
    if r.returncode != 0 or not os.path.exists(prefix + ".json"):
        sys.exit(f"the callgrind run failed (exit {r.returncode})")
    rows = json.loads(Path(prefix + ".json").read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    print(common.md_table(["M×K×N", "method", "K instructions", "I1 misses", "D1 read misses"],
                          [[r["shape"], r["method"], f"{r['Ir'] / 1e3:.1f}", f"{r.get('I1mr', 0):.0f}",
                            f"{r.get('D1mr', 0):.0f}"] for r in rows]))
    print(common.write_results(a.out or "instructions", {"threads": 1, "tool": "callgrind --cache-sim=yes",
                                                         "n1": a.n1, "n2": a.n2, "rows": rows}))


if __name__ == "__main__":
    main()
