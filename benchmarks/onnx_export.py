"""ONNX export: fp32 torch / fp32 ORT / lowbit int8 eager / lowbit's exact and QDQ files in ORT / torch.ao, one table.

Run: ``python benchmarks/onnx_export.py [--threads 1] [--rounds 7] [--quick] [--out NAME]``. Prints the ISA line, then
one progress line per step, then one markdown table and writes ``benchmarks/results/NAME.json`` (default
``onnx_export``). Models (random weights; MobileNetV2 x0.5 has no ImageNet checkpoint), calibrated on their own
inputs:

* SmallCNN (``lowbit.examples``), eager workflow (fused conv-bn-relu), batch 32 of 1x28x28;
* MobileNetV2 width 0.5 (``lowbit.models``), graph mode (``quantize_ptq(recipe="default")``), batch 4 of 3x96x96;
* MLP 256 -> 512 -> 512 -> 10 with ReLUs, eager workflow, batch 64.

Methods: ``fp32 torch``; ``fp32 ORT`` (``torch.onnx.export`` of the float model); ``lowbit int8`` (eager);
``exact ORT`` (``to_onnx(exact=True)``: ORT's codes are lowbit's), ``exact x86 ORT`` (``exact="x86"``: the same
codes on x86 ORT, Conv requantization kept in ORT's NCHWc layout) and ``QDQ ORT`` (``to_onnx``: ORT's fused
QLinear kernels); ``torch.ao x86`` (torch.ao's eager / FX workflow on the x86 engine, default qconfig), where it runs.
Every ORT session runs ``--threads`` intra-op threads, ORT's full optimization level. Timing is ``common.bench``
(interleaved rounds, order reversed every other round, medians; the speed-up is the median of per-round ratios
against ``fp32 torch``, > 1 faster); at one thread it reads this thread's CPU time (``--clock wall`` for wall time).
Columns also give each file's node count (as written / as ORT runs it after its optimizer), its size, and the
largest output difference against ``lowbit int8`` (0: the same outputs, bit for bit).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import lowbit as Q  # noqa: E402
from lowbit.examples import SmallCNN  # noqa: E402
from lowbit.export import to_onnx  # noqa: E402
from lowbit.models import mobilenet_v2  # noqa: E402

METHODS = ("fp32 torch", "fp32 ORT", "lowbit int8", "exact ORT", "exact x86 ORT", "QDQ ORT", "torch.ao x86")
MODELS = ("SmallCNN", "MobileNetV2 x0.5", "MLP")


class MLP(nn.Module):
    def __init__(self, quant: nn.Module, dequant: nn.Module) -> None:
        super().__init__()
        self.quant, self.dequant = quant, dequant
        self.fc1, self.r1 = nn.Linear(256, 512), nn.ReLU()
        self.fc2, self.r2 = nn.Linear(512, 512), nn.ReLU()
        self.fc3 = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc3(self.r2(self.fc2(self.r1(self.fc1(self.quant(x)))))))


def _ao_eager(model: nn.Module, groups: list[list[str]], x: torch.Tensor) -> nn.Module:
    """torch.ao's eager workflow (x86 engine, its default qconfig) on ``model`` (torch.ao stubs / FloatFunctional)."""
    import torch.ao.quantization as aoq

    torch.backends.quantized.engine = "x86"
    model.eval().qconfig = aoq.get_default_qconfig("x86")
    model = aoq.fuse_modules(model, groups)
    aoq.prepare(model, inplace=True)
    with torch.inference_mode():
        model(x)
    return aoq.convert(model, inplace=True)


def smallcnn(batch: int) -> tuple[nn.Module, nn.Module, Callable[[], nn.Module], torch.Tensor]:
    import torch.ao.nn.quantized as aonnq
    import torch.ao.quantization as aoq

    torch.manual_seed(0)
    model, x = SmallCNN().eval(), torch.randn(batch, 1, 28, 28)
    prep = Q.prepare(Q.fuse_modules(model, SmallCNN.fusion_groups()), Q.get_default_qconfig())
    with torch.no_grad():
        prep(x)

    def ao() -> nn.Module:
        m = SmallCNN()
        m.load_state_dict(model.state_dict())
        m.quant, m.dequant, m.skip = aoq.QuantStub(), aoq.DeQuantStub(), aonnq.FloatFunctional()
        return _ao_eager(m, SmallCNN.fusion_groups(), x)
    return model, Q.convert(prep), ao, x


def mobilenet(batch: int, size: int) -> tuple[nn.Module, nn.Module, Callable[[], nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    model, x = mobilenet_v2(width=0.5).eval(), torch.randn(batch, 3, size, size)
    qm, _ = Q.quantize_ptq(model, [x], recipe="default", progress=False)

    def ao() -> nn.Module:
        import copy

        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        torch.backends.quantized.engine = "x86"
        prep = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (x,))
        with torch.inference_mode():
            prep(x)
        return convert_fx(prep)
    return model, qm, ao, x


def mlp(batch: int) -> tuple[nn.Module, nn.Module, Callable[[], nn.Module], torch.Tensor]:
    import torch.ao.quantization as aoq

    torch.manual_seed(0)
    model, x = MLP(Q.QuantStub(), Q.DeQuantStub()).eval(), torch.randn(batch, 256)
    groups = [["fc1", "r1"], ["fc2", "r2"]]
    prep = Q.prepare(Q.fuse_modules(model, groups), Q.get_default_qconfig())
    with torch.no_grad():
        prep(x)

    def ao() -> nn.Module:
        m = MLP(aoq.QuantStub(), aoq.DeQuantStub())
        m.load_state_dict(model.state_dict())
        return _ao_eager(m, groups, x)
    return model, Q.convert(prep), ao, x


def _session(path: Path, threads: int) -> tuple[Any, str, Path]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.optimized_model_filepath = str(path.with_suffix(".opt.onnx"))  # the graph ORT runs (its node count)
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return sess, sess.get_inputs()[0].name, path.with_suffix(".opt.onnx")


def run_model(name: str, built: tuple[nn.Module, nn.Module, Callable[[], nn.Module], torch.Tensor],
              a: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import onnx

    model, qm, ao_build, x = built
    methods: dict[str, Callable[[], Any]] = {"fp32 torch": lambda: model(x), "lowbit int8": lambda: qm(x)}
    info: dict[str, dict[str, Any]] = {k: {} for k in METHODS}
    with torch.inference_mode():
        ref = qm(x)
    files = {"fp32 ORT": folder / f"{name}_fp32.onnx", "exact ORT": folder / f"{name}_exact.onnx",
             "exact x86 ORT": folder / f"{name}_exact_x86.onnx",
             "QDQ ORT": folder / f"{name}_qdq.onnx"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x[:2],), str(files["fp32 ORT"]), dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})
        to_onnx(qm, x[:2], files["exact ORT"], exact=True)
        to_onnx(qm, x[:2], files["exact x86 ORT"], exact="x86")
        to_onnx(qm, x[:2], files["QDQ ORT"])
    xn = x.numpy()
    for k, path in files.items():
        sess, inp, opt = _session(path, a.threads)
        out = torch.from_numpy(sess.run(None, {inp: xn})[0])
        info[k] = {"nodes_file": len(onnx.load(str(path)).graph.node), "nodes_ort": len(onnx.load(str(opt)).graph.node),
                   "kB": path.stat().st_size / 1024}
        if k != "fp32 ORT":
            info[k]["max_abs_diff"] = float((out - ref).abs().max())
        methods[k] = lambda s=sess, i=inp: s.run(None, {i: xn})
    try:
        ao = ao_build()
        with torch.inference_mode():
            ao(x)
        methods["torch.ao x86"] = lambda: ao(x)
    except Exception as e:  # noqa: BLE001  (reported, not raised: "where it runs")
        info["torch.ao x86"]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        print(f"  [{name}] torch.ao x86 does not run: {info['torch.ao x86']['error']}", flush=True)
    methods = {k: methods[k] for k in METHODS if k in methods}
    print(f"  [{name}] timing {len(methods)} methods, {a.rounds} interleaved rounds ...", flush=True)
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    t = common.bench(methods, a.rounds, a.min_time, a.max_load, a.max_wait, clock=clock)
    summ = t.summary("fp32 torch")
    for k, v in summ["methods"].items():
        info[k].update(ms=v["ms"], speedup=v["speedup_vs_fp32 torch"], spread=v["spread"])
    return {"batch": int(x.shape[0]), "input": list(x.shape[1:]), "clean_rounds": t.n_clean, "rounds": a.rounds,
            "other_load_median": summ["other_load_median"], "methods": info}


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, r in results.items():
        for k in METHODS:
            v = r["methods"].get(k, {})
            if "ms" not in v:
                rows.append([f"{name} (b{r['batch']})", k, "-", "-", "-", "-", v.get("error", "-")])
                continue
            nodes = f"{v['nodes_file']} / {v['nodes_ort']}" if "nodes_file" in v else "-"
            size = f"{v['kB']:.0f}" if "kB" in v else "-"
            off = f"{v['max_abs_diff']:.3g}" if "max_abs_diff" in v else "-"
            rows.append([f"{name} (b{r['batch']})", k, f"{v['ms']:.3f}", f"{v['speedup']:.2f}", nodes, size, off])
    return common.md_table(["model", "method", "ms", "x vs fp32 torch", "nodes file / ORT", "file kB",
                            "max |out - lowbit int8|"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=common.positive_int, default=1, help="torch and ORT intra-op threads")
    ap.add_argument("--rounds", type=common.positive_int, default=7)
    ap.add_argument("--min-time", type=common.positive_float, default=0.05, help="seconds per sample")
    ap.add_argument("--max-load", type=common.positive_float, default=0.15)
    ap.add_argument("--max-wait", type=common.nonnegative_float, default=3.0)
    ap.add_argument("--clock", choices=("auto", "thread", "wall"), default="auto",
                    help="auto: this thread's CPU time at one thread, else wall time")
    ap.add_argument("--quick", action="store_true", help="smoke run: small batches and images")
    ap.add_argument("--out", default="onnx_export", help="results name (benchmarks/results/OUT.json)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # torch.ao's deprecation notices, the exporters' notes
    if a.clock == "auto":
        a.clock = "thread" if a.threads == 1 else "wall"
    print(common.isa_line(), flush=True)
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__} | threads {a.threads} | clock {a.clock} | rounds {a.rounds}",
          flush=True)
    torch.set_num_threads(a.threads)
    builders: dict[str, Callable[[], Any]] = {
        "SmallCNN": lambda: smallcnn(4 if a.quick else 32),
        "MobileNetV2 x0.5": lambda: mobilenet(2 if a.quick else 4, 64 if a.quick else 96),
        "MLP": lambda: mlp(8 if a.quick else 64)}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as d:
        for i, (name, build) in enumerate(builders.items(), 1):
            print(f"[{i}/{len(builders)}] {name}: quantize, export, check ...", flush=True)
            results[name] = run_model(name.split()[0], build(), a, Path(d))
    print()
    print(table(results))
    print("clean rounds / other processes' load (CPUs, median): " + ", ".join(
        f"{k} {r['clean_rounds']}/{r['rounds']} {r['other_load_median']:.2f}" for k, r in results.items()))
    path = common.write_results(a.out, {"threads": a.threads, "clock": a.clock, "onnxruntime": onnxruntime.__version__,
                                        "results": results})
    print(path)
    return results


if __name__ == "__main__":
    main()
