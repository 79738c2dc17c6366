"""``FxReport``: what graph mode did to each part of a model (``gm.lowbit_report``).

>>> r = FxReport()
>>> r.left_float["softmax"] = "softmax (no integer kernel)"
>>> print(r)
graph mode: 0 fused, 0 quantized, 1 left float, 0 untraceable modules
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
    ``untraceable``: path of every module whose ``forward`` torch.fx could not trace -> how it is
    handled (its children prepared one by one, or left float) and the trace error.
    ``rescaled``: layer -> ``"output"`` or ``"weight"``, the layers whose channels an equalization rescaled
    (``quantize_ptq``'s ``equalize`` / ``streams``): their output (and weight) or only their weight no longer
    equals the original float model's, so ``lowbit.debug.compare`` does not score them against it.
    """

    fused: list[str] = field(default_factory=list)
    converted: dict[str, str] = field(default_factory=dict)
    left_float: dict[str, str] = field(default_factory=dict)
    untraceable: dict[str, str] = field(default_factory=dict)
    absorbed: dict[str, list[str]] = field(default_factory=dict)
    rescaled: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"graph mode: {len(self.fused)} fused, {len(self.converted)} quantized, "
                 f"{len(self.left_float)} left float, {len(self.untraceable)} untraceable modules"]
        lines += [f"  untraceable  {p}: {why}" for p, why in self.untraceable.items()]
        lines += [f"  float  {p}: {why}" for p, why in self.left_float.items()]
        return "\n".join(lines)
