"""float16 dynamic quantization through the qconfig route: ``get_dynamic_qconfig(torch.float16)`` builds the
same modules as ``quantize_dynamic(dtype=torch.float16)``; oracle: torch.ao's float16 dynamic modules."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.ao.nn.quantized.dynamic as tnnqd
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q
from lowbit.nn.quantized import dynamic as nnqd
from lowbit.observer import PlaceholderObserver

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.lstm = nn.Linear(8, 16), nn.LSTM(16, 12, 2, batch_first=True)
        self.gru, self.head = nn.GRU(12, 6), nn.Linear(6, 3)

    def forward(self, x):
        y, _ = self.lstm(self.fc(x))
        y, _ = self.gru(y)
        return self.head(y)


@pytest.fixture(scope="module")
def model_and_input():
    torch.manual_seed(0)
    return Model().eval(), torch.randn(4, 5, 8)


F16 = Q.get_dynamic_qconfig(torch.float16)
ROUTES = {
    "mapping": lambda m: Q.quantize_dynamic(m, Q.QConfigMapping().set_global(F16)),
    "qconfig": lambda m: Q.quantize_dynamic(m, F16),
    "dict": lambda m: Q.quantize_dynamic(m, {nn.Linear: F16, nn.LSTM: F16, nn.GRU: F16}),
}


def test_float16_qconfig_is_torchs_float16_dynamic_qconfig():
    act, w = F16.activation(), F16.weight()
    ref_act, ref_w = tq.float16_dynamic_qconfig.activation(), tq.float16_dynamic_qconfig.weight()
    assert isinstance(act, PlaceholderObserver) and isinstance(w, PlaceholderObserver)
    assert (act.qdtype, act.is_dynamic, w.qdtype, w.is_dynamic) == (ref_act.dtype, ref_act.is_dynamic, ref_w.dtype, False)
    assert "float16" in repr(F16)
    with pytest.raises(RuntimeError, match="no statistics"):
        w.calculate_qparams()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_qconfig_route_equals_dtype_route(model_and_input, route):
    m, x = model_and_input
    by_dtype, by_qconfig = Q.quantize_dynamic(m, dtype=torch.float16), ROUTES[route](m)
    kinds = [type(by_qconfig.fc), type(by_qconfig.lstm), type(by_qconfig.gru), type(by_qconfig.head)]
    assert kinds == [nnqd.Linear, nnqd.LSTM, nnqd.GRU, nnqd.Linear]
    assert by_qconfig.fc.weight().dtype == torch.float16 and by_qconfig.lstm.dtype == torch.float16
    assert by_qconfig.state_dict().keys() == by_dtype.state_dict().keys()
    for k, v in by_dtype.state_dict().items():
        assert torch.equal(v, by_qconfig.state_dict()[k]), k
    assert torch.equal(by_qconfig(x), by_dtype(x))
    assert type(m.fc) is nn.Linear  # not in place


def test_close_to_torch_float16_dynamic_modules(model_and_input):
    m, x = model_and_input
    ours = ROUTES["mapping"](m)
    ref = tq.quantize_dynamic(m, {nn.Linear, nn.LSTM, nn.GRU}, dtype=torch.float16)
    assert type(ref.fc) is tnnqd.Linear
    with torch.no_grad():
        assert torch.allclose(ours.fc(x), ref.fc(x), atol=1e-6, rtol=0)  # same float16 weights, float32 math
        assert torch.allclose(ours(x), ref(x), atol=1e-5, rtol=0)
        assert (ours(x) - m(x)).abs().max() < 1e-2  # float16 weight rounding only


def test_mapping_mixes_float16_and_int8(model_and_input):
    m, x = model_and_input
    mapping = (Q.QConfigMapping().set_global(Q.get_dynamic_qconfig()).set_object_type(nn.LSTM, F16)
               .set_module_name("head", None).set_module_name_regex("g.u", F16))
    q = Q.quantize_dynamic(m, mapping)
    assert q.fc.weight().qdtype == Q.qint8 and q.lstm.dtype == torch.float16 and q.gru.dtype == torch.float16
    assert type(q.head) is nn.Linear
    assert (q(x) - m(x)).norm() / m(x).norm() < 0.05


def test_bad_input_is_named():
    for bad in (Q.quint8, torch.bfloat16, "int7"):
        with pytest.raises((ValueError, TypeError), match="dtype"):
            Q.get_dynamic_qconfig(bad)
    with pytest.raises(TypeError, match="QConfigMapping"):
        Q.quantize_dynamic(Model(), qconfig_spec="Linear")
    bad_weight = Q.QConfig(PlaceholderObserver.with_args(qdtype=torch.float16, is_dynamic=True),
                           PlaceholderObserver.with_args(qdtype=Q.quint8))
    with pytest.raises(ValueError, match=r"module 'fc' \(Linear\).*dtype=lowbit.quint8"):
        Q.quantize_dynamic(Model(), Q.QConfigMapping().set_global(bad_weight))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PlaceholderObserver(qdtype="float16").qdtype == torch.float16
