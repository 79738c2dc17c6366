"""torch.ao surface, part 6: observer state dicts, RecordingObserver, FixedQParamsFakeQuantize, the fused
fake-quant function and the dynamic QAT Linear — parity with torch.ao on the same inputs."""

import warnings

import pytest
import torch
import torch.ao.nn.qat.dynamic as tnnqatd
import torch.ao.quantization as tq
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
import lowbit.nn.qat.dynamic as nnqatd
import lowbit.nn.quantized.dynamic as nnqd

torch.set_num_threads(1)


def stub_net():
    return nn.Sequential(Q.QuantStub(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), Q.DeQuantStub())


def torch_stub_net(model):
    t = nn.Sequential(tq.QuantStub(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), tq.DeQuantStub())
    t.load_state_dict(model.state_dict(), strict=False)
    return t


# ---- get_observer_state_dict / load_observer_state_dict ----
def test_observer_state_dict_matches_torch_ao_statistics_and_round_trips():
    torch.manual_seed(0)
    model, xs = stub_net().eval(), [torch.randn(8, 6) * (i + 1) for i in range(3)]
    ours = Q.prepare(model, Q.get_minmax_qconfig())
    theirs = torch_stub_net(model).eval()
    theirs.qconfig = tq.QConfig(activation=tq.MinMaxObserver, weight=tq.default_per_channel_weight_observer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tq.prepare(theirs)
    for x in xs:
        ours(x), theirs(x)
    sd, tsd = Q.get_observer_state_dict(ours), tq.get_observer_state_dict(theirs)
    common = [k for k in tsd if k.endswith(("min_val", "max_val"))]
    assert len(common) == 6  # QuantStub and the two Linears: min_val and max_val each
    for k in common:
        assert torch.equal(sd[k], tsd[k]), k
    fresh = Q.prepare(model, Q.get_minmax_qconfig())
    Q.load_observer_state_dict(fresh, sd)
    a, b = Q.convert(ours), Q.convert(fresh)
    x = torch.randn(4, 6)
    assert torch.equal(a(x), b(x))


def test_observer_state_dict_qat_weight_fake_quant_and_per_channel_shapes():
    torch.manual_seed(1)
    model = stub_net()
    qat = Q.prepare_qat(model)
    qat(torch.randn(8, 6))
    sd = Q.get_observer_state_dict(qat)
    assert any(k.startswith("1.weight_fake_quant.") for k in sd)
    fresh = Q.prepare_qat(model)
    Q.load_observer_state_dict(fresh, sd)  # (C,) per-channel buffers adopted from the checkpoint
    assert torch.equal(fresh[1].weight_fake_quant.scale, qat[1].weight_fake_quant.scale)


def test_load_observer_state_dict_errors_name_the_keys():
    model = stub_net()
    prepared = Q.prepare(model, Q.get_minmax_qconfig())
    prepared(torch.randn(2, 6))
    sd = Q.get_observer_state_dict(prepared)
    with pytest.raises(RuntimeError, match="no saved statistics.*1.activation_post_process.min_val"):
        Q.load_observer_state_dict(Q.prepare(model, Q.get_minmax_qconfig()),
                                   {k: v for k, v in sd.items() if k != "1.activation_post_process.min_val"})
    with pytest.raises(RuntimeError, match=r"keys \['bogus.min_val'\] name no observer"):
        Q.load_observer_state_dict(Q.prepare(model, Q.get_minmax_qconfig()), {**sd, "bogus.min_val": torch.ones(())})
    with pytest.raises(TypeError, match="obs_dict"):
        Q.load_observer_state_dict(prepared, [1])


# ---- RecordingObserver / get_observer_dict ----
def test_recording_observer_and_observer_dict_match_torch_ao():
    x = [torch.randn(3, 6), torch.randn(2, 6)]
    rec, trec = Q.RecordingObserver(), tq.RecordingObserver()
    for t in x:
        assert rec(t) is t
        trec(t)
    assert all(torch.equal(a, b) for a, b in zip(rec.get_tensor_value(), trec.get_tensor_value()))
    with pytest.raises(RuntimeError, match="no qparams"):
        rec.calculate_qparams()
    prepared = Q.prepare(stub_net(), Q.get_minmax_qconfig())
    d = {}
    Q.get_observer_dict(prepared, d)
    theirs = torch_stub_net(stub_net())
    theirs.qconfig = tq.default_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tq.prepare(theirs)
    td = {}
    from torch.ao.quantization.quantize import _get_observer_dict
    _get_observer_dict(theirs, td)
    assert set(td) <= set(d)
    assert all(isinstance(v, Q.ObserverBase) for v in d.values())


# ---- FixedQParamsFakeQuantize ----
@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-3, 3, width=32), min_size=1, max_size=40),
       st.sampled_from([(1.0 / 256, 0, Q.quint8), (2.0 / 256, 128, Q.quint8), (1.0 / 256, -128, Q.qint8)]))
def test_fixed_qparams_fake_quantize_matches_torch_ao(values, grid):
    scale, zp, qdtype = grid
    ours = Q.FixedQParamsFakeQuantize(Q.FixedQParamsObserver.with_args(scale=scale, zero_point=zp, qdtype=qdtype))
    theirs = tq.FixedQParamsFakeQuantize(tq.FixedQParamsObserver.with_args(
        scale=scale, zero_point=zp, dtype=qdtype.torch_dtype, quant_min=qdtype.quant_min, quant_max=qdtype.quant_max))
    x = torch.tensor(values)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    assert torch.equal(ya, yb)
    ya.sum().backward(), yb.sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    s, z = ours.calculate_qparams()
    ts, tz = theirs.calculate_qparams()
    assert s.item() == ts.item() and z.item() == tz.item()


def test_fixed_qparams_fake_quantize_rejects_a_statistics_observer():
    with pytest.raises(TypeError, match="needs a FixedQParamsObserver"):
        Q.FixedQParamsFakeQuantize(Q.MinMaxObserver)


# ---- fused_moving_avg_obs_fake_quant ----
@pytest.mark.parametrize("per_row,symmetric,qrange", [(False, False, (0, 255)), (False, True, (-128, 127)),
                                                      (True, True, (-128, 127)), (True, False, (0, 255))])
def test_fused_moving_avg_obs_fake_quant_function_matches_torch(per_row, symmetric, qrange):
    torch.manual_seed(2)
    shape = (4,) if per_row else (1,)
    bufs = [torch.full(shape, float("inf")), torch.full(shape, float("-inf")), torch.ones(shape),
            torch.zeros(shape, dtype=torch.int32)]
    tbufs = [b.clone() for b in bufs]
    on = torch.tensor([1], dtype=torch.long)
    for i, fq_on in enumerate([1, 1, 0, 1]):
        x = torch.randn(4, 7) * (i + 1) + i
        fq = torch.tensor([fq_on], dtype=torch.long)
        ya = Q.fused_moving_avg_obs_fake_quant(x, on, fq, *bufs, 0.3, *qrange, 0, per_row, symmetric)
        yb = torch.fused_moving_avg_obs_fake_quant(x, on, fq, *tbufs, 0.3, *qrange, 0, per_row, symmetric)
        assert torch.equal(ya, yb), i
        for a, b in zip(bufs, tbufs):
            assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=0), (i, a, b)


# ---- dynamic QAT Linear ----
def dynamic_qat_qconfigs():
    ours = Q.QConfig(activation=Q.FakeQuantize.with_args(observer=Q.MovingAverageMinMaxObserver, averaging_constant=1),
                     weight=Q.FakeQuantize.with_args(observer=Q.MinMaxObserver, qscheme=Q.per_tensor_symmetric,
                                                     qdtype=Q.qint8))
    theirs = tq.QConfig(activation=tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver,
                                                             averaging_constant=1),
                        weight=tq.FakeQuantize.with_args(observer=tq.MinMaxObserver, qscheme=torch.per_tensor_symmetric,
                                                         dtype=torch.qint8, quant_min=-128, quant_max=127))
    return ours, theirs


def test_dynamic_qat_linear_matches_torch_ao_forward_and_backward():
    torch.manual_seed(3)
    qc, tqc = dynamic_qat_qconfigs()
    lin = nn.Linear(6, 4)
    ours = nnqatd.Linear(6, 4, qconfig=qc)
    theirs = tnnqatd.Linear(6, 4, qconfig=tqc)
    ours.load_state_dict(lin.state_dict(), strict=False)
    theirs.load_state_dict(lin.state_dict(), strict=False)
    x = torch.randn(5, 6)
    ya, yb = ours(x), theirs(x)
    assert torch.allclose(ya, yb, atol=1e-6)
    ya.sum().backward(), yb.sum().backward()
    assert torch.allclose(ours.weight.grad, theirs.weight.grad, atol=1e-6)


def test_dynamic_qat_linear_workflow_converts_to_dynamic_linear():
    torch.manual_seed(4)
    qc, tqc = dynamic_qat_qconfigs()
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    theirs = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    theirs.load_state_dict(model.state_dict())
    model.qconfig, theirs.qconfig = qc, tqc
    qat = Q.prepare_qat(model, mapping={nn.Linear: nnqatd.Linear})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tqat = tq.prepare_qat(theirs, mapping={nn.Linear: tnnqatd.Linear})
    assert type(qat[0]) is nnqatd.Linear
    x = torch.randn(16, 6)  # the activation fake-quant is on the input (memoryless), as torch.ao's pre-hook
    assert torch.allclose(qat(x), tqat(x), atol=1e-5)
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        qat(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
    q = Q.convert(qat.eval(), mapping={nnqatd.Linear: nnqd.Linear})
    assert type(q[0]) is nnqd.Linear and type(q[2]) is nnqd.Linear
    x = torch.randn(8, 6)
    ref = qat[2](qat[1](qat[0](x)))
    assert ((q(x) - ref).norm() / ref.norm()) < 0.05
    assert Q.get_default_dynamic_quant_module_mappings()[nnqatd.Linear] is nnqd.Linear


def test_dynamic_qat_linear_rejects_a_stateful_activation():
    with pytest.raises(ValueError, match="Dynamic QAT requires a memoryless observer.This means a MovingAverage "
                                         "observer with averaging constant equal to 1"):
        nnqatd.Linear(2, 2, qconfig=Q.get_default_qat_qconfig())
    with pytest.raises(ValueError, match="got MinMaxObserver"):  # accumulates: not memoryless
        nnqatd.Linear(2, 2, qconfig=Q.QConfig(activation=Q.MinMaxObserver, weight=Q.get_default_qat_qconfig().weight))
    assert nnqatd.is_memoryless(Q.get_dynamic_qat_qconfig()) and nnqatd.is_memoryless(Q.get_dynamic_qconfig())
