"""Session 37, the eager workflow on real-model code patterns (prepare → calibrate → convert), each test failing before
its fix. Oracles: the prepared model's own simulation (``convert(prepared, is_reference=True)``, which the int8 model
must match within one output quantum) and torch.ao's eager ``prepare`` / ``convert`` where it is defined.

- A user's forward hook that changes a module's output ran between the module and prepare's observer: the grid was
  calibrated on the hook's output and then applied, after convert, to the module's own output (torch.ao prepends its
  observer hook; so does lowbit now).
- ``y += z`` on an observed output kept the tag "quantized after convert": the next layer recorded no input grid and the
  converted model quantized that float sum per call (torchvision's ``out += identity; out = self.relu(out)``).
- ``convert(is_reference=True)`` raised on a module that never ran during calibration, where ``convert`` keeps it float.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import lowbit as Q


def _calibrated(model: nn.Module, *batches: torch.Tensor) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(prepared, reference, int8) of ``model`` under the min/max qconfig, calibrated on ``batches``."""
    model.qconfig = Q.get_minmax_qconfig()
    prepared = Q.prepare(model.eval())
    with torch.no_grad():
        for b in batches:
            prepared(b)
    ref = Q.convert(copy.deepcopy(prepared), is_reference=True)
    return prepared, ref, Q.convert(prepared)


def _quanta(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return ((a - b).abs() / scale).max().item()


# ---- a user's forward hook runs after prepare's observer ------------------------------------------------------------

def _double_hook(mod: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _hooked(stubs: str) -> nn.Module:
    quant, dequant = (Q.QuantStub, Q.DeQuantStub) if stubs == "lowbit" else (tq.QuantStub, tq.DeQuantStub)
    torch.manual_seed(0)
    m = nn.Sequential(quant(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), dequant())
    m[1].register_forward_hook(_double_hook)
    return m


def test_a_user_hook_changing_the_output_runs_after_the_observer_as_in_torch_ao():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    prepared, ref, qm = _calibrated(_hooked("lowbit"), x)
    raw = nn.functional.linear(x, prepared[1].weight, prepared[1].bias)
    # the observer saw the Linear's own output (was: the hook's doubled one), as torch.ao's prepended hook does
    assert prepared[1].activation_post_process.max_val.item() == pytest.approx(raw.max().item(), rel=1e-6)
    ao = _hooked("ao")
    ao.qconfig = tq.QConfig(activation=tq.MinMaxObserver, weight=tq.default_weight_observer)
    pa = tq.prepare(ao.eval())
    with torch.no_grad():
        pa(x)
    assert prepared[1].activation_post_process.max_val.item() == pytest.approx(
        pa[1].activation_post_process.max_val.item(), rel=1e-6)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # (the hook's `* 2` runs on the QTensor's float values, warned)
        out, sim = qm(x), ref(x)
    assert len(qm[1]._forward_hooks) == 1  # the user's hook survived convert, once
    assert _quanta(out, sim, qm[3].scale) <= 1.0 + 1e-4  # was 7 quanta: the grid of 2·y applied to y


# ---- an in-place write unmarks an observed output -------------------------------------------------------------------

class _Block(nn.Module):
    """torchvision's BasicBlock tail without FloatFunctional: ``out += identity; out = self.relu(out)``."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        out = self.relu1(self.conv1(x))  # in-place ReLU right after a layer: still on its grid
        out = self.conv2(out)
        out += x
        out = self.relu(out)
        return self.dequant(self.conv3(out))


def test_in_place_add_makes_the_next_layer_record_its_float_input_grid():
    torch.manual_seed(0)
    x = torch.randn(8, 4, 6, 6)
    prepared, ref, qm = _calibrated(_Block(), x)
    # conv2's input came from ReLU(inplace=True) on conv1's output: tagged, no input grid (unchanged behaviour)
    assert qm.conv2.input_grid is None
    # conv3's input is conv2's output written in place by `+= x`: a float sum, observed (was: taken as quantized)
    assert qm.conv3.input_grid is not None
    with torch.no_grad():
        c1 = torch.relu(nn.functional.conv2d(x, prepared.conv1.weight, prepared.conv1.bias, padding=1))
        float_in = (nn.functional.conv2d(c1, prepared.conv2.weight, prepared.conv2.bias, padding=1) + x).relu()
    assert prepared.conv3.input_activation_post_process.max_val.item() == pytest.approx(float_in.max().item(), rel=1e-5)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # (the QTensors' `+=` runs on float values, warned)
        out, sim = qm(x), ref(x)
        # was: a per-call grid from each batch's own min/max, so one sample's output depended on the batch
        alone = qm(x[:1])
    assert _quanta(out, sim, qm.conv3.scale) <= 1.0 + 1e-4
    assert torch.equal(alone, out[:1])


def test_calibration_under_inference_mode_still_runs():
    # inference tensors have no version counter: the tag is kept as before (no in-place write can be seen)
    torch.manual_seed(0)
    x = torch.randn(16, 4, 4, 4)
    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(4, 4, 1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 1), Q.DeQuantStub())
    model.qconfig = Q.get_minmax_qconfig()
    prepared = Q.prepare(model.eval())
    with torch.inference_mode():
        prepared(x)
    ref = Q.convert(copy.deepcopy(prepared), is_reference=True)
    qm = Q.convert(prepared)
    assert qm[3].input_grid is None
    with torch.no_grad():
        assert _quanta(qm(x), ref(x), qm[3].scale) <= 1.0 + 1e-4


# ---- a module that never ran: the reference model leaves it float as convert does ----------------------------------

class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.fc = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.quant(x)))


def test_reference_convert_leaves_a_module_that_never_ran_float_as_convert_does():
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    model = _WithUnused()
    model.qconfig = Q.get_minmax_qconfig()
    prepared = Q.prepare(model.eval())
    with torch.no_grad():
        prepared(x)
    with pytest.warns(UserWarning, match="'unused' .*never ran during calibration"):
        ref, report = Q.convert(prepared, is_reference=True, return_report=True)  # was: RuntimeError
    assert type(ref.unused) is nn.Linear and not hasattr(ref.unused, "activation_post_process")
    assert "unused" in report.left_float
    with pytest.warns(UserWarning, match="never ran"):
        qm = Q.convert(prepared)
    assert type(qm.unused) is nn.Linear
    with torch.no_grad():
        assert _quanta(qm(x), ref(x), qm.fc.scale) <= 1.0 + 1e-4
        assert torch.equal(ref.unused(x), prepared.unused(x))
    lowered = Q.lower_reference(ref)
    with torch.no_grad():
        assert torch.equal(lowered(x), qm(x))
    # with no calibration at all it is still the error it was
    fresh = Q.prepare(_WithUnused().eval(), Q.get_minmax_qconfig())
    with pytest.raises(RuntimeError, match="saw no data"):
        Q.convert(fresh, is_reference=True)
