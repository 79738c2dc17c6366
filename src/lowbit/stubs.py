"""Quantization boundary markers (torch.ao semantics): where a model enters / leaves int8.

``QuantStub`` is the identity until ``prepare`` gives it an output observer (the model's input
grid); ``convert`` turns it into ``lowbit.nn.quantized.Quantize``. ``DeQuantStub`` is the identity
and becomes ``DeQuantize``. ``QuantWrapper(m)`` computes ``dequant(m(quant(x)))``.

>>> import torch
>>> from torch import nn
>>> w = QuantWrapper(nn.Linear(2, 2))
>>> [name for name, _ in w.named_children()]
['quant', 'dequant', 'module']
>>> x = torch.randn(3, 2)
>>> torch.equal(w(x), w.module(x))
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .fx_leaves import FxLeaf
from .qconfig import QConfig

__all__ = ["QuantStub", "DeQuantStub", "QuantWrapper"]


def _check_qconfig(owner: str, qconfig: Any) -> None:
    # lowbit's QConfig (as prepare takes it); torch.ao's, a NamedTuple with the same fields, was taken here and
    # refused only by prepare ("expected a lowbit QConfig")
    if qconfig is not None and not isinstance(qconfig, QConfig):
        raise TypeError(f"{owner}: qconfig must be a lowbit QConfig or None, got {type(qconfig).__module__}."
                        f"{type(qconfig).__name__}")


class QuantStub(FxLeaf, nn.Module):
    """Identity marker before the first quantized op; ``qconfig`` (optional) is set as ``.qconfig``."""

    def __init__(self, qconfig: Any = None) -> None:
        super().__init__()
        _check_qconfig("QuantStub", qconfig)
        if qconfig is not None:
            self.qconfig = qconfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DeQuantStub(FxLeaf, nn.Module):
    """Identity marker after the last quantized op; becomes ``DeQuantize`` (QTensor → float)."""

    def __init__(self, qconfig: Any = None) -> None:
        super().__init__()
        _check_qconfig("DeQuantStub", qconfig)
        if qconfig is not None:
            self.qconfig = qconfig

    def forward(self, x: Any) -> Any:
        return x


class QuantWrapper(FxLeaf, nn.Module):
    """``dequant(module(quant(x)))``: makes a whole float module one quantized region.

    The wrapper inherits ``module.qconfig`` when the module has one, so ``prepare(QuantWrapper(m))``
    quantizes the stubs with the module's own settings.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"QuantWrapper wraps an nn.Module, got {type(module).__name__}")
        qconfig = getattr(module, "qconfig", None)
        self.add_module("quant", QuantStub(qconfig))
        self.add_module("dequant", DeQuantStub(qconfig))
        self.add_module("module", module)
        self.train(module.training)

    def forward(self, x: torch.Tensor) -> Any:
        return self.dequant(self.module(self.quant(x)))
