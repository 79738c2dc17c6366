"""Float fused markers: ``nn.Sequential`` subclasses naming a pattern the workflows treat as one op.

``fuse_modules`` / ``fuse_modules_qat`` build them; ``prepare`` observes only their output (never
their children); ``prepare_qat`` swaps them for ``lowbit.nn.intrinsic.qat`` modules; ``convert``
swaps them for ``lowbit.nn.quantized`` modules. Their float forward is the plain composition
``y = m[-1](...m[1](m[0](x)))`` so a fused float model computes exactly what the unfused one did.

>>> import torch
>>> from torch import nn
>>> import lowbit.nn.intrinsic as nni
>>> m = nni.ConvReLU2d(nn.Conv2d(1, 2, 3), nn.ReLU())
>>> bool((m(torch.randn(1, 1, 5, 5)) >= 0).all())
True
>>> nni.ConvReLU2d(nn.Conv1d(1, 2, 3), nn.ReLU())
Traceback (most recent call last):
...
TypeError: ConvReLU2d expects (Conv2d, ReLU), got (Conv1d, ReLU)
"""

from __future__ import annotations

import torch
from torch import nn

from ...fx_leaves import FxLeaf

__all__ = [
    "FusedModule", "ConvReLU1d", "ConvReLU2d", "ConvReLU3d", "LinearReLU",
    "ConvBn1d", "ConvBn2d", "ConvBn3d", "ConvBnReLU1d", "ConvBnReLU2d", "ConvBnReLU3d",
    "LinearBn1d", "BNReLU2d", "BNReLU3d", "ClampedReLU", "as_fusable_relu",
    "ConvTransposeBn1d", "ConvTransposeBn2d", "ConvTransposeBn3d",
]


class FusedModule(FxLeaf, nn.Sequential):
    """Base of every fused marker; ``_types`` lists the exact child types, in order."""

    _types: tuple[type[nn.Module], ...] = ()

    def __init__(self, *mods: nn.Module) -> None:
        got = tuple(type(m) for m in mods)
        if len(mods) != len(self._types) or not all(isinstance(m, t) for m, t in zip(mods, self._types)):
            want = ", ".join(t.__name__ for t in self._types)
            have = ", ".join(t.__name__ for t in got)
            raise TypeError(f"{type(self).__name__} expects ({want}), got ({have})")
        super().__init__(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # only the fused ops: prepare adds observers as children, which Sequential would run too
        for mod in list(self._modules.values())[: len(self._types)]:
            x = mod(x)
        return x


class ClampedReLU(FxLeaf, nn.ReLU):
    """``clamp(x, 0, max_val)``: ReLU6 / ``Hardtanh(0, max_val)`` / ``clamp(x, 0, max_val)`` as a fusable ReLU.

    It is an ``nn.ReLU`` so the ReLU markers accept it. Fused after a conv/linear, the marker's output
    observer sees clamped values, so the quantized layer's output grid is ``[0, t]`` with ``t <= max_val``:
    the requantize step's code clamp *is* the activation (one rounding instead of two, and a grid that
    spends no codes on values the clamp removes).

    >>> ClampedReLU(6.0)(torch.tensor([-1.0, 3.0, 9.0])).tolist()
    [0.0, 3.0, 6.0]
    """

    def __init__(self, max_val: float = 6.0) -> None:
        super().__init__()
        if not max_val > 0:
            raise ValueError(f"ClampedReLU: max_val={max_val!r} must be > 0")
        self.max_val = float(max_val)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, 0.0, self.max_val)

    def extra_repr(self) -> str:
        return f"max_val={self.max_val}"


def as_fusable_relu(mod: nn.Module) -> nn.Module | None:
    """``mod`` as a ReLU a marker can hold: ``nn.ReLU`` itself, ReLU6 / Hardtanh(0, t) as ``ClampedReLU``.

    Exact types only, as for ``nn.ReLU``: a user's ``Hardtanh`` subclass may compute anything in its ``forward``
    (it was replaced by the plain clamp, silently)."""
    if type(mod) is nn.ReLU or isinstance(mod, ClampedReLU):
        return mod
    if type(mod) in (nn.Hardtanh, nn.ReLU6) and float(mod.min_val) == 0.0 and float(mod.max_val) > 0:
        return ClampedReLU(float(mod.max_val))
    return None


def _marker(name: str, types: tuple[type[nn.Module], ...], doc: str) -> type[FusedModule]:
    return type(name, (FusedModule,), {"_types": types, "__doc__": doc, "__module__": __name__})


ConvReLU1d = _marker("ConvReLU1d", (nn.Conv1d, nn.ReLU), "``relu(conv1d(x))``.")
ConvReLU2d = _marker("ConvReLU2d", (nn.Conv2d, nn.ReLU), "``relu(conv2d(x))``.")
ConvReLU3d = _marker("ConvReLU3d", (nn.Conv3d, nn.ReLU), "``relu(conv3d(x))``.")
LinearReLU = _marker("LinearReLU", (nn.Linear, nn.ReLU), "``relu(linear(x))``.")
ConvBn1d = _marker("ConvBn1d", (nn.Conv1d, nn.BatchNorm1d), "``bn(conv1d(x))`` (kept unfolded for QAT).")
ConvBn2d = _marker("ConvBn2d", (nn.Conv2d, nn.BatchNorm2d), "``bn(conv2d(x))`` (kept unfolded for QAT).")
ConvBn3d = _marker("ConvBn3d", (nn.Conv3d, nn.BatchNorm3d), "``bn(conv3d(x))`` (kept unfolded for QAT).")
ConvBnReLU1d = _marker("ConvBnReLU1d", (nn.Conv1d, nn.BatchNorm1d, nn.ReLU), "``relu(bn(conv1d(x)))``.")
ConvBnReLU2d = _marker("ConvBnReLU2d", (nn.Conv2d, nn.BatchNorm2d, nn.ReLU), "``relu(bn(conv2d(x)))``.")
ConvBnReLU3d = _marker("ConvBnReLU3d", (nn.Conv3d, nn.BatchNorm3d, nn.ReLU), "``relu(bn(conv3d(x)))``.")
LinearBn1d = _marker("LinearBn1d", (nn.Linear, nn.BatchNorm1d), "``bn(linear(x))`` (kept unfolded for QAT).")
ConvTransposeBn1d = _marker("ConvTransposeBn1d", (nn.ConvTranspose1d, nn.BatchNorm1d),
                            "``bn(conv_transpose1d(x))`` (kept unfolded for QAT).")
ConvTransposeBn2d = _marker("ConvTransposeBn2d", (nn.ConvTranspose2d, nn.BatchNorm2d),
                            "``bn(conv_transpose2d(x))`` (kept unfolded for QAT).")
ConvTransposeBn3d = _marker("ConvTransposeBn3d", (nn.ConvTranspose3d, nn.BatchNorm3d),
                            "``bn(conv_transpose3d(x))`` (kept unfolded for QAT).")
BNReLU2d = _marker("BNReLU2d", (nn.BatchNorm2d, nn.ReLU), "``relu(bn2d(x))``.")
BNReLU3d = _marker("BNReLU3d", (nn.BatchNorm3d, nn.ReLU), "``relu(bn3d(x))``.")
