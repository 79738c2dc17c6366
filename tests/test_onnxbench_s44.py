"""Session 44: exact ONNX Conv epilogues as depthwise 1x1 Convs (``to_onnx(exact="x86")``, ``conv_epilogue.py``),
and the ONNX benchmark.

Before, every exact Conv's requantization (``Mul(S) -> Add(b) -> Mul(inv) -> Add(z) -> Round -> Clip``) ran outside
ONNX Runtime's NCHWc layout: a ``ReorderOutput`` / ``ReorderInput`` pair and four or five elementwise passes per Conv.
Now it is depthwise 1x1 Convs (``fl(fl(w x) + b)`` each, rounding as ``fl(fl(v + M) - M)``) that NCHWc keeps. The
structure tests failed before (a ``Round`` per Conv in ORT's graph; no ``conv_epilogue`` module); the code tests hold
ORT's codes to lowbit's eager ones, tie-heavy grids included, and ORT's depthwise Conv to two roundings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx

ort = pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread  # noqa: E402

_ = one_thread
ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    """Conv(3 -> 16) + ReLU, Conv(16 -> 32) (z != 0 after), Conv(32 -> 16) + ReLU, Conv(16 -> 8) (half an NCHWc
    block); every result an output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.quant = Q.QuantStub()
        self.c1, self.r1 = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.c3, self.r3 = nn.Conv2d(32, 16, 1), nn.ReLU()
        self.c4 = nn.Conv2d(16, 8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = self.r1(self.c1(self.quant(x)))
        b = self.c2(a)
        c = self.r3(self.c3(b))
        d = self.c4(c)
        return tuple(t.dequantize() for t in (a, b, c, d))


LAYERS = ("c1", "c2", "c3", "c4")


def _net(qdtype: Q.QDtype, ties: bool) -> nn.Module:
    model = Q.fuse_modules(Net().eval(), [["c1", "r1"], ["c3", "r3"]])
    model.qconfig = Q.QConfig(Q.MinMaxObserver.with_args(qdtype=qdtype), Q.get_default_qconfig().weight)
    p = Q.prepare(model)
    with torch.no_grad():
        p(torch.randn(16, 3, 10, 10, generator=torch.Generator().manual_seed(1)) + 0.5)
    q = Q.convert(p)
    if ties:  # power-of-two grids, biases on s_x s_w / 2**8: requantizations land on exact half steps
        lo = qdtype.quant_min
        with torch.no_grad():
            q.quant.scale.fill_(2.0 ** -5)
            s_in = 2.0 ** -5
            for name, (so, zo) in zip(LAYERS, [(2.0 ** -5, lo), (2.0 ** -4, lo + 77), (2.0 ** -5, lo), (2.0 ** -4, lo + 130)]):
                m = getattr(q, name)
                m.weight_scale.fill_(2.0 ** -7)
                m.bias.copy_(torch.randint(-40, 40, m.bias.shape, generator=torch.Generator().manual_seed(2)).float()
                             * s_in * 2.0 ** -8)
                m.set_output_grid(so, zo, m.out_qdtype)
                s_in = so
    return q


def _inputs(ties: bool) -> torch.Tensor:
    x = torch.randn(30, 3, 10, 10, generator=torch.Generator().manual_seed(5)) * 1.5
    if ties:
        x = (torch.round(x * 32) + 0.5) / 32  # half codes of the input grid too
    return torch.cat([x, torch.full((1, 3, 10, 10), 1e3), torch.full((1, 3, 10, 10), -1e3)])


def _export(q: nn.Module, x: torch.Tensor, path: Path, exact: bool | str = "x86") -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_onnx(q, x[:2], path, exact=exact)


@pytest.mark.parametrize("exact", [True, "x86"])
@pytest.mark.parametrize("qdtype", [Q.quint8, Q.qint8])
@pytest.mark.parametrize("ties", [False, True])
def test_conv_epilogues_codes_equal_lowbit(tmp_path, qdtype, ties, exact) -> None:
    q, x = _net(qdtype, ties), _inputs(ties)
    _export(q, x, tmp_path / "n.onnx", exact)
    got = run_onnx(tmp_path / "n.onnx", x)
    with torch.no_grad():
        want = q(x)
    for name, g, w in zip(LAYERS, got, want):
        s, z = float(getattr(q, name).scale), int(getattr(q, name).zero_point)
        gc, wc = torch.round(g / s).to(torch.int64) + z, torch.round(w / s).to(torch.int64) + z
        assert torch.equal(gc, wc), (name, int((gc != wc).sum()))


def test_conv_epilogues_stay_in_nchwc(tmp_path) -> None:
    # before: 4 Round nodes in ORT's graph and a ReorderOutput / ReorderInput pair around each of the NCHWc epilogues
    q, x = _net(Q.quint8, False), _inputs(False)
    _export(q, x, tmp_path / "n.onnx")
    opt = tmp_path / "opt.onnx"
    run_onnx(tmp_path / "n.onnx", x, optimized_model_path=str(opt))
    ops = [n.op_type for n in onnx.load(str(opt)).graph.node]
    assert ops.count("Round") == 1 and ops.count("ReorderInput") == 0, ops  # (the Quantize; c1 reads 3 channels)
    assert ops.count("ReorderOutput") == 4, ops  # each result leaves NCHWc once, as a model output
    written = [n.op_type for n in onnx.load(str(tmp_path / "n.onnx")).graph.node]
    assert written.count("Round") == 1  # the model's Quantize only


def test_portable_exact_keeps_elementwise_epilogues(tmp_path) -> None:
    # exact=True stays exact on any ORT build (ARM's NEON NCHWc depthwise kernel fuses the bias into its multiply-add,
    # so the depthwise form is opt-in as exact="x86")
    q, x = _net(Q.quint8, False), _inputs(False)
    _export(q, x, tmp_path / "n.onnx", True)
    written = [n.op_type for n in onnx.load(str(tmp_path / "n.onnx")).graph.node]
    assert written.count("Round") == 1 + len(LAYERS)


@pytest.mark.parametrize("bad", ["arm", "X86", 1, None])
def test_exact_refuses_other_values(tmp_path, bad) -> None:
    q, x = _net(Q.quint8, False), _inputs(False)
    with pytest.raises(TypeError, match=f"exact={bad!r}"):
        to_onnx(q, x[:2], tmp_path / "n.onnx", exact=bad)


def _chain_graph(channels: int, bias: bool, z: float) -> onnx.GraphProto:
    """``x -> Conv(depthwise 1x1 of ones: the identity) -> Mul(S) -> [Add(b)] -> Mul(inv) -> [Add(z)] -> Round
    -> Clip(0, 255)``, the exact export's epilogue, on hand-picked values."""
    f = np.float32
    c = lambda n, v: numpy_helper.from_array(np.asarray(v, dtype=f), n)  # noqa: E731
    s = (np.arange(channels, dtype=f) % 3 + 1) * f(0.25)  # powers-of-two-ish: products exact, sums tie
    b = (np.arange(channels) % 4 * 0.125).reshape(channels, 1, 1)
    inits = [c("w", np.ones((channels, 1, 1, 1))), c("S", s.reshape(channels, 1, 1)), c("b", b), c("inv", 0.5),
             c("z", z), c("lo", 0.0), c("hi", 255.0)]
    nodes = [helper.make_node("Conv", ["x", "w"], ["acc"], group=channels), helper.make_node("Mul", ["S", "acc"], ["y1"])]
    y = "y1"
    if bias:
        nodes.append(helper.make_node("Add", [y, "b"], ["y2"]))
        y = "y2"
    nodes.append(helper.make_node("Mul", [y, "inv"], ["y3"]))
    y = "y3"
    if z:
        nodes.append(helper.make_node("Add", [y, "z"], ["y4"]))
        y = "y4"
    nodes += [helper.make_node("Round", [y], ["r"]), helper.make_node("Clip", ["r", "lo", "hi"], ["q"])]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 4, 64])],
                             [helper.make_tensor_value_info("q", TensorProto.FLOAT, None)], inits)


def _run(graph: onnx.GraphProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


@pytest.mark.parametrize("channels", [16, 8])  # a whole NCHWc block / half of one
@pytest.mark.parametrize("bias, z", [(True, 5.0), (False, 0.0), (True, 0.0), (False, 131.0)])
def test_depthwise_rounding_equals_round_clip(channels, bias, z) -> None:
    from lowbit.export.conv_epilogue import depthwise_epilogues

    f = np.float32
    v = np.concatenate([np.arange(-300, 300, 0.25), np.arange(-40, 40, 0.125) + f(2 ** -20),  # ties, near-ties
                        [2.0 ** 22, 2.0 ** 22 + 1, 2.0 ** 23 + 0.5, 2.0 ** 24 + 3, -2.0 ** 22, -2.0 ** 23 - 1, 1e30,
                         -1e30, np.inf, -np.inf, 3e-39, -0.0, np.nan]]).astype(f)
    v = np.resize(v, channels * 4 * 64).reshape(1, channels, 4, 64)
    graph = _chain_graph(channels, bias, z)
    want = _run(graph, v)
    assert depthwise_epilogues(graph) == 1
    assert "Round" not in [n.op_type for n in graph.node]
    got = _run(graph, v)
    assert np.array_equal(got, want, equal_nan=True)


def test_depthwise_pass_leaves_other_chains() -> None:
    from lowbit.export.conv_epilogue import depthwise_epilogues

    graph = _chain_graph(16, True, 5.0)
    graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))  # Round read twice
    assert depthwise_epilogues(graph) == 0
    graph = _chain_graph(16, True, 5.0)
    b = next(t for t in graph.initializer if t.name == "b")
    b.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(b).reshape(16), "b"))  # (C,): broadcast along W
    assert depthwise_epilogues(graph) == 0
    graph = _chain_graph(16, True, 5.0)
    graph.node[0].op_type = "ConvTranspose"  # (no NCHWc form: left alone)
    assert depthwise_epilogues(graph) == 0
    assert [n.op_type for n in graph.node].count("Round") == 1


@pytest.mark.parametrize("channels", [16, 32, 8, 24])
def test_ort_depthwise_conv_adds_bias_after_the_product(channels) -> None:
    # what the pass rests on (ORT 1.32, MLAS): fl(fl(w x) + b), not one fused rounding fma(w, x, b)
    f = np.float32
    w, x = f(1 + 2 ** -12), f(1 + 2 ** -12)
    inits = [numpy_helper.from_array(np.full((channels, 1, 1, 1), w, f), "w"),
             numpy_helper.from_array(np.full(channels, -1.0, f), "b")]
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w", "b"], ["y"], group=channels)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    y = _run(graph, np.full((1, channels, 4, 4), x, f))
    assert (y == f(f(w * x) - f(1))).all() and f(f(w * x) - f(1)) != f(np.float64(w) * np.float64(x) - 1)


def test_benchmark_smoke(tmp_path) -> None:
    # benchmarks/onnx_export.py at tiny settings (nothing timed): the ISA line first, the table with every row
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "onnx_export.py"), "--quick", "--rounds", "1", "--min-time",
           "0.001", "--max-wait", "0", "--out", str(tmp_path / "res")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ISA:")
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| model")]
    for model in ("SmallCNN", "MobileNetV2 x0.5", "MLP"):
        for method in ("fp32 torch", "fp32 ORT", "lowbit int8", "exact ORT", "exact x86 ORT", "QDQ ORT", "torch.ao x86"):
            assert any(r.startswith(f"| {model} (b") and f"| {method} |" in r for r in rows), (model, method)
    exact = [r for r in rows if "| exact ORT |" in r or "| exact x86 ORT |" in r]
    assert len(exact) == 6 and all(r.rstrip(" |").endswith("| 0") for r in exact)  # ORT's outputs are lowbit's
    assert (tmp_path / "res.json").exists()
