"""lowbit.debug: compare (per-layer SQNR), sensitivity (one layer at a time + tolerance loop), activation_ranges."""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit import qtensor
from lowbit.debug import CompareResult, activation_ranges, compare, sensitivity, sqnr

torch.set_num_threads(1)
GROUPS = [["conv", "bn", "relu"]]


def cbr_linear(stubs: bool = True, seed: int = 0) -> nn.Module:
    """quant -> conv-bn-relu -> flatten -> linear -> dequant, BN with non-trivial statistics (folding matters)."""
    torch.manual_seed(seed)
    layers: list[tuple[str, nn.Module]] = [("conv", nn.Conv2d(3, 8, 3, padding=1)), ("bn", nn.BatchNorm2d(8)),
                                           ("relu", nn.ReLU()), ("flat", nn.Flatten()), ("fc", nn.Linear(8 * 36, 5))]
    if stubs:
        layers = [("quant", Q.QuantStub()), *layers, ("dequant", Q.DeQuantStub())]
    m = nn.Sequential(OrderedDict(layers)).eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.3, 0.3)
        m.bn.running_var.uniform_(0.2, 3.0)
        m.bn.weight.uniform_(0.3, 3.0)
        m.bn.bias.uniform_(-0.2, 0.2)
    return m


def quantized(model: nn.Module, x: torch.Tensor, qconfig=None) -> nn.Module:
    prepared = Q.prepare(Q.fuse_modules(model, GROUPS), qconfig or Q.get_minmax_qconfig())
    prepared(x)
    return Q.convert(prepared)


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return torch.randn(64, 3, 6, 6, generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- sqnr


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 200), st.floats(1e-3, 1e3), st.integers(0, 2**16))
def test_sqnr_parity_with_torch_ao_and_properties(n, scale, seed):
    from torch.ao.ns.fx.utils import compute_sqnr

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    noise = torch.randn(n, generator=g) * scale * 0.01 + 1e-3 * scale
    got = sqnr(x, x + noise)
    assert got == pytest.approx(float(compute_sqnr(x, x + noise)), abs=1e-3)  # torch.ao: float32 norms
    x, noise = x.double(), noise.double()
    got = sqnr(x, x + noise)
    assert sqnr(3 * x, 3 * (x + noise)) == pytest.approx(got, abs=1e-6)            # scale invariant
    assert sqnr(x, x + noise / 2) == pytest.approx(got + 20 * math.log10(2), abs=1e-6)  # half the noise: +6.02 dB


def test_sqnr_exact_and_qtensor():
    x = torch.tensor([0.5, -1.0, 2.0])
    assert sqnr(x, x) == math.inf
    qt = Q.quantize_per_tensor(x, 0.5, 0, Q.qint8)
    assert sqnr(x, qt) == math.inf  # the codes represent x exactly
    with pytest.raises(TypeError, match="x_hat"):
        sqnr(x, [1.0, 2.0, 3.0])


# ---------------------------------------------------------------- compare


def test_compare_fused_conv_bn_relu_linear(data):
    m = cbr_linear()
    q = quantized(m, data)
    r = compare(m, q, [data[:32], data[32:]])
    assert [(row.name, row.compared_with) for row in r.rows] == [("quant", "quant"), ("conv", "relu"), ("fc", "fc")]
    for row in r.rows:
        assert row.act_sqnr_db > 25, row
    conv, fc = r.rows[1], r.rows[2]
    assert conv.weight_sqnr_db > 35 and fc.weight_sqnr_db > 35
    assert r.rows[0].weight_sqnr_db is None                          # Quantize has no weight
    # independent computation: the last layer's output is the model output (DeQuantize is exact)
    assert fc.act_sqnr_db == pytest.approx(sqnr(m(data), q(data)), abs=1e-6)
    # conv weight vs the BN-folded float weight (and folding matters: against the raw weight it is far worse)
    folded = Q.fuse_modules(m, GROUPS).conv[0].weight
    assert conv.weight_sqnr_db == pytest.approx(sqnr(folded, q.conv.weight()), abs=1e-6)
    assert sqnr(m.conv.weight, q.conv.weight()) < conv.weight_sqnr_db - 10
    # the models are left as they were
    assert not m.training and all(h == {} for mod in q.modules() for h in (mod._forward_hooks,))


def test_compare_float_model_fused_beforehand_gives_same_numbers(data):
    m = cbr_linear()
    q = quantized(m, data)
    a, b = compare(m, q, data), compare(Q.fuse_modules(m, GROUPS), q, data)
    assert [r.act_sqnr_db for r in a.rows] == pytest.approx([r.act_sqnr_db for r in b.rows], abs=1e-4)
    assert [r.weight_sqnr_db for r in a.rows[1:]] == pytest.approx([r.weight_sqnr_db for r in b.rows[1:]], abs=1e-4)


def test_compare_weight_parity_with_torch_ao_numeric_suite(data):
    import torch.ao.quantization as tq
    from torch.ao.ns import _numeric_suite as ns
    from torch.ao.ns.fx.utils import compute_sqnr

    m = cbr_linear()
    ao = nn.Sequential(OrderedDict([("quant", tq.QuantStub()), *list(m.named_children())[1:-1],
                                    ("dequant", tq.DeQuantStub())]))
    ao = tq.fuse_modules(copy.deepcopy(ao).eval(), GROUPS)
    ao.qconfig = tq.QConfig(activation=tq.MinMaxObserver.with_args(dtype=torch.quint8),
                            weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                         qscheme=torch.per_channel_symmetric))
    prepared = tq.prepare(ao)
    prepared(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = ns.compare_weights(ao.state_dict(), tq.convert(prepared).state_dict())
    w = weights["conv.weight"]
    ours = compare(m, quantized(m, data), data).rows[1]
    assert ours.weight_sqnr_db == pytest.approx(float(compute_sqnr(w["float"], w["quantized"].dequantize())),
                                                abs=1e-3)


def test_compare_broken_layer_is_worst(data):
    m = cbr_linear()
    q = quantized(m, data)
    q.fc.set_output_grid(float(q.fc.scale) * 0.02, int(q.fc.zero_point))   # output scale forced tiny: saturates
    q.conv.weight_scale.mul_(0.05)                                          # weight scale forced tiny: clips
    r = compare(m, q, data)
    assert r.worst("activation").name == "fc" and r.worst("activation").act_sqnr_db < 10
    assert r.worst("weight").name == "conv" and r.worst("weight").weight_sqnr_db < 10


def test_compare_quant_wrapper_without_stubs_and_dynamic(data):
    m = cbr_linear(stubs=False)
    wrapped = Q.QuantWrapper(Q.fuse_modules(m, GROUPS))
    prepared = Q.prepare(wrapped, Q.get_minmax_qconfig())
    prepared(data)
    r = compare(m, Q.convert(prepared), data)
    assert [(row.name, row.compared_with) for row in r.rows] == [("module.conv", "relu"), ("module.fc", "fc")]
    assert min(row.act_sqnr_db for row in r.rows) > 25
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    rd = compare(mlp, Q.quantize_dynamic(mlp, {nn.Linear}), torch.randn(8, 16))
    assert [row.name for row in rd.rows] == ["0", "2"] and all(row.weight_sqnr_db > 30 for row in rd.rows)


def test_compare_float_functional_and_tables():
    from lowbit.examples import SmallCNN

    torch.manual_seed(0)
    m = SmallCNN(channels=(4, 8), hidden=16).eval()
    x = torch.randn(16, 1, 28, 28)
    prepared = Q.prepare(Q.fuse_modules(m, m.fusion_groups()), Q.get_minmax_qconfig())
    prepared(x)
    r = compare(m, Q.convert(prepared), x)
    names = [row.name for row in r.rows]
    assert names == ["quant", "conv1", "conv2", "conv3", "skip", "fc1", "fc2"]
    assert r.rows[names.index("skip")].module_type == "QFunctional" and r.rows[names.index("conv3")].compared_with == "bn3"
    text, md, d = str(r), r.to_markdown(), r.to_dict()
    assert text.splitlines()[0].split()[:2] == ["layer", "type"] and len(text.splitlines()) == len(r.rows) + 2
    md_lines = md.splitlines()
    assert len(md_lines) == len(r.rows) + 2 and all(line.count("|") == 8 for line in md_lines)
    for line, row in zip(md_lines[2:], r.rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == row.name and float(cells[3]) == pytest.approx(row.act_sqnr_db, abs=0.005)
    assert CompareResult(rows=[type(r.rows[0])(**row) for row in d["rows"]]).rows == r.rows


def test_compare_bad_input(data):
    m = cbr_linear()
    q = quantized(m, data)
    with pytest.raises(TypeError, match="float_model"):
        compare("model", q, data)
    with pytest.raises(TypeError, match="quantized_model"):
        compare(m, None, data)
    with pytest.raises(ValueError, match="empty"):
        compare(m, q, [])
    with pytest.raises(TypeError, match="inputs"):
        compare(m, q, 3)
    with pytest.raises(ValueError, match="no quantized module"):
        compare(m, copy.deepcopy(m), data)
    with pytest.raises(ValueError, match="kind"):
        compare(m, q, data).worst("bias")


# ---------------------------------------------------------------- activation_ranges


def test_activation_ranges_minmax_and_histogram(data):
    m = cbr_linear()
    prepared = Q.prepare(Q.fuse_modules(m, GROUPS), Q.get_minmax_qconfig())
    prepared(data)
    first = activation_ranges(prepared)[0]
    assert first.name == "quant" and first.observed == (float(data.min()), float(data.max()))
    scale, zp = prepared.quant.activation_post_process.calculate_qparams()
    assert first.clip == pytest.approx(((0 - int(zp)) * float(scale), (255 - int(zp)) * float(scale)))
    assert first.histogram is None
    prepared = Q.prepare(Q.fuse_modules(m, GROUPS), Q.get_default_qconfig())
    prepared(data)
    ranges = activation_ranges(prepared)
    assert [a.name for a in ranges] == ["quant", "conv", "fc"]
    assert float(ranges[0].histogram.sum()) == data.numel() and ranges[0].bin_edges()[-1] == pytest.approx(data.max())
    assert all(a.observer == "HistogramObserver" and a.clip[0] <= 0 <= a.clip[1] for a in ranges)
    with pytest.raises(ValueError, match="no calibrated"):
        activation_ranges(m)
    with pytest.raises(TypeError, match="prepared_model"):
        activation_ranges([1, 2])


# ---------------------------------------------------------------- sensitivity


def sensitive_mlp() -> nn.Module:
    """fc2's output channel 0 is ~300x larger than the others and clamped away before fc3: quantizing fc2's
    output per tensor crushes the channels that matter, so fc2 (and only fc2) is sensitive."""
    torch.manual_seed(0)
    m = nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), relu=nn.ReLU(), fc2=nn.Linear(16, 16),
                                  clamp=nn.Hardtanh(-1.0, 1.0), fc3=nn.Linear(16, 4))).eval()
    with torch.no_grad():
        m.fc2.weight[0] *= 300.0
        m.fc3.weight[:, 0] = 0.0
    return m


def mse_score(model: nn.Module, x: torch.Tensor):
    ref = model(x).detach()

    def score(m: nn.Module) -> float:
        out = m(x)
        assert isinstance(out, torch.Tensor)  # eval_fn always sees float outputs
        return -float(((out - ref) ** 2).mean())
    return score


def test_sensitivity_finds_the_sensitive_layer_and_tolerance_keeps_it_float():
    m = sensitive_mlp()
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(2))
    score = mse_score(m, x)
    seen = set(qtensor._warned_ops)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mapping, table = sensitivity(m, Q.get_minmax_qconfig(), x, score)
        assert table.rows[0].name == "fc2" and [r.name for r in table.rows][1:] in (["fc1", "fc3"], ["fc3", "fc1"])
        assert table.rows[0].drop > 20 * max(r.drop for r in table.rows[1:])
        assert table.baseline == 0.0 and table.final_metric is None and table.float_layers == []
        tol = 3 * sum(r.drop for r in table.rows[1:])
        mapping, table = sensitivity(m, Q.get_minmax_qconfig(), [x[:64], x[64:]], score, tolerance=tol)
    assert not [w for w in caught if "no integer implementation" in str(w.message)]
    assert qtensor._warned_ops == seen  # silenced without using up the warn-once of user code
    assert table.float_layers == ["fc2"] and table.met_tolerance and table.final_drop <= tol
    assert mapping.get_qconfig(nn.Linear, "fc2") is None and mapping.get_qconfig(nn.Linear, "fc1") is not None
    prepared = Q.prepare(m, mapping)
    prepared(x)
    q = Q.convert(prepared)
    assert type(q.fc2) is nn.Linear and type(q.fc1).__module__.startswith("lowbit.nn.quantized")
    assert "fc2" in str(table) and "| fc2 | Linear |" in table.to_markdown() and table.to_dict()["float_layers"] == ["fc2"]


def test_sensitivity_with_stubs_and_fuse(data):
    m = cbr_linear()
    calls = []

    def score(model: nn.Module) -> float:
        calls.append(model)
        return -float((model(data) - m(data)).abs().mean())

    mapping, table = sensitivity(m, None, data, score, fuse=GROUPS)
    assert sorted(r.name for r in table.rows) == ["conv", "fc"]            # stubs are not layers
    assert [r.drop for r in table.rows] == sorted((r.drop for r in table.rows), reverse=True)
    assert len(calls) == 3 and isinstance(mapping, Q.QConfigMapping)
    assert not hasattr(m.conv, "weight_fake_quant") and type(m.bn) is nn.BatchNorm2d  # model untouched
    _, table = sensitivity(m, Q.get_minmax_qconfig(), data, score, tolerance=0.0,
                           fuse=lambda mod: Q.fuse_modules(mod, GROUPS))
    assert sorted(table.float_layers) == ["conv", "fc"] and table.met_tolerance is False  # the stubs still round


def test_sensitivity_qat_ranks_like_ptq_and_trains_each_candidate():
    m = sensitive_mlp()
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(2))
    score, target = mse_score(m, x), m(x).detach()
    trained = []

    def train_fn(prepared: nn.Module) -> None:  # a short fine-tune towards the float outputs
        assert prepared.training and torch.is_grad_enabled()
        opt = torch.optim.SGD(prepared.parameters(), lr=1e-4)
        for _ in range(2):
            opt.zero_grad()
            ((prepared(x) - target) ** 2).mean().backward()
            opt.step()
        trained.append({n: type(c) for n, c in prepared.named_children()})

    mapping, table = sensitivity(m, Q.get_minmax_qconfig(), x, score, method="qat", train_fn=train_fn, tolerance=1e-3)
    assert len(trained) == 3 + 1 + len(table.float_layers)  # one per layer, the full model, one per exclusion
    assert all(t[n] is Q.nn.qat.Linear for t in trained[3:] for n in ("fc1", "fc3"))  # the full model's, in QAT form
    assert [sum(c is Q.nn.qat.Linear for c in t.values()) for t in trained[:3]] == [1, 1, 1]  # one layer at a time
    assert table.rows[0].name == "fc2" and table.rows[0].drop > 20 * max(r.drop for r in table.rows[1:])
    assert table.float_layers == ["fc2"] and table.met_tolerance
    assert mapping.get_qconfig(nn.Linear, "fc2") is None
    assert type(m.fc2) is nn.Linear and not m.training  # the user's model is untouched
    with pytest.raises(TypeError, match="train_fn"):
        sensitivity(m, None, x, score, method="qat")


def test_sensitivity_dynamic_finds_the_outlier_column_layer():
    """Per-channel weights cannot absorb an outlier *column*: every row's scale is set by it, crushing the rest
    (the column meets a dead ReLU channel, so the float model does not see it)."""
    torch.manual_seed(0)
    m = nn.Sequential(OrderedDict(fc1=nn.Linear(16, 32), relu=nn.ReLU(), fc2=nn.Linear(32, 32), fc3=nn.Linear(32, 4)))
    with torch.no_grad():
        m.fc1.weight[0], m.fc1.bias[0] = 0.0, -1.0
        m.fc2.weight[:, 0] = 100.0
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    score = mse_score(m, x)
    _, table = sensitivity(m, None, None, score, method="dynamic")
    assert [r.module_type for r in table.rows] == ["Linear"] * 3 and table.rows[0].name == "fc2"
    assert table.rows[0].drop > 10 * max(r.drop for r in table.rows[1:])
    tol = 3 * sum(r.drop for r in table.rows[1:])
    mapping, table = sensitivity(m, Q.get_dynamic_qconfig(), [x], score, method="dynamic", tolerance=tol)
    assert table.float_layers == ["fc2"] and table.met_tolerance
    q = Q.quantize_dynamic(m, mapping)
    assert type(q.fc2) is nn.Linear and type(q.fc1).__module__.startswith("lowbit.nn.quantized.dynamic")
    with torch.no_grad():
        assert -float(((q(x) - m(x)) ** 2).mean()) == pytest.approx(table.final_metric, rel=1e-6, abs=1e-12)


def test_sensitivity_bad_input(data):
    m = cbr_linear()
    ok = lambda mod: 0.0
    with pytest.raises(TypeError, match="model"):
        sensitivity("model", None, data, ok)
    with pytest.raises(TypeError, match="eval_fn"):
        sensitivity(m, None, data, "accuracy")
    with pytest.raises(ValueError, match="tolerance=-0.5"):
        sensitivity(m, None, data, ok, tolerance=-0.5)
    with pytest.raises(TypeError, match="tolerance"):
        sensitivity(m, None, data, ok, tolerance="1%")
    with pytest.raises(ValueError, match="empty"):
        sensitivity(m, None, [], ok)
    with pytest.raises(TypeError, match="fuse"):
        sensitivity(m, None, data, ok, fuse=42)
    with pytest.raises(ValueError, match="method='gptq'"):
        sensitivity(m, None, data, ok, method="gptq")
    with pytest.raises(ValueError, match="train_fn"):
        sensitivity(m, None, data, ok, train_fn=lambda p: None)
    with pytest.raises(ValueError, match="method='dynamic'"):  # a model with no Linear/LSTM/GRU... cbr_linear has fc
        sensitivity(nn.Sequential(nn.Conv2d(1, 1, 1)), None, None, ok, method="dynamic")
    with pytest.raises(ValueError, match="quantizes no layer"):
        sensitivity(m, Q.QConfigMapping(), data, ok)
    with pytest.raises(TypeError, match="real number"):
        sensitivity(m, None, data, lambda mod: "good")
