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

from torch import nn

from ..nn.quantized.group_size import DEFAULT_GROUP_SIZE, checked_group_size
from .blocks import decoder_layers
from .tied import find_head

__all__ = ["DEFAULT_GROUP_SIZE", "check_shapes", "resolve_group_size"]


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
    ``DEFAULT_GROUP_SIZE``, with a warning naming each layer ``fit_group_size`` gives another size
    (``nn.quantized.group_size.checked_group_size``: ``quantize_weight_only``'s rule too)."""
    return checked_group_size({n: m.in_features for n, m in _linears(model, bits, head).items()}, group_size, fn,
                              stacklevel=4)
