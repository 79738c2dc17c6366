"""Hostile but valid-looking inputs at the debug tools, the accuracy algorithms and ``quantize_ptq`` (session 24).

Each case ends in a clear error naming the value, or in the documented result — never a silently wrong ranking,
a half-changed caller's model, or an error that blames something the user did not write.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.debug import auto_mixed_precision, compare, sensitivity, sqnr


def _mlp_with_costly_last_layer() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        m[2].weight[0, 0] = 50.0  # one outlier weight: layer '2' costs the output most
    return m, torch.randn(64, 8)


def test_sqnr_metric_with_infinite_baseline_ranks_layers_by_metric_and_meets_its_tolerance():
    m, x = _mlp_with_costly_last_layer()
    ref = m(x).detach()

    def db(mm: nn.Module) -> float:
        return sqnr(ref, mm(x))  # the float model scores inf

    _, table = sensitivity(m, Q.get_minmax_qconfig(), x, db)
    assert math.isinf(table.baseline)
    assert [r.name for r in table.rows] == ["2", "0"], table.rows  # worst (lowest SQNR) first, not module order
    assert table.rows[0].metric < table.rows[1].metric
    for search in ("exact", "fast"):
        _, t = auto_mixed_precision(m, Q.get_minmax_qconfig(), x, db, max_float_layers=1, search=search,
                                    progress=False)
        assert t.float_layers == ["2"], (search, t.float_layers)
    with pytest.warns(UserWarning):  # every layer float: nothing left to quantize
        _, t = sensitivity(m, Q.get_minmax_qconfig(), x, db, tolerance=3.0)
    assert t.final_drop == 0.0 and t.met_tolerance is True  # inf - inf is no drop, not NaN


def test_compare_leaves_out_the_cells_equalization_rescaled():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU6(), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6(),
                      nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        m[0].weight.mul_(torch.logspace(-1.5, 0, 8).view(8, 1, 1, 1))  # channels of very different range
    x = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    q, report = Q.quantize_ptq(m, x, recipe="accurate", iters=1, progress=False)
    assert report.sqnr_db > 35
    assert q.lowbit_report.rescaled == {"0": "output", "2": "weight"}
    rows = {r.name: r for r in compare(m, q, x).rows}
    assert rows["0"].act_sqnr_db is None and rows["0"].weight_sqnr_db is None  # was -10.5 / -16.5 dB
    assert "output rescaled" in rows["0"].compared_with
    assert rows["2"].weight_sqnr_db is None and rows["2"].act_sqnr_db > 30  # its output equals the float one
    assert rows["4"].act_sqnr_db > 35 and rows["4"].weight_sqnr_db > 35  # untouched layers are scored as before
    q2, _ = Q.quantize_ptq(m, x, recipe="accurate", iters=1, equalize=False, progress=False)
    assert q2.lowbit_report.rescaled == {} and all(r.act_sqnr_db is not None for r in compare(m, q2, x).rows)
