"""Session 34's deployment-parity sweep of lowbit.export.to_onnx: the defects it found, each pinned.

- a grouped ConvTranspose (weight (C_in, C_out/groups, *k), per-channel scale along axis 1 with C_out/groups
  entries) failed to export: its bias scale s_x * s_w had C_out/groups entries for C_out bias values;
- a float Linear kept in an int8 model (a qconfig mapping's None) ran int8 in ONNX Runtime: ORT >= 1.20's
  WeightBiasQuantization quantizes a float Gemm / Conv weight read from DQ and written to Q (per-tensor int8);
- the twin of nn.TransformerEncoderLayer under quantize_dynamic raised AttributeError on linear1.weight
  (its fast-path check), where lowbit's eager model runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.export import to_onnx
from lowbit.export.twin import build_twin

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx_helpers import one_thread, ort_graph, within_one_quantum  # noqa: E402,F401 (one_thread: autouse fixture)


def _fx(model: nn.Module, shape: tuple[int, ...], mapping=None) -> nn.Module:
    calib = torch.randn(32, *shape)
    prepared = Q.prepare_fx(copy.deepcopy(model).eval(), mapping, example_inputs=(calib[:2],))
    with torch.no_grad():
        prepared(calib)
    return Q.convert_fx(prepared)


def test_grouped_conv_transpose_exports_with_per_output_channel_bias(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(4, 8, 2, stride=2, groups=2), nn.ReLU())
    qm = _fx(model, (4, 6, 6))
    path = to_onnx(qm, torch.randn(2, 4, 6, 6), tmp_path / "ct.onnx")       # raised RuntimeError (8 vs 4)
    x = torch.randn(3, 4, 6, 6)
    (out,), graph = ort_graph(path, (x,), tmp_path)
    assert within_one_quantum(out, qm(x), float(qm.get_submodule("0").scale)) >= 0.99
    assert any(n.op_type in ("QLinearConvTranspose", "ConvTranspose") for n in graph.node)


def test_grouped_conv_transpose_with_a_per_tensor_weight_grid_exports(tmp_path):
    """The same layer on one weight scale (torch.ao's x86 choice for ConvTranspose; the module keeps it expanded to
    its ``C_out / groups`` weight channels, so the per-group repetition above applies as it is)."""
    torch.manual_seed(0)
    qc = Q.QConfig(activation=Q.HistogramObserver.with_args(qdtype=Q.quint8),
                   weight=Q.MinMaxObserver.with_args(qdtype=Q.qint8, qscheme=Q.per_tensor_symmetric))
    model = nn.Sequential(nn.ConvTranspose2d(4, 8, 2, stride=2, groups=2), nn.ReLU())
    qm = _fx(model, (4, 6, 6), Q.QConfigMapping().set_global(qc))
    path = to_onnx(qm, torch.randn(2, 4, 6, 6), tmp_path / "ct1.onnx")
    x = torch.randn(3, 4, 6, 6)
    (out,), _ = ort_graph(path, (x,), tmp_path)
    assert within_one_quantum(out, qm(x), float(qm.get_submodule("0").scale)) >= 0.99


class _FloatMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def test_float_layer_of_a_mapping_stays_float_in_onnx_runtime(tmp_path):
    torch.manual_seed(1)
    mapping = Q.get_default_qconfig_mapping().set_module_name("b", None)
    qm = _fx(_FloatMiddle(), (8,), mapping)
    assert type(qm.get_submodule("b")) is nn.Linear
    path = to_onnx(qm, torch.randn(2, 8), tmp_path / "fb.onnx")
    x = torch.randn(256, 8)
    (out,), graph = ort_graph(path, (x,), tmp_path)
    # before: ORT quantized b's float weight per tensor, 2.3 % of the outputs over one quantum off lowbit's
    assert within_one_quantum(out, qm(x), float(qm.get_submodule("c").scale)) >= 0.99
    assert not [t.name for t in graph.initializer if "weight_q" in t.name]


def test_dynamic_transformer_encoder_layer_twin_takes_the_module_path():
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    qm = Q.quantize_dynamic(layer)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        twin = build_twin(qm, (x[:2],))                                   # raised AttributeError: no 'weight'
        assert torch.allclose(twin(x), qm(x), atol=1e-5)
