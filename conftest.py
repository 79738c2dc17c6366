"""Repository-root pytest hooks: one copy of every ``lowbit`` module, whatever order the files are collected in.

``--doctest-modules --import-mode=importlib`` (pyproject.toml) imports each ``src/lowbit`` file itself. For
``src/lowbit/qstore.py`` pytest looks up ``sys.modules["lowbit.qstore"]`` first and, when it is missing, imports
the parent package ``lowbit`` — whose ``__init__`` imports ``lowbit.qstore`` (copy A, bound by every module that
imported it) — and then executes the file again as copy B, which replaces A in ``sys.modules`` and as the
``lowbit.qstore`` attribute (pytest-dev/pytest#11306, #11475). Tests then patch or reset B (``monkeypatch`` of
``qstore.plain``, ``conftest.fresh_warn_once`` on ``qtensor._warned_ops``) while the library runs A: failures that
appear only when a submodule's doctests are collected before anything imported ``lowbit``. Importing the parent
package the ordinary way first puts A in ``sys.modules``, and pytest then takes A as it is.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

_SRC = Path(__file__).resolve().parent / "src"


def pytest_collect_file(file_path: Path, parent: object) -> None:
    """Import the package that holds a ``src/`` module (``lowbit.kernels`` for ``src/lowbit/kernels/plan.py``,
    ``lowbit`` for ``src/lowbit/kernels/__init__.py``) before pytest imports the module for its doctests."""
    if file_path.suffix != ".py" or _SRC not in file_path.resolve().parents:
        return None
    parts = file_path.resolve().relative_to(_SRC).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if len(parts) > 1:
        # a package that fails to import fails again, with pytest's own report, when pytest imports the module
        with contextlib.suppress(Exception):
            importlib.import_module(".".join(parts[:-1]))
    return None
