"""Process settings for inference speed that belong to no model: ``keep_freed_memory``.

Why. PyTorch's CPU tensors come from the C library's ``malloc``. glibc's defaults give memory back to the
kernel as soon as a large block is freed: a block past the (adaptive, at most 32 MiB) mmap threshold is
unmapped on ``free``, and free space at the top of the heap past the trim threshold is returned with
``sbrk``. The next forward's tensors of the same size then touch fresh pages, and every 4 KiB page costs a
page fault. A transformer's activations are big (MiniLM, batch 32 × 128 tokens: 6 MiB per hidden state,
25 MiB per FFN activation), so the faults add up: measured on a 2-vCPU AMD EPYC (Zen 5) VM, 1 thread, fresh
processes (``benchmarks/heap.py``), 41,000-48,000 minor faults per MiniLM forward at ~1.3 µs each, 290-301 ms per
forward for lowbit's dynamic int8 model and 291-292 ms for torch.ao's; with ``keep_freed_memory()`` 0-308 faults,
227-230 ms and 227-230 ms (1.28-1.31x; 1.35-1.40x at 2 threads; same peak RSS, ~800 MB). Both models gain alike:
the ratio between them does not move. The cost of a fault varies by machine (bare metal is several times cheaper
than this VM), so the gain does too.

What. ``keep_freed_memory()`` sets two glibc ``mallopt`` parameters for the whole process:

- ``M_MMAP_MAX = 0``: no block is served by ``mmap``, so freeing one never unmaps it;
- ``M_TRIM_THRESHOLD = 2**31 - 1``: the heap's free top is (practically) never returned to the kernel;

so memory freed by one forward is reused by the next without faults. The trade: the process keeps its
peak heap until it exits (resident memory does not shrink after a large batch), as with the caching
allocators (jemalloc, tcmalloc) that PyTorch's CPU performance guides recommend preloading, and that heap can
grow past the working set: a 64-byte-aligned block (PyTorch's) can be a few bytes too big for the hole its
predecessor left when small allocations pin the alignment slack, and the heap grows instead. A loop making
one 64 MiB tensor at a time settled at 731 MB peak RSS against 283 MB with glibc's defaults (60 rounds; 2,185
faults a round against 16,385); MiniLM's forward showed no growth (776-865 MB either way). It changes
no number a model computes. It is process-wide and cannot be undone in the same process (glibc has no
getter for these parameters; setting them also turns off its adaptive thresholds), which is why lowbit
never calls it by itself. The environment variable route, before the process starts, is
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647``.

Returns ``True`` where the settings were applied (glibc), ``False`` elsewhere (musl, macOS, Windows: their
allocators behave differently; nothing is changed); ``reason()`` says which.

>>> from lowbit.runtime import keep_freed_memory, reason
>>> isinstance(keep_freed_memory(dry_run=True), bool) and isinstance(reason(), str)
True
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["keep_freed_memory", "reason"]

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
_M_MMAP_MAX = -4
_TRIM = 2**31 - 1  # mallopt takes an int
_lock = threading.Lock()
_state: dict[str, object] = {"applied": False, "reason": "keep_freed_memory() has not been called"}


def _glibc() -> ctypes.CDLL | None:
    """The process's glibc (``None`` where the C library is another one, or has no ``mallopt``)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # not a POSIX system, or no such name
        version = None
    if not version or not version.startswith("glibc"):
        _state["reason"] = f"the C library is not glibc ({version or 'unknown'}): nothing changed"
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError) as e:
        _state["reason"] = f"glibc's mallopt is not reachable ({e}): nothing changed"
        return None
    return libc


def keep_freed_memory(dry_run: bool = False) -> bool:
    """Keep memory freed by tensors in this process for reuse instead of returning it to the kernel (glibc
    ``mallopt``: ``M_MMAP_MAX = 0``, ``M_TRIM_THRESHOLD = 2**31 - 1``; see the module docstring for the
    measured gain and the trade). Process-wide, idempotent, not undoable. ``dry_run=True``: only say whether it
    would apply. Returns whether the settings are (or would be) in force."""
    if not isinstance(dry_run, bool):
        raise TypeError(f"keep_freed_memory: dry_run={dry_run!r} must be True or False")
    with _lock:
        if _state["applied"]:
            return True
        libc = _glibc()
        if libc is None:
            return False
        if dry_run:  # (reason() says what a call would do, as it says what one did)
            _state["reason"] = ("dry run: glibc's mallopt is reachable; keep_freed_memory() would set M_MMAP_MAX=0, "
                                "M_TRIM_THRESHOLD=2**31-1 (nothing changed)")
            return True
        if libc.mallopt(_M_MMAP_MAX, 0) != 1:  # 1: success
            _state["reason"] = "glibc's mallopt refused M_MMAP_MAX=0: nothing changed"
            return False
        if libc.mallopt(_M_TRIM_THRESHOLD, _TRIM) != 1:  # the first is in force and cannot be taken back
            _state["reason"] = ("glibc's mallopt refused M_TRIM_THRESHOLD=2**31-1 after taking M_MMAP_MAX=0: only "
                                "M_MMAP_MAX=0 is in force (large blocks stay in the heap; its free top is still trimmed)")
            return False
        _state["applied"] = True
        _state["reason"] = "applied: glibc mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2**31-1"
        return True


def reason() -> str:
    """What ``keep_freed_memory`` did (or why it did nothing) in this process."""
    return str(_state["reason"])
