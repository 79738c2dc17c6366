"""Hostile inputs found by session 40's sweep of the session 39 entry points (~450 probes: bilinear resampling of
QTensor codes, QAT ConvTranspose1d/2d/3d, grouped / multiplier-k cross-layer equalization, ``float_swap`` /
``auto_mixed_precision(search="fast")``, ``export/qat.py`` / ``export/codes.py``, ``check_batchnorm_stats``,
``batches.real_rows``, ``agree_structure`` / ``sync_pending`` without ``torch.distributed``, LSQ called twice in one
forward). Each test failed before its fix: a bilinear output size that rounds down to 0, or an input with no channels
or rows, gave an empty QTensor where torch's float and quantized kernels refuse; a size or scale factor of 0, < 0,
NaN or inf failed deep in torch's meta path (``ZeroDivisionError``, "upper bound and lower bound inconsistent with
step sign", "cannot convert float NaN to integer"), a call with neither size nor scale factor with ``float()`` of
None; the helpers' own checks raised ``AttributeError`` / a ``TypeError`` from a comparison, or accepted bad values."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse: one thread)
from lowbit.debug.float_swap import keep_float_layers
from lowbit.nn.quantized.normalization import check_batchnorm_stats
from lowbit.observer.distributed import agree_structure, sync_pending


def _codes(shape: tuple[int, ...]) -> Q.QTensor:
    torch.manual_seed(0)
    return Q.quantize_per_tensor(torch.randn(shape), 0.05, 60, Q.quint8)


# ---- bilinear resampling of QTensor codes ------------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "kw", "match"), [
    ((2, 3, 5, 7), dict(scale_factor=0.15), r"got input \(C: 3, H: 5, W: 7\) and output \(H: 0, W: 1\)"),
    ((2, 3, 5, 7), dict(scale_factor=1e-9), r"output \(H: 0, W: 0\)"),
    ((2, 0, 5, 7), dict(scale_factor=2), r"got input \(C: 0, H: 5, W: 7\) and output \(H: 10, W: 14\)"),
    ((2, 3, 0, 7), dict(scale_factor=2), r"got input \(C: 3, H: 0, W: 7\)"),
    ((2, 3, 0, 7), dict(size=(3, 3), align_corners=True), r"got input \(C: 3, H: 0, W: 7\)"),
])
def test_bilinear_refuses_empty_sizes_as_torch_does(shape, kw, match):
    # was: an empty QTensor ((2, 3, 0, 1), (2, 0, 10, 14), (2, 3, 0, 14)) or index_select's "self indexing axis dim
    # should be positive", where torch's float and quantized kernels raise ("Input and output sizes should be greater
    # than 0", "Non-empty 4D data tensor expected")
    qt = _codes(shape)
    with pytest.raises(RuntimeError):
        F.interpolate(qt.dequantize(), mode="bilinear", **kw)  # the float oracle refuses too
    with pytest.raises(ValueError, match=match):
        F.interpolate(qt, mode="bilinear", **kw)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(size=(0, 4)), r"size=\(0, 4\) must hold finite numbers > 0"),
    (dict(size=(-1, 4)), r"size=\(-1, 4\) must hold finite numbers > 0"),
    (dict(scale_factor=0.0), r"scale_factor=0.0 must hold finite numbers > 0"),
    (dict(scale_factor=-2.0), r"scale_factor=-2.0 must hold"),
    (dict(scale_factor=float("nan")), r"scale_factor=nan must hold"),
    (dict(scale_factor=float("inf")), r"scale_factor=inf must hold"),
    (dict(scale_factor=(2, float("nan"))), r"scale_factor=\(2, nan\) must hold"),
])
def test_bilinear_names_bad_size_and_scale_values(kw, match):
    # was: ZeroDivisionError, RuntimeError "upper bound and lower bound inconsistent with step sign", ValueError
    # "cannot convert float NaN to integer", OverflowError "cannot convert float infinity to integer"
    with pytest.raises(ValueError, match=r"interpolate \(bilinear, QTensor input of shape \(2, 3, 5, 7\)\): " + match):
        F.interpolate(_codes((2, 3, 5, 7)), mode="bilinear", **kw)


def test_bilinear_without_size_or_scale_gives_torchs_error():
    # was: TypeError "float() argument must be a string or a real number, not 'NoneType'"
    for up in (lambda q: F.interpolate(q, mode="bilinear"), nn.Upsample(mode="bilinear")):
        with pytest.raises(ValueError, match="either size or scale_factor should be defined"):
            up(_codes((1, 2, 3, 3)))


def test_bilinear_empty_batch_and_valid_sizes_still_resample():
    # a batch of 0 is fine for torch (empty output) and stays so; valid hostile-looking sizes keep torch's codes
    out = F.interpolate(_codes((0, 3, 5, 7)), scale_factor=2, mode="bilinear")
    assert isinstance(out, Q.QTensor) and tuple(out.shape) == (0, 3, 10, 14)
    qt = _codes((2, 3, 5, 7))
    assert tuple(F.interpolate(qt, scale_factor=0.2, mode="bilinear").shape) == (2, 3, 1, 1)
    one = _codes((2, 3, 1, 1))  # (torch's NHWC kernel scrambles these channels; lowbit copies each code)
    assert torch.equal(F.interpolate(one, scale_factor=2, mode="bilinear").int_repr(),
                       one.int_repr().expand(2, 3, 2, 2))


# ---- check_batchnorm_stats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mod", "match"), [
    (nn.BatchNorm2d(3, track_running_stats=False), r"bn: expects a BatchNorm with running statistics, got "
                                                   r"BatchNorm2d whose running_mean / running_var are \['NoneType'"),
    (nn.Linear(3, 3), r"got Linear whose"),
    (None, r"got NoneType whose"),
])
def test_check_batchnorm_stats_names_a_module_without_statistics(mod, match):
    # was: AttributeError "'NoneType' object has no attribute 'detach'" / "'Linear' object has no attribute 'eps'"
    with pytest.raises(TypeError, match=match):
        check_batchnorm_stats(mod, "bn")


def test_check_batchnorm_stats_names_meta_statistics():
    # was: RuntimeError "Tensor.item() cannot be called on meta tensors"
    with pytest.raises(ValueError, match="bn: the BatchNorm's running statistics are on the meta device"):
        check_batchnorm_stats(nn.BatchNorm2d(3, device="meta"), "bn")


# ---- keep_float_layers ---------------------------------------------------------------------------------------------
def _mixprec_case() -> tuple[nn.Module, nn.Module, nn.Module, object]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=4)).eval()
    x = torch.randn(8, 3, 4, 4)
    prepared = Q.prepare(copy.deepcopy(net), Q.get_minmax_qconfig())
    with torch.no_grad():
        prepared(x)
        ref = net(x)
    qmodel = Q.convert(copy.deepcopy(prepared))

    def score(m: nn.Module) -> float:
        with torch.no_grad():
            out = m(x)
        return -float(((out.dequantize() if isinstance(out, Q.QTensor) else out) - ref).pow(2).mean())
    return net, prepared, qmodel, score


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_keep_float_layers_names_a_bad_budget(bad):
    # was: "2" a TypeError from a comparison inside the search; -1, 1.5, True, None accepted
    net, prepared, qmodel, score = _mixprec_case()
    with pytest.raises(ValueError, match=rf"keep_float_layers: max_float_layers={bad!r} must be an int >= 0"):
        keep_float_layers(net, prepared, qmodel, score, bad, progress=False)


def test_keep_float_layers_names_what_is_not_a_module():
    # was: AttributeError "'NoneType' object has no attribute 'named_modules'"
    net, prepared, qmodel, score = _mixprec_case()
    with pytest.raises(TypeError, match="keep_float_layers: qmodel must be an nn.Module, got NoneType"):
        keep_float_layers(net, prepared, None, score, 1, progress=False)
    with pytest.raises(TypeError, match="keep_float_layers: eval_fn=3 must be callable"):
        keep_float_layers(net, prepared, qmodel, 3, 1, progress=False)
    table = keep_float_layers(net, prepared, qmodel, score, 1, progress=False)  # the valid call still works
    assert len(table.float_layers) <= 1


# ---- agree_structure / sync_pending, one process ------------------------------------------------------------------
def test_agree_structure_and_sync_pending_check_their_arguments_in_one_process():
    # was: agree_structure accepted group="world" and a string of entries in one process (group was checked only by
    # sync_observers / sync_pending); sync_pending("model") returned silently in one process and failed in
    # named_modules under torch.distributed
    obs = Q.MinMaxObserver()
    with pytest.raises(TypeError, match=r"agree_structure: group='world' must be None"):
        agree_structure([("fc", obs)], group="world")
    with pytest.raises(TypeError, match="agree_structure: entries must be a list of \\(module path, observer module\\)"):
        agree_structure("abc")
    with pytest.raises(TypeError, match="sync_pending: module must be an nn.Module, got str"):
        sync_pending("model")
    agree_structure([("fc", obs)])  # valid: nothing to compare in one process
    agree_structure([])
    sync_pending(obs)
