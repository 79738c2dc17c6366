"""Fusion: exact BN folding for every pattern (1d/2d/3d), QAT markers, clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
import lowbit.nn.intrinsic as nni
from lowbit.fuse import fuse_modules, fuse_modules_qat
from lowbit.nn.intrinsic import fold_bn_weights


torch.manual_seed(0)
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
SIZE = {1: (2, 3, 9), 2: (2, 3, 7, 7), 3: (2, 3, 5, 5, 5)}


def _randomize_bn(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.3, 2.0)
        if bn.affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return bn


def _net(*mods):
    for m in mods:
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            _randomize_bn(m)
    return nn.Sequential(*mods).eval()


def _check_exact(model, groups, x, fused_types):
    fused = fuse_modules(model, groups)
    assert [type(m) for m in fused] == fused_types
    torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    return fused


@pytest.mark.parametrize("d", [1, 2, 3])
def test_conv_bn_folds_exactly(d):
    m = _net(CONV[d](3, 4, 3, bias=d != 2), BN[d](4))
    _check_exact(m, ["0", "1"], torch.randn(SIZE[d]), [CONV[d], nn.Identity])


@pytest.mark.parametrize("d", [1, 2, 3])
def test_conv_bn_relu_folds_exactly(d):
    m = _net(CONV[d](3, 4, 3), BN[d](4), nn.ReLU())
    types = [getattr(nni, f"ConvReLU{d}d"), nn.Identity, nn.Identity]
    f = _check_exact(m, [["0", "1", "2"]], torch.randn(SIZE[d]), types)
    assert type(f[0][0]) is CONV[d]


@pytest.mark.parametrize("d", [1, 2, 3])
def test_conv_relu(d):
    m = _net(CONV[d](3, 4, 3), nn.ReLU())
    _check_exact(m, ["0", "1"], torch.randn(SIZE[d]), [getattr(nni, f"ConvReLU{d}d"), nn.Identity])


@pytest.mark.parametrize("d", [1, 2, 3])
def test_convtranspose_bn_folds_exactly(d):
    ct = getattr(nn, f"ConvTranspose{d}d")(3, 4, 3, stride=2, groups=1)
    m = _net(ct, BN[d](4))
    _check_exact(m, ["0", "1"], torch.randn(SIZE[d]), [type(ct), nn.Identity])


def test_linear_patterns_and_bn_relu():
    x = torch.randn(8, 5)
    _check_exact(_net(nn.Linear(5, 6), nn.ReLU()), ["0", "1"], x, [nni.LinearReLU, nn.Identity])
    _check_exact(_net(nn.Linear(5, 6), nn.BatchNorm1d(6)), ["0", "1"], x, [nn.Linear, nn.Identity])
    _check_exact(_net(nn.BatchNorm2d(3), nn.ReLU()), ["0", "1"], torch.randn(SIZE[2]), [nni.BNReLU2d, nn.Identity])
    _check_exact(_net(nn.BatchNorm3d(3), nn.ReLU()), ["0", "1"], torch.randn(SIZE[3]), [nni.BNReLU3d, nn.Identity])


def test_non_affine_bn_and_padding_survive():
    m = _net(nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect"), nn.BatchNorm2d(4, affine=False))
    f = _check_exact(m, ["0", "1"], torch.randn(SIZE[2]), [nn.Conv2d, nn.Identity])
    assert f[0].padding == "same" and f[0].padding_mode == "reflect"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = _randomize_bn(nn.BatchNorm2d(3))
        self.relu = nn.ReLU()
        self.head = nn.Sequential(nn.Linear(3, 4), nn.ReLU())

    def forward(self, x):
        return self.head(self.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_nested_names_list_of_lists_and_inplace():
    m = nn.Sequential(Block()).eval()
    x = torch.randn(SIZE[2])
    groups = [["0.conv", "0.bn", "0.relu"], ["0.head.0", "0.head.1"]]
    f = fuse_modules(m, groups)
    assert f is not m and type(m[0].conv) is nn.Conv2d  # original untouched
    assert type(f[0].conv) is nni.ConvReLU2d and type(f[0].head[0]) is nni.LinearReLU
    torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    g = fuse_modules(m, groups, inplace=True)
    assert g is m and type(m[0].bn) is nn.Identity


@pytest.mark.parametrize("mods, match", [
    ((nn.Conv2d(3, 3, 3), nn.Hardtanh(-1.0, 1.0)), r"cannot fuse \(Conv2d, Hardtanh\)"),  # ReLU6 fuses (ClampedReLU)
    ((nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.Sigmoid()), r"cannot fuse \(Conv2d, BatchNorm2d, Sigmoid\)"),
    ((nn.Conv2d(3, 3, 3), nn.BatchNorm1d(3)), r"cannot fuse \(Conv2d, BatchNorm1d\)"),
    ((nn.ReLU(), nn.Linear(3, 3)), r"cannot fuse \(ReLU, Linear\)"),
])
def test_unfusable_pattern_raises(mods, match):
    with pytest.raises(ValueError, match=match):
        fuse_modules(nn.Sequential(*mods).eval(), [str(i) for i in range(len(mods))])


def test_bad_arguments():
    m = _net(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="no submodule named 'nope'"):
        fuse_modules(m, ["0", "nope"])
    with pytest.raises(ValueError, match="eval mode"):
        fuse_modules(m.train(), ["0", "1"])
    with pytest.raises(ValueError, match=r"BatchNorm2d\(5"):
        fuse_modules(_net(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(5)), ["0", "1"])
    with pytest.raises(TypeError, match="modules_to_fuse"):
        fuse_modules(m, "0")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        fuse_modules("model", ["0", "1"])
    with pytest.raises(TypeError, match="inplace"):
        fuse_modules(m, ["0", "1"], inplace=1)
    with pytest.raises(TypeError, match="ConvReLU2d expects"):
        nni.ConvReLU2d(nn.Conv2d(1, 1, 1))


@pytest.mark.parametrize("d", [1, 2, 3])
def test_fuse_qat_keeps_markers(d):
    m = nn.Sequential(CONV[d](3, 4, 3), BN[d](4), nn.ReLU(), CONV[d](4, 4, 1), BN[d](4), CONV[d](4, 4, 1), nn.ReLU())
    qc = Q.get_default_qat_qconfig()
    f = fuse_modules_qat(m, [["0", "1", "2"], ["3", "4"], ["5", "6"]], qconfig=qc)
    assert [type(f[i]) for i in (0, 3, 5)] == [getattr(nni, f"ConvBnReLU{d}d"), getattr(nni, f"ConvBn{d}d"),
                                               getattr(nni, f"ConvReLU{d}d")]
    assert f[0].qconfig is qc and f.training
    x = torch.randn(SIZE[d])
    torch.testing.assert_close(f(x), m(x))  # markers compute the unfused float function
    lb = fuse_modules_qat(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), ["0", "1"])
    assert type(lb[0]) is nni.LinearBn1d
    ct = fuse_modules_qat(nn.Sequential(nn.ConvTranspose2d(3, 3, 3), nn.BatchNorm2d(3)), ["0", "1"])
    assert type(ct[0]) is nni.ConvTransposeBn2d  # (session 40: trained by nniqat.ConvTransposeBn2d)
    with pytest.raises(ValueError, match="fuse_modules_qat: cannot fuse"):
        fuse_modules_qat(nn.Sequential(nn.ConvTranspose2d(3, 3, 3), nn.BatchNorm2d(3), nn.ReLU()), ["0", "1", "2"])
    with pytest.raises(TypeError, match="qconfig"):
        fuse_modules_qat(m, ["0", "1"], qconfig="x")


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 3), cin=st.integers(1, 4), groups=st.sampled_from([1, 2]), k=st.integers(1, 3),
       bias=st.booleans(), affine=st.booleans(), transpose=st.booleans(), seed=st.integers(0, 2**16))
def test_fold_bn_weights_property(d, cin, groups, k, bias, affine, transpose, seed):
    """bn_eval(layer(x)) == layer with (W', b') for random shapes, groups, bias/affine, transpose."""
    torch.manual_seed(seed)
    cin, cout = cin * groups, 2 * groups
    layer = getattr(nn, f"ConvTranspose{d}d" if transpose else f"Conv{d}d")(cin, cout, k, groups=groups, bias=bias)
    bn = _randomize_bn(BN[d](cout, affine=affine)).eval()
    w, b = fold_bn_weights(layer.weight.detach(), None if layer.bias is None else layer.bias.detach(), bn,
                           transpose=transpose, groups=groups)
    x = torch.randn((2, cin) + (4,) * d)
    op = getattr(torch.nn.functional, f"conv_transpose{d}d" if transpose else f"conv{d}d")
    torch.testing.assert_close(op(x, w, b, groups=groups), bn(layer(x)), atol=1e-5, rtol=1e-5)
