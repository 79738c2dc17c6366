"""Session 36 sweep of weight-only, dynamic and distributed calibration with hostile inputs; each test failed before
its fix. Oracles: torch.ao's fp16 dynamic Linear (saturated weights), one observer fed every rank's data."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_helpers import needs_gloo, run_ranks
from torch import nn

import lowbit as Q
from lowbit.observer import distributed as D


def _lin(k: int = 64, n: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, n))


# ---- A. quantize_weight_only ----
@pytest.mark.parametrize("arg", ["inplace", "act_order"])
def test_weight_only_refuses_non_bool_flags(arg):
    model = _lin()
    with pytest.raises(TypeError, match=arg):
        Q.quantize_weight_only(model, group_size=32, calib=[torch.randn(4, 64)], **{arg: "no"})
    assert type(model[0]) is nn.Linear  # inplace="no" (truthy) rewrote the caller's model


@pytest.mark.parametrize("calib", [{"x": torch.randn(4, 64)}, "data", 5])
def test_weight_only_refuses_calib_that_is_not_batches(calib):
    with pytest.raises(TypeError, match="calib"):
        Q.quantize_weight_only(_lin(), group_size=32, method="gptq", calib=calib)


def test_weight_only_warns_when_nothing_is_quantized_or_skip_matches_nothing():
    with pytest.warns(UserWarning, match="no nn.Linear to quantize"):
        out = Q.quantize_weight_only(nn.Sequential(nn.ReLU()))
    assert type(out[0]) is nn.ReLU
    model = nn.ModuleDict({"enc": nn.ModuleDict({"fc": nn.Linear(64, 32)}), "head": nn.Linear(32, 32)})
    with pytest.warns(UserWarning, match=r"skip entries \['enc', 'nope'\]"):  # a parent's name skips nothing
        q = Q.quantize_weight_only(model, group_size=32, skip=("enc", "nope"))
    assert type(q["enc"]["fc"]).__name__ == "WeightOnlyLinear"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skip naming a Linear, and the default skip, are silent
        q = Q.quantize_weight_only(model, group_size=32, skip=("fc",))
        Q.quantize_weight_only(model, group_size=32)
    assert type(q["enc"]["fc"]) is nn.Linear and type(q["head"]).__name__ == "WeightOnlyLinear"


def test_weight_only_names_a_meta_layer():
    with pytest.raises(ValueError, match="'0' has its weight on the meta device"):
        Q.quantize_weight_only(nn.Sequential(nn.Linear(8, 8, device="meta")))


def test_weight_only_overflowing_calibration_is_named_as_such():
    with pytest.raises(ValueError, match="overflow float32"):
        Q.quantize_weight_only(_lin(), group_size=32, calib=[torch.randn(4, 64) * 1e20])


# ---- B. quantize_dynamic(dtype=torch.float16) ----
def test_fp16_dynamic_saturates_like_torch_ao():
    import torch.ao.quantization as tq
    m = _lin(16, 8)
    with torch.no_grad():
        m[0].weight[0, 0] = 1e5
    x = torch.randn(4, 16)
    with pytest.warns(UserWarning, match="saturated"):
        ours = Q.quantize_dynamic(m, dtype=torch.float16)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tq.quantize_dynamic(m, dtype=torch.float16)(x)
    assert torch.isfinite(ours).all()  # was inf in the column reading the weight
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)
    lstm = nn.Sequential(nn.LSTM(4, 4))
    with torch.no_grad():
        lstm[0].weight_hh_l0[0, 0] = -1e6
    with pytest.warns(UserWarning, match="saturated"):
        q = Q.quantize_dynamic(lstm, dtype=torch.float16)
    assert float(q[0].hh["l0"].weight_fp16.min()) == -65504.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", [nn.Linear, nn.LSTM, nn.GRUCell])
def test_fp16_dynamic_refuses_non_finite_weights_as_int8_does(bad, kind):
    mod = kind(4, 4)
    w = mod.weight if kind is nn.Linear else mod.weight_ih if kind is nn.GRUCell else mod.weight_ih_l0
    with torch.no_grad():
        w[1, 2] = bad
    with pytest.raises(ValueError, match=r"module '0'.*NaN/Inf"):
        Q.quantize_dynamic(nn.Sequential(mod), {kind}, dtype=torch.float16)


# ---- C. distributed calibration ----
def _mismatch_worker(rank):
    out = {}
    for key, obs in (("bins", Q.HistogramObserver(bins=64 * (1 + rank))),
                     ("per_tensor_vs_channel", Q.MinMaxObserver() if rank == 0 else Q.PerChannelMinMaxObserver()),
                     ("channels", Q.PerChannelMinMaxObserver())):
        obs(torch.randn(3 + rank if key == "channels" else 4, 5))
        try:
            D.sync_observers(nn.ModuleDict({"act": obs}))
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
    return out


def _union_worker(rank):
    data = _shards()
    hist, mm = Q.HistogramObserver(bins=128), Q.MinMaxObserver()
    for o in (hist, mm):
        for b in data[rank::2]:
            o(b)
    return hist.calculate_qparams(), mm.calculate_qparams()


def _shards():
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(64, 6, generator=g) for _ in range(4)]
    a[1] = a[1] * 5 + 3                      # rank 1's range differs
    a[2] = torch.full((8, 6), float("nan"))  # rank 0 sees an all-NaN batch, rank 1 one NaN
    a[3][0, 0] = float("nan")
    return a


@needs_gloo
def test_distributed_mismatches_raise_on_every_rank_naming_ranks_and_observer():
    res = run_ranks(_mismatch_worker, pg_timeout_s=30, timeout_s=240)
    for r in res:  # bins: gloo aborted the process; per-tensor vs per-channel: rank 0 got per-channel qparams
        # (since session 38 the observers' settings are compared first: observer.distributed.agree_observer; since
        # session 39 their paths and classes before that: agree_structure, which names the class only)
        assert "observer 'act'" in r["bins"] and "bins=64" in r["bins"] and "bins=128" in r["bins"]
        assert "rank 0: 'act' (MinMaxObserver)" in r["per_tensor_vs_channel"]
        assert "rank 1: 'act' (PerChannelMinMaxObserver)" in r["per_tensor_vs_channel"]
        assert "rank 0: 3 channels, rank 1: 4 channels" in r["channels"]


@needs_gloo
def test_distributed_histogram_and_minmax_equal_one_observer_on_the_union():
    res = run_ranks(_union_worker, pg_timeout_s=30, timeout_s=240)
    hist, mm = Q.HistogramObserver(bins=128), Q.MinMaxObserver()
    for o in (hist, mm):
        for b in _shards():
            o(b)
    for r in res:
        for got, want in zip(r, (hist.calculate_qparams(), mm.calculate_qparams())):
            torch.testing.assert_close(got, want)
