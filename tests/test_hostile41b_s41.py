"""Session 41, second hostile sweep of the session's new APIs (prepared graphs through pickle / deepcopy, share-op
ends, the bilinear plan cache, quantize_ptq's "nothing to quantize" refusal, keep_float's checks).

Before: a deep copy of a loaded prepared model not yet restored (``copy.deepcopy(torch.load(...))``, as
``quantize_ptq`` / a training loop's best-model copy do) lost the prepare state (``GraphModule.__deepcopy__`` keeps
only what the graph reads, and a loaded graph has no deepcopy hook): ``convert_fx`` refused the copy ("a GraphModule
with observers but no prepare state"); ``keep_float(None, ...)`` raised ``'NoneType' object has no attribute
'set_module_name'``; the "nothing to quantize" refusal of ``torch.relu(x) + x`` said "no layer or op got a qconfig"
while the add had one (prepare_fx kept it float: a float island) and did not say so.
"""

from __future__ import annotations

import copy
import io
import operator
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.debug.table import keep_float
from lowbit.fx.state import STATE_KEY, is_prepared


class _Res(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.c1(x)))
        return F.interpolate(self.up(self.c2(y) + y), scale_factor=0.5) * 0.5


class _Tied(nn.Module):
    """Two Linears sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


class _Branchy(nn.Module):
    """A root torch.fx cannot trace: prepare_fx returns it with prepared child graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if bool(y.sum() > 0) else y


def _prepared(make, qat: bool, x: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if qat:
            p = Q.prepare_qat_fx(make().train(), Q.get_default_qat_qconfig_mapping(), example_inputs=(x,))
        else:
            p = Q.prepare_fx(make().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        for i in range(3):
            p(x + 0.1 * i)
    return p


def _torch_save(m: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _converted(m: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Q.convert_fx(m)


def _same(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    qa, qb = _converted(a), _converted(b)
    assert str(qa) == str(qb)
    sa, sb = qa.state_dict(), qb.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
    assert torch.equal(qa(x), qb(x))


CASES = [(_Res, (2, 3, 8, 8)), (_Tied, (4, 6))]
COPIES = {
    "deepcopy": lambda m: copy.deepcopy(_torch_save(m)),
    "deepcopy_twice": lambda m: copy.deepcopy(copy.deepcopy(pickle.loads(pickle.dumps(m)))),
    "deepcopy_then_pickle": lambda m: pickle.loads(pickle.dumps(copy.deepcopy(pickle.loads(pickle.dumps(m))))),
}


@pytest.mark.parametrize("make,shape", CASES, ids=["cnn", "tied"])
@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
@pytest.mark.parametrize("how", list(COPIES))
def test_a_deep_copy_of_a_loaded_unrestored_prepared_graph_converts_bit_identically(make, shape, qat, how):
    """Before: TypeError 'convert_fx: expects a model returned by prepare_fx or prepare_qat_fx, got GraphModule: a
    GraphModule with observers but no prepare state' (24 of 24 such copies in the sweep)."""
    x = torch.randn(*shape)
    p = _prepared(make, qat, x)
    c = COPIES[how](p)
    assert is_prepared(c) and c.meta[STATE_KEY]["is_qat"] is qat
    _same(c, p, x)


def test_the_loaded_original_and_its_deep_copy_both_convert_and_calibrate_on_their_own():
    x = torch.randn(4, 6)
    p = _prepared(_Tied, False, x)
    loaded = pickle.loads(pickle.dumps(p))
    c = copy.deepcopy(loaded)
    c(x * 3)  # the copy calibrates on its own: the loaded model and the original keep their statistics
    _same(loaded, p, x)
    ref = copy.deepcopy(p)
    ref(x * 3)
    _same(c, ref, x)


def test_a_deep_copy_of_a_loaded_container_with_prepared_children_converts_bit_identically():
    x = torch.randn(2, 3, 8, 8).abs()
    p = _prepared(_Branchy, False, x)
    assert not isinstance(p, torch.fx.GraphModule)
    c = copy.deepcopy(_torch_save(p))
    a, b = _converted(c), _converted(p)
    assert a.a.code == b.a.code and a.b.code == b.b.code and str(a) == str(b)
    assert torch.equal(a(x), b(x))


# ---- keep_float's mapping ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping", [None, {}, "x"], ids=["none", "dict", "str"])
def test_keep_float_refuses_a_non_mapping(mapping):
    """Before: AttributeError "'NoneType' object has no attribute 'set_module_name'"."""
    with pytest.raises(TypeError, match=rf"keep_float: mapping={type(mapping).__name__} must be a QConfigMapping"):
        keep_float(mapping, "add#0", {"add#0": ("", operator.add, 0)})


# ---- quantize_ptq: nothing to quantize -----------------------------------------------------------------------------


class _AddIsland(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + x


class _CatIsland(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x * 2], 1)


@pytest.mark.parametrize("model,ops", [(_AddIsland(), "add: add"), (_CatIsland(), "cat: cat")], ids=["add", "cat"])
def test_nothing_to_quantize_names_the_ops_prepare_fx_kept_float(model, ops):
    """An op with a qconfig that prepare_fx kept float (float in, float out: a float island) is named with the
    reason; before, the message said no op got a qconfig."""
    with pytest.raises(ValueError, match=rf"nothing to quantize in {type(model).__name__} .*no layer or op runs in "
                                         rf"int8 .*kept float by prepare_fx: .*{ops} \(kept float: float input"):
        Q.quantize_ptq(model.eval(), [torch.randn(4, 4)], recipe="default", progress=False)


def test_an_int8_op_only_model_is_still_quantized():
    """An op-only model with an int8 op (cat then add of a constant: int8 as torch.ao) is not refused."""

    class CatAdd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x], 1) + 1

    x = torch.randn(8, 4)
    q, report = Q.quantize_ptq(CatAdd().eval(), [x], recipe="default", progress=False)
    assert 30 < report.sqnr_db < float("inf")
    assert torch.allclose(q(x), CatAdd()(x), atol=0.05)
