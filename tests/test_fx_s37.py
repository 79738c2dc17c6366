"""Session 37: graph mode's custom configs and tracing limits, torch.ao.quantization.quantize_fx as the oracle.

Probed: non-traceable module names / classes, standalone modules, custom observed / quantized module classes, preserved
attributes and methods, quantized inputs feeding a float op, control flow on shapes, ``torch.fx.wrap``'d functions,
optional (``None``) arguments, buffers updated in ``forward``, reads of a called module's parameters
(``self.conv.weight.shape``), ``F.conv2d`` with stride / groups from attributes, modules called with keyword arguments
and per-name qconfigs. Non-traceable modules, custom modules, ``fx.wrap`` and per-name qconfigs match torch.ao; keyword
calls and ``F.conv2d`` with integer strides work where torch.ao fails. Defects (each test below failed before its fix):

- a forward that updates a buffer (``self.steps += 1``, ``self.running.mul_(0.9)``): torch.fx ran the update once on the
  real buffer while tracing and recorded neither it nor the reads after it; the prepared / converted model never
  updated the buffer (or lost it), and prepare's example run left the buffers changed;
- a read of a called module's parameter (``self.conv.weight.shape``, ``self.fc.weight.sum()``) failed in prepare_fx
  when the module was fused ("references nonexistent attribute weight"), or when the converted model ran ("'function'
  object has no attribute 'shape'"; torch.ao fails alike);
- a preserved method stayed bound to the float model: calibrating through ``prepared.predict(x)`` fed no observer, and
  ``quantized.predict(x)`` ran the float layers; ``convert_to_reference_fx`` dropped preserved attributes (and lowering
  the reference model then failed naming them);
- the warning for an untraceable forward did not name the line (``if x.shape[0] > 1:``);
- torch.ao's standalone module config got "unsupported keys" with no alternative.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.fx import convert_fx, prepare_fx, prepare_qat_fx
from lowbit.reference.fx import convert_to_reference_fx

ao = pytest.importorskip("torch.ao.quantization")
from torch.ao.quantization import quantize_fx  # noqa: E402
from torch.ao.quantization.fx.custom_config import PrepareCustomConfig as AoPrepareCustomConfig  # noqa: E402

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - y).pow(2).mean().clamp_min(1e-20)))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---- buffers updated in forward


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 1)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.c(x)


class _CountingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnt, self.d = _Counter(), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.d(self.cnt(x).relu())


class _RunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 1)
        self.register_buffer("running", torch.full((4,), 0.5))

    def forward(self, x):
        y = self.c(x)
        self.running.mul_(0.9).add_(y.mean((0, 2, 3)).detach() * 0.1)
        return y - self.running[None, :, None, None]


@pytest.mark.parametrize("make, buffer, culprit", [(_CountingNet, "cnt.steps", "cnt"),
                                                   (_RunningMean, "running", "<root>")])
def test_a_forward_that_updates_a_buffer_keeps_updating_it(make, buffer, culprit):
    """The module whose forward changes the buffer is an opaque leaf (its children are prepared one by one), the
    prepared model starts from the float model's buffers, and calibration + inference update them as the float model
    does (before: frozen at a traced copy, or dropped; prepare's example run had changed them)."""
    torch.manual_seed(0)
    model = make().eval()
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=f"changes buffer '{buffer}'"):
        prepared = prepare_fx(copy.deepcopy(model), Q.get_minmax_qconfig(), example_inputs=(X,))
    assert torch.equal(prepared.get_buffer(buffer), model.get_buffer(buffer))  # prepare left it as it was
    assert buffer in prepared.lowbit_report.untraceable[culprit]
    batches = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    with torch.no_grad():
        for x in batches:
            prepared(x), twin(x)
        quantized = convert_fx(prepared)
        for x in batches:
            ref, y = twin(x), quantized(x)
            assert _sqnr(ref, y) > 30
    assert torch.allclose(quantized.get_buffer(buffer).float(), twin.get_buffer(buffer).float(), atol=2e-3)
    assert sum(isinstance(m, Q.nn.quantized.Conv2d) for m in quantized.modules()) >= 1


# ---- reads of a called module's parameters


class _ReadsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Linear(4, 2)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1), self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3))) * self.conv.weight.shape[0], self.conv.weight.sum() + self.fc.bias.sum()


@pytest.mark.parametrize("how", ["convert_fx", "reference", "lowered", "qat"])
def test_reading_a_fused_or_quantized_modules_parameters(how):
    """``self.conv.weight`` of a conv that prepare fuses with its BN and ReLU and convert makes int8: the read sees the
    float model's (unfolded) weight, exactly (before: prepare_fx failed in torch.fx's lint, convert_fx's model failed
    with "'function' object has no attribute 'shape'"; torch.ao fails alike)."""
    torch.manual_seed(0)
    model = _ReadsWeights().eval()
    ref, read = model(X)
    if how == "qat":
        prepared = prepare_qat_fx(copy.deepcopy(model).train(), example_inputs=(X,))
    else:
        prepared = prepare_fx(copy.deepcopy(model), Q.get_minmax_qconfig(), example_inputs=(X,))
    with torch.no_grad():
        prepared(X)
        if how == "qat":  # (the fake-quantized model, BN on its running statistics, is the reference there)
            ref = prepared.eval()(X)[0]
        result = {"convert_fx": convert_fx, "reference": convert_to_reference_fx, "qat": convert_fx,
                  "lowered": lambda p: convert_fx(convert_to_reference_fx(p))}[how](prepared)
        y, got = result(X)
    assert torch.equal(got, read.detach())
    assert _sqnr(ref.detach(), y) > 30
    with pytest.raises(AttributeError):  # (the oracle: torch.ao's converted model fails on the same read)
        p = _quiet(quantize_fx.prepare_fx, copy.deepcopy(model), ao.get_default_qconfig_mapping(), (X,))
        p(X)
        _quiet(quantize_fx.convert_fx, p)(X)


# ---- preserved attributes and methods


class _WithMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.scale = nn.Conv2d(3, 4, 1), 3.0

    def forward(self, x):
        return self.c(x) * 2

    def predict(self, x):
        return self(x).sum((1, 2, 3)) * self.scale


def test_a_preserved_method_runs_on_the_model_it_was_preserved_onto():
    """Calibrating through ``prepared.predict`` feeds the observers (before: it ran the float model and convert_fx said
    the observers saw no data), ``quantized.predict`` runs the int8 model, and the reference model keeps both
    attributes (before: dropped, and lowering it failed naming them)."""
    model = _WithMethod().eval()
    cfg = Q.PrepareCustomConfig().set_preserved_attributes(["scale", "predict"])
    prepared = prepare_fx(copy.deepcopy(model), Q.get_minmax_qconfig(), (X,), prepare_custom_config=cfg)
    assert prepared.predict.__self__ is prepared
    with torch.no_grad():
        prepared.predict(X)
        reference = convert_to_reference_fx(prepared)
        quantized = convert_fx(prepared)
        assert quantized.predict.__self__ is quantized and quantized.scale == 3.0
        assert torch.equal(quantized.predict(X), quantized(X).sum((1, 2, 3)) * 3.0)
        assert _sqnr(model.predict(X), quantized.predict(X)) > 30
        assert reference.scale == 3.0 and reference.predict.__self__ is reference
        lowered = convert_fx(reference)
        assert lowered.predict.__self__ is lowered
        assert torch.equal(lowered.predict(X), quantized.predict(X))


# ---- tracing limits and refusals


class _ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        if x.shape[0] > 1:
            return self.c(x)
        return self.c(x) * 2


def test_the_untraceable_warning_names_the_models_line():
    """Control flow on a traced shape: the warning (and the report) quote the model's line (before: only torch.fx's
    "symbolically traced variables cannot be used as inputs to control flow"); its children are still int8."""
    model = nn.Sequential(_ShapeBranch(), nn.Conv2d(4, 2, 1)).eval()
    with pytest.warns(UserWarning, match=r"test_fx_s37\.py:\d+ `if x\.shape\[0\] > 1:`"):
        prepared = prepare_fx(model, Q.get_minmax_qconfig(), (X,))
    assert "`if x.shape[0] > 1:`" in prepared.lowbit_report.untraceable["0"]
    prepared(X)
    assert _sqnr(model(X).detach(), convert_fx(prepared)(X)) > 30


def test_a_standalone_module_config_is_refused_naming_what_to_use():
    cfg = AoPrepareCustomConfig().set_standalone_module_name("0", None, (X,), None, None)
    with pytest.raises(ValueError, match="standalone.*set_module_name"):
        prepare_fx(nn.Sequential(nn.Conv2d(3, 4, 1)).eval(), Q.get_minmax_qconfig(), (X,), prepare_custom_config=cfg)


# ---- parity with torch.ao (no defect: recorded so that it stays)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.c(x).relu()


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.inner, self.b = nn.Conv2d(3, 4, 1), _Inner(), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.b(self.inner(self.a(x)))


@torch.fx.wrap
def _clip(t, lo):
    return t.clamp(min=lo)


class _Wrapped(_Outer):
    def forward(self, x):
        return self.b(_clip(self.a(x), -0.5))


@pytest.mark.parametrize("case", ["non_traceable_name", "non_traceable_class", "fx_wrap", "module_name_none"])
def test_custom_configs_match_torch_ao(case):
    """Same int8 layers as torch.ao (a non-traceable module's children stay float; a wrapped function is a float op;
    a module named with qconfig None stays float) and outputs within two output steps of torch.ao's."""
    torch.manual_seed(0)
    model = (_Wrapped if case == "fx_wrap" else _Outer)().eval()
    ours_cfg = theirs_cfg = None
    # 7-bit activations: torch.ao's fbgemm is exact there on CPUs without VNNI too
    ours_map = Q.QConfigMapping().set_global(Q.QConfig(
        activation=Q.MinMaxObserver.with_args(qdtype=Q.quint8.with_range(0, 127)), weight=Q.get_minmax_qconfig().weight))
    theirs_map = ao.QConfigMapping().set_global(
        ao.QConfig(activation=ao.MinMaxObserver.with_args(dtype=torch.quint8, reduce_range=True),
                   weight=ao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)))
    if case.startswith("non_traceable"):
        key = {"non_traceable_name": ("non_traceable_module_name", ["inner"]),
               "non_traceable_class": ("non_traceable_module_class", [_Inner])}[case]
        ours_cfg, theirs_cfg = dict([key]), dict([key])
    if case == "module_name_none":
        ours_map.set_module_name("inner", None)
        theirs_map.set_module_name("inner", None)
    ours = prepare_fx(copy.deepcopy(model), ours_map, (X,), prepare_custom_config=ours_cfg)
    theirs = _quiet(quantize_fx.prepare_fx, copy.deepcopy(model), theirs_map, (X,), prepare_custom_config=theirs_cfg)
    with torch.no_grad():
        ours(X), theirs(X)
        ours, theirs = convert_fx(ours), _quiet(quantize_fx.convert_fx, theirs)
        ref, a, b = model(X), ours(X), theirs(X)
    names = sorted(n for n, m in ours.named_modules() if isinstance(m, Q.nn.quantized.Conv2d))
    names_ao = sorted(n for n, m in theirs.named_modules() if type(m).__module__.startswith("torch.ao.nn.")
                      and "Conv" in type(m).__name__)
    assert names == names_ao == ["a", "b"]
    assert float((a - b).abs().max()) <= 2.01 * float(ref.max() - ref.min()) / 127
    assert _sqnr(ref, a) > 30


def test_modules_called_with_keywords_and_functional_convs_with_attribute_options():
    """torch.ao fails on both ("Dequantize index 0 exceeded", an int stride for conv2d_prepack); lowbit quantizes."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.fc = nn.Conv2d(3, 6, 1), nn.Linear(6, 2)
            self.w = nn.Parameter(torch.randn(6, 2, 3, 3) * 0.3)
            self.stride, self.groups = 2, 3

        def forward(self, x):
            y = F.conv2d(self.c(input=x), self.w, None, self.stride, 1, 1, self.groups)
            return self.fc(input=y.relu().mean((2, 3)))

    torch.manual_seed(0)
    model = Net().eval()
    prepared = prepare_fx(copy.deepcopy(model), Q.get_minmax_qconfig(), (X,))
    prepared(X)
    quantized = convert_fx(prepared)
    convs = [m for m in quantized.modules() if isinstance(m, Q.nn.quantized.Conv2d)]
    assert len(convs) == 2 and {(c.stride, c.groups) for c in convs} == {((1, 1), 1), ((2, 2), 3)}
    assert _sqnr(model(X).detach(), quantized(X)) > 30
