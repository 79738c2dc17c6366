"""Zero padding between two int8 layers stays on the first layer's grid (graph and eager mode).

``F.pad`` (constant, value 0), ``nn.ZeroPad2d`` and ``nn.ConstantPad2d(p, 0.0)`` after a quantized conv
run on its codes, filling the zero point: the next conv reads exactly ``pad(codes, zero_point)`` on the
same scale, with no dequantize → float pad → re-quantize (a second rounding on a new grid). A non-zero
constant is not known to be on the grid before calibration: that pad stays float, as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit import kernels


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


class PadNet(nn.Module):
    """conv → bn → relu6 → pad → depthwise conv → conv, the TF-"same" pattern of EfficientNet-Lite0."""

    def __init__(self, pad: nn.Module | None = None, widths=(0, 1, 0, 1), value: float | None = None) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8)
        self.pad, self.widths, self.value = pad, list(widths), value
        self.dw = nn.Conv2d(8, 8, 3, 2, groups=8)
        self.c2 = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.bn(self.c1(x)))
        if self.pad is not None:
            y = self.pad(y)
        elif self.value is None:
            y = F.pad(y, self.widths)
        else:
            y = F.pad(y, self.widths, value=self.value)
        return self.c2(self.dw(y))


def _convert(model: nn.Module, x: torch.Tensor) -> nn.Module:
    p = Q.prepare_fx(model.eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    p(x)
    return Q.convert_fx(p)


def _io_of(q: nn.Module, x: torch.Tensor) -> tuple[Q.QTensor, Q.QTensor | torch.Tensor]:
    """The first conv's output and the depthwise conv's input in the converted model."""
    seen: dict[str, object] = {}
    h1 = q.get_submodule("c1").register_forward_hook(lambda m, a, out: seen.setdefault("c1", out))
    h2 = q.get_submodule("dw").register_forward_pre_hook(lambda m, a: seen.setdefault("dw", a[0]))
    with kernels.use_backend("reference"), torch.no_grad():
        q(x)
    h1.remove()
    h2.remove()
    return seen["c1"], seen["dw"]  # type: ignore[return-value]


def _assert_pad_on_codes(q: nn.Module, x: torch.Tensor, widths: list[int]) -> None:
    out, padded = _io_of(q, x)
    assert isinstance(out, Q.QTensor) and isinstance(padded, Q.QTensor), type(padded)
    assert padded.q_scale() == out.q_scale() and padded.q_zero_point() == out.q_zero_point()
    want = F.pad(out.int_repr(), widths, value=out.q_zero_point())
    assert torch.equal(padded.int_repr(), want)


@pytest.mark.parametrize("pad", [None, nn.ZeroPad2d((0, 1, 0, 1)), nn.ConstantPad2d((0, 1, 0, 1), 0.0)],
                         ids=["F.pad", "ZeroPad2d", "ConstantPad2d-0"])
def test_zero_pad_runs_on_the_codes_in_graph_mode(pad):
    x = torch.randn(4, 3, 9, 9)
    q = _convert(PadNet(pad), x)
    assert "pad" not in " ".join(q.lowbit_report.left_float)
    _assert_pad_on_codes(q, x, [0, 1, 0, 1])
    assert q.code.count("self.dequantize(") == 1  # only the graph output leaves int8


@settings(max_examples=12, deadline=None)
@given(widths=st.lists(st.integers(0, 3), min_size=4, max_size=4), seed=st.integers(0, 2**16),
       shift=st.floats(-2.0, 2.0))
def test_zero_pad_codes_property(widths, seed, shift):
    """Any widths, any grid (the shift moves the zero point): codes = pad(codes, zero_point)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 7, 7, generator=g) + shift
    torch.manual_seed(seed)
    model = PadNet(widths=widths)
    model.bn.bias.data += shift  # ReLU6 outputs in [0, 6]: a zero point at 0 or inside the range
    q = _convert(model, x)
    _assert_pad_on_codes(q, x, widths)


@pytest.mark.parametrize("pad, value", [(nn.ConstantPad2d((0, 1, 0, 1), 0.5), None), (None, 0.5)],
                         ids=["ConstantPad2d-0.5", "F.pad-value-0.5"])
def test_non_zero_constant_pad_stays_float(pad, value):
    x = torch.randn(4, 3, 9, 9)
    model = PadNet(pad, value=value).eval()
    q = _convert(model, x)
    assert any("pad" in k for k in q.lowbit_report.left_float), q.lowbit_report.left_float
    out, padded = _io_of(q, x)
    assert isinstance(padded, Q.QTensor)  # re-quantized for the depthwise conv after a float pad
    border = padded.dequantize()[..., -1, :]
    assert torch.allclose(border, torch.full_like(border, 0.5), atol=padded.q_scale() / 2 + 1e-6)
    with torch.no_grad():
        ref = model(x)
        err = (q(x) - ref).pow(2).mean() / ref.pow(2).mean()
    assert err < 0.05, float(err)


def test_zero_pad_module_stays_int_in_eager_mode():
    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 1), nn.ReLU(), nn.ZeroPad2d(1),
                          nn.Conv2d(8, 4, 3), Q.DeQuantStub()).eval()
    model.qconfig = Q.get_default_qconfig()
    x = torch.randn(4, 3, 6, 6)
    p = Q.prepare(model)
    p(x)
    q = Q.convert(p)
    seen: dict[str, object] = {}
    q[2].register_forward_hook(lambda m, a, out: seen.setdefault("out", out))
    q[4].register_forward_pre_hook(lambda m, a: seen.setdefault("in", a[0]))
    with kernels.use_backend("reference"), torch.no_grad():
        q(x)
    out, padded = seen["out"], seen["in"]
    assert isinstance(padded, Q.QTensor) and padded.q_scale() == out.q_scale()
    assert torch.equal(padded.int_repr(), F.pad(out.int_repr(), (1, 1, 1, 1), value=out.q_zero_point()))


def test_compare_applies_the_absorbed_relu6_clamp():
    """A conv + BN + F.relu6 fused in graph mode is compared with clamp(BN output, 0, 6), not relu(BN output)."""
    from lowbit.debug import compare

    x = torch.randn(8, 3, 9, 9)
    model = PadNet().eval()
    with torch.no_grad():
        model.bn.weight.mul_(20.0)  # pre-activation values far above 6: a plain relu reference would be off by them
    q = _convert(model, x)
    with kernels.use_backend("reference"):
        row = next(r for r in compare(model, q, x).rows if r.name == "c1")
    assert row.compared_with == "bn + clamp(0, 6)"
    assert row.act_sqnr_db > 30 and row.act_max_abs_err < 1.0, (row.act_sqnr_db, row.act_max_abs_err)
