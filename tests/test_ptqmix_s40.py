"""Session 40: ``quantize_ptq(max_float_layers=N)`` on ``auto_mixed_precision(search="fast")``'s candidates and rows.

Graph-mode adds / muls / cats are candidates (named ``"module:function#index"``, ``report.op_keys`` their call-order
keys), a reused layer gets one float twin per call on that call's own grid, and the returned model is the one the
report scores: its SQNR on the first calibration batch equals the report's and the one of the model ``prepare_fx`` /
``convert_fx`` build with the reported layers and ops float (default recipe: no rounding, the same grids). The
returned model holds plain modules (no search gates, no call alias of an int8 layer), exports to ONNX and
``torch.export``s.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import lowbit as Q
from lowbit import kernels
from lowbit.debug import auto_mixed_precision
from lowbit.debug.float_swap import keep_float_layers
from lowbit.debug.float_swap import _FloatTwin
from lowbit.debug.graph_swap import _Gate, _OpTwin
from lowbit.debug.table import keep_float
from lowbit.ptq import _sqnr

sys.path.insert(0, str(Path(__file__).parent))
from test_mixprec_s39 import _read_through_case  # noqa: E402
from test_mixprec_s40 import _case  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    before = torch.get_num_threads()  # (restored after the test: tests/conftest.py's state guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


def _ptq(model, x, n):
    with kernels.use_backend("reference"):
        return Q.quantize_ptq(model, [x], recipe="default", max_float_layers=n, progress=False)


def _built(model, x, names, op_keys):
    """First-batch SQNR of the model prepare_fx / convert_fx build with ``names`` float (the recipe's mapping)."""
    mapping = Q.get_default_qconfig_mapping()
    for n in names:
        keep_float(mapping, n, op_keys)
    with warnings.catch_warnings(), torch.no_grad(), kernels.use_backend("reference"):
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(model), mapping, example_inputs=(x,))
        p(x)
        return _sqnr(model(x), Q.convert_fx(p)(x))


def _returned(model, q, x):
    with torch.no_grad(), kernels.use_backend("reference"):
        return _sqnr(model(x), q(x))


def test_ops_are_candidates_and_the_report_is_the_returned_and_built_model():
    """Before: no op was a candidate; the walk ranked 7 layers and kept ['stem'] (25.98 -> 26.08 dB, budget 2: the head
    twin rounded onto its grid where the model built with it float feeds the returned add float). Now 11 candidates;
    it keeps ['head', 'operator.mul#0'] (31.86 dB), as auto_mixed_precision's fast search on the same mapping does,
    and prepare_fx keeps the returned add float too (a float island). Session 44: the mul, read only by 'head', is
    float with it (``fx.islands``): ['head', 'stem'] (33.03 dB)."""
    model, x, _ = _case()
    q, report = _ptq(model, x, 2)
    assert report.float_layers == ["head", "stem"]
    assert report.op_keys == {}
    assert "(7 layers, 4 ops)" in report.steps[-1][1]
    assert report.sqnr_db == pytest.approx(_returned(model, q, x), rel=1e-9)
    assert report.sqnr_db == pytest.approx(_built(model, x, report.float_layers, report.op_keys), rel=1e-9)
    assert report.sqnr_db > 32.5
    ref = model(x).detach()
    with kernels.use_backend("reference"):
        _, table = auto_mixed_precision(model, Q.get_default_qconfig_mapping(), [x], lambda m: _sqnr(ref, m(x)),
                                        max_float_layers=2, mode="fx", search="fast", progress=False)
    assert table.float_layers == report.float_layers and table.final_metric == pytest.approx(report.sqnr_db, rel=1e-9)
    ops = {type(m) for m in q.modules()}
    assert _OpTwin in ops and _Gate not in ops          # the mul and the returned add float, the gates settled


@pytest.mark.parametrize("n, names", [(1, ["r"]), (3, ["r", "head", "b"])])
def test_reused_layer_one_twin_per_call_exact(n, names):
    """A layer called twice ('r'): before, one float twin on the layer's shared grid served both calls and 'r' ranked
    below 'head' (budget 1: ['head'] 20.14 dB; budget 3: ['head'] only, the walk stopped). Now each call has its own
    twin on its own grid, 'r' ranks first: 20.51 dB, and ['r', 'head', 'b'] 26.93 dB, the built model's."""
    model, x, _ = _read_through_case()
    q, report = _ptq(model, x, n)
    assert report.float_layers == names and report.op_keys == {}
    assert report.sqnr_db == pytest.approx(_returned(model, q, x), rel=1e-9)
    assert report.sqnr_db == pytest.approx(_built(model, x, names, {}), rel=1e-9)
    first, second = q.get_submodule("r"), q.get_submodule("r__call1")
    assert isinstance(first, _FloatTwin) and isinstance(second, _FloatTwin) and first is not second
    assert first.float_mod is not second.float_mod
    if n == 3:
        assert report.sqnr_db > 26.5


def test_reused_int8_layer_keeps_one_module():
    """A reused layer that stays int8: its call alias is pointed back at the module (one set of state_dict keys, the
    plain converted model's), and no gate is left in the graph."""
    model, x, _ = _read_through_case()
    with warnings.catch_warnings(), torch.no_grad(), kernels.use_backend("reference"):
        warnings.simplefilter("ignore")
        prepared = Q.prepare_fx(copy.deepcopy(model), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        from lowbit.debug.graph_swap import record_call_outputs

        calls, handles = record_call_outputs(prepared)
        prepared(x)
        for h in handles:
            h.remove()
        plain = Q.convert_fx(copy.deepcopy(prepared))
        q = Q.convert_fx(copy.deepcopy(prepared))
        table = keep_float_layers(model, prepared, q, lambda m: float(isinstance(m.get_submodule("head"), _FloatTwin)),
                                  1, progress=False, call_outputs=calls)
        assert table.float_layers == ["head"] and "r" in {r.name for r in table.rows}
        assert set(q.state_dict()) == {k for k in plain.state_dict() if not k.startswith("head.")} | {
            "head.float_mod.weight", "head.float_mod.bias", "head.requant.scale", "head.requant.zero_point"}
        assert [n.target for n in q.graph.nodes if n.op == "call_module" and "r" == n.target] == ["r", "r"]
        assert not any(isinstance(m, _Gate) for m in q.modules())
        assert torch.equal(q.get_submodule("r").weight_int8, plain.get_submodule("r").weight_int8)


def test_keep_float_layers_checks_call_outputs():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"call_outputs=list must be None"):
        keep_float_layers(model, model, model, lambda m: 0.0, 1, call_outputs=[1])


def test_float_add_returned_model_exports():
    """The returned model with the mul and the returned add float: ONNX (ORT equals the export twin's simulation), and
    torch.export gives the eager output bit for bit."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx_helpers import ort_ops

    from lowbit.export import to_onnx
    from lowbit.export.twin import build_twin

    model, x, _ = _case()
    q, report = _ptq(model, x, 1)  # (session 44: budget 2 adds the float stem, whose ORT conv is off in the last bits)
    assert report.float_layers == ["head"]  # the mul, only 'head' reads it, is float with it
    adds = [m for m in q.modules() if isinstance(m, _OpTwin)]
    assert len(adds) == 2
    tmp = Path(__import__("tempfile").mkdtemp())
    path = to_onnx(q, (x[:2],), tmp / "m.onnx")
    got, ops = ort_ops(path, x, tmp)
    with torch.no_grad(), kernels.use_backend("reference"):
        sim = build_twin(q, (x,))(x)
    assert float((got - sim).norm() / sim.norm()) < 1e-4
    assert {"Add", "Mul"} <= ops and "QLinearConv" in ops  # the float ops run in float, the convs on int8 kernels
    with torch.no_grad():
        ep = torch.export.export(q, (x,))
        assert torch.equal(ep.module()(x), q(x))


def test_reused_layer_float_exports_with_a_grid_per_call():
    """Before, budget 1 kept 'head' and left the reused 'r' int8: to_onnx refused it ('r' called on inputs with
    different grids). Now 'r' float, one twin per call, each with its own output grid: the file exports."""
    pytest.importorskip("onnxruntime")
    from onnx_helpers import ort_ops

    from lowbit.export import to_onnx
    from lowbit.export.twin import build_twin

    model, x, _ = _read_through_case()
    q, report = _ptq(model, x, 1)
    assert report.float_layers == ["r"]
    grids = {q.get_submodule(p).grid for p in ("r", "r__call1")}
    assert len(grids) == 2
    tmp = Path(__import__("tempfile").mkdtemp())
    got, _ = ort_ops(to_onnx(q, (x[:2],), tmp / "m.onnx"), x, tmp)
    with torch.no_grad(), kernels.use_backend("reference"):
        sim = build_twin(q, (x,))(x)
    assert float((got - sim).norm() / sim.norm()) < 1e-4
    with torch.no_grad():
        assert torch.equal(torch.export.export(q, (x,)).module()(x), q(x))


def test_graph_modules_only_lose_the_search_machinery():
    """The returned graphs call no gate and no alias of an int8 module (before: nothing to settle; a regression guard
    for settle on a model with both a float reused layer and an int8 one)."""
    model, x, _ = _read_through_case()
    q, _ = _ptq(model, x, 3)
    targets = [n.target for gm in q.modules() if isinstance(gm, fx.GraphModule) for n in gm.graph.nodes
               if n.op == "call_module"]
    assert not any("gate" in t for t in targets) and targets.count("r__call1") == 1
