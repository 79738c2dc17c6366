"""Hostile inputs at the workflow layer: fusion, qconfig mappings, hooks, NaN weights/inputs,
tampered checkpoints, abstract bases. Each ends in a clear error naming the value, or a documented
safe result — never a silently different model."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()
        self.fc = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(self.quant(x))))
        return self.dequant(self.fc(x.mean((2, 3)) if isinstance(x, torch.Tensor) else x.dequantize().mean((2, 3))))


# ---- fuse_modules ----
def test_fusing_around_a_module_in_between_is_an_error():
    m = nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.ReLU()).eval()
    with pytest.raises(ValueError, match=r"\['1'\] sits between"):
        Q.fuse_modules(m, [["0", "2"]])
    with pytest.raises(ValueError, match="bn1"):
        Q.fuse_modules(Block().eval(), [["conv1", "relu1"]])
    with pytest.raises(ValueError, match="sits between"):
        Q.fuse_modules_qat(Block().train(), [["conv1", "relu1"]])


def test_adjacent_fusions_still_work_and_keep_the_function():
    m = Block().eval()
    x = torch.randn(2, 1, 6, 6)
    f = Q.fuse_modules(m, [["conv1", "bn1", "relu1"]])
    assert torch.allclose(f(x), m(x), atol=1e-5)
    # after an earlier fusion the Identity it left in between does not block a later one
    s = nn.Sequential(nn.Conv2d(1, 1, 1), nn.Identity(), nn.ReLU()).eval()
    assert isinstance(Q.fuse_modules(s, [["0", "2"]])[0], Q.nn.intrinsic.ConvReLU2d)


# ---- QConfigMapping names ----
def test_set_module_name_that_matches_nothing_is_an_error_at_prepare():
    qc = Q.get_minmax_qconfig()
    mapping = Q.QConfigMapping().set_global(qc).set_module_name("fc1", None)
    for call in (lambda: Q.prepare(Block(), mapping), lambda: Q.prepare_qat(Block().train(), mapping)):
        with pytest.raises(ValueError, match=r"names no module.*'fc1'.*did you mean \['fc'\]"):
            call()
    # quantize_dynamic warns (torch.ao parity on what is swapped: tests/test_quantize_api.py)
    with pytest.warns(UserWarning, match="'fc1'"):
        Q.quantize_dynamic(Block(), Q.QConfigMapping().set_module_name("fc1", Q.get_dynamic_qconfig()))
    with pytest.warns(UserWarning, match="'typo'"):
        Q.quantize_dynamic(Block(), {"typo": Q.get_dynamic_qconfig()})
    # a name that exists is fine (and excludes that module)
    prepared = Q.prepare(Block(), Q.QConfigMapping().set_global(qc).set_module_name("fc", None))
    assert not hasattr(prepared.fc, "activation_post_process")


def test_regex_matching_nothing_warns():
    mapping = Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_module_name_regex(r"blocks\.\d+", None)
    with pytest.warns(UserWarning, match="matches no module"):
        Q.prepare(Block(), mapping)


# ---- user hooks survive every module swap (torch.ao parity) ----
def _hooked(model_cls=Block):
    m = model_cls()
    calls: list[str] = []
    m.fc.register_forward_pre_hook(lambda mod, inp: calls.append("pre"))
    m.fc.register_forward_hook(lambda mod, inp, out: calls.append("post"))
    return m, calls


def _hook_count(mod: nn.Module) -> tuple[int, int]:
    return len(mod._forward_pre_hooks), len(mod._forward_hooks)


def test_hooks_survive_prepare_and_convert_like_torch_ao():
    x = torch.randn(2, 1, 6, 6)
    ours, calls = _hooked()
    ours.qconfig = Q.get_minmax_qconfig()
    prepared = Q.prepare(ours)
    prepared(x)
    converted = Q.convert(prepared)
    calls.clear()
    converted(x)
    assert calls == ["pre", "post"]

    ao, _ = _hooked()
    ao.qconfig = tq.get_default_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao_prepared = tq.prepare(ao)
        ao_prepared(x)
        ao_converted = tq.convert(ao_prepared)
    assert _hook_count(converted.fc) == _hook_count(ao_converted.fc) == (1, 1)


def test_hooks_survive_prepare_qat_and_convert():
    x = torch.randn(2, 1, 6, 6)
    m, calls = _hooked()
    prepared = Q.prepare_qat(m.train(), Q.get_default_qat_qconfig())
    assert type(prepared.fc).__module__.startswith("lowbit.nn.qat")
    calls.clear()
    prepared(x)
    assert calls == ["pre", "post"]
    converted = Q.convert(prepared.eval())
    calls.clear()
    converted(x)
    assert calls == ["pre", "post"]
    ao, _ = _hooked()
    ao.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao_prepared = tq.prepare_qat(ao.train())
    assert _hook_count(prepared.fc)[1] - 1 == _hook_count(ao_prepared.fc)[1] - 1 == 1  # + the output observer's


def test_hooks_survive_quantize_dynamic_like_torch_ao():
    m, calls = _hooked()
    q = Q.quantize_dynamic(m, {nn.Linear})
    calls.clear()
    q(torch.randn(2, 1, 6, 6))
    assert calls == ["pre", "post"]
    ao, _ = _hooked()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao_q = tq.quantize_dynamic(ao, {nn.Linear})
    assert _hook_count(ao_q.fc) == (1, 1) and _hook_count(q.fc)[1] == 1
    assert type(q.fc).__module__.startswith("lowbit.nn.quantized.dynamic")


# ---- abstract bases ----
def test_observer_base_is_abstract_like_torch_ao():
    with pytest.raises(TypeError, match="abstract"):
        Q.ObserverBase()
    with pytest.raises(TypeError):
        tq.ObserverBase(torch.quint8)

    class Half(Q.ObserverBase):  # no calculate_qparams
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="calculate_qparams"):
        Half()


# ---- NaN weights and NaN inputs ----
def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), Q.DeQuantStub())


def _converted(model: nn.Module | None = None) -> nn.Module:
    prepared = Q.prepare(model or _mlp(), Q.get_minmax_qconfig())
    prepared(torch.randn(16, 4))
    return Q.convert(prepared)


@pytest.mark.parametrize("what", ["weight", "bias"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_in_static_ptq_is_an_error_naming_the_layer(what, bad):
    m = _mlp()
    with torch.no_grad():
        getattr(m[3], what).view(-1)[1] = bad
    prepared = Q.prepare(m, Q.get_minmax_qconfig())
    prepared(torch.randn(16, 4))
    with pytest.raises(ValueError, match=rf"module '3'.*{what} .*NaN/Inf"):
        Q.convert(prepared)


def test_a_nan_weight_in_quantize_dynamic_is_an_error_naming_the_layer():
    m = _mlp()
    with torch.no_grad():
        m[1].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"module '1'.*NaN/Inf"):
        Q.quantize_dynamic(m)


def _table(kind: type, bad: float) -> nn.Sequential:
    m = nn.Sequential(kind(6, 4))
    with torch.no_grad():
        m[0].weight[2, 1] = bad
    return m


@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("flow", ["from_float", "static", "float_qparams", "dynamic", "qat"])
def test_a_non_finite_embedding_table_is_an_error_naming_the_layer(kind, bad, flow):
    # the row observers skip NaN/Inf, so the table used to quantize into finite rows that are wrong
    m = _table(kind, bad)
    qcls = Q.nn.quantized.Embedding if kind is nn.Embedding else Q.nn.quantized.EmbeddingBag
    with pytest.raises(ValueError, match=rf"{kind.__name__}.from_float: the weight .* 1 NaN/Inf") as err:
        if flow == "from_float":
            qcls.from_float(m[0])
        elif flow == "dynamic":
            Q.quantize_dynamic(m, {kind: Q.get_embedding_qconfig()})
        elif flow == "qat":
            m[0].qconfig = Q.get_embedding_qat_qconfig()
            Q.convert(Q.prepare_qat(m).eval())
        else:
            m[0].qconfig = Q.get_embedding_qconfig(float_qparams=flow == "float_qparams")
            Q.convert(Q.prepare(m))
    assert flow == "from_float" or "module '0'" in str(err.value)


def test_learnable_fake_quantize_refuses_a_grid_it_never_saw_data_for():
    """All-NaN (or no) data leaves no grid: calculate_qparams raises naming the module (it reported the
    initial scale 1.0); finite data, learning or a loaded state give it one."""
    nan = torch.full((8,), float("nan"))
    for make in (lambda: Q.LearnableFakeQuantize(),
                 lambda: Q.LearnableFakeQuantize(Q.PerChannelMinMaxObserver, ch_axis=0)):
        fq = make()
        with pytest.raises(RuntimeError, match="LearnableFakeQuantize: .*no grid"):
            fq.calculate_qparams()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the observer warns that it ignores NaN
            fq(nan.reshape(2, 4))
        with pytest.raises(RuntimeError, match="LearnableFakeQuantize: .*NaN"):
            fq.calculate_qparams()
        x = torch.tensor([[-1.0, 0.0, 2.0, 3.0], [0.5, 1.0, 1.5, 4.0]])
        fq(x)
        scale, _ = fq.calculate_qparams()
        assert torch.isfinite(scale).all() and not torch.equal(scale, torch.ones_like(scale))
        loaded = make()
        loaded.load_state_dict(fq.state_dict())
        assert torch.equal(loaded.calculate_qparams()[0], scale)
    learning = Q.LearnableFakeQuantize(scale=0.05).enable_param_learning()  # trained from a given start
    assert float(learning.calculate_qparams()[0]) == pytest.approx(0.05)
    # partly NaN per channel: the unseen channel has no grid, as PerChannelMinMaxObserver says
    fq = Q.LearnableFakeQuantize(Q.PerChannelMinMaxObserver, ch_axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fq(torch.stack([torch.randn(4), nan[:4]]))
    with pytest.raises(RuntimeError, match="LearnableFakeQuantize"):
        fq.calculate_qparams()


def test_a_converted_model_fed_nan_errors_instead_of_finite_garbage():
    q = _converted()
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    with pytest.raises(RuntimeError, match=r"Quantize: .*1 NaN"):
        q(x)
    # a float input straight into a quantized layer (no QuantStub) is checked the same way
    with pytest.raises(RuntimeError, match="NaN"):
        q[1](x)
    assert torch.isfinite(q(torch.randn(3, 4))).all()


@pytest.mark.parametrize("size", [*range(1, 20), 31, 33, 768])
def test_quantize_finds_nan_anywhere_and_infinities_are_no_false_alarm(size):
    # Quantize's eager fast path tests one reduction (max, which propagates NaN) and runs the exact count only then:
    # a NaN at any place of a vector body or tail, next to ±inf or not, raises; ±inf alone quantizes to the edge codes
    qz = Q.nn.quantized.Quantize(0.05, 64, Q.quint8.with_range(0, 127))
    torch.manual_seed(size)
    for pos in sorted({0, size // 2, size - 1, *range(0, size, max(1, size // 7))}):
        for infs in ((), (float("inf"),), (float("inf"), -float("inf"))):
            x = torch.randn(size)
            for j, v in enumerate(infs):
                x[(pos + 1 + j) % size] = v
            x[pos] = float("nan")
            with pytest.raises(RuntimeError, match=r"Quantize: .* holds 1 NaN values"):
                qz(x)
    x = torch.randn(size)
    x[0] = float("inf")
    x[-1] = -float("inf") if size > 1 else float("inf")
    codes = qz(x).int_repr()
    assert codes[0] == 127 and codes[-1] == (0 if size > 1 else 127)
    assert torch.equal(codes, Q.quantize_per_tensor(x, 0.05, 64, Q.quint8.with_range(0, 127)).int_repr())


def test_a_dynamic_model_fed_nan_propagates_nan_like_the_float_model():
    m = nn.Sequential(nn.Linear(4, 3)).eval()
    q = Q.quantize_dynamic(m)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    assert torch.equal(torch.isnan(q(x)), torch.isnan(m(x)))


# ---- tampered checkpoints ----
TAMPER = {
    "3.scale": [float("nan"), 0.0, -0.5, float("inf")],
    "0.scale": [float("nan"), 0.0],
    "3.weight_scale": [torch.tensor([0.1, float("nan")]), torch.tensor([0.1, -1.0])],
    "3.zero_point": [300, -1, 2.5],
    "0.zero_point": [256],
    "3.weight_zero_point": [torch.tensor([0.0, 1.5])],
    "3.input_scale": [-1.0, float("nan")],
    "3.bias": [torch.tensor([0.0, float("nan")])],
    "1.weight_int8": [torch.full((4, 4), 200, dtype=torch.int16), torch.full((4, 4), 0.5)],
}
CASES = [(k, v) for k, vs in TAMPER.items() for v in vs]


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_tampered_checkpoint_is_rejected_naming_the_key(key, value):
    q = _converted()
    state = q.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    tampered = dict(state)
    tampered[key] = torch.as_tensor(value)
    with pytest.raises(RuntimeError, match=rf"{key.replace('.', '[.]')}: "):
        q.load_state_dict(tampered)
    after = q.state_dict()
    owner = key.rsplit(".", 1)[0]  # the failing module keeps its state
    assert all(torch.equal(after[k], before[k]) for k in after if k.startswith(owner + "."))


def test_tampered_shapes_are_rejected_naming_the_key():
    q = _converted()
    state = dict(q.state_dict())
    state["3.weight_scale"] = torch.ones(3)
    with pytest.raises(RuntimeError, match="3.weight_scale"):
        q.load_state_dict(state)


def test_valid_checkpoint_round_trips():
    q, fresh = _converted(), _converted(_mlp())
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(5, 4)
    assert torch.equal(fresh(x), q(x))


@pytest.mark.parametrize(("make", "key", "value"), [
    (lambda: Q.FakeQuantize(), "scale", torch.tensor([float("nan")])),
    (lambda: Q.FakeQuantize(), "zero_point", torch.tensor([300])),
    (lambda: Q.FakeQuantize(), "activation_post_process.min_val", torch.tensor(float("nan"))),
    (lambda: Q.MinMaxObserver(), "max_val", torch.tensor(float("nan"))),
    (lambda: Q.HistogramObserver(bins=4), "histogram", torch.tensor([1.0, -1.0, 0.0, float("nan")])),
    (lambda: Q.LearnableFakeQuantize(), "scale", torch.tensor(float("nan"))),  # (a Parameter, not a buffer)
    (lambda: Q.LearnableFakeQuantize(), "scale", torch.tensor(0.0)),
    (lambda: Q.LearnableFakeQuantize(), "scale", torch.tensor(-0.5)),
    (lambda: Q.LearnableFakeQuantize(), "zero_point", torch.tensor(float("inf"))),
    (lambda: Q.LearnableFakeQuantize(Q.PerChannelMinMaxObserver, ch_axis=0, channel_len=16), "scale",
     torch.tensor([0.1] * 15 + [float("nan")])),
])
def test_tampered_observer_and_fake_quant_state_is_rejected_naming_the_key(make, key, value):
    src = make()
    src(torch.randn(16))
    state = dict(src.state_dict())
    state[key] = value
    with pytest.raises(RuntimeError, match=rf"{key.replace('.', '[.]')}: "):
        make().load_state_dict(state)
    make().load_state_dict(src.state_dict())  # the untampered state loads
