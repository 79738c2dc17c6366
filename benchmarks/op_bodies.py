"""Each lowbit op body of a compiled model against its eager twin, and the compiled ``qlinear``'s fast entry A/B.

Run: ``python benchmarks/op_bodies.py [smallcnn1 smallcnn64 minilm] [--rounds 11]`` (prints the ISA first). Per case,
1 thread, interleaved, medians of the rounds of thread CPU time: every lowbit op call of one compiled call (its
Python impl called with the very arguments the compiled program passed, recorded by ``sys.setprofile``), every lowbit
leaf module call of one eager call (``Quantize``, the convs, Linears, ``DeQuantize``: the twins), the whole model
eager and compiled; then, in a loop of their own (3 × rounds), compiled with ``qlinear``'s fast entries and with them
dropped before every call (``_arm_fast`` a no-op for them: the body before pt2py49), and the paired saving.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.examples import SmallCNN
from lowbit.pt2 import kernel_ops as K, module_ops as MO, quant_ops as QO
from lowbit.qtensor.layout import nchw_copy

IMPLS = {f.__code__: f for f in (K.qlinear, K.qconv_cfg, QO.quantize_op, QO.dequantize_op, MO.dynamic_linear,
                                 MO.qfunctional, MO._max_pool2d_codes, nchw_copy, MO.quantize_codes,
                                 MO.weight_only_linear)}


def build(case: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    if case.startswith("smallcnn"):
        m = Q.fuse_modules(SmallCNN().eval(), SmallCNN.fusion_groups())
        p = Q.prepare(copy.deepcopy(m), Q.get_default_qconfig())
        with torch.inference_mode():
            p(torch.randn(128, 1, 28, 28))
        return Q.convert(p), (torch.randn(int(case[8:]), 1, 28, 28),), {}
    import lowbit.data as D
    tok, model = D.load_minilm()
    docs = [f"sentence number {i} about the quantization of neural networks on CPUs" for i in range(32)]
    enc = tok(docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
    return Q.quantize_dynamic(copy.deepcopy(model)), (), {"input_ids": enc["input_ids"],
                                                         "attention_mask": enc["attention_mask"]}


def _op_calls(c: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> list[tuple[Any, list[Any]]]:
    calls: list[tuple[Any, list[Any]]] = []

    def prof(frame: Any, ev: str, arg: Any) -> None:
        if ev == "call" and frame.f_code in IMPLS and (frame.f_back is None or frame.f_back.f_code not in IMPLS):
            f = IMPLS[frame.f_code]
            calls.append((f, [frame.f_locals[v] for v in f.__code__.co_varnames[:f.__code__.co_argcount]]))
    sys.setprofile(prof)
    try:
        c(*a, **kw)
    finally:
        sys.setprofile(None)
    return calls


def run(case: str, rounds: int) -> None:
    m, a, kw = build(case)
    c = torch.compile(m, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for _ in range(3):
            c(*a, **kw)
        calls = _op_calls(c, a, kw)
        leaves: list[Any] = []
        hooks = [mod.register_forward_hook(lambda mod, i, o: leaves.append((mod, i))) for mod in m.modules()
                 if type(mod).__module__.startswith("lowbit") and not list(mod.children())]
        m(*a, **kw)
    for h in hooks:
        h.remove()

    fns = {f"op {i:02d} {f.__name__}": (lambda f=f, x=x: f(*x)) for i, (f, x) in enumerate(calls)}
    fns.update({f"eager {i:02d} {type(mod).__name__}": (lambda mod=mod, x=x: mod(*x)) for i, (mod, x) in enumerate(leaves)})
    fns.update({"whole eager": lambda: m(*a, **kw), "whole compiled": lambda: c(*a, **kw)})
    res: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    with torch.inference_mode():
        for r in range(rounds):
            for k in (keys if r % 2 == 0 else keys[::-1]):
                reps = 3 if k.startswith("whole") else 20
                t0 = time.thread_time_ns()
                for _ in range(reps):
                    fns[k]()
                res[k].append((time.thread_time_ns() - t0) / reps / 1e3)
    print(f"== {case} (us, median of {rounds} rounds)")
    for k, v in res.items():
        print(f"{statistics.median(v):10.1f}  {k}")
    if any(f is K.qlinear for f, _ in calls):
        on, off = _entry_ab(c, a, kw, rounds)
        d = statistics.median([x - y for x, y in zip(off, on, strict=True)])
        print(f"compiled with / without qlinear's fast entry: {statistics.median(on):.1f} / {statistics.median(off):.1f}"
              f" us, paired saving {d:.1f} us")


def _entry_ab(c: Any, a: tuple[Any, ...], kw: dict[str, Any], rounds: int) -> tuple[list[float], list[float]]:
    """The compiled call with ``qlinear``'s fast entries and without (dropped before every call, ``_arm_fast`` a no-op
    for them: the body before pt2py49), interleaved on their own (the op-body loop above evicts the caches); each
    variant is set and called twice before its timed calls."""
    real = K._arm_fast

    def set_variant(on: bool) -> None:
        K._arm_fast = real if on else (lambda cache, config, *r: None if isinstance(config, tuple)
                                       else real(cache, config, *r))
        for _, cache in list(K._CACHES.values()):
            for k in [k for k in cache if isinstance(k, tuple) and not on]:
                del cache[k]
    res: dict[bool, list[float]] = {True: [], False: []}
    try:
        with torch.inference_mode():
            for r in range(3 * rounds):
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    set_variant(on), c(*a, **kw), c(*a, **kw)
                    t0 = time.thread_time_ns()
                    for _ in range(5):
                        set_variant(on)
                        c(*a, **kw)
                    res[on].append((time.thread_time_ns() - t0) / 5 / 1e3)
    finally:
        K._arm_fast = real
    return res[True], res[False]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["smallcnn1", "smallcnn64"])
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(common.isa_line())
    for case in args.cases:
        run(case, args.rounds)


if __name__ == "__main__":
    main()
