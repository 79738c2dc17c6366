"""QConfig, QConfigMapping (precedence, inheritance, normalisation, bad keys) and the default recipes."""

from __future__ import annotations

import copy
import importlib
import pickle

import pytest
import torch
from torch import nn
from torch.ao.quantization import QConfigMapping as TorchQConfigMapping

import lowbit as Q
from lowbit.fake_quant import FakeQuantize
from lowbit.observer.fixed import PlaceholderObserver
from lowbit.observer.histogram import HistogramObserver
from lowbit.observer.minmax import MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver

A = Q.get_default_qconfig()
B = Q.get_minmax_qconfig()
C = Q.get_default_qat_qconfig()


# ---- QConfig ----
def test_qconfig_is_a_namedtuple_of_factories():
    qc = Q.QConfig(activation=MinMaxObserver.with_args(), weight=PerChannelMinMaxObserver)
    act, w = qc
    assert qc._fields == ("activation", "weight") and act is qc.activation and w is qc.weight
    assert act() is not act() and isinstance(w(), PerChannelMinMaxObserver)  # a fresh observer per call
    with pytest.raises(AttributeError):
        qc.activation = None  # immutable
    assert copy.deepcopy(qc) is qc
    m = nn.Linear(1, 1)
    m.qconfig = qc
    assert copy.deepcopy(m).qconfig is qc  # prepare's deep copy keeps the recipe identity
    assert repr(pickle.loads(pickle.dumps(qc))) == repr(qc)


@pytest.mark.parametrize("activation, weight, match", [
    (MinMaxObserver(), MinMaxObserver, "activation=MinMaxObserver.*instance.*with_args"),
    (MinMaxObserver, PerChannelMinMaxObserver(), "weight=PerChannelMinMaxObserver.*instance"),
    ("minmax", MinMaxObserver, "activation='minmax'.*zero-arg factory"),
    (MinMaxObserver, None, "weight=None"),
    (MinMaxObserver, lambda ch_axis: None, "weight=.*without arguments"),
])
def test_qconfig_rejects_non_factories(activation, weight, match):
    with pytest.raises(TypeError, match=match):
        Q.QConfig(activation, weight)


def test_qconfig_repr_is_readable():
    assert repr(B) == ("QConfig(activation=MinMaxObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8), "
                       "weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, "
                       "qdtype=qint8))")
    assert "FakeQuantize.with_args(observer=MovingAverageMinMaxObserver" in repr(C)


# ---- default recipes ----
def built(factory):
    m = factory()
    return type(m), m.qscheme, m.qdtype, m.ch_axis


def test_default_qconfig():
    assert built(A.activation) == (HistogramObserver, Q.per_tensor_affine, Q.quint8, None)
    assert built(A.weight) == (PerChannelMinMaxObserver, Q.per_channel_symmetric, Q.qint8, 0)
    assert A.activation().bins == 2048


def test_default_qat_qconfig():
    act, w = C.activation(), C.weight()
    assert isinstance(act, FakeQuantize) and isinstance(w, FakeQuantize)
    assert built(lambda: act.activation_post_process) == (
        MovingAverageMinMaxObserver, Q.per_tensor_affine, Q.quint8, None)
    assert act.activation_post_process.averaging_constant == 0.01
    # the seeds' cumulative per-channel min/max (torch uses a moving-average one here)
    assert built(lambda: w.activation_post_process) == (PerChannelMinMaxObserver, Q.per_channel_symmetric, Q.qint8, 0)


def test_other_recipes():
    assert built(B.activation) == (MinMaxObserver, Q.per_tensor_affine, Q.quint8, None)
    dyn = Q.get_dynamic_qconfig()
    act = dyn.activation()
    assert isinstance(act, PlaceholderObserver) and act.is_dynamic and act.qdtype == Q.quint8
    assert built(dyn.weight) == (PerChannelMinMaxObserver, Q.per_channel_symmetric, Q.qint8, 0)
    for bad in (Q.quint8, "int7"):  # torch.float16 is supported: tests/test_dynamic_float16.py
        with pytest.raises((ValueError, TypeError), match="dtype"):
            Q.get_dynamic_qconfig(bad)


def test_default_mappings_set_the_global_tier_and_fixed_grids_only():
    for m, qc in ((Q.get_default_qconfig_mapping(), A), (Q.get_default_qat_qconfig_mapping(), C)):
        assert repr(m.global_qconfig) == repr(qc)
        assert not (m.module_name_qconfigs or m.module_name_regex_qconfigs)
        # torch.ao's fixed-qparams ops (session 36): sigmoid / hardsigmoid / softmax / tanh, nothing else
        assert all("FixedQParams" in repr(c.activation) for c in m.object_type_qconfigs.values())
        assert set(m.object_type_qconfigs) == {nn.Sigmoid, torch.sigmoid, nn.Hardsigmoid, torch.nn.functional.hardsigmoid,
                                               nn.Softmax, nn.Tanh, torch.tanh}


# ---- QConfigMapping: precedence, exactly as torch.ao resolves it for full-name matches ----
class Sub(nn.Linear):
    pass


def mapping():
    return (Q.QConfigMapping().set_global(A).set_object_type(nn.Linear, B)
            .set_module_name_regex(r"enc\.\d+", C).set_module_name_regex(r"enc\..*", None)
            .set_module_name("enc.1", B).set_module_name("head", None))


@pytest.mark.parametrize("mtype, name, expect", [
    (nn.Conv2d, "body", A),          # global
    (nn.Linear, "body", B),          # exact type beats global
    (Sub, "body", A),                # subclasses are not matched
    (nn.Linear, "enc.0", C),         # regex beats type; first registered regex wins
    (nn.Conv2d, "enc.x", None),      # the second regex, an explicit None
    (nn.Conv2d, "xenc.0", A),        # fullmatch: no substring or prefix match
    (nn.Conv2d, "enc.1", B),         # module name beats regex
    (nn.Linear, "head", None),       # an explicit None at the name tier excludes
])
def test_precedence(mtype, name, expect):
    m = mapping()
    assert m.get_qconfig(mtype, name) == expect
    assert m.resolve(name, mtype, inherited=A) == expect


@pytest.mark.parametrize("mtype, name", [(nn.Conv2d, "body"), (nn.Linear, "body"), (nn.Linear, "enc.0"),
                                         (nn.Conv2d, "enc.x"), (nn.Conv2d, "enc.1"), (nn.Linear, "head")])
def test_precedence_matches_torch_ao_fx(mtype, name):
    # torch.ao's FX lookup: global < object type < first re.match regex < module name (names without
    # a parent setting here; torch's prefix match of regexes and parent names differs by design)
    from torch.ao.quantization.fx import qconfig_mapping_utils as tu
    tm = (TorchQConfigMapping().set_global("A").set_object_type(nn.Linear, "B")
          .set_module_name_regex(r"enc\.\d+", "C").set_module_name_regex(r"enc\..*", None)
          .set_module_name("enc.1", "B").set_module_name("head", None))
    expected = tu._get_object_type_qconfig(tm, mtype, tm.global_qconfig)
    expected = tu._get_module_name_qconfig(tm, name, tu._get_module_name_regex_qconfig(tm, name, expected))
    assert {A: "A", B: "B", C: "C", None: None}[mapping().get_qconfig(mtype, name)] == expected


def test_setting_a_key_again_replaces_it_and_regex_keeps_its_place():
    m = Q.QConfigMapping().set_module_name_regex("a.*", A).set_module_name_regex("ab", B).set_module_name_regex("a.*", C)
    assert m.get_qconfig(nn.Linear, "ab") == C and list(m.module_name_regex_qconfigs) == ["a.*", "ab"]
    m.set_object_type(nn.Linear, A).set_object_type(nn.Linear, None)
    assert m.get_qconfig(nn.Linear, "x") is None


# ---- inheritance: children take their parent's resolved setting ----
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Conv1d(1, 1, 1)))
        self.head = nn.Sequential(nn.Linear(4, 2), nn.Sigmoid())
        self.body = nn.Conv1d(1, 1, 1)


def resolve_tree(m, model):
    """The prepare walk: each module resolves against its parent's result (the root's is the global)."""
    out = {}

    def walk(mod, name, inherited):
        out[name] = m.resolve(name, type(mod), inherited)
        for cname, child in mod.named_children():
            walk(child, f"{name}.{cname}" if name else cname, out[name])
    walk(model, "", m.global_qconfig)
    return out


def test_children_inherit_their_parents_setting():
    m = Q.QConfigMapping().set_global(A).set_module_name("enc", B).set_module_name("head", None)
    m.set_module_name("enc.2.0", C).set_object_type(nn.Sigmoid, C)
    assert resolve_tree(m, Net()) == {"": A, "enc": B, "enc.0": B, "enc.1": B, "enc.2": B, "enc.2.0": C,
                                      "head": None, "head.0": None, "head.1": C, "body": A}
    assert set(resolve_tree(Q.QConfigMapping(), Net()).values()) == {None}  # empty mapping: nothing


def test_inheritance_matches_torch_ao_eager_propagation(monkeypatch):
    tq = importlib.import_module("torch.ao.quantization.quantize")  # the module, not the function
    monkeypatch.setattr(tq, "_add_module_to_qconfig_obs_ctr", lambda qconfig, module: qconfig)
    names = {A: "A", B: "B", C: "C", None: None}
    model = Net()
    tq._propagate_qconfig_helper(model, {"": "A", nn.Linear: "B", "enc": "C", "head": None, nn.Sigmoid: "A",
                                         "enc.2.0": None})
    expected = {name: mod.qconfig for name, mod in model.named_modules()}
    m = (Q.QConfigMapping().set_global(A).set_object_type(nn.Linear, B).set_module_name("enc", C)
         .set_module_name("head", None).set_object_type(nn.Sigmoid, A).set_module_name("enc.2.0", None))
    assert {k: names[v] for k, v in resolve_tree(m, Net()).items()} == expected


# ---- normalising user input ----
def test_from_qconfig():
    assert repr(Q.QConfigMapping.from_qconfig(None).global_qconfig) == repr(A)
    assert repr(Q.QConfigMapping.from_qconfig(None, Q.get_default_qat_qconfig_mapping()).global_qconfig) == repr(C)
    assert Q.QConfigMapping.from_qconfig(None, B).global_qconfig == B
    m = mapping()
    assert Q.QConfigMapping.from_qconfig(m) is m
    assert Q.QConfigMapping.from_qconfig(B).global_qconfig == B


def test_from_qconfig_dict():
    d = {"": A, "object_type": [(nn.Linear, B)], "module_name": [("head", None)],
         "module_name_regex": [(r"enc\..*", C)]}
    m = Q.QConfigMapping.from_qconfig(d)
    assert (m.global_qconfig, m.object_type_qconfigs, m.module_name_qconfigs, m.module_name_regex_qconfigs) == (
        A, {nn.Linear: B}, {"head": None}, {r"enc\..*": C})
    spec = Q.QConfigMapping.from_qconfig({nn.Linear: B, "fc1": None})  # quantize_dynamic's qconfig_spec style
    assert spec.get_qconfig(nn.Linear, "fc2") == B and spec.get_qconfig(nn.Linear, "fc1") is None
    assert spec.global_qconfig is None


@pytest.mark.parametrize("bad, err, match", [
    ("fbgemm", TypeError, "qconfig='fbgemm'"),
    (42, TypeError, "qconfig=42"),
    ({"object_type": [nn.Linear]}, ValueError, "must be a .key, qconfig. pair"),
    ({3: A}, TypeError, "key 3"),
    ({"": "A"}, TypeError, "qconfig='A'"),
])
def test_from_qconfig_rejects_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        Q.QConfigMapping.from_qconfig(bad)


@pytest.mark.parametrize("call, err, match", [
    (lambda m: m.set_object_type("Linear", A), TypeError, "object_type='Linear'"),
    (lambda m: m.set_object_type(nn.Linear(2, 2), A), TypeError, "object_type=Linear"),
    (lambda m: m.set_module_name(3, A), TypeError, "module_name=3"),
    (lambda m: m.set_module_name_regex(None, A), TypeError, "pattern=None"),
    (lambda m: m.set_module_name_regex("enc.(", A), ValueError, r"pattern='enc.\('"),
    (lambda m: m.set_global(MinMaxObserver), TypeError, "qconfig=<class"),
    (lambda m: m.set_module_name("x", (MinMaxObserver, MinMaxObserver)), TypeError, "lowbit QConfig"),
])
def test_setters_reject_bad_keys_and_values(call, err, match):
    with pytest.raises(err, match=match):
        call(Q.QConfigMapping())


def test_functions_are_object_types_for_graph_mode():
    m = Q.QConfigMapping().set_object_type(torch.nn.functional.relu, None).set_object_type(torch.add, A)
    assert m.get_qconfig(torch.add, "add_1") == A and m.get_qconfig(torch.nn.functional.relu, "r") is None


def test_mapping_repr_is_readable():
    r = repr(mapping())
    assert r.startswith("QConfigMapping(\n  global: QConfig(activation=HistogramObserver.with_args(")
    assert "  object_type[Linear]: QConfig(activation=MinMaxObserver" in r
    assert "  module_name_regex['enc\\\\..*']: None" in r and "  module_name['head']: None" in r
