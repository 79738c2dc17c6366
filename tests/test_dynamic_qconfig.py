"""Dynamic qconfigs through the workflows: eager prepare/convert and graph-mode prepare_fx/convert_fx.

A module under ``get_dynamic_qconfig()`` gets no observer and becomes the ``lowbit.nn.quantized.dynamic``
module ``quantize_dynamic`` builds with that qconfig (compared bit for bit); mappings mixing static and
dynamic settings work; a dynamic qconfig on a type with no dynamic kernel (Conv2d) leaves it float and
reported. Oracle: ``torch.ao``'s ``prepare_fx``/``convert_fx`` with ``default_dynamic_qconfig``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
import lowbit.nn.quantized.dynamic as nnqd
from lowbit.nn.quantized.conv import ConvReLU2d as QConvReLU2d
from lowbit.nn.quantized.stubs import DeQuantize
from lowbit.observer import MinMaxObserver, PlaceholderObserver

DTYPES = [Q.qint8, torch.float16]


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


# ---- models ----
class Tagger(nn.Module):
    """Linear -> ReLU -> LSTM -> GRU -> Linear (sequence model: every layer has a dynamic twin)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.act = nn.Linear(6, 12), nn.ReLU()
        self.lstm, self.gru = nn.LSTM(12, 16, batch_first=True), nn.GRU(16, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):                       # (N, T, 6)
        y, _ = self.lstm(self.act(self.proj(x)))  # (N, T, 16)
        y, _ = self.gru(y)                        # (N, T, 8)
        return self.head(y[:, -1])               # (N, 3)


class ConvHead(nn.Module):
    """Conv-BN-ReLU stack -> flatten -> Linear head (the mixed static/dynamic recipe)."""

    def __init__(self, stubs: bool = False) -> None:
        super().__init__()
        self.quant = Q.QuantStub() if stubs else nn.Identity()
        self.conv, self.bn, self.relu = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
        self.flat, self.fc = nn.Flatten(), nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):                       # (N, 1, 8, 8)
        return self.fc(self.flat(self.relu(self.bn(self.conv(self.quant(x))))))  # (N, 5)


def _eval(m):
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.2, 0.2)
                mod.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _seq():
    return torch.randn(4, 7, 6)


def _img(n=8, seed=0):
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def _rel(y, ref):
    return ((y - ref).norm() / ref.norm()).item()


def _dynamic_mapping(dtype=Q.qint8):
    return Q.QConfigMapping().set_global(Q.get_dynamic_qconfig(dtype))


def _mixed_mapping():
    return Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_object_type(nn.Linear, Q.get_dynamic_qconfig())


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _no_observers(m):
    return not any(isinstance(x, (Q.ObserverBase, Q.FakeQuantize)) for x in m.modules())


# ---- eager ----
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_dynamic_equals_quantize_dynamic(dtype):
    model, x = Tagger().eval(), _seq()
    qc = Q.get_dynamic_qconfig(dtype)
    prepared = Q.prepare(model, Q.QConfigMapping().set_global(qc))
    assert _no_observers(prepared)  # nothing to calibrate
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "saw no data" / "no prepared module" complaints
        qmodel, report = Q.convert(prepared, return_report=True)
    expected = Q.quantize_dynamic(model, qc)
    for name in ("proj", "lstm", "gru", "head"):
        assert type(getattr(qmodel, name)) is type(getattr(expected, name))
        assert type(getattr(qmodel, name)).__module__.startswith("lowbit.nn.quantized.dynamic")
        assert getattr(qmodel, name).dtype == dtype
    assert sorted(report.converted) == ["gru", "head", "lstm", "proj"] and not report.left_float
    _assert_same_state(qmodel, expected)
    assert torch.equal(qmodel(x), expected(x))
    assert _rel(qmodel(x), model(x)) < 0.05


def test_eager_qconfig_attribute_and_bare_root():
    model = Tagger().eval()
    model.qconfig = Q.get_dynamic_qconfig()  # torch.ao style: attribute on the root, propagated
    qmodel = Q.convert(Q.prepare(model))
    assert isinstance(qmodel.lstm, nnqd.LSTM) and isinstance(qmodel.head, nnqd.Linear)
    fc = nn.Linear(4, 3)
    qfc = Q.convert(Q.prepare(fc, Q.get_dynamic_qconfig(torch.float16)))  # the root itself is swapped
    assert isinstance(qfc, nnqd.Linear) and qfc.dtype == torch.float16
    x = torch.randn(2, 4)
    assert torch.equal(qfc(x), Q.quantize_dynamic(fc, Q.get_dynamic_qconfig(torch.float16))(x))


@pytest.mark.parametrize("stubs", [False, True])
def test_eager_mixed_static_convs_dynamic_linear(stubs):
    model = _eval(ConvHead(stubs))
    prepared = Q.prepare(Q.fuse_modules(model, [["conv", "bn", "relu"]]), _mixed_mapping())
    assert "activation_post_process" not in prepared.fc._modules  # dynamic: not observed
    assert "activation_post_process" in prepared.conv._modules
    with pytest.raises(RuntimeError, match="'quant'|'conv'"):  # the static part still needs calibration
        Q.convert(prepared)
    for i in range(4):
        prepared(_img(16, i))
    qmodel, report = Q.convert(prepared, return_report=True)
    assert isinstance(qmodel.conv, QConvReLU2d) and isinstance(qmodel.fc, nnqd.Linear)
    assert report.converted["fc"].endswith("dynamic.linear.Linear")
    assert report.converted["conv"].endswith("conv.ConvReLU2d")
    assert not report.left_float
    x = _img(8, 9)
    out = qmodel(x)
    assert not isinstance(out, Q.QTensor) and _rel(out, model(x)) < 0.05  # the dynamic head returns float


def test_eager_static_linear_dynamic_lstm():
    """The other common recipe: static everywhere, dynamic LSTM (a type the static mapping lacks)."""
    model, x = Tagger().eval(), _seq()
    mapping = Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_object_type(nn.LSTM, Q.get_dynamic_qconfig())
    prepared = Q.prepare(model, mapping)
    prepared(x)
    qmodel, report = Q.convert(prepared, return_report=True)
    assert isinstance(qmodel.lstm, nnqd.LSTM) and type(qmodel.proj).__module__ == "lowbit.nn.quantized.linear"
    assert "gru" in report.left_float and "lstm" in report.converted  # GRU: static qconfig, no static module
    out = qmodel(x)  # the static head returns a QTensor (no DeQuantStub)
    assert isinstance(out, Q.QTensor) and _rel(out.dequantize(), model(x)) < 0.1


def test_eager_dynamic_qconfig_on_conv_left_float_and_reported():
    model = _eval(ConvHead())
    qmodel, report = Q.convert(Q.prepare(model, _dynamic_mapping()), return_report=True)  # no calibration
    assert type(qmodel.conv) is nn.Conv2d and isinstance(qmodel.fc, nnqd.Linear)
    assert "dynamic qconfig" in report.left_float["conv"] and "Conv2d" in report.left_float["conv"]
    x = _img()
    assert torch.equal(qmodel.conv(x), model.conv(x))
    explicit = Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_object_type(nn.Conv2d,
                                                                                      Q.get_dynamic_qconfig())
    prepared = Q.prepare(model, explicit)
    assert "activation_post_process" not in prepared.conv._modules
    prepared(x)
    _, report = Q.convert(prepared, return_report=True)
    assert "dynamic qconfig" in report.left_float["conv"] and "fc" in report.converted


def test_eager_prepare_qat_keeps_dynamic_layers_float():
    model = _eval(ConvHead())
    prepared = Q.prepare_qat(model, Q.QConfigMapping().set_global(Q.get_default_qat_qconfig())
                             .set_object_type(nn.Linear, Q.get_dynamic_qconfig()))
    assert type(prepared.fc) is nn.Linear and type(prepared.conv).__module__.startswith("lowbit.nn.qat")
    prepared(_img(16)).sum().backward()
    qmodel = Q.convert(prepared.eval())
    assert isinstance(qmodel.fc, nnqd.Linear)


def test_eager_bad_input():
    model = Tagger().eval()
    with pytest.raises(TypeError, match="dynamic_mapping|mapping must be a dict"):
        Q.prepare(model, _dynamic_mapping(), dynamic_mapping=[nn.Linear])
    with pytest.raises(TypeError, match="mapping\\[Linear\\]"):
        Q.convert(model, dynamic_mapping={nn.Linear: nn.Linear})
    bad = Q.QConfig(activation=PlaceholderObserver.with_args(is_dynamic=True),
                    weight=MinMaxObserver.with_args(qdtype=Q.quint8))  # no uint8 dynamic weights
    with pytest.raises(ValueError, match="'proj'.*quint8"):
        Q.convert(Q.prepare(model, Q.QConfigMapping().set_object_type(nn.Linear, bad)))


# ---- graph mode ----
def _fx_dynamic(model, mapping, x, calibrate=False):
    prepared = Q.prepare_fx(model, mapping, example_inputs=(x,))
    if calibrate:
        prepared(x)
    return prepared, Q.convert_fx(prepared)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fx_dynamic_equals_quantize_dynamic(dtype):
    model, x = Tagger().eval(), _seq()
    qc = Q.get_dynamic_qconfig(dtype)
    prepared, qmodel = _fx_dynamic(model, Q.QConfigMapping().set_global(qc), x)
    assert _no_observers(prepared)
    assert not any(isinstance(m, (Q.nn.quantized.Quantize, DeQuantize)) for m in qmodel.modules())  # float in/out
    expected = Q.quantize_dynamic(model, qc)
    for name in ("proj", "lstm", "gru", "head"):
        assert type(getattr(qmodel, name)) is type(getattr(expected, name))
    _assert_same_state(qmodel, expected)
    assert torch.equal(qmodel(x), expected(x))
    assert set(qmodel.lowbit_report.converted) == {"proj", "lstm", "gru", "head"}
    # without example inputs the heuristic finds the same nodes
    assert torch.equal(Q.convert_fx(Q.prepare_fx(model, Q.QConfigMapping().set_global(qc)))(x), expected(x))


def test_fx_parity_with_torch_ao_mlp():
    import torch.ao.nn.quantized.dynamic as aoqd
    import torch.ao.quantization as tq
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
    from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare_fx

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).eval()
    x = torch.randn(64, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation warnings
        ao = ao_convert_fx(ao_prepare_fx(copy.deepcopy(model), tq.QConfigMapping().set_global(
            tq.default_dynamic_qconfig), example_inputs=(x,)))
    _, lb = _fx_dynamic(model, _dynamic_mapping(), x)
    dyn_ao = {n for n, m in ao.named_modules() if isinstance(m, aoqd.Linear)}  # its LinearReLU subclasses it
    dyn_lb = {n for n, m in lb.named_modules() if isinstance(m, nnqd.Linear)}
    assert dyn_lb == dyn_ao == {"0", "2", "4"}
    ref = model(x)
    assert _rel(lb(x), ref) <= _rel(ao(x), ref)  # per-channel weights, per-token activations


def test_fx_mixed_static_convs_dynamic_head():
    model, x = _eval(ConvHead()), _img(16)
    with pytest.raises(RuntimeError, match="saw no data"):  # the static part needs calibration
        _fx_dynamic(model, _mixed_mapping(), x)
    prepared, qmodel = _fx_dynamic(model, _mixed_mapping(), x, calibrate=True)
    assert "fc" not in {n.args[0].target for n in prepared.graph.nodes
                        if n.op == "call_module" and n.target.startswith("activation_post_process")
                        and n.args[0].op == "call_module"}  # the dynamic head is not observed
    assert isinstance(qmodel.conv, QConvReLU2d) and isinstance(qmodel.fc, nnqd.Linear)  # conv-bn-relu fused
    nodes = {n.name: n for n in qmodel.graph.nodes}
    assert nodes["fc"].args[0].target == "dequantize"  # int region ends before the dynamic head
    assert next(n for n in qmodel.graph.nodes if n.op == "output").args[0] is nodes["fc"]  # float out
    assert qmodel.lowbit_report.converted["fc"].endswith("dynamic.linear.Linear")
    y = _img(8, 5)
    assert _rel(qmodel(y), model(y)) < 0.05


def test_fx_dynamic_functional_linear_with_relu():
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(6, 10)), nn.Parameter(torch.randn(6))

        def forward(self, x):
            return F.relu(F.linear(x, self.w, self.b)) * 2

    model, x = Head().eval(), torch.randn(5, 10)
    mapping = Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_object_type(F.linear, Q.get_dynamic_qconfig())
    _, qmodel = _fx_dynamic(model, mapping, x, calibrate=True)
    dyn = [m for m in qmodel.modules() if isinstance(m, nnqd.Linear)]
    assert len(dyn) == 1 and not hasattr(qmodel, "w")  # the float weight is gone
    ref = Q.quantize_dynamic(_standin(model), Q.get_dynamic_qconfig())  # the same layer as an nn.Linear
    assert torch.equal(qmodel(x), F.relu(ref(x)) * 2)
    assert _rel(qmodel(x), model(x)) < 0.05


def _standin(model):
    lin = nn.Linear(10, 6)
    with torch.no_grad():
        lin.weight.copy_(model.w)
        lin.bias.copy_(model.b)
    return lin


def test_fx_dynamic_qconfig_on_conv_left_float_and_reported():
    model, x = _eval(ConvHead()), _img()
    _, qmodel = _fx_dynamic(model, _dynamic_mapping(), x)  # nothing to calibrate
    assert type(qmodel.conv) is nn.Conv2d and type(qmodel.bn) is nn.BatchNorm2d  # not fused either
    assert isinstance(qmodel.fc, nnqd.Linear)
    assert "dynamic qconfig" in qmodel.lowbit_report.left_float["conv"]
    assert _rel(qmodel(x), model(x)) < 0.02


def test_fx_qat_keeps_dynamic_layers_float():
    model, x = _eval(ConvHead()), _img(16)
    mapping = Q.QConfigMapping().set_global(Q.get_default_qat_qconfig()).set_object_type(nn.Linear,
                                                                                          Q.get_dynamic_qconfig())
    prepared = Q.prepare_qat_fx(model.train(), mapping, example_inputs=(x,))
    assert type(prepared.fc) is nn.Linear
    prepared(x).sum().backward()
    assert prepared.fc.weight.grad is not None
    qmodel = Q.convert_fx(prepared)
    assert isinstance(qmodel.fc, nnqd.Linear)


def test_fx_bad_weight_dtype_names_the_layer():
    bad = Q.QConfig(activation=PlaceholderObserver.with_args(is_dynamic=True),
                    weight=MinMaxObserver.with_args(qdtype=Q.quint8))
    model, x = Tagger().eval(), _seq()
    prepared = Q.prepare_fx(model, Q.QConfigMapping().set_object_type(nn.Linear, bad), example_inputs=(x,))
    with pytest.raises(ValueError, match="'proj'.*quint8"):
        Q.convert_fx(prepared)


# ---- property: the three routes build the same dynamic Linear ----
@settings(max_examples=12, deadline=None)
@given(k=st.integers(1, 24), n=st.integers(1, 12), rows=st.integers(1, 9), scale=st.floats(0.01, 50.0),
       f16=st.booleans(), seed=st.integers(0, 2**16))
def test_property_eager_fx_quantize_dynamic_agree(k, n, rows, scale, f16, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n)).eval()
    x = torch.randn(rows, k) * scale
    qc = Q.get_dynamic_qconfig(torch.float16 if f16 else Q.qint8)
    expected = Q.quantize_dynamic(model, qc)(x)
    eager = Q.convert(Q.prepare(model, Q.QConfigMapping().set_global(qc)))(x)
    graph = Q.convert_fx(Q.prepare_fx(model, Q.QConfigMapping().set_global(qc), example_inputs=(x,)))(x)
    assert torch.equal(eager, expected) and torch.equal(graph, expected)
