"""Session 40: graph-mode ops (adds, mul, cat) as mixed-precision candidates, and a reused layer scored exactly.

``convert_fx`` makes an int8 add a generated ``qfunctional_N`` no module name reaches; the mapping keeps it float
through its call-order key (``set_module_name_object_type_order``). The fast search's row for every candidate (layer,
op, reused layer) must be the score of the model ``prepare_fx`` / ``convert_fx`` builds with it float, and the returned
mapping must build the reported model.
"""

from __future__ import annotations

import copy
import operator
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.debug import auto_mixed_precision
from lowbit.debug.table import SensitivityTable, call_order_name, keep_float
from lowbit.observer import MinMaxObserver

sys.path.insert(0, str(Path(__file__).parent))
from test_mixprec_s39 import _read_through_case  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x))) + x  # operator.add #0 in this block


class _ResNet(nn.Module):
    """A stem, two residual blocks (``features.0``, ``features.1``), a ``mul`` and a ``torch.add`` that the model
    returns, at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.features = nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(_Block(), _Block())
        self.c, self.head = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(self.stem(x))
        g = self.c(h) * h
        return torch.add(self.head(g), g)


def _case():
    model = _ResNet().eval()
    with torch.no_grad():  # one wide output channel of the head: the returned add's grid is coarse
        model.head.weight[0] *= 30
    x = torch.randn(16, 3, 8, 8)
    with torch.no_grad():
        ref = model(x)

    def score(m: nn.Module) -> float:
        with torch.no_grad():
            return -float((m(x) - ref).pow(2).mean())
    return model, x, score


def _built(model, x, score, names, op_keys, qconfig=None):
    mapping = Q.QConfigMapping.from_qconfig(qconfig or Q.get_minmax_qconfig(), None)
    for n in names:
        keep_float(mapping, n, op_keys)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(x,))
        p(x)
        q = Q.convert_fx(p)
        return score(q), q


OPS = {"features.0:operator.add#0": ("features.0", operator.add, 0), "features.1:operator.add#0":
       ("features.1", operator.add, 0), "operator.mul#0": ("", operator.mul, 0), "torch.add#0": ("", torch.add, 0)}


def test_graph_mode_ops_are_fast_search_candidates_scored_as_built():
    """Before: the adds and the mul were no candidates (rows: the 7 convs only), 'head' scored -4.69e-3 where the model
    built with it float scores -1.98e-3 (prepare_fx then keeps the returned add float too: a float island, float input
    and only the output reads it), and the walk kept ['stem', 'features.0.a'] (-4.44e-3). Now it keeps ['head',
    'operator.mul#0'] (-1.09e-3; the exact search ['head', 'stem'], -1.67e-3). Session 44: with 'head' float the mul
    that only it reads is float too (a float reader, ``fx.islands``): 'head' alone scores -1.09e-3, and both searches
    keep ['head', 'stem'] (-8.28e-4)."""
    model, x, score = _case()
    with kernels.use_backend("reference"):
        mapping, fast = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=2, mode="fx",
                                             search="fast", progress=False)
        assert fast.op_keys == OPS
        assert {r.name: r.module_type for r in fast.rows if r.name in OPS} == {
            "features.0:operator.add#0": "add", "features.1:operator.add#0": "add", "torch.add#0": "add",
            "operator.mul#0": "mul"}
        for row in fast.rows:
            assert row.metric == pytest.approx(_built(model, x, score, [row.name], OPS)[0], rel=1e-9), row.name
        rows = {r.name: r.metric for r in fast.rows}
        assert rows["torch.add#0"] > 1.3 * fast.all_quantized_metric  # the returned add on its coarse grid
        built, q = _built(model, x, score, fast.float_layers, OPS)
        assert fast.final_metric == pytest.approx(built, rel=1e-9)
        with torch.no_grad():  # the returned mapping builds the reported model
            p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(x,))
            p(x)
            assert score(Q.convert_fx(p)) == pytest.approx(fast.final_metric, rel=1e-9)
        _, exact = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=2, mode="fx",
                                        progress=False)
    assert fast.float_layers == ["head", "stem"] and exact.float_layers == ["head", "stem"]
    assert fast.final_metric == pytest.approx(exact.final_metric, rel=1e-9)
    assert mapping.module_name_object_type_order_qconfigs == {}  # (the mul follows 'head')
    # the mul and the returned add run in float in the built model, the blocks' adds stay QFunctional
    floats = [n.target for gm in q.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes
              if n.op == "call_function" and n.target in (operator.mul, torch.add, operator.add)]
    assert floats == [operator.mul, torch.add] and sum(type(m).__name__ == "QFunctional" for m in q.modules()) == 2


def test_graph_mode_ops_are_exact_search_candidates():
    """Before: the exact search's rows held the convs only. Alone, an int8 add is a float island (prepare_fx keeps an
    elementwise op float when no int op reads it): its "only this op int8" row is the float model's."""
    model, x, score = _case()
    with kernels.use_backend("reference"):
        mapping, exact = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=12, mode="fx",
                                              progress=False, tolerance=0.0)
    assert exact.op_keys == OPS and set(OPS) <= {r.name for r in exact.rows}
    assert all(r.drop == 0 for r in exact.rows if r.name in OPS)
    for name in exact.float_layers:
        if name in OPS:
            assert mapping.module_name_object_type_order_qconfigs[OPS[name]] is None
    assert exact.to_dict()["op_keys"]["torch.add#0"] == ["", "torch.add", 0]


def test_graph_reused_layer_row_is_the_built_models():
    """A layer called twice ('r'): one float twin on the layer's one (shared-observer) grid served both calls. Its row
    was -2.07e-5 where the model built with 'r' float scores -1.49e-5 (the first call's output stays float, the
    second rounds on the grid of its own outputs); the walk then kept ['a'] (-1.49e-5), now ['a', 'r'] (-7.13e-6);
    session 44 (an add read by a float layer is float too) ['r', 'b'] (-3.06e-6)."""
    model, x, score = _read_through_case()
    with kernels.use_backend("reference"):
        _, fast = auto_mixed_precision(model, Q.get_minmax_qconfig(), x, score, max_float_layers=2, mode="fx",
                                       search="fast", progress=False)
        rows = {r.name: r.metric for r in fast.rows}
        assert rows["r"] == pytest.approx(_built(model, x, score, ["r"], fast.op_keys)[0], rel=1e-9)
        assert rows["operator.add#0"] == pytest.approx(_built(model, x, score, ["operator.add#0"], fast.op_keys)[0],
                                                       rel=1e-9)
        # 'a' and 'r' float: prepare_fx keeps the add between them float too (float input, float reader only),
        # and 'a''s output is rounded for the int8 'b' only
        built, _ = _built(model, x, score, fast.float_layers, fast.op_keys)
    assert sorted(fast.float_layers) == ["b", "r"]
    assert fast.final_metric == pytest.approx(built, rel=1e-9)


def test_a_float_add_matches_torch_ao():
    """prepare_fx honours set_module_name_object_type_order(..., operator.add, i, None): the add runs in float on its
    dequantized inputs and its reader re-quantizes, bit for bit as torch.ao's prepare_fx / convert_fx (7-bit
    activations, oneDNN: no saturation, no add of its own to round differently)."""
    from torch.ao.quantization import MinMaxObserver as AoMinMax
    from torch.ao.quantization import PerChannelMinMaxObserver as AoPerChannel
    from torch.ao.quantization import QConfig as AoQConfig
    from torch.ao.quantization import QConfigMapping as AoMapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert
    from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare

    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.a(x))
            return self.c(self.b(h) + h)

    model, x = Res().eval(), torch.randn(16, 3, 8, 8)
    ao_qc = AoQConfig(activation=AoMinMax.with_args(dtype=torch.quint8, reduce_range=True),
                      weight=AoPerChannel.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    prev = torch.backends.quantized.engine
    torch.backends.quantized.engine = "onednn"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = ao_prepare(copy.deepcopy(model), AoMapping().set_global(ao_qc).set_module_name_object_type_order(
                "", operator.add, 0, None), (x,))
            p(x)
            ref = ao_convert(p)(x)
    finally:
        torch.backends.quantized.engine = prev
    seven = Q.QConfig(activation=MinMaxObserver.with_args(qdtype=Q.quint8.with_range(0, 127)),
                      weight=Q.get_minmax_qconfig().weight)
    mapping = Q.QConfigMapping().set_global(seven).set_module_name_object_type_order("", operator.add, 0, None)
    p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(x,))
    p(x)
    q = Q.convert_fx(p)
    assert [n.target for n in q.graph.nodes if n.op == "call_function"] == [operator.add]
    assert torch.equal(q(x), ref)


def test_call_order_names_and_table_round_trip():
    assert call_order_name(("features.3", operator.add, 0)) == "features.3:operator.add#0"
    assert call_order_name(("", torch.cat, 2)) == "torch.cat#2"
    m = keep_float(Q.QConfigMapping(), "features.3:operator.add#0", {"features.3:operator.add#0": ("features.3",
                                                                                                   operator.add, 0)})
    assert m.module_name_object_type_order_qconfigs == {("features.3", operator.add, 0): None}
    assert keep_float(Q.QConfigMapping(), "fc", {}).module_name_qconfigs == {"fc": None}
    assert SensitivityTable(0.0).to_dict()["op_keys"] == {}
