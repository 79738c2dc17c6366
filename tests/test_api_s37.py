"""Session 37, public API leftovers: a given weight-only group size honoured or refused (``quantize_llm``'s rule),
the lazy observer reduction over the group the user gave, NaN through the x86 dynamic recipe's fbgemm route, labels
past the model's classes, ``keep_freed_memory(dry_run=True)``'s reason. Each test failed before its fix."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from dist_helpers import needs_gloo, run_ranks
from torch import nn

import lowbit as Q
from lowbit import native, runtime
from lowbit.examples import SmallCNN, evaluate, train
from lowbit.nn.quantized.dynamic import reduced
from lowbit.observer import distributed as D


# ---- 1. quantize_weight_only: a given group size is honoured or refused; only the default adapts ----
def _two_widths() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 16))


def test_weight_only_refuses_a_given_group_size_that_does_not_divide_a_layer():
    m = _two_widths()
    with pytest.raises(ValueError, match=r"quantize_weight_only: group_size=64 does not divide in_features of 1 "
                                         r"layer\(s\): 2 \(96\); sizes dividing every layer: 32, 16, 8"):
        Q.quantize_weight_only(m, bits=4, group_size=64)  # was g32 for layer 2, with a warning
    q = Q.quantize_weight_only(m, bits=4, group_size=32)  # divides both: used as given
    assert (q[0].group_size, q[2].group_size) == (32, 32)


def test_weight_only_default_group_size_adapts_per_layer_with_a_warning():
    m = _two_widths()
    with pytest.warns(UserWarning, match=r"default group size 128 does not divide 1 layer\(s\); using: 2 \(96 "
                                         r"features: group size 32\)"):
        q = Q.quantize_weight_only(m, bits=4)
    assert (q[0].group_size, q[2].group_size) == (128, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer divisible: no warning
        assert Q.quantize_weight_only(nn.Sequential(nn.Linear(256, 8)), bits=4)[0].group_size == 128


# ---- 2. the lazy reduction uses the group the user gave ----
def _group_worker(rank):
    solo = [torch.distributed.new_group([0]), torch.distributed.new_group([1])][rank]  # every rank makes both
    model = nn.ModuleDict({"mm": Q.MinMaxObserver(), "hist": Q.HistogramObserver(bins=64),
                           "pct": Q.PercentileObserver()})
    for obs in model.values():
        obs(torch.linspace(-1.0, 1.0, 101))
    assert D.sync_observers(model, group=solo) == 3  # a one-rank group: nothing exchanged
    for obs in model.values():
        obs(torch.linspace(-1.0, 1.0, 101) * (2.0 + 4 * rank))  # more data after the sync, rank-specific
    twin = copy.deepcopy(model)  # (convert copies the model: the group travels with it)
    torch.save(model, io.BytesIO())  # the group is no state: a pickle of the module still works
    out = {name: obs.calculate_qparams()[0] for name, obs in model.items()}
    out["twin_mm"] = twin["mm"].calculate_qparams()[0]
    return out


def _local_scales(rank):
    model = {"mm": Q.MinMaxObserver(), "hist": Q.HistogramObserver(bins=64), "pct": Q.PercentileObserver()}
    for obs in model.values():
        obs(torch.linspace(-1.0, 1.0, 101))
        obs(torch.linspace(-1.0, 1.0, 101) * (2.0 + 4 * rank))
    return {name: obs.calculate_qparams()[0] for name, obs in model.items()}


@needs_gloo
def test_lazy_calculate_qparams_reduces_over_the_group_given_to_sync_observers():
    res = run_ranks(_group_worker, pg_timeout_s=30, timeout_s=240)
    for rank, got in enumerate(res):  # each rank its own group: local statistics (WORLD gave both ranks rank 1's)
        want = _local_scales(rank)
        for name in ("mm", "hist", "pct"):
            torch.testing.assert_close(got[name], want[name], msg=f"rank {rank} {name}")
        torch.testing.assert_close(got["twin_mm"], want["mm"])
    assert not torch.equal(res[0]["mm"], res[1]["mm"])


def test_observer_group_is_no_state():
    obs = Q.MinMaxObserver()
    obs(torch.randn(8))
    D.sync_observers(nn.ModuleDict({"a": obs}))  # single process: records WORLD, exchanges nothing
    assert "_sync_group" not in obs.state_dict() and copy.deepcopy(obs)._sync_group is obs._sync_group
    torch.save(obs, io.BytesIO())


# ---- 3. the x86 dynamic recipe propagates NaN ----
def test_x86_dynamic_recipe_gives_nan_for_a_non_finite_input_on_every_route():
    """One per-tensor grid serves every row, so a NaN / Inf anywhere makes it NaN: every output NaN, on fbgemm's route
    as on the exact one (fbgemm's op skipped a NaN past the first element: finite outputs in every row)."""
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else old
    try:
        torch.manual_seed(0)
        lin = nn.Sequential(nn.Linear(40, 24))
        q = Q.quantize_dynamic(lin, {nn.Linear: Q.get_dynamic_qconfig(backend="x86")})
        assert q[0].activation == "per_tensor_7bit"
        x = torch.randn(5, 40)
        for where, bad in (((1, 7), float("nan")), ((3, 39), float("-inf")), ((0, 0), float("nan"))):
            xb = x.clone()
            xb[where] = bad
            for pin in (None, "reference"):
                with Q.kernels.use_backend(pin) if pin else warnings.catch_warnings():
                    assert torch.isnan(q(xb)).all(), (where, bad, pin)
        if reduced._fbgemm_may_run(x):  # a finite input still gets torch.ao's op, bit for bit
            ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(lin), {nn.Linear}, dtype=torch.qint8)
            assert torch.equal(q(x), ao(x))
    finally:
        torch.backends.quantized.engine = old


@pytest.mark.skipif(not native.available(), reason="lowbit.native not built")
@pytest.mark.parametrize("body", ["best", "avx2", "scalar"])
def test_native_all_finite(body):
    pin = {"best": None, "avx2": native.force_avx2, "scalar": native.force_scalar}[body]
    with pin() if pin else warnings.catch_warnings():
        for n in (1, 15, 16, 17, 31, 32, 33, 100, 12288):
            x = torch.randn(n)
            x[0] = torch.finfo(torch.float32).max
            x[-1] = -torch.finfo(torch.float32).tiny / 4  # a denormal
            assert native.all_finite(x) is True
            for i in sorted({0, n // 2, n - 1}):
                for bad in (float("nan"), float("inf"), float("-inf")):
                    y = x.clone()
                    y[i] = bad
                    assert native.all_finite(y) is False, (n, i, bad)
    assert native.all_finite(torch.randn(4, 8)[:, ::2]) is None and native.all_finite(torch.randn(4).double()) is None


# ---- 4. labels past the model's classes ----
def test_evaluate_and_train_name_a_label_past_the_class_count():
    torch.manual_seed(0)
    m = SmallCNN(num_classes=10, channels=(4, 4), hidden=8)
    x, y = torch.randn(8, 1, 28, 28), torch.tensor([0, 1, 2, 3, 12, 5, 6, 7])
    with pytest.raises(ValueError, match=r"evaluate: y holds the label 12, but the model scores 10 classes"):
        evaluate(m, x, y)  # was 0 % (or the matches of the other labels), silently
    with pytest.raises(ValueError, match=r"train: y holds the label 12, but the model scores 10 classes"):
        train(m, x, y, epochs=1, batch_size=4)  # was torch's IndexError "Target 12 is out of bounds"
    y[4] = 9
    assert 0.0 <= evaluate(m, x, y, batch_size=3) <= 100.0


# ---- 5. keep_freed_memory(dry_run=True) says what it found ----
def test_keep_freed_memory_dry_run_sets_its_reason(monkeypatch):
    monkeypatch.setattr(runtime, "_state", {"applied": False, "reason": "keep_freed_memory() has not been called"})
    would = Q.keep_freed_memory(dry_run=True)
    assert runtime._state["applied"] is False  # nothing changed
    said = runtime.reason()
    assert said != "keep_freed_memory() has not been called"
    assert ("dry run" in said and "would" in said) if would else "nothing changed" in said


# ---- sweep: arguments of the wrong type ----
def test_sweep_skip_and_group_of_the_wrong_type_are_named():
    with pytest.raises(TypeError, match=r"quantize_weight_only: skip=None must be a tuple of module names"):
        Q.quantize_weight_only(nn.Sequential(nn.Linear(32, 16)), group_size=16, skip=None)  # was "not iterable"
    with pytest.raises(TypeError, match=r"sync_observers: group='x' must be None .* or a torch.distributed "
                                        r"ProcessGroup"):
        Q.sync_observers(nn.Sequential(Q.MinMaxObserver()), group="x")  # was kept for the lazy reduction
    with pytest.raises(TypeError, match=r"sync_pending: group=3"):
        D.sync_pending(Q.MinMaxObserver(), group=3)
