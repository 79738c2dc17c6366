"""Why torch.ao's cached conv route (``conv_plan._ao_route``) made the next conv slower: the call path's warmth.

Run: ``python benchmarks/conv_route_warmth.py [--calls 1500] [--forwards 80] [--no-model]`` (prints the ISA first;
~1 min). 1 thread, thread CPU time (``time.thread_time_ns``) per call. The methods are interleaved call by call in a
shuffled order (not in rounds), so load on a shared machine falls on all of them alike; medians.

1. A depthwise 3x3 conv (144 channels, 56², batch 1; lowbit's planned ``onednn::qconv_pointwise`` call, which builds
   its primitive descriptor every call) and its twin on torch.ao's cached primitive (a pack made under the ``onednn``
   engine, the only torch.ao engine that packs depthwise convs for oneDNN), each timed right after one of: a small
   conv (16 -> 16, 4²) through ``qconv_pointwise``, the same conv through torch.ao's cached route, 50 µs of Python.
   A call is ~10-25 µs cheaper right after a call through its own path (session 50, AMX Xeon): the cost is in the
   host code around the kernel (``ONEDNN_VERBOSE``'s kernel time moved ~1 µs), not in the data, the kernel or
   state torch.ao's op leaves behind (50 µs of Python costs the same as a torch.ao call).
2. The whole converted MobileNetV2 at batch 1 (``compiled.MobileNetV2``): the route off (the default), on for the
   dense / pointwise convs (``AO_MACS`` 32M: each depthwise conv then runs after a call through the other path),
   on for every conv (the depthwise ones too, by the onednn-engine pack above: one path throughout), and torch.ao.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.kernels import conv_plan as CP
from lowbit.kernels.spec import ConvSpec
from lowbit.nn.quantized import ConvReLU2d

warnings.filterwarnings("ignore")


_AO_PACK = CP._ao_pack  # (the plan's own, kept: the every-conv variant patches CP._ao_pack with _pack_onednn)


def _pack_onednn(w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec) -> Any:
    """``conv_plan._ao_pack`` under torch.ao's ``onednn`` engine (x86 packs depthwise convs for fbgemm)."""
    return _AO_PACK(w, w_scale, bias, spec, "onednn")


def _any_geometry(weight_shape: torch.Size, spec: ConvSpec, relu: bool, post: str, clamp: bool) -> bool:
    """``conv_plan._ao_geometry`` without the not-depthwise and groups <= 100 rules (for the onednn-engine pack)."""
    return all(d == 1 for d in spec.dilation) and not clamp and post == ("relu" if relu else "none")


def _planned(mod: torch.nn.Module, x: Any, macs: int, every_conv: bool = False) -> torch.nn.Module:
    """A copy of ``mod`` whose conv plans are made (by a first call on ``x``) with ``AO_MACS = macs``."""
    saved = CP.AO_MACS, CP._ao_pack, CP._ao_geometry
    try:
        CP.AO_MACS = macs
        if every_conv:
            CP._ao_pack, CP._ao_geometry = _pack_onednn, _any_geometry
        m = copy.deepcopy(mod)
        with torch.no_grad():
            m(x), m(x)  # (the second call: the pack, made on use)
        return m
    finally:
        CP.AO_MACS, CP._ao_pack, CP._ao_geometry = saved


def _conv(cin: int, cout: int, k: int, groups: int, seed: int) -> ConvReLU2d:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (cout, cin // groups, k, k), generator=g, dtype=torch.int8)
    w = Q.QTensor(codes, torch.rand(cout, generator=g) / 2000 + 1e-4, torch.zeros(cout, dtype=torch.long), Q.qint8, 0)
    mod = ConvReLU2d(cin, cout, k, 1, (k - 1) // 2, groups=groups)
    mod.set_weight_bias(w, torch.randn(cout, generator=g))
    mod.set_output_grid(0.05, 0, Q.quint8)
    return mod


def _codes(c: int, hw: int, seed: int) -> Q.QTensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (1, c, hw, hw), generator=g, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    return Q.QTensor(q, torch.tensor(0.02), torch.tensor(0), Q.quint8)


def _interleaved(meths: dict[str, Callable[[], float]], calls: int) -> dict[str, float]:
    """Median µs of each method, the methods called in a new shuffled order each cycle."""
    res: dict[str, list[float]] = {k: [] for k in meths}
    keys, rng = list(meths), random.Random(0)
    for _ in common.round_bar(calls, "warmth cycles"):
        rng.shuffle(keys)
        for k in keys:
            res[k].append(meths[k]())
    return {k: statistics.median(v) for k, v in res.items()}


def after_paths(calls: int) -> None:
    x_small, x = _codes(16, 4, 3), _codes(144, 56, 1)
    small, dw = _conv(16, 16, 1, 1, 5), _conv(144, 144, 3, 144, 2)
    small_pw, small_ao = _planned(small, x_small, 0), _planned(small, x_small, 32_000_000)
    dw_pw, dw_ao = _planned(dw, x, 0), _planned(dw, x, 32_000_000, every_conv=True)
    assert small_ao(x_small)._tq is not None and small_pw(x_small)._tq is None and dw_ao(x)._tq is not None
    assert torch.equal(dw_ao(x).int_repr(), dw_pw(x).int_repr())

    def python_50us() -> None:
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < 50_000:
            pass
    before = {"a qconv_pointwise call": lambda: small_pw(x_small), "a torch.ao cached call": lambda: small_ao(x_small),
              "50 us of Python": python_50us}
    meths: dict[str, Callable[[], float]] = {}
    for dname, d in (("dw, qconv_pointwise", dw_pw), ("dw, torch.ao cached", dw_ao)):
        for bname, b in before.items():
            def f(b: Callable[[], Any] = b, d: torch.nn.Module = d) -> float:
                b()
                t0 = time.thread_time_ns()
                d(x)
                return (time.thread_time_ns() - t0) / 1e3
            meths[f"{dname:20s} after {bname}"] = f
    for k, v in _interleaved(meths, calls).items():
        print(f"{k:56s} {v:7.1f} µs", flush=True)


def mobilenet(forwards: int) -> None:
    import compiled as C

    torch.manual_seed(0)
    fp, ao_fp = C.MobileNetV2().eval(), C.MobileNetV2(ao=True).eval()
    ao_fp.load_state_dict(fp.state_dict())
    lb, ao = C._static_pair(fp, ao_fp, [torch.randn(4, 3, 224, 224) for _ in range(2)], fp.fusion_groups())
    x = torch.randn(1, 3, 224, 224)
    models = {"route off (default)": _planned(lb, x, 0), "route on, dense convs": _planned(lb, x, 32_000_000),
              "route on, every conv": _planned(lb, x, 32_000_000, every_conv=True), "torch.ao x86": ao}
    with torch.no_grad():
        ref = models["route off (default)"](x)
        for k in list(models)[1:3]:
            assert torch.equal(models[k](x), ref), k

        def timed(m: torch.nn.Module) -> Callable[[], float]:
            def f() -> float:
                t0 = time.thread_time_ns()
                m(x)
                return (time.thread_time_ns() - t0) / 1e3
            return f
        med = _interleaved({k: timed(m) for k, m in models.items()}, forwards)
    base = med["route off (default)"]
    for k, v in med.items():
        print(f"MobileNetV2 b1 {k:22s} {v / 1e3:7.2f} ms   off / this {base / v:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1500, help="cycles of the depthwise experiment")
    p.add_argument("--forwards", type=int, default=80, help="cycles of the whole-model experiment")
    p.add_argument("--no-model", action="store_true", help="skip the whole MobileNetV2")
    a = p.parse_args()
    if a.calls < 1 or a.forwards < 1:
        p.error(f"--calls and --forwards must be positive, got {a.calls}, {a.forwards}")
    print(common.isa_line() + " | 1 thread | per call, thread time", flush=True)
    torch.set_num_threads(1)
    if CP._ao_ops is None or not CP._ao_geometry(torch.Size([8, 8, 1, 1]), ConvSpec(2, (1, 1), (0, 0), (1, 1), 1),
                                                 True, "relu", False):
        sys.exit("conv_route_warmth.py needs torch.ao's cached route here (oneDNN on an uncapped AVX-512 VNNI CPU)")
    after_paths(a.calls)
    if not a.no_model:
        mobilenet(a.forwards)


if __name__ == "__main__":
    main()
