"""PyTorch 2 sweep (session 34): converted models under ``torch.compile(fullgraph=True, dynamic=True)``."""

from __future__ import annotations

import torch
from torch import nn

import lowbit as Q
from lowbit.nn.quantized.functional_modules import FloatFunctional


class _AddMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.c1, self.c2 = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        self.f, self.g = FloatFunctional(), FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        a, b = self.c1(x), self.c2(x)
        return self.dequant(self.g.mul(self.f.add_relu(a, b), a))


def test_compile_dynamic_true_binary_qfunctional_ops() -> None:
    """``QFunctional.add``/``add_relu``/``mul`` checked their unused scalar default (``c=0.0``) with
    ``math.isfinite``; under ``dynamic=True`` dynamo makes a float default a SymFloat and ``fullgraph=True`` stopped
    at "torch.* op returned non-Tensor" (every model with a residual add, SmallCNN included). Now the codes of eager,
    at two batch sizes."""
    torch.manual_seed(0)
    p = Q.prepare(_AddMul().eval(), Q.get_default_qconfig())
    p(torch.randn(4, 3, 4, 4))
    q = Q.convert(p)
    torch._dynamo.reset()
    compiled = torch.compile(q, fullgraph=True, dynamic=True, backend="aot_eager")  # (the break is dynamo's: no C++)
    with torch.no_grad():
        for b in (2, 3):  # (one graph: the batch is symbolic)
            x = torch.randn(b, 3, 4, 4)
            assert torch.equal(compiled(x), q(x)), f"batch {b}"
