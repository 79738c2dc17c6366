"""torch.ao's one-line workflows and recipe helpers: quantize / quantize_qat, quantize_dynamic by name,
chained with_args, qconfig_equals — each against torch.ao on the same model and inputs."""

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit import kernels
from lowbit.quantize_api import quantize, quantize_qat


class Net(nn.Module):
    """quant → conv-relu → flatten → linear-relu → linear → dequant; ``torch_ao=True`` uses torch.ao's stubs."""

    def __init__(self, torch_ao: bool = False):
        super().__init__()
        self.quant = tq.QuantStub() if torch_ao else Q.QuantStub()
        self.dequant = tq.DeQuantStub() if torch_ao else Q.DeQuantStub()
        self.conv, self.relu1 = nn.Conv2d(2, 4, 3), nn.ReLU()
        self.fc1, self.relu2, self.fc2 = nn.Linear(4 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 5)

    def forward(self, x):
        x = self.relu1(self.conv(self.quant(x))).flatten(1)
        return self.dequant(self.fc2(self.relu2(self.fc1(x))))


def _pair():
    torch.manual_seed(0)
    ours, theirs = Net(), Net(torch_ao=True)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 2, 6, 6, generator=g) for _ in range(n)]


def _calibrate(model, batches):
    with torch.no_grad():
        for x in batches:
            model(x)


TORCH_MINMAX = tq.QConfig(
    activation=tq.MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False),
    weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def test_quantize_matches_torch_ao_and_leaves_the_model():
    ours, theirs = _pair()
    ours.qconfig, theirs.qconfig = Q.get_minmax_qconfig(), TORCH_MINMAX
    engine, torch.backends.quantized.engine = torch.backends.quantized.engine, "qnnpack"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tqm = tq.quantize(theirs, _calibrate, [_batches()])
        x = _batches(4)[3]
        ref = tqm(x)
    finally:
        torch.backends.quantized.engine = engine
    qm = quantize(ours, _calibrate, [_batches()])
    assert type(ours.fc1) is nn.Linear and ours.fc1._forward_hooks == {}  # inplace=False: untouched
    assert type(qm.fc1).__module__ == "lowbit.nn.quantized.linear" and not qm.training
    assert float(qm.fc2.scale) == pytest.approx(float(tqm.fc2.scale), rel=1e-6)
    assert int(qm.fc2.zero_point) == int(tqm.fc2.zero_point)
    with kernels.use_backend("reference"):
        y = qm(x)
    # qnnpack is torch.ao's exact engine: outputs within a couple of output quanta (requantize rounding)
    assert (y - ref).abs().max() <= 2.01 * float(tqm.fc2.scale)
    # inplace=True converts the given model (the return value is the model to use)
    same = quantize(ours, _calibrate, [_batches()], inplace=True)
    assert same is ours and type(ours.fc1) is type(qm.fc1)


def test_quantize_mapping_and_bad_arguments():
    ours, _ = _pair()
    ours.qconfig = Q.get_minmax_qconfig()
    mapping = Q.get_default_static_quant_module_mappings()
    del mapping[nn.Linear]
    qm = quantize(ours, _calibrate, [_batches(1)], mapping=mapping)
    assert type(qm.fc1) is nn.Linear and type(qm.conv).__module__ == "lowbit.nn.quantized.conv"
    with pytest.raises(TypeError, match="run_args"):
        quantize(ours, _calibrate, _batches(1)[0])
    with pytest.raises(TypeError, match="run_fn"):
        quantize(ours, None, [])
    with pytest.raises(TypeError, match="quantize_qat: model"):
        quantize_qat("net", _calibrate, [])


def _train(model, batches, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(steps):
        x = batches[i % len(batches)]
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_quantize_qat_matches_torch_ao():
    ours, theirs = _pair()
    ours.qconfig = Q.QConfig(
        Q.FakeQuantize.with_args(observer=Q.MovingAverageMinMaxObserver, qdtype=Q.quint8),
        Q.FakeQuantize.with_args(observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0,
                                 qscheme=Q.per_channel_symmetric, qdtype=Q.qint8))
    theirs.qconfig = tq.QConfig(
        tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                  dtype=torch.quint8, reduce_range=False),
        tq.FakeQuantize.with_args(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                  dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0))
    engine, torch.backends.quantized.engine = torch.backends.quantized.engine, "qnnpack"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(3)
            tqm = tq.quantize_qat(theirs, _train, [_batches(), 6])
        x = _batches(4)[3]
        ref = tqm(x)
    finally:
        torch.backends.quantized.engine = engine
    torch.manual_seed(3)
    qm = quantize_qat(ours, _train, [_batches(), 6])
    assert ours.training and type(ours.fc1) is nn.Linear  # inplace=False
    assert not qm.training
    # the same training trajectory: trained weights agree (fake-quant forward and STE backward alike)
    tw = tqm.fc1.weight().dequantize()
    assert (qm.fc1.weight().dequantize() - tw).abs().max() <= 1.01 * float(tqm.fc1.weight().q_per_channel_scales().max())
    assert float(qm.fc2.scale) == pytest.approx(float(tqm.fc2.scale), rel=5e-3)  # float-order drift over 6 steps
    with kernels.use_backend("reference"):
        y = qm(x)
    assert (y - ref).abs().max() <= 2.01 * float(tqm.fc2.scale)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.lstm = nn.LSTM(3, 3)

    def forward(self, x):
        return self.lstm(self.head(self.encoder(x)).unsqueeze(0))[0][0]


def _dynamic_paths(model):
    """Paths of the outermost dynamic quantized modules (not their internals)."""
    paths = sorted(n for n, m in model.named_modules() if ".dynamic" in type(m).__module__)
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths)]


@pytest.mark.parametrize("spec", [{"encoder"}, {"head", "encoder.2"}, {"encoder.0", nn.LSTM}, {"nothing.here"}])
def test_quantize_dynamic_by_name_swaps_what_torch_ao_swaps(spec):
    torch.manual_seed(0)
    m = Nested().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tq.quantize_dynamic(m, spec)
        ours = Q.quantize_dynamic(m, spec)
    assert _dynamic_paths(ours) == _dynamic_paths(theirs)
    x = torch.randn(4, 8)
    torch.testing.assert_close(ours(x), m(x), atol=0.05, rtol=0)


def test_quantize_dynamic_name_dict_with_qconfigs():
    torch.manual_seed(0)
    m = Nested().eval()
    q = Q.quantize_dynamic(m, {"encoder": Q.get_dynamic_qconfig(), "encoder.2": None,
                               "head": Q.get_dynamic_qconfig(torch.float16)})
    assert _dynamic_paths(q) == ["encoder.0", "head"]
    torch.testing.assert_close(q(torch.ones(2, 8)), m(torch.ones(2, 8)), atol=0.05, rtol=0)
    with pytest.raises(TypeError, match="module types or module names"):
        Q.quantize_dynamic(m, {3})


def test_chained_with_args_later_kwargs_win_as_torch_ao():
    x = torch.randn(64) * 3 + 1
    ours = Q.MinMaxObserver.with_args(qdtype=Q.qint8).with_args(qdtype=Q.quint8)()
    theirs = tq.MinMaxObserver.with_args(dtype=torch.qint8).with_args(dtype=torch.quint8)()
    ours(x), theirs(x)
    (s, z), (ts, tz) = ours.calculate_qparams(), theirs.calculate_qparams()
    assert ours.qdtype == Q.quint8 and theirs.dtype == torch.quint8
    torch.testing.assert_close(s.reshape(1), ts, rtol=1e-6, atol=0)
    assert int(z) == int(tz)
    fq = Q.FakeQuantize.with_args(observer=Q.MinMaxObserver).with_args(qdtype=Q.qint8).with_args(
        observer=Q.MovingAverageMinMaxObserver)()
    assert type(fq.activation_post_process) is Q.MovingAverageMinMaxObserver and fq.qdtype == Q.qint8
    qc = Q.QConfig(fq_f := Q.FakeQuantize.with_args().with_args(qdtype=Q.qint8), fq_f)  # still a valid recipe
    assert "qdtype=qint8" in repr(qc)
    import pickle
    assert pickle.loads(pickle.dumps(fq_f)).keywords == {"qdtype": Q.qint8}


def _torch_ao_and_ours(case):
    """The same pair of recipes built twice, in torch.ao and in lowbit."""
    if case == "same_args":
        return ((tq.QConfig(tq.MinMaxObserver.with_args(dtype=torch.quint8), tq.MinMaxObserver.with_args(dtype=torch.qint8)),
                 tq.QConfig(tq.MinMaxObserver.with_args(dtype=torch.quint8), tq.MinMaxObserver.with_args(dtype=torch.qint8))),
                (Q.QConfig(Q.MinMaxObserver.with_args(qdtype=Q.quint8), Q.MinMaxObserver.with_args(qdtype=Q.qint8)),
                 Q.QConfig(Q.MinMaxObserver.with_args(qdtype=Q.quint8), Q.MinMaxObserver.with_args(qdtype=Q.qint8))))
    if case == "other_args":
        return ((tq.QConfig(tq.MinMaxObserver.with_args(dtype=torch.quint8), tq.MinMaxObserver),
                 tq.QConfig(tq.MinMaxObserver.with_args(dtype=torch.qint8), tq.MinMaxObserver)),
                (Q.QConfig(Q.MinMaxObserver.with_args(qdtype=Q.quint8), Q.MinMaxObserver),
                 Q.QConfig(Q.MinMaxObserver.with_args(qdtype=Q.qint8), Q.MinMaxObserver)))
    if case == "nested_observer":
        return ((tq.QConfig(tq.FakeQuantize.with_args(observer=tq.MinMaxObserver.with_args(dtype=torch.quint8)),
                            tq.MinMaxObserver),
                 tq.QConfig(tq.FakeQuantize.with_args(observer=tq.MinMaxObserver.with_args(dtype=torch.quint8)),
                            tq.MinMaxObserver)),
                (Q.QConfig(Q.FakeQuantize.with_args(observer=Q.MinMaxObserver.with_args(qdtype=Q.quint8)),
                           Q.MinMaxObserver),
                 Q.QConfig(Q.FakeQuantize.with_args(observer=Q.MinMaxObserver.with_args(qdtype=Q.quint8)),
                           Q.MinMaxObserver)))
    if case == "other_class":
        return ((tq.QConfig(tq.MinMaxObserver, tq.MinMaxObserver), tq.QConfig(tq.HistogramObserver, tq.MinMaxObserver)),
                (Q.QConfig(Q.MinMaxObserver, Q.MinMaxObserver), Q.QConfig(Q.HistogramObserver, Q.MinMaxObserver)))
    if case == "none":
        return (tq.default_qconfig, None), (Q.get_minmax_qconfig(), None)
    return (None, None), (None, None)


@pytest.mark.parametrize("case", ["same_args", "other_args", "nested_observer", "other_class", "none", "both_none"])
def test_qconfig_equals_agrees_with_torch_ao(case):
    (t1, t2), (o1, o2) = _torch_ao_and_ours(case)
    assert Q.qconfig_equals(o1, o2) == tq.qconfig_equals(t1, t2)
    assert Q.qconfig_equals(o2, o1) == tq.qconfig_equals(t2, t1)


def test_qconfig_equals_chained_and_errors():
    a = Q.QConfig(Q.MinMaxObserver.with_args(qdtype=Q.qint8).with_args(eps=1e-5), Q.MinMaxObserver)
    b = Q.QConfig(Q.MinMaxObserver.with_args(eps=1e-5, qdtype=Q.qint8), Q.MinMaxObserver)
    assert Q.qconfig_equals(a, b) and Q.qconfig_equals(Q.get_default_qconfig(), Q.get_default_qconfig())
    assert not Q.qconfig_equals(Q.get_default_qconfig(), Q.get_default_qat_qconfig())
    assert Q.qconfig_equals(copy.deepcopy(a), a)
    with pytest.raises(TypeError, match="qconfig_equals"):
        Q.qconfig_equals(a, tq.default_qconfig)


def test_with_callable_args_evaluated_per_call_as_torch_ao():
    seq, tseq = iter([1e-4, 2e-4, 3e-4]), iter([1e-4, 2e-4, 3e-4])
    ours = Q.MinMaxObserver.with_args(qdtype=Q.qint8, eps=0.5).with_callable_args(eps=lambda: next(seq))
    theirs = tq.MinMaxObserver.with_args(dtype=torch.qint8, eps=0.5).with_callable_args(eps=lambda: next(tseq))
    got = [(ours().eps, float(theirs().eps)) for _ in range(2)]
    assert [a for a, _ in got] == pytest.approx([b for _, b in got]) == [1e-4, 2e-4]  # callable beats with_args
    assert ours(eps=0.25).eps == 0.25 and float(theirs(eps=0.25).eps) == 0.25         # the call beats both
    chained = ours.with_args(qdtype=Q.quint8)                                          # chaining keeps them
    assert chained().qdtype == Q.quint8 and chained.callable_args == ours.callable_args
    qc = Q.QConfig(Q.FixedQParamsObserver.with_callable_args(scale=lambda: 0.1, zero_point=lambda: 3), Q.MinMaxObserver)
    assert qc.activation().calculate_qparams()[1] == 3 and "with_callable_args(scale=" in repr(qc)
    assert Q.qconfig_equals(Q.QConfig(ours, Q.MinMaxObserver), Q.QConfig(ours.with_args(), Q.MinMaxObserver))
    with pytest.raises(TypeError, match="zero-arg callable"):
        Q.MinMaxObserver.with_callable_args(eps=0.1)
