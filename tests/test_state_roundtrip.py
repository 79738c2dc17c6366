"""A converted model's state travels whole: the grid recorded for float inputs is in the state_dict,
so a twin converted from different calibration data becomes bit-identical after load_state_dict."""

import io

import pytest
import torch
from torch import nn

import lowbit as Q


def converted(calib: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))   # no QuantStub: fed float
    prepared = Q.prepare(model, Q.get_minmax_qconfig())
    prepared(calib)
    return Q.convert(prepared)


def test_input_grid_round_trips_through_state_dict():
    a = converted(torch.randn(64, 8))
    b = converted(torch.randn(64, 8) * 5)                                     # other calibration: other grids
    assert a[0].input_grid is not None and a[0].input_grid != b[0].input_grid
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b[0].input_grid == a[0].input_grid
    x = torch.randn(32, 8) * 2
    ya, yb = a(x), b(x)
    ya, yb = (y.dequantize() if isinstance(y, Q.QTensor) else y for y in (ya, yb))
    assert torch.equal(ya, yb)


def test_no_recorded_grid_means_dynamic_and_survives_a_load():
    q = Q.nn.quantized.Linear(8, 4)
    assert q.input_grid is None and float(q.input_scale) == 0.0
    twin = Q.nn.quantized.Linear(8, 4)
    twin.load_state_dict(q.state_dict())
    assert twin.input_grid is None


def test_bad_input_grid_is_rejected():
    q = Q.nn.quantized.Linear(8, 4)
    with pytest.raises(ValueError, match="scale=0.0 must be positive"):
        q.input_grid = (0.0, 0, Q.quint8)
