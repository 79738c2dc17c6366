"""Session 47 (fx47): ``torch.fx.symbolic_trace`` of lowbit models, and ``graph_leaf``'s blind spots.

- torch.fx's default tracer keeps only ``torch.nn`` / ``torch.ao.nn`` modules whole: it ran the ``forward`` of
  lowbit's observers, stubs and quantized modules on proxies, and every prepared / converted model failed to re-trace
  (``Quantize expects a float tensor or a QTensor, got Proxy``). ``fx_leaves.FxLeaf`` makes each lowbit module
  one ``call_module`` node in any tracer; ``leaf_method`` does so for ``QFunctional.add`` & co. (eager models).
  Oracle: torch.ao's converted models re-trace with the default tracer (its prepared static models do not: its
  HistogramObserver branches on a traced value).
- ``graph_leaf`` did not see a proxy inside a ``slice``, a ``set`` or a dict key (the body ran at trace time).
"""

from __future__ import annotations

import copy
import importlib
import io
import pkgutil
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lowbit as Q
from lowbit.compile_state import graph_leaf
from lowbit.fx_leaves import LOWBIT_LEAVES


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 36, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        return self.fc(torch.flatten(self.c2(y) + y, 1))


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 2.0, -1)
        return self.ln(x + self.o(a @ self.v(x)))


MODELS = {"cnn": (CNN, (2, 3, 8, 8)), "attn": (Attn, (2, 4, 8)),
          "linears": (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (3, 8))}


def retraced(model: nn.Module, *x: torch.Tensor) -> fx.GraphModule:
    """``symbolic_trace(model)`` (torch.fx's own tracer) after checking it gives ``model``'s outputs bit for bit, from
    the same state (a copy runs the original), and that its code prints and recompiles."""
    ref = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    want, got = ref(*x), gm(*x)
    assert torch.equal(got, want)
    gm.recompile()
    assert "def forward" in gm.code
    return gm


def leaf_targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(MODELS))
def test_prepared_and_converted_graphs_retrace_bit_identical(name: str, dynamic: bool) -> None:
    cls, shape = MODELS[name]
    x = torch.randn(*shape)
    qmap = Q.QConfigMapping().set_global(Q.get_dynamic_qconfig()) if dynamic else Q.get_default_qconfig_mapping()
    prepared = Q.prepare_fx(cls().eval(), qmap, (x,))
    prepared(x)
    t = retraced(prepared, x)
    assert leaf_targets(t) == leaf_targets(prepared)  # every observer / module call stays one node
    # the re-traced module runs the same observers: their statistics move as the original's would
    twin = copy.deepcopy(prepared)
    wide = 3 * torch.randn(*shape)
    t(wide), twin(wide)
    assert all(torch.equal(a, b) for a, b in zip(prepared.state_dict().values(), twin.state_dict().values()))
    converted = Q.convert_fx(prepared)
    t = retraced(converted, x)
    assert leaf_targets(t) == leaf_targets(converted)
    assert all(t.get_submodule(k) is converted.get_submodule(k) for k in leaf_targets(t))


def test_torch_ao_converted_retraces_too() -> None:
    """The oracle: torch.ao's converted graph of the same model re-traces with the default tracer."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    x = torch.randn(2, 3, 8, 8)
    p = prepare_fx(CNN().eval(), get_default_qconfig_mapping(), (x,))
    p(x)
    retraced(convert_fx(p), x)


def test_qat_graph_retraces_and_fake_quants_learn() -> None:
    x = torch.randn(2, 3, 8, 8)
    pq = Q.prepare_qat_fx(CNN().train(), Q.get_default_qat_qconfig_mapping(), (x,))
    twin = copy.deepcopy(pq)
    t = retraced(pq, x)  # (one step each from the same state: the copy ran the original)
    twin(x)
    assert all(torch.equal(a, b) for a, b in zip(pq.state_dict().values(), twin.state_dict().values()))
    retraced(Q.convert_fx(copy.deepcopy(pq).eval()), x)
    assert leaf_targets(t) == leaf_targets(pq)


def test_weight_only_reference_and_pickled_retrace() -> None:
    x = torch.randn(3, 8)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    for bits in (4, 8):
        retraced(Q.quantize_weight_only(m, bits=bits, group_size=8), x)
    xi = torch.randn(2, 3, 8, 8)
    p = Q.prepare_fx(CNN().eval(), Q.get_default_qconfig_mapping(), (xi,))
    p(xi)
    retraced(Q.convert_to_reference_fx(copy.deepcopy(p)), xi)
    t = retraced(Q.convert_fx(p), xi)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(xi), t(xi))
    assert torch.equal(fx.Interpreter(t).run(xi), t(xi))


class Eager(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.conv, self.dequant = Q.QuantStub(), nn.Conv2d(3, 3, 1), Q.DeQuantStub()
        self.ff = Q.nn.quantized.FloatFunctional()
        self.fc = nn.Linear(96, 4)

    def forward(self, x):
        x = self.quant(x)
        y = self.ff.add(self.conv(x), x)
        y = self.ff.cat([y, self.ff.mul_scalar(y, 0.5)], dim=1)
        return self.dequant(self.fc(torch.flatten(y, 1)))


def test_eager_prepared_converted_and_dynamic_retrace() -> None:
    x = torch.randn(2, 3, 4, 4)
    m = Eager().eval()
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    retraced(p, x)
    p(x)
    c = Q.convert(p)
    t = retraced(c, x)
    assert [n.args[0] for n in t.graph.nodes if n.target == "ff"] == ["add", "mul_scalar", "cat"]

    class Rnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.fc = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 2)

        def forward(self, x):
            return self.fc(self.lstm(x)[0])

    retraced(Q.quantize_dynamic(Rnn().eval()), torch.randn(2, 3, 4))


def _leaf_classes() -> list[type]:
    for pkg in ("lowbit.nn", "lowbit.observer", "lowbit.fake_quant", "lowbit.reference"):
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
            importlib.import_module(info.name)
    importlib.import_module("lowbit.algorithms.smoothquant")
    found, todo = [], [nn.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            # (a class only posing as lowbit's, its __module__ set to a module that does not exist, is a test's:
            # test_export_onnx's _Custom)
            if sub.__module__ in sys.modules and (sub.__module__.startswith(LOWBIT_LEAVES)
                                                  or getattr(sub, "_lowbit_fx_leaf", False)):
                found.append(sub)
    return found


def test_every_class_lowbit_keeps_whole_is_one_node_in_any_tracer() -> None:
    """Each module class lowbit's own tracer keeps whole (``LOWBIT_LEAVES``, ``_lowbit_fx_leaf``) has the leaf
    ``forward`` (a new class outside the ``FxLeaf`` bases fails here)."""
    classes = _leaf_classes()
    assert len(classes) > 100
    missing = [f"{c.__module__}.{c.__qualname__}" for c in classes
               if not getattr(c.forward, "__isabstractmethod__", False)
               and not getattr(c.forward, "_lowbit_leaf_forward", False)]
    assert missing == []


class Twice(Q.QuantStub):
    """A user subclass (not a lowbit leaf) whose forward calls the leaf's: traced through, the stub's own body runs
    (a node of the whole module there would run ``x * 2`` twice)."""

    def forward(self, x):
        return super().forward(x * 2)


class Scaled(Q.MinMaxObserver):
    _lowbit_fx_leaf = True  # (a user class may ask to be one node: its own forward)

    def forward(self, x):
        return super().forward(x) * 3 if float(x.abs().max()) > 0 else x


def test_user_subclasses_traced_through_or_whole() -> None:
    m = nn.Sequential(Twice(), nn.ReLU(), Scaled())
    x = torch.randn(4)
    t = retraced(m, x)
    assert leaf_targets(t) == ["1", "2"] and torch.equal(t(x), torch.relu(x * 2) * 3)


@graph_leaf
def _pick(x, where):
    return x[slice(int(where.start), None)]  # (int() of a proxy: the body cannot run at trace time)


@graph_leaf
def _total(parts):
    return sum(float(p.sum()) for p in parts)


def test_graph_leaf_sees_proxies_in_slices_sets_and_dict_keys() -> None:
    gm = fx.symbolic_trace(lambda x: _pick(x, slice(x.shape[0] - 2, None)))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][-1] is _pick
    assert gm(torch.arange(5.0)).tolist() == [3.0, 4.0]
    with pytest.raises(TypeError, match="_total: a traced value inside a set"):
        fx.symbolic_trace(lambda x: _total({x}))
    with pytest.raises(TypeError, match="_total: a traced value inside a set or used as a dict key"):
        fx.symbolic_trace(lambda x: _total({x: 1}))
