"""Hostile inputs found by session 23's probes, each now a clear error naming the value or the documented result:
a quantized conv whose window does not fit its input (was an empty output), a calibration batch that does not fit
the model (was torch's bare error with no batch named), ``quantize_ptq``'s seed, a ``quantize_w8a8`` model that is no
module, and a Linear shared by two places in ``quantize_weight_only`` (was int4 at one place and float at the other)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q


def _converted(conv: nn.Module, spatial: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), conv, Q.DeQuantStub()).eval()
    p = Q.prepare(m, Q.get_minmax_qconfig())
    p(torch.randn(2, 3, *[spatial] * (conv.weight.dim() - 2)))
    return m, Q.convert(p)


@pytest.mark.parametrize(("conv", "fits", "too_small", "needs"), [
    (nn.Conv2d(3, 4, 3), (3, 3), (2, 2), "(3, 3)"),
    (nn.Conv1d(3, 4, 3), (3,), (2,), "(3,)"),
    (nn.Conv3d(3, 4, 3), (3, 3, 3), (2, 3, 3), "(3, 3, 3)"),
    (nn.Conv2d(3, 4, 3, dilation=2), (5, 5), (4, 5), "(5, 5)"),
    (nn.Conv2d(3, 4, 5, padding=1), (3, 3), (2, 3), "(3, 3)"),
    (nn.Conv2d(3, 4, 5, padding=2, padding_mode="reflect"), (3, 3), (1, 3), "(1, 1)"),
], ids=["2d", "1d", "3d", "dilated", "padded", "reflect"])
def test_a_conv_window_larger_than_its_input_is_an_error_like_torch(conv, fits, too_small, needs):
    m, c = _converted(conv, 8)
    x = torch.randn(1, 3, *fits)
    assert c(x).shape == m(x).shape  # the smallest input that fits still runs, shaped as the float conv's output
    if needs == "(1, 1)":  # reflect padding of 2 needs 3 pixels: torch refuses one pixel for its own reason
        return
    with pytest.raises(RuntimeError):
        m(torch.randn(1, 3, *too_small))
    needs_re = needs.replace("(", "[(]").replace(")", "[)]")
    with pytest.raises(ValueError, match=rf"input spatial size \({too_small[0]}.*at least {needs_re}"):
        c(torch.randn(1, 3, *too_small))


def test_fx_converted_conv_checks_its_window_too():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), (torch.randn(2, 3, 8, 8),))
    p(torch.randn(4, 3, 8, 8))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        Q.convert_fx(p)(torch.randn(1, 3, 2, 2))


def test_a_calibration_batch_that_does_not_fit_is_named_first_or_later():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with pytest.raises(ValueError, match=r"calib batch 2 \(input shapes \[\(3, 9\)\]\) failed in the model: RuntimeError"):
        Q.quantize_ptq(m, [torch.randn(4, 8), torch.randn(5, 8), torch.randn(3, 9)], progress=False)
    for recipe in ("default", "accurate"):  # the first batch runs inside prepare_fx: named in calib's terms too
        with pytest.raises(ValueError, match=r"quantize_ptq: calib batch 0 \(input shapes \[\(4, 9\)\]\) failed in the "
                                             r"model: RuntimeError"):
            Q.quantize_ptq(m, [torch.randn(4, 9), torch.randn(5, 8)], recipe=recipe, progress=False,
                           **({"iters": 1} if recipe == "accurate" else {}))  # (accurate-only: refused elsewhere)
    q, _ = Q.quantize_ptq(m, [torch.randn(4, 8), torch.randn(5, 8)], progress=False)  # varying batch sizes are fine
    assert q(torch.randn(2, 8)).shape == (2, 4)


@pytest.mark.parametrize("seed", ["a", 1.5, None, True])
def test_quantize_ptq_seed_must_be_an_int_before_any_work(seed):
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with pytest.raises(TypeError, match=rf"quantize_ptq: seed={seed!r} must be an int"):
        Q.quantize_ptq(m, [torch.randn(4, 8)], recipe="accurate", iters=1, progress=False, seed=seed)


def test_quantize_w8a8_names_a_model_that_is_no_module_and_a_bool_alpha():
    with pytest.raises(TypeError, match="quantize_w8a8: model must be an nn.Module, got str"):
        Q.quantize_w8a8("x", [torch.ones(1, 4, dtype=torch.long)])
    with pytest.raises(ValueError, match="alpha=True"):
        Q.quantize_w8a8(nn.Linear(2, 2), [torch.ones(1, 4, dtype=torch.long)], alpha=True)


def test_weight_only_quantizes_a_shared_linear_at_every_place_it_sits():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    q = Q.quantize_weight_only(model, bits=4, group_size=16)
    assert type(q[0]).__name__ == "WeightOnlyLinear"
    assert q[0] is q[2]  # one module, one copy of the codes, as eager convert shares a shared layer
    x = torch.randn(3, 16)
    assert torch.equal(q(x), q[0](torch.relu(q[0](x))))
    assert type(model[2]) is nn.Linear and model[0] is model[2]  # the input model is not changed
    kept = Q.quantize_weight_only(model, bits=4, group_size=16, skip=("2",))
    assert type(kept[0]).__name__ == "WeightOnlyLinear" and type(kept[2]) is nn.Linear  # skip names one place


def test_weight_only_gptq_names_a_calibration_batch_that_does_not_fit():
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with pytest.raises(ValueError, match="quantize_weight_only: calib batch 1 failed in the model: RuntimeError"):
        Q.quantize_weight_only(m, bits=4, group_size=16, method="gptq", calib=[torch.randn(2, 16), torch.randn(2, 17)])


@pytest.mark.parametrize("bits", [4.0, 8.0, "4"])
def test_bits_must_be_the_int_4_or_8(bits):
    with pytest.raises(ValueError, match=rf"bits={bits!r} must be"):
        Q.quantize_weight_only(nn.Sequential(nn.Linear(16, 16)), bits=bits, group_size=16)
    with pytest.raises(ValueError, match=rf"get_embedding_qconfig: bits={bits!r}"):
        Q.get_embedding_qconfig(bits=bits)
