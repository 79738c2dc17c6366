"""QAT sweep (session 43): eager / graph-mode QAT against torch.ao.quantization; each defect's test fails before its fix."""

import copy

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q
import lowbit.nn.intrinsic.qat as nniqat
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)
from lowbit.fake_quant import LearnableFakeQuantize, enable_param_learning

_PLACEHOLDER = r"fake quantization is on but the observer is off and has seen no data, so the grid is the placeholder"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 25, 5)).train()


def _qat(qc: Q.QConfig) -> nn.Module:
    return Q.prepare_qat(Q.QuantWrapper(Q.fuse_modules_qat(_net(), [["0", "1", "2"]])), qc)


_QCONFIGS = {"x86 fused": lambda: Q.get_default_qat_qconfig("x86"), "x86 v0": lambda: Q.get_default_qat_qconfig("x86", 0),
             "lowbit": Q.get_default_qat_qconfig, "lsq": Q.get_lsq_qat_qconfig}


@pytest.mark.parametrize("name", list(_QCONFIGS))
def test_observers_disabled_before_the_first_step_is_refused(name):
    """`model.apply(disable_observer)` before any batch (a freeze schedule whose step is 0) trained every layer on the
    placeholder grid scale=1.0: the QAT model's outputs were one constant for every input (torch.ao: the same,
    silently) and only `convert`, after the whole run, said the observers saw no data."""
    p = _qat(_QCONFIGS[name]())
    p.apply(Q.disable_observer)
    x = torch.randn(8, 3, 7, 7)
    with pytest.raises(RuntimeError, match=_PLACEHOLDER):
        p(x)
    p.apply(Q.enable_observer)
    p(x)  # one step with the observers on records the grids
    p.apply(Q.disable_observer)
    assert p(x).unique().numel() > 1


def test_torch_ao_trains_on_the_placeholder_grid_silently():
    """The oracle's behaviour the refusal replaces: constant outputs, no word."""
    a = tq.QuantWrapper(tq.fuse_modules_qat(_net(), [["0", "1", "2"]]))
    a.qconfig = tq.get_default_qat_qconfig("qnnpack")  # (per-channel weights: a deep error in its kernel instead)
    a = tq.prepare_qat(a)
    a.apply(tq.disable_observer)
    assert a(torch.randn(8, 3, 7, 7)).unique().numel() == 1


def test_graph_mode_observers_disabled_before_the_first_step_is_refused():
    ex = (torch.randn(8, 3, 7, 7),)
    p = Q.prepare_qat_fx(_net(), Q.get_default_qat_qconfig_mapping("x86"), ex)
    p.apply(Q.disable_observer)
    with pytest.raises(RuntimeError, match=_PLACEHOLDER):
        p(*ex)


@pytest.mark.parametrize("name", list(_QCONFIGS))
def test_a_loaded_checkpoint_counts_as_a_grid(name):
    """Resuming: a fresh prepared model, the trained state dict, observers off: the next step equals the trained
    model's; loading an untrained state dict into a module that held a grid makes it refuse again."""
    qc = _QCONFIGS[name]()
    trained, x = _qat(qc), torch.randn(8, 3, 7, 7)
    trained(x)
    if name == "lsq":
        trained.apply(enable_param_learning)
    trained.apply(Q.disable_observer)
    fresh = _qat(qc)
    fresh.apply(Q.disable_observer)
    if name == "lsq":
        fresh.apply(enable_param_learning)  # (its per-channel parameters take their shape from the checkpoint)
    fresh.load_state_dict(trained.state_dict())
    assert torch.equal(fresh(x), trained(x))
    if name != "lsq":  # (an LSQ module in its learning phase learns from whatever it holds)
        fresh.load_state_dict(_qat(qc).state_dict())  # (its switches too: observers on)
        fresh.apply(Q.disable_observer)
        with pytest.raises(RuntimeError, match=_PLACEHOLDER):
            fresh(x)


def test_a_grid_set_by_hand_and_fake_quant_off_still_work():
    fq = Q.FakeQuantize().disable_observer()
    x = torch.tensor([0.26, -1.0, 3.0])
    fq.disable_fake_quant()
    assert torch.equal(fq(x), x)  # observer and fake quantization off: the identity, grid or not
    fq.enable_fake_quant()
    fq.scale.fill_(0.5)
    fq.zero_point.fill_(10)
    assert torch.equal(fq(x), torch.tensor([0.5, -1.0, 3.0]))
    lsq = LearnableFakeQuantize(scale=0.25).disable_observer()
    assert torch.equal(lsq(x), torch.tensor([0.25, 0.0, 3.0]))  # quint8: -1.0 clips at zero point 0


def test_lsq_learning_from_its_initial_scale_is_not_refused():
    """LSQ with learning on trains the parameters from wherever they start (torch.ao's init is scale 1.0 too)."""
    fq = LearnableFakeQuantize()
    fq.enable_param_learning()
    x = torch.tensor([0.3, 2.6])
    fq(x).sum().backward()
    assert fq.scale.grad is not None


@pytest.mark.parametrize("qc", [("x86", 0), ("x86", 1), ("qnnpack", 0)])
def test_gradient_accumulation_and_eval_mode_steps_match_torch_ao(qc):
    """Several forwards before one backward (gradient accumulation: the fake-quant grids move between the forwards),
    then training steps in eval mode (frozen BN, fine-tuning): outputs, every gradient, BN statistics and
    fake-quant state equal torch.ao's bit for bit."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 3), nn.BatchNorm2d(6),
                      nn.Flatten(), nn.Linear(54, 5), nn.BatchNorm1d(5)).train()
    groups = [["0", "1", "2"], ["3", "4"], ["6", "7"]]
    a = tq.QuantWrapper(tq.fuse_modules_qat(copy.deepcopy(m), groups))
    a.qconfig = tq.get_default_qat_qconfig(*qc)
    a = tq.prepare_qat(a)
    b = Q.prepare_qat(Q.QuantWrapper(Q.fuse_modules_qat(copy.deepcopy(m), groups)), Q.get_default_qat_qconfig(*qc))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.05), torch.optim.SGD(b.parameters(), lr=0.05)
    torch.manual_seed(1)
    for step in range(5):
        if step == 3:
            a.eval(), b.eval()
        xs = [torch.randn(8, 3, 7, 7) for _ in range(3 if step < 3 else 1)]
        la = sum(a(x).square().mean() for x in xs)
        lb = sum(b(x).square().mean() for x in xs)
        assert torch.equal(la, lb), step
        oa.zero_grad(), ob.zero_grad()
        la.backward(), lb.backward()
        ga = {_ao_name(k): p.grad for k, p in b.named_parameters()}
        gb = {k: p.grad for k, p in a.named_parameters()}
        assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga), step
        oa.step(), ob.step()
    sa = a.state_dict()
    compared = 0
    for k, v in b.state_dict().items():
        if "input_activation_post_process" in k or k.endswith(("_extra_state", ".eps")):
            continue  # (lowbit's float-input grids; freeze_bn / bn_fold; eps: the seeds' 1e-8, torch.ao's 2^-23)
        ref = sa[_ao_name(k)]
        assert torch.equal(v.reshape(-1).to(ref.dtype), ref.reshape(-1)), k
        compared += 1
    assert compared >= 40


def _ao_name(key: str) -> str:
    """torch.ao's name of a lowbit QAT state entry: its fused conv / linear + BN modules are the layer itself."""
    return key.replace(".conv.", ".").replace(".linear.", ".")


@pytest.mark.parametrize("make, bad, good", [
    (lambda qc: nniqat.LinearBn1d(nn.Linear(5, 4), nn.BatchNorm1d(4, momentum=None), qconfig=qc), (1, 5), (3, 5)),
    (lambda qc: nniqat.ConvBnReLU2d(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), qconfig=qc), (1, 3, 3, 3), (2, 3, 5, 5)),
    (lambda qc: nniqat.ConvBn1d(nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"), nn.BatchNorm1d(4), qconfig=qc),
     (1, 3, 1), (2, 3, 4)),
    (lambda qc: nniqat.ConvTransposeBn2d(nn.ConvTranspose2d(3, 4, 1), nn.BatchNorm2d(4), qconfig=qc), (1, 3, 1, 1),
     (2, 3, 2, 2)),
])
def test_a_bn_batch_of_one_value_per_channel_is_refused_before_anything_changes(make, bad, good):
    """torch's 'Expected more than 1 value per channel when training' came after the weight fake-quant had observed
    (its grid moved) and the BN had counted the batch (num_batches_tracked, the weight of every later batch with
    momentum=None): a training loop that skips such a batch still changed the model. torch.ao does the same."""
    m = make(Q.get_default_qat_qconfig("x86"))
    m(torch.randn(good))
    before = copy.deepcopy(m.state_dict())
    shape = str(bad).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=rf"{type(m).__name__}: BatchNorm in training mode needs more than 1 value "
                                         rf"per channel, got an input of shape {shape}"):
        m(torch.randn(bad))
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert m.eval()(torch.randn(bad)).shape[0] == 1  # running statistics: a batch of one is fine
    m.train().freeze_bn_stats()
    assert m(torch.randn(bad)).shape[0] == 1
