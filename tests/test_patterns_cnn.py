"""Real-model code patterns through eager and graph mode, without edits to the model (issue #9 item 4).

Small nets, one per pattern: torchvision's quantizable style (a ``FloatFunctional`` in every block,
used only by residual ones), ReLU6 / ``F.relu6`` / ``Hardtanh(0, t)`` / ``clamp(0, t)`` folded into the
preceding layer's output grid, Hardswish / Hardsigmoid, squeeze-excite (sigmoid-mul), adaptive
pooling, Dropout, flatten. Each converts, keeps its conv/linear layers on int8 modules, and stays
close to the float model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit import kernels
from lowbit.models import mobilenet_v2


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _sqnr(ref, out):
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _fx(model, x, calib=3):
    p = Q.prepare_fx(copy.deepcopy(model).eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    with torch.no_grad():
        for i in range(calib):
            p(x + 0.05 * i)
    return Q.convert_fx(p)


def _int8_layers(q):
    return [n for n, m in q.named_modules() if isinstance(m, (nnq.Conv2d, nnq.Linear))]


def _mnv2_groups(m):
    groups = []
    for n, mod in m.named_modules():
        if isinstance(mod, nn.Sequential) and len(mod) == 3 and isinstance(mod[0], nn.Conv2d):
            groups.append([f"{n}.0", f"{n}.1", f"{n}.2"])
        if n.endswith(".conv"):
            k = len(mod) - 2
            groups.append([f"{n}.{k}", f"{n}.{k + 1}"])
    return groups


def test_torchvision_quantizable_style_unused_floatfunctional_eager():
    torch.manual_seed(0)
    m = mobilenet_v2(num_classes=10, width=0.25, quantizable=True).eval()
    x = torch.randn(4, 3, 32, 32)
    p = Q.prepare(Q.fuse_modules(m, _mnv2_groups(m)), Q.get_default_qconfig())
    with torch.no_grad():
        p(x)
    with pytest.warns(UserWarning, match=r"features.2.skip_add' \(FloatFunctional\) never ran"):
        q, report = Q.convert(p, return_report=True)
    assert "features.2.skip_add" in report.left_float and type(q.features[2].skip_add) is nnq.FloatFunctional
    assert type(q.features[3].skip_add) is nnq.QFunctional  # the residual block's add is integer
    assert isinstance(q.features[0][0], nnq.ConvReLU2d)  # conv + BN + ReLU6: one int8 layer
    assert _sqnr(m(x), q(x)) > 25


def test_uncalibrated_model_still_raises():
    m = mobilenet_v2(num_classes=10, width=0.25, quantizable=True).eval()
    with pytest.raises(RuntimeError, match="saw no data"):
        Q.convert(Q.prepare(m, Q.get_default_qconfig()))


def test_mobilenet_style_graph_mode_folds_relu6():
    torch.manual_seed(1)
    m = mobilenet_v2(num_classes=10, width=0.25).eval()
    x = torch.randn(4, 3, 32, 32)
    q = _fx(m, x)
    assert not any(isinstance(mod, (nn.ReLU6, nnq.ReLU6)) for mod in q.modules())
    assert isinstance(q.get_submodule("features.1.conv.0.0"), nnq.ConvReLU2d)
    assert _sqnr(m(x), q(x)) > 25


class Clamps(nn.Module):
    """Every spelling of a [0, t] clamp after a conv / linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3, self.c4 = (nn.Conv2d(4, 4, 3, padding=1) for _ in range(4))
        self.r6, self.ht = nn.ReLU6(), nn.Hardtanh(0.0, 2.0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.r6(self.c1(x))
        x = F.relu6(self.c2(x))
        x = self.ht(self.c3(x))
        x = torch.clamp(self.c4(x), 0.0, 1.5)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1)).clamp(min=0, max=4.0)


def test_clamp_spellings_fold_into_output_grid():
    torch.manual_seed(2)
    m, x = Clamps().eval(), 3 * torch.randn(8, 4, 6, 6)
    q = _fx(m, x)
    bounds = {"c1": 6.0, "c2": 6.0, "c3": 2.0, "c4": 1.5, "fc": 4.0}
    for name, t in bounds.items():
        mod = q.get_submodule(name)
        assert isinstance(mod, (nnq.ConvReLU2d, nnq.LinearReLU)), (name, type(mod).__name__)
        top = float(mod.scale) * (255 - int(mod.zero_point))  # the grid's largest value
        assert top <= t * (1 + 1e-6), name  # the grid clamps at t; the ReLU variant clamps at 0
    assert _sqnr(m(x), q(x)) > 25


def test_eager_fuse_relu6_and_hardtanh():
    m = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU6(), nn.Conv2d(4, 4, 1),
                      nn.Hardtanh(0.0, 3.0), Q.DeQuantStub()).eval()
    f = Q.fuse_modules(m, [["1", "2", "3"], ["4", "5"]])
    assert type(f[1]).__name__ == "ConvReLU2d" and type(f[4]).__name__ == "ConvReLU2d"
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    p = Q.prepare(f, Q.get_default_qconfig())
    p(x)
    q = Q.convert(p)
    assert isinstance(q[1], nnq.ConvReLU2d) and _sqnr(m(x), q(x)) > 25


class SEBlock(nn.Module):
    """MobileNetV3-style: conv → Hardswish → squeeze-excite (adaptive pool, Hardsigmoid / sigmoid, mul)."""

    def __init__(self, gate="hardsigmoid"):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.Hardswish()
        self.fc1, self.fc2 = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.gate = nn.Hardsigmoid() if gate == "hardsigmoid" else nn.Sigmoid()
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = self.act(self.conv(x))
        s = self.gate(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(h, 1)))))
        h = h * s
        h = torch.flatten(nn.functional.adaptive_avg_pool2d(h, (1, 1)), 1)
        return self.head(self.drop(F.hardswish(h)))


@pytest.mark.parametrize("gate", ["hardsigmoid", "sigmoid"])
def test_squeeze_excite_hardswish_graph_mode(gate):
    torch.manual_seed(3)
    m, x = SEBlock(gate).eval(), torch.randn(8, 3, 10, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float op ever sees a QTensor
        q = _fx(m, x)
        y = q(x)
    assert {"conv", "fc1", "fc2", "head"} <= set(_int8_layers(q))
    assert _sqnr(m(x), y) > 25


class EagerSE(nn.Module):
    """The same block written for eager mode: stubs and a FloatFunctional for the excite multiply."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.conv, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish()
        self.pool, self.fc1, self.relu, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 8, 1)
        self.gate, self.mul = nn.Hardsigmoid(), nnq.FloatFunctional()
        self.pool2, self.flat, self.drop, self.head = nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Dropout(), nn.Linear(8, 5)

    def forward(self, x):
        h = self.act(self.conv(self.quant(x)))
        h = self.mul.mul(h, self.gate(self.fc2(self.relu(self.fc1(self.pool(h))))))
        return self.dequant(self.head(self.drop(self.flat(self.pool2(h)))))


def test_squeeze_excite_eager_mode():
    torch.manual_seed(4)
    m, x = EagerSE().eval(), torch.randn(8, 3, 10, 10)
    p = Q.prepare(Q.fuse_modules(m, [["fc1", "relu"]]), Q.get_default_qconfig())
    p(x)
    q = Q.convert(p)
    assert {"conv", "fc1", "fc2", "head"} <= set(_int8_layers(q))
    assert _sqnr(m(x), q(x)) > 25


class FunctionalClamps(nn.Module):
    """F.conv2d / F.linear on the model's own parameters followed by F.relu6 / clamp (EfficientNet's style)."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(0.3 * torch.randn(6, 3, 3, 3)), nn.Parameter(torch.zeros(6))
        self.w2 = nn.Parameter(0.3 * torch.randn(4, 6))

    def forward(self, x):
        h = F.relu6(F.conv2d(F.pad(x, [1, 1, 1, 1]), self.w1, self.b1))
        return torch.clamp(F.linear(F.adaptive_avg_pool2d(h, 1).flatten(1), self.w2), 0.0, 2.0)


def test_functional_layers_fold_relu6_and_clamp():
    torch.manual_seed(5)
    m, x = FunctionalClamps().eval(), 3 * torch.randn(8, 3, 8, 8)
    q = _fx(m, x)
    relus = [mod for mod in q.modules() if isinstance(mod, (nnq.ConvReLU2d, nnq.LinearReLU))]
    assert len(relus) == 2 and not any(isinstance(mod, nnq.ReLU6) for mod in q.modules())
    assert all(float(r.scale) * (255 - int(r.zero_point)) <= t * (1 + 1e-6) for r, t in zip(relus, (6.0, 2.0)))
    assert _sqnr(m(x), q(x)) > 25
