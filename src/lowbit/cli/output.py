"""The ``--out`` folder: checked before any work, written elsewhere, swapped in whole, or left untouched.

``OutputFolder(path)`` checks ``path`` at once — it must be missing, an empty folder, or a folder a
previous ``lowbit`` run wrote (it holds the marker file ``.lowbit-out``, or only files named like
lowbit's outputs) — and creates a staging folder beside it (same file system), named after this
host and process so that the next run removes it should this one be killed (SIGKILL, a crash). The run writes into
``staging``; ``commit()`` swaps the staging folder in for ``path`` in one rename (``renameat2``'s
``RENAME_EXCHANGE`` on Linux; elsewhere two renames, the old folder moved aside first) and then
deletes the old run. Leaving the ``with`` block by an exception (or Ctrl-C) deletes the staging
folder and leaves ``path`` as it was, so a rerun never mixes runs and a failed run changes nothing.

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> with OutputFolder(root / "out") as folder:
...     _ = (folder.staging / "report.md").write_text("# run 1")
...     _ = folder.commit()
>>> sorted(p.name for p in (root / "out").iterdir())
['.lowbit-out', 'report.md']
>>> (root / "notes.txt").write_text("mine") and None
>>> OutputFolder(root / "notes.txt")
Traceback (most recent call last):
...
lowbit.cli.common.CLIError: --out ... names an existing file; give a folder (it is replaced as a whole)
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from .common import CLIError

__all__ = ["OutputFolder", "MARKER", "strict_json", "check_inputs_outside"]

MARKER = ".lowbit-out"
#: files a lowbit run writes (older runs wrote no marker): its models by method, reports, report figures; a user's
#: own model_best.pt is not one of them (a folder holding it was replaced as a whole)
_OURS = re.compile(r"model_(fp32|ptq|qat|dynamic|weight_only|rtn|int8|w8a8)\.pt|report\.(json|md|html)"
                   r"|report_(sqnr|activations)\.png")


def strict_json(obj: Any) -> str:
    """``obj`` as strict JSON (RFC 8259): NaN and ±Inf become ``null``, tuples lists.

    >>> strict_json({"acc": float("nan"), "sqnr": [1.5, float("inf")]})
    '{"acc": null, "sqnr": [1.5, null]}'
    """
    def clean(o: Any) -> Any:
        if isinstance(o, float):
            return o if math.isfinite(o) else None
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    return json.dumps(clean(obj), allow_nan=False)


def check_inputs_outside(out: str | Path, inputs: dict[str, Any]) -> None:
    """``--out`` is replaced as a whole: an input file or folder inside it (``{flag: path or None}``) is refused.
    A path holding a NUL character names no file: refused here, first (``Path.resolve`` raised "embedded null
    byte" with a traceback)."""
    for flag, path in {"--out": out, **inputs}.items():
        if isinstance(path, str) and "\x00" in path:
            raise CLIError(f"{flag} {path!r} holds a NUL character, which no file name can hold")
    root = Path(out).absolute().resolve()
    for flag, path in inputs.items():
        if path is None:
            continue
        p = Path(path).absolute().resolve()
        if p == root or root in p.parents:
            raise CLIError(f"{flag} {path} lies inside --out {out}, which is replaced as a whole; move it out first")


def _check_target(out: Path) -> None:
    try:
        _check_target_path(out)
    except OSError as e:  # a name too long, a parent we may not list, ...: the OSError's traceback before any work
        raise CLIError(f"--out {out}: {e.strerror or e}") from e


def _check_target_path(out: Path) -> None:
    cwd = Path.cwd()
    if out.absolute() == cwd or out.absolute() in cwd.parents:  # the staging folder would sit inside --out itself
        raise CLIError(f"--out {out} is the current folder or one above it, which lowbit cannot replace as a whole; "
                       "give a folder of its own (e.g. --out lowbit-out)")
    if out.is_symlink():
        raise CLIError(f"--out {out} is a symbolic link; give the folder itself (it is replaced as a whole)")
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} names an existing file; give a folder (it is replaced as a whole)")
    if out.is_dir():
        names = sorted(p.name for p in out.iterdir())
        foreign = [n for n in names if n != MARKER and not _OURS.fullmatch(n)]
        if foreign and MARKER not in names:
            raise CLIError(f"--out {out} is a folder lowbit did not write (it holds {foreign[0]!r}); lowbit replaces "
                           "its output folder as a whole, so give a new folder or a previous lowbit output")
    for parent in out.absolute().parents:  # first existing ancestor: must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise CLIError(f"--out {out}: {parent} is a file, not a folder")
            break


def _staging_prefix() -> str:
    """``.lowbit-<host>-<pid>-``: whose staging folder it is, so a later run can remove it if that run died."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40] or "host"
    return f".lowbit-{host}-{os.getpid()}-"


_STAGING = re.compile(r"\.lowbit-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-")


def _remove_stale_staging(parent: Path) -> None:
    """Delete staging folders a killed run (SIGKILL, a crash) left beside ``--out``: same host, dead pid."""
    if os.name != "posix":  # os.kill(pid, 0) is a liveness probe only on POSIX (on Windows it terminates)
        return
    host = _staging_prefix().split("-")[1]
    for p in parent.iterdir():
        m = _STAGING.match(p.name)
        if not m or m["host"] != host or not p.is_dir() or p.is_symlink():
            continue
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (PermissionError, OverflowError, OSError):
            pass                      # alive (another user's), or not ours to judge


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError, TypeError):   # not Linux/glibc: no renameat2
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


class OutputFolder:
    """Context manager around ``--out``: check now, stage in ``self.staging``, ``commit()`` swaps in."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(os.path.normpath(out))  # '' -> '.', 'a/b/..' -> 'a': the staging folder goes beside it
        _check_target(self.out)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_staging(self.out.parent)
            self.staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(), dir=self.out.parent))
        except OSError as e:
            raise CLIError(f"--out {out}: cannot write there ({e.strerror or e})") from e
        self.committed = False

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.discard()

    def discard(self) -> None:
        """Delete the staging folder (after a commit it holds the old run, or is already gone)."""
        shutil.rmtree(self.staging, ignore_errors=True)

    def commit(self) -> list[str]:
        """Swap the staging folder in for ``out``; return the names it holds. Ctrl-C and SIGTERM wait until it is done."""
        (self.staging / MARKER).write_text(json.dumps({"written_by": "lowbit quantize"}) + "\n")
        names = sorted(p.name for p in self.staging.iterdir() if p.name != MARKER)
        block = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
        if block:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            _check_target(self.out)  # changed under us since the start (e.g. now a file)? keep it
            try:
                if not self.out.exists():
                    os.rename(self.staging, self.out)
                elif not _exchange(self.staging, self.out):
                    aside = Path(tempfile.mkdtemp(prefix=_staging_prefix() + "old-", dir=self.out.parent))
                    os.rename(self.out, aside / "old")
                    try:
                        os.rename(self.staging, self.out)
                    except OSError:
                        os.rename(aside / "old", self.out)   # put the old run back
                        raise
                    finally:
                        shutil.rmtree(aside, ignore_errors=True)
            except OSError as e:
                raise CLIError(f"--out {self.out}: cannot replace it ({e.strerror or e}); it is unchanged") from e
            self.committed = True
        finally:
            if block:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        return names
