"""Graph mode (lowbit.fx): trace -> fuse -> observe -> convert, on models without stubs."""

from __future__ import annotations

import copy
import math
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lowbit as Q
import lowbit.nn.quantized as nnq
from lowbit.fx import FxReport, convert_fx, prepare_fx, prepare_qat_fx
from lowbit.nn.quantized.activation import Hardswish as QHardswish
from lowbit.nn.quantized.activation import ReLU6 as QReLU6
from lowbit.nn.quantized.functional_modules import QFunctional


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)  # the 2 shared cores are oversubscribed otherwise
    torch.manual_seed(0)


# ---- models: no QuantStub, no FloatFunctional ----
class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)  # plain `+`


class ResNet(nn.Module):
    def __init__(self, c: int = 8, n: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.layer1, self.layer2 = ResBlock(c), ResBlock(c)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, n)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class MBBlock(nn.Module):
    def __init__(self, c: int = 8, e: int = 4) -> None:
        super().__init__()
        h = c * e
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6())
        self.dw, self.dw_bn = nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h)
        self.act = nn.Hardswish()
        self.project, self.project_bn = nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.project_bn(self.project(self.act(self.dw_bn(self.dw(self.expand(x))))))


class MobileNet(nn.Module):
    def __init__(self, c: int = 8, n: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, stride=2), nn.BatchNorm2d(c), nn.Hardswish())
        self.blocks = nn.Sequential(MBBlock(c), MBBlock(c))
        self.fc = nn.Linear(c, n)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class Block(nn.Module):
    """Pre-LN transformer block: Linear + matmul + softmax + layernorm + gelu + residuals."""

    def __init__(self, d: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h, self.dk = h, d // h
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):  # (B, T, D)
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.reshape(B, T, self.h, self.dk).transpose(1, 2)  # (B, h, T, dk)
        k = k.reshape(B, T, self.h, self.dk).transpose(1, 2)
        v = v.reshape(B, T, self.h, self.dk).transpose(1, 2)
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dk), dim=-1)  # (B, h, T, T)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).mean() / (ref - y).pow(2).mean())).item()


def with_bn_stats(m: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(shape))
    return m.eval()


def ptq(model: nn.Module, shape: tuple[int, ...], qconfig=None, batches: int = 3):
    x = torch.randn(shape)
    prepared = prepare_fx(model, Q.get_minmax_qconfig() if qconfig is None else qconfig, example_inputs=(x,))
    with torch.no_grad():
        for _ in range(batches):
            prepared(torch.randn(shape))
    return prepared, convert_fx(prepared)


def run_silent(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run ``model``; fail on any warning (a well-covered model never leaves int8 by accident)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            return model(x)


def quantized_types(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules() if type(m).__module__.startswith("lowbit.nn.quantized")]


# ---- the three model families ----
def test_resnet_ptq_converts_and_matches_fp32():
    model = with_bn_stats(ResNet(), (8, 3, 12, 12))
    _, q = ptq(model, (16, 3, 12, 12))
    types = quantized_types(q)
    assert types.count(nnq.ConvReLU2d) == 3 and types.count(nnq.Conv2d) == 2 and nnq.Linear in types
    assert QFunctional in types and not any(isinstance(m, nn.BatchNorm2d) for m in q.modules())
    assert all("add_relu" in v for k, v in q.lowbit_report.converted.items() if "add" in k)
    x = torch.randn(64, 3, 12, 12)
    ref, y = model(x), run_silent(q, x)
    assert sqnr(ref, y) > 20
    assert (y.argmax(1) == ref.argmax(1)).float().mean() >= 0.95


def test_resnet_matches_torch_ao_fx():
    ao = pytest.importorskip("torch.ao.quantization")
    from torch.ao.quantization import quantize_fx
    model = with_bn_stats(ResNet(), (8, 3, 12, 12))
    cal = [torch.randn(16, 3, 12, 12) for _ in range(3)]
    x = torch.randn(64, 3, 12, 12)
    ours = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
    aoqc = ao.QConfig(activation=ao.MinMaxObserver.with_args(dtype=torch.quint8),
                      weight=ao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                   qscheme=torch.per_channel_symmetric))
    theirs = quantize_fx.prepare_fx(copy.deepcopy(model), ao.QConfigMapping().set_global(aoqc), example_inputs=(x,))
    with torch.no_grad():
        for c in cal:
            ours(c), theirs(c)
    ours, theirs = convert_fx(ours), quantize_fx.convert_fx(theirs)
    ref = model(x)
    s_ours, s_theirs = sqnr(ref, run_silent(ours, x)), sqnr(ref, theirs(x))
    assert s_ours > s_theirs - 3, (s_ours, s_theirs)  # same recipe: accuracy at least on par
    # same structure: torch.ao also fuses conv-bn-relu and add-relu; the last add-relu, read only by the float
    # average pool, stays float in lowbit (session 44: an int op saving no kernel only adds a rounding)
    n_ao = sum("add_relu" in str(n.target) for n in theirs.graph.nodes)
    assert n_ao == 2 and sum("add_relu" in v for v in ours.lowbit_report.converted.values()) == 1
    assert sum("add_relu (kept float: read by float ops" in v for v in ours.lowbit_report.left_float.values()) == 1


def test_mobilenet_block_depthwise_relu6_hardswish():
    model = with_bn_stats(MobileNet(), (8, 3, 16, 16))
    _, q = ptq(model, (16, 3, 16, 16))
    types = quantized_types(q)
    # ReLU6 after a conv is folded into the conv's output grid (ConvReLU2d, codes capped at 6), not a separate op
    assert QHardswish in types and QReLU6 not in types and nnq.ConvReLU2d in types
    assert not any(isinstance(m, nn.ReLU6) for m in q.modules())
    for m in (m for m in q.modules() if isinstance(m, nnq.ConvReLU2d)):  # quint8 grid tops out near 6
        assert float((255 - m.zero_point) * m.scale) <= 6.0 + float(m.scale)
    dw = [m for m in q.modules() if isinstance(m, nnq.Conv2d) and m.groups > 1]
    assert len(dw) == 2 and all(m.groups == m.in_channels for m in dw)
    x = torch.randn(32, 3, 16, 16)
    assert sqnr(model(x), run_silent(q, x)) > 20


def test_transformer_block_int_linear_and_matmul_float_softmax_layernorm():
    model = Block().eval()
    _, q = ptq(model, (4, 10, 32))
    assert quantized_types(q).count(nnq.Linear) == 4
    converted = " ".join(q.lowbit_report.converted.values())
    assert converted.count("QFunctional.matmul") == 2
    left = " ".join(q.lowbit_report.left_float.values())
    assert "truediv (kept float: read by float ops" in left  # / sqrt(dk): only the float softmax reads it
    assert "softmax" in left and "LayerNorm" in left and "gelu" in left
    assert any(isinstance(m, nn.LayerNorm) for m in q.modules())
    x = torch.randn(4, 10, 32)
    assert sqnr(model(x), run_silent(q, x)) > 20


def test_qat_trains_and_converts():
    model = ResNet()
    x, t = torch.randn(16, 3, 12, 12), torch.randint(0, 10, (16,))
    p = prepare_qat_fx(model, example_inputs=(x,))
    assert p.training and any(isinstance(m, Q.FakeQuantize) for m in p.modules())
    before = [w.detach().clone() for w in p.parameters()]
    opt = torch.optim.SGD(p.parameters(), lr=0.05)
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(p(x), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, p.parameters()))
    p.eval()
    with torch.no_grad():
        fake = p(x)
    q = convert_fx(p)
    assert quantized_types(q).count(nnq.ConvReLU2d) == 3
    assert sqnr(fake, run_silent(q, x)) > 20


# ---- functional coverage ----
class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 4)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        y = torch.cat([F.hardswish(a), torch.sigmoid(b)], dim=1)  # (N, 16)
        y = (y * 0.5 + 1.0) / 2
        y = operator.mul(y, y).relu()
        z = self.c(y.flatten(1))
        return (z + torch.add(z, z)).relu()


def test_functional_ops_become_integer_ops():
    model = Functional().eval()
    _, q = ptq(model, (32, 8))
    converted = " ".join(q.lowbit_report.converted.values())
    for op in ("QFunctional.cat", "QFunctional.mul_scalar", "QFunctional.add_scalar", "QFunctional.mul",
               "QFunctional.add_relu", "QFunctional.add", "Hardswish", "Sigmoid"):
        assert op in converted, op
    assert not q.lowbit_report.left_float
    x = torch.randn(64, 8)
    assert sqnr(model(x), run_silent(q, x)) > 20


def test_qconfig_mapping_excludes_modules_and_functions():
    model = ResNet().eval()
    mapping = (Q.QConfigMapping().set_global(Q.get_minmax_qconfig()).set_module_name("fc", None)
               .set_object_type(operator.add, None))
    _, q = ptq(model, (8, 3, 12, 12), qconfig=mapping)
    assert type(q.fc) is nn.Linear and QFunctional not in quantized_types(q)
    assert nnq.ConvReLU2d in quantized_types(q)
    x = torch.randn(8, 3, 12, 12)
    assert sqnr(model(x), run_silent(q, x)) > 20



@pytest.mark.parametrize("act", [nn.ReLU6, nn.ReLU])
def test_an_excluded_layers_batchnorm_and_activation_stay_float(act):
    """``set_module_name(conv, None)`` keeps the conv's whole run float, as torch.ao's fused module under the conv's
    qconfig does: its BatchNorm must not become an int8 op of its own (it once did: BN + ReLU fused into a quantized
    BNReLU2d on the conv's wide pre-BN output). As in torch.ao the BN is folded into the float conv (session 41: it
    stayed a module of its own) and a ReLU fused with it (a float ``nni.ConvReLU2d``); a ReLU6 (torch.ao does not fuse
    it) stays a float module. The float run computes the float model's first three modules, and only the next conv's
    input is quantized."""
    from lowbit.nn import intrinsic as nni

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act(), nn.Conv2d(8, 4, 3, padding=1)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.1, 2)
    x = torch.randn(4, 3, 8, 8)
    mapping = Q.get_default_qconfig_mapping().set_module_name("0", None)
    p = prepare_fx(copy.deepcopy(model), mapping, example_inputs=(x,))
    observed_inputs = [n.args[0].target for n in p.graph.nodes if n.op == "call_module" and "post_process" in n.target]
    last_float = "0" if act is nn.ReLU else "2"
    assert observed_inputs == [last_float, "3"], observed_inputs  # the run's float output, then conv 3's
    p(x)
    q = convert_fx(p)
    run = [getattr(q, k) for k in "012" if hasattr(q, k)]
    assert [type(m) for m in run] == ([nni.ConvReLU2d] if act is nn.ReLU else [nn.Conv2d, act])
    assert isinstance(getattr(q, "3"), nnq.Conv2d)
    with torch.no_grad():
        head, out = model[2](model[1](model[0](x))), x
        for m in run:
            out = m(out)
        assert torch.allclose(out, head, atol=1e-5)
        assert sqnr(model(x), run_silent(q, x)) > 30


def test_default_qconfig_and_no_example_inputs():
    model = Block().eval()
    p = prepare_fx(model)  # default histogram recipe; tensor kinds by heuristic
    p(torch.randn(4, 10, 32))
    q = convert_fx(p)
    x = torch.randn(4, 10, 32)
    assert sqnr(model(x), run_silent(q, x)) > 20


# ---- untraceable submodules ----
class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * 2 if x.sum() > 0 else self.fc(x)  # data-dependent control flow


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(8, 8), Gate(), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(F.relu(self.gate(self.a(x))) + x)


def test_untraceable_submodule_is_reported_and_its_children_quantized():
    model = WithGate().eval()
    x = torch.randn(32, 8)
    with pytest.warns(UserWarning, match="'gate' \\(Gate\\) cannot be traced"):
        p = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
    assert "gate" in p.lowbit_report.untraceable and "children" in p.lowbit_report.untraceable["gate"]
    p(x)
    q = convert_fx(p)
    assert isinstance(q.gate, Gate) and isinstance(q.gate.fc, fx.GraphModule)
    assert quantized_types(q).count(nnq.Linear) == 3
    assert sqnr(model(x), run_silent(q, x)) > 20


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(int(x.abs().sum() > 0) + 1):
            x = self.fc1(x)
        return self.fc2(x)


def test_untraceable_root_prepares_children():
    model = Untraceable().eval()
    x = torch.randn(16, 8)
    with pytest.warns(UserWarning, match="<root>"):
        p = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
    assert isinstance(p, Untraceable) and isinstance(p.fc1, fx.GraphModule)
    p(x)
    q = convert_fx(p)
    assert quantized_types(q).count(nnq.Linear) == 2 and isinstance(q.lowbit_report, FxReport)
    assert sqnr(model(x), run_silent(q, x)) > 20


def test_bare_leaf_root():
    lin = nn.Linear(4, 3)
    p = prepare_fx(lin, Q.get_minmax_qconfig(), example_inputs=(torch.randn(2, 4),))
    x = torch.randn(64, 4)
    p(x)
    q = convert_fx(p)
    assert isinstance(q.module, nnq.Linear)
    assert sqnr(lin(x), run_silent(q, x)) > 20


# ---- workflow contracts ----
def test_not_inplace_leaves_model_untouched_and_state_dict_roundtrips():
    model = ResNet().eval()
    state = copy.deepcopy(model.state_dict())
    p, q = ptq(model, (4, 3, 12, 12))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert not any("qconfig" in m.__dict__ for m in model.modules())
    assert not any("qconfig" in m.__dict__ for m in q.modules())
    q2 = copy.deepcopy(q)
    x = torch.randn(2, 3, 12, 12)
    assert torch.equal(run_silent(q, x), run_silent(q2, x))
    q2.load_state_dict(q.state_dict())
    assert torch.equal(run_silent(q, x), run_silent(q2, x))


def test_conv_bn_in_train_mode_needs_eval():
    with pytest.raises(ValueError, match="eval"):
        prepare_fx(ResNet().train(), Q.get_minmax_qconfig())


@pytest.mark.parametrize("call, err, match", [
    (lambda: prepare_fx("model"), TypeError, "model must be an nn.Module, got str"),
    (lambda: prepare_fx(nn.Linear(2, 2), example_inputs=[torch.randn(1, 2)]), TypeError,
     "example_inputs must be a tuple"),
    (lambda: prepare_fx(nn.Linear(2, 2), inplace="yes"), TypeError, "inplace must be a bool"),
    (lambda: prepare_fx(nn.Linear(2, 2), qconfig_mapping="x"), TypeError, "qconfig="),
    (lambda: prepare_qat_fx(3), TypeError, "model must be an nn.Module, got int"),
    (lambda: convert_fx(nn.Linear(2, 2)), TypeError, "prepare_fx or prepare_qat_fx, got Linear"),
    (lambda: convert_fx(None), TypeError, "not an nn.Module"),
    (lambda: prepare_fx(nn.Linear(2, 2), example_inputs=(torch.randn(1, 3),)), ValueError, "example_inputs failed"),
])
def test_bad_input(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_bad_workflow_order():
    p = prepare_fx(nn.Sequential(nn.Linear(2, 2)), Q.get_minmax_qconfig())
    with pytest.raises(ValueError, match="already prepared"):
        prepare_fx(p)
    with pytest.raises(RuntimeError, match="saw no data"):
        convert_fx(p)
    p(torch.randn(4, 2))
    q = convert_fx(p)
    with pytest.raises(ValueError, match="already converted"):
        convert_fx(q)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        convert_fx(p, inplace=1)


class MaskedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask=None, scale=1.0):
        y = self.fc(x) * scale
        return y if mask is None else y + mask


class CallsMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = MaskedScale()

    def forward(self, x):
        if x.sum() > 0:  # untraceable: inner is prepared as its own graph with captured inputs
            return self.inner(x, mask=None, scale=2.0)
        return self.inner(x, None, 2.0)


def test_captured_child_inputs_none_and_runtime_scalar():
    model = CallsMasked().eval()
    x = torch.randn(16, 8)
    with pytest.warns(UserWarning, match="<root>"):
        p = prepare_fx(model, Q.get_minmax_qconfig(), example_inputs=(x,))
    assert isinstance(p.inner, fx.GraphModule)
    p(x), p(-x)
    q = convert_fx(p)
    assert "QFunctional.mul_scalar" in " ".join(q.lowbit_report.converted.values())
    assert sqnr(model(x), run_silent(q, x)) > 20 and sqnr(model(-x), run_silent(q, -x)) > 20


class SharedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.relu = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        return self.fc(self.relu(self.fc(x))) + self.fc(x)  # one Linear at three call sites


def test_module_called_at_several_sites_shares_one_observer():
    model = SharedLayer().eval()
    p, q = ptq(model, (32, 8))
    assert len({n.target for n in p.graph.nodes if n.op == "call_module" and "activation_post" in n.target
                and n.args[0].target == "fc"}) == 1
    assert isinstance(q.fc, nnq.Linear) and not isinstance(q.fc, nnq.LinearReLU)
    x = torch.randn(32, 8)
    assert sqnr(model(x), run_silent(q, x)) > 20


class AllPatterns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1, self.r1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
        self.c2 = nn.Conv2d(4, 4, 1)
        self.b3 = nn.BatchNorm2d(4)
        self.l1, self.l2, self.bl = nn.Linear(4 * 4 * 4, 8), nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):  # (N, 3, 6, 6)
        x = self.r1(self.b1(self.c1(x)))       # conv-bn-relu (nn.ReLU)
        x = F.relu(self.c2(x))                 # conv-relu (F.relu)
        x = torch.relu(self.b3(x))             # bn-relu (torch.relu)
        x = self.l1(x.flatten(1)).relu()       # linear-relu (.relu())
        return self.bl(self.l2(x))             # linear-bn


@pytest.mark.parametrize("qat", [False, True])
def test_fusion_patterns(qat):
    model = with_bn_stats(AllPatterns(), (8, 3, 6, 6))
    x = torch.randn(8, 3, 6, 6)
    p = (prepare_qat_fx if qat else prepare_fx)(model, example_inputs=(x,))
    fused = " | ".join(p.lowbit_report.fused)
    for run in ("Conv2d + BatchNorm2d + ReLU", "Conv2d + ReLU", "BatchNorm2d + ReLU", "Linear + ReLU",
                "Linear + BatchNorm1d"):
        assert run in fused, run
    p.eval()
    with torch.no_grad():
        p(x)
    q = convert_fx(p)
    types = quantized_types(q)
    assert types.count(nnq.ConvReLU2d) == 2 and nnq.LinearReLU in types and types.count(nnq.Linear) == 1
    assert not any(isinstance(m, nn.BatchNorm1d) for m in q.modules())


def test_graph_modules_pickle_round_trip() -> None:
    """torch.save/torch.load of prepared and converted GraphModules (fx re-creates the tracer with no arguments)."""
    import io

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8)
    prepared = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), example_inputs=(x,))
    prepared(x)
    converted = Q.convert_fx(prepared)
    for gm in (prepared, converted):
        buf = io.BytesIO()
        torch.save(gm, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(gm(x), loaded(x))
