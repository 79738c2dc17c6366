"""End-to-end distillation (``lowbit.algorithms.distill``): what it optimises is what ``convert_fx`` runs.

- the distilled codes, biases and grids lower the int8 model's output error on the calibration data, the error it
  reports is the converted model's (the simulation is exact), and the converted weights are the codes it learned;
- step 0 runs the rounded model itself (the offsets start at 0);
- nothing changes when it finds no gain, or with ``iters=0`` (weights, biases, qconfigs, observers as they were);
- ``quantize_ptq(distill=N)`` reports the step; bad input raises naming the value.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import reconstruct
from lowbit.algorithms.distill import distill
from lowbit.algorithms.layers import is_weighted, weight_codes
from lowbit.observer.fixed import FixedQParamsObserver
from helpers import bn_depthwise_net


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _net() -> nn.Module:
    return bn_depthwise_net(linear_bias=False)


def _rounded(model: nn.Module, calib: list[torch.Tensor], rounded: bool = True) -> nn.Module:
    """Calibrated and (``rounded``) its weights rounded to nearest and frozen, biases corrected."""
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            p(b)
    if rounded:
        reconstruct(p, calib, adaround=False, bias_correction=True, progress=False)
    return p


def _error(model: nn.Module, q: nn.Module, calib: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float((q(b) - model(b)).pow(2).sum(1).mean()) for b in calib)


def _calib(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(16, 3, 6, 6) for _ in range(n)]


@pytest.mark.parametrize("grids", [False, True])
@pytest.mark.parametrize("rounded", [True, False])
def test_distillation_lowers_the_int8_error_reports_it_exactly_and_converts_its_codes(grids, rounded):
    model, calib = _net(), _calib()
    p = _rounded(model, calib, rounded)
    before = _error(model, Q.convert_fx(copy.deepcopy(p)), calib)
    r = distill(p, model, calib, iters=80, batch_size=8, lr=5e-2, grids=grids, progress=False)
    q = Q.convert_fx(copy.deepcopy(p))
    after = _error(model, q, calib)
    assert r.kept and after < 0.8 * before and r.n_layers == 3 and r.codes_moved > 0, (r, before, after)
    # the simulation it optimised is the int8 model: its errors are the converted model's (before distilling too,
    # unrounded layers included: weight_codes is convert's round(w · fl(1/s) + z) since ties42; it was round(w / s),
    # one extreme code per channel off at exact ties, 1.070e-4 against 1.042e-4 converted)
    assert r.error_after == pytest.approx(after, rel=1e-6)
    assert r.error_before == pytest.approx(before, rel=1e-6)
    fixed = [m for m in p.modules() if isinstance(m, FixedQParamsObserver)]
    assert len(fixed) == (r.n_grids if grids else 0) and (r.n_grids > 0) == grids
    # the converted layers hold exactly the codes the prepared model's frozen weights carry
    mods = dict(p.named_modules())
    layers = {n.target: mods[n.target] for n in p.graph.nodes if n.op == "call_module" and is_weighted(mods[n.target])}
    assert len(layers) == 3
    for name, m in layers.items():
        codes = q.get_submodule(name).weight_int8
        assert torch.equal(codes.float(), weight_codes(m)[0]), name
    # the Linear had no bias: distillation gave it one, which convert keeps
    assert q.get_submodule(list(layers)[-1]).bias is not None


def test_step_zero_is_the_rounded_model():
    model, calib = _net(), _calib(1)
    p = _rounded(model, calib)
    ref = copy.deepcopy(p)
    r = distill(p, model, calib, iters=1, lr=0.0, bias_lr=0.0, grid_lr=0.0, progress=False)
    # with every learning rate 0 one step changes nothing: the error after equals the error before, not kept
    assert r.error_after == r.error_before and not r.kept
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), p.state_dict().values()))


@pytest.mark.parametrize("kw", [dict(iters=0), dict(iters=20, lr=1e3, bias_lr=1e2)])
def test_no_gain_leaves_the_model_as_it_was(kw):
    model, calib = _net(), _calib(2)
    for rounded in (True, False):
        p = _rounded(model, calib, rounded)
        ref = copy.deepcopy(p)
        keys = list(p.state_dict())
        r = distill(p, model, calib, progress=False, **kw)
        assert not r.kept and r.n_grids == 0 and r.codes_moved == 0, r
        assert list(p.state_dict()) == keys  # no parametrization, no added bias left behind
        assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), p.state_dict().values()))
        assert not any(isinstance(m, FixedQParamsObserver) for m in p.modules())
        assert all(t.grad is None and not isinstance(t, torch.nn.utils.parametrize.ParametrizationList)
                   for t in p.parameters())
        x = calib[0]
        assert torch.equal(Q.convert_fx(copy.deepcopy(p))(x), Q.convert_fx(ref)(x))


def test_quantize_ptq_distill_step_and_bad_input():
    model, calib = _net(), _calib(2)
    q, rep = Q.quantize_ptq(model, calib, iters=5, distill=10, progress=False)
    assert [s for s, _ in rep.steps][-3:] == ["distill", "convert", "float output"], rep.steps
    assert "codes moved" in dict(rep.steps)["distill"]
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match=f"distill={bad!r}"):
            Q.quantize_ptq(model, calib, distill=bad, progress=False)
    for recipe in ("balanced", "default"):  # accurate only: refused, not silently skipped (session 42)
        with pytest.raises(ValueError, match=f"distill=10 applies to recipe='accurate' only, not recipe='{recipe}'"):
            Q.quantize_ptq(model, calib, recipe, distill=10, progress=False)
    p = _rounded(model, calib)
    for kw, msg in ((dict(iters=-3), "iters=-3"), (dict(batch_size=0), "batch_size=0"),
                    (dict(lr=float("nan")), "lr=nan"), (dict(grid_lr=-1.0), "grid_lr=-1.0"),
                    (dict(bias_lr="1"), "bias_lr='1'")):
        with pytest.raises(ValueError, match=msg):
            distill(p, model, calib, **kw)
    with pytest.raises(TypeError, match="prepare_fx"):
        distill(model, model, calib)
    with pytest.raises(TypeError, match="float_model must be an nn.Module, got str"):
        distill(p, "model", calib)
    with pytest.raises(ValueError, match="distill: calib: inputs is empty"):
        distill(p, model, [])


def test_cli_distill_flag(tmp_path, monkeypatch, capsys):
    """``lowbit quantize --recipe accurate --distill N`` runs the step (the report says so); the flag is refused
    by name with another recipe or a bad value."""
    from lowbit import cli

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    torch.save(torch.randn(32, 3, 6, 6), "x.pt")
    (tmp_path / "net41.py").write_text("import torch\nfrom torch import nn\n"
                                       "def net():\n    torch.manual_seed(0)\n"
                                       "    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), "
                                       "nn.Linear(128, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["quantize", "--quiet", "--model", "net41:net", "--calib", "x.pt", "--method", "ptq"]
    assert cli.main([*base, "--recipe", "accurate", "--distill", "4", "--out", "o1"]) == 0
    report = "\n".join(p.read_text() for p in (tmp_path / "o1").rglob("*") if p.suffix in (".md", ".txt", ".json"))
    assert "distill" in report and "4 steps" in report
    capsys.readouterr()
    assert cli.main([*base, "--distill", "4", "--out", "o2"]) == 2
    assert "--distill 4 applies to --recipe accurate, not --recipe default" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main([*base, "--recipe", "accurate", "--distill", "-1", "--out", "o3"])
    assert e.value.code == 2 and "-1 must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
