"""``quantize_llm``'s recipe checked against the model before any work: 4-bit packing and the group size.

Group size: a Linear with ``K`` input features is quantized in groups of ``g`` columns only if ``g | K``.

- ``group_size`` given by the caller (an int ``g``, or -1 per channel): it must divide the ``in_features`` of every
  Linear it applies to (the decoder blocks' Linears, and the head for ``head="int4"``), else a ``ValueError``
  names those layers and the sizes that would divide them all. It is never changed.
- ``group_size=None`` (the default): 128 where it divides ``K``, else the largest ``128 / 2^j ≥ 8`` that does, else
  per channel (``fit_group_size``); every layer that got another size than 128 is named in one ``UserWarning``
  with the size it got (e.g. SmolLM2's 576-feature layers: 64).

>>> from torch import nn
>>> class M(nn.Module):
...     def __init__(self):
...         super().__init__(); self.model = nn.Module(); self.model.layers = nn.ModuleList([nn.Linear(96, 8)])
>>> resolve_group_size(M(), 32, 4, None, "f")
32
>>> try:
...     resolve_group_size(M(), 64, 4, None, "f")
... except ValueError as e:
...     print(str(e)[:101])
f: group_size=64 does not divide in_features of 1 layer(s): model.layers.0 (96); sizes dividing every
"""

from __future__ import annotations

import math
import warnings

from torch import nn

from ..nn.quantized.weight_only import fit_group_size
from .blocks import decoder_layers
from .tied import find_head

__all__ = ["DEFAULT_GROUP_SIZE", "check_shapes", "resolve_group_size"]

DEFAULT_GROUP_SIZE = 128


def _linears(model: nn.Module, bits: int, head: str | None) -> dict[str, nn.Linear]:
    """``{name: Linear}`` the block quantization (and a ``head="int4"`` head) will group."""
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    lins = {f"{prefix}.{n}": m for n, m in layers.named_modules() if type(m) is nn.Linear}
    if head == "int4":
        name, _ = find_head(model)
        lins[name] = model.get_submodule(name)
    return lins


def check_shapes(model: nn.Module, bits: int, head: str | None, fn: str = "quantize_llm") -> None:
    """Before any work: 4-bit Linears need an even ``in_features``, and ``head`` needs an output projection (both
    were raised after every block was quantized, leaving the caller's model half done with ``inplace=True``)."""
    if head is not None:
        find_head(model)  # a ValueError naming the model when it has none
    lins = _linears(model, bits, head) if bits == 4 else {}
    odd = [f"{n} ({m.in_features})" for n, m in lins.items() if m.in_features % 2]
    if odd:
        raise ValueError(f"{fn}: 4-bit codes are packed two per byte, so in_features must be even; {len(odd)} "
                         f"layer(s) have an odd number: {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''} "
                         f"(use bits=8{', head=int8' if head == 'int4' else ''})")


def resolve_group_size(model: nn.Module, group_size: int | None, bits: int, head: str | None, fn: str) -> int:
    """The group size to pass on: ``group_size`` itself once checked to divide every layer, or (``None``)
    ``DEFAULT_GROUP_SIZE``, with a warning naming each layer ``fit_group_size`` gives another size."""
    lins = _linears(model, bits, head)
    if group_size is not None:
        bad = [f"{n} ({m.in_features})" for n, m in lins.items() if group_size != -1 and m.in_features % group_size]
        if bad:
            k = math.gcd(*(m.in_features for m in lins.values()))
            fits = [g for g in (2 ** j for j in range(12, 2, -1)) if k % g == 0 and g < group_size]
            raise ValueError(f"{fn}: group_size={group_size} does not divide in_features of {len(bad)} layer(s): "
                             f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; sizes dividing every layer: "
                             + (", ".join(map(str, fits[:3])) + " (or -1: per channel" if fits else "-1 (per channel")
                             + "; or leave group_size unset: 128 halved per layer where it does not divide, "
                             "with a warning)")
        return group_size
    changed = {}
    for n, m in lins.items():
        g = fit_group_size(m.in_features, DEFAULT_GROUP_SIZE)
        if g != DEFAULT_GROUP_SIZE:
            changed[n] = (m.in_features, g)
    if changed:
        said = [f"{n} ({k} features: {'per channel' if g == -1 else f'group size {g}'})" for n, (k, g) in changed.items()]
        warnings.warn(f"{fn}: the default group size {DEFAULT_GROUP_SIZE} does not divide {len(changed)} layer(s); "
                      f"using: {', '.join(said[:4])}{' ...' if len(said) > 4 else ''} (pass group_size= to choose "
                      "one size for all)", stacklevel=3)
    return DEFAULT_GROUP_SIZE
