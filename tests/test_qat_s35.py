"""QAT workflow sweep (session 35): defects found against torch.ao.quantization, each test failing before its fix."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit as Q
import lowbit.nn.intrinsic.qat as nniqat
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.fake_quant import LearnableFakeQuantize, enable_param_learning


def _lsq_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                      nn.Linear(8 * 4 * 4, 4), Q.DeQuantStub()).train()
    return Q.prepare_qat(Q.fuse_modules_qat(m, [["1", "2", "3"]]), Q.get_lsq_qat_qconfig())


def test_lsq_first_batch_under_inference_mode_then_learning():
    """A validation pass under torch.inference_mode() before training sized the per-channel LSQ parameters with
    inference tensors: enable_param_learning() then raised 'Setting requires_grad=True on inference tensor outside
    InferenceMode' (torch.ao copies into its parameters in place and trains)."""
    p = _lsq_model()
    x = torch.randn(8, 3, 6, 6)
    with torch.inference_mode():
        p(x)
    fqs = [m for m in p.modules() if isinstance(m, LearnableFakeQuantize)]
    assert not any(t.is_inference() for fq in fqs for t in (fq.scale, fq.zero_point))
    assert p[1].weight_fake_quant.scale.shape == (8,)
    p.apply(enable_param_learning)
    opt = torch.optim.SGD(p.parameters(), lr=1e-3)
    loss = p(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert p[1].weight_fake_quant.scale.grad is not None


def test_lsq_checkpoint_after_an_optimizer_step_drove_a_scale_below_zero_reloads():
    """An optimizer step can leave a learned scale <= 0 (the forward clamps it to eps before use); the state_dict
    saved then was refused by load_state_dict ('scale=[...] must be finite and > 0'), so a mid-training checkpoint of
    lowbit's own QAT did not load back. The checkpoint now holds the scale the module uses, max(scale, eps)."""
    p = _lsq_model()
    x = torch.randn(8, 3, 6, 6)
    p(x)
    p.apply(enable_param_learning)
    fq = p[5].weight_fake_quant
    with torch.no_grad():
        fq.scale[0] = -1e-3  # where a large Adam / SGD step on a small scale lands
    sd = p.state_dict()
    assert float(sd["5.weight_fake_quant.scale"].min()) > 0
    assert float(fq.scale.detach()[0]) < 0  # the live parameter is not changed by saving
    fresh = _lsq_model()
    fresh(x)
    fresh.apply(enable_param_learning)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), p(x))  # p's forward clamps its scale to eps, as the checkpoint holds it


@pytest.mark.parametrize("make, x, rank", [
    (lambda qc: nniqat.LinearBn1d(nn.Linear(5, 4), nn.BatchNorm1d(4), qconfig=qc), torch.randn(2, 4, 5), 2),
    (lambda qc: nniqat.ConvBn1d(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4), qconfig=qc), torch.randn(3, 4), 3),
    (lambda qc: nniqat.ConvBnReLU2d(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), qconfig=qc), torch.randn(3, 4, 4), 4),
])
@pytest.mark.parametrize("bn_fold", ["batch_stats", "running_stats"])
def test_conv_linear_bn_qat_refuses_an_input_of_the_wrong_rank(make, x, rank, bn_fold):
    """LinearBn1d on a 3-d (N, L, in) input and ConvBn1d on an unbatched (C, L) input returned silently wrong values
    (the BN fold and the BatchNorm acted on the wrong axis); ConvBn2d on an unbatched input failed inside torch."""
    m = make(Q.get_default_qat_qconfig())
    m.bn_fold = bn_fold
    shape = str(tuple(x.shape)).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=rf"{type(m).__name__} expects a {rank}-d input .*got shape {shape}"):
        m(x)
    batched = torch.randn(4, x.shape[-1]) if rank == 2 else torch.randn(2, *x.shape)
    assert m(batched).shape[0] == batched.shape[0]


def test_lsq_scale_going_negative_in_real_training_round_trips():
    """The end-to-end form: SGD on the LSQ parameters of a small model drives a scale below zero within four steps."""
    p = _lsq_model()
    x, y = torch.randn(32, 3, 6, 6), torch.randint(0, 4, (32,))
    p(x)
    p.apply(enable_param_learning)
    opt = torch.optim.SGD(p.parameters(), lr=0.1)
    for _ in range(4):
        loss = F.cross_entropy(p(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert min(float(m.scale.detach().min()) for m in p.modules() if isinstance(m, LearnableFakeQuantize)) < 0
    fresh = _lsq_model()
    fresh(x)
    fresh.apply(enable_param_learning)
    fresh.load_state_dict(p.state_dict())
    assert torch.equal(fresh(x), p(x))
