"""Where a compiled lowbit model's call spends its time beyond the eager model's (1 thread, thread time).

Run: ``python benchmarks/compiled_overhead.py [--cases smallcnn linear] [--rounds 31]`` (prints the ISA).

Per case (SmallCNN b64 static; QuantStub → Linear 768² → DeQuantStub at 16 rows), interleaved, medians of
``time.thread_time_ns``:

- ``eager`` / ``compiled``: the converted model and ``torch.compile(model, fullgraph=True, dynamic=False)``;
- ``graph``: the compiled program's own call (``__compiled_fn_*``: AOT's runtime wrapper and inductor's ``call``: the
  custom ops, their ``assert_size_stride`` checks, inductor's float kernels); ``compiled - graph`` is dynamo's frame:
  the guards, ``OptimizedModule``'s call and the frame's bytecode;
- ``guards hot`` / ``guards cold``: the guard tree's ``check`` alone, right after another check / right after an
  eager call of the model (its caches evicted, as in a real call); ``guard entries``: how many dynamo built, and
  how many are tensors (one per graph input) and Python-level ``is`` checks (objects reached by two sources);
- the inductor program's lowbit op calls and ``assert_size_stride`` calls, and one such assert's cost.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._C._dynamo.guards import assert_size_stride
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.examples import SmallCNN


class _Net(nn.Module):
    """QuantStub → Linear → DeQuantStub with a ``forward`` of its own (a frame whose cache entry can be read)."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.quant, self.fc, self.dequant = Q.QuantStub(), lin, Q.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.quant(x)))


def build(case: str) -> tuple[nn.Module, torch.Tensor]:
    """The converted model (default qconfig, random calibration) and its input."""
    torch.manual_seed(0)
    if case == "smallcnn":
        m, calib, x = Q.fuse_modules(SmallCNN().eval(), SmallCNN.fusion_groups()), torch.randn(128, 1, 28, 28), \
            torch.randn(64, 1, 28, 28)
    else:
        m, x = _Net(nn.Linear(768, 768)).eval(), torch.randn(16, 768)
        calib = x
    p = Q.prepare(copy.deepcopy(m), Q.get_default_qconfig())
    with torch.inference_mode():
        p(calib)
    return Q.convert(p), x


def _median_us(fns: dict[str, Callable[[], Any]], rounds: int, spent: list[int], reps: int = 20) -> dict[str, float]:
    """Medians over ``rounds`` interleaved samples of ``reps`` calls each (order reversed every other round); with
    ``graph``: the compiled program's share of the ``compiled`` samples (``spent``, filled by its timing wrapper)."""
    t: dict[str, list[float]] = {k: [] for k in (*fns, "graph")}
    for r in common.round_bar(rounds, "overhead rounds"):
        for k, f in list(fns.items())[:: 1 if r % 2 == 0 else -1]:
            spent[0] = 0
            t0 = time.thread_time_ns()
            for _ in range(reps):
                f()
            t[k].append((time.thread_time_ns() - t0) / reps / 1e3)
            if k == "compiled":
                t["graph"].append(spent[0] / reps / 1e3)
    out = {k: statistics.median(v) for k, v in t.items()}
    out["frame (compiled - graph)"] = statistics.median(a - b for a, b in zip(t["compiled"], t["graph"], strict=True))
    return out


def overhead(case: str, rounds: int) -> dict[str, Any]:
    """The figures of the module doc for one case."""
    m, x = build(case)
    torch._dynamo.reset()
    entries: list[Any] = []

    def keep(es: list[Any]) -> list[bool]:
        entries.extend(es)
        return [True] * len(es)
    c = torch.compile(m, fullgraph=True, dynamic=False, options={"guard_filter_fn": keep})
    with torch.inference_mode():
        got, codes = run_and_get_code(c, x)
        assert torch.equal(got, m(x)), "compiled differs from eager"
        code = "\n".join(line for line in "\n".join(codes).splitlines() if not line.lstrip().startswith("#"))
        scope = vars(sys.modules[type(m).forward.__module__])
        name = next(k for k in scope if k.startswith("__compiled_fn"))
        inner, spent = scope[name], [0]

        def timed(*a: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return inner(*a)
            finally:
                spent[0] += time.thread_time_ns() - t0
        scope[name] = timed
        guard = _debug_get_cache_entry_list(type(m).forward.__code__)[0].guard_manager
        frame = {"self": m, "x": x}
        assert guard.check(frame)
        med = _median_us({"eager": lambda: m(x), "compiled": lambda: c(x)}, rounds, spent)
        scope[name] = inner
        hot, cold = [], []
        for _ in range(rounds * 5):
            t0 = time.thread_time_ns()
            guard.check(frame)
            hot.append(time.thread_time_ns() - t0)
            m(x)
            t0 = time.thread_time_ns()
            guard.check(frame)
            cold.append(time.thread_time_ns() - t0)
        med["guards hot"], med["guards cold"] = statistics.median(hot) / 1e3, statistics.median(cold) / 1e3
        t = torch.empty(64, 32, 14, 14).contiguous(memory_format=torch.channels_last)
        t0 = time.thread_time_ns()
        for _ in range(10000):
            assert_size_stride(t, (64, 32, 14, 14), (6272, 1, 448, 32))
        med["one assert_size_stride"] = (time.thread_time_ns() - t0) / 10000 / 1e3
    counts = {"guard entries": len(entries),
              "tensor guards": sum(e.guard_type == "TENSOR_MATCH" for e in entries),
              "object-identity guards (Python)": sum(e.guard_type == "DUPLICATE_INPUT"
                                                     and not isinstance(e.value, torch.Tensor) for e in entries),
              "lowbit op calls": code.count("= torch.ops.lowbit."),
              "assert_size_stride calls": code.count("assert_size_stride(") - code.count("assert_size_stride = ")}
    return {"us": med, "counts": counts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=["smallcnn", "linear"], choices=["smallcnn", "linear"])
    p.add_argument("--rounds", type=common.positive_int, default=31)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(common.isa_line(), flush=True)
    res = {}
    for case in a.cases:
        r = res[case] = overhead(case, a.rounds)
        print(f"{case}: " + " | ".join(f"{k} {v:.1f} us" for k, v in r["us"].items()))
        print(f"{case}: " + " | ".join(f"{k} {v}" for k, v in r["counts"].items()), flush=True)
    print(common.write_results("compiled_overhead", res))


if __name__ == "__main__":
    main()
