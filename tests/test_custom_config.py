"""torch.ao surface, parts 5 and 7: custom modules (eager and graph mode), non-traceable modules, quantized
input/output indexes, preserved attributes, fuse_fx, user fusion patterns, observer_non_leaf_module_list,
and the mapping arguments of prepare_qat / convert — parity with torch.ao where it has the feature."""

import warnings

import pytest
import torch
import torch.ao.nn.qat as tnnqat
import torch.ao.nn.quantized as tnnq
import torch.ao.quantization as tq
import torch.ao.quantization.quantize_fx as tqfx
from torch import nn

import lowbit as Q
import lowbit.nn.qat as nnqat
import lowbit.nn.quantized as nnq
from lowbit.nn import intrinsic as nni

torch.set_num_threads(1)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---- custom module classes (user code) ----
class Doubler(nn.Module):  # the float custom module
    def forward(self, x):
        return x * 2


class ObservedDoubler(Doubler):
    @classmethod
    def from_float(cls, mod):
        new = cls()
        new.qconfig = mod.qconfig  # torch.ao observes the returned module only if it carries the qconfig
        return new


class QuantDoubler(nn.Module):  # lowbit: QTensor in, QTensor out on the observed grid
    def __init__(self, scale, zero_point):
        super().__init__()
        self.scale, self.zero_point = scale, zero_point

    def forward(self, x):
        return Q.quantize_per_tensor(x.dequantize() * 2, self.scale, self.zero_point, Q.quint8)

    @classmethod
    def from_observed(cls, mod):
        s, z = mod.activation_post_process.calculate_qparams()
        return cls(float(s), int(z))


class TorchQuantDoubler(QuantDoubler):  # torch.ao's twin on torch quantized tensors
    def forward(self, x):
        return torch.quantize_per_tensor(x.dequantize() * 2, self.scale, self.zero_point, torch.quint8)


def custom_net(stub=Q.QuantStub, destub=Q.DeQuantStub):
    torch.manual_seed(0)
    return nn.Sequential(stub(), nn.Linear(6, 5), Doubler(), nn.Linear(5, 3), destub()).eval()


def test_eager_custom_module_matches_torch_ao():
    model = custom_net()
    theirs_model = custom_net(tq.QuantStub, tq.DeQuantStub)
    theirs_model.load_state_dict(model.state_dict())
    qc = Q.get_minmax_qconfig()
    ours = Q.prepare(model, qc, prepare_custom_config_dict={
        "float_to_observed_custom_module_class": {Doubler: ObservedDoubler}})
    theirs_model.qconfig = tq.QConfig(activation=tq.MinMaxObserver, weight=tq.default_per_channel_weight_observer)
    theirs = quiet(tq.prepare, theirs_model, prepare_custom_config_dict={
        "float_to_observed_custom_module_class": {Doubler: ObservedDoubler}})
    assert type(ours[2]) is ObservedDoubler and type(theirs[2]) is ObservedDoubler
    xs = [torch.randn(16, 6) for _ in range(3)]
    for x in xs:
        ours(x), theirs(x)
    assert torch.equal(ours[2].activation_post_process.max_val, theirs[2].activation_post_process.max_val)
    cfg = Q.ConvertCustomConfig().set_observed_to_quantized_mapping(ObservedDoubler, QuantDoubler)
    q = Q.convert(ours, convert_custom_config_dict=cfg)
    x = torch.randn(8, 6)
    # qnnpack: torch.ao's exact engine for full-range activations on every CPU (x86/onednn saturate the
    # u8 x s8 pair sums on CPUs without VNNI, off by up to 0.6 here on an AVX2-only machine)
    prev, torch.backends.quantized.engine = torch.backends.quantized.engine, "qnnpack"
    try:
        tqm = quiet(tq.convert, theirs, convert_custom_config_dict={
            "observed_to_quantized_custom_module_class": {ObservedDoubler: TorchQuantDoubler}})
        ref = tqm(x)
    finally:
        torch.backends.quantized.engine = prev
    assert type(q[2]) is QuantDoubler and type(tqm[2]) is TorchQuantDoubler
    out_scale = float(q[3].scale)
    assert (q(x) - ref).abs().max() <= 2 * out_scale + 1e-6


def test_eager_custom_module_errors():
    prepared = Q.prepare(custom_net(), Q.get_minmax_qconfig(), prepare_custom_config_dict={
        "float_to_observed_custom_module_class": {Doubler: ObservedDoubler}})
    prepared(torch.randn(4, 6))
    with pytest.raises(TypeError, match="has no from_observed"):
        Q.convert(prepared, convert_custom_config_dict={"observed_to_quantized_custom_module_class":
                                                        {ObservedDoubler: nn.Identity}})
    with pytest.raises(ValueError, match="unsupported keys"):
        Q.prepare(custom_net(), prepare_custom_config_dict={"float_to_observed": {}})
    with pytest.raises(ValueError, match="quant_type='dynamic'"):
        Q.PrepareCustomConfig().set_float_to_observed_mapping(Doubler, ObservedDoubler, "dynamic")


# ---- observer_non_leaf_module_list ----
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


def test_observer_non_leaf_module_list_matches_torch_ao():
    torch.manual_seed(1)
    model = nn.Sequential(Q.QuantStub(), Block(), nn.Linear(4, 2), Q.DeQuantStub()).eval()
    theirs_model = nn.Sequential(tq.QuantStub(), Block(), nn.Linear(4, 2), tq.DeQuantStub()).eval()
    theirs_model.load_state_dict(model.state_dict())
    ours = Q.prepare(model, Q.get_minmax_qconfig(), observer_non_leaf_module_list=[Block])
    theirs_model.qconfig = tq.QConfig(activation=tq.MinMaxObserver, weight=tq.default_per_channel_weight_observer)
    theirs = quiet(tq.prepare, theirs_model, observer_non_leaf_module_list=[Block])

    def observed(m):
        return sorted(n for n, c in m.named_modules() if hasattr(c, "activation_post_process") and n)

    assert observed(ours) == observed(theirs) == ["0", "1", "2"]
    for x in [torch.randn(8, 4), torch.randn(8, 4) * 3]:
        ours(x), theirs(x)
    assert torch.equal(ours[1].activation_post_process.min_val, theirs[1].activation_post_process.min_val)
    with pytest.raises(TypeError, match="observer_non_leaf_module_list must be a list of module classes"):
        Q.prepare(model, observer_non_leaf_module_list=["Block"])


# ---- prepare_qat(mapping=...) / convert(mapping=...) ----
def test_prepare_qat_and_convert_mapping_arguments_match_torch_ao():
    torch.manual_seed(2)

    def net(stub, destub):
        return nn.Sequential(stub(), nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3), destub())

    model = net(Q.QuantStub, Q.DeQuantStub)
    theirs_model = net(tq.QuantStub, tq.DeQuantStub)
    theirs_model.load_state_dict(model.state_dict())
    ours = Q.prepare_qat(model, Q.get_default_qat_qconfig(), mapping={nn.Linear: nnqat.Linear})
    theirs_model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    theirs = quiet(tq.prepare_qat, theirs_model.train(), mapping={nn.Linear: tnnqat.Linear})
    assert [type(m).__name__ for m in ours] == [type(m).__name__ for m in theirs]
    assert type(ours[1]) is nn.Conv2d and type(ours[3]) is nnqat.Linear
    for _ in range(2):
        x = torch.randn(4, 1, 6, 6)
        ours(x), theirs(x)
    q = Q.convert(ours.eval(), mapping={Q.QuantStub: nnq.Quantize, Q.DeQuantStub: nnq.DeQuantize,
                                        nnqat.Linear: nnq.Linear})
    tqm = quiet(tq.convert, theirs.eval(), mapping={tq.QuantStub: tnnq.Quantize, tq.DeQuantStub: tnnq.DeQuantize,
                                                    tnnqat.Linear: tnnq.Linear})
    assert [type(m).__name__ for m in q] == [type(m).__name__ for m in tqm] == [
        "Quantize", "Conv2d", "Flatten", "Linear", "DeQuantize"]
    assert type(q[1]) is nn.Conv2d and type(q[3]) is nnq.Linear


# ---- graph mode: custom modules, non-traceable modules, indexes, preserved attributes ----
class FxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.twice, self.fc2 = nn.Linear(6, 5), Doubler(), nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(self.twice(self.fc1(x)))


def test_fx_custom_module_and_preserved_attributes():
    torch.manual_seed(3)
    model = FxNet().eval()
    model.label = "kept"
    x = torch.randn(8, 6)
    pcfg = (Q.PrepareCustomConfig().set_float_to_observed_mapping(Doubler, ObservedDoubler)
            .set_preserved_attributes(["label"]))
    prepared = Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,), prepare_custom_config=pcfg)
    assert type(prepared.twice) is ObservedDoubler and prepared.label == "kept"
    for _ in range(3):
        prepared(torch.randn(16, 6))
    ccfg = Q.ConvertCustomConfig().set_observed_to_quantized_mapping(ObservedDoubler, QuantDoubler)
    q = Q.convert_fx(prepared, convert_custom_config=ccfg.set_preserved_attributes(["label"]))
    assert type(q.twice) is QuantDoubler and q.label == "kept"
    ref = model(x)
    assert ((q(x) - ref).norm() / ref.norm()) < 0.05
    with pytest.raises(ValueError, match="has no quantized class"):
        Q.convert_fx(prepared)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -x


class HasBranchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.branchy, self.post = nn.Linear(4, 4), Branchy(), nn.Linear(4, 2)

    def forward(self, x):
        return self.post(self.branchy(self.pre(x)))


@pytest.mark.parametrize("by", ["name", "class"])
def test_fx_non_traceable_modules_stay_float_without_a_warning(by):
    torch.manual_seed(4)
    model = HasBranchy().eval()
    cfg = Q.PrepareCustomConfig()
    cfg = cfg.set_non_traceable_module_names(["branchy"]) if by == "name" else cfg.set_non_traceable_module_classes(
        [Branchy])
    x = torch.randn(8, 4).abs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default path warns that 'branchy' cannot be traced
        prepared = Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,), prepare_custom_config=cfg)
    prepared(x)
    q = Q.convert_fx(prepared)
    assert type(q.branchy.fc) is nn.Linear and type(q.pre) is nnq.Linear and type(q.post) is nnq.Linear
    assert "branchy" in q.lowbit_report.untraceable
    ref = model(x)
    assert ((q(x) - ref).norm() / ref.norm()) < 0.05
    with pytest.raises(ValueError, match="'nope'"):
        Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,),
                     prepare_custom_config=Q.PrepareCustomConfig().set_non_traceable_module_names(["nope"]))


def test_fx_quantized_input_and_output_indexes():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    x = torch.randn(8, 6)
    cfg = Q.PrepareCustomConfig().set_input_quantized_indexes([0]).set_output_quantized_indexes([0])
    prepared = Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,), prepare_custom_config=cfg)
    plain = Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,))
    for _ in range(3):
        xb = torch.randn(16, 6)
        prepared(xb), plain(xb)
    q, qp = Q.convert_fx(prepared), Q.convert_fx(plain)
    assert not any(type(m).__name__ == "Quantize" for m in q.modules())
    assert not any(type(m).__name__ == "DeQuantize" for m in q.modules())
    grid = next(m for m in qp.modules() if isinstance(m, nnq.Quantize))  # the Quantize
    qx = Q.quantize_per_tensor(x, float(grid.scale), int(grid.zero_point), Q.quint8)
    out = q(qx)
    assert isinstance(out, Q.QTensor)
    assert torch.equal(out.dequantize(), qp(x))  # same codes in, same grid out


# ---- fuse_fx and user fusion patterns ----
def test_fuse_fx_matches_torch_ao():
    torch.manual_seed(6)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
            self.fc, self.act = nn.Linear(4 * 4 * 4, 3), nn.ReLU()

        def forward(self, x):
            return self.act(self.fc(self.relu(self.bn(self.conv(x))).flatten(1)))

    model = Net().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    ours = Q.fuse_fx(model, Q.FuseCustomConfig().set_preserved_attributes(["training"]))
    theirs = quiet(tqfx.fuse_fx, model)

    def called(gm):
        return [type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"]

    assert called(ours) == called(theirs) == ["ConvReLU2d", "LinearReLU"]
    x = torch.randn(3, 2, 6, 6)
    assert torch.allclose(ours(x), theirs(x), atol=1e-5) and torch.allclose(ours(x), model(x), atol=1e-5)
    qat = Q.fuse_fx(Net().train())
    assert type(qat.conv) is nni.ConvBnReLU2d


class LinearReLU6(nn.Sequential):  # user fused marker
    pass


class QuantLinearReLU6(nn.Module):  # user quantized form: int8 Linear on the observed grid, then ReLU6 on codes
    def __init__(self, linear):
        super().__init__()
        self.linear, self.relu6 = linear, nnq.ReLU6()

    def forward(self, x):
        return self.relu6(self.linear(x))

    @classmethod
    def from_float(cls, mod):
        lin = mod[0]
        lin.qconfig, lin.activation_post_process = mod.qconfig, mod.activation_post_process
        return cls(nnq.Linear.from_float(lin))


@pytest.fixture
def relu6_pattern():
    Q.register_fusion_pattern((nn.Linear, nn.ReLU6), lambda is_qat, lin, act: LinearReLU6(lin, act),
                              fused_type=LinearReLU6, quantized=QuantLinearReLU6)
    yield
    Q.unregister_fusion_pattern((nn.Linear, nn.ReLU6))


def test_user_fusion_pattern_in_eager_and_graph_mode(relu6_pattern):
    torch.manual_seed(7)
    float_model = nn.Sequential(nn.Linear(6, 8), nn.ReLU6(), nn.Linear(8, 3)).eval()
    x = torch.randn(16, 6) * 3
    ref = float_model(x)
    eager = Q.fuse_modules(float_model, [["0", "1"]])
    assert type(eager[0]) is LinearReLU6
    eager = nn.Sequential(Q.QuantStub(), *eager, Q.DeQuantStub())
    prepared = Q.prepare(eager, Q.get_minmax_qconfig())
    prepared(x)
    q = Q.convert(prepared)
    assert type(q[1]) is QuantLinearReLU6
    assert ((q(x) - ref).norm() / ref.norm()) < 0.05
    gprep = Q.prepare_fx(float_model, Q.get_minmax_qconfig(), (x,))
    assert any("Linear + ReLU6 -> LinearReLU6" in f for f in gprep.lowbit_report.fused)
    gprep(x)
    gq = Q.convert_fx(gprep)
    assert type(gq.get_submodule("0")) is QuantLinearReLU6
    assert ((gq(x) - ref).norm() / ref.norm()) < 0.05
    assert type(Q.fuse_fx(float_model).get_submodule("0")) is LinearReLU6


def test_register_fusion_pattern_errors():
    with pytest.raises(TypeError, match="tuple of 2-4 nn.Module classes"):
        Q.register_fusion_pattern((nn.Linear,), lambda *a: None)
    with pytest.raises(ValueError, match="give fused_type"):
        Q.register_fusion_pattern((nn.Linear, nn.ReLU6), lambda *a: None, quantized=QuantLinearReLU6)
    with pytest.raises(KeyError, match="not registered"):
        Q.unregister_fusion_pattern((nn.Linear, nn.Tanh))


def test_fx_quantized_input_gets_no_observer_and_feeds_share_ops():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 3)).eval()
    x = torch.randn(4, 2, 3)
    cfg = Q.PrepareCustomConfig().set_input_quantized_indexes([0])
    prepared = Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,), prepare_custom_config=cfg)
    plain = Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,))

    def observers(gm):
        return sum(isinstance(m, Q.ObserverBase) for m in gm.modules())

    assert observers(prepared) == observers(plain) - 1 == 1  # only the Linear's output
    prepared(x), plain(x)
    q, qp = Q.convert_fx(prepared), Q.convert_fx(plain)
    grid = next(m for m in qp.modules() if isinstance(m, nnq.Quantize))
    qx = Q.quantize_per_tensor(x, float(grid.scale), int(grid.zero_point), Q.quint8)
    assert torch.equal(q(qx), qp(x))


class DynamicCustom(nn.Module):  # torch.ao's dynamic custom module flow: a float leaf swapped at convert
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return torch.relu(self.linear(x))

    @classmethod
    def from_observed(cls, mod):
        return cls(nnq.dynamic.Linear.from_float(mod.fc))


class HasLinearBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.block = nn.Linear(4, 4), Block()

    def forward(self, x):
        return self.block(self.fc(x))


def test_fx_dynamic_custom_module_from_a_non_traceable_class():
    torch.manual_seed(9)
    model = HasLinearBlock().eval()
    x = torch.randn(8, 4)
    prepared = Q.prepare_fx(model, Q.get_minmax_qconfig(), (x,),
                            prepare_custom_config={"non_traceable_module_class": [Block]})
    prepared(x)
    q = Q.convert_fx(prepared, convert_custom_config={
        "observed_to_quantized_custom_module_class": {"dynamic": {Block: DynamicCustom}}})
    assert type(q.block) is DynamicCustom and type(q.block.linear) is nnq.dynamic.Linear
    ref = model(x)
    assert ((q(x) - ref).norm() / ref.norm()) < 0.05
