"""Session 36: graph mode and the debug tools with hostile and unusual inputs, torch.ao.quantization.quantize_fx as the
oracle. The sweep (functional weights, shared modules, in-place ops, dict / tuple / None outputs, concatenation of
differently-observed inputs, integer shape arithmetic, interpolation, means, matmul / bmm, scalar arithmetic, lone
BatchNorms, conv1d / conv3d / transposed convs, a dynamic LSTM, the custom configs and QConfigMapping variants) found
graph mode on par with or above torch.ao everywhere; the defects were in the refusals:

- ``prepare_fx`` of a model ``convert_fx`` or ``convert_to_reference_fx`` made said "already prepared ...; calibrate it
  and call convert_fx";
- a custom module's ``from_float`` error reached the caller bare (eager ``prepare`` names the module), and a
  ``from_observed`` returning no module failed inside torch.fx ("`d` is not an nn.Module");
- ``compare(prepared_model, ...)`` ran the prepared model's observers on the comparison data (its calibration changed
  in place, and the numbers compared a fake-quantized model); swapped arguments and a prepared ``quantized_model``
  got "pass the float model the quantized one was converted from";
- ``sensitivity`` / ``layer_sensitivity`` / ``auto_mixed_precision`` of a prepared or converted model failed deep inside
  ("MinMaxObserver observes tensors, got QTensor"), said "quantizes no layer" or named ``prepare_fx``, and
  ``layer_sensitivity`` recalibrated a prepared model's observers first.

Each test of a refusal failed before its fix.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.debug import auto_mixed_precision, compare, layer_sensitivity, sensitivity
from lowbit.fx import convert_fx, prepare_fx, prepare_qat_fx
from lowbit.reference.fx import convert_to_reference_fx

ao = pytest.importorskip("torch.ao.quantization")
from torch.ao.quantization import quantize_fx  # noqa: E402


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - y).pow(2).mean().clamp_min(1e-20)))


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def _seven_bit() -> bool:
    """Without VNNI (an ``ONEDNN_MAX_CPU_ISA=AVX2`` cap included) torch.ao's fbgemm kernels saturate the u8×s8 pair
    sums of full-range 8-bit activations (docs/design.md, "Kernels on CPUs without VNNI") while lowbit's stay exact:
    there the parity runs on 7-bit activations, where torch.ao is exact too."""
    from lowbit.kernels import onednn

    return not onednn.has_vnni()


def _ao_qconfig():
    return ao.QConfig(activation=ao.MinMaxObserver.with_args(dtype=torch.quint8, reduce_range=_seven_bit()),
                      weight=ao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                   qscheme=torch.per_channel_symmetric))


def _ours_qconfig():
    if not _seven_bit():
        return Q.get_minmax_qconfig()
    return Q.QConfig(activation=Q.MinMaxObserver.with_args(qdtype=Q.quint8.with_range(0, 127)),
                     weight=Q.get_minmax_qconfig().weight)


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return {"a": self.c(x), "b": self.c(x).relu()}


class _FunctionalLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return F.linear(x, self.w, self.b)


class _Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.o(torch.cat([self.a(x), self.b(x) * 10], 1))


class _Mean(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.l = nn.Conv2d(3, 4, 3), nn.Linear(4, 3)

    def forward(self, x):
        y = self.c(x)
        return self.l(y.mean((2, 3))) + self.l(torch.flatten(y.mean([2, 3], keepdim=True), 1))


class _MatMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        return torch.matmul(a, b.t()), torch.bmm(a[None], b[None].transpose(1, 2))


class _Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.r, self.o = nn.Linear(8, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.r(self.l(x))
        return self.o(y)


def _case(name):
    torch.manual_seed(0)
    x4 = torch.randn(4, 3, 8, 8)
    if name == "dict_out":
        return _DictOut(), (x4,), None
    if name == "functional_linear":
        return _FunctionalLinear(), (torch.randn(4, 16),), None
    if name == "cat_of_different_grids":
        return _Cat(), (x4,), None
    if name == "mean_keepdim_flatten":
        return _Mean(), (x4,), None
    if name == "matmul_bmm":
        return _MatMul(), (torch.randn(4, 16),), None
    if name == "conv1d_bn_relu":
        return nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Conv1d(4, 2, 3)), \
            (torch.randn(4, 3, 20),), None
    if name == "conv3d_bn_relu":
        return nn.Sequential(nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4), nn.ReLU(), nn.Conv3d(4, 2, 3)), \
            (torch.randn(2, 3, 6, 6, 6),), None
    assert name == "dynamic_lstm"
    return _Lstm(), (torch.randn(2, 5, 8),), nn.LSTM


@pytest.mark.parametrize("name", ["dict_out", "functional_linear", "cat_of_different_grids", "mean_keepdim_flatten",
                                  "matmul_bmm", "conv1d_bn_relu", "conv3d_bn_relu", "dynamic_lstm"])
def test_unusual_graphs_match_torch_ao(name):
    """Same recipe (min/max activations, per-channel symmetric weights), same calibration: every output within about
    one output step of torch.ao's and the same kinds of int8 layers (torch.ao's names, lowbit's modules)."""
    model, xs, dynamic = _case(name)
    model = model.eval()
    ours_map = Q.QConfigMapping().set_global(_ours_qconfig())
    ao_map = ao.QConfigMapping().set_global(_ao_qconfig())
    if dynamic is not None:
        ours_map.set_object_type(dynamic, Q.get_dynamic_qconfig())
        ao_map.set_object_type(dynamic, ao.default_dynamic_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = prepare_fx(copy.deepcopy(model), ours_map, example_inputs=xs)
        theirs = quantize_fx.prepare_fx(copy.deepcopy(model), ao_map, example_inputs=xs)
        with torch.no_grad():
            ours(*xs), theirs(*xs)
        ours, theirs = convert_fx(ours), quantize_fx.convert_fx(theirs)
        with torch.no_grad():
            ref, y_ours, y_ao = _tensors(model(*xs)), _tensors(ours(*xs)), _tensors(theirs(*xs))
    assert len(ref) == len(y_ours) == len(y_ao)
    for r, a, b in zip(ref, y_ours, y_ao):
        step = float(r.max() - r.min()) / (127 if _seven_bit() else 255)
        assert float((a - b).abs().max()) <= 2.01 * step, name
        assert _sqnr(r, a) > 30
    q_ours = sorted({type(m).__name__ for m in ours.modules() if type(m).__module__.startswith("lowbit.nn.quantized")
                     and type(m).__name__ not in ("Quantize", "DeQuantize", "QFunctional")})
    q_ao = {type(m).__name__ for m in theirs.modules() if type(m).__module__.startswith(
        ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")) and "Packed" not in type(m).__name__}
    q_ao |= {"Linear" for n in theirs.graph.nodes if str(n.target) == "quantized.linear"}  # (a functional op there)
    q_ao = sorted(q_ao)
    assert q_ours == q_ao, (q_ours, q_ao)


# ---- refusals


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.relu, self.fc = nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.relu(self.conv(x)).mean((2, 3)))


def _prepared_and_converted():
    torch.manual_seed(1)
    model, x = _Net().eval(), torch.randn(8, 3, 8, 8)
    prepared = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
    prepared(x)
    return model, x, prepared, convert_fx(prepared)


@pytest.mark.parametrize("fn", [prepare_fx, prepare_qat_fx])
def test_preparing_a_converted_model_says_it_is_converted(fn):
    model, x, prepared, qmodel = _prepared_and_converted()
    for done in (qmodel, convert_to_reference_fx(prepared)):
        with pytest.raises(ValueError, match=r"already converted by convert_fx or convert_to_reference_fx; pass the "
                                             r"float model"):
            fn(done, Q.get_minmax_qconfig(), example_inputs=(x,))
    with pytest.raises(ValueError, match="already prepared by prepare_fx/prepare_qat_fx; calibrate it"):
        fn(prepared, Q.get_minmax_qconfig(), example_inputs=(x,))


class _Double(nn.Module):
    def forward(self, x):
        return x * 2


class _UsesDouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.d, self.b = nn.Linear(8, 8), _Double(), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.d(self.a(x)))


class _ObservedDouble(nn.Module):
    @classmethod
    def from_float(cls, mod):
        return cls()

    def forward(self, x):
        return x * 2


class _RefusesFloat(nn.Module):
    @classmethod
    def from_float(cls, mod):
        raise RuntimeError("no weights to observe")


class _ReturnsNone(nn.Module):
    @classmethod
    def from_observed(cls, mod):
        return None


def test_custom_module_class_errors_name_the_module():
    x = torch.randn(4, 8)
    bad = {"float_to_observed_custom_module_class": {"static": {_Double: _RefusesFloat}}}
    with pytest.raises(RuntimeError, match=r"^prepare_fx: custom module 'd' \(_Double -> _RefusesFloat.from_float\): "
                                           r"no weights to observe"):
        prepare_fx(_UsesDouble().eval(), Q.get_minmax_qconfig(), (x,), prepare_custom_config=bad)
    good = {"float_to_observed_custom_module_class": {"static": {_Double: _ObservedDouble}}}
    prepared = prepare_fx(_UsesDouble().eval(), Q.get_minmax_qconfig(), (x,), prepare_custom_config=good)
    prepared(x)
    with pytest.raises(TypeError, match=r"^convert_fx: module 'd': _ReturnsNone.from_float / from_observed returned "
                                        r"NoneType, not an nn.Module"):
        convert_fx(prepared, convert_custom_config={
            "observed_to_quantized_custom_module_class": {"static": {_ObservedDouble: _ReturnsNone}}})


def _observer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "activation_post_process" in k}


def test_compare_refuses_a_prepared_float_model_and_leaves_its_calibration_alone():
    model, x, prepared, qmodel = _prepared_and_converted()
    before = _observer_state(prepared)
    with pytest.raises(TypeError, match=r"^compare: float_model is already prepared \(module "
                                        r"'activation_post_process_0' \(MinMaxObserver\)"):
        compare(prepared, qmodel, x * 10)  # was: a table, and the observers had learnt x * 10's range
    after = _observer_state(prepared)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert compare(model, qmodel, x).rows  # the float model still works


def test_compare_names_swapped_arguments_and_an_unconverted_model():
    model, x, prepared, qmodel = _prepared_and_converted()
    with pytest.raises(TypeError, match=r"^compare: float_model is already quantized \(module 'conv' \(ConvReLU2d\)"):
        compare(qmodel, model, x)  # was: "pass the float model the quantized one was converted from"
    with pytest.raises(TypeError, match=r"^compare: quantized_model is prepared but not converted .*call convert / "
                                        r"convert_fx first"):
        compare(model, prepared, x)


def _run_tool(tool, model, x):
    qc = Q.get_minmax_qconfig()
    if tool == "sensitivity":
        return sensitivity(model, qc, [x], lambda m: 0.0, method="fx")
    if tool == "layer_sensitivity":
        return layer_sensitivity(model, qc, [x], mode="fx")
    return auto_mixed_precision(model, qc, [x], lambda m: 0.0, tolerance=1.0, mode="fx", progress=False)


@pytest.mark.parametrize("tool", ["sensitivity", "layer_sensitivity", "auto_mixed_precision"])
def test_sensitivity_tools_refuse_prepared_and_converted_models(tool):
    model, x, prepared, qmodel = _prepared_and_converted()
    before = _observer_state(prepared)
    with pytest.raises(TypeError, match=rf"^{tool}: model is already prepared \(module 'activation_post_process_0' "
                                        r"\(MinMaxObserver\) is not a float module\); pass the float model"):
        _run_tool(tool, prepared, x * 10)
    after = _observer_state(prepared)  # layer_sensitivity ran the prepared model on x * 10 before failing
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(TypeError, match=rf"^{tool}: model is already quantized \(module 'conv' \(ConvReLU2d\)"):
        _run_tool(tool, qmodel, x)


@pytest.mark.parametrize("make, kind", [
    (lambda m: Q.prepare(m, Q.get_default_qconfig()), "prepared"),
    (lambda m: Q.prepare_qat(m.train(), Q.get_default_qat_qconfig()), "QAT-prepared"),
    (lambda m: Q.convert(_calibrated(Q.prepare(m, Q.get_default_qconfig()))), "quantized"),
])
def test_prepare_fx_refuses_an_eager_prepared_or_converted_model(make, kind):
    """An eager-prepared, QAT-prepared or converted model went into prepare_fx silently: its observers and int8
    modules became opaque leaves of the graph (session 36, lead)."""
    model = make(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval())
    for fn in (Q.prepare_fx, Q.prepare_qat_fx):
        with pytest.raises(TypeError, match=f"already {kind} in eager mode"):
            fn(model, Q.get_default_qconfig_mapping(), example_inputs=(torch.randn(2, 4),))


def _calibrated(prepared):
    prepared(torch.randn(8, 4))
    return prepared
