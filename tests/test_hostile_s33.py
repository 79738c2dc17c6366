"""Hostile inputs found by session 33's sweep: a call-order entry ``quantize_dynamic`` ignored, a malformed qconfig
dict tier failing as a bare "not iterable", float codes ``cpu_int_mm`` truncated on its int32 route, non-finite and
meta weights ``DynamicInt8Linear`` / dynamic ``from_float`` quantized (or failed on deep inside), the clipping-range
observers' NaN bin indices on a very narrow range, an observer instance handed to ``FakeQuantize``, ``fuse_modules``
leaving an ``inplace`` model half fused, junk for ``to_onnx``'s ``dynamic_batch`` and the LLM entry points'
``inplace``, and ``quantize_w8a8`` / ``quantize_llm`` putting the caller's model in eval mode before refusing its
calibration data, ``quantize_ptq`` checking ``equalize`` only after tracing the model. Each is now an error naming
the value before anything is changed."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit.kernels.int_mm import cpu_int_mm
from lowbit.llm.w8a8 import DynamicInt8Linear
from lowbit.nn.quantized.dynamic import Linear as DynamicLinear


def _order_mapping() -> Q.QConfigMapping:
    return (Q.QConfigMapping().set_global(Q.get_dynamic_qconfig())
            .set_module_name_object_type_order("", nn.Linear, 0, None))


def test_quantize_dynamic_refuses_call_order_entries():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="quantize_dynamic: QConfigMapping.set_module_name_object_type_order"):
        Q.quantize_dynamic(m, _order_mapping())
    # graph mode honours the same entry: the first Linear called in the root stays float
    ex = (torch.randn(2, 4),)
    mapping = Q.get_default_qconfig_mapping().set_module_name_object_type_order("", nn.Linear, 0, None)
    p = Q.prepare_fx(m.eval(), mapping, ex)
    p(*ex)
    float_layer = Q.convert_fx(p).get_submodule("0")
    # kept float, it still fuses with its ReLU as torch.ao does (session 41): a float LinearReLU around nn.Linear
    assert type(float_layer).__name__ == "LinearReLU" and type(float_layer[0]) is nn.Linear


@pytest.mark.parametrize("key", ["object_type", "module_name", "module_name_regex", "module_name_object_type_order"])
@pytest.mark.parametrize("value", [5, None, "ab", {"fc": None}])
def test_qconfig_dict_tier_must_be_a_list_of_entries(key, value):
    with pytest.raises(TypeError, match=rf"qconfig dict \[{key!r}\]: value=.* must be a list of"):
        Q.QConfigMapping.from_dict({key: value})
    with pytest.raises(TypeError, match=rf"qconfig dict \[{key!r}\]"):
        Q.prepare_fx(nn.Sequential(nn.Linear(2, 2)).eval(), {key: value}, (torch.randn(1, 2),))


def test_qconfig_dict_tier_still_takes_any_iterable_of_entries():
    qc = Q.get_default_qconfig()
    m = Q.QConfigMapping.from_dict({"object_type": {nn.Linear: None}.items(),
                                    "module_name_object_type_order": (("", operator.add, 1, qc),)})
    assert m.object_type_qconfigs == {nn.Linear: None}
    assert m.module_name_object_type_order_qconfigs == {("", operator.add, 1): qc}


@pytest.mark.parametrize(("q", "w_t", "exc", "match"), [
    (torch.randn(4, 1), torch.ones(1, 3, dtype=torch.int8), TypeError, "got dtypes torch.float32 and torch.int8"),
    (torch.ones(4, 1, dtype=torch.int32), torch.ones(1, 3, dtype=torch.int8), TypeError, "torch.int32"),
    (torch.ones(4, 8, dtype=torch.int8), torch.ones(8, 3, dtype=torch.int32), TypeError, "torch.int32"),
    (torch.ones(8, dtype=torch.int8), torch.ones(8, 3, dtype=torch.int8), ValueError, r"shapes \(8,\) and \(8, 3\)"),
    (torch.ones(4, 2, dtype=torch.int8), torch.ones(3, 3, dtype=torch.int8), ValueError, "same K"),
])
def test_cpu_int_mm_refuses_operands_it_would_truncate_or_misread(q, w_t, exc, match):
    with pytest.raises(exc, match=f"cpu_int_mm: .*{match}"):
        cpu_int_mm(q, w_t)


def test_cpu_int_mm_takes_its_operands_as_before():
    torch.manual_seed(0)
    for m, k, n in ((4, 1, 3), (0, 8, 3), (5, 16, 7), (3, 0, 2)):
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        assert torch.equal(cpu_int_mm(a, b.t()), a.int() @ b.t().int())


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_w8a8_linear_refuses_a_non_finite_weight(value):
    lin = nn.Linear(4, 2)
    with torch.no_grad():
        lin.weight[1, 2] = value
    with pytest.raises(ValueError, match=r"DynamicInt8Linear.from_float: the weight of shape \(2, 4\) holds 1 NaN/Inf"):
        DynamicInt8Linear.from_float(lin)


def test_w8a8_linear_and_dynamic_from_float_refuse_meta_weights():
    with pytest.raises(RuntimeError, match="DynamicInt8Linear.from_float: a meta tensor"):
        DynamicInt8Linear.from_float(nn.Linear(2, 2, device="meta"))
    with pytest.raises(RuntimeError, match="dynamic Linear.from_float: a meta tensor"):
        DynamicLinear.from_float(nn.Linear(2, 2, device="meta"))


def test_dynamic_from_float_names_a_non_finite_weight():
    m = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        m[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"module '0' \(Linear\): dynamic Linear.from_float: the weight of shape "
                                         r"\(4, 4\) holds 1 NaN/Inf values"):
        Q.quantize_dynamic(m)


@pytest.mark.parametrize("make", [
    lambda: Q.PercentileObserver(), lambda: Q.EntropyObserver(), lambda: Q.MSEObserver(),
    lambda: Q.MSEObserver(qscheme=Q.per_channel_symmetric, qdtype=Q.qint8, ch_axis=0),
])
def test_clip_range_observers_take_a_very_narrow_range(make):
    obs = make()
    obs(torch.tensor([[1e-40, 2e-40], [1e-40, 3e-40]]))  # bins / width overflowed float32: NaN bin indices
    assert float(obs.histogram.sum()) == 4.0
    scale, _ = obs.calculate_qparams()
    assert torch.equal(scale, torch.full_like(scale, 1e-8))  # the eps floor, as MinMaxObserver gives


def test_fake_quantize_refuses_an_observer_instance():
    for cls in (Q.FakeQuantize, Q.LearnableFakeQuantize, Q.FusedMovingAvgObsFakeQuantize):
        with pytest.raises(TypeError, match=r"observer=MinMaxObserver\(.*\) is an observer instance; pass its class"):
            cls(Q.MinMaxObserver())


def _fusable() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU()).eval()


@pytest.mark.parametrize(("groups", "match"), [
    ([["0", "1", "2"], ["3", "9"]], "has no submodule named '9'"),
    ([["0", "1"], ["1", "2"]], r"cannot fuse \(Identity, ReLU\)"),
    ([["3", "4"], ["0", "2"]], "sits between them"),
])
def test_fuse_modules_inplace_error_leaves_the_model_as_it_was(groups, match):
    m = _fusable()
    before = list(m)
    with pytest.raises((ValueError, TypeError), match=match):
        Q.fuse_modules(m, groups, inplace=True)
    assert all(a is b for a, b in zip(m, before, strict=True))


def test_to_onnx_dynamic_batch_must_be_a_bool(tmp_path):
    pytest.importorskip("onnx")
    from lowbit.export import to_onnx

    with pytest.raises(TypeError, match="to_onnx: dynamic_batch='no' must be True or False"):
        to_onnx(nn.Linear(2, 2), (torch.randn(1, 2),), tmp_path / "m.onnx", dynamic_batch="no")
    assert not (tmp_path / "m.onnx").exists()


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return Q.llm.toy_llama(layers=1, hidden=32, vocab=64), torch.randint(0, 64, (1, 8))


@pytest.mark.parametrize("fn", ["quantize_w8a8", "quantize_llm"])
def test_llm_entry_points_check_inplace_and_keep_the_mode_on_refusal(toy, fn):
    m, ids = toy
    model = copy.deepcopy(m).train()
    call = getattr(Q, fn)
    kwargs = {"group_size": 16, "progress": False} if fn == "quantize_llm" else {}
    with pytest.raises(TypeError, match=rf"{fn}: inplace='no' must be True or False"):
        call(model, [ids], inplace="no", **kwargs)
    with pytest.raises(TypeError, match="token ids must be an integer tensor"):
        call(model, [torch.rand(1, 8)], inplace=True, **kwargs)
    assert all(mod.training for mod in model.modules())
    assert all(type(mod) is not DynamicInt8Linear for mod in model.modules())


def test_w8a8_nan_activations_refused_in_place_keep_the_mode(toy):
    m, ids = toy
    model = copy.deepcopy(m).train()
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[0] = float("nan")  # finite ids, NaN activations into q/k/v
    with pytest.raises(ValueError, match="quantize_w8a8: the calibration activations reaching .* hold NaN/Inf"):
        Q.quantize_w8a8(model, [ids], inplace=True)
    assert all(mod.training for mod in model.modules())


def test_quantize_ptq_checks_equalize_before_any_work(monkeypatch):
    import lowbit.ptq as ptq

    def boom(*_a, **_k):
        raise AssertionError("prepare_fx ran before equalize was checked")

    monkeypatch.setattr(ptq, "prepare_fx", boom)
    with pytest.raises(ValueError, match="quantize_ptq: equalize='x' must be True, False or 'range'"):
        Q.quantize_ptq(nn.Sequential(nn.Linear(2, 2)), [torch.randn(1, 2)], recipe="default", equalize="x",
                       progress=False)


def test_a_failed_onnx_export_leaves_the_file_at_path_as_it_was(tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    import lowbit.export.onnx as ex

    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(4, 4, 1), Q.DeQuantStub()).eval()
    model.qconfig = Q.get_default_qconfig()
    x = torch.randn(2, 4, 3, 3)
    prepared = Q.prepare(model)
    prepared(x)
    qmodel = Q.convert(prepared)
    path = tmp_path / "model.onnx"
    path.write_bytes(b"the user's earlier export")

    def refuse(proto):  # a step after torch's exporter wrote its file fails (as the opset-21 relabelling can)
        raise ValueError("post-processing refused the graph")

    with monkeypatch.context() as m:
        m.setattr(ex, "constants_to_initializers", refuse)
        with pytest.raises(ValueError, match="post-processing refused"):
            ex.to_onnx(qmodel, x, path)
    assert path.read_bytes() == b"the user's earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no partial file left beside it
    assert ex.to_onnx(qmodel, x, path) == path  # a successful export replaces it
    assert path.stat().st_size > 100 and not path.read_bytes().startswith(b"the user's")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # an ordinary file, not a private temp


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
