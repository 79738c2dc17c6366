"""What every part of the CLI shares: the one-line user error, stage wrapping, progress bars.

A user error is a ``CLIError``: ``lowbit`` prints it as one line (``lowbit: error: ...``) and exits
with status 2. Any other exception raised while a named stage runs (the user's factory, a
quantization method, writing the report) is turned into one by :func:`stage`, which names the stage
and the exception's first line; ``--traceback`` re-raises it instead, for debugging.

>>> try:
...     with stage("ptq"):
...         raise ValueError("bad\\nvalue")
... except CLIError as e:
...     print(e)
ptq failed: ValueError: bad value
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["CLIError", "stage", "progress", "one_line", "count", "cpus"]


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colour / bold codes some libraries put into messages


def one_line(e: BaseException) -> str:
    """``Type: message`` with the message's lines joined by spaces and terminal escape codes removed."""
    text = " ".join(_ANSI.sub("", str(e)).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


#: set by ``--traceback``: let unexpected exceptions propagate with their traceback
RAISE_UNEXPECTED = False


@contextmanager
def stage(what: str) -> Iterator[None]:
    """Turn any exception other than ``CLIError``/``KeyboardInterrupt`` into ``CLIError('<what> failed: ...')``."""
    try:
        yield
    except CLIError:
        raise
    except Exception as e:
        if RAISE_UNEXPECTED:
            raise
        raise CLIError(f"{what} failed: {one_line(e)}") from e


def progress(it: Iterable[Any], desc: str, total: int | None, quiet: bool) -> Iterator[Any]:
    """``tqdm`` over ``it`` on stderr when that is a terminal and ``quiet`` is false; else ``it`` unchanged."""
    if quiet or not sys.stderr.isatty():
        yield from it
        return
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        yield from it
        return
    yield from tqdm(it, desc=desc, total=total, leave=False, file=sys.stderr)


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def count(minimum: int, maximum: int | None = None) -> Any:
    """An argparse ``type``: an integer ``>= minimum`` (and ``<= maximum``, the CPUs), else a message naming it."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be >= {minimum}" + (" (0: the default)" if minimum == 0 else ""))
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"{v} is more than the {maximum} CPUs this process may use")
        return v
    parse.__name__ = "count"
    return parse
