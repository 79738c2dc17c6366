"""``FxReport``: what graph mode did to each part of a model (``gm.lowbit_report``).

>>> r = FxReport()
>>> r.left_float["softmax"] = "softmax (no integer kernel)"
>>> print(r)
graph mode: 0 fused, 0 quantized, 1 left float, 0 eager submodules
  float  softmax: softmax (no integer kernel)
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FxReport"]


@dataclass
class FxReport:
    """Per-model record of graph-mode quantization.

    ``fused``: fused runs (``"conv: Conv2d + BatchNorm2d + ReLU -> ConvReLU2d"``).
    ``converted``: node name -> ``"Float -> lowbit Quantized"``, filled by ``convert_fx``.
    ``left_float``: node name -> why it stays float (no integer kernel, qconfig ``None`` ...).
    ``eager``: path of every submodule torch.fx could not trace -> how it is handled
    (``"quantized eagerly"`` or ``"left float"``), with the trace error.
    """

    fused: list[str] = field(default_factory=list)
    converted: dict[str, str] = field(default_factory=dict)
    left_float: dict[str, str] = field(default_factory=dict)
    eager: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"graph mode: {len(self.fused)} fused, {len(self.converted)} quantized, "
                 f"{len(self.left_float)} left float, {len(self.eager)} eager submodules"]
        lines += [f"  eager  {p}: {why}" for p, why in self.eager.items()]
        lines += [f"  float  {p}: {why}" for p, why in self.left_float.items()]
        return "\n".join(lines)
