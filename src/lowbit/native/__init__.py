"""lowbit's native passes: C files (``rowquant.c``, ``linear.c``, ``pool.c``, ``stubs.c``, ``dynamic.c``, ``smallconv.c``)
doing in one call what torch (or oneDNN) needs several for, or does slowly.

Every pass does the same float32 operations, in the same order, as the torch ops (or the fbgemm op) it replaces (built
with ``-ffp-contract=off``, an FMA explicit where torch's ``addcmul_`` fuses; integer sums exact), so its results are
bit for bit theirs (``tests/test_native.py`` and ``tests/test_native_gemm.py`` check them against each other, both C
bodies, 1 and 2 threads). ``rows``: the per-token Linear's row grids and epilogue, the quantized add, the Quantize and
DeQuantize stubs' passes (the stubs, row grids and row epilogue have AVX-512 bodies where the CPU has AVX-512F, AVX2 and
scalar ones elsewhere, the same codes and floats). ``layers``: the split-weight conv epilogue, a depthwise conv, max
pooling of channels-last codes (``pool.c``). ``smallconv``: a dense conv with a small window (an image model's first
conv; VNNI, AVX2 and scalar bodies). ``gemm``: the int8 Linears (``LinearPlan``: lowbit's float epilogue, fbgemm's
requantization, the per-token rows; ``dyn_linear``: the per-token dynamic Linear, its row grids and codes included, in
one call, ``dynamic.c``).

The C sources are compiled once per machine and source version with the system's C compiler (``cc``, or ``$CC``)
into ``$LOWBIT_CACHE_DIR`` (default ``~/.cache/lowbit``; a new build removes other versions' builds unused for a
week; no torch headers: ~1-12 s once). Where this interpreter's ``Python.h`` is installed the same object is also a
CPython extension whose fast-call functions are the entry points (``entry``: ~0.3 µs a call); elsewhere, or with
``LOWBIT_NATIVE_ENTRY=ctypes``, they are called through ``ctypes`` (~3-6 µs a call: the same C calls, the same
values; ``entry_points()`` says which, ``through_ctypes()`` pins ctypes in tests). It
takes AVX2 + FMA bodies where the CPU has them, checked at run time, and scalar bodies with the same results
elsewhere; work is split over ``torch.get_num_threads()`` threads of torch's own OpenMP pool (the object links
``libgomp.so.1``, which resolves to the copy torch loaded) for inputs past ATen's grain size. Where there is no
compiler, the build fails or ``LOWBIT_NATIVE=0`` is set, ``available()`` is ``False`` and every caller keeps its
torch ops (the same numbers, slower); ``reason()`` says why. Tensors a pass cannot take (dtype, layout, device,
a non-finite row) give ``None`` (the caller's torch path runs); wrong argument values raise ``ValueError``.

>>> from lowbit import native
>>> isinstance(native.available(), bool) and isinstance(native.reason(), str)
True
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
from pathlib import Path
from collections import Counter
from typing import Iterator

import torch

from . import entry

__all__ = ["available", "traced_available",
           "reason", "row_grid", "row_epilogue", "all_finite", "conv_epilogue", "qadd", "quantize_into", "dequantize",
           "dwconv", "dw_weight", "smallconv", "smallconv_prepared", "smallconv_weight", "smallconv_body", "maxpool_codes",
           "to_channels_last", "to_contiguous", "im2col", "conv_out_hw", "qlinear", "qlinear_requant",
           "qlinear_rows", "LinearPlan", "linear_plan", "dyn_linear", "empty_codes", "disabled", "through_ctypes",
           "entry_points", "force_scalar", "force_avx2", "force_vnni", "vnni", "amx", "counts"]

_DIR = Path(__file__).parent
# compiled together; all include common.h
_SRC = [_DIR / "rowquant.c", _DIR / "linear.c", _DIR / "pool.c", _DIR / "stubs.c", _DIR / "dynamic.c",
        _DIR / "smallconv.c"]
_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno"]
_OPENMP = "-fopenmp"  # tried first; a compiler without OpenMP builds the single-threaded object
_THREAD_MIN = 1 << 15  # floats a pass must cover before it is split over threads (ATen's grain size)
_state: dict[str, object] = {}
_lock = threading.Lock()
_local = threading.local()  # per-thread switches for tests: disabled(), force_scalar()
counts: Counter[str] = Counter()  # the passes that ran natively, by function name (as kernels.counts)


def _cache_dir() -> Path:
    root = os.environ.get("LOWBIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lowbit")
    return Path(root) / "native"


def _build() -> tuple[types.SimpleNamespace | None, types.SimpleNamespace | None, str]:
    """``(entry points, their ctypes twins, what was built or why nothing was)``: see the module doc."""
    switch = os.environ.get("LOWBIT_NATIVE", "").strip()
    if switch not in ("", "0", "1"):  # ("off", "false": the passes ran on, silently)
        raise ValueError(f"LOWBIT_NATIVE={switch!r}: set it to 0 (no native passes) or 1 (the default)")
    if switch == "0":
        return None, None, "LOWBIT_NATIVE=0"
    missing = [str(f) for f in (*_SRC, _DIR / "common.h") if not f.exists()]
    if sys.platform != "linux" or missing:
        return None, None, f"{missing[0]} is missing" if missing else f"no native build on {sys.platform}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, None, "no C compiler (cc / gcc / $CC) on PATH"
    want = os.environ.get("LOWBIT_NATIVE_ENTRY", "").strip() or "cpython"  # (empty: unset, as $CC, $LOWBIT_CACHE_DIR)
    if want not in ("cpython", "ctypes"):
        raise ValueError(f"LOWBIT_NATIVE_ENTRY={want!r}: set it to 'cpython' (the default) or 'ctypes'")
    src = b"".join(f.read_bytes() for f in (*_SRC, _DIR / "common.h"))
    inc = entry.python_include()  # the CPython entry points need Python.h; without it ctypes alone calls the passes
    ext = entry.wrapper_source() if inc is not None else ""
    abi = f"{sysconfig.get_config_var('SOABI')} {inc}" if inc is not None else ""
    tag = hashlib.sha256(src + " ".join([cc, *_FLAGS, _OPENMP, abi]).encode() + ext.encode()).hexdigest()[:16]
    lib = _cache_dir() / f"lowbit-native-{tag}.so"
    if not lib.exists():
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then one atomic rename
                out = Path(tmp) / lib.name
                wrap: list[str] = []
                if inc is not None:
                    (Path(tmp) / "pyentry.c").write_text(ext)
                    wrap = [f"-I{inc}", str(Path(tmp) / "pyentry.c")]
                # with the entry points and OpenMP, then without OpenMP, then each without the entry points
                tries = [[_OPENMP, *wrap], wrap, [_OPENMP], []]
                for extra in [e for i, e in enumerate(tries) if e not in tries[:i]]:
                    done = subprocess.run([cc, *_FLAGS, *extra, "-o", str(out), *map(str, _SRC)], capture_output=True,
                                          text=True, timeout=120)
                    if done.returncode == 0:
                        break
                else:
                    return None, None, f"{cc} failed: {done.stderr.strip()[-300:]}"
                os.replace(out, lib)
            _prune(lib)
        except (OSError, subprocess.SubprocessError) as e:
            return None, None, f"native build failed: {e}"
    try:
        dll = ctypes.CDLL(str(lib))
        fast, slow = entry.bind(dll, lib, want)
    except (OSError, AttributeError) as e:
        return None, None, f"cannot load {lib}: {e}"
    body = "AVX2 + FMA bodies" if fast.lb_cpu_avx2() else "scalar bodies (no AVX2 + FMA on this CPU)"
    if fast.lb_cpu_avx512():
        body += ", AVX-512 stubs and row passes"
    if fast.lb_cpu_vnni():
        body += ", AVX-512 VNNI Linears"
    body += ", OpenMP threads" if fast.lb_openmp() else ", one thread (built without OpenMP)"
    why = ("LOWBIT_NATIVE_ENTRY=ctypes" if want == "ctypes" else "built without them" if inc else "no Python.h")
    return fast, slow, body + (", CPython entry points" if fast is not slow else f", ctypes entry points ({why})")


_STALE_S = 7 * 24 * 3600  # builds of other source versions unused this long are removed when a new one is made


def _prune(keep: Path) -> None:
    """Remove other builds (``lowbit-native-*.so``, and session 13's ``rowquant-*.so``) from ``keep``'s folder whose
    last use (access or change) is older than ``_STALE_S``: every source edit adds one, and none was ever removed.
    A process that still has one loaded keeps its mapping; a newer lowbit rebuilds its own in about a second."""
    now = time.time()
    for old in [*keep.parent.glob("lowbit-native-*.so"), *keep.parent.glob("rowquant-*.so")]:
        if old == keep:
            continue
        try:
            st = old.stat()
            if now - max(st.st_atime, st.st_mtime) > _STALE_S:
                old.unlink()
        except OSError:
            pass  # (another process removed it, or it is not ours to remove)


def _lib() -> types.SimpleNamespace | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["ctypes"], _state["reason"] = _build()
    if _local.__dict__.get("off", False):
        return None
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the native passes run in this thread (built and loaded, not switched off)."""
    return _lib() is not None


def traced_available() -> bool:
    """``available()`` as traced code reads it: once per trace, as a constant (marked as
    ``torch.compiler.assume_constant_result`` does, without importing dynamo). Where it is true, the quantize stub
    and the quantized add emit their opaque ops (``lowbit::quantize_codes``, ``lowbit::qfunctional``), whose eager
    native one-pass bodies beat inductor's kernels of the same float32 steps (``stubs.Quantize``,
    ``functional_modules._inductor_exact``); elsewhere they emit aten ops."""
    return available()


traced_available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def reason() -> str:
    """What the native build gave: the bodies it runs, or why it is not used."""
    _lib()
    return str(_state["reason"])


class _Disabled:
    """``disabled()``'s context manager: a class, not a generator (~0.3 µs instead of ~3 per block, which matters
    where benchmarks time small calls with the native passes off). What each enter found is kept on this thread's
    stack, not on the object: one object may be entered again inside itself (a module-level ``OFF = native.disabled()``)
    or by several threads, and each exit restores its own thread's state."""

    __slots__ = ()

    def __enter__(self) -> None:
        d = _local.__dict__
        d.setdefault("off_stack", []).append(d.get("off", False))
        _local.off = True

    def __exit__(self, *exc: object) -> None:
        _local.off = _local.off_stack.pop()


@contextlib.contextmanager
def through_ctypes() -> Iterator[None]:
    """Every native call inside this block goes through ``ctypes`` even where the CPython entry points were built (the
    same C calls with the same values, ~3-6 µs more each): tests run both ways of calling on every machine. It swaps
    the process's entry points (not one thread's: the hot paths read them without a thread-local lookup)."""
    lib = _lib()
    slow = _state.get("ctypes")
    if lib is None or slow is None or slow is lib:
        yield
        return
    with _lock:
        _state["lib"] = slow
    try:
        yield
    finally:
        with _lock:
            _state["lib"] = lib


def entry_points() -> str:
    """How the native passes are called here: ``"cpython"`` (the ``_lowbit_native`` extension), ``"ctypes"``, or
    ``"none"`` (no native build, or ``disabled()`` in this thread)."""
    lib = _lib()
    return "none" if lib is None else "ctypes" if lib is _state.get("ctypes") else "cpython"


def disabled() -> _Disabled:
    """Callers keep their torch ops inside this block (this thread): the reference for the native passes."""
    return _Disabled()


@contextlib.contextmanager
def _pinned(isa: int) -> Iterator[None]:
    """The C bodies of ``isa`` (0 scalar, 1 the best, 2 AVX2: common.h's ``use_avx2`` / ``use_vnni``) in this block."""
    old = _local.__dict__.get("isa", 1)
    _local.isa = isa
    try:
        yield
    finally:
        _local.isa = old


def force_scalar() -> contextlib.AbstractContextManager[None]:
    """The scalar C bodies inside this block (this thread), on any CPU: tests cover both bodies everywhere."""
    return _pinned(0)


def force_avx2() -> contextlib.AbstractContextManager[None]:
    """The AVX2 bodies inside this block (this thread) even on a CPU with AVX-512 VNNI, whose Linears otherwise take
    their VNNI kernels (the same sums): tests cover both where the CPU has both. No effect without AVX2."""
    return _pinned(2)


def force_vnni() -> contextlib.AbstractContextManager[None]:
    """The VNNI kernels inside this block (this thread) even on a CPU with AMX, whose Linears on ``k % 64 == 0`` otherwise
    make their sums with AMX tiles (the same sums): tests compare the two. Elsewhere the same as no pin."""
    return _pinned(3)


def amx() -> bool:
    """Whether the Linears' AMX int8 sums run in this thread (built, the CPU has AMX-INT8 and Linux grants the tiles,
    not pinned away): ``LinearPlan`` runs of 8 rows or more on the VNNI packing with ``k % 64 == 0`` take them."""
    lib = _lib()
    if lib is None or _local.__dict__.get("isa", 1) != 1:
        return False
    cpu = _state.get("amx_cpu")
    if cpu is None:
        cpu = _state["amx_cpu"] = bool(lib.lb_cpu_amx())
    return cpu  # type: ignore[return-value]


def vnni() -> bool:
    """Whether the Linears' AVX-512 VNNI kernels run in this thread (built, the CPU has them, not pinned away)."""
    lib = _lib()
    if lib is None or _local.__dict__.get("isa", 1) != 1:
        return False
    cpu = _state.get("vnni_cpu")
    if cpu is None:  # (asked once: plans ask on calls that may pack)
        cpu = _state["vnni_cpu"] = bool(lib.lb_cpu_vnni())
    return cpu  # type: ignore[return-value]


def _threads(work: int) -> int:
    return torch.get_num_threads() if work >= _THREAD_MIN else 1


_STORAGE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}


def _check_grid(fn: str, zero_point: int, lo: int, hi: int, storage: torch.dtype = torch.uint8,
                inv: float | None = None) -> None:
    """Argument values a caller got wrong raise (tensors that do not fit a pass return ``None`` instead): the code range
    ``[lo, hi]`` and the zero point inside the 8-bit storage, ``inv`` (``1 / scale``) finite and positive."""
    smin, smax = _STORAGE[storage]
    if not smin <= lo <= hi <= smax:
        raise ValueError(f"lowbit.native.{fn}: code range lo={lo!r}, hi={hi!r} is not an interval inside [{smin}, {smax}]")
    if not smin <= zero_point <= smax:
        raise ValueError(f"lowbit.native.{fn}: zero_point={zero_point!r} is outside [{smin}, {smax}]")
    if inv is not None and not (math.isfinite(inv) and inv > 0):
        raise ValueError(f"lowbit.native.{fn}: inv={inv!r} must be a finite positive 1 / scale")


def _check_conv(fn: str, zx: int, stride: list[int], padding: list[int], dilation: list[int]) -> None:
    """A native conv's argument values (raise naming the value): the input zero point an int in the u8 range, two
    strides and dilations of at least 1, two paddings of at least 0."""
    if isinstance(zx, bool) or not isinstance(zx, int) or not 0 <= zx <= 255:
        raise ValueError(f"lowbit.native.{fn}: input zero point zx={zx!r} is not an int in [0, 255]")
    geometry = (list(stride), list(padding), list(dilation))
    if any(len(g) != 2 for g in geometry) or min(*stride, *dilation) < 1 or min(padding) < 0:
        raise ValueError(f"lowbit.native.{fn}: stride={stride!r}, padding={padding!r}, dilation={dilation!r} must be "
                         "two values each, stride and dilation >= 1, padding >= 0")


def _check_kernel(fn: str, kernel: tuple[int, int]) -> None:
    """A native 2-d conv's window (raise naming the value): two ints of at least 1."""
    if (not isinstance(kernel, (tuple, list)) or len(kernel) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in kernel)):
        raise ValueError(f"lowbit.native.{fn}: kernel={kernel!r} must be two ints >= 1")


def conv_out_hw(h: int, w: int, kernel: tuple[int, int], stride: list[int], padding: list[int],
                dilation: list[int]) -> tuple[int, int]:
    """A 2-d conv's output height and width: ``(h + 2 p - d (k - 1) - 1) // s + 1`` per axis (≤ 0: no output).

    >>> conv_out_hw(9, 8, (3, 3), [2, 1], [1, 0], [1, 2])
    (5, 4)
    """
    return ((h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1,
            (w + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1)


def _channel_vectors(n: int, *vs: torch.Tensor | None) -> bool:
    """Whether every given vector is a contiguous float32 tensor of ``n`` elements (``None``: absent, fine)."""
    return all(v is None or (v.dtype == torch.float32 and v.is_contiguous() and v.numel() == n) for v in vs)


from .layers import (conv_epilogue, dw_weight, dwconv, empty_codes, im2col, maxpool_codes,  # noqa: E402  (below the helpers)
                     to_channels_last, to_contiguous)
from .gemm import LinearPlan, dyn_linear, linear_plan, qlinear, qlinear_requant, qlinear_rows  # noqa: E402
from .rows import all_finite, dequantize, qadd, quantize_into, row_epilogue, row_grid  # noqa: E402
from .smallconv import smallconv, smallconv_body, smallconv_prepared, smallconv_weight  # noqa: E402
