"""User fusion patterns: add a fusible module run without editing lowbit (the role of torch.ao's BackendConfig).

``register_fusion_pattern((A, B[, C]), fuser, fused_type=..., quantized=..., qat=...)`` teaches
every fusion path a new run of module types:

- ``fuse_modules`` / ``fuse_modules_qat`` fuse a group of these types with
  ``fuser(is_qat, a, b, ...)`` (torch.ao's ``fuser_method`` signature), before the built-in table;
- graph mode (``fuse_fx``, ``prepare_fx``, ``prepare_qat_fx``) fuses every chain of ``call_module``
  nodes of these types (each output read only by the next module, each module called once);
- ``quantized`` (a class with ``from_float``) is added to the static mapping for ``fused_type``
  (the class ``fuser`` returns), so ``prepare``/``convert`` and ``prepare_fx``/``convert_fx``
  quantize the fused module; ``qat`` (a class with ``from_float``) to the QAT mapping for
  ``fused_type``, and ``qat → quantized`` to the static one.

The registry is process-wide; ``unregister_fusion_pattern`` removes an entry, ``fusion_patterns()``
lists them. Patterns match module types exactly (functions such as ``F.relu`` are not pattern
elements: use the ``nn.ReLU`` module form).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> class ConvReLU6(nn.Sequential):             # the fused marker
...     pass
>>> _ = register_fusion_pattern((nn.Conv2d, nn.ReLU6), lambda is_qat, conv, act: ConvReLU6(conv, act),
...                             fused_type=ConvReLU6)
>>> m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU6())
>>> [type(c).__name__ for c in Q.fuse_modules(m, [["0", "1"]])]
['ConvReLU6', 'Identity']
>>> unregister_fusion_pattern((nn.Conv2d, nn.ReLU6))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["FusionPattern", "register_fusion_pattern", "unregister_fusion_pattern", "fusion_patterns",
           "find_fusion_pattern"]


@dataclass(frozen=True)
class FusionPattern:
    """One registered run: module ``pattern`` types, ``fuser(is_qat, *mods) -> nn.Module`` and the classes
    that quantize (``quantized``) or train (``qat``) the fused module of type ``fused_type``."""

    pattern: tuple[type, ...]
    fuser: Callable[..., nn.Module]
    fused_type: type | None = None
    quantized: type | None = None
    qat: type | None = None


_PATTERNS: dict[tuple[type, ...], FusionPattern] = {}


def register_fusion_pattern(pattern: tuple[type, ...], fuser: Callable[..., nn.Module], fused_type: type | None = None,
                            quantized: type | None = None, qat: type | None = None) -> FusionPattern:
    """Register (or replace) the fusion of ``pattern``; see the module docstring. Returns the entry."""
    where = "register_fusion_pattern"
    if (not isinstance(pattern, tuple) or not 2 <= len(pattern) <= 4
            or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in pattern)):
        raise TypeError(f"{where}: pattern must be a tuple of 2-4 nn.Module classes, got {pattern!r}")
    if not callable(fuser):
        raise TypeError(f"{where}: fuser must be callable as fuser(is_qat, *modules), got {fuser!r}")
    if fused_type is not None and not (isinstance(fused_type, type) and issubclass(fused_type, nn.Module)):
        raise TypeError(f"{where}: fused_type={fused_type!r} must be the nn.Module class fuser returns")
    if (quantized is not None or qat is not None) and fused_type is None:
        raise ValueError(f"{where}: give fused_type (the class fuser returns) with quantized= or qat=")
    for name, cls in (("quantized", quantized), ("qat", qat)):
        if cls is not None and not hasattr(cls, "from_float"):
            raise TypeError(f"{where}: {name}={cls!r} has no from_float classmethod")
    entry = FusionPattern(pattern, fuser, fused_type, quantized, qat)
    _PATTERNS[pattern] = entry
    return entry


def unregister_fusion_pattern(pattern: tuple[type, ...]) -> None:
    """Remove a registered pattern (``KeyError`` naming it if absent)."""
    if not isinstance(pattern, tuple) or not all(isinstance(t, type) for t in pattern):
        raise TypeError(f"unregister_fusion_pattern: pattern={pattern!r} must be a tuple of module classes, "
                        "as registered")
    if pattern not in _PATTERNS:
        raise KeyError(f"unregister_fusion_pattern: {tuple(t.__name__ for t in pattern)} is not registered")
    del _PATTERNS[pattern]


def fusion_patterns() -> list[FusionPattern]:
    """The registered patterns, in registration order."""
    return list(_PATTERNS.values())


def find_fusion_pattern(types: tuple[type, ...]) -> FusionPattern | None:
    """The entry registered for exactly these module types, or ``None``."""
    return _PATTERNS.get(types)


def extra_mappings(kind: str) -> dict[Any, Any]:
    """The swap-table entries the registry adds: ``kind`` ``"static"`` or ``"qat"``."""
    out: dict[Any, Any] = {}
    for p in _PATTERNS.values():
        if kind == "static":
            if p.quantized is not None:
                out[p.fused_type] = p.quantized
                if p.qat is not None:
                    out[p.qat] = p.quantized
        elif p.qat is not None:
            out[p.fused_type] = p.qat
    return out
