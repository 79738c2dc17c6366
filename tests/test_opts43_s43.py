"""Session 43 (opts43): options that were silently ignored or unchecked.

- ``quantize_ptq(recipe="default" / "balanced", iters=3)`` (and ``batch_size``, ``seed``, ``blocks``, ``learn_grids``,
  ``rounding``, ``equalize``, ``streams``, ``refine``, ``float_output``: 20 of 24 recipe / option pairs) ran and
  ignored the option; only ``tune`` / ``distill`` > 0 were refused. Now every option only ``"accurate"`` reads
  (``ptq_checks.ACCURATE_ONLY``) given another value than its default is a ``ValueError`` naming option, value and
  recipe; the default passed explicitly stays silent. The CLI derives its check from the same table.
- ``lowbit.rounding`` checked nothing: a zero / negative / NaN / Inf scale or ``quant_min > quant_max`` gave codes
  silently, a list ``x`` raised ``AttributeError``, mismatched shapes a broadcasting ``RuntimeError`` (27 of 27 bad
  inputs without a clear error).
- Three seed rules: ``quantize_ptq`` took a NumPy int (``numbers.Integral``) which ``reconstruct`` then refused as
  "reconstruct: seed=np.int64(3) must be an int"; ``tune_biases`` / ``distill`` refused it too. One rule now
  (``layerwise_step.check_seed``): Python / NumPy ints and 0-d integer tensors, not bools or floats.
- ``quantize_llm`` had no warning for GPTQ with fewer calibration rows than a layer's ``in_features`` (
  ``quantize_weight_only`` had one since session 42): the same warning, from the same code.
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.algorithms import reconstruct
from lowbit.algorithms.end_to_end import example
from lowbit.algorithms.layerwise_step import check_seed
from lowbit.algorithms.tune import tune_biases
from lowbit.ptq_checks import ACCURATE_ONLY, ignored_options
from lowbit.rounding import grid_position, round_codes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=g) for _ in range(2)]


#: a valid value other than the default for every accurate-only option
OTHER = dict(iters=3, batch_size=4, equalize=False, streams=None, blocks=False, learn_grids=False, tune=2, seed=5,
             rounding="quadratic", refine=2, float_output=False, distill=2)


# ---- 1. quantize_ptq: the options a recipe does not read ----

def test_the_table_is_quantize_ptqs_signature():
    params = inspect.signature(Q.quantize_ptq).parameters
    assert set(OTHER) == set(ACCURATE_ONLY)
    assert {k: params[k].default for k in ACCURATE_ONLY} == ACCURATE_ONLY  # the visible defaults, kept in sync


@pytest.mark.parametrize("recipe", ["default", "balanced"])
@pytest.mark.parametrize("opt", sorted(OTHER))
def test_an_option_the_recipe_ignores_is_refused_naming_it(recipe, opt):
    v = OTHER[opt]
    with pytest.raises(ValueError, match=rf"quantize_ptq: {opt}={v!r} applies to recipe='accurate' only, not "
                                         rf"recipe='{recipe}' \(it would be ignored\); pass {opt}="
                                         rf"{ACCURATE_ONLY[opt]!r} \(the default\)"):
        Q.quantize_ptq(_net(), _calib(), recipe, progress=False, **{opt: v})


def test_several_ignored_options_are_named_together():
    with pytest.raises(ValueError, match=r"quantize_ptq: iters=3, streams=None, seed=5 apply to recipe='accurate' "
                                         r"only, not recipe='default' \(it would be ignored\); pass iters=500, "
                                         r"streams=0.75, seed=0 \(the defaults\) or leave them out"):
        Q.quantize_ptq(_net(), _calib(), "default", iters=3, seed=5, streams=None, progress=False)


@pytest.mark.parametrize("recipe", ["default", "balanced"])
def test_the_defaults_passed_explicitly_stay_silent_and_change_nothing(recipe):
    model, calib = _net(), _calib()
    x = torch.randn(5, 8)
    with kernels.use_backend("reference"), torch.no_grad():
        q0, r0 = Q.quantize_ptq(model, calib, recipe, progress=False)
        q1, r1 = Q.quantize_ptq(model, calib, recipe, progress=False, **ACCURATE_ONLY)
        q2, _ = Q.quantize_ptq(model, calib, recipe, progress=False, seed=np.int64(0), iters=500, streams=0.75)
        torch.testing.assert_close(q1(x), q0(x), rtol=0, atol=0)
        torch.testing.assert_close(q2(x), q0(x), rtol=0, atol=0)
    assert r1.steps == r0.steps


def test_accurate_still_reads_them_and_the_other_options_apply_to_every_recipe():
    assert ignored_options("accurate", OTHER) == []
    assert ignored_options("balanced", {"max_float_layers": 2, "progress": True, "iters": 500}) == []
    q, rep = Q.quantize_ptq(_net(), _calib(), "balanced", max_float_layers=1, progress=False)
    assert [s for s, _ in rep.steps][-1] == "float layers"


def test_cli_refuses_an_ignored_flag_in_one_line_and_passes_seed_to_accurate(tmp_path, capsys, monkeypatch):
    from lowbit import cli
    from lowbit.cli.command import RECIPE_FLAGS, build_parser
    from lowbit.cli.common import CLIError

    args = build_parser().parse_args(["quantize"])
    assert {opt: getattr(args, dest) for dest, opt in RECIPE_FLAGS.items()} == {
        opt: ACCURATE_ONLY[opt] for opt in RECIPE_FLAGS.values()}  # the CLI's defaults are quantize_ptq's
    (tmp_path / "net43.py").write_text("import torch\nfrom torch import nn\ndef net():\n    torch.manual_seed(0)\n"
                                       "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))\n")
    torch.save(torch.randn(32, 8), tmp_path / "x.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["quantize", "--quiet", "--model", "net43:net", "--calib", "x.pt", "--method", "ptq"]
    for recipe in ("default", "balanced"):
        capsys.readouterr()
        assert cli.main([*base, "--recipe", recipe, "--distill", "3", "--out", "o"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"lowbit: error: --distill 3 applies to --recipe accurate, not --recipe {recipe} (it would be " \
               "ignored); leave it out (default 0)" in err
    seen = {}

    def fake(model, calib, recipe="accurate", **kw):  # what the CLI hands quantize_ptq, then stop
        seen[recipe] = kw
        raise CLIError("stopped by the test")

    monkeypatch.setattr(Q, "quantize_ptq", fake)
    for recipe in ("accurate", "balanced"):
        assert cli.main([*base, "--recipe", recipe, "--seed", "7", "--out", "o"]) == 2
    assert seen["accurate"]["seed"] == 7 and seen["accurate"]["distill"] == 0  # was: seed never passed (always 0)
    assert "seed" not in seen["balanced"] and "distill" not in seen["balanced"]  # (it would refuse them)
    assert not (tmp_path / "o").exists()


# ---- 2. lowbit.rounding: argument checks ----

_X = torch.randn(4, 3)
_S, _Z = torch.tensor(0.1), torch.tensor(0.0)


@pytest.mark.parametrize("fn", [grid_position, lambda x, s, z: round_codes(x, s, z, -128, 127)],
                         ids=["grid_position", "round_codes"])
@pytest.mark.parametrize("x, s, z, err, msg", [
    ([0.1], _S, _Z, TypeError, r"x must be a floating-point tensor, got list"),
    (torch.ones(3, dtype=torch.int32), _S, _Z, TypeError, r"x must be a floating-point tensor, got torch.int32"),
    (torch.ones(3, dtype=torch.bool), _S, _Z, TypeError, r"x must be a floating-point tensor, got torch.bool"),
    (_X, 0.1, _Z, TypeError, r"scale must be a tensor broadcastable to x's shape \(4, 3\) .*got float 0.1"),
    (_X, _S, 0, TypeError, r"zero_point must be a tensor broadcastable .*got int 0"),
    (_X, torch.tensor(1), _Z, TypeError, r"scale must be a floating-point tensor, got torch.int64"),
    (_X, _S, torch.tensor(True), TypeError, r"zero_point must be a real tensor, got torch.bool"),
    (_X, torch.tensor(0.0), _Z, ValueError, r"scale holds 0.0; every step must be positive and finite"),
    (_X, torch.tensor([[0.1, -1.0, 0.2]]), _Z, ValueError, r"scale holds -1.0"),
    (_X, torch.tensor(float("nan")), _Z, ValueError, r"scale holds nan"),
    (_X, torch.full((4, 1), float("inf")), _Z, ValueError, r"scale holds inf"),
    (_X, _S, torch.tensor([0.0, float("nan"), 0.0]), ValueError, r"zero_point holds nan; zero points must be finite"),
    (_X, torch.ones(5), _Z, ValueError, r"scale \(5,\) and zero_point \(\) must broadcast to x's shape \(4, 3\)"),
    (_X, _S, torch.zeros(4), ValueError, r"scale \(\) and zero_point \(4,\) must broadcast to x's shape \(4, 3\)"),
    (_X, torch.ones(2, 4, 3), _Z, ValueError, r"must broadcast to x's shape \(4, 3\)"),  # would grow x: not codes of x
])
def test_rounding_refuses_bad_arguments_naming_them(fn, x, s, z, err, msg):
    with pytest.raises(err, match=msg):
        fn(x, s, z)


@pytest.mark.parametrize("qmin, qmax, err, msg", [(5, -5, ValueError, r"round_codes: quant_min=5 > quant_max=-5"),
                                                  (0.5, 7, TypeError, r"round_codes: quant_min=0.5 must be an int"),
                                                  (-8, True, TypeError, r"round_codes: quant_max=True must be an int")])
def test_round_codes_refuses_a_bad_grid(qmin, qmax, err, msg):
    with pytest.raises(err, match=msg):
        round_codes(_X, _S, _Z, qmin, qmax)


def test_checked_codes_are_unchanged_and_the_converted_models():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(320, 960, generator=g)
    s = w.abs().amax(1, keepdim=True) / 127.5
    z = torch.zeros(320, 1, dtype=torch.int64)
    q = round_codes(w, s, z, -128, 127)
    assert torch.equal(q, round_codes(w, s, z, -128, 127, check=False))
    assert torch.equal(grid_position(w, s, z), grid_position(w, s, z, check=False))
    ref = Q.functional.quantize(w, s.reshape(-1), z.reshape(-1), "qint8", ch_axis=0)  # convert's weight codes
    assert torch.equal(q.to(torch.int8), ref.to(torch.int8) if not isinstance(ref, Q.QTensor) else ref.int_repr())
    assert round_codes(torch.empty(0, 3), _S, _Z, 0, 255).shape == (0, 3)  # empty x: nothing to refuse


# ---- 3. one seed rule ----

def _entry_points(seed):
    model, calib, p, _ = example()
    return {"quantize_ptq": lambda: Q.quantize_ptq(model, calib, "accurate", iters=2, refine=0, seed=seed,
                                                   progress=False),
            "reconstruct": lambda: reconstruct(p, calib, iters=2, seed=seed, progress=False),
            "tune_biases": lambda: tune_biases(example()[2], model, calib, iters=2, seed=seed, progress=False)}


@pytest.mark.parametrize("seed", [True, 3.0, np.float64(3), torch.tensor(3.0), torch.tensor([3]), "3", np.bool_(True)],
                         ids=repr)
def test_every_entry_point_refuses_the_same_non_integer_seeds(seed):
    for where, run in _entry_points(seed).items():
        with pytest.raises(TypeError, match=rf"{where}: seed=.* must be an int \(Python, NumPy or a 0-d integer "
                                            r"tensor\), not a bool or a float"):
            run()
    with pytest.raises(ValueError, match=r"reconstruct: seed=18446744073709551616 must be in \[-2\*\*63, 2\*\*64\)"):
        _entry_points(2 ** 64)["reconstruct"]()


@pytest.mark.parametrize("seed", [np.int64(3), np.uint8(3), torch.tensor(3), torch.tensor(3, dtype=torch.int16)],
                         ids=repr)
def test_numpy_and_torch_integer_seeds_are_the_int_everywhere(seed):
    # was: quantize_ptq let np.int64(3) through and reconstruct refused it; tune_biases refused it too
    assert check_seed("demo", seed) == 3 and type(check_seed("demo", seed)) is int
    x = torch.randn(6, 8)
    with kernels.use_backend("reference"), torch.no_grad():
        for where in ("quantize_ptq", "reconstruct", "tune_biases"):
            got, ref = _entry_points(seed)[where](), _entry_points(3)[where]()
            if where == "quantize_ptq":
                torch.testing.assert_close(got[0](x), ref[0](x), rtol=0, atol=0)
            elif where == "reconstruct":
                assert [c.codes_changed for c in got] == [c.codes_changed for c in ref]
            else:
                assert (got.error_before, got.error_after) == (ref.error_before, ref.error_after)


# ---- 4. quantize_llm: fewer calibration rows than in_features ----

def test_quantize_llm_warns_when_gptq_sees_fewer_rows_than_in_features():
    pytest.importorskip("transformers")
    m = Q.llm.toy_llama()  # hidden 64, intermediate 160 (down_proj's in_features)
    ids = [torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(2)]  # 96 rows
    with pytest.warns(UserWarning, match=r"quantize_llm: GPTQ saw fewer calibration rows than input features at 2 "
                                         r"layer\(s\) \(\(rows, in_features\): \{'model.layers.0.mlp.down_proj': "
                                         r"\(96, 160\), 'model.layers.1.mlp.down_proj': \(96, 160\)\}\).*method='rtn'"
                      ) as rec:
        Q.quantize_llm(m, ids, bits=4, group_size=32, progress=False)
    assert [w.filename for w in rec if "fewer calibration rows" in str(w.message)] == [__file__]  # the caller's line
    # padding is no row: 2 x 96 tokens, half of them masked -> 96 real rows, the same warning
    batches = [{"input_ids": torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(i)),
                "attention_mask": torch.cat([torch.zeros(1, 48, dtype=torch.long), torch.ones(1, 48, dtype=torch.long)],
                                            1)} for i in range(2)]
    with pytest.warns(UserWarning, match=r"'model.layers.0.mlp.down_proj': \(96, 160\)"):
        Q.quantize_llm(m, batches, bits=4, group_size=32, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Q.quantize_llm(m, ids, bits=4, group_size=32, method="rtn", progress=False)  # no statistics: nothing to say
        more = [torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(i)) for i in range(2)]
        Q.quantize_llm(m, more, bits=4, group_size=32, progress=False)  # 192 rows >= 160: nothing to say
