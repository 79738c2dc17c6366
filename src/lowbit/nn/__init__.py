"""Module families: ``quantized`` (static, + ``quantized.dynamic``), ``qat``, ``intrinsic`` (+ ``intrinsic.qat``).

Subpackages load on first access, so ``import lowbit`` stays light.

>>> import lowbit.nn
>>> lowbit.nn.quantized.Linear.__name__
'Linear'
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["quantized", "qat", "intrinsic"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
