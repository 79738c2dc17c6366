"""One copy of each ``lowbit`` module per process, in any collection order.

pytest collects every file before it runs a test, so when this file runs, each ``src/lowbit`` module chosen for
its doctests (``--doctest-modules``) has been imported. Under ``--import-mode=importlib`` a submodule collected
before anything imported ``lowbit`` used to be executed a second time (the repository-root ``conftest.py`` says
how): ``sys.modules`` then held the copy that tests patch, and the library modules the copy they run. Run this
file after doctest paths to check an order, e.g. ``pytest src/lowbit/qstore.py src/lowbit/kernels
tests/test_import_once.py``.
"""

from __future__ import annotations

import sys
import types

import lowbit  # noqa: F401  (the package and what it imports: checked with whatever collection added)


def _lowbit_modules() -> list[tuple[str, types.ModuleType]]:
    return [(n, m) for n, m in list(sys.modules.items())
            if isinstance(m, types.ModuleType) and (n == "lowbit" or n.startswith("lowbit."))]


def test_every_module_reference_is_the_registered_module() -> None:
    """``from . import qstore`` in any lowbit module and ``lowbit.qstore`` name the module in ``sys.modules``."""
    stale = []
    for name, mod in _lowbit_modules():
        for attr, value in list(vars(mod).items()):
            if isinstance(value, types.ModuleType) and value.__name__.startswith("lowbit"):
                if sys.modules.get(value.__name__) is not value:
                    stale.append(f"{name}.{attr} -> a second copy of {value.__name__}")
    assert not stale, stale


def test_every_imported_class_and_function_is_the_registered_one() -> None:
    """``from .qtensor import QTensor`` anywhere in lowbit is the ``QTensor`` of ``sys.modules['lowbit.qtensor']``
    (a class or function defined at a module's top level, looked up again by its module and name)."""
    stale = []
    for name, mod in _lowbit_modules():
        for attr, value in list(vars(mod).items()):
            if not isinstance(value, (type, types.FunctionType)):
                continue
            home, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
            if not isinstance(home, str) or not home.startswith("lowbit") or "." in qual or "<" in qual:
                continue
            owner = sys.modules.get(home)
            if owner is not None and owner is not mod and vars(owner).get(qual, value) is not value:
                stale.append(f"{name}.{attr} -> a second copy of {home}.{qual}")
    assert not stale, stale
