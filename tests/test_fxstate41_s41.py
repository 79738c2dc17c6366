"""Session 41: graph-mode state through pickle / torch.save, DDP ignore-list hygiene on the reference path.

Before: a prepared (calibrated) graph pickled or torch.saved lost its prepare state (``gm.meta`` and every node's
``lowbit_*`` metadata: pickle rebuilds a GraphModule from its code), so ``convert_fx`` refused it ("a GraphModule
with observers but no prepare state"); ``convert_to_reference_fx`` and its lowering lost or kept stale names in
``_ddp_params_and_buffers_to_ignore``.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.fx.state import CARRY_KEY, STATE_KEY, is_prepared


class _Res(nn.Module):
    """Conv-BN-ReLU, a residual add, a bilinear upsample (the grid_blend bookkeeping) and a nearest one."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.c1(x)))
        z = self.up(self.c2(y) + y)
        return F.interpolate(z, scale_factor=0.5) * 0.5


class _Lin(nn.Module):
    """A Linear module, a functional linear on a parameter (its weight observer), an add."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.w = nn.Linear(6, 8), nn.Parameter(torch.randn(5, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc(x))
        return F.linear(h, self.w) + h[:, :5]


def _pickle(m: nn.Module) -> nn.Module:
    return pickle.loads(pickle.dumps(m))


def _torch_save(m: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _prepared(make, qat: bool, x: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if qat:
            p = Q.prepare_qat_fx(model.train(), Q.get_default_qat_qconfig_mapping(), example_inputs=(x,))
        else:
            p = Q.prepare_fx(model.eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        for i in range(3):
            p(x + 0.1 * i)
    return p


def _same(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    assert a.code == b.code
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        va, vb = sa[k], sb[k]
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), k
        else:
            assert repr(va) == repr(vb), k
    assert torch.equal(a(x), b(x))


CASES = [(_Res, (2, 3, 8, 8)), (_Lin, (4, 6))]


@pytest.mark.parametrize("make,shape", CASES, ids=["cnn", "linear"])
@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
@pytest.mark.parametrize("load", [_pickle, _torch_save], ids=["pickle", "torch_save"])
def test_a_saved_prepared_graph_converts_bit_identically(make, shape, qat, load):
    """Before: TypeError 'expects a model returned by prepare_fx or prepare_qat_fx, got GraphModule: a GraphModule
    with observers but no prepare state'."""
    x = torch.randn(*shape)
    p = _prepared(make, qat, x)
    loaded = load(p)
    assert is_prepared(loaded) and loaded.meta[STATE_KEY]["is_qat"] is qat
    assert loaded.lowbit_report is loaded.meta[STATE_KEY]["report"]  # (one object, as prepare_fx left it)
    assert loaded.training is p.training
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(Q.convert_fx(loaded), Q.convert_fx(p), x)


def test_a_loaded_prepared_graph_keeps_calibrating_and_its_checks():
    """Calibration after loading goes on from the saved statistics; the all-or-nothing load_state_dict guard and the
    grid-blend node's role come back; a reference convert of the loaded model equals the original's."""
    x = torch.randn(2, 3, 8, 8)
    p = _prepared(_Res, False, x)
    loaded = _torch_save(p)
    for m in (p, loaded):
        m(x * 2)
    assert any(n.meta.get("lowbit_kind") == "grid_blend" for n in (is_prepared(loaded) and
                                                                   loaded.graph.nodes))
    def hooks(m: nn.Module) -> list:
        return [getattr(h.hook, "func", h.hook) for h in m._load_state_dict_pre_hooks.values()]

    assert hooks(loaded) == hooks(p) and len(hooks(p)) == 2  # the all-or-nothing guard, absorbed BN keys skipped
    _same(Q.convert_fx(loaded), Q.convert_fx(p), x)
    _same(Q.convert_to_reference_fx(_pickle(p)), Q.convert_to_reference_fx(p), x)


def test_a_pickled_reference_model_lowers_as_the_original():
    x = torch.randn(4, 6)
    ref = Q.convert_to_reference_fx(_prepared(_Lin, False, x))
    _same(Q.convert_fx(_pickle(ref)), Q.convert_fx(ref), x)


def test_a_converted_graph_pickles_without_the_prepare_state():
    x = torch.randn(4, 6)
    q = Q.convert_fx(_prepared(_Lin, False, x))
    assert CARRY_KEY not in q.__dict__
    loaded = _pickle(q)
    assert torch.equal(loaded(x), q(x))


def test_a_graph_that_cannot_take_its_state_back_is_refused_by_name():
    """A snapshot that does not match the re-traced graph (here: one node's entry removed) is never applied in part:
    convert_fx refuses, naming the mismatch and the way out."""
    x = torch.randn(4, 6)
    p = _prepared(_Lin, False, x)
    blob = pickle.dumps(p)
    loaded = pickle.loads(blob)
    carry = loaded.__dict__[CARRY_KEY]
    carry.saved["nodes"] = [e for e in carry.saved["nodes"] if e[0] != "get_attr"]
    with pytest.raises(TypeError, match=r"got GraphModule: the re-traced graph's nodes do not match the saved prepare "
                                        r"state \(saved only: \[\], re-traced only: \['get_attr w'\]\); load the "
                                        "prepared model's state_dict"):
        Q.convert_fx(loaded)
    # a pickle without the carry (from before it): session 40's message
    old = copy.deepcopy(p)
    del old.__dict__[CARRY_KEY]
    with pytest.raises(TypeError, match=r"got GraphModule: a GraphModule with observers but no prepare state"):
        Q.convert_fx(_pickle(old))


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_loaded_attention_mask_model_calibrates_without_its_padding_or_is_refused():
    """The root's attention_mask hooks (padding left out of the statistics) come back with restore(); a model
    calibrated after loading before they did is refused by name (its padding went into the statistics)."""
    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 6), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    x[mask == 0] = 50.0  # padding far outside the real tokens' range
    p = Q.prepare_fx(_Masked().eval(), Q.get_default_qconfig_mapping(), example_inputs=(x, mask))
    blob = pickle.dumps(p)
    loaded = Q.fx.restore(pickle.loads(blob))
    for m in (p, loaded):
        m(x, mask)
    a, b = Q.convert_fx(loaded), Q.convert_fx(p)
    assert torch.equal(a(x, mask), b(x, mask)) and a.code == b.code
    late = pickle.loads(blob)
    late(x, mask)
    with pytest.raises(TypeError, match=r"got GraphModule: it was calibrated after loading, before its attention_mask "
                                        r"hooks were put back .*lowbit\.fx\.restore\(model\)"):
        Q.convert_fx(late)


_IGNORE = "_ddp_params_and_buffers_to_ignore"


@pytest.mark.parametrize("inplace", [False, True])
def test_reference_converts_keep_the_users_ddp_names_and_drop_the_observers(inplace):
    """As convert_fx: the user's names stay, the names prepare added for the histogram observers go with them.
    Before: the reference model (a GraphModule copy) had no list (the user's 'fc.bias' lost), in place it kept the
    24 names of the removed observers' buffers, and its lowering had no list either."""
    x = torch.randn(4, 6)
    p = _prepared(_Lin, False, x)
    assert len(getattr(p, _IGNORE)) == 24
    getattr(p, _IGNORE).append("fc.bias")
    assert getattr(Q.convert_fx(p), _IGNORE) == ["fc.bias"]
    ref = Q.convert_to_reference_fx(p, inplace=inplace)
    assert getattr(ref, _IGNORE) == ["fc.bias"] and ref.__dict__["_lowbit_ddp_ignored"] == []
    assert getattr(Q.convert_fx(ref), _IGNORE) == ["fc.bias"]
    assert getattr(Q.lower_reference(ref), _IGNORE) == ["fc.bias"]


def test_eager_to_reference_drops_the_observers_ddp_names():
    """Before: to_reference kept the 18 names of the histogram observers' statistics (frozen, the buffers gone)."""
    from lowbit.reference import lower_reference_eager, to_reference

    torch.manual_seed(0)
    m = Q.QuantWrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    p(torch.randn(8, 4))
    getattr(p, _IGNORE).append("module.0.bias")
    assert len(getattr(p, _IGNORE)) == 19
    ref = to_reference(p)
    assert getattr(ref, _IGNORE) == ["module.0.bias"]
    assert getattr(lower_reference_eager(ref), _IGNORE) == ["module.0.bias"]


class _Branchy(nn.Module):
    """A root torch.fx cannot trace (data-dependent branch): returned as itself, its children prepared graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), nn.Sequential(nn.Conv2d(4, 4, 1), nn.Upsample(
            scale_factor=2, mode="bilinear"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if bool(y.sum() > 0) else y


@pytest.mark.parametrize("load", [_pickle, _torch_save], ids=["pickle", "torch_save"])
def test_a_saved_container_with_prepared_children_converts_bit_identically(load):
    """The root keeps its mark through pickle (a plain module's __dict__); its child graphs take theirs back."""
    x = torch.randn(2, 3, 8, 8).abs()
    p = _prepared(_Branchy, False, x)
    assert not isinstance(p, torch.fx.GraphModule) and isinstance(p.a, torch.fx.GraphModule)
    loaded = load(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = Q.convert_fx(loaded), Q.convert_fx(p)
    assert a.a.code == b.a.code and a.b.code == b.b.code and str(a) == str(b)
    assert torch.equal(a(x), b(x))
    broken = load(p)
    broken.b.__dict__[CARRY_KEY].saved["nodes"].pop(0)  # a child graph that cannot take its state back
    with pytest.raises(TypeError, match=r"convert_fx: a graph of this pickled prepared model lost its prepare state: "
                                        r"the re-traced graph's nodes do not match"):
        Q.convert_fx(broken)
