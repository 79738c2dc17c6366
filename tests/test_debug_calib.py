"""Debugger on graph-mode models (BN-folded layers compared after their BN/ReLU), the "quantize only
this layer" view, and automatic mixed precision in eager and graph mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.debug import auto_mixed_precision, compare, layer_sensitivity


class ConvBnReLU(nn.Module):
    """conv-bn-F.relu, conv-bn-nn.ReLU, then a Linear head; BNs far from identity (as after training)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    m = ConvBnReLU()
    with torch.no_grad():
        for bn in (m.bn1, m.bn2):
            bn.running_mean.uniform_(-2, 2)
            bn.running_var.uniform_(0.05, 4)
            bn.weight.uniform_(-3, 3)
            bn.bias.uniform_(-1, 1)
    return m.eval()


def test_compare_graph_mode_matches_folded_layers_after_bn_and_relu():
    model, x = _net(), torch.randn(16, 3, 12, 12)
    prepared = Q.prepare_fx(model, Q.get_default_qconfig(), example_inputs=(x,))
    prepared(x)
    qmodel = Q.convert_fx(prepared)
    assert qmodel.lowbit_report.absorbed == {"conv1": ["bn1", "relu"], "conv2": ["bn2", "relu2"]}
    rows = {r.name: r for r in compare(model, qmodel, x).rows}
    assert rows["conv1"].compared_with == "bn1 + relu" and rows["conv2"].compared_with == "relu2"
    for name in ("conv1", "conv2", "fc"):   # measured 44.8 / 44.5 / 43.1 dB activations, 48.7 / 48.2 / 46.0 weights
        assert rows[name].act_sqnr_db > 35 and rows[name].weight_sqnr_db > 40, rows[name]


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(128, 8)
    x[0, 0] = 200.0                          # an outlier on the model input: layer '0' pays
    return model, x


def test_layer_sensitivity_names_the_costly_layer_first():
    model, x = _mlp()
    for mode in ("eager", "fx"):
        table = layer_sensitivity(model, Q.get_minmax_qconfig(), x, mode=mode)
        assert [r.name for r in table.rows][0] == "0", (mode, table)
        assert all(r.drop > 0 for r in table.rows) and table.rows[0].drop > 3 * table.rows[1].drop


def test_layer_sensitivity_graph_mode_conv_bn():
    model, x = _net(), torch.randn(8, 3, 12, 12)
    table = layer_sensitivity(model, Q.get_default_qconfig(), x, mode="fx")
    assert sorted(r.name for r in table.rows) == ["conv1", "conv2", "fc"]   # BNs fold, they are not layers
    assert all(0 < r.drop < 1e-2 for r in table.rows)


@pytest.mark.parametrize("mode", ["eager", "fx"])
def test_auto_mixed_precision_meets_the_tolerance_with_few_float_layers(mode):
    model, x = _mlp()
    ref = model(x).detach()

    def score(m):
        return -float(((m(x) - ref) ** 2).mean() / (ref ** 2).mean())

    mapping, table = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, tolerance=-0.5 * score_of_all(
        model, x, score, mode), mode=mode, progress=False)
    assert table.float_layers == ["0"] and table.met_tolerance
    # the returned mapping reproduces the result
    q = _quantize(model, mapping, x, mode)
    assert score(q) == pytest.approx(table.final_metric, rel=1e-6)
    # a zero budget keeps everything int8; the budget caps the float layers
    _, none = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=0, mode=mode,
                                   progress=False)
    assert none.float_layers == [] and none.final_metric == none.all_quantized_metric


def score_of_all(model, x, score, mode):
    return score(_quantize(model, Q.get_minmax_qconfig(), x, mode))


def _quantize(model, mapping, x, mode):
    if mode == "fx":
        prepared = Q.prepare_fx(model, mapping, example_inputs=(x,))
        prepared(x)
        q = Q.convert_fx(prepared)
    else:
        prepared = Q.prepare(model, mapping)
        prepared(x)
        q = Q.convert(prepared)
    return lambda inp: (lambda y: y.dequantize() if isinstance(y, Q.QTensor) else y)(q(inp))


def test_auto_mixed_precision_bad_input():
    model, x = nn.Sequential(nn.Linear(4, 4)).eval(), torch.randn(8, 4)
    score = lambda m: 0.0  # noqa: E731
    with pytest.raises(ValueError, match="give a budget"):
        auto_mixed_precision(model, None, x, score)
    with pytest.raises(ValueError, match="tolerance=-1"):
        auto_mixed_precision(model, None, x, score, tolerance=-1)
    with pytest.raises(ValueError, match="max_float_layers=1.5"):
        auto_mixed_precision(model, None, x, score, max_float_layers=1.5)
    with pytest.raises(ValueError, match="mode='jit'"):
        auto_mixed_precision(model, None, x, score, tolerance=0.1, mode="jit")
    with pytest.raises(ValueError, match="needs example_inputs"):
        auto_mixed_precision(model, None, [{"x": x}], score, tolerance=0.1, mode="fx")
    with pytest.raises(ValueError, match="mode='tflite'"):
        layer_sensitivity(model, None, x, mode="tflite")
