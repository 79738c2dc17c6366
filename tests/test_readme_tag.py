"""Calibrating a prepared eager model must not change the caller's tensors: ``prepare``'s output hook tagged the
tensor an observed ``QuantStub`` returned, which is the caller's batch itself, so a later prepared model fed the same
batch read it as an observed (quantized) output, its first layer observed no float input and ``convert`` recorded no
input grid (float inputs were then quantized dynamically, per call). Found by the README's lines (``prepared(x)``
with a stub model, then ``sensitivity`` on the same ``calib``: its per-layer rows changed). Failed before the fix."""

from __future__ import annotations

import torch
from torch import nn

import lowbit as Q


class _Stubbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.fc, self.dequant = Q.QuantStub(), nn.Linear(4, 3), Q.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.quant(x)))


def _first_layer_grid(x: torch.Tensor) -> object:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3)).eval()  # no stub: the Linear observes its float input
    p = Q.prepare(m, Q.get_default_qconfig())
    p(x)
    return Q.convert(p)[0].input_grid


def test_calibrating_a_stub_model_leaves_the_batch_untagged():
    torch.manual_seed(1)
    x = torch.randn(8, 4)
    fresh = _first_layer_grid(x.clone())
    assert fresh is not None
    prepared = Q.prepare(_Stubbed().eval(), Q.get_default_qconfig())
    prepared(x)
    assert vars(x) == {}  # no attribute set on the caller's tensor
    assert _first_layer_grid(x) == fresh
