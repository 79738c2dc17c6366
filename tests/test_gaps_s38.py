"""Graph-mode gaps (session 38): grid-preserving ops that stayed float, each behind a DeQuantize + Quantize pair.

Nearest-neighbour resampling (``F.interpolate`` / ``nn.Upsample`` / ``nn.UpsamplingNearest2d`` in ``"nearest"`` /
``"nearest-exact"`` mode: a UNet's decoder upsampling) and the code selections ``torch.roll`` / ``x.roll``,
``x.expand`` / ``x.expand_as``, ``x.repeat`` select input codes: after ``convert_fx`` they now run on the QTensor's
codes (``share``). Oracle: the reference model (``convert_to_reference_fx``), which the int8 model must equal
exactly where every op is exact; and the graph's Quantize / DeQuantize count.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
from helpers import Fn, UNet, one_thread  # noqa: F401  (autouse: one thread)
from lowbit import kernels
from lowbit.nn.quantized.stubs import DeQuantize, Quantize
from lowbit.reference.fx import convert_to_reference_fx


class Between(nn.Module):
    """conv → op → conv."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.c1, self.c2, self.fn = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.fn(self.c1(x)))


def _q_dq(gm: nn.Module) -> tuple[int, int]:
    mods = dict(gm.named_modules())
    kinds = [type(mods[n.target]) for n in gm.graph.nodes if n.op == "call_module"]
    return kinds.count(Quantize), kinds.count(DeQuantize)


def _convert_and_check(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Convert ``model``; assert the int8 model equals the reference model exactly, with no float fallback."""
    p = Q.prepare_fx(model.eval(), Q.get_default_qconfig_mapping(), example_inputs=(x,))
    p(x)
    ref = convert_to_reference_fx(copy.deepcopy(p))
    q = Q.convert_fx(p)
    with torch.no_grad(), kernels.use_backend("reference"), warnings.catch_warnings():
        warnings.simplefilter("error")  # (a QTensor float fallback warns)
        got, want = q(x), ref(x)
    assert torch.equal(got, want)
    return q


UPSAMPLES = {
    "Upsample-nearest": nn.Upsample(scale_factor=2, mode="nearest"),
    "Upsample-size-nearest-exact": nn.Upsample(size=(8, 8), mode="nearest-exact"),
    "UpsamplingNearest2d": nn.UpsamplingNearest2d(scale_factor=2),
    "F.interpolate": Fn(lambda t: F.interpolate(t, scale_factor=2)),
    "F.interpolate-nearest-exact": Fn(lambda t: F.interpolate(t, None, 2.0, "nearest-exact")),
    "F.interpolate-size-kw": Fn(lambda t: F.interpolate(t, size=(8, 8), mode="nearest")),
    "F.upsample_nearest": Fn(lambda t: F.upsample_nearest(t, scale_factor=2)),
}


@pytest.mark.parametrize("name", list(UPSAMPLES))
def test_nearest_upsampling_runs_on_the_codes(name):
    """A UNet decoder's nearest upsample sat between a DeQuantize and a Quantize (2 of each; torch.ao keeps it
    quantized); now only the model's input is quantized and its output dequantized."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (F.upsample_nearest is deprecated)
        q = _convert_and_check(UNet(copy.deepcopy(UPSAMPLES[name])), torch.randn(2, 3, 8, 8))
    assert _q_dq(q) == (1, 1)
    assert not q.lowbit_report.left_float


@pytest.mark.parametrize("up", [Fn(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", antialias=True)),
                                Fn(lambda t: F.interpolate(t, scale_factor=2, mode="bicubic"))],
                         ids=["F.interpolate-bilinear-antialias", "F.interpolate-bicubic"])
def test_averaging_upsampling_stays_float(up):
    """Bicubic and antialiased bilinear interpolation (no quantized kernel, torch's neither): still float and reported
    (plain bilinear runs on the codes since session 39: tests/test_bilinear_s39.py)."""
    torch.manual_seed(0)
    q = _convert_and_check(UNet(up), torch.randn(2, 3, 8, 8))
    assert _q_dq(q) == (2, 2) and len(q.lowbit_report.left_float) == 1


SELECTIONS = {
    "torch.roll": lambda t: torch.roll(t, 1, 2),
    "x.roll-dims": lambda t: t.roll((1, -2), (2, 3)),
    "x.roll-flat": lambda t: t.roll(3),
    "x.expand": lambda t: t[:, :, :1].expand(-1, -1, 8, -1),
    "x.expand_as": lambda t: t[:, :, :, :1].expand_as(t),
    "x.repeat": lambda t: t.repeat(1, 1, 2, 1),
    "x.repeat-new-dim": lambda t: t.repeat(1, 1, 1, 1, 1).flatten(0, 1),
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_code_selections_run_on_the_codes(name):
    """roll / expand / expand_as / repeat between two convs were float (a DeQuantize + Quantize pair)."""
    torch.manual_seed(0)
    q = _convert_and_check(Between(SELECTIONS[name]), torch.randn(2, 3, 8, 8))
    assert _q_dq(q) == (1, 1)
    assert not q.lowbit_report.left_float


class FloatExpandAs(nn.Module):
    """A float value expanded to the shape of an int one: the op moves float values (its int input gives a shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x)
        return F.gelu(x[:, :1].expand_as(y)) + y


def test_float_expand_as_an_int_value_stays_float():
    """The domain of a share op is its first argument's: ``x.expand_as(y)`` of a float ``x`` is float even where ``y``
    is int (it reads ``y`` through a DeQuantize), not a QTensor."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    q = _convert_and_check(FloatExpandAs(), x)
    node = next(n for n in q.graph.nodes if n.target == "expand_as")
    assert node.meta["lowbit_domain"] == "float"
    with torch.no_grad(), kernels.use_backend("reference"):
        y = q.c1(Q.quantize_per_tensor(x, 1.0, 0, Q.quint8)).dequantize()  # (shape only)
    assert y.shape == (2, 4, 4, 4)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dims", [2, 3])
def test_quantized_batchnorm_matches_torch_ao_code_for_code(dims, relu):
    """A standalone BatchNorm (DenseNet's pre-activation BN → ReLU) had no int8 module (torch.ao: nnq.BatchNorm2d/3d,
    nniq.BNReLU2d/3d); ``lowbit.nn.quantized.normalization.BatchNorm2d/3d`` / ``BNReLU2d/3d`` give torch.ao's codes."""
    import torch.ao.nn.intrinsic.quantized as tnniq
    import torch.ao.nn.quantized as tnnq

    from lowbit.nn.quantized import normalization as qn

    torch.manual_seed(dims + 2 * relu)
    C = 5
    bn = getattr(nn, f"BatchNorm{dims}d")(C).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.1, 3), bn.weight.uniform_(-2, 2)
        bn.bias.uniform_(-1, 1)
    x = torch.randn((3, C) + (6,) * dims) * 2
    s_in, z_in, s_out, z_out = 0.031, 121, 0.047, 97
    ref = getattr(tnniq if relu else tnnq, f"{'BNReLU' if relu else 'BatchNorm'}{dims}d")(C)
    ref.load_state_dict({**bn.state_dict(), "scale": torch.tensor(s_out), "zero_point": torch.tensor(z_out)},
                        strict=False)
    if relu:
        fused = getattr(Q.nn.intrinsic, f"BNReLU{dims}d")(bn, nn.ReLU())
        fused.activation_post_process = Q.observer.MinMaxObserver()
    else:
        fused = copy.deepcopy(bn)
        fused.activation_post_process = Q.observer.MinMaxObserver()
    fused.activation_post_process(torch.tensor([(0 - z_out) * s_out, (255 - z_out) * s_out]))
    mine = getattr(qn, f"{'BNReLU' if relu else 'BatchNorm'}{dims}d").from_float(fused)
    assert (mine.scale.item(), mine.zero_point.item()) == pytest.approx((s_out, z_out), rel=1e-6)
    mine.scale.fill_(s_out)
    with torch.no_grad():
        want = ref(torch.quantize_per_tensor(x, s_in, z_in, torch.quint8)).int_repr()
        got = mine(Q.quantize_per_tensor(x, s_in, z_in, Q.quint8))
    assert torch.equal(got.int_repr(), want)
    # the float value it stands for: bn(x̂) (relu'd), one output quantum
    xh = Q.quantize_per_tensor(x, s_in, z_in, Q.quint8).dequantize().double()
    y = bn.double()(xh).float()
    y = F.relu(y) if relu else y
    assert (got.dequantize() - y.clamp((0 - z_out) * s_out, (255 - z_out) * s_out)).abs().max() <= s_out / 2 + 1e-5


def test_quantized_batchnorm_refuses_what_it_cannot_run():
    from lowbit.nn.quantized import normalization as qn

    bn = nn.BatchNorm2d(3, track_running_stats=False)
    bn.activation_post_process = Q.observer.MinMaxObserver()
    bn.activation_post_process(torch.tensor([-1.0, 1.0]))
    with pytest.raises(ValueError, match="running statistics"):
        qn.BatchNorm2d.from_float(bn)
    with pytest.raises(TypeError, match="BNReLU2d"):
        qn.BNReLU2d.from_float(nn.BatchNorm2d(3))  # (a plain BN is not a BN-ReLU)
    m = qn.BatchNorm2d(3, scale=0.1, zero_point=10)
    with pytest.raises(ValueError, match=r"3 channels, got shape \(1, 4, 2, 2\)"):
        m(Q.quantize_per_tensor(torch.zeros(1, 4, 2, 2), 0.1, 10, Q.quint8))
