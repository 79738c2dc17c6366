"""The int8 Linears without VNNI (``linear.c``): exact int32 sums and an epilogue in one native call, at any M.

``LinearPlan`` holds one layer's constants (int8 weights ``(N, K)``, ``Σ_k w`` per column, the epilogue's vectors and
scalars) in the C struct ``lb_linear_run`` reads, checked once where it is made; a call then passes only the codes,
their zero point and the output (~3 µs of Python and ctypes at M = 1 instead of ~14 with every argument checked and
converted per call). The sums are exact for any u8 codes (without VNNI: ``vpmaddubsw`` where no u8 × s8 pair can
saturate, ``pairs``; else ``vpmaddubsw`` on ``|q - 128|`` against sign-adjusted weights, packed from ``BCAST_M``
rows; with AVX-512 VNNI ``vpdpbusd`` for every plan), so each mode gives its
reference's floats or codes bit for bit:

    a = Σ_k q w - z_x Σ_k w
    "float"    y = fl(fl(a) · sc_n) (+ b_n), ReLU: max(y, 0)           (``_fbgemm_linear`` / fbgemm's float output)
    "codes"    lowbit's store of that y: clamp(round(fl(clamp(fl(y · inv), vlo, vhi) + z)), 0, 255)
    "requant"  fbgemm's ``quantized::linear``: round(fl(fl(fl(a) + bterm_n) · mult_n)) saturated, + z_out, to [lo, hi]
    "rows"     the per-token rows: t = fl(fl(a) · sc_n), y = fl(fl(t + a_m fw_n) · s_m) (+ b_n)
    "rows_sub" the same rows unfused: y = fl(fl(t - fl(a_m fw_n)) · s_m) (+ b_n)   (the generic per-token epilogue)

``qlinear``, ``qlinear_requant`` and ``qlinear_rows`` are the one-shot forms; ``dyn_linear`` the per-token dynamic Linear
in one call, its row grids and codes included; ``LinearPlan.run_conv`` a 2-d conv's patches as the rows, made tile by
tile inside the call (``kernels.conv_split.gemm_conv``).

>>> import torch
>>> from lowbit import native
>>> w = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
>>> y = native.qlinear(torch.tensor([[10, 20]], dtype=torch.uint8), 0, w, torch.ones(2), None, None, False)
>>> y is None or y.tolist() == [[-30.0, 110.0]]
True
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from . import _channel_vectors, _check_conv, _check_grid, _check_kernel, _lib, _local, _state, _threads, conv_out_hw, counts, vnni
from .layers import empty_codes

__all__ = ["MAX_ROWS", "BCAST_M", "LinearPlan", "linear_plan", "pack_bcast", "pack_vnni", "qlinear", "qlinear_requant",
           "qlinear_rows", "dyn_linear"]

MAX_ROWS = 64  # input rows per row chunk of a call (linear.c's MAX_ROWS; a call takes any number)
BCAST_M = 2  # rows from which a plan runs linear.c's many-row kernels on packed weights (linear.c's BCAST_M)
_NO_PACK = torch.empty(0, dtype=torch.int8)  # a plan's "no packed weights on this CPU" (its C pointer stays NULL)
_MODES = {"float": 0, "codes": 1, "requant": 2, "rows": 3, "rows_sub": 5}  # (mode 4, a weight split, went in session 26)
_ROWS = ("rows", "rows_sub")  # the modes with per-row vectors (a, s) in each call
_U8 = (torch.uint8, torch.quint8)


class _Plan(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("wsum", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("fw", ctypes.c_void_p), ("k", ctypes.c_int64), ("n", ctypes.c_int64),
                ("pairs", ctypes.c_int32), ("mode", ctypes.c_int32), ("relu", ctypes.c_int32), ("zo", ctypes.c_int32),
                ("lo", ctypes.c_int32), ("hi", ctypes.c_int32), ("inv", ctypes.c_float), ("z", ctypes.c_float),
                ("vlo", ctypes.c_float), ("vhi", ctypes.c_float), ("wp", ctypes.c_void_p), ("sw", ctypes.c_void_p),
                ("wv", ctypes.c_void_p)]


class LinearPlan:
    """One layer's constants for ``lb_linear_run`` (made by ``linear_plan``); ``run`` is the per-call entry."""

    __slots__ = ("_plan", "_addr", "_keep", "_wp", "_sw", "_wv", "_first", "k", "n", "mode", "name")

    def __init__(self, plan: _Plan, keep: tuple[torch.Tensor | None, ...], k: int, n: int, mode: str) -> None:
        self._plan, self._keep, self.k, self.n, self.mode = plan, keep, k, n, mode
        self._wp: torch.Tensor | None = None  # pack_bcast(w) for the AVX2 kernels, made by a first call of BCAST_M rows or more
        self._sw: torch.Tensor | None = None  # 128 Σ w per column for the many-row kernel of a plan without pairs
        self._wv: torch.Tensor | None = None  # pack_vnni(w) for the VNNI kernels (any rows); _NO_PACK once wp is made
        self._first: dict[str, Any] = {}  # the packs first published ("wv": wv, "wp": (wp, sw)), held for good
        self._addr = ctypes.addressof(plan)
        self.name = {"float": "qlinear", "codes": "qlinear", "requant": "qlinear_requant", "rows": "qlinear_rows",
                     "rows_sub": "qlinear_rows"}[mode]

    def run(self, q: torch.Tensor, zx: int, out: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """``out`` (contiguous ``(M, N)``: float32 for "float" / "rows" / "rows_sub", an 8-bit tensor, plain or torch
        quantized, for the codes) from u8 codes ``q`` ``(M, K)`` (unit column stride; a ``quint8`` tensor's codes read as they
        are) on zero point ``zx``; "rows" and "rows_sub": ``(a, s)``, float32 ``(M,)`` each. ``False``
        (nothing written) where they do not fit, or the native build is switched off; a ``zx`` outside those raises."""
        if not 0 <= zx <= 255 or (zx and not self._plan.wsum):
            raise ValueError(f"lowbit.native.LinearPlan.run: zx={zx!r} must be in [0, 255] (0 for a plan made without"
                             f" wsum, mode {self.mode!r})")
        lib = _state.get("lib")
        shape = q.shape
        if (lib is None or len(shape) != 2 or shape[1] != self.k or not 0 < shape[0] or q.dtype not in _U8
                or q.stride(1) != 1 or not q.is_cpu or _local.__dict__.get("off", False)):
            return False
        m = shape[0]
        if out.shape != (m, self.n) or not out.is_contiguous():
            return False
        ra = rs = None
        if self.mode in _ROWS:
            if rows is None or not _channel_vectors(m, *rows):
                return False
            ra, rs = rows[0].data_ptr(), rows[1].data_ptr()
        return self.run_checked(lib, q, m, zx, out, ra, rs)

    def run_checked(self, lib: Any, q: torch.Tensor, m: int, zx: int, out: torch.Tensor, ra: int | None = None,
                    rs: int | None = None) -> bool:
        """``run``'s native call for arguments its checks passed (the caller's, once per state where they cannot change:
        ``kernels.lane``): ``lib`` loaded and on in this thread, ``q`` u8 ``(m, k)`` with unit column stride on the CPU,
        ``0 < m``, ``zx`` valid for this plan, ``out`` contiguous ``(m, n)``. Packs on the first call that needs it."""
        if self._wv is None and (m >= BCAST_M or vnni()):  # the first call that packs (VNNI: from one row)
            self._pack(lib)
        if lib.lb_linear_run(self._addr, q.data_ptr(), m, q.stride(0), zx, ra, rs, out.data_ptr(),
                             _threads(m * self.n * self.k // 16), _local.__dict__.get("isa", 1)):
            return False
        counts[self.name] += 1
        return True

    def split(self, m: int, threads: int | None = None, conv: bool = False) -> tuple[int, bool] | None:
        """How a call of ``m`` rows (``conv``: ``run_conv``'s patch rows) on ``threads`` threads (default: what
        ``run`` passes, ``torch.get_num_threads()`` past ATen's grain size) splits: ``(threads used, by rows)``, else
        by whole 64-column blocks (16 without VNNI); with the kernels this plan has packed so far (a first call
        packs). ``None`` without the native build."""
        lib = _state.get("lib")
        if lib is None:
            return None
        nt = _threads(m * self.n * self.k // 16) if threads is None else threads
        if m < 0 or nt < 1:
            raise ValueError(f"lowbit.native.LinearPlan.split: m={m!r} must be >= 0 and threads={threads!r} >= 1")
        v = lib.lb_linear_split(self._addr, m, nt, _local.__dict__.get("isa", 1), int(conv))
        return v // 2, bool(v % 2)

    def run_conv(self, q: torch.Tensor, zx: int, kernel: tuple[int, int], stride: list[int], padding: list[int],
                 dilation: list[int], out: torch.Tensor) -> bool:
        """``run`` on the patches of a 2-d conv of one group over channels-last u8 codes ``q`` ``(N, C, H, W)``
        (``native.im2col``'s rows, padding taps at ``zx``; the plan's weights tap by tap, ``K = KH·KW·C``) without them
        in memory: each thread makes its row tiles' patches where the many-row kernels read them (``linear.c``
        ``lb_conv_gemm``). ``out``: contiguous ``(N·OH·OW, N_out)`` as ``run``'s. ``False`` (nothing written) where
        they do not fit, the native build is off, or the many-row kernels do not run (fewer than ``BCAST_M`` rows, no
        AVX2, a per-token rows mode): the caller's ``im2col`` and ``run`` then give the same output."""
        _check_conv("LinearPlan.run_conv", zx, stride, padding, dilation)
        _check_kernel("LinearPlan.run_conv", kernel)
        if zx and not self._plan.wsum:
            raise ValueError(f"lowbit.native.LinearPlan.run_conv: zx={zx!r} needs a plan made with wsum")
        lib = _state.get("lib")
        if (lib is None or _local.__dict__.get("off", False) or q.dtype not in _U8 or q.dim() != 4 or not q.is_cpu
                or q.numel() == 0 or not q.is_contiguous(memory_format=torch.channels_last) or self.mode in _ROWS):
            return False
        n, c, h, w = q.shape
        kh, kw = kernel
        oh, ow = conv_out_hw(h, w, (kh, kw), stride, padding, dilation)
        m = n * oh * ow
        if kh * kw * c != self.k or oh < 1 or ow < 1 or m < BCAST_M or out.shape != (m, self.n) or not out.is_contiguous():
            return False
        if self._wv is None:
            self._pack(lib)
        if lib.lb_conv_gemm(self._addr, q.data_ptr(), n, c, h, w, kh, kw, stride[0], stride[1], padding[0], padding[1],
                            dilation[0], dilation[1], zx, oh, ow, out.data_ptr(), _threads(m * self.n * self.k // 16),
                            _local.__dict__.get("isa", 1)):
            return False
        counts[self.name] += 1
        counts["conv_gemm"] += 1
        return True

    def _pack(self, lib: Any) -> None:
        """The weights packed once, for the kernels this thread runs: ``pack_vnni`` where the AVX-512 VNNI kernels run
        (they read it from one row), else ``pack_bcast`` for the AVX2 many-row kernels (from ``BCAST_M`` rows). One
        packing per plan: a plan packed for one kind of kernel runs the other's dot products (the same sums) if the
        thread's kernels change (``force_avx2`` in tests). A plan is shared by the threads calling one model, and once
        a pack is in the C struct a native call may be reading it with the GIL released: the first pack published
        (``dict.setdefault``, atomic under the GIL; no lock, which a fork could leave held) is the one every racing
        thread takes and ``_first`` keeps it for the plan's life, so a later one never replaces (frees) it."""
        w: torch.Tensor = self._keep[0]  # type: ignore[assignment]
        if vnni():
            wv = self._first.setdefault("wv", pack_vnni(w))  # (atomic: threads racing here all take the first pack)
            self._plan.wv = wv.data_ptr()
            self._wv = wv
            return
        if not lib.lb_cpu_avx2():  # (the packed kernels are AVX2 only: no copy of the weights for the scalar body)
            self._wp = self._wv = _NO_PACK
            return
        # groups of 4 codes for every many-row kernel; a plan without pairs adds linear.c's sw for blk_bcast_s
        wp, sw = pack_bcast(w), None
        if not self._plan.pairs:
            n = w.shape[0]
            sw = torch.zeros(-(-n // 16) * 16, dtype=torch.int32)
            sw[:n] = w.sum(1, dtype=torch.int32) * 128
        wp, sw = self._first.setdefault("wp", (wp, sw))  # (as above)
        if sw is not None:
            self._sw, self._plan.sw = sw, sw.data_ptr()
        self._wp, self._plan.wp = wp, wp.data_ptr()
        self._wv = _NO_PACK

def dyn_linear(x: torch.Tensor, one: LinearPlan | None, rows: LinearPlan | None,
               w_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The per-token dynamic Linear in one native call (``dynamic.c``): float32 ``x`` ``(M, K)`` (unit column stride) →
    each row's grid on [0, 255] and u8 codes (``row_grid``'s), then on a VNNI CPU ``one`` where given ("float" mode, one
    row, run with the column scales ``fl(s_w s_x)`` made in the call: the plan's own ``sc`` is never read, so threads
    share it), else ``rows`` ("rows" mode: zero point 128,
    ``cn = fl(128 - z_x)``): ``per_token._vnni_native``'s floats bit for bit, without its tensors and calls in Python.
    A "rows_sub" plan as ``rows`` (``one`` None) runs on any CPU at zero point 128 with ``c = fl(-128 + z_x)``:
    ``no_vnni._native_rows8``'s floats. ``None`` (the caller's path runs) where the plan is missing, the tensors do not
    fit, a row is not finite or the VNNI kernels a "rows" or "float" plan needs do not run here."""
    lib = _state.get("lib")
    plan = one if one is not None else rows
    sub = one is None and rows is not None and rows.mode == "rows_sub"
    if (lib is None or plan is None or x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or not x.is_cpu
            or x.requires_grad or x.shape[1] != plan.k or x.shape[0] == 0 or (one is not None and x.shape[0] != 1)
            or not (sub or vnni()) or not (sub or (w_scale is not None and _channel_vectors(plan.n, w_scale)))):
        return None
    m, k = x.shape
    n = plan.n
    if plan._wv is None and (m >= BCAST_M or vnni()):
        plan._pack(lib)
    y = torch.empty(m, n)
    codes, grid = torch.empty(m, k, dtype=torch.uint8), torch.empty(3 * m)
    isa = _local.__dict__.get("isa", 1)
    if lib.lb_dyn_linear(x.data_ptr(), m, k, x.stride(0), n, one._addr if one is not None else None,
                         None if w_scale is None else w_scale.data_ptr(),
                         rows._addr if one is None else None, int(sub), codes.data_ptr(), grid.data_ptr(), y.data_ptr(),
                         _threads(m * k), _threads(m * n * k // 16), isa):
        return None
    counts["row_grid"] += 1
    counts[plan.name] += 1
    return y


def linear_plan(w: torch.Tensor, mode: str, sc: torch.Tensor, bias: torch.Tensor | None = None, *,
                wsum: torch.Tensor | None = None, pairs: bool = False, relu: bool = False,
                grid: tuple[float, int, int, int] | None = None, codes: tuple[int, int, int] | None = None,
                fw: torch.Tensor | None = None) -> LinearPlan | None:
    """A ``LinearPlan`` for int8 weights ``w`` ``(N, K)`` (contiguous) in ``mode`` ("float", "codes", "requant",
    "rows", "rows_sub"; the module docstring's math): ``sc`` (``mult`` for "requant") and ``bias`` (``bterm`` for
    "requant") float32 ``(N,)``; ``wsum`` int32 ``Σ_k w`` (made here when absent); ``pairs``: every u8 × s8 pair sum fits int16;
    ``grid = (inv, z, lo, hi)`` for "codes" (``lo``/``hi``: the code range, ReLU floor included), ``codes = (z_out, lo,
    hi)`` for "requant", ``fw`` for "rows" and "rows_sub".
    Wrong argument values raise ``ValueError``; ``None`` where the tensors do not fit (dtype, shape, layout, device) or
    there is no native build."""
    if mode not in _MODES:
        raise ValueError(f"lowbit.native.linear_plan: mode={mode!r} is not one of {sorted(_MODES)}")
    inv, z, vlo, vhi = 1.0, 0.0, 0.0, 0.0
    if mode == "codes":
        if grid is None:
            raise ValueError("lowbit.native.linear_plan: mode 'codes' needs grid=(inv, z, lo, hi)")
        _check_grid("linear_plan", grid[1], grid[2], grid[3], inv=grid[0])
        inv, z = grid[0], float(grid[1])
        vlo = float(grid[2] - grid[1]) if grid[2] > 0 else -math.inf
        vhi = float(grid[3] - grid[1]) if grid[3] < 255 else math.inf
    zo, lo, hi = codes if codes is not None else (0, 0, 255)
    if mode == "requant":
        if codes is None:
            raise ValueError("lowbit.native.linear_plan: mode 'requant' needs codes=(z_out, lo, hi)")
        _check_grid("linear_plan", zo, lo, hi)
    if mode in _ROWS and fw is None:
        raise ValueError(f"lowbit.native.linear_plan: mode {mode!r} needs fw (Σ ŵ per column)")
    if _lib() is None or w.dim() != 2 or w.dtype != torch.int8 or not w.is_contiguous() or not w.is_cpu or w.numel() == 0:
        return None
    n, k = w.shape
    if not _channel_vectors(n, sc, bias, fw):
        return None
    if wsum is None and (mode != "rows" or not pairs):
        # (read for a non-zero input zero point, which "rows" lacks, and by linear.c's few-row kernel for codes
        # without pairs)
        wsum = w.sum(1, dtype=torch.int32)
    if wsum is not None and (wsum.dtype != torch.int32 or not wsum.is_contiguous() or wsum.numel() != n):
        return None
    if bias is not None:  # (the plan's own copy: a module's bias moved in memory, as share_memory_ moves it, must not
        bias = bias.clone()  # leave the plan reading where it was; the weights' address is in the layer's plan key)
    ptr = [None if t is None else t.data_ptr() for t in (w, wsum, sc, bias, fw)]
    plan = _Plan(*ptr, k, n, int(pairs), _MODES[mode], int(relu), zo, lo, hi, inv, z, vlo, vhi)
    return LinearPlan(plan, (w, wsum, sc, bias, fw), k, n, mode)


def _check_weights(fn: str, w: Any) -> None:
    """A packing's input: a 2-d int8 tensor, else ``ValueError`` naming ``fn`` and what it got."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.int8:
        what = f"{tuple(w.shape)} {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"lowbit.native.gemm.{fn}: w must be a 2-d int8 tensor (N, K), got {what}")


def pack_bcast(w: torch.Tensor) -> torch.Tensor:
    """int8 weights ``w`` ``(N, K)`` as ``linear.c``'s many-row kernels read them: blocks of 16 columns, each of groups of
    4 consecutive ``k`` for its 16 columns, ``wp[b, i, c, t] = w[16 b + c, 4 i + t]`` (zeros past ``N`` and ``K``).

    >>> pack_bcast(torch.arange(8, dtype=torch.int8).view(1, 8)).shape
    torch.Size([1, 2, 16, 4])
    >>> pack_bcast(torch.arange(8, dtype=torch.int8).view(1, 8))[0, :, 0].tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    _check_weights("pack_bcast", w)
    n, k = w.shape
    nb, kg = -(-n // 16), -(-k // 4)
    pad = torch.zeros(nb * 16, kg * 4, dtype=torch.int8)
    pad[:n, :k] = w
    return pad.view(nb, 16, kg, 4).permute(0, 2, 1, 3).contiguous()


def pack_vnni(w: torch.Tensor) -> torch.Tensor:
    """int8 weights ``w`` ``(N, K)`` as ``linear.c``'s VNNI kernel reads them: ``pack_bcast``'s blocks of 16 columns in
    chunks of 4 blocks (64 columns; the last chunk has the blocks left), each chunk's blocks interleaved group by group,
    ``wv[chunk][i][v][c][t] = w[64 chunk + 16 v + c, 4 i + t]`` (zeros past ``N`` and ``K``), flat: one sequential
    stream per chunk for the kernel's 4 weight vectors a step.

    >>> pack_vnni(torch.arange(8, dtype=torch.int8).view(1, 8)).view(2, 16, 4)[:, 0].tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> w = torch.randint(-128, 128, (70, 9), dtype=torch.int8)
    >>> pack_vnni(w).numel(), int(pack_vnni(w).view(-1, 64)[2 * 4 + 1, 5 * 4]) == int(w[16 + 5, 2 * 4])
    (960, True)
    """
    _check_weights("pack_vnni", w)
    blocks = pack_bcast(w)  # (nb, kq, 16, 4)
    return torch.cat([blocks[c:c + 4].transpose(0, 1).reshape(-1) for c in range(0, blocks.shape[0], 4)])


def _one_shot(q: torch.Tensor, zx: int, plan: LinearPlan | None, out: torch.Tensor,
              rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    return out if plan is not None and plan.run(q, zx, out, rows) else None


def _rows_cols(q: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    return (q.shape[0] if q.dim() == 2 else 0), (w.shape[0] if w.dim() == 2 else 0)


def _check_zx(fn: str, zx: int) -> None:
    if not 0 <= zx <= 255:
        raise ValueError(f"lowbit.native.{fn}: input zero point zx={zx!r} is outside [0, 255]")


def qlinear(q: torch.Tensor, zx: int, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            out: tuple[float, int, int, int] | None, relu: bool, wsum: torch.Tensor | None = None,
            pairs: bool = False) -> torch.Tensor | None:
    """A small-M int8 Linear with lowbit's float epilogue in one native call: u8 codes ``q`` ``(M, K)`` on zero point
    ``zx``, int8 weights ``w`` ``(N, K)``, the exact ``acc = Σ (q - z_x) w`` as ``fl(acc)``, then ``· scale_n + bias_n``;
    ``out = (inv, z, lo, hi)``: the codes as ``conv_epilogue``'s in a torch ``quint8`` tensor on scale 1 and zero point
    ``z`` (``empty_codes``), or float32 ``(M, N)`` (``relu``: ``max(·, 0)``) when ``None``. ``wsum``: ``Σ_k w`` as int32
    (made here when absent); ``pairs``: every u8 × s8 pair sum fits int16 (codes ≤ 127 or ``saturation_safe``
    weights), the faster sums. ``None`` where the tensors do not fit."""
    _check_zx("qlinear", zx)
    m, n = _rows_cols(q, w)
    plan = linear_plan(w, "float" if out is None else "codes", scale, bias, wsum=wsum, pairs=pairs, relu=relu, grid=out)
    y = torch.empty(m, n, dtype=torch.float32) if out is None else empty_codes((m, n), out[1], torch.quint8)
    return _one_shot(q, zx, plan, y)


def qlinear_requant(q: torch.Tensor, zx: int, w: torch.Tensor, wsum: torch.Tensor | None, mult: torch.Tensor,
                    bterm: torch.Tensor | None, zero_point: int, lo: int, hi: int, pairs: bool,
                    into: torch.Tensor | None = None) -> torch.Tensor | None:
    """torch's fbgemm ``quantized::linear`` (per-channel weights, float bias) in one native call, its codes bit for bit:
    exact ``a = Σ q w - z_x Σ w``, ``v = fl(fl(a) + bterm_n)`` (``bterm = fl(bias / fl(s_x s_w))``, ``None``: no bias),
    ``fl(v · mult_n)`` (``mult = fl(fl(s_x s_w) / s_out)``) rounded half to even (``INT32_MIN`` past int32, as
    ``cvtps2dq``), saturated to int16, ``+ zero_point`` saturated, to ``[0, 255]``, then to ``[lo, hi]`` (the ReLU floor
    and a narrow grid). ``q`` may be a ``quint8`` tensor (its codes are read). Plain uint8 ``(M, N)``, or written
    into ``into`` (a contiguous ``(M, N)`` uint8 / ``quint8`` tensor) and that returned; ``None`` where the tensors do
    not fit."""
    _check_zx("qlinear_requant", zx)
    m, n = _rows_cols(q, w)
    plan = linear_plan(w, "requant", mult, bterm, wsum=wsum, pairs=pairs, codes=(zero_point, lo, hi))
    if into is not None and into.dtype not in (torch.uint8, torch.quint8):
        return None
    return _one_shot(q, zx, plan, torch.empty(m, n, dtype=torch.uint8) if into is None else into)


def qlinear_rows(q: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, a: torch.Tensor, s: torch.Tensor,
                 fw: torch.Tensor, bias: torch.Tensor | None, pairs: bool) -> torch.Tensor | None:
    """The per-token dynamic Linear on its u8 codes ``q`` (one grid per row, zero point 0) in one native call:
    ``t = fl(fl(Σ q w) · s_w)`` (fbgemm's float output of the row codes on scale 1), then the fused row epilogue
    ``y = fl(fl(t + a_m fw_n) · s_m) (+ bias_n)`` (``a`` = -z_x and ``s`` = s_x per row, ``fw`` = Σ ŵ per column; the
    sum rounded once, as ``addcmul_``). Float32 ``(M, N)``; ``None`` where the tensors do not fit."""
    m, n = _rows_cols(q, w)
    plan = linear_plan(w, "rows", w_scale, bias, pairs=pairs, fw=fw)
    return _one_shot(q, 0, plan, torch.empty(m, n, dtype=torch.float32), (a, s))

