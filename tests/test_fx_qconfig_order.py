"""``QConfigMapping.set_module_name_object_type_order``: torch.ao's graph-mode call-order key.

torch.ao's ``prepare_fx`` is the oracle: its prepared graph records each node's qconfig
(``meta["_observed_graph_module_attrs"].node_name_to_qconfig``); lowbit's records it in ``meta["lowbit_qconfig"]``.
Both trace the same node names, so which ops each quantizes can be compared op by op.
"""

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


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x), self.fc2(x)
        y = a + b                      # operator.add #0 in "block"
        z = y + x                      # operator.add #1
        return torch.add(z, a)         # torch.add #0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.fc, self.head = Block(), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.block(x) + x)           # operator.add #0 in the root
        return self.head(F.relu(y) * 2 + y)      # operator.add #1 in the root


X = torch.randn(4, 8)
# (module name, object type, index) entries set to None (left float): functions and modules, nested and at the root
CASES = [
    [("block", operator.add, 1)],
    [("block", nn.Linear, 0)],
    [("block", torch.add, 0), ("", operator.add, 0)],
    [("", nn.Linear, 1), ("block", operator.add, 0), ("block", nn.Linear, 1)],
    [("", operator.add, 1)],
]


def _ours(entries: list, qat: bool = False) -> dict[str, bool]:
    m = Q.QConfigMapping().set_global(Q.get_default_qat_qconfig() if qat else Q.get_default_qconfig())
    for name, obj, i in entries:
        m.set_module_name_object_type_order(name, obj, i, None)
    net = Net().train(qat) if qat else Net().eval()
    p = (Q.prepare_qat_fx if qat else Q.prepare_fx)(net, m, (X,))
    return {n.name: n.meta.get("lowbit_qconfig") is not None for n in p.graph.nodes
            if n.op in ("call_function", "call_module") and not n.name.startswith("activation_post_process")}


def _theirs(entries: list) -> dict[str, bool]:
    m = tq.QConfigMapping().set_global(tq.get_default_qconfig("x86"))
    for name, obj, i in entries:
        m.set_module_name_object_type_order(name, obj, i, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ao_prepare_fx(Net().eval(), m, (X,))
    graph = {n.name: n.op for n in p.graph.nodes}
    return {n: q is not None for n, q in p.meta["_observed_graph_module_attrs"].node_name_to_qconfig.items()
            if graph.get(n) in ("call_function", "call_module") and not n.startswith("activation_post_process")}


@pytest.mark.parametrize("entries", CASES, ids=lambda e: ",".join(f"{n or 'root'}:{getattr(o, '__name__', o)}#{i}"
                                                                 for n, o, i in e))
def test_which_ops_get_a_qconfig_matches_torch_ao(entries):
    ours, theirs = _ours(entries), _theirs(entries)
    assert ours == theirs
    assert sum(not v for v in ours.values()) >= len(entries)  # every entry took an op out (the test can fail)


def test_qat_prepare_takes_the_order_too():
    ours = _ours([("block", nn.Linear, 0), ("block", operator.add, 1)], qat=True)
    assert ours == _theirs([("block", nn.Linear, 0), ("block", operator.add, 1)])


def test_converted_model_keeps_the_chosen_ops_float():
    m = Q.QConfigMapping().set_global(Q.get_minmax_qconfig())
    m.set_module_name_object_type_order("block", nn.Linear, 0, None)  # block.fc1: the first Linear called in block
    p = Q.prepare_fx(Net().eval(), m, (X,))
    p(X)
    q = Q.convert_fx(p)
    assert type(q.get_submodule("block.fc1")) is nn.Linear
    assert type(q.get_submodule("block.fc2")).__module__.startswith("lowbit.nn.quantized")
    full = Q.prepare_fx(Net().eval(), Q.get_minmax_qconfig(), (X,))
    full(X)
    assert type(Q.convert_fx(full).get_submodule("block.fc1")).__module__.startswith("lowbit.nn.quantized")


def test_the_setter_and_dict_round_trip():
    qc = Q.get_default_qconfig()
    m = Q.QConfigMapping().set_global(qc).set_module_name_object_type_order("block", operator.add, 1, None)
    m.set_module_name_object_type_order("", nn.Linear, 0, qc)
    assert m.module_name_object_type_order_qconfigs == {("block", operator.add, 1): None, ("", nn.Linear, 0): qc}
    d = m.to_dict()
    assert d["module_name_object_type_order"] == [("block", operator.add, 1, None), ("", nn.Linear, 0, qc)]
    back = Q.QConfigMapping.from_dict(d)
    assert back.module_name_object_type_order_qconfigs == m.module_name_object_type_order_qconfigs
    assert "module_name_object_type_order['block', " in repr(m)


def test_bad_inputs():
    m = Q.QConfigMapping()
    with pytest.raises(TypeError, match="module_name=3 must be a str"):
        m.set_module_name_object_type_order(3, nn.Linear, 0, None)
    with pytest.raises(TypeError, match="object_type='add' is a method call, which graph mode does not count"):
        m.set_module_name_object_type_order("block", "add", 0, None)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=f"index={bad!r} must be an int >= 0"):
            m.set_module_name_object_type_order("block", nn.Linear, bad, None)
    with pytest.raises(TypeError, match="QConfig"):
        m.set_module_name_object_type_order("block", nn.Linear, 0, "float")
    with pytest.raises(ValueError, match="resolution='exact'"):
        Q.QConfigMapping(resolution="exact").set_module_name_object_type_order("block", nn.Linear, 0, None)
    with pytest.raises(ValueError, match=r"must be a \(module name, object type, index, qconfig\)"):
        Q.QConfigMapping.from_dict({"module_name_object_type_order": [("block", nn.Linear, None)]})
    # a module name the model does not have: a typo, named with a hint
    typo = Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_module_name_object_type_order(
        "blok", nn.Linear, 0, None)
    with pytest.raises(ValueError, match=r"set_module_name_object_type_order names no module .*'blok'.*did you mean"):
        Q.prepare_fx(Net().eval(), typo, (X,))
    # an index past the calls: warned with the count, nothing changed
    past = Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_module_name_object_type_order(
        "block", nn.Linear, 2, None)
    with pytest.warns(UserWarning, match=r"\('block', Linear, 2\) matches no call: the traced graph calls Linear 2"):
        p = Q.prepare_fx(Net().eval(), past, (X,))
    assert all(_ours([]).values()) and {n.name for n in p.graph.nodes} >= {"block_fc1", "block_fc2"}
    # eager mode has no call order
    eager = Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_module_name_object_type_order(
        "block", nn.Linear, 0, None)
    for prepare in (Q.prepare, Q.prepare_qat):
        with pytest.raises(ValueError, match="eager mode has no call order: name the module with set_module_name"):
            prepare(copy.deepcopy(Net()), eager)
