"""Native row passes of the per-token (dynamic) Linear: one pass per row where torch needs five to eight.

The per-token recipes quantize every row ``x_m`` of an ``(M, K)`` float32 input on its own grid, and after the
GEMM scale every output row by it. In torch ops that is ``amin``, ``amax``, the grid's ten tiny ops, then
``mul``, ``sub``, ``round``/``clamp`` over ``x`` and ``addcmul``, ``mul``, ``add`` over the output: each a pass
over memory, ~130 ms of a 950 ms MiniLM forward at one thread. ``rowquant.c`` does each side in one pass per
row (the row's second read comes from L1), with the same float32 operations in the same order, so its results
are bit for bit those of the torch ops it replaces (``tests/test_native.py`` checks them against each other)::

    row_grid(x, levels, mode)      lo = min(x_m, 0), hi = max(x_m, 0)            (NaN / ±Inf: None, all rows)
                                   s_m = max(fl(fl(hi - lo) / levels), 1e-8),  -z_m = round(fl(lo / s_m))
                                   u = fl(fl(x · fl(1 / s_m)) - (-z_m))
                                   mode "u":     min(u, qmax)                   float32 (fbgemm rounds it)
                                   mode "codes": clamp(round(u), 0, qmax)       uint8
    row_epilogue(raw, a, w, s, b)  in place, fused=True:  raw = fl(raw + a_m w_n) · s_m + b_n   (one rounding
                                                          of raw + a w: torch's addcmul_ is a fused multiply-add)
                                              fused=False: raw = fl(raw - fl(a_m w_n)) · s_m + b_n  (sub_ of a product)

The C source is compiled once per machine and source version with the system's C compiler (``cc``, or
``$CC``) into ``$LOWBIT_CACHE_DIR`` (default ``~/.cache/lowbit``) and loaded with ``ctypes`` (no torch headers:
~0.5 s). It takes AVX2 + FMA bodies where the CPU has them, checked at run time, and scalar bodies with the
same results elsewhere; rows are split over ``torch.get_num_threads()`` threads of torch's own OpenMP pool (the
object links ``libgomp.so.1``, which resolves to the copy torch loaded) for inputs past ATen's grain size.
Where there is no compiler, the build fails or ``LOWBIT_NATIVE=0`` is set, ``available()`` is ``False`` and
every caller keeps its torch ops (the same numbers, slower); ``reason()`` says why.

>>> import torch
>>> from lowbit import native
>>> x = torch.tensor([[-1.0, 0.0, 2.0], [0.5, 0.25, 0.0]])
>>> r = native.row_grid(x, 255.0, "codes") if native.available() else None
>>> r is None or r[0].tolist() == [[0, 85, 255], [255, 127, 0]]
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
import tempfile
import threading
import warnings
from pathlib import Path
from collections import Counter
from typing import Iterator

import torch

__all__ = ["available", "reason", "row_grid", "row_epilogue", "conv_epilogue", "qadd", "quantize_into", "dwconv", "dw_weight",
           "qlinear", "dyn_wsplit", "empty_codes", "disabled", "force_scalar", "counts"]

_SRC = Path(__file__).with_name("rowquant.c")
_FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]
_OPENMP = "-fopenmp"  # tried first; a compiler without OpenMP builds the single-threaded object
_THREAD_MIN = 1 << 15  # floats a pass must cover before it is split over threads (ATen's grain size)
_state: dict[str, object] = {}
_lock = threading.Lock()
_local = threading.local()  # per-thread switches for tests: disabled(), force_scalar()
counts: Counter[str] = Counter()  # passes that ran natively ("row_grid", "row_epilogue"), as kernels.counts


def _cache_dir() -> Path:
    root = os.environ.get("LOWBIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lowbit")
    return Path(root) / "native"


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("LOWBIT_NATIVE", "1") == "0":
        return None, "LOWBIT_NATIVE=0"
    if sys.platform != "linux" or not _SRC.exists():
        return None, f"no native build on {sys.platform}" if _SRC.exists() else f"{_SRC} is missing"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc / gcc / $CC) on PATH"
    src = _SRC.read_bytes()
    tag = hashlib.sha256(src + " ".join([cc, *_FLAGS, _OPENMP]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"rowquant-{tag}.so"
    if not lib.exists():
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then one atomic rename
                out = Path(tmp) / lib.name
                for extra in ([_OPENMP], []):
                    done = subprocess.run([cc, *_FLAGS, *extra, "-o", str(out), str(_SRC)], capture_output=True,
                                          text=True, timeout=120)
                    if done.returncode == 0:
                        break
                else:
                    return None, f"{cc} failed: {done.stderr.strip()[-300:]}"
                os.replace(out, lib)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"native build failed: {e}"
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        return None, f"cannot load {lib}: {e}"
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    dll.lb_row_grid.argtypes = [p, i64, i64, i64, f32, f32, f32, i32, p, i64, p, p, i32, i32]
    dll.lb_row_grid.restype = i32
    dll.lb_row_epilogue.argtypes = [p, i64, i64, i64, p, p, p, p, i32, i32, i32]
    dll.lb_row_epilogue.restype = None
    dll.lb_conv_epilogue.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, f32, f32, f32, f32, p, i32, i32]
    dll.lb_conv_epilogue.restype = None
    dll.lb_qadd.argtypes = [p, i32, p, i32, p, i32, i64, f32, f32, f32, f32, f32, f32, f32, i32, i32]
    dll.lb_qadd.restype = None
    dll.lb_quantize.argtypes = [p, i64, f32, f32, f32, f32, i32, p, i32, i32]
    dll.lb_quantize.restype = i32
    dll.lb_dwconv.argtypes = [p, i64, i64, i64, i64, p, i32, i32, i32, i32, i32, i32, i32, i32, i32, i64, i64, p, p,
                              f32, f32, f32, f32, p, i32, i32]
    dll.lb_dwconv.restype = None
    dll.lb_qlinear.argtypes = [p, i64, i64, i64, i32, p, i64, p, p, i32, i32, f32, f32, f32, f32, p, i64, i32, i32]
    dll.lb_qlinear.restype = i32
    dll.lb_dyn_wsplit.argtypes = [p, i64, i64, p, i64, p, p, p, p, p, p, i32, i32]
    dll.lb_dyn_wsplit.restype = i32
    dll.lb_cpu_avx2.restype = dll.lb_openmp.restype = i32
    body = "AVX2 + FMA bodies" if dll.lb_cpu_avx2() else "scalar bodies (no AVX2 + FMA on this CPU)"
    return dll, body + (", OpenMP threads" if dll.lb_openmp() else ", one thread (built without OpenMP)")


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["reason"] = _build()
    if getattr(_local, "off", False):
        return None
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the native passes run in this thread (built and loaded, not switched off)."""
    return _lib() is not None


def reason() -> str:
    """What the native build gave: the bodies it runs, or why it is not used."""
    _lib()
    return str(_state["reason"])


class _Disabled:
    """``disabled()``'s context manager: a class, not a generator (~0.3 µs instead of ~3 per block, which matters
    where benchmarks time small calls with the native passes off)."""

    __slots__ = ("old",)

    def __enter__(self) -> None:
        self.old = getattr(_local, "off", False)
        _local.off = True

    def __exit__(self, *exc: object) -> None:
        _local.off = self.old


def disabled() -> _Disabled:
    """Callers keep their torch ops inside this block (this thread): the reference for the native passes."""
    return _Disabled()


@contextlib.contextmanager
def force_scalar() -> Iterator[None]:
    """The scalar C bodies inside this block (this thread), on any CPU: tests cover both bodies everywhere."""
    old = getattr(_local, "isa", 1)
    _local.isa = 0
    try:
        yield
    finally:
        _local.isa = old


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


def _fits(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0
            and x.shape[1] > 0 and x.stride(0) >= x.shape[1] and not x.requires_grad)


def row_grid(x: torch.Tensor, levels: float, mode: str, out: torch.Tensor | None = None,
             qmax: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(out, s, -z)`` for a 2-d float32 CPU ``x`` (unit column stride): the row grids on ``[0, levels]`` as
    ``(M, 1)`` float32 and ``out`` (``(M, K)``, given or new; float32 for ``mode="u"``, uint8 for ``"codes"``)
    as the module doc states; ``qmax`` defaults to ``levels`` (``inf``: no clamp on ``u``). ``None`` when the
    native passes are off, the tensors do not fit them, or some row is not finite: the caller's torch ops decide."""
    if mode not in ("u", "codes"):
        raise ValueError(f"lowbit.native.row_grid: mode={mode!r} must be 'u' or 'codes'")
    top = levels if qmax is None else qmax
    if not (math.isfinite(levels) and levels > 0) or top != top or (mode == "codes" and not 0 <= top <= 255):
        raise ValueError(f"lowbit.native.row_grid: levels={levels!r} must be finite and positive, qmax={qmax!r} a number "
                         "(for codes: inside [0, 255])")
    lib = _lib()
    if lib is None or not _fits(x):
        return None
    m, k = x.shape
    dtype = torch.float32 if mode == "u" else torch.uint8
    if out is None:
        out = torch.empty(m, k, dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != (m, k) or not out.is_contiguous():
        raise ValueError(f"row_grid: out must be a contiguous {dtype} tensor of shape {(m, k)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    scale, negzp = torch.empty(m, 1), torch.empty(m, 1)
    bad = lib.lb_row_grid(x.data_ptr(), m, k, x.stride(0), levels, 1e-8, levels if qmax is None else qmax,
                          0 if mode == "u" else 1, out.data_ptr(), k, scale.data_ptr(), negzp.data_ptr(),
                          _threads(m * k), getattr(_local, "isa", 1))
    if bad:
        return None
    counts["row_grid"] += 1
    return out, scale, negzp


def row_epilogue(raw: torch.Tensor, a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
                 fused: bool) -> torch.Tensor | None:
    """``raw = (raw ± a ⊗ w) · s + bias`` in place (``fused``: ``+``, as ``addcmul_``; else ``-``), for ``raw``
    ``(M, N)``, ``a`` / ``s`` ``(M, 1)``, ``w`` / ``bias`` ``(N,)``, all contiguous float32 CPU; returns ``raw``, or
    ``None`` (nothing written) when the native passes are off or the tensors do not fit."""
    lib = _lib()
    if lib is None:
        return None
    m, n = raw.shape if raw.dim() == 2 else (0, 0)
    parts = (raw, a, w, s) if bias is None else (raw, a, w, s, bias)
    if m == 0 or n == 0 or any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in parts):
        return None
    if a.numel() != m or s.numel() != m or w.numel() != n or (bias is not None and bias.numel() != n):
        return None
    if raw.requires_grad:
        return None
    lib.lb_row_epilogue(raw.data_ptr(), m, n, n, a.data_ptr(), w.data_ptr(), s.data_ptr(),
                        None if bias is None else bias.data_ptr(), int(fused), _threads(m * n),
                        getattr(_local, "isa", 1))
    counts["row_epilogue"] += 1
    return raw


def conv_epilogue(ys: list[torch.Tensor], groups: int, scale: torch.Tensor, bias: torch.Tensor | None, inv: float,
                  zero_point: int, lo: int, hi: int) -> torch.Tensor | None:
    """The split-weight conv's epilogue in one pass (``kernels.onednn._wsplit_conv``): from its raw float32 sums,
    ``[stacked]`` (``(N, 2C, *sp)``, each group's ``hi`` then ``lo`` channels) or ``[hi, lo]`` (``(N, C, *sp)`` each),
    channels innermost in memory (oneDNN's channels-last output), the uint8 codes
    ``clamp(round(fl(clamp(fl(fl(fl(lo + 2 hi) · scale_c) + bias_c) · inv), lo - z, hi - z) + z)), 0, 255)``
    (``combine_stacked`` / ``add_(alpha=2)``, ``_acc_epilogue``'s multiply and bias, ``qstore.codes``' clamp, round and
    store) as an ``(N, C, *sp)`` channels-last tensor; ``None`` (nothing written) where the tensors do not fit."""
    _check_grid("conv_epilogue", zero_point, lo, hi, inv=inv)
    if groups < 1:
        raise ValueError(f"lowbit.native.conv_epilogue: groups={groups!r} must be at least 1")
    lib = _lib()
    if lib is None or len(ys) not in (1, 2):
        return None
    y0 = ys[0]
    c2 = y0.shape[1] if y0.dim() >= 3 else 0
    c = c2 // 2 if len(ys) == 1 else c2
    if c == 0 or (len(ys) == 1 and (c2 % 2 or c % groups)):
        return None
    lasts = [t.movedim(1, -1) for t in ys]
    if any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.requires_grad for t in lasts):
        return None
    if len(ys) == 2 and ys[1].shape != y0.shape:
        return None
    if not _channel_vectors(c, scale, bias):
        return None
    npix = y0.numel() // c2
    codes = torch.empty((*lasts[0].shape[:-1], c), dtype=torch.uint8)
    if len(ys) == 1:
        cpg = c // groups
        h, lo_ptr, ps, gs, ng = y0.data_ptr(), y0.data_ptr() + 4 * cpg, 2 * c, 2 * cpg, groups
    else:
        cpg, h, lo_ptr, ps, gs, ng = c, ys[0].data_ptr(), ys[1].data_ptr(), c, 0, 1
    vlo = float(lo - zero_point) if lo > 0 else -float("inf")
    vhi = float(hi - zero_point) if hi < 255 else float("inf")
    lib.lb_conv_epilogue(h, lo_ptr, npix, ps, gs, ng, cpg, scale.data_ptr(), None if bias is None else bias.data_ptr(),
                         inv, float(zero_point), vlo, vhi, codes.data_ptr(), _threads(npix * c),
                         getattr(_local, "isa", 1))
    counts["conv_epilogue"] += 1
    return codes.movedim(-1, 1)


_CODES = (torch.uint8, torch.int8)


def qadd(qa: torch.Tensor, za: int, ka: float, qb: torch.Tensor, zb: int, kb: float, z: int, lo: int, hi: int,
         storage: torch.dtype) -> torch.Tensor | None:
    """``round(clamp(fl(fl((q_a - z_a) k_a) + fl((q_b - z_b) k_b)), lo - z, hi - z)) + z`` in ``storage`` (uint8 /
    int8) for two same-shape dense 8-bit code tensors in the same memory order (``functional_modules._fast_add``'s
    arithmetic, its float32 steps in its order), as a new tensor in that order; ``None`` where they do not fit."""
    if storage not in _CODES:
        raise ValueError(f"lowbit.native.qadd: storage={storage!r} must be torch.uint8 or torch.int8")
    _check_grid("qadd", z, lo, hi, storage)
    if not all(math.isfinite(k) and k > 0 for k in (ka, kb)):
        raise ValueError(f"lowbit.native.qadd: ka={ka!r}, kb={kb!r} must be finite positive scale ratios")
    lib = _lib()
    if lib is None or qa.dtype not in _CODES or qb.dtype not in _CODES:
        return None
    if qa.shape != qb.shape or qa.stride() != qb.stride() or not qa.is_cpu or not qb.is_cpu or qa.numel() == 0:
        return None
    if not (qa.is_contiguous() or qa.is_contiguous(memory_format=torch.channels_last)):
        return None
    out = torch.empty_like(qa, dtype=storage)
    if out.stride() != qa.stride():
        return None
    n = qa.numel()
    lib.lb_qadd(qa.data_ptr(), int(qa.dtype == torch.int8), qb.data_ptr(), int(qb.dtype == torch.int8), out.data_ptr(),
                int(storage == torch.int8), n, float(za), float(zb), ka, kb, float(lo - z), float(hi - z), float(z),
                _threads(n), getattr(_local, "isa", 1))
    counts["qadd"] += 1
    return out


def quantize_into(x: torch.Tensor, inv: float, z: int, lo: float | None, hi: float | None, out: torch.Tensor) -> bool:
    """``out = clamp(round(fl(clamp(fl(x · inv), lo, hi) + z)), storage range)`` for a contiguous float32 CPU ``x``
    and an 8-bit ``out`` of as many elements (its ``data_ptr`` written: a plain uint8 / int8 tensor or a torch
    quantized tensor's storage): the Quantize stub's ``mul``, clamp and ``quantize_per_tensor(v, 1, z)`` with its
    NaN check in one pass. ``False`` (``out`` partly written, to be dropped) for a NaN, or where it does not fit."""
    sgn = out.dtype in (torch.int8, torch.qint8)
    _check_grid("quantize_into", z, -128 if sgn else 0, 127 if sgn else 255, torch.int8 if sgn else torch.uint8, inv)
    if (lo is not None and lo != lo) or (hi is not None and hi != hi) or (lo is not None and hi is not None and lo > hi):
        raise ValueError(f"lowbit.native.quantize_into: clamp bounds lo={lo!r}, hi={hi!r} must be numbers with lo <= hi")
    lib = _lib()
    if lib is None or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or x.requires_grad:
        return False
    if out.dtype not in (torch.uint8, torch.int8, torch.quint8, torch.qint8) or out.numel() != x.numel() \
            or not out.is_contiguous():
        return False
    n = x.numel()
    nan = lib.lb_quantize(x.data_ptr(), n, inv, float(z), -float("inf") if lo is None else lo,
                          float("inf") if hi is None else hi, int(sgn), out.data_ptr(), _threads(n),
                          getattr(_local, "isa", 1))
    if nan:
        return False
    counts["quantize"] += 1
    return True


def _channel_vectors(n: int, *vs: torch.Tensor | None) -> bool:
    """Whether every given vector is a contiguous float32 tensor of ``n`` elements (``None``: absent, fine)."""
    return all(v is None or (v.dtype == torch.float32 and v.is_contiguous() and v.numel() == n) for v in vs)


def dw_weight(w: torch.Tensor) -> torch.Tensor:
    """A depthwise conv's int8 weight ``(C, 1, kh, kw)`` as the ``(kh, kw, C)`` int16 taps ``dwconv`` reads."""
    if w.dtype != torch.int8 or w.dim() != 4 or w.shape[1] != 1:
        raise ValueError(f"lowbit.native.dw_weight: a depthwise int8 weight of shape (C, 1, kh, kw) is needed, got "
                         f"{w.dtype} of shape {tuple(w.shape)}")
    return w[:, 0].permute(1, 2, 0).to(torch.int16).contiguous()


def dwconv(q: torch.Tensor, zx: int, taps: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int],
           scale: torch.Tensor, bias: torch.Tensor | None, inv: float, zero_point: int, lo: int,
           hi: int) -> torch.Tensor | None:
    """A 2-d depthwise int8 conv with its requantizing epilogue in one pass: u8 codes ``q`` ``(N, C, H, W)`` on zero
    point ``zx`` (zero padding: the zero point), ``taps`` from ``dw_weight``, exact int32 sums ``acc``, then
    ``conv_epilogue``'s codes of ``fl(acc)`` (``scale`` = ``fl(s_x s_w)`` per channel, ``bias``, ``inv`` = 1 / s_out,
    clamp to ``[lo, hi]``) as ``(N, C, OH, OW)`` channels-last uint8; ``None`` where the tensors do not fit."""
    _check_grid("dwconv", zero_point, lo, hi, inv=inv)
    if not 0 <= zx <= 255:
        raise ValueError(f"lowbit.native.dwconv: input zero point zx={zx!r} is outside [0, 255]")
    geometry = (list(stride), list(padding), list(dilation))
    if any(len(g) != 2 for g in geometry) or min(*stride, *dilation) < 1 or min(padding) < 0:
        raise ValueError(f"lowbit.native.dwconv: stride={stride!r}, padding={padding!r}, dilation={dilation!r} must be "
                         "two values each, stride and dilation >= 1, padding >= 0")
    lib = _lib()
    if lib is None or q.dtype != torch.uint8 or q.dim() != 4 or not q.is_cpu:
        return None
    n, c, h, w = q.shape
    kh, kw = taps.shape[:2] if taps.dim() == 3 else (0, 0)
    if taps.dtype != torch.int16 or taps.shape != (kh, kw, c) or not taps.is_contiguous() or kh * kw > 64:
        return None  # (rowquant.c's DW_MAX_TAPS)
    if not _channel_vectors(c, scale, bias):
        return None
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if oh <= 0 or ow <= 0 or n == 0 or c == 0:
        return None
    x = q.movedim(1, -1)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((n, oh, ow, c), dtype=torch.uint8)
    vlo = float(lo - zero_point) if lo > 0 else -float("inf")
    vhi = float(hi - zero_point) if hi < 255 else float("inf")
    lib.lb_dwconv(x.data_ptr(), n, c, h, w, taps.data_ptr(), kh, kw, stride[0], stride[1], padding[0], padding[1],
                  dilation[0], dilation[1], zx, oh, ow, scale.data_ptr(), None if bias is None else bias.data_ptr(),
                  inv, float(zero_point), vlo, vhi, out.data_ptr(), _threads(n * oh * ow * c * kh * kw),
                  getattr(_local, "isa", 1))
    counts["dwconv"] += 1
    return out.movedim(-1, 1)


_QUIET = [False]  # torch's one deprecation warning for quantized tensors, kept from users


def empty_codes(shape: tuple[int, ...] | torch.Size, zero_point: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty torch quantized tensor (``quint8`` / ``qint8``) on scale 1 and ``zero_point``, for a native pass to fill:
    the form lowbit keeps 8-bit codes in for the fbgemm ops that read them next (a ``QTensor``'s ``tu``)."""
    if dtype not in (torch.quint8, torch.qint8):
        raise ValueError(f"lowbit.native.empty_codes: dtype={dtype!r} must be torch.quint8 or torch.qint8")
    _check_grid("empty_codes", zero_point, *((-128, 127, torch.int8) if dtype == torch.qint8 else (0, 255)))
    if _QUIET[0]:
        return torch._empty_affine_quantized(shape, scale=1.0, zero_point=zero_point, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch._empty_affine_quantized(shape, scale=1.0, zero_point=zero_point, dtype=dtype)
    _QUIET[0] = True
    return t


def qlinear(q: torch.Tensor, zx: int, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            out: tuple[float, int, int, int] | None, relu: bool) -> torch.Tensor | None:
    """A small-M int8 Linear with lowbit's float epilogue in one native call: u8 codes ``q`` ``(M, K)`` on zero point
    ``zx``, int8 weights ``w`` ``(N, K)``, the exact ``acc = Σ (q - z_x) w`` (int16 products, int32 sums) as
    ``fl(acc)``, then ``· scale_n + bias_n``;
    ``out = (inv, z, lo, hi)``: the codes as ``conv_epilogue``'s in a torch ``quint8`` tensor on scale 1 and zero point
    ``z`` (``empty_codes``), or float32 ``(M, N)`` (``relu``: ``max(·, 0)``) when ``None``. ``None`` where the tensors
    do not fit."""
    if not 0 <= zx <= 255:
        raise ValueError(f"lowbit.native.qlinear: input zero point zx={zx!r} is outside [0, 255]")
    if out is not None:
        _check_grid("qlinear", out[1], out[2], out[3], inv=out[0])
    lib = _lib()
    if lib is None or q.dtype != torch.uint8 or q.dim() != 2 or not q.is_cpu or q.stride(1) != 1:
        return None
    m, k = q.shape
    n = w.shape[0] if w.dim() == 2 else 0
    if m == 0 or n == 0 or w.dtype != torch.int8 or w.shape[1] != k or not w.is_contiguous():
        return None
    if not _channel_vectors(n, scale, bias):
        return None
    inv, z, lo, hi = out if out is not None else (1.0, 0, 0, 255)
    y = torch.empty(m, n, dtype=torch.float32) if out is None else empty_codes((m, n), z, torch.quint8)
    vlo = float(lo - z) if lo > 0 else -float("inf")
    vhi = float(hi - z) if hi < 255 else float("inf")
    if lib.lb_qlinear(q.data_ptr(), m, k, q.stride(0), zx, w.data_ptr(), n, scale.data_ptr(),
                      None if bias is None else bias.data_ptr(), int(out is not None), int(relu), inv, float(z), vlo, vhi,
                      y.data_ptr(), n, _threads(m * n * k // 16), getattr(_local, "isa", 1)):
        return None
    counts["qlinear"] += 1
    return y


def dyn_wsplit(q: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, a: torch.Tensor, wsum: torch.Tensor,
               s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The 8-bit dynamic Linear's few-row route without VNNI in one call (``per_token._weight_split``'s arithmetic):
    u8 codes ``q`` ``(M, K)`` on zero point 0, int8 weights ``w`` ``(N, K)`` split as ``2 (w >> 1) + (w & 1)``,
    ``t = fl(fl(Σ q (w >> 1)) · 2 s_w) + fl(fl(Σ q (w & 1)) · s_w)`` (fbgemm's two float sums of the split pack, added),
    then ``fl(fl(t + a_m wsum) · s_m) + bias`` (``a`` = -z_x and ``s`` = s_x per row, ``(M, 1)``). ``None`` where the
    tensors do not fit."""
    lib = _lib()
    if lib is None or q.dtype != torch.uint8 or q.dim() != 2 or not q.is_contiguous() or not q.is_cpu:
        return None
    m, k = q.shape
    n = w.shape[0] if w.dim() == 2 else 0
    if m == 0 or n == 0 or w.dtype != torch.int8 or w.shape[1] != k or not w.is_contiguous():
        return None
    if not (_channel_vectors(n, w_scale, wsum, bias) and _channel_vectors(m, a, s)):
        return None
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.lb_dyn_wsplit(q.data_ptr(), m, k, w.data_ptr(), n, w_scale.data_ptr(), a.data_ptr(), wsum.data_ptr(),
                         s.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), _threads(m * n * k // 16),
                         getattr(_local, "isa", 1)):
        return None
    counts["dyn_wsplit"] += 1
    return y
