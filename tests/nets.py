"""Small models shared by several test modules (not a test module)."""

from __future__ import annotations

import torch
from torch import nn

import lowbit as Q


class StubMLP(nn.Module):
    """QuantStub → Linear(16, 32) → ReLU → Linear(32, 4) → DeQuantStub: the smallest eager QAT model."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))
