"""Per-call cost of static int8 convs: lowbit's conv with its fast lane, without it (the full path), and torch.ao.

Run: ``python benchmarks/convlane.py [--batches 1 8] [--rounds 11] [--mobilenet]`` (prints the ISA first). Each layer is
the module alone on an 8-bit channels-last input (quantized in, quantized out): lowbit ``Conv2d`` / ``ConvReLU2d`` with
the lane (``kernels.lane.ConvLane``), a twin that never takes it (``_lane_call`` returns ``None``: the full path every
call), and torch.ao's x86 ``Conv2d`` / ``ConvReLU2d`` (depthwise: its fbgemm kernel). Per call: thread CPU time
(``time.thread_time_ns``), 1 thread, the methods interleaved in rounds (order reversed every other round), medians;
ratios are medians of the per-round paired ``t_ao / t_method`` (> 1: faster than torch.ao). ``--mobilenet``: the
whole converted MobileNetV2 (``compiled.MobileNetV2``, lowbit default recipe and torch.ao's x86 eager twin) at the
``--mobilenet-batches`` (default 1).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.ao.nn.intrinsic.quantized as aonniq
import torch.ao.nn.quantized as aonnq
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.nn.quantized import Conv2d as LConv
from lowbit.nn.quantized import ConvReLU2d as LConvReLU

warnings.filterwarnings("ignore")

LAYERS = {  # name: (c_in, c_out, kernel, stride, groups, H = W, relu)
    "3x3 64->64 56²": (64, 64, 3, 1, 1, 56, True),
    "1x1 24->144 56² (expand)": (24, 144, 1, 1, 1, 56, True),
    "1x1 144->24 56² (project)": (144, 24, 1, 1, 1, 56, False),
    "dw3x3 144 s1 56²": (144, 144, 3, 1, 144, 56, True),
    "dw3x3 144 s2 56²": (144, 144, 3, 2, 144, 56, True),
    "1x1 320->1280 7²": (320, 1280, 1, 1, 1, 7, True),
    "dw3x3 960 s1 7²": (960, 960, 3, 1, 960, 7, True),
    "1x1 16->16 8² (fixed costs)": (16, 16, 1, 1, 1, 8, False),
}


def _no_lane(m: nn.Module) -> nn.Module:
    for mod in m.modules():
        if isinstance(mod, LConv):
            mod._lane_call = lambda x: None  # type: ignore[method-assign]
    return m


def layer(cin: int, cout: int, k: int, stride: int, groups: int, hw: int, relu: bool,
          batch: int) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups).eval()
    x = torch.randn(batch, cin, hw, hw).relu().contiguous(memory_format=torch.channels_last)
    w = conv.weight.detach()
    s = w.abs().flatten(1).amax(1) / 127
    zp = torch.zeros(cout, dtype=torch.long)
    s_in = float(x.amax()) / 255
    with torch.no_grad():
        s_out = float(conv(x).abs().amax()) / 127.5
    m = (LConvReLU if relu else LConv).from_reference(conv, Q.quantize_per_channel(w, s, zp, 0, Q.qint8), s_out, 128)
    off = _no_lane(copy.deepcopy(m))
    xq = Q.quantize_per_tensor(x, s_in, 0, Q.quint8)
    torch.backends.quantized.engine = "x86"
    a = (aonniq.ConvReLU2d if relu else aonnq.Conv2d)(cin, cout, k, stride, (k - 1) // 2, groups=groups)
    a.set_weight_bias(torch.quantize_per_channel(w, s.double(), zp, 0, torch.qint8), conv.bias.detach())
    a.scale, a.zero_point = s_out, 128
    xa = torch.quantize_per_tensor(x, s_in, 0, torch.quint8)
    assert torch.equal(m(xq).int_repr(), off(xq).int_repr())
    return {"lane": lambda: m(xq), "full path": lambda: off(xq), "torch.ao": lambda: a(xa)}


def measure(meths: dict[str, Callable[[], Any]], rounds: int, sample_ns: float = 4e7) -> dict[str, list[float]]:
    """Per round, µs of thread CPU time per call for each method (interleaved, order reversed every other round)."""
    n = {}
    for k, f in meths.items():
        f(), f()
        t0 = time.thread_time_ns()
        f()
        n[k] = max(2, int(sample_ns / max(1, time.thread_time_ns() - t0)))
    res: dict[str, list[float]] = {k: [] for k in meths}
    keys = list(meths)
    for r in common.round_bar(rounds, "convlane rounds"):
        for k in keys if r % 2 == 0 else keys[::-1]:
            f, t0 = meths[k], time.thread_time_ns()
            for _ in range(n[k]):
                f()
            res[k].append((time.thread_time_ns() - t0) / n[k] / 1e3)
    return res


def report(name: str, res: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in res.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(res["torch.ao"], res[k])) for k in ("lane", "full path")}
    saved = statistics.median(o - la for o, la in zip(res["full path"], res["lane"]))
    unit, f = ("ms", 1e-3) if med["torch.ao"] > 5000 else ("µs", 1.0)
    print(f"{name:34s} full {med['full path'] * f:8.1f}  lane {med['lane'] * f:8.1f}  torch.ao {med['torch.ao'] * f:8.1f}"
          f" {unit} | lane saves {saved:6.1f} µs | ao/full {ratio['full path']:.3f}  ao/lane {ratio['lane']:.3f}",
          flush=True)


def mobilenet(rounds: int, batches: list[int]) -> None:
    import compiled as C

    torch.manual_seed(0)
    fp, ao_fp = C.MobileNetV2().eval(), C.MobileNetV2(ao=True).eval()
    ao_fp.load_state_dict(fp.state_dict())
    lb, ao = C._static_pair(fp, ao_fp, [torch.randn(4, 3, 224, 224) for _ in range(2)], fp.fusion_groups())
    off = _no_lane(copy.deepcopy(lb))
    for b in batches:
        x = torch.randn(b, 3, 224, 224)
        with torch.no_grad():
            assert torch.equal(lb(x), off(x))
            report(f"MobileNetV2 b{b} 224² (whole model)",
                   measure({"lane": lambda x=x: lb(x), "full path": lambda x=x: off(x), "torch.ao": lambda x=x: ao(x)},
                           rounds, 3e8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--mobilenet", action="store_true")
    p.add_argument("--mobilenet-batches", type=int, nargs="+", default=[1])
    a = p.parse_args()
    print(common.isa_line())
    torch.set_num_threads(1)
    for b in a.batches:
        for name, cfg in LAYERS.items():
            report(f"b{b} {name}", measure(layer(*cfg, b), a.rounds))
    if a.mobilenet:
        mobilenet(max(5, a.rounds // 2), a.mobilenet_batches)


if __name__ == "__main__":
    main()
