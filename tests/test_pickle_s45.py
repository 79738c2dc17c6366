"""Session 45: a converted (or prepared) graph-mode model pickled whole keeps lowbit's graph functions as nodes.

``pickle`` / ``torch.save(model)`` store a ``GraphModule`` as its generated code, and loading re-traces that code.
lowbit's graph functions were ``torch.fx.wrap``'d (a leaf only for calls from the module that registered them) or
not wrapped at all, and a node a pass inserted is a call from the GraphModule's own code: the re-trace ran their
bodies on proxies. Before (each test here failed):

- ``scaled_operand(b, -0.5)`` (``torch.add(a, b, alpha=-0.5)``, ``c - x``) came back as ``b * -0.5``: a float
  ``mul`` on a QTensor, run dequantized with the warning "torch.mul has no integer implementation";
- ``writable_copy`` / ``written`` (in-place writes) came back as ``clone`` and nothing;
- in a prepared model, ``add_relu`` became ``add`` + ``relu`` and ``linear_relu`` / ``conv2d_relu`` became
  ``F.linear`` + ``relu``.

``attention_probs`` / ``attention_context`` / ``attention_weights`` survived (torch.fx wrote ``wrap(...)`` lines
for nodes its own trace wrapped). Now every such function is ``compile_state.graph_leaf``: it records itself as one
node whenever an argument is a proxy. Oracle: the model before pickling (targets and outputs bit for bit).
``copy.deepcopy`` copies the graph (no re-trace) and kept the targets before too; it is checked alongside.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)


class Alpha(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.add(self.a(x), self.b(x), alpha=-0.5)


class Negate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return 0.5 - self.a(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x)[0]


class Inplace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        y[:, :4].mul_(2)
        return self.b(y)


class AddRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return F.relu(self.a(x) + self.b(x))


class FunctionalRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.k = nn.Parameter(torch.randn(8, 8) / 3), nn.Parameter(torch.randn(4, 2, 3, 3) / 4)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        y = self.out(F.relu(F.linear(x, self.w)))
        return F.relu(F.conv2d(y.reshape(-1, 2, 4, 5), self.k, padding=1))


CONVERTED = {  # model -> the lowbit functions its converted graph calls
    "alpha": (Alpha, ["scaled_operand"]),
    "negate": (Negate, ["scaled_operand"]),
    "attention": (Attention, ["attention_probs", "attention_context", "attention_weights"]),
    "inplace": (Inplace, ["writable_copy", "written"]),
}
PREPARED = {"add_relu": (AddRelu, ["add_relu"]), "functional_relu": (FunctionalRelu, ["linear_relu", "conv2d_relu"])}


def _x() -> torch.Tensor:
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))


def _prepared(cls, seed: int = 0) -> fx.GraphModule:
    torch.manual_seed(seed)
    x = _x()
    p = Q.prepare_fx(cls().eval(), Q.get_default_qconfig_mapping(), (x,))
    with torch.no_grad():
        p(x)
        p(2 * x)
    return p


def _converted(cls, seed: int = 0) -> fx.GraphModule:
    return Q.convert_fx(_prepared(cls, seed))


def lowbit_calls(gm: fx.GraphModule) -> list[str]:
    return [f"{n.target.__module__}.{n.target.__name__}" for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("lowbit")]


def _name(t) -> str:
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', t)}"


def targets(gm: fx.GraphModule) -> list[tuple[str, str]]:
    return [(n.op, _name(n.target)) for n in gm.graph.nodes]


def _run(gm: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return gm(_x())


def _reload(gm: nn.Module, how: str) -> nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(gm)
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


_CHILD = r"""
import json, sys, warnings
import torch
warnings.simplefilter("error")  # a warning on load or run fails the child
torch.set_num_threads(1)
out = {}
for path in sys.argv[1:]:
    gm = torch.load(path, weights_only=False)
    with torch.no_grad():
        y = gm(torch.load(path + ".x"))
    calls = [f"{n.target.__module__}.{n.target.__name__}" for n in gm.graph.nodes
             if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("lowbit")]
    torch.save(y, path + ".y")
    name = lambda t: t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', t)}"
    out[path] = {"calls": calls, "targets": [(n.op, name(n.target)) for n in gm.graph.nodes]}
print(json.dumps(out))
"""


def test_torch_save_loads_in_a_fresh_process_with_the_same_lowbit_calls(tmp_path: Path) -> None:
    models, paths = {}, []
    for name, (cls, _) in CONVERTED.items():
        q = _converted(cls)
        path = str(tmp_path / f"{name}.pt")
        torch.save(q, path)
        torch.save(_x(), path + ".x")
        models[path] = q
        paths.append(path)
    src = Path(Q.__file__).parents[1]
    env = {"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _CHILD, *paths], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for path, q in models.items():
        name = Path(path).stem
        assert [c.rpartition(".")[2] for c in report[path]["calls"]] == CONVERTED[name][1], name
        assert report[path]["calls"] == lowbit_calls(q), name
        assert [tuple(t) for t in report[path]["targets"]] == targets(q), name
        assert torch.equal(torch.load(path + ".y"), _run(q)), name


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("name", list(CONVERTED))
def test_converted_model_keeps_its_lowbit_calls(name: str, how: str) -> None:
    cls, expected = CONVERTED[name]
    q = _converted(cls)
    assert [c.rpartition(".")[2] for c in lowbit_calls(q)] == expected
    ref = _run(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = _reload(q, how)
        out = _run(loaded)
    assert lowbit_calls(loaded) == lowbit_calls(q)
    assert targets(loaded) == targets(q)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", list(PREPARED))
def test_prepared_model_keeps_its_fused_functions_through_pickle(name: str) -> None:
    cls, expected = PREPARED[name]
    p = _prepared(cls)
    assert [c.rpartition(".")[2] for c in lowbit_calls(p)] == expected
    loaded = pickle.loads(pickle.dumps(p))
    assert lowbit_calls(loaded) == lowbit_calls(p)
    assert targets(loaded) == targets(p)
    q, q2 = Q.convert_fx(copy.deepcopy(p)), Q.convert_fx(loaded)
    assert targets(q2) == targets(q)
    assert torch.equal(_run(q2), _run(q))


def test_a_loaded_model_compiles_to_the_same_codes() -> None:
    q = _reload(_converted(Alpha), "pickle")
    compiled = torch.compile(q, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(_x()), _run(q))


def test_state_dict_with_weights_only_is_unchanged() -> None:
    q = _converted(Alpha)
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = _converted(Alpha, seed=1)
    assert not torch.equal(_run(fresh), _run(q))
    fresh.load_state_dict(state)
    assert torch.equal(_run(fresh), _run(q))


def test_graph_leaf_is_one_node_also_for_a_proxy_inside_a_tuple() -> None:
    from lowbit.compile_state import graph_leaf  # (new in session 45)

    @graph_leaf
    def first(pair, scale=1.0):
        return pair[0] * scale

    gm = fx.symbolic_trace(lambda x: first((x, x), scale=2.0) + first([x + 1]))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is first]
    assert len(calls) == 2
    assert calls[0].kwargs == {"scale": 2.0}
    assert gm(torch.ones(2)).tolist() == [4.0, 4.0]
    assert first((torch.ones(1),), scale=3.0).tolist() == [3.0]
