"""Session 47 (fx47): ``torch.fx.symbolic_trace`` of lowbit models, and ``graph_leaf``'s blind spots.

- torch.fx's default tracer keeps only ``torch.nn`` / ``torch.ao.nn`` modules whole: it ran the ``forward`` of
  lowbit's observers, stubs and quantized modules on proxies, and every prepared / converted model failed to re-trace
  (``Quantize expects a float tensor or a QTensor, got Proxy``). ``compile_state.FxLeaf`` makes each lowbit module
  one ``call_module`` node in any tracer; ``leaf_method`` does so for ``QFunctional.add`` & co. (eager models).
  Oracle: torch.ao's converted models re-trace with the default tracer (its prepared static models do not: its
  HistogramObserver branches on a traced value).
- ``graph_leaf`` did not see a proxy inside a ``slice``, a ``set`` or a dict key (the body ran at trace time).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from lowbit.compile_state import graph_leaf


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
