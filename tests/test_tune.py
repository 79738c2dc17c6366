"""End-to-end bias tuning (``lowbit.algorithms.tune``): what it optimises is what ``convert_fx`` runs.

- the tuned biases (and grids) lower the int8 model's output error on the calibration data, and the
  error ``tune_biases`` reports is the converted model's (the simulation is exact);
- nothing changes when tuning finds no gain (lr 0), or with ``iters=0``;
- ``quantize_ptq(tune=N)`` reports the step; bad input raises naming the value.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import reconstruct
from lowbit.algorithms.tune import tune_biases
from lowbit.observer.fixed import FixedQParamsObserver
from helpers import bn_depthwise_net


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _net() -> nn.Module:
    return bn_depthwise_net()


def _rounded(model: nn.Module, calib: list[torch.Tensor], offset: float = 0.0) -> nn.Module:
    """Calibrated, weights rounded to nearest and frozen; ``offset`` added to every bias (an error to undo)."""
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            p(b)
    reconstruct(p, calib, adaround=False, bias_correction=False, progress=False)
    with torch.no_grad():
        for n, t in p.named_parameters():
            if n.endswith("bias"):
                t.add_(offset * torch.linspace(-1, 1, t.numel()))
    return p


def _error(model: nn.Module, q: nn.Module, calib: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float((q(b) - model(b)).pow(2).sum(1).mean()) for b in calib)


@pytest.mark.parametrize("grids", [False, True])
def test_tuning_lowers_the_int8_models_calibration_error_and_reports_it_exactly(grids):
    model = _net()
    torch.manual_seed(1)
    calib = [torch.randn(16, 3, 6, 6) for _ in range(3)]
    p = _rounded(model, calib, offset=0.05)
    before = _error(model, Q.convert_fx(copy.deepcopy(p)), calib)
    r = tune_biases(p, model, calib, iters=60, batch_size=8, lr=3e-3, grids=grids, progress=False)
    after = _error(model, Q.convert_fx(p), calib)
    assert r.kept and after < 0.5 * before and r.n_biases == 3, (r, before, after)
    assert r.error_before == pytest.approx(before, rel=1e-3) and r.error_after == pytest.approx(after, rel=1e-3)
    fixed = [m for m in p.modules() if isinstance(m, FixedQParamsObserver)]
    assert len(fixed) == (r.n_grids if grids else 0) and (r.n_grids > 0) == grids


def test_no_gain_leaves_the_model_as_it_was():
    model = _net()
    calib = [torch.randn(8, 3, 6, 6) for _ in range(2)]
    p = _rounded(model, calib)
    biases = [t.clone() for n, t in p.named_parameters() if n.endswith("bias")]
    for kw in (dict(iters=0), dict(iters=5, lr=0.0, grid_lr=0.0, grids=True)):
        r = tune_biases(p, model, calib, progress=False, **kw)
        assert not r.kept and r.n_grids == 0, r
        assert all(torch.equal(a, b) for a, b in zip(biases, [t for n, t in p.named_parameters() if n.endswith("bias")]))
        assert not any(isinstance(m, FixedQParamsObserver) for m in p.modules())
        assert all(t.grad is None for t in p.parameters())


def test_quantize_ptq_tune_step_and_bad_input():
    model = _net()
    calib = [torch.randn(8, 3, 6, 6) for _ in range(2)]
    q, rep = Q.quantize_ptq(model, calib, iters=5, tune=10, progress=False)
    assert [s for s, _ in rep.steps][-3:] == ["tune biases", "convert", "float output"], rep.steps
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match=f"tune={bad!r}"):
            Q.quantize_ptq(model, calib, tune=bad, progress=False)
    p = _rounded(model, calib)
    with pytest.raises(ValueError, match="iters=-3"):
        tune_biases(p, model, calib, iters=-3)
    with pytest.raises(ValueError, match="batch_size=0"):
        tune_biases(p, model, calib, batch_size=0)
    with pytest.raises(TypeError, match="prepare_fx"):
        tune_biases(model, model, calib)


def test_calibration_batches_follow_lowbit_batches_convention_and_errors_name_the_caller():
    """``reconstruct`` / ``tune_biases`` read ``calib`` as every other data-driven step does (``lowbit.batches``:
    a tensor is one batch, a list batch holds positional inputs like a tuple), and bad ``calib`` raises naming
    the function called (the shared helper once named ``reconstruct`` for ``tune_biases`` too)."""
    model = _net()
    calib = [torch.randn(8, 3, 6, 6) for _ in range(2)]
    p = _rounded(model, calib, offset=0.05)
    ref = tune_biases(copy.deepcopy(p), model, [(b,) for b in calib], iters=5, progress=False)
    for same in ([[b] for b in calib], calib):  # list batches, tensor batches: the same run, the same numbers
        got = tune_biases(copy.deepcopy(p), model, same, iters=5, progress=False)
        assert (got.error_before, got.error_after) == (ref.error_before, ref.error_after)
    with pytest.raises(ValueError, match="tune_biases: calib: inputs is empty"):
        tune_biases(p, model, [])
    with pytest.raises(TypeError, match="tune_biases: calib batch 0 is a dict"):
        tune_biases(p, model, [{"x": calib[0]}])
    with pytest.raises(TypeError, match="tune_biases: calib: inputs must be a tensor or an iterable"):
        tune_biases(p, model, 3)
    q = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    with torch.no_grad():
        q(calib[0])
    with pytest.raises(ValueError, match="reconstruct: calib: inputs is empty"):
        reconstruct(q, [], progress=False)
    one = copy.deepcopy(q)
    reconstruct(one, calib[0], adaround=False, progress=False)  # a tensor is one batch
    two = copy.deepcopy(q)
    reconstruct(two, [[calib[0]]], adaround=False, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values()))
