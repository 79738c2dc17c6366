"""Session 50 (mnv2acc50): QDrop in the residual blocks' rounding (``reconstruct(drop=)``, the accurate recipe's
``ptq_steps.QDROP``): while a block learns its codes, activation elements inside it stay float with probability
``drop``; the keep-if-better check, bias correction and convert see every grid."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit as Q
import lowbit.ptq_steps as ptq_steps
from lowbit import kernels
from lowbit.algorithms.layerwise import reconstruct

from helpers import inverted_net, one_thread  # noqa: F401  (autouse: learned codes depend on the summation order)


@pytest.fixture(autouse=True)
def _pin():
    with kernels.use_backend("reference"):
        yield


def _calibrated(model, calib):
    prepared = Q.prepare_fx(model, Q.get_accurate_qconfig(), example_inputs=(calib[0],))
    with torch.no_grad():
        for b in calib:
            prepared(b)
    return prepared


def _weights(prepared):
    return {n: m.weight.detach().clone() for n, m in prepared.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.5", float("nan"), None])
def test_reconstruct_refuses_a_bad_drop(bad):
    model = inverted_net()
    calib = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    prepared = _calibrated(model, calib)
    with pytest.raises(ValueError, match=r"drop=") as e:
        reconstruct(prepared, [(b,) for b in calib], iters=5, blocks=True, progress=False, drop=bad)
    assert repr(bad) in str(e.value)


def test_drop_moves_the_blocks_codes_and_converts_exactly():
    model = inverted_net()
    torch.manual_seed(1)
    calib = [torch.randn(8, 3, 10, 10) for _ in range(4)]
    runs = {}
    for drop in (0.0, 0.0, 0.5):
        prepared = _calibrated(model, calib)
        reconstruct(prepared, [(b,) for b in calib], iters=60, blocks=True, learn_grids=True, progress=False,
                    drop=drop)
        runs.setdefault(drop, []).append((prepared, _weights(prepared)))
    (_, w0), (_, w0b) = runs[0.0]
    prepared, w5 = runs[0.5][0]
    assert all(torch.equal(w0[n], w0b[n]) for n in w0)  # drop=0 is deterministic (a pin)
    stem = next(iter(w0))  # (the first conv, fused with its ReLU6)
    assert stem.startswith("0") and torch.equal(w0[stem], w5[stem])  # before any block: no draw has happened yet
    blocks = [n for n in w0 if ".expand." in n or ".dw." in n or n.endswith(".project")]
    assert any(not torch.equal(w0[n], w5[n]) for n in blocks), "drop=0.5 learned the same block codes"
    qmodel = Q.convert_fx(prepared)  # the learned codes and grids on the int8 kernels, as learned
    x = torch.randn(16, 3, 10, 10)
    with torch.no_grad():
        ref, out = model(x), qmodel(x)
    assert float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())) > 20


def test_accurate_recipe_learns_its_blocks_with_qdrop(monkeypatch):
    model = inverted_net()
    torch.manual_seed(2)
    calib = [torch.randn(8, 3, 10, 10) for _ in range(3)]
    x = torch.randn(8, 3, 10, 10)
    assert ptq_steps.QDROP == 0.5
    q1, _ = Q.quantize_ptq(model, calib, iters=40, progress=False)
    monkeypatch.setattr(ptq_steps, "QDROP", 0.0)
    q0, _ = Q.quantize_ptq(model, calib, iters=40, progress=False)
    with torch.no_grad():
        assert not torch.equal(q1(x), q0(x))
    # the default / balanced recipes learn no blocks: unchanged by QDROP
    d1, _ = Q.quantize_ptq(model, calib, recipe="balanced", progress=False)
    monkeypatch.setattr(ptq_steps, "QDROP", 0.5)
    d2, _ = Q.quantize_ptq(model, calib, recipe="balanced", progress=False)
    with torch.no_grad():
        assert torch.equal(d1(x), d2(x))
