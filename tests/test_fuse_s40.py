"""Fusion and QAT BN folding (session 40): ConvTranspose + BatchNorm under QAT, Linear + BatchNorm1d on a 3-d input,
``freeze_bn`` / ``bn_fold`` in checkpoints. Oracles: torch.ao's ``fuse_modules`` (the eval fold), the unfused float
model (the QAT module with its fake-quant off), the converted int8 model (code for code). Each test marked
"before:" failed before its change."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.intrinsic as nni
import lowbit.nn.intrinsic.qat as nniqat
import lowbit.nn.quantized as nnq
from helpers import one_thread, roundtrip  # noqa: F401  (one_thread: autouse, this module runs on 1 thread)
from lowbit.fx import fuse_fx, prepare_fx, prepare_qat_fx

SIZES = {1: (16,), 2: (8, 8), 3: (4, 4, 4)}


def _bn(bn: nn.Module) -> nn.Module:
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return bn


def _ct_bn(d: int, groups: int) -> nn.Sequential:
    return nn.Sequential(getattr(nn, f"ConvTranspose{d}d")(4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups),
                         _bn(getattr(nn, f"BatchNorm{d}d")(6)))


def _sqnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(a.pow(2).mean() / (a - b).pow(2).mean().clamp_min(1e-30)))


@pytest.mark.parametrize("d", [1, 2, 3])
def test_eval_fold_of_conv_transpose_bn_is_torch_ao_s(d):
    """fuse_modules folds the BN along the transposed weight's axis 1: torch.ao's folded weight and bias (groups 1;
    torch.ao's fold fails on groups), and the float function for groups 2 (checked, already right)."""
    torch.manual_seed(d)
    m = _ct_bn(d, 1).eval()
    ours, theirs = Q.fuse_modules(m, [["0", "1"]]), tq.fuse_modules(m, [["0", "1"]])
    torch.testing.assert_close(ours[0].weight, theirs[0].weight, rtol=0, atol=1e-7)
    torch.testing.assert_close(ours[0].bias, theirs[0].bias, rtol=0, atol=1e-6)
    g = _ct_bn(d, 2).eval()
    x = torch.randn(2, 4, *SIZES[d])
    torch.testing.assert_close(Q.fuse_modules(g, [["0", "1"]])(x), g(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_qat_conv_transpose_bn_trains_the_bn_as_the_float_model(d, groups):
    """before: fuse_modules_qat refused (ConvTranspose2d, BatchNorm2d). Now it makes nni.ConvTransposeBn*d, which
    prepare_qat trains as nniqat.ConvTransposeBn*d: with its fake-quant off, forward, gradients and the BN's running
    statistics are the float model's (train mode), and frozen / eval it is the BN-folded transposed conv."""
    torch.manual_seed(0)
    m = _ct_bn(d, groups).train()
    fused = Q.fuse_modules_qat(m, [["0", "1"]])
    assert type(fused[0]) is getattr(nni, f"ConvTransposeBn{d}d")
    qat = Q.prepare_qat(fused, Q.get_default_qat_qconfig())
    mod = qat[0]
    assert type(mod) is getattr(nniqat, f"ConvTransposeBn{d}d")
    qat.apply(Q.disable_fake_quant)
    ref = copy.deepcopy(m)
    for _ in range(3):
        x = torch.randn(4, 4, *SIZES[d])
        y, want = qat(x), ref(x)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        y.square().mean().backward()
        want.square().mean().backward()
    assert mod.weight_fake_quant.scale.numel() == 6 // groups  # one grid per column of axis 1
    torch.testing.assert_close(mod.bn.running_mean, ref[1].running_mean)
    torch.testing.assert_close(mod.bn.running_var, ref[1].running_var)
    torch.testing.assert_close(mod.weight.grad, ref[0].weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mod.bn.weight.grad, ref[1].weight.grad, rtol=1e-4, atol=1e-5)
    mod.freeze_bn_stats()
    frozen = mod.bn.running_mean.clone()
    x = torch.randn(4, 4, *SIZES[d])
    out = qat(x)  # frozen: the eval fold, output_size honoured as by the float layer
    assert torch.equal(mod.bn.running_mean, frozen)
    folded = mod.fold()
    torch.testing.assert_close(out, folded(x), rtol=1e-5, atol=1e-5)
    size = [2 * s - 1 for s in SIZES[d]]  # output_padding 0 instead of 1 per dim
    torch.testing.assert_close(mod(x, output_size=size), folded(x, output_size=size), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mod.to_float()(x), ref.eval()(x), rtol=1e-4, atol=1e-4)


def _net(d: int, groups: int) -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.dq = Q.QuantStub(), Q.DeQuantStub()
            self.c, self.relu = getattr(nn, f"Conv{d}d")(3, 8, 3, padding=1), nn.ReLU()
            self.ct = getattr(nn, f"ConvTranspose{d}d")(8, 6, 3, stride=2, padding=1, output_padding=1, groups=groups)
            self.bn = _bn(getattr(nn, f"BatchNorm{d}d")(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dq(self.bn(self.ct(self.relu(self.c(self.q(x))))))

    return Net()


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("mode", ["eager", "fx"])
def test_qat_conv_transpose_bn_and_its_int8_model_agree(mode, d, groups):
    """before: eager refused; graph mode trained the BN as a separate op (one more requantize). Now 5 SGD steps of the
    fused QAT module, then convert: one int8 ConvTranspose with the BN folded, whose weight codes are the QAT fake-quant
    codes of the folded weight and whose outputs agree with the QAT model's code for code (measured: 0 codes off, fx
    3-d 1 code in 6144)."""
    torch.manual_seed(0)
    net, xs = _net(d, groups).train(), [torch.randn(4, 3, *SIZES[d]) for _ in range(6)]
    qc = Q.get_default_qat_qconfig()
    if mode == "eager":
        p = Q.prepare_qat(Q.fuse_modules_qat(net, [["ct", "bn"]]), qc)
    else:
        p = prepare_qat_fx(net, Q.QConfigMapping().set_global(qc), (xs[0],))
    (mod,) = [m for m in p.modules() if type(m) is getattr(nniqat, f"ConvTransposeBn{d}d")]
    opt = torch.optim.SGD(p.parameters(), lr=0.05)
    for x in xs[:-1]:
        p(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert int(mod.bn.num_batches_tracked) == 5
    p.eval()
    p.apply(Q.disable_observer)
    with torch.no_grad():
        ref, folded = p(xs[-1]), mod.fold()
        w_fq = folded.fake_quant_weight()
        qm = (Q.convert if mode == "eager" else Q.convert_fx)(copy.deepcopy(p))
        out = qm(xs[-1])
    (ct,) = [m for m in qm.modules() if type(m) is getattr(nnq, f"ConvTranspose{d}d")]
    assert not [m for m in qm.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    codes_off = ((ref - out) / float(ct.scale)).round().abs()
    assert _sqnr(ref, out) >= 55 and float((codes_off > 0).float().mean()) <= 0.001 and float(codes_off.max()) <= 1
    view = (1, -1) + (1,) * d
    scale, zp = ct.weight_scale.reshape(view), ct.weight_zero_point.reshape(view)
    assert torch.equal(torch.round(w_fq / scale) + zp, ct.weight_int8.float())
    if groups == 1:  # the folded float weight is torch.ao's fold of the trained layer and BN
        from torch.nn.utils.fusion import fuse_conv_bn_weights  # (what torch.ao's fuse_convtranspose_bn calls)

        tw, tb = fuse_conv_bn_weights(mod.weight, mod.bias, mod.bn.running_mean, mod.bn.running_var, mod.bn.eps,
                                      mod.bn.weight, mod.bn.bias, transpose=True)
        torch.testing.assert_close(folded.weight, tw, rtol=0, atol=1e-6)
        torch.testing.assert_close(folded.bias, tb, rtol=0, atol=1e-6)


def test_conv_transpose_bn_relu_stays_refused_and_bn_fold_mode_reaches_it():
    """ConvTranspose + BN + ReLU has no fused form (torch.ao neither): refused naming the group. set_bn_fold_mode and
    the module-level freeze_bn_stats reach the new module and its marker."""
    m = nn.Sequential(nn.ConvTranspose2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    for fuse in (Q.fuse_modules, Q.fuse_modules_qat):
        with pytest.raises(ValueError, match=r"cannot fuse \(ConvTranspose2d, BatchNorm2d, ReLU\)"):
            fuse(m.eval() if fuse is Q.fuse_modules else m.train(), [["0", "1", "2"]])
    f = nniqat.set_bn_fold_mode(Q.fuse_modules_qat(m.train(), [["0", "1"]]), "running_stats")
    assert f[0].bn_fold == "running_stats"
    qat = Q.prepare_qat(f, Q.get_default_qat_qconfig())
    assert type(qat[0]) is nniqat.ConvTransposeBn2d and qat[0].bn_fold == "running_stats"
    qat(torch.randn(2, 4, 5, 5))
    assert int(qat[0].bn.num_batches_tracked) == 0  # the fixed fold: the BN never runs
    qat.apply(nniqat.freeze_bn_stats)
    assert qat[0].freeze_bn and not qat[0].bn.training


def test_folded_linear_bn_refuses_an_input_its_fold_is_wrong_for():
    """before: Linear(5, 6) + BatchNorm1d(6) on a (3, 6, 5) input (the BN normalises dim 1, 6 entries, not the
    features) folded along the features, silently 1.94 off the float model, in fuse_modules and in fuse_fx without
    example inputs (torch.ao too). Now the folded Linear refuses a non-2-d input, naming its shape, and keeps that
    check through prepare / convert; 2-d inputs are unchanged, and prepare_fx with example inputs leaves it unfused."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), _bn(nn.BatchNorm1d(6))).eval()
    x3, x2 = torch.randn(3, 6, 5), torch.randn(8, 5)
    for fused in (Q.fuse_modules(m, [["0", "1"]]), fuse_fx(m)):
        torch.testing.assert_close(fused(x2), m(x2), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"Linear\(5, 6\) with a BatchNorm1d folded in .* got shape \(3, 6, 5\)"):
            fused(x3)
    p = Q.prepare(nn.Sequential(Q.QuantStub(), *Q.fuse_modules(m, [["0", "1"]]), Q.DeQuantStub()),
                  Q.get_default_qconfig())
    p(x2)
    q = Q.convert(p)
    assert isinstance(q[1], nnq.Linear)
    with pytest.raises(ValueError, match=r"got shape \(3, 6, 5\)"):
        q(x3)
    g = prepare_fx(copy.deepcopy(m), Q.QConfigMapping().set_global(Q.get_default_qconfig()), (x3,))
    torch.testing.assert_close(g(x3), m(x3))  # (observers only: the float function, BN unfused)


@pytest.mark.parametrize("kind", ["ConvBn2d", "LinearBn1d", "ConvTransposeBn2d"])
def test_freeze_bn_and_bn_fold_survive_a_checkpoint(kind):
    """before: freeze_bn and bn_fold were not in the state dict (torch.ao loses freeze_bn too): a QAT run resumed from
    a checkpoint taken after freeze_bn_stats updated the BN statistics again, silently. Now they are the module's
    `_extra_state` (a uint8 tensor: weights_only loads, every value a tensor); a checkpoint without it (older lowbit)
    still loads strictly and keeps the module's state; a malformed one is refused, naming it."""
    torch.manual_seed(0)
    layer, bn, x = {"ConvBn2d": (nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), torch.randn(8, 2, 6, 6)),
                    "LinearBn1d": (nn.Linear(3, 4), nn.BatchNorm1d(4), torch.randn(8, 3)),
                    "ConvTransposeBn2d": (nn.ConvTranspose2d(2, 4, 3), nn.BatchNorm2d(4), torch.randn(8, 2, 6, 6))}[kind]
    cls, qc = getattr(nniqat, kind), Q.get_default_qat_qconfig()
    a = cls(layer, bn, qconfig=qc)
    a(x)
    a.freeze_bn_stats()
    sd = roundtrip(a)
    b = cls(copy.deepcopy(layer), copy.deepcopy(bn), qconfig=qc).train()
    b.load_state_dict(sd)
    assert b.freeze_bn and not b.bn.training and b.bn_fold == "batch_stats"
    mean = b.bn.running_mean.clone()
    b.train()(x)
    assert torch.equal(b.bn.running_mean, mean)  # resumed frozen
    a.update_bn_stats()
    a.bn_fold = "running_stats"
    b.load_state_dict(roundtrip(a))
    assert not b.freeze_bn and b.bn.training and b.bn_fold == "running_stats"
    old = {k: v for k, v in sd.items() if k != "_extra_state"}
    c = cls(copy.deepcopy(layer), copy.deepcopy(bn), qconfig=qc, freeze_bn=True)
    c.load_state_dict(old)  # strict
    assert c.freeze_bn
    with pytest.raises(ValueError, match=r"_extra_state=tensor\(\[1, 7\]"):
        c.load_state_dict({**sd, "_extra_state": torch.tensor([1, 7])})
    buf = io.BytesIO()
    torch.save(nn.Sequential(a).state_dict(), buf)
    assert "0._extra_state" in torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_functional_transposed_fold_axis():
    """The QAT module scales output channel g·C/G + j (the weight's axis 1 within group g), as the float fold does:
    frozen, its weight before fake-quant is fold_bn_weights(transpose=True)'s."""
    ct, bn = nn.ConvTranspose2d(4, 6, 3, groups=2), _bn(nn.BatchNorm2d(6))
    m = nniqat.ConvTransposeBn2d(ct, bn, qconfig=Q.get_default_qat_qconfig())
    w, _ = nni.fold_bn_weights(ct.weight, ct.bias, bn, transpose=True, groups=2)
    assert torch.equal(m._scale_weight(nni.bn_scale(bn)), w)
    x = torch.randn(2, 4, 5, 5)
    m.weight_fake_quant.disable_fake_quant()
    torch.testing.assert_close(m.eval()(x), bn.eval()(F.conv_transpose2d(x, ct.weight, ct.bias, groups=2)),
                               rtol=1e-5, atol=1e-5)
