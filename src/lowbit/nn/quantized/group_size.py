"""The weight-only group size of each Linear: one rule for ``quantize_weight_only`` and ``quantize_llm``.

A Linear with ``K`` input features is quantized in groups of ``g`` columns only if ``g | K``:

- a ``group_size`` the caller gave (an int ``g``, or -1 per channel) must divide the ``in_features`` of every Linear
  it applies to, else a ``ValueError`` names those layers and the sizes that would divide them all; it is never
  changed;
- ``group_size=None`` (the default) is ``DEFAULT_GROUP_SIZE`` (128) where it divides ``K``, else the largest
  ``128 / 2^j ≥ 8`` that does, else per channel (``fit_group_size``); every layer that got another size is named in
  one ``UserWarning`` with the size it got (e.g. SmolLM2's 576-feature layers: 64).

>>> checked_group_size({"fc": 96}, 32, "f")
32
>>> try:
...     checked_group_size({"fc": 96}, 64, "f")
... except ValueError as e:
...     print(str(e)[:70])
f: group_size=64 does not divide in_features of 1 layer(s): fc (96); s
"""

from __future__ import annotations

import math
import warnings

__all__ = ["DEFAULT_GROUP_SIZE", "checked_group_size", "fit_group_size"]

DEFAULT_GROUP_SIZE = 128


def fit_group_size(k: int, group_size: int) -> int:
    """The group size to use for ``k`` input features: ``group_size`` if it divides ``k`` (or is -1, per
    channel), else the largest ``group_size / 2^j`` that does, if ≥ 8, else -1 (per channel).

    >>> fit_group_size(768, 128), fit_group_size(576, 128), fit_group_size(20, 128)
    (128, 64, -1)
    """
    if group_size == -1 or k % group_size == 0:
        return group_size
    g = group_size
    while g > 1 and k % g:
        g //= 2
    return g if g >= 8 else -1


def checked_group_size(in_features: dict[str, int], group_size: int | None, fn: str, stacklevel: int = 3) -> int:
    """The group size to pass on for the layers ``{name: in_features}``: ``group_size`` itself once checked to divide
    every layer, or (``None``) ``DEFAULT_GROUP_SIZE``, with a warning naming each layer ``fit_group_size`` gives
    another size (``fit_group_size(k, returned)`` is then each layer's size either way)."""
    if group_size is not None:
        bad = [f"{n} ({k})" for n, k in in_features.items() if group_size != -1 and k % group_size]
        if bad:
            common = math.gcd(*in_features.values())
            fits = [g for g in (2 ** j for j in range(12, 2, -1)) if common % g == 0 and g < group_size]
            raise ValueError(f"{fn}: group_size={group_size} does not divide in_features of {len(bad)} layer(s): "
                             f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; sizes dividing every layer: "
                             + (", ".join(map(str, fits[:3])) + " (or -1: per channel" if fits else "-1 (per channel")
                             + "; or leave group_size unset: 128 halved per layer where it does not divide, "
                             "with a warning)")
        return group_size
    changed = {n: (k, fit_group_size(k, DEFAULT_GROUP_SIZE)) for n, k in in_features.items()
               if fit_group_size(k, DEFAULT_GROUP_SIZE) != DEFAULT_GROUP_SIZE}
    if changed:
        said = [f"{n} ({k} features: {'per channel' if g == -1 else f'group size {g}'})" for n, (k, g) in changed.items()]
        warnings.warn(f"{fn}: the default group size {DEFAULT_GROUP_SIZE} does not divide {len(changed)} layer(s); "
                      f"using: {', '.join(said[:4])}{' ...' if len(said) > 4 else ''} (pass group_size= to choose "
                      "one size for all)", stacklevel=stacklevel + 1)
    return DEFAULT_GROUP_SIZE
