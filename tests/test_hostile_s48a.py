"""Session 48 (review48a): hostile inputs on models and workflows. Each group failed before its fix:

- a lazy module whose parameters are not made yet (``nn.LazyLinear``, ``nn.LazyConv2d``): ``prepare_fx`` / eager
  ``prepare`` / ``prepare_qat`` calibrated a copy that made its own random weights (−2 dB against the float model,
  silently) and ``quantize_dynamic`` returned it unquantized; now one error naming the module;
- the legacy ``torch.nn.utils.weight_norm`` / ``spectral_norm`` in eager mode: the hook went with the module to its
  quantized class (``'Linear' object has no attribute 'weight_g'`` at the first call) or ``deepcopy`` refused the
  weight it computed (``quantize_dynamic``, ``quantize_weight_only``, ``prepare`` after a forward with gradients);
  now baked into a plain weight as ``prepare_fx`` does;
- a forward argument traced as ``None`` (``mask=None``): given at inference, torch.fx's AssertionError "mask has been
  specialized to have value None but got another value" (now a ValueError saying which model, why, and what to do);
  and the model's unpickling (``torch.load``) failed with ``KeyError: 'torch.fx._symbolic_trace._assert_is_none'``,
  after which every torch.fx trace in the process failed the same way (``prepare_fx`` left whole models float);
- a number passed to ``forward`` (``forward(x, scale=1.0)``: ``y * scale``) ran on the int8 grid calibration's value
  gave: ``scale=2.0`` at inference clipped (10.7 dB, silently); now that op is kept float, named in ``left_float``;
  ``forward(x, **kw)`` failed in prepare_fx (torch.fx's Interpreter gave ``kw`` a list);
- a float16 / bfloat16 model in eager ``prepare`` / ``prepare_qat`` with a static qconfig: a half op after the int8
  layers failed deep (``LayerNorm``'s "mixed dtype (CPU)"); now refused up front, as ``prepare_fx`` does.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp_min(1e-300)))


_X = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- 1. lazy modules not materialised
def _prepare_fx(m):
    return Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(_X,))


def _ptq_fx(m):
    """(prepared, converted) of ``m`` after one calibration batch, warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = _prepare_fx(m)
        p(_X)
        return p, Q.convert_fx(p)


def _prepare(m):
    m = nn.Sequential(Q.QuantStub(), m, Q.DeQuantStub())
    m.qconfig = Q.get_default_qconfig()
    return Q.prepare(m)


def _prepare_qat(m):
    m = nn.Sequential(Q.QuantStub(), m, Q.DeQuantStub()).train()
    m.qconfig = Q.get_default_qat_qconfig()
    return Q.prepare_qat(m)


@pytest.mark.parametrize("entry", [_prepare_fx, _prepare, _prepare_qat, lambda m: Q.quantize_dynamic(m, {nn.Linear}),
                                   lambda m: Q.quantize_weight_only(m, bits=8, group_size=8)],
                         ids=["prepare_fx", "prepare", "prepare_qat", "quantize_dynamic", "quantize_weight_only"])
def test_a_lazy_module_without_parameters_is_refused(entry):
    model = nn.Sequential(nn.Linear(8, 8), nn.LazyLinear(4)).eval()
    with pytest.raises(ValueError, match=r"module '(1\.)?1' \(LazyLinear\) has uninitialized parameters"):
        entry(model)  # before: calibrated random weights of the copy's own (-2 dB), or left LazyLinear float


def test_a_lazy_module_run_once_is_quantized():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LazyLinear(4)).eval()
    model(_X)  # (materialised: now an nn.Linear)
    p, q = _ptq_fx(copy.deepcopy(model))
    assert _sqnr(model(_X), q(_X)) > 30.0


# ---------------------------------------------------------------- 2. legacy weight / spectral norm, eager mode
def _legacy(kind: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.nn.utils.weight_norm is deprecated)
        lin = nn.Linear(8, 8)
        return torch.nn.utils.weight_norm(lin) if kind == "weight_norm" else torch.nn.utils.spectral_norm(lin)


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_eager_prepare_convert_with_a_legacy_norm(kind, grad):
    torch.manual_seed(0)
    model = nn.Sequential(Q.QuantStub(), _legacy(kind), Q.DeQuantStub()).eval()
    with torch.set_grad_enabled(grad):
        ref = model(_X).detach()  # (with gradients, the hook's weight is a non-leaf tensor deepcopy refuses)
    model.qconfig = Q.get_default_qconfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare(model)
        p(_X)
        q = Q.convert(p)
    assert _sqnr(ref, q(_X)) > 30.0  # before: 'Linear' object has no attribute 'weight_g' / deepcopy's error


@pytest.mark.parametrize("entry", ["quantize_dynamic", "quantize_weight_only"])
def test_dynamic_and_weight_only_with_a_legacy_weight_norm(entry):
    torch.manual_seed(0)
    model = nn.Sequential(_legacy("weight_norm")).eval()
    model[0].weight_g.data.mul_(2.0)
    ref = model(_X).detach()  # (a forward with gradients: deepcopy refused the computed weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = (Q.quantize_dynamic(model, {nn.Linear}) if entry == "quantize_dynamic"
             else Q.quantize_weight_only(model, bits=8, group_size=8))
    assert _sqnr(ref, q(_X)) > 30.0
    assert not any(h for m in q.modules() for h in m._forward_pre_hooks.values())


# ---------------------------------------------------------------- 3. an argument traced as None
class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask=None):
        y = self.fc(x)
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y


def test_an_argument_traced_as_none_says_so_when_given():
    torch.manual_seed(0)
    model = _Masked().eval()
    p, q = _ptq_fx(model)
    assert _sqnr(model(_X), q(_X)) > 30.0
    for m in (p, q):
        with pytest.raises(ValueError, match=r"_Masked was prepared with mask=None .*example_inputs that pass one"):
            m(_X, mask=_X > 0)  # before: AssertionError "mask has been specialized to have value None but got another
            # value" from torch.fx's check


def test_a_model_with_an_argument_traced_as_none_loads_and_leaves_torch_fx_working():
    """torch.fx's ``_assert_is_none`` check made the unpickling fail (``KeyError:
    'torch.fx._symbolic_trace._assert_is_none'``) and every torch.fx trace after it in the process too (``prepare_fx``
    then left a whole model float, warned). The test runs in a subprocess: before the fix it poisoned the process."""
    code = '''
import io, pickle, warnings, torch
from torch import nn, fx
import lowbit as Q
from test_hostile_s48a import _Masked, _X, _sqnr
torch.manual_seed(0)
model = _Masked().eval()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    p = Q.prepare_fx(model, Q.get_default_qconfig_mapping(), example_inputs=(_X,)); p(_X); q = Q.convert_fx(p)
buf = io.BytesIO(); torch.save(q, buf); buf.seek(0)
for r in (pickle.loads(pickle.dumps(q)), torch.load(buf, weights_only=False), fx.symbolic_trace(q)):
    assert torch.equal(r(_X), q(_X))
with warnings.catch_warnings():
    warnings.simplefilter("error")  # (before: "'<root>' (Sequential) cannot be traced by torch.fx (KeyError ...")
    fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8)))
    Q.prepare_fx(nn.Sequential(nn.Linear(8, 8)).eval(), Q.get_default_qconfig_mapping(), example_inputs=(_X,))
print("ok")
'''
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=here, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


# ---------------------------------------------------------------- 4. a number passed to forward
class _Scaled(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc, self.form = nn.Linear(8, 8), form

    def forward(self, x, scale=1.0):
        y = self.fc(x)
        if self.form == "mul":
            return y * scale
        if self.form == "div":
            return y / scale
        if self.form == "derived":
            return y * (scale * 2)
        return scale - y  # "rsub"


@pytest.mark.parametrize("form,scale", [("mul", 2.0), ("mul", -3.0), ("div", 0.25), ("derived", 2.0), ("rsub", -4.0)])
def test_an_op_on_a_number_passed_to_forward_is_kept_float(form, scale):
    torch.manual_seed(0)
    model = _Scaled(form).eval()
    p, q = _ptq_fx(model)
    assert _sqnr(model(_X, scale), q(_X, scale)) > 35.0  # before: 10.7 dB at mul 2.0 (the grid of scale=1.0)
    assert any("forward's argument 'scale'" in v for v in q.lowbit_report.left_float.values()), \
        q.lowbit_report.left_float


def test_a_number_from_the_input_shape_keeps_its_int8_op():
    """Pin: ``y * (x.shape[-1] / 8)`` (from a tensor argument's shape) stays an int8 scalar op."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x) * (x.shape[-1] / 8)

    p, q = _ptq_fx(M().eval())
    assert not q.lowbit_report.left_float
    assert "QFunctional" in str([type(m).__name__ for m in q.modules()])


# ---------------------------------------------------------------- 5. half models in eager static mode
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("entry", ["prepare", "prepare_qat"])
def test_eager_static_refuses_a_half_model(dtype, entry):
    model = nn.Sequential(Q.QuantStub(), nn.Linear(8, 8), Q.DeQuantStub(), nn.LayerNorm(8)).to(dtype)
    model.qconfig = Q.get_default_qat_qconfig() if entry == "prepare_qat" else Q.get_default_qconfig()
    with pytest.raises(TypeError, match=rf"{entry}: static int8 needs a float32 model, but '1.weight' is {dtype}"):
        getattr(Q, entry)(model.train() if entry == "prepare_qat" else model.eval())
    # before: prepared, and the converted model failed at its first call ("mixed dtype (CPU)" in LayerNorm)


def test_eager_half_model_with_a_dynamic_qconfig_is_still_prepared():
    """Pin: a dynamic qconfig keeps float activations, so a half model is fine there."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).half().eval()
    model.qconfig = Q.get_dynamic_qconfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = Q.convert(Q.prepare(model))
    assert q(_X.half()).dtype == torch.float16


def test_a_forward_with_var_keywords_is_prepared_and_its_number_kept_float():
    """``forward(x, **kw)``: torch.fx's Interpreter gave ``kw`` the rest of the positional inputs, a list, so
    prepare_fx failed ("running the traced model on example_inputs failed: 'list' object has no attribute 'get'");
    the number read from it is a forward argument's (kept float)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, **kw):
            return self.fc(x) * kw.get("k", 1.0)

    torch.manual_seed(0)
    model = M().eval()
    p, q = _ptq_fx(model)
    assert _sqnr(model(_X), q(_X)) > 35.0 and _sqnr(model(_X, k=3.0), q(_X, k=3.0)) > 35.0
    assert "argument 'kw'" in str(q.lowbit_report.left_float)
