"""Linear layers: fp32 / bf16 / torch.ao / ONNX Runtime / lowbit int8, interleaved, per thread count.

Run: ``python benchmarks/linear.py [--quick] [--threads 1 2] [--rounds 7]`` (method: ``common.py``).

``python benchmarks/linear.py --vs-ao [--dynamic-only] [--threads 1] [--rounds 9]`` is the issue #10 table instead: the
converted models the workflows build (``QuantStub → Linear → DeQuantStub``: lowbit with its default
qconfig and with torch.ao's x86 recipe ``get_default_qconfig("x86")``, torch.ao with its x86 default; and
``quantize_dynamic`` of an ``nn.Linear`` with lowbit's per-token default, its 7-bit per-token recipe
``get_dynamic_qconfig(reduce_range=True)`` and torch.ao's x86 recipe ``get_dynamic_qconfig(backend="x86")``;
torch.ao's on the x86 engine), eager, at M ∈ {1, 16, 128,
512} × (K, N) ∈ {768², 768×3072, 4096²}: medians of interleaved rounds and lowbit / torch.ao speed ratios
(> 1: lowbit faster), ISA printed; writes ``benchmarks/results/linear_vs_ao.json``.
Shapes: M ∈ {1, 16, 128, 512} × (K, N) ∈ {768², 768×3072, 3072×768, 4096²}. Every method is a whole
float-in/float-out layer unless named "kernel". Speed-ups are against fp32 eager (``F.linear``,
MKL sgemm) and against the best fp32 (oneDNN packed ``mkldnn._linear_pointwise``). Writes
``benchmarks/results/linear.json``. Relative error vs fp32 is recorded per method.

Methods:
  fp32 eager | fp32 oneDNN packed | bf16 | ao dynamic (x86, reduce_range 7-bit per-tensor act) |
  ao static (x86/fbgemm, reduce_range, quantize→qlinear→dequantize) | ORT fp32 / ORT dynamic int8 |
  lowbit static u8 (8-bit act; split into 2 oneDNN calls on non-VNNI CPUs) |
  lowbit static u7 (7-bit act, the speed recipe: 1 exact call) | lowbit dynamic (per-token u8) |
  kernel u7 (one oneDNN qlinear call, u8 codes ≤ 127, float out): the raw GEMM, with GOP/s.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.kernels import onednn
from lowbit.nn.quantized import Linear as QLinear
from lowbit.nn.quantized.dynamic import Linear as DLinear

warnings.filterwarnings("ignore")
MS = [1, 16, 128, 512]
KN = [(768, 768), (768, 3072), (3072, 768), (4096, 4096)]
KN_VS_AO = [(768, 768), (768, 3072), (4096, 4096)]


def qweight(w: torch.Tensor) -> Q.QTensor:
    s = w.abs().amax(1) / 127
    return Q.quantize_per_channel(w, s, torch.zeros_like(s, dtype=torch.long), 0, Q.qint8)


def lowbit_static(lin: nn.Linear, x: torch.Tensor, qd: Q.QDtype) -> Callable[[], torch.Tensor]:
    y = lin(x)
    wq = qweight(lin.weight.detach())
    s_in = float(x.abs().amax()) * 2 / (qd.quant_max - qd.quant_min)
    z_in = (qd.quant_min + qd.quant_max + 1) // 2
    s_out = float(y.abs().amax()) * 2 / (qd.quant_max - qd.quant_min)
    m = QLinear.from_reference(lin, wq, s_out, z_in, qd)
    m.input_grid = (s_in, z_in, qd)
    return lambda: m(x).dequantize()


def ao_static(lin: nn.Linear, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    torch.backends.quantized.engine = "x86"
    w = lin.weight.detach()
    s = (w.abs().amax(1) / 127).double()
    wq = torch.quantize_per_channel(w, s, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(wq, lin.bias.detach())
    s_in, s_out = float(x.abs().amax()) / 63.5, float(lin(x).abs().amax()) / 63.5  # reduce_range: 7-bit
    return lambda: torch.ops.quantized.linear(torch.quantize_per_tensor(x, s_in, 64, torch.quint8), packed,
                                              s_out, 64).dequantize()


def ort_sessions(lin: nn.Linear, threads: int) -> dict[str, Any]:
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        return {}
    w = lin.weight.detach().t().contiguous().numpy()
    b = lin.bias.detach().numpy()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])], "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", w.shape[1]])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    tmp = Path("/tmp/lowbit_bench_lin.onnx")
    onnx.save(model, tmp)
    out: dict[str, Any] = {"ORT fp32": ort.InferenceSession(str(tmp), opts, providers=["CPUExecutionProvider"])}
    qtmp = Path("/tmp/lowbit_bench_lin_q.onnx")
    quantize_dynamic(str(tmp), str(qtmp), weight_type=QuantType.QInt8, per_channel=True)
    out["ORT dynamic int8"] = ort.InferenceSession(str(qtmp), opts, providers=["CPUExecutionProvider"])
    return out


def methods_for(m: int, k: int, n: int, threads: int) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    torch.manual_seed(0)
    lin = nn.Linear(k, n).eval()
    x = torch.randn(m, k)
    w, b = lin.weight.detach(), lin.bias.detach()
    w_dnnl = torch.ops.mkldnn._reorder_linear_weight(w, m)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    torch.backends.quantized.engine = "x86"
    ao_dyn = torch.ao.quantization.quantize_dynamic(nn.Sequential(lin), {nn.Linear}, dtype=torch.qint8)
    dyn = DLinear.from_float(lin)
    wq = qweight(w)
    packed = torch.ops.onednn.qlinear_prepack(wq.int_repr(), None)
    xq7 = torch.randint(0, 128, (m, k), dtype=torch.uint8)
    zpw = torch.zeros(n, dtype=torch.long)
    meth: dict[str, Callable[[], Any]] = {
        "fp32 eager": lambda: F.linear(x, w, b),
        "fp32 oneDNN packed": lambda: torch.ops.mkldnn._linear_pointwise(x, w_dnnl, b, "none", [], ""),
        "bf16": lambda: F.linear(xb, wb, bb),
        "ao dynamic": lambda: ao_dyn(x),
        "ao static": ao_static(lin, x),
        "lowbit static u8": lowbit_static(lin, x, Q.quint8),
        "lowbit static u7": lowbit_static(lin, x, Q.quint8.with_range(0, 127)),
        "lowbit dynamic": lambda: dyn(x),
        "kernel u7": lambda: torch.ops.onednn.qlinear_pointwise(xq7, 0.01, 64, packed, wq.scale, zpw, b, 1.0, 0,
                                                                torch.float32, "none", [], ""),
    }
    for name, sess in ort_sessions(lin, threads).items():
        xn = x.numpy()
        meth[name] = lambda s=sess, xn=xn: s.run(None, {"x": xn})
    with torch.inference_mode():
        ref = lin(x)
        err = {}
        for name, f in meth.items():
            if name.startswith("kernel"):
                continue
            y = f()
            y = torch.as_tensor(y[0]) if isinstance(y, list) else y
            err[name] = float((y.float() - ref).norm() / ref.norm())
    return meth, err


def converted_pair(m: int, k: int, n: int) -> tuple[torch.Tensor, dict[str, nn.Module]]:
    """fp32, lowbit / torch.ao static and dynamic models of one ``nn.Linear``: lowbit static with its default
    qconfig (8-bit activations) and with torch.ao's x86 recipe (``get_default_qconfig("x86")``: 7-bit
    activations), torch.ao static with its x86 default (the same recipe), on the x86 engine."""
    import torch.ao.quantization as aoq

    torch.manual_seed(0)
    lin, x = nn.Linear(k, n).eval(), torch.randn(m, k)
    preps = {name: Q.prepare(nn.Sequential(Q.QuantStub(), copy.deepcopy(lin), Q.DeQuantStub()).eval(), qc)
             for name, qc in (("lowbit static", Q.get_default_qconfig()),
                              ("lowbit static x86", Q.get_default_qconfig("x86")))}
    torch.backends.quantized.engine = "x86"
    ao = nn.Sequential(aoq.QuantStub(), copy.deepcopy(lin), aoq.DeQuantStub()).eval()
    ao.qconfig = aoq.get_default_qconfig("x86")
    aoq.prepare(ao, inplace=True)
    with torch.inference_mode():
        for prep in preps.values():
            prep(x)
        ao(x)
    aoq.convert(ao, inplace=True)
    def dyn(qconfig: Q.QConfig | None) -> nn.Module:
        spec = None if qconfig is None else {nn.Linear: qconfig}
        return Q.quantize_dynamic(nn.Sequential(copy.deepcopy(lin)), spec)

    return x, {"fp32": lin, **{name: Q.convert(prep) for name, prep in preps.items()}, "ao static": ao,
               "lowbit dynamic": dyn(None), "lowbit dynamic u7": dyn(Q.get_dynamic_qconfig(reduce_range=True)),
               "lowbit dynamic x86": dyn(Q.get_dynamic_qconfig(backend="x86")),
               "ao dynamic": aoq.quantize_dynamic(nn.Sequential(copy.deepcopy(lin)), {nn.Linear}, dtype=torch.qint8)}


def _vs_ao_shapes(a: argparse.Namespace) -> list[tuple[int, int, int]]:
    """The --vs-ao tables' shapes: ``--quick`` two of them, else every ``--ms`` × ``--kn``."""
    return [(16, 768, 768), (1, 768, 3072)] if a.quick else [(m, k, n) for k, n in (a.kn or KN_VS_AO) for m in a.ms]


def vs_ao(a: argparse.Namespace) -> None:
    """The issue #10 table: lowbit vs torch.ao, static and dynamic, eager, 12 shapes."""
    res: dict[str, Any] = {"vnni": onednn.has_vnni(), "runs": []}
    shapes = _vs_ao_shapes(a)
    for threads in a.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): median µs of interleaved rounds; ratio = torch.ao time / lowbit time (> 1: lowbit "
              "faster), median of per-round ratios (ratio of the best rounds)")
        print(common.md_table(["M×K×N", "clean", "load", "lowbit static", "lowbit static x86", "ao static",
                               "ratio default", "ratio x86", "lowbit dynamic", "ao dynamic", "ratio", "ratio dyn u7",
                               "ratio dyn x86", "fp32"], []))
        for m, k, n in shapes:
            x, mods = converted_pair(m, k, n)
            meth = {name: (lambda mod=mod, x=x: mod(x)) for name, mod in mods.items()}
            t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
            us = {name: t.median(name) * 1e6 for name in meth}
            st, s7 = t.ratio("ao static", "lowbit static"), t.ratio("ao static", "lowbit static x86")
            dy = t.ratio("ao dynamic", "lowbit dynamic")
            d7, dx = t.ratio("ao dynamic", "lowbit dynamic u7"), t.ratio("ao dynamic", "lowbit dynamic x86")
            # best-of-rounds ratios too: on a loaded machine the minimum is the least disturbed sample
            best = {name: min(v) for name, v in t.times.items()}
            st_b, s7_b = best["ao static"] / best["lowbit static"], best["ao static"] / best["lowbit static x86"]
            dy_b = best["ao dynamic"] / best["lowbit dynamic"]
            d7_b, dx_b = best["ao dynamic"] / best["lowbit dynamic u7"], best["ao dynamic"] / best["lowbit dynamic x86"]
            load = t.summary()["other_load_median"]
            print(f"| {m}×{k}×{n} | {t.n_clean}/{a.rounds} | {load:.2f} | {us['lowbit static']:.1f} | "
                  f"{us['lowbit static x86']:.1f} | {us['ao static']:.1f} | {st:.2f} ({st_b:.2f}) | {s7:.2f} ({s7_b:.2f}) | "
                  f"{us['lowbit dynamic']:.1f} | {us['ao dynamic']:.1f} | {dy:.2f} ({dy_b:.2f}) | {d7:.2f} ({d7_b:.2f}) | "
                  f"{dx:.2f} ({dx_b:.2f}) | "
                  f"{us['fp32']:.1f} |",
                  flush=True)
            res["runs"].append({"threads": threads, "M": m, "K": k, "N": n, "us": us, "static_ratio": st,
                                "static_x86_ratio": s7, "dynamic_ratio": dy, "dynamic_u7_ratio": d7,
                                "dynamic_x86_ratio": dx, "dynamic_u7_ratio_best": d7_b,
                                "dynamic_x86_ratio_best": dx_b, "static_ratio_best": st_b,
                                "static_x86_ratio_best": s7_b, "dynamic_ratio_best": dy_b, **t.summary()})
    print(common.write_results(a.out or "linear_vs_ao", res))


def vs_ao_dynamic(a: argparse.Namespace) -> None:
    """The issue #10 dynamic table alone (``--vs-ao --dynamic-only``): lowbit's three dynamic recipes vs torch.ao's
    dynamic Linear, 12 shapes; ratios are medians of per-round ratios and, in brackets, of the best rounds."""
    res: dict[str, Any] = {"vnni": onednn.has_vnni(), "runs": []}
    names = {"default": "lowbit dynamic", "u7": "lowbit dynamic u7", "x86": "lowbit dynamic x86"}
    for threads in a.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): ratio = torch.ao dynamic time / lowbit time (> 1: lowbit faster)")
        print(common.md_table(["M×K×N", "clean", "load", "ao dynamic µs", "default µs", "u7 µs", "x86 µs",
                               "ratio default", "ratio u7", "ratio x86", "fp32 µs"], []))
        for m, k, n in _vs_ao_shapes(a):
            x, mods = converted_pair(m, k, n)
            keep = ("fp32", "ao dynamic", *names.values())
            meth = {name: (lambda mod=mods[name], x=x: mod(x)) for name in keep}
            t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
            us = {name: t.median(name) * 1e6 for name in meth}
            best = {name: min(v) for name, v in t.times.items()}
            ratio = {key: t.ratio("ao dynamic", name) for key, name in names.items()}
            ratio_b = {key: best["ao dynamic"] / best[name] for key, name in names.items()}
            load = t.summary()["other_load_median"]
            print(f"| {m}×{k}×{n} | {t.n_clean}/{a.rounds} | {load:.2f} | {us['ao dynamic']:.1f} | "
                  + " | ".join(f"{us[name]:.1f}" for name in names.values()) + " | "
                  + " | ".join(f"{ratio[key]:.2f} ({ratio_b[key]:.2f})" for key in names) + f" | {us['fp32']:.1f} |",
                  flush=True)
            res["runs"].append({"threads": threads, "M": m, "K": k, "N": n, "us": us, "ratio": ratio,
                                "ratio_best": ratio_b, **t.summary()})
    print(common.write_results(a.out or "linear_vs_ao_dynamic", res))


def _kn(text: str) -> tuple[int, int]:
    """``"384x1536"`` → ``(384, 1536)``; anything else is an argparse error naming the value."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--kn {text!r}: expected KxN with positive integers, e.g. 384x1536")
    return int(parts[0]), int(parts[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--ms", type=common.positive_int, nargs="+", default=MS, help="the M values to run")
    p.add_argument("--vs-ao", action="store_true", help="the issue #10 lowbit-vs-torch.ao table (12 shapes)")
    p.add_argument("--dynamic-only", action="store_true", help="with --vs-ao: the dynamic recipes only")
    p.add_argument("--kn", type=_kn, nargs="+", default=None, metavar="KxN",
                   help="the K×N weight shapes instead of the built-in ones, e.g. --kn 384x1536 1536x384 (MiniLM)")
    a = p.parse_args()
    if a.dynamic_only and not a.vs_ao:
        p.error("--dynamic-only needs --vs-ao")
    if a.quick:
        a.rounds = min(a.rounds, 3)
    print(common.isa_line(), flush=True)
    if a.vs_ao and a.dynamic_only:
        vs_ao_dynamic(a)
        return
    if a.vs_ao:
        vs_ao(a)
        return
    shapes = [(m, k, n) for m in a.ms for k, n in (a.kn or KN)]
    if a.quick:
        shapes = [(16, 768, 768), (128, 768, 3072)]
    res: dict[str, Any] = {"vnni": onednn.has_vnni(), "runs": []}
    for threads in a.threads:
        torch.set_num_threads(threads)
        for m, k, n in shapes:
            meth, err = methods_for(m, k, n, threads)
            t = common.bench(meth, a.rounds, a.min_time, a.max_load, a.max_wait)
            summ = t.summary("fp32 eager")
            for name, row in summ["methods"].items():
                row["speedup_vs_best_fp32"] = t.ratio("fp32 oneDNN packed", name)
                row["rel_err"] = err.get(name)
                row["gops"] = 2 * m * k * n / (row["ms"] * 1e-3) / 1e9
            res["runs"].append({"threads": threads, "M": m, "K": k, "N": n, **summ})
            r = summ["methods"]
            print(f"t={threads} {m:4d}x{k}x{n:<5d} clean {t.n_clean}/{a.rounds} load {summ['other_load_median']:.2f} | "
                  + " ".join(f"{kk}={v['speedup_vs_fp32 eager']:.2f}" for kk, v in r.items()), flush=True)
    print(common.write_results(a.out or "linear", res))


if __name__ == "__main__":
    main()
