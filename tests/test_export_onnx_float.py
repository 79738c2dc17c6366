"""to_onnx on the recommended recipes' float pieces: ``LinearFloatOut`` (``fuse_dequantize``), float layers
kept by ``quantize_ptq(max_float_layers=...)`` / ``keep_faster`` and float layers from a mixed-precision mapping.

Parity: ORT against the export twin's float simulation (what the file describes) to 1e-4 relative, and
against lowbit's eager model: int8 outputs within one output quantum (>= 99 % of elements, as the other
export tests), float outputs to 0.5 % relative L2 (measured <= 0.09 %): an upstream int8 code may differ by one where
ORT's integer requantization and lowbit's epilogue round a near-tie differently.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.export import run_onnx, to_onnx
from lowbit.export.twin import build_twin
from lowbit.nn.quantized.linear_float_out import LinearFloatOut
from lowbit.speed_guard import FloatFallback

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread, ort_ops, within_one_quantum  # noqa: E402,F401 (one_thread: autouse fixture)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    with torch.no_grad():
        model[2].weight[:, 3] *= 3           # an outlier input channel (x20 amplifies one-code ties past a quantum)
    return model


def _fx(model: nn.Module, mapping=None) -> nn.Module:
    calib = torch.randn(64, 16)
    prepared = Q.prepare_fx(copy.deepcopy(model), mapping or Q.get_default_qconfig(), example_inputs=(calib,))
    prepared(calib)
    return Q.convert_fx(prepared)


def _parity(qmodel: nn.Module, x: torch.Tensor, tmp_path, quantum: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, set[str]]:
    """(ORT output, lowbit eager output, ORT's executed op types); checks ORT against the twin simulation:
    within one output quantum when the output is int8 (``quantum``), else to 0.5 % relative L2."""
    path = to_onnx(qmodel, (x[:2],), tmp_path / "m.onnx")
    got, ops = ort_ops(path, x, tmp_path)
    with torch.no_grad(), kernels.use_backend("reference"):
        sim = build_twin(qmodel, (x,))(x)
        eager = qmodel(x)
    if quantum is None:
        assert _rel(got, sim) < 5e-3
    else:
        assert within_one_quantum(got, sim, quantum) >= 0.99
    return got, eager, ops


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_linear_float_out_exports_without_output_rounding_on_integer_kernels(tmp_path):
    qmodel = _fx(_mlp())
    assert Q.fuse_dequantize(qmodel) == ["4"]            # the last Linear feeds the (float) model output
    assert isinstance(qmodel.get_submodule("4"), LinearFloatOut)
    x = torch.randn(24, 16)
    got, eager, ops = _parity(qmodel, x, tmp_path)
    assert _rel(got, eager) < 5e-3
    assert ops & {"QGemm", "MatMulIntegerToFloat", "QLinearMatMul"}
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert graph.node[-1].op_type != "DequantizeLinear"   # the file ends at the float Gemm, no output Q/DQ


def test_quantize_ptq_float_layers_export(tmp_path):
    model = _mlp()
    calib = [torch.randn(32, 16) for _ in range(2)]
    qmodel, report = Q.quantize_ptq(model, calib, recipe="default", max_float_layers=2, progress=False)
    assert len(report.float_layers) == 2
    x = torch.randn(24, 16)
    got, eager, _ = _parity(qmodel, x, tmp_path)
    assert _rel(got, eager) < 5e-3
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    n_float = sum(n.op_type == "Gemm" and not any("DequantizeLinear" in i for i in n.input) for n in graph.node)
    assert n_float >= 1                                  # float weights stay float


@pytest.mark.parametrize("kind", ["mixed_precision", "keep_faster"])
def test_float_layer_on_its_output_grid_feeds_an_int8_layer(kind, tmp_path):
    from lowbit.debug.mixed_precision import _FloatTwin

    model = _mlp()
    qmodel = _fx(model)
    qmid = qmodel.get_submodule("2")                     # LinearReLU whose reader is the int8 Linear '4'
    float_mid = nn.Sequential(copy.deepcopy(model[2]), nn.ReLU())
    twin = _FloatTwin(float_mid, qmid, float_out=False) if kind == "mixed_precision" else \
        FloatFallback(float_mid, (float(qmid.scale), int(qmid.zero_point), qmid.out_qdtype))
    setattr(qmodel, "2", twin)
    x, quantum = torch.randn(24, 16), float(qmodel.get_submodule("4").scale)
    got, eager, ops = _parity(qmodel, x, tmp_path, quantum)
    assert within_one_quantum(got, eager, quantum) >= 0.99
    assert ops & {"QGemm", "QLinearMatMul"}               # the int8 layers still run on integer kernels


def test_mixed_precision_mapping_float_layer_exports(tmp_path):
    mapping = Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_module_name("2", None)
    qmodel = _fx(_mlp(), mapping)
    assert type(qmodel.get_submodule("2")) is nn.Linear
    x, quantum = torch.randn(24, 16), float(qmodel.get_submodule("4").scale)
    got, eager, _ = _parity(qmodel, x, tmp_path, quantum)
    assert within_one_quantum(got, eager, quantum) >= 0.99


def test_float_layer_holding_quantized_or_fake_quant_modules_is_named(tmp_path):
    qmodel = _fx(_mlp())
    qmid = qmodel.get_submodule("2")
    setattr(qmodel, "2", FloatFallback(nn.Sequential(copy.deepcopy(qmid)), None))
    with pytest.raises(TypeError, match=r"float layer '2' holds a quantized LinearReLU"):
        to_onnx(qmodel, torch.randn(2, 16), tmp_path / "bad.onnx")
    qat = nn.Linear(32, 32)
    qat.weight_fake_quant = Q.FakeQuantize()
    setattr(qmodel, "2", FloatFallback(qat, None))
    with pytest.raises(TypeError, match=r"float layer '2' holds a FakeQuantize"):
        to_onnx(qmodel, torch.randn(2, 16), tmp_path / "bad.onnx")
