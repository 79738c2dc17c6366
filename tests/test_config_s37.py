"""How users say what to quantize (session 37 sweep): fusion, QConfigMapping, fusion patterns. torch.ao the oracle
where it is defined; each test failed before its fix."""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare_fx

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.fusion_registry import register_fusion_pattern, unregister_fusion_pattern

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _cbr() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-1, 1)
    return m


X4 = torch.randn(2, 2, 8, 8)


# ---- fuse_modules: the first part's pre-hooks and the last one's hooks are moved, run once ----
@pytest.mark.parametrize("group", [["0", "1", "2"], ["0", "1"]], ids=["conv-bn-relu", "conv-bn"])
@pytest.mark.parametrize("fuse", [Q.fuse_modules, Q.fuse_modules_qat], ids=["eager", "qat"])
def test_moved_hooks_run_once_and_an_output_hook_gives_the_float_models_result(group, fuse):
    m = _cbr()
    if fuse is Q.fuse_modules_qat:
        m.train()
    calls: list[str] = []
    last = m[int(group[-1])]
    m[0].register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    last.register_forward_hook(lambda mod, args, out: calls.append("post") or out * 2 - 1)  # changes the output
    ref = m.eval()(X4)
    calls.clear()
    f = fuse(m, [group])
    out = f.eval()(X4)
    assert calls == ["pre", "post"]  # each once (both ran twice: the fused module and the part inside it)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_conv_relu_hooks_move_as_torch_ao():
    # torch.ao moves them (its fused conv-relu runs the pre-hook once); lowbit ran it twice
    counts = []
    for fuse in (tq.fuse_modules, Q.fuse_modules):
        m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU()).eval()
        log: list[str] = []
        m[0].register_forward_pre_hook(lambda mod, args, log=log: log.append("pre"))
        m[1].register_forward_hook(lambda mod, args, out, log=log: log.append("post"))
        fuse(m, [["0", "1"]])(X4)
        counts.append(log)
    assert counts[1] == counts[0] == ["pre", "post"]


def test_moved_hooks_keep_their_kwargs_and_always_call_flags():
    m = _cbr()
    seen: list[object] = []
    m[0].register_forward_pre_hook(lambda mod, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    m[2].register_forward_hook(lambda mod, args, kwargs, out: seen.append("post"), with_kwargs=True)
    m[2].register_forward_hook(lambda mod, args, out: seen.append("always"), always_call=True)
    f = Q.fuse_modules(m, [["0", "1", "2"]])
    f(X4)  # a kwargs hook registered without its flag got the wrong arguments (TypeError, torch.ao too)
    assert seen == [[], "post", "always"]
    assert len(f[0]._forward_hooks_always_called) == 1


def test_hooks_that_cannot_move_are_named():
    m = _cbr()
    m[1].register_forward_pre_hook(lambda mod, args: None)  # the BN is folded away
    with pytest.warns(UserWarning, match=r"BatchNorm2d \(part 1\) forward pre-hooks are not moved"):
        Q.fuse_modules(m, [["0", "1", "2"]])


def test_a_failed_inplace_fusion_leaves_the_parts_hooks_in_place():
    m = _cbr()
    calls: list[str] = []
    handle = m[0].register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    with pytest.raises(ValueError, match="no submodule named 'nope'"):
        Q.fuse_modules(m, [["0", "1", "2"], ["nope", "2"]], inplace=True)
    assert [type(c) for c in m] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    m(X4)
    assert calls == ["pre"]
    handle.remove()  # the user's handle still removes it
    m(X4)
    assert calls == ["pre"]


# ---- fuse_modules: argument checks ----
def test_the_root_cannot_be_a_part():
    with pytest.raises(ValueError, match="'' names the model itself"):  # was "'' is not in list"
        Q.fuse_modules(_cbr(), [["", "0"]])


def test_fuse_modules_qat_refuses_a_torch_ao_qconfig_where_it_is_given():
    with pytest.raises(TypeError, match="lowbit QConfig"):  # accepted, then refused by prepare_qat
        Q.fuse_modules_qat(_cbr().train(), [["0", "1", "2"]], qconfig=tq.default_qat_qconfig)


@pytest.mark.parametrize("none_on, gets", [(2, "the first part's QConfig"), (0, "the first part's None")])
def test_parts_disagreeing_on_qconfig_none_warn(none_on, gets):
    m = _cbr()
    for i in (0, 2):
        m[i].qconfig = None if i == none_on else Q.get_minmax_qconfig()
    with pytest.warns(UserWarning, match=f"disagree on .qconfig.*gets {gets}"):
        f = Q.fuse_modules(m, [["0", "1", "2"]])
    assert (f[0].qconfig is None) == (none_on == 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = _cbr()
        m[0].qconfig = m[2].qconfig = None  # agreeing parts: no warning
        Q.fuse_modules(m, [["0", "1", "2"]])


# ---- register_fusion_pattern: fused_type is the class the fuser returns ----
class _ConvReLU6(nn.Sequential):
    pass


def test_fused_type_must_be_a_module_class_and_the_fuser_must_return_it():
    with pytest.raises(TypeError, match="fused_type='x'"):
        register_fusion_pattern((nn.Conv2d, nn.ReLU6), lambda q, a, b: _ConvReLU6(a, b), fused_type="x")
    register_fusion_pattern((nn.Conv2d, nn.ReLU6), lambda q, a, b: nn.Sequential(a, b), fused_type=_ConvReLU6)
    try:  # the swap tables key on fused_type: a Sequential stayed float without a word
        with pytest.raises(TypeError, match="returned Sequential, not _ConvReLU6"):
            Q.fuse_modules(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU6()), [["0", "1"]])
    finally:
        unregister_fusion_pattern((nn.Conv2d, nn.ReLU6))


# ---- QConfigMapping.from_dict: a misspelt tier ----
def test_from_dict_names_a_misspelt_tier():
    with pytest.raises(ValueError, match="'object_types' is no tier.*did you mean 'object_type'"):
        Q.QConfigMapping.from_dict({"object_types": [(nn.Linear, None)]})  # was: set_module_name: qconfig=[...]
    assert Q.QConfigMapping.from_dict({"fc": None}).module_name_qconfigs == {"fc": None}  # a module name still is


# ---- graph mode: set_object_type keys on the traced function, as torch.ao ----
class _Ops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        y = torch.add(a + b, a)          # operator.add, then torch.add
        z = torch.mul(y * b, a)          # operator.mul, then torch.mul
        return self.b(z)


XL = torch.randn(4, 8)


def _ours(obj) -> dict[str, bool]:
    m = Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_object_type(obj, None)
    p = Q.prepare_fx(_Ops().eval(), m, (XL,))
    return {n.name: n.meta.get("lowbit_qconfig") is not None for n in p.graph.nodes if n.op == "call_function"}


def _theirs(obj) -> dict[str, bool]:
    m = tq.QConfigMapping().set_global(tq.get_default_qconfig("x86")).set_object_type(obj, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ao_prepare_fx(_Ops().eval(), m, (XL,))
    ops = {n.name for n in p.graph.nodes if n.op == "call_function"}
    return {n: q is not None for n, q in p.meta["_observed_graph_module_attrs"].node_name_to_qconfig.items() if n in ops}


@pytest.mark.parametrize("obj", [operator.add, torch.add, operator.mul, torch.mul],
                         ids=["operator.add", "torch.add", "operator.mul", "torch.mul"])
def test_object_type_of_a_function_matches_torch_ao(obj):
    ours, theirs = _ours(obj), _theirs(obj)
    assert ours == theirs  # `a + b` and torch.add(a, b) were one key: setting one excluded both
    assert sum(not v for v in ours.values()) == 1


class _AddReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.relu(torch.add(self.a(x), self.b(x))))  # fused into one add_relu node


@pytest.mark.parametrize("obj, float_add", [(operator.add, False), (torch.add, True)])
def test_a_fused_add_relu_keeps_its_functions_setting(obj, float_add):
    m = Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_object_type(obj, None)
    p = Q.prepare_fx(_AddReLU().eval(), m, (XL,))
    p(XL)
    q = Q.convert_fx(copy.deepcopy(p))
    assert ("add_relu" in q.lowbit_report.converted) == (not float_add)  # torch.add's None took `+` too
    assert ("qfunctional" in q.code) == (not float_add)
