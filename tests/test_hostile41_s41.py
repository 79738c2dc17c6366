"""Session 41 hostile-input sweep of session 40's APIs: DDP ignore-list bookkeeping, QAT conv / transposed conv + BN
``_extra_state`` on meta checkpoints, bias tuning with nothing to tune, op-candidate / keep_float argument checks."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.nn.intrinsic.qat as nniqat
from lowbit.algorithms.tune import tune_biases
from lowbit.debug import graph_swap
from lowbit.debug.table import keep_float
from lowbit.observer import ddp
from lowbit.ptq import quantize_ptq

# ---- QAT conv / transposed conv + BN: a meta checkpoint loads (assign=True) -----------------------------------------


def _qat_bn_model(transposed: bool) -> nn.Module:
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(2, 4, 3, stride=2) if transposed else nn.Conv2d(2, 4, 3)
    m = Q.QuantWrapper(nn.Sequential(conv, nn.BatchNorm2d(4)))
    m.qconfig = Q.get_default_qat_qconfig()
    m.train()
    Q.fuse_modules_qat(m, [["module.0", "module.1"]], inplace=True)
    return Q.prepare_qat(m)


@pytest.mark.parametrize("transposed", [False, True])
def test_meta_checkpoint_assign_loads_qat_bn(transposed):
    src = _qat_bn_model(transposed)
    x = torch.randn(4, 2, 5, 5)
    src(x)
    src.apply(nniqat.freeze_bn_stats)
    meta_sd = {k: v.to("meta") for k, v in src.state_dict().items()}
    dst = _qat_bn_model(transposed)
    dst.load_state_dict(meta_sd, assign=True)  # raised "_extra_state=tensor(..., device='meta') is not ..." before
    assert dst.module[0].weight.is_meta and dst.module[0].freeze_bn is False  # no values: settings kept
    dst.to_empty(device="cpu")
    dst.load_state_dict(src.state_dict())
    assert dst.module[0].freeze_bn is True and not dst.module[0].bn.training
    src.eval()
    dst.eval()
    assert torch.equal(src(x), dst(x))


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.uint8), torch.zeros(2), torch.zeros(1, 2, dtype=torch.uint8)])
def test_meta_extra_state_still_checks_shape_and_dtype(bad):
    m = nniqat.ConvBn2d(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2), qconfig=Q.get_default_qat_qconfig())
    sd = {**m.state_dict(), "_extra_state": bad.to("meta")}
    with pytest.raises(ValueError, match=r"ConvBn2d: _extra_state=tensor\(\.\.\., device='meta'"):
        m.load_state_dict(sd, assign=True)


# ---- tune= on a model with nothing to tune --------------------------------------------------------------------------


class _NoWeights(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + x


class _CatOnly(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x * 2], 1) + 1


@pytest.mark.filterwarnings("ignore:prepare_fx")
def test_quantize_ptq_tune_without_weighted_layers():
    x = torch.randn(16, 4)
    # a model with nothing int8 at all is refused up front (mp41's check; the report read inf dB before) ...
    with pytest.raises(ValueError, match="nothing to quantize in _NoWeights"):
        quantize_ptq(_NoWeights().eval(), [x[:8], x[8:]], recipe="accurate", iters=2, tune=2, progress=False)
    # ... int8 ops without a weighted layer tune their grids alone, with no bias to tune
    q, report = quantize_ptq(_CatOnly().eval(), [x[:8], x[8:]], recipe="accurate", iters=2, tune=2,
                             progress=False)
    assert torch.allclose(q(x), _CatOnly()(x), atol=0.1)
    assert any(name == "tune biases" and "0 layers' biases" in text for name, text in report.steps)


@pytest.mark.filterwarnings("ignore:prepare_fx")
def test_tune_biases_nothing_to_tune():
    x = torch.randn(8, 4)
    p = Q.prepare_fx(_NoWeights().eval(), Q.QConfigMapping(), (x,))
    r = tune_biases(p, _NoWeights().eval(), [x], iters=3, progress=False)
    assert (r.n_biases, r.n_grids, r.kept) == (0, 0, False) and r.error_before == r.error_after


# ---- DDP ignore list ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, torch.zeros(2), "model"])
def test_keep_statistics_local_refuses_non_module(bad):
    with pytest.raises(TypeError, match=f"keep_statistics_local: model must be an nn.Module, got {type(bad).__name__}"):
        ddp.keep_statistics_local(bad)


def test_drop_removed_refuses_non_module():
    with pytest.raises(TypeError, match="drop_removed: model must be an nn.Module, got NoneType"):
        ddp.drop_removed(None)  # returned None silently before
    with pytest.raises(TypeError, match="drop_removed: source must be an nn.Module, got int"):
        ddp.drop_removed(nn.Linear(2, 2), source=3)  # returned the model unchanged before


def test_keep_statistics_local_after_rename_drops_stale_names():
    p = Q.prepare(Q.QuantWrapper(nn.Linear(2, 2)), Q.get_default_qconfig())
    p._ddp_params_and_buffers_to_ignore.append("module.bias")
    p.quant2 = p.quant
    del p.quant
    ddp.keep_statistics_local(p)
    names = p._ddp_params_and_buffers_to_ignore
    alive = {n for n, _ in p.named_buffers()} | {n for n, _ in p.named_parameters()}
    assert set(names) <= alive, sorted(set(names) - alive)  # 'quant.activation_post_process.*' stayed before
    assert "module.bias" in names and any(n.startswith("quant2.activation_post_process.") for n in names)
    assert len(names) == len(set(names))
    assert set(p._lowbit_ddp_ignored) <= alive
    assert ddp.keep_statistics_local(p)._ddp_params_and_buffers_to_ignore == names  # a rerun changes nothing


def test_keep_statistics_local_rerun_keeps_users_stale_name():
    m = nn.Sequential(nn.Linear(2, 2))
    m._ddp_params_and_buffers_to_ignore = ["gone.weight"]  # the user's own name: not ours to drop
    assert ddp.keep_statistics_local(copy.deepcopy(m))._ddp_params_and_buffers_to_ignore == ["gone.weight"]


# ---- op candidates / keep_float -------------------------------------------------------------------------------------


def test_op_candidates_refuses_non_module():
    with pytest.raises(TypeError, match="op_candidates: qmodel must be an nn.Module .*got NoneType"):
        graph_swap.op_candidates(None)


@pytest.mark.parametrize(("name", "keys", "err", "match"), [
    (None, {}, TypeError, "keep_float: name=None must be a str"),
    (5, {}, TypeError, "keep_float: name=5 must be a str"),
    ("fc", None, TypeError, "keep_float: op_keys=NoneType must be a dict"),
    ("add#0", {"add#0": ("", operator.add)}, ValueError, r"keep_float: op_keys\['add#0'\]=\('', <built-in function add>\) must"),
    ("add#0", {"add#0": "bad"}, ValueError, r"keep_float: op_keys\['add#0'\]='bad' must be a \(module_name, function"),
])
def test_keep_float_bad_arguments(name, keys, err, match):
    with pytest.raises(err, match=match):
        keep_float(Q.QConfigMapping(), name, keys)


def test_keep_float_good_names():
    m = keep_float(Q.QConfigMapping(), "s:operator.add#1", {"s:operator.add#1": ("s", operator.add, 1)})
    assert m.module_name_object_type_order_qconfigs == {("s", operator.add, 1): None}
    assert keep_float(Q.QConfigMapping(), "fc", {}).module_name_qconfigs == {"fc": None}


def test_meta_extra_state_without_assign_still_refused():
    m = nniqat.ConvBn2d(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2), qconfig=Q.get_default_qat_qconfig())
    sd = {**m.state_dict(), "_extra_state": torch.empty(2, dtype=torch.uint8, device="meta")}
    with pytest.raises(ValueError, match=r"ConvBn2d: _extra_state=tensor\(\.\.\., device='meta'"):
        m.load_state_dict(sd)
    m.set_extra_state(torch.tensor([1, 1], dtype=torch.uint8))  # a direct call: values as ever
    assert m.freeze_bn and m.bn_fold == "running_stats"


def test_convert_cleans_a_prepared_submodules_ignore_list():
    torch.manual_seed(0)
    part = Q.prepare(Q.QuantWrapper(nn.Linear(4, 4)), Q.get_default_qconfig())  # a part prepared on its own
    part._ddp_params_and_buffers_to_ignore.append("module.bias")
    whole = nn.Sequential(part, nn.ReLU())
    x = torch.randn(16, 4)
    whole(x)
    c = Q.convert(whole)
    # the part's list kept its 18 observer names (module.activation_post_process.histogram, ...) before
    assert c[0]._ddp_params_and_buffers_to_ignore == ["module.bias"]
    assert c[0]._lowbit_ddp_ignored == []
    assert not hasattr(c, "_ddp_params_and_buffers_to_ignore")
