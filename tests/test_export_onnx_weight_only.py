"""ONNX export of WeightOnlyLinear (group-wise int4 / int8 weights): ONNX Runtime matches lowbit's reference
path (dequantize + F.linear) to float tolerance; at opset 21 the weights are packed INT4 and ORT runs MatMulNBits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit.export import run_onnx, to_onnx
from lowbit.export.weight_only import WeightOnlyTwin
from lowbit.nn.quantized import WeightOnlyLinear

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx_helpers import float_weight_matmuls, one_thread, ort_graph  # noqa: E402,F401 (one_thread: autouse fixture)

RTOL = 1e-4  # relative to the output norm


def wol(k: int, n: int, bits: int, g: int, sym: bool, bias: bool = True, relu: bool = False, seed: int = 0
        ) -> WeightOnlyLinear:
    torch.manual_seed(seed)
    return WeightOnlyLinear.from_float(nn.Linear(k, n, bias=bias), bits=bits, group_size=g, symmetric=sym,
                                       relu=relu, kernel="reference").eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def export_run(model, x, x_run, opset, tmp_path):
    path = to_onnx(model, x, tmp_path / f"m{opset}.onnx", opset_version=opset)
    outs, graph = ort_graph(path, (x_run,), tmp_path)
    return path, outs[0], graph


CASES = [(4, 32, True, True, False), (4, 32, False, False, True), (4, 128, True, True, True),
         (4, 128, False, True, False), (8, -1, True, True, False), (8, -1, False, False, True)]


@pytest.mark.parametrize("opset", [17, 21])
@pytest.mark.parametrize("bits,g,sym,bias,relu", CASES)
def test_ort_matches_reference(bits, g, sym, bias, relu, opset, tmp_path):
    q = wol(256, 64, bits, g, sym, bias, relu)
    x = torch.randn(2, 5, 256)  # 3-D input; batch (dim 0) dynamic: run on another batch size
    x_run = torch.randn(3, 5, 256)
    path, out, graph = export_run(q, x, x_run, opset, tmp_path)
    ref = q(x_run)
    assert out.shape == ref.shape == (3, 5, 64)
    assert rel_err(out, ref) < RTOL
    ops = {n.op_type for n in graph.node}
    assert not float_weight_matmuls(graph)  # the weight stays integer codes in what ORT runs
    saved = onnx.load(str(path))
    dq = [n for n in saved.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 1
    codes = next(t for t in saved.graph.initializer if t.name == dq[0].input[0])
    if opset == 21:
        assert "MatMulNBits" in ops and "MatMul" not in ops
        assert {a.name: onnx.helper.get_attribute_value(a) for a in dq[0].attribute} == {
            "axis": 0, "block_size": 256 if g == -1 else g}
        four = onnx.TensorProto.INT4 if sym else onnx.TensorProto.UINT4
        assert codes.data_type == (four if bits == 4 else onnx.TensorProto.INT8)
        assert list(codes.dims) == [256, 64]
        assert all(o.domain in ("", "ai.onnx") for o in saved.opset_import)
    else:
        signed = bits == 8 or sym
        assert codes.data_type == (onnx.TensorProto.INT8 if signed else onnx.TensorProto.UINT8)
        assert list(codes.dims) == [64 * (256 // (256 if g == -1 else g)), 256 if g == -1 else g]


@pytest.mark.parametrize("g", [32, 128])
def test_int4_file_at_opset21_is_about_half(g, tmp_path):
    q = wol(512, 128, 4, g, True)
    x = torch.randn(2, 512)
    s17 = to_onnx(q, x, tmp_path / "a.onnx", opset_version=17).stat().st_size
    s21 = to_onnx(q, x, tmp_path / "b.onnx", opset_version=21).stat().st_size
    assert 0.45 < s21 / s17 < 0.62, (s17, s21)


def test_ort_default_accuracy_level_quantizes_activations(tmp_path):
    """ORT's own default (accuracy level 4) runs MatMulNBits on int8 activations: close, not exact."""
    q = wol(256, 64, 4, 32, True)
    x = torch.randn(4, 256)
    path = to_onnx(q, x, tmp_path / "m.onnx", opset_version=21)
    exact, = run_onnx(path, x)
    approx, = run_onnx(path, x, accuracy_level=None)
    ref = q(x)
    assert rel_err(exact, ref) < RTOL
    assert RTOL < rel_err(approx, ref) < 0.02
    with pytest.raises(ValueError, match="accuracy_level=7"):
        run_onnx(path, x, accuracy_level=7)
    with pytest.raises(ValueError, match="accuracy_level=True"):
        run_onnx(path, x, accuracy_level=True)


@pytest.mark.parametrize("opset", [17, 21])
def test_mlp_from_quantize_weight_only(opset, tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    qm = Q.quantize_weight_only(model, bits=4, group_size=32)
    for m in qm.modules():
        if isinstance(m, WeightOnlyLinear):
            m.kernel = "reference"
    x, x_run = torch.randn(3, 64), torch.randn(7, 64)
    _, out, graph = export_run(qm, x, x_run, opset, tmp_path)
    assert rel_err(out, qm(x_run)) < RTOL
    assert rel_err(out, model(x_run)) < 0.2  # still the float model, to int4 accuracy
    if opset == 21:
        assert sum(n.op_type == "MatMulNBits" for n in graph.node) == 3
    assert not float_weight_matmuls(graph)


@settings(max_examples=25, deadline=None)
@given(k_groups=st.integers(1, 4), g=st.sampled_from([8, 16, 32]), n=st.integers(1, 9), bits=st.sampled_from([4, 8]),
       sym=st.booleans(), relu=st.booleans(), seed=st.integers(0, 2**16))
def test_twin_forms_equal_reference(k_groups, g, n, bits, sym, relu, seed):
    """Both ONNX forms of the twin (opset < 21: groups as DQ channels; 21: blocked DQ of the transposed codes)
    compute the reference dequantize + F.linear."""
    q = wol(k_groups * g, n, bits, g, sym, relu=relu, seed=seed)
    x = torch.randn(2, 3, k_groups * g, generator=torch.Generator().manual_seed(seed))
    ref = q(x)
    for opset in (17, 21):
        out = WeightOnlyTwin(q, opset)(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
