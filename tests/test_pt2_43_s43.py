"""Session 43 PT2 sweep (``pt2_43``): a 1-d conv's traced codes in eager's layout, and a switch buffer written in place
or reassigned after tracing refused by the compiled / exported program (it ran the stale branch silently)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)

torch._dynamo.config.cache_size_limit = 64


class _Conv1dMean(nn.Module):
    """A quantized Conv1d / ConvTranspose1d, then float reductions of its dequantized output (they add in memory
    order: a layout change moves their last bits)."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        conv = nn.ConvTranspose1d if transposed else nn.Conv1d
        self.conv = conv(4, 6, 3, padding=1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.dequant(self.conv(self.quant(x)))
        return torch.stack([a.mean(), a.sum(), a.std()])


def _conv1d(transposed: bool) -> nn.Module:
    torch.manual_seed(0)
    p = Q.prepare(_Conv1dMean(transposed).eval(), Q.get_default_qconfig())
    for _ in range(3):
        p(torch.randn(8, 4, 10))
    return Q.convert(p)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv1d", "conv_transpose1d"])
def test_traced_conv1d_codes_keep_the_eager_layout(transposed: bool) -> None:
    """Eager 1-d convs give ``(N, C, L)`` codes with strides ``(L·C, 1, C)`` (oneDNN runs them as channels-last 2-d
    convs); ``lowbit::qconv_cfg`` made them contiguous, so a compiled / exported model's float reductions after the
    dequantize added in another order: a session-43 probe's ``mean`` was 3e-8 off eager. Now the op and its fake give
    eager's strides for a 1-d config string marked ``nlc`` (what traces emit), and the outputs are eager's bit for
    bit; an unmarked string (programs and AOTInductor packages traced before) keeps the contiguous codes."""
    model = _conv1d(transposed)
    torch.manual_seed(5)
    x = torch.randn(5, 4, 10)
    with torch.no_grad():
        codes = model.conv(model.quant(x))
        ref = model(x)
    conv, q = model.conv, model.quant(x)
    from lowbit.compile_state import conv_config, qdtype_key

    spec = conv._spec
    weight, out = conv._prepared()
    cfg = conv_config(qdtype_key(q.qdtype), qdtype_key(weight.qdtype), qdtype_key(out.qdtype), False,
                      list(spec.stride), list(spec.padding), list(spec.dilation), spec.groups, spec.transposed,
                      list(spec.output_padding))
    args = (q.int_repr(), q.scale, q.zero_point, weight.int_repr(), weight.scale, weight.zero_point, conv.bias,
            out.scale_t, out.zero_point_t, cfg)
    got = torch.ops.lowbit.qconv_cfg(*args)
    assert torch.equal(got, codes.int_repr()) and got.stride() == codes.int_repr().stride() == (60, 1, 6)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.lowbit.qconv_cfg(*args)
    assert fake.stride() == got.stride() and cfg.endswith("|nlc")
    legacy = torch.ops.lowbit.qconv_cfg(*args[:-1], cfg.removesuffix("|nlc"))  # (traced before: contiguous, as built)
    assert torch.equal(legacy, got) and legacy.is_contiguous()
    with pytest.raises(ValueError, match=r"config='.*\|nlc' is not conv_config's ten"):
        torch.ops.lowbit.qconv_cfg(*args[:-1], cfg.replace("|1|", "|1,1|", 1))  # (nlc on a 2-d geometry)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(model, (x[:3],), dynamic_shapes=({0: batch},)).module()
    with torch.no_grad():
        assert torch.equal(compiled(x), ref), (compiled(x) - ref).abs().max()
        assert torch.equal(exported(x), ref), (exported(x) - ref).abs().max()


_FQS = {"fake_quantize": lambda: Q.FakeQuantize(), "fused": lambda: Q.FusedMovingAvgObsFakeQuantize(),
        "learnable": lambda: Q.LearnableFakeQuantize()}


def _write(fq: nn.Module, name: str, how: str) -> None:
    if how == "in_place":  # (DDP's buffer broadcast writes this way)
        getattr(fq, name)[0] = 0
    else:
        setattr(fq, name, torch.tensor([0], dtype=torch.uint8))


@pytest.mark.parametrize("how", ["in_place", "reassigned"])
@pytest.mark.parametrize("name", ["fake_quant_enabled", "observer_enabled"])
@pytest.mark.parametrize("kind", sorted(_FQS))
def test_compiled_fake_quant_refuses_a_switch_written_behind_its_back(kind: str, name: str, how: str) -> None:
    """A switch buffer written in place or reassigned after ``torch.compile`` traced the module: dynamo guards on the
    Python mirror (no tensor value, and ``_version`` is read as a constant), so the compiled program ran the branch
    it was traced with, silently (fake quantization or observation still on; 9 of 9 probes of session 43). Now the
    traced graph checks the buffer against the branch and raises naming the switch and the way out, leaving the state
    as it was; after the switch method the compiled module equals eager again."""
    torch.manual_seed(0)
    fq, x = _FQS[kind](), torch.randn(64) * 3
    fq(x)
    ref = copy.deepcopy(fq)
    torch._dynamo.reset()
    compiled = torch.compile(fq, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), ref(x))
    _write(fq, name, how)
    before = {k: v.clone() for k, v in fq.state_dict().items()}
    x2 = torch.randn(64) * 5
    with pytest.raises(RuntimeError, match=rf"{type(fq).__name__}: switch {name} was traced on \(1\) but its buffer "
                                           r"now reads otherwise.*set it with enable_"):
        compiled(x2)
    assert all(torch.equal(v, fq.state_dict()[k]) for k, v in before.items())
    method = "enable_fake_quant" if name == "fake_quant_enabled" else "enable_observer"
    getattr(fq, method)(False)
    getattr(ref, method)(False)
    assert torch.equal(compiled(x2), ref(x2)) and torch.equal(fq.scale, ref.scale)


def test_exported_qat_model_refuses_a_switch_written_after_export() -> None:
    """An exported eval QAT model (observers off) whose fake-quant switch is then written in place: the program was
    traced with fake quantization on and kept applying it (silently the output of another model); now it raises. A
    model written in place *before* export, without an eager forward, is refused the same way (the mirror it traced
    with was stale); the untouched program runs as before."""
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Linear(8, 4), Q.DeQuantStub())
    m.qconfig = Q.get_default_qat_qconfig()
    p = Q.prepare_qat(m.train())
    x = torch.randn(16, 8)
    p(x)
    p.eval().apply(Q.disable_observer)
    program = torch.export.export(p, (x,)).module()
    assert torch.equal(program(x), p(x))
    fq = p[1].weight_fake_quant
    fq.fake_quant_enabled[0] = 0
    program_state = dict(program.named_buffers())
    if program_state["1.weight_fake_quant.fake_quant_enabled"].data_ptr() != fq.fake_quant_enabled.data_ptr():
        program_state["1.weight_fake_quant.fake_quant_enabled"][0] = 0  # (export held a copy: write it there)
    with pytest.raises(RuntimeError, match="switch fake_quant_enabled was traced on"):
        program(x)
    stale = torch.export.export(p, (x,)).module()  # (traced on the mirror: no eager forward since the write)
    with pytest.raises(RuntimeError, match="switch fake_quant_enabled was traced on"):
        stale(x)
    p(x)  # one eager forward refreshes the mirror
    assert torch.equal(torch.export.export(p, (x,)).module()(x), p(x))


class _FloatInside(nn.Module):
    """An eager-mode model whose middle conv has no qconfig: it receives a QTensor and runs on its dequantized floats
    (lowbit warns once per op)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.c3(self.quant(self.c2(self.c1(self.quant(x))))))


def test_float_fallback_warning_does_not_break_a_fullgraph_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The float-fallback warning (``warnings.warn``) inside the traced forward: dynamo cannot trace it, so
    ``torch.compile(fullgraph=True)`` of an eager model with a float layer in its quantized region raised
    "Attempted to call function marked as skipped" (``_warnings.warn``) when it compiled before any eager call had
    warned. Now the compiled model gives eager's output, and the first eager call still warns."""
    from lowbit import qtensor

    torch.manual_seed(0)
    m = _FloatInside().eval()
    m.qconfig, m.c2.qconfig = Q.get_default_qconfig(), None
    p = Q.prepare(m)
    p(torch.randn(8, 3, 6, 6))
    q = Q.convert(p)
    x = torch.randn(5, 3, 6, 6)
    monkeypatch.setattr(qtensor, "_warned_ops", set())
    torch._dynamo.reset()
    got = torch.compile(q, fullgraph=True, backend="aot_eager")(x)
    with pytest.warns(UserWarning, match="torch.conv2d has no integer implementation for QTensor inputs"):
        ref = q(x)
    assert torch.equal(got, ref)
