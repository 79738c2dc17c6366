"""Session 42 follow-ups of the distillation / bias-tuning sweep (branch distill42b).

- ``distill`` / ``tune_biases`` on a ``prepare_qat_fx`` model were silent no-ops (n_layers=0, kept=False): refused by
  name now;
- ``tune_biases`` not kept left the zero biases it gave bias-less layers (state_dict keys changed) and their weights
  frozen: restored byte for byte now (``end_to_end.EndToEnd.finish``, shared with ``distill``);
- ``quantize_ptq(recipe="default" / "balanced", distill=N or tune=N)`` silently skipped the step: refused;
- ``to_onnx(exact=True)`` kept a ConvTranspose whose integer sums pass 2**24 as QDQ without a word (1 of 8,192 codes
  off in ORT): one warning names every layer that stays QDQ.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import reconstruct
from lowbit.algorithms.distill import distill
from lowbit.algorithms.tune import tune_biases
from lowbit.export import to_onnx


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _net(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=bias),
                         nn.Flatten(), nn.Linear(8 * 36, 5, bias=bias)).eval()


def _calib(n: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(12, 3, 6, 6) for _ in range(n)]


def _prepared(model: nn.Module, calib: list[torch.Tensor], rounded: bool = True) -> nn.Module:
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            p(b)
    if rounded:
        reconstruct(p, calib, adaround=False, bias_correction=False, progress=False)
    return p


@pytest.mark.parametrize("who", ["distill", "tune_biases"])
def test_a_qat_prepared_model_is_refused_by_name(who):
    model, calib = _net(), _calib()
    qat = Q.prepare_qat_fx(copy.deepcopy(model).train(), Q.get_default_qat_qconfig_mapping(),
                           example_inputs=(calib[0],))
    for b in calib:
        qat(b)
    keys = {k: v.clone() for k, v in qat.state_dict().items()}
    run = distill if who == "distill" else tune_biases
    with pytest.raises(ValueError, match=rf"{who}: prepared comes from prepare_qat_fx \(layer '0' is a QAT "
                                         r"ConvReLU2d that fake-quantizes its own weight\)"):
        run(qat, model, calib, iters=3, progress=False)
    assert list(qat.state_dict()) == list(keys) and all(torch.equal(v, keys[k]) for k, v in qat.state_dict().items())


@pytest.mark.parametrize("rounded", [True, False])
@pytest.mark.parametrize("who", ["distill", "tune_biases"])
def test_not_kept_leaves_the_model_byte_identical_keys_included(who, rounded):
    model, calib = _net(bias=False), _calib()
    p = _prepared(model, calib, rounded)
    ref = copy.deepcopy(p)
    run = distill if who == "distill" else tune_biases
    lrs = dict(lr=0.0, grid_lr=0.0, **({"bias_lr": 0.0} if who == "distill" else {}))
    r = run(p, model, calib, iters=4, batch_size=4, grids=True, progress=False, **lrs)  # lr 0: no gain, not kept
    assert not r.kept, r
    assert list(p.state_dict()) == list(ref.state_dict())  # tune_biases left '2.bias' and '4.bias' (zeros)
    assert all(torch.equal(a, b) for a, b in zip(p.state_dict().values(), ref.state_dict().values()))
    assert all(op.bias is None for op in (p.get_submodule("2"), p.get_submodule("4")))
    assert [type(m.qconfig.weight()).__name__ for m in (p.get_submodule("2"), p.get_submodule("4"))] == \
        [type(m.qconfig.weight()).__name__ for m in (ref.get_submodule("2"), ref.get_submodule("4"))]
    x = calib[0]
    assert torch.equal(Q.convert_fx(p)(x), Q.convert_fx(ref)(x))


def test_kept_tuning_still_adds_the_bias_it_learned():
    model, calib = _net(bias=False), _calib()
    p = _prepared(model, calib)
    with torch.no_grad():  # an error to undo: a constant offset on the last layer's output
        model[4].bias = nn.Parameter(torch.linspace(-0.3, 0.3, 5))
    r = tune_biases(p, model, calib, iters=40, batch_size=8, lr=1e-2, progress=False)
    assert r.kept and r.error_after < 0.5 * r.error_before, r
    assert "4.bias" in p.state_dict() and float(p.get_submodule("4").bias.detach().abs().sum()) > 0


@pytest.mark.parametrize("recipe", ["default", "balanced"])
@pytest.mark.parametrize("opt", ["distill", "tune"])
def test_quantize_ptq_refuses_accurate_only_steps_with_other_recipes(recipe, opt):
    model, calib = _net(), _calib()
    with pytest.raises(ValueError, match=rf"quantize_ptq: {opt}=7 applies to recipe='accurate' only, not "
                                         rf"recipe='{recipe}' \(it would be ignored\); pass {opt}=0"):
        Q.quantize_ptq(model, calib, recipe, progress=False, **{opt: 7})
    q, rep = Q.quantize_ptq(model, calib, recipe, progress=False, **{opt: 0})  # 0 (off) is fine
    assert rep.recipe == recipe


def _conv_transpose(c_in: int) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.ConvTranspose2d(c_in, 2, 3), Q.DeQuantStub()).eval()
    with torch.no_grad():
        m[1].weight.copy_(torch.randn_like(m[1].weight).sign())  # every code at +-127
    m.qconfig = Q.get_default_qconfig()
    m = Q.prepare(m)
    m(torch.randn(4, c_in, 4, 4))
    return Q.convert(m)


def test_exact_onnx_warns_naming_a_conv_transpose_past_2_24(tmp_path):
    pytest.importorskip("onnx")
    big = _conv_transpose(64)  # 255 * 64 * 9 * 127 = 18.7e6 > 2**24: stays QDQ
    with pytest.warns(UserWarning, match=r"to_onnx\(exact=True\): 1 quantized layer\(s\) stay QDQ.*'1' "
                                         r"\(ConvTranspose2d: its integer sums can pass 2\*\*24"):
        to_onnx(big, torch.randn(1, 64, 4, 4), tmp_path / "big.onnx", exact=True)
    small = _conv_transpose(8)  # 2.3e6: exact, no warning; nor without exact=True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_onnx(small, torch.randn(1, 8, 4, 4), tmp_path / "small.onnx", exact=True)
        to_onnx(big, torch.randn(1, 64, 4, 4), tmp_path / "big_qdq.onnx")


def test_exact_onnx_warns_naming_an_asymmetric_weight_layer(tmp_path):
    pytest.importorskip("onnx")
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 3), Q.DeQuantStub()).eval()
    m.qconfig = Q.QConfig(activation=Q.get_default_qconfig().activation,
                          weight=Q.MinMaxObserver.with_args(qdtype=Q.qint8, qscheme=Q.per_tensor_affine))
    m = Q.prepare(m)
    m(torch.randn(8, 4))
    m = Q.convert(m)
    with pytest.warns(UserWarning, match=r"'1' \(Linear: its weights have non-zero zero points\)"):
        to_onnx(m, torch.randn(1, 4), tmp_path / "asym.onnx", exact=True)
