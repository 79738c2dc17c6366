"""Session 42 hostile-input sweep of session 41's end-to-end distillation, its CLI flag and ``benchmarks/accuracy.py
--distill`` (``to_onnx(exact=True)`` held: 0 codes off on every probe where exact applies, nothing to fix there).

Before the fixes:

- ``distill`` / ``tune_biases`` compared the prepared model's outputs with a ``float_model`` of another output
  structure element by element: ``zip`` stopped at the shorter (a 2-tuple target against one output: the second
  ignored), a ``(N, 1)`` / ``(1, 5)`` / scalar target broadcast against ``(N, 5)``, an integer-only output gave an
  error of 0; ``distill`` then kept the codes it "learned" (kept=True);
- an uncalibrated prepared model distilled with its observers running as the identity and kept the result
  (``convert_fx`` then refused it: "saw no data");
- a ``float_model`` in training mode gave batch-statistics / dropout targets and had its BN running statistics
  changed by ``distill`` (error before 1.418 where the eval targets give 5.2e-5);
- ``seed`` was unchecked (``RuntimeError: manual_seed expected a long``), ``grids`` / ``progress`` took any value,
  a batch of 0 samples raised ``random_ expects 'from' to be less than 'to'`` and a batch the float model cannot
  run a bare torch ``RuntimeError``;
- ``--distill 99999999999999999999999`` failed only after the rounding ran (``OverflowError ... ssize_t``);
  ``benchmarks/accuracy.py --distill -1`` ran the default and balanced rows before failing, ``--distill N``
  without the accurate ImageNet rows was silently ignored.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import reconstruct
from lowbit.algorithms.distill import distill
from lowbit.algorithms.tune import tune_biases

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 5)).eval()


def _calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 4, 4, generator=g) for _ in range(2)]


def _prepared(model: nn.Module, calib: list[torch.Tensor], calibrate: bool = True) -> nn.Module:
    p = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(calib[0],))
    if calibrate:
        with torch.no_grad():
            for b in calib:
                p(b)
        reconstruct(p, calib, adaround=False, bias_correction=True, progress=False)
    return p


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


class _Pair(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.m(x)
        return y, 2 * y


class _Const(nn.Module):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.shape, self.dtype = shape, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tuple(x.shape[0] if s == -1 else s for s in self.shape), dtype=self.dtype)


@pytest.mark.parametrize("fm, shapes", [
    (lambda m: _Pair(m), r"float_model \[\(8, 5\), \(8, 5\)\]"),  # was: the second output ignored
    (lambda m: _Const((-1, 1)), r"float_model \[\(8, 1\)\]"),  # was: broadcast, kept=True
    (lambda m: _Const((1, 5)), r"float_model \[\(1, 5\)\]"),
    (lambda m: _Const(()), r"float_model \[\(\)\]"),
    (lambda m: _Const((-1, 5), torch.long), r"float_model \[\]"),  # was: error 0 before and after
])
@pytest.mark.parametrize("who", ["distill", "tune_biases"])
def test_float_model_of_other_outputs_is_refused_and_the_model_left_as_it_was(fm, shapes, who):
    model, calib = _net(), _calib()
    p = _prepared(model, calib)
    ref = copy.deepcopy(p)
    run = distill if who == "distill" else tune_biases
    with pytest.raises(ValueError, match=rf"{who}: on calib batch 0 the prepared model returned float tensors of "
                                         rf"shapes \[\(8, 5\)\], {shapes}; float_model must be the model that was prepared"):
        run(p, fm(model).eval(), calib, iters=3, progress=False)
    assert _same(p, ref) and all(not hasattr(m, "parametrizations") for m in p.modules())
    x = calib[0]
    assert torch.equal(Q.convert_fx(copy.deepcopy(p))(x), Q.convert_fx(ref)(x))


def test_the_same_model_with_tuple_outputs_still_distills():
    model, calib = _Pair(_net()).eval(), _calib()
    r = distill(_prepared(model, calib), model, calib, iters=3, progress=False)
    assert r.n_layers == 2


def test_uncalibrated_prepared_model_is_refused():
    # was: kept=True with every activation observer running as the identity; convert_fx then refused the model
    model, calib = _net(), _calib()
    p = _prepared(model, calib, calibrate=False)
    with pytest.raises(ValueError, match=r"distill: the observer after 'input_1' \(activation_post_process_0\) saw no "
                                         r"data; run calibration batches"):
        distill(p, model, calib, iters=3, progress=False)


def test_float_model_in_training_mode_gives_eval_targets_and_is_not_changed():
    torch.manual_seed(0)
    fm = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(32, 5),
                       nn.Dropout(0.5)).eval()
    calib = _calib()
    p = _prepared(fm, calib)
    p2 = copy.deepcopy(p)
    want = distill(p2, fm, calib, iters=5, progress=False)
    fm.train()
    state = copy.deepcopy(fm.state_dict())
    got = distill(p, fm, calib, iters=5, progress=False)
    assert got == want  # the eval-mode targets (was: error before 1.418 against batch statistics and dropout)
    assert fm.training and all(m.training for m in fm.modules())
    assert all(torch.equal(v, fm.state_dict()[k]) for k, v in state.items())  # running stats untouched


@pytest.mark.parametrize("kw, err, msg", [
    (dict(seed="x"), TypeError, "distill: seed='x' must be an int"),
    (dict(seed=1.5), TypeError, "distill: seed=1.5 must be an int"),
    (dict(seed=True), TypeError, "distill: seed=True must be an int"),
    (dict(seed=None), TypeError, "distill: seed=None must be an int"),
    (dict(seed=2 ** 70), ValueError, r"distill: seed=1180591620717411303424 must be in \[-2\*\*63, 2\*\*64\)"),
    (dict(grids="no"), TypeError, "distill: grids='no' must be True or False"),
    (dict(grids=None), TypeError, "distill: grids=None must be True or False"),
    (dict(progress=1), TypeError, "distill: progress=1 must be True or False"),
    (dict(iters=2 ** 64), ValueError, r"distill: iters=18446744073709551616 must be an int in \[0, 2\*\*63\)"),
])
def test_bad_settings_are_refused_by_name(kw, err, msg):
    model, calib = _net(), _calib()
    p = _prepared(model, calib)
    ref = copy.deepcopy(p)
    with pytest.raises(err, match=msg):
        distill(p, model, calib, **{"progress": False, **kw})
    assert _same(p, ref)


def test_bad_batches_are_refused_naming_the_batch():
    model, calib = _net(), _calib()
    p = _prepared(model, calib)
    with pytest.raises(ValueError, match=r"distill: calib batch 1 has no samples \(input shapes \[\(0, 3, 4, 4\)\]\)"):
        distill(p, model, [calib[0], calib[0][:0]], progress=False)
    with pytest.raises(ValueError, match=r"distill: float_model failed on calib batch 0 \(input shapes "
                                         r"\[\(8, 4, 4, 4\)\]\): RuntimeError: .*channels"):
        distill(p, model, [torch.randn(8, 4, 4, 4)], progress=False)
    with pytest.raises(ValueError, match=r"distill: float_model failed on calib batch 0 .*RuntimeError: .*double"):
        distill(p, model, [calib[0].double()], progress=False)


def test_quantize_ptq_and_cli_refuse_a_step_count_past_int64_before_any_work(tmp_path, monkeypatch, capsys):
    model, calib = _net(), _calib()
    with pytest.raises(ValueError, match=r"quantize_ptq: distill=1267650600228229401496703205376 must be an int in "
                                         r"\[0, 2\*\*63\)"):
        Q.quantize_ptq(model, calib, distill=2 ** 100, progress=False)
    from lowbit import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["quantize", "--quiet", "--calib", "x.pt", "--method", "ptq", "--recipe", "accurate",
                  "--distill", str(2 ** 100), "--out", "o"])
    assert e.value.code == 2
    assert f"argument --distill: {2 ** 100} must be <= 2**63 - 1" in capsys.readouterr().err


def _accuracy():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_s42_accuracy", BENCH / "accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("args, msg", [
    (["--distill", "-1"], "--distill -1: must be >= 0"),
    (["--distill", "5", "--recipes", "default,balanced"],
     "--distill 5 applies to the accurate recipe's ImageNet rows (--recipes with accurate, --models with mnv2 or "
     "lite0); here --recipes default,balanced --models mnv2,lite0,fmnist,minilm"),
    (["--distill", "5", "--models", "fmnist,minilm"], "here --recipes default,balanced,accurate --models fmnist,minilm"),
])
def test_accuracy_benchmark_distill_checks(args, msg, monkeypatch, capsys, tmp_path):
    # was: -1 ran the default / balanced rows (minutes) before quantize_ptq refused it; the others ran without it
    accuracy = _accuracy()
    monkeypatch.setattr(sys, "argv", ["accuracy.py", *args, "--out", str(tmp_path / "acc")])
    with pytest.raises(SystemExit) as e:
        accuracy.main()
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
