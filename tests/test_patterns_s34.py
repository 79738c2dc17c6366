"""Session 34's real-model pattern sweep: ordinary PyTorch code through graph mode, eager mode and ``quantize_ptq``,
each case one that gave silent garbage, a deep crash or a failed compile before its fix.

- eager ``nn.ConstantPad2d(p, v)`` with ``v`` past the grid of the layer before it: the pad code saturated (10.9 dB);
- ``torch.compile(fullgraph=True)`` of the 9th ``convert_fx`` model in a process: ``FailOnRecompileLimitHit``
  (every converted model shared one dynamo frame, ``fx/call.py``);
- ``lowbit::qfunctional`` on a broadcasting ``mul`` of channels-last codes (squeeze-excite's gate): its fake
  promised contiguous codes, inductor's stride assertion failed the compiled model;
- ``quantize_ptq(recipe="balanced")`` bias correction of a Linear on ``(N, T, C)`` inputs summed over ``T`` as if it
  were the channel axis (a crash where ``T != C``, a wrong correction where ``T == C``);
- a conv with asymmetric zero padding (``padding="same"`` with an even kernel) under ``torch.compile`` / ``torch.export``:
  its explicit pad read the zero point with ``int()``, a data-dependent guard;
- ``quantize_dynamic`` of ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder``: their eval fast-path checks read
  ``linear1.weight.device``, and torch.ao's (and lowbit's) ``weight`` was a method.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from lowbit.qtensor import QTensor


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _fx(model: nn.Module, x: torch.Tensor) -> nn.Module:
    p = Q.prepare_fx(copy.deepcopy(model).eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    with torch.no_grad():
        for i in range(3):
            p(x + 0.05 * i)
    return Q.convert_fx(p)


def test_eager_constant_pad_past_the_grid_runs_float():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ConstantPad2d(2, 3.0), nn.Conv2d(8, 4, 3)).eval()
    x = torch.randn(4, 3, 12, 12)
    p = Q.prepare(nn.Sequential(Q.QuantStub(), *copy.deepcopy(m), Q.DeQuantStub()), Q.get_default_qconfig())
    with torch.no_grad():
        for i in range(3):
            p(x + 0.05 * i)
    q = Q.convert(p)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # (the pad's float fallback is warned)
        assert _sqnr(m(x), q(x)) > 36  # 10.9 dB before: 3.0 padded as the grid's top, ~1.5


def test_qtensor_constant_pad_keeps_codes_only_for_values_on_the_grid():
    qt = Q.quantize_per_tensor(torch.tensor([[[-1.0, 0.0, 1.0]]]), 0.01, 128, Q.quint8)  # grid [-1.28, 1.27]
    inside = F.pad(qt, (1, 1), value=0.5)
    assert isinstance(inside, QTensor) and inside.int_repr()[0, 0, 0] == 178
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outside = F.pad(qt, (1, 1), value=3.0)
    assert not isinstance(outside, QTensor)
    torch.testing.assert_close(outside, torch.tensor([[[3.0, -1.0, 0.0, 1.0, 3.0]]]))


def test_compiling_many_converted_models_in_one_process():
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    with torch._dynamo.config.patch(recompile_limit=2):  # (8 by default: the 9th model failed)
        for i in range(4):
            torch.manual_seed(i)
            q = _fx(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), x)
            with torch.no_grad():
                assert torch.equal(torch.compile(q, backend="eager", fullgraph=True)(x), q(x)), i
    torch._dynamo.reset()


@pytest.mark.parametrize("swap", [False, True], ids=["h*w", "w*h"])
def test_qfunctional_broadcast_mul_fake_strides_match(swap):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import lowbit.pt2  # noqa: F401  (registers the ops)

    h = torch.randint(0, 255, (2, 6, 5, 5), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    w = torch.randint(0, 255, (2, 6, 1, 1), dtype=torch.uint8)
    s, z = torch.tensor(0.02), torch.tensor(128)
    a, b = (w, h) if swap else (h, w)

    def call(a, b, s, z):
        return torch.ops.lowbit.qfunctional("mul", a, s, z, "quint8:0:255", b, s, z, "quint8:0:255", 0.0, s, z, "quint8:0:255")

    real = call(a, b, s, z)
    with FakeTensorMode() as mode:
        fake = call(*(mode.from_tensor(t) for t in (a, b, s, z)))
    assert fake.shape == real.shape and fake.stride() == real.stride()


class _SE(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.out = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 4, 1)

    def forward(self, x):
        h = F.relu(self.c(x))
        return self.out(h * F.adaptive_avg_pool2d(h, 1).flatten(1)[:, :, None, None])


def test_squeeze_excite_export_strides_hold():
    """The exported program's op strides (the fake's) are the eager codes' (inductor asserts them)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    q = _fx(_SE().eval(), x)
    with torch.no_grad():
        ep = torch.export.export(q, (x,))
        assert torch.equal(ep.module()(x), q(x))
    node = next(n for n in ep.graph.nodes if n.target is torch.ops.lowbit.qfunctional.default)
    h = node.args[1].meta["val"]
    assert node.meta["val"].stride() == torch.empty_like(h).stride()


def test_balanced_bias_correction_on_token_linears():
    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.o = nn.Linear(16, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.o(F.relu(self.a(x)) + 1.0)

    torch.manual_seed(0)
    m = Tok().eval()
    calib = [torch.randn(8, 5, 16) + torch.linspace(-3, 3, 5)[:, None] for _ in range(4)]
    q, _ = Q.quantize_ptq(m, calib, recipe="balanced", progress=False)  # crashed: (8,) vs (5,) channels
    x = torch.randn(8, 5, 16) + torch.linspace(-3, 3, 5)[:, None]
    with torch.no_grad():
        assert _sqnr(m(x), q(x)) > 42


class _SamePad(nn.Module):
    """An even kernel with padding="same" (left 1, right 2: padded explicitly, on the input's zero point) and a
    reflect-padded conv."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 4, padding="same")
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")

    def forward(self, x):
        return self.c2(F.relu(self.c1(x)))


def test_asymmetric_zero_padding_compiles_and_exports():
    """The explicit zero pad read the zero point with int(): a data-dependent guard stopped torch.compile and
    torch.export; traced, it now pads q - z with zeros (the same codes)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    m = _SamePad().eval()
    q = _fx(m, x)
    with torch.no_grad():
        ref = q(x)
        assert _sqnr(m(x), ref) > 25  # (the eager int8 model: 34 dB)
        assert torch.equal(torch.compile(q, fullgraph=True)(x), ref)
        assert torch.equal(torch.export.export(q, (x,)).module()(x), ref)


def test_dynamic_transformer_encoder_layers_run():
    """torch.ao's ``weight()`` method failed nn.TransformerEncoderLayer's / nn.TransformerEncoder's fast-path checks
    in eval mode ("'function' object has no attribute 'device'"; torch.ao fails alike): the dynamic Linear's
    ``weight`` is now a callable tensor-like (``WeightAccessor``), and those layers take their module-by-module path."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    m = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    q = Q.quantize_dynamic(m)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2).eval()
    qe = Q.quantize_dynamic(enc)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's nested-tensor prototype warning on the float fast path)
        assert _sqnr(m(x), q(x)) > 40  # (55 dB)
        r, o = enc(x, src_key_padding_mask=mask), qe(x, src_key_padding_mask=mask)
    keep = ~mask  # (the float model's nested-tensor fast path zeros padded positions; the module path computes them)
    assert _sqnr(r[keep], o[keep]) > 40  # (51 dB)
    assert q.linear1.weight().qdtype == Q.qint8 and q.linear1.weight.device == x.device


class _ExplicitPad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)

    def forward(self, x):
        return self.b(F.pad(F.relu(self.a(x)), (1, 2, 1, 2)))  # TF-"same"-style zero pad between int8 convs


def test_an_explicit_zero_pad_of_codes_compiles_and_exports():
    """The QTensor's own constant pad (graph mode keeps F.pad on the codes) read its fill code with int(): the same
    data-dependent guard as the conv's padding, fixed where both pads now go (qtensor/ops.py)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 10)
    q = _fx(_ExplicitPad().eval(), x)
    with torch.no_grad():
        ref = q(x)
        assert torch.equal(torch.compile(q, fullgraph=True)(x), ref)
        assert torch.equal(torch.export.export(q, (x,)).module()(x), ref)


class _ViewHead(nn.Module):
    """A conv whose output the user's code flattens with ``view`` (or ``reshape``) before a Linear."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.c, self.fc = how, nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        y = F.relu(self.c(x))
        return self.fc(y.view(y.size(0), -1) if self.how == "view" else y.reshape(y.size(0), -1))


def test_view_of_a_quantized_conv_output_is_taken_in_nchw_order():
    """The conv's codes are channels-last (the int8 kernels' layout); ``y.view(n, -1)`` of them raised "view size is
    not compatible", where the float model's NCHW output views fine: it now views NCHW codes, as reshape does."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    m = _ViewHead("view").eval()
    r = _ViewHead("reshape").eval()
    r.load_state_dict(m.state_dict())
    qv, qr = _fx(m, x), _fx(r, x)
    with torch.no_grad():
        out = qv(x)
        assert torch.equal(out, qr(x))
        assert _sqnr(m(x), out) > 15  # (20 dB: a random 3x3 conv and a 512-wide Linear)
        assert torch.equal(torch.compile(qv, fullgraph=True)(x), out)
