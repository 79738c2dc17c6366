"""Hostile inputs found by session 34's sweep of the newer entry points (``quantize_ptq``, the debug tools, eager
``equalize``, ``to_onnx``, ``lowbit.llm``, graph-mode convert): truthy non-bools read as flags, meta tensors and
unbatched calibration data failing deep inside torch, NaN / empty calibration batches reported as "observer saw no
data", a documented ``(tokens,)`` id shape failing inside the decoder, a NaN weight equalized for 100 sweeps. Each
test failed before its fix; each error names the value and comes before the caller's model changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.debug import auto_mixed_precision, sensitivity


def _lin() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(m: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    now = m.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k].nan_to_num(), v.nan_to_num()) for k, v in state.items())


_X = [torch.randn(4, 8), torch.randn(4, 8)]


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"equalize": 1}, ValueError, "equalize=1 must be True, False or 'range'"),  # was run as "range" (1 is not True)
    ({"equalize": 0}, ValueError, "equalize=0 must be"),
    ({"progress": "no"}, TypeError, "progress='no' must be True or False"),  # was: progress bars shown
])
def test_quantize_ptq_flags_must_be_bools(kw, exc, match):
    with pytest.raises(exc, match=f"quantize_ptq: {match}"):
        Q.quantize_ptq(_lin(), _X, recipe="accurate", iters=1, **kw)


def test_quantize_ptq_names_meta_tensors():
    # was: "Tensor.item() cannot be called on meta tensors" from torch's meta registrations
    with pytest.raises(ValueError, match=r"quantize_ptq: calib batch 1, input 0 is a meta tensor \(shape \(4, 8\)"):
        Q.quantize_ptq(_lin(), [_X[0], torch.randn(4, 8, device="meta")], recipe="default", progress=False)
    with pytest.raises(ValueError, match="quantize_ptq: model parameter '0.weight' is on the meta device"):
        Q.quantize_ptq(nn.Sequential(nn.Linear(8, 4, device="meta")), _X, recipe="default", progress=False)


def _iters1(recipe: str) -> dict:
    """``iters=1`` where the recipe reads it (accurate); another recipe refuses it (session 43)."""
    return {"iters": 1} if recipe == "accurate" else {}


@pytest.mark.parametrize("recipe", ["accurate", "balanced"])
def test_quantize_ptq_refuses_unbatched_calibration_for_the_reconstructing_recipes(recipe):
    # was: "mat1 and mat2 shapes cannot be multiplied" from grid_search / quadratic (they slice samples on dim 0)
    m = _lin()
    state = _state(m)
    with pytest.raises(ValueError, match=rf"quantize_ptq: recipe='{recipe}' needs calibration batches with a leading "
                                         r"sample axis .* layer '0' \(Linear\) reads an input of shape \(8,\)"):
        Q.quantize_ptq(m, [torch.randn(8)], recipe=recipe, progress=False, **_iters1(recipe))
    assert _same(m, state)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(0), nn.Linear(64, 2))
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d\) reads an input of shape \(3, 6, 6\)"):
        Q.quantize_ptq(conv, [torch.randn(3, 6, 6)], recipe=recipe, progress=False, **_iters1(recipe))
    Q.quantize_ptq(_lin(), [torch.randn(8)], recipe="default", progress=False)  # the default recipe takes them


def _amp_fast(m, c):
    return auto_mixed_precision(m, None, c, _score, max_float_layers=1, mode="fx", search="fast", progress=False)


def _amp_exact(m, c):
    return auto_mixed_precision(m, None, c, _score, max_float_layers=1, progress=False)


def _sens(m, c):
    return sensitivity(m, None, c, _score, method="fx")


def _score(m: nn.Module) -> float:
    return -float(m(_X[0]).float().abs().mean())


@pytest.mark.parametrize(("fn", "who"), [(_amp_fast, "auto_mixed_precision"), (_amp_exact, "auto_mixed_precision"),
                                         (_sens, "sensitivity")])
def test_debug_tools_name_nan_and_empty_calibration_batches(fn, who):
    # was: "observer ... saw no data; run calibration batches through the prepared model" (a NaN or empty batch
    # alone), or a NaN batch among good ones silently skipped by the observers
    m = _lin()
    state = _state(m)
    with pytest.raises(ValueError, match=f"{who}: calib batch 1 holds 32 NaN/Inf values of 32"):
        fn(m, [_X[0], torch.full((4, 8), float("nan"))])
    with pytest.raises(ValueError, match=rf"{who}: calib batch 0 holds an empty tensor \(shape \(0, 8\)\)"):
        fn(m, [torch.randn(0, 8)])
    assert _same(m, state)


def test_to_onnx_refuses_non_float32_and_meta_example_inputs(tmp_path):
    pytest.importorskip("onnx")
    from lowbit.export import to_onnx

    q = Q.quantize_ptq(_lin(), _X, recipe="default", progress=False)[0]
    path = tmp_path / "m.onnx"
    for dtype in (torch.float64, torch.float16):  # was: "mat1 and mat2 must have the same dtype" from the twin
        with pytest.raises(TypeError, match=rf"to_onnx: example_inputs\[0\] has dtype {dtype}; .* float32"):
            to_onnx(q, (_X[0].to(dtype),), path)
    with pytest.raises(ValueError, match=r"to_onnx: example_inputs\[0\] \(shape \(4, 8\)\) is a meta tensor"):
        to_onnx(q, torch.randn(4, 8, device="meta"), path)  # was: "Cannot copy out of meta tensor"
    assert not path.exists()


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return Q.llm.toy_llama(layers=1, hidden=32, vocab=64), torch.randint(0, 64, (1, 8))


@pytest.mark.parametrize("flag", ["awq", "act_order", "refine", "float_target", "progress"])
def test_quantize_llm_flags_must_be_bools(toy, flag):
    m, ids = toy
    with pytest.raises(TypeError, match=f"quantize_llm: {flag}='no' must be True or False"):  # awq='no' ran AWQ
        Q.quantize_llm(m, [ids], group_size=16, **{"progress": False, flag: "no"})


@pytest.mark.parametrize("fn", ["quantize_llm", "quantize_w8a8"])
def test_llm_entry_points_take_a_token_sequence_as_documented(toy, fn):
    # (tokens,) passed check_llm_calib and failed inside the decoder ("The size of tensor a (4) must match ...")
    m, ids = toy
    kw = {"group_size": 16, "progress": False, "method": "rtn", "awq": False} if fn == "quantize_llm" else {}
    call = getattr(Q, fn)
    q1, q2 = call(m, [ids[0]], **kw), call(m, [ids], **kw)
    assert torch.equal(q1(ids).logits, q2(ids).logits)
    model = copy.deepcopy(m).train()
    with pytest.raises(ValueError, match=rf"{fn}: calib batch 0: input_ids of a dict batch must be \(batch, tokens\), "
                                         r"got shape \(8,\)"):
        call(model, [{"input_ids": ids[0]}], inplace=True, **kw)
    assert all(mod.training for mod in model.modules())


def _eq_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()


def test_equalize_refuses_non_finite_and_meta_weights_before_any_change():
    m = _eq_model()
    with torch.no_grad():
        m[2].weight[1, 0] = float("inf")
    state = _state(m)
    # was: the NaN range kept that channel unscaled, the others rescaled, and all 100 sweeps ran (change = inf)
    with pytest.raises(ValueError, match=r"equalize: the weight of '2' \(Conv2d, shape \(4, 8, 1, 1\)\) holds 1 NaN/Inf "
                                         r"values \(pair '0' -> '2'\)"):
        Q.equalize(m, [["0", "2"]], progress=False)
    assert _same(m, state)
    meta = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"equalize: the weight of '0' \(Linear\) is on the meta device"):
        Q.equalize(meta, [["0", "1"]], progress=False)  # was: "Tensor.item() cannot be called on meta tensors"
    with pytest.raises(TypeError, match="equalize: progress='no' must be True or False"):
        Q.equalize(_eq_model(), [["0", "2"]], progress="no")


def test_convert_fx_names_an_activation_observer_that_records_no_grid():
    # was: "the observer after 'input_1' (input) saw no data; run calibration batches" after calibration had run
    # (eager convert names the NoopObserver / PlaceholderObserver since session 24)
    x = _X[0]
    p = Q.prepare_fx(_lin().eval(), Q.QConfigMapping().set_global(Q.get_embedding_qconfig()), (x,))
    p(x)
    with pytest.raises(RuntimeError, match=r"convert_fx: the observer after 'input_1' \(input\) is a NoopObserver "
                                           r"\(qconfig.activation\), which records no grid"):
        Q.convert_fx(p)
    with pytest.raises(RuntimeError, match="is a NoopObserver"):
        Q.quantize_ptq(_lin(), _X, recipe="default", qconfig_mapping=Q.get_embedding_qconfig(), progress=False)
