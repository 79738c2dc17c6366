"""The static Linear's and Conv2d's fast lanes: the native call ``kernels.plan``'s ``run_qt`` (``kernels.conv_plan``'s
``run``) last made, repeated with its checks cut to what can change between two calls.

``run_qt`` decides per call which route a per-tensor ``QTensor`` input takes and re-derives what the route needs. For
a layer fed inputs on one grid (a model's ``Quantize`` stub or the previous layer's output grid), every call after the
first takes the same route with the same plan: lowbit.native's requantizing kernel (``"requant"``: fbgemm's codes on
the output grid, ``small_m.native_requant``) or its float-epilogue kernel (``"codes"``: 8-bit codes on scale 1,
``onednn.native_linear``'s split route). ``run_qt`` *arms* a ``LinearLane`` with that route, its plan and the input
grid's ``(s_x, z_x)`` after the route ran; the lane then serves an input whose grid tensors are those very tensors at
the same versions, whose qdtype is the same object, and whose codes are a contiguous 2-d u8 CPU tensor of ``k``
columns within the route's row limit, while the route's other conditions hold (torch's engine is fbgemm / x86, the
native build is on in this thread). It calls the plan's native entry (``LinearPlan.run_checked``) into an output
made by ``empty_like`` of a kept one of the same rows (``_empty_affine_quantized``'s keyword parsing costs ~0.7 µs
more), and wraps it as ``run_qt`` does: the same codes, the same ``QTensor`` parts, the same ``kernels.counts``.
Anything else returns ``None`` and the caller takes ``run_qt``. The module checks its own buffers (identity and
version) before it calls the lane (``WeightedQuantModule._lane_call``).

Measured on the 16×768² static Linear (Zen 5, 1 thread): ~5 µs of ~11 µs of Python per call saved (session 36,
``benchmarks/README.md``).

``ConvLane`` is the conv plan's: ``run`` arms it after its oneDNN call (the main route: not the rewritten odd windows
or strided columns, not the small first-conv pass) with the input grid's tensors, versions (``-1`` for inference
tensors, which the plan's ``input_grid_key`` keys the same way) and Python numbers, the qdtype object, the codes' shape
and the weight packed for that shape and ``z_x``; it then serves an input whose grid tensors are those very tensors
at the same versions, whose qdtype is the same object, per tensor, and whose codes (``x.int_repr()``, as ``run``
reads them) are u8 CPU codes of that very shape: every check ``run`` and the module's forward make depends only on
these (the shape checks, the odd-window test, the pack's key), so the lane repeats ``run``'s layout step (NCHW codes
to channels-last memory) and its call, with the same tally. The module calls it only without explicit padding (its
input is then the plan's input) and after its own buffer checks (``WeightedQuantModule._lane_call``); the compiled
``lowbit::qconv`` / ``qconv_cfg`` after ``checked_weight`` and its input checks (``pt2.kernel_ops``). The small
first-conv pass has a ``ConvLane`` of its own since session 51 (``channels_last=False``: no layout step, the pass
reads any strides; its "packed" is ``conv_small.prepared``'s run), and a call that declines (``None``) is not tallied:
``run`` then serves and tallies.

>>> import torch, lowbit as Q
>>> lane = LinearLane(k=2, vnni=False, vnni_rows=0, out=(None, None, Q.quint8), counts={}, key=("onednn", "linear"))
>>> lane(Q.quantize_per_tensor(torch.zeros(1, 2), 0.1, 0, Q.quint8)) is None  # not armed: the caller's route runs
True
"""

from __future__ import annotations

from typing import Any

import torch

from .. import native
from ..qscheme import QDtype
from ..qtensor import QTensor
from . import onednn
from .small_m import _quantized_out as _quantized  # (torch's deprecation warning silenced as the routes silence it)

__all__ = ["LinearLane", "ConvLane"]

_U8 = (torch.uint8, torch.quint8)
_UINT8, _CL = torch.uint8, torch.channels_last
_MAX_TEMPLATES = 8  # row counts whose output template is kept (a model sees a few batch sizes)
_TEMPLATE_CODES = 1 << 16  # outputs up to this many codes are made from a kept template (at most 8 × 64 KiB held)


class LinearLane:
    """One plan's fast lane (see the module docstring). ``out``: ``(scale_t, zero_point_t, qdtype)`` of the output
    grid the lane's results carry; ``counts`` / ``key``: the dispatcher's tally and the plan's key in it."""

    __slots__ = ("_k", "_vnni", "_rows", "_s_t", "_z_t", "_qd", "_counts", "_key", "_st", "_tmpl")

    def __init__(self, k: int, vnni: bool, vnni_rows: int, out: tuple[Any, Any, QDtype], counts: Any,
                 key: tuple[str, str]) -> None:
        self._k, self._vnni, self._rows = k, vnni, vnni_rows
        self._s_t, self._z_t, self._qd = out
        self._counts, self._key = counts, key
        self._st: tuple[Any, ...] | None = None  # (s, z, s version, z version, qdtype, route, plan, z_x, grid)
        self._tmpl: dict[int, torch.Tensor] = {}

    def armed(self) -> bool:
        return self._st is not None

    def arm(self, x: QTensor, route: str, plan: Any, zx: int, grid: tuple[float, int]) -> None:
        """Serve inputs on ``x``'s grid by ``route`` (``"requant"`` / ``"codes"``) with ``plan`` (a ``LinearPlan`` the
        route just ran with ``zx``); ``grid``: the output tensors' torch quantizer ``(scale, zero_point)``. Grids held in
        inference tensors (no version counter) are not armed."""
        s, z = x._scale, x._zero_point
        if self._s_t is None or s.is_inference() or z.is_inference():
            self._st = None
            return
        st = self._st
        if st is not None and st[6] is plan and st[0] is s and st[1] is z and st[2] == s._version and st[3] == z._version:
            return  # (already serving this grid)
        if st is None or st[8] != grid:
            self._tmpl = {}
        self._st = (s, z, s._version, z._version, x._qdtype, route, plan, zx, grid)

    def __call__(self, x: QTensor) -> QTensor | None:
        st = self._st
        if st is None:
            return None
        s, z = x._scale, x._zero_point
        if (s is not st[0] or z is not st[1] or s._version != st[2] or z._version != st[3] or x._qdtype is not st[4]
                or x._axis is not None):
            return None
        requant = st[5] == "requant"
        if requant:  # run_qt's choice of codes: the kernel's quantized tensor, Quantize's store, or the plain codes
            t = x._tq if x._tq is not None else x._tu if x._tu is not None else x._q
            if t.dtype not in _U8:
                return None
        else:
            t = x._q
            if t.dtype != torch.uint8:
                return None
        shape = t.shape
        if len(shape) != 2 or shape[1] != self._k or not shape[0] or not t.is_contiguous() or not t.is_cpu:
            return None
        m = shape[0]
        if (self._vnni and m * self._k > self._rows) or not onednn.fbgemm_engine():
            return None
        lib = native._lib()
        if lib is None:
            return None
        n = st[6].n
        if m * n > _TEMPLATE_CODES:  # (a large output: the keyword parsing is noise, and no big template is held)
            y = _quantized((m, n), *st[8])
        else:
            tmpl = self._tmpl.get(m)
            if tmpl is None:
                if len(self._tmpl) >= _MAX_TEMPLATES:
                    self._tmpl.clear()
                tmpl = self._tmpl[m] = _quantized((m, n), *st[8])
            y = torch.empty_like(tmpl)
        if not st[6].run_checked(lib, t, m, st[7], y):
            return None
        self._counts[self._key] += 1
        if requant:
            return QTensor._trusted(None, self._s_t, self._z_t, self._qd, None, y)
        return QTensor._trusted(None, self._s_t, self._z_t, self._qd, None, None, y)


class ConvLane:
    """``conv_plan``'s lane (module docstring): ``call(q, s_x, z_x, packed)`` is the plan's oneDNN call and output wrap
    on channels-last u8 codes ``q``; ``counts`` / ``key``: the dispatcher's tally and the plan's key in it.

    >>> import torch, lowbit as Q
    >>> lane = ConvLane(lambda q, sx, zx, packed: None, counts={}, key=("onednn", "conv"))
    >>> lane(Q.quantize_per_tensor(torch.zeros(1, 1, 2, 2), 0.1, 0, Q.quint8)) is None  # not armed: run serves
    True
    """

    __slots__ = ("_call", "_counts", "_key", "_st", "_cl")

    def __init__(self, call: Any, counts: Any, key: tuple[str, str], channels_last: bool = True) -> None:
        self._call, self._counts, self._key, self._cl = call, counts, key, channels_last
        self._st: tuple[Any, ...] | None = None  # (s, z, s version, z version, qdtype, shape, packed, s_x, z_x)

    def armed(self) -> bool:
        return self._st is not None

    def arm(self, x: QTensor, shape: torch.Size, packed: Any, sx: float, zx: int) -> None:
        """Serve inputs on ``x``'s grid (read as ``s_x``, ``z_x``) whose codes have ``shape``, with ``packed``."""
        s, z = x._scale, x._zero_point
        st = self._st
        if st is not None and st[0] is s and st[1] is z and st[5] == shape and st[6] is packed and st[4] is x._qdtype:
            if (st[2] == -1 or st[2] == s._version) and (st[3] == -1 or st[3] == z._version):
                return  # (already serving it)
        self._st = (s, z, -1 if s.is_inference() else s._version, -1 if z.is_inference() else z._version,
                    x._qdtype, shape, packed, sx, zx)

    def __call__(self, x: QTensor) -> QTensor | None:
        st = self._st
        if st is None:
            return None
        s, z = x._scale, x._zero_point
        if (s is not st[0] or z is not st[1] or x._qdtype is not st[4] or x._axis is not None
                or (st[2] != -1 and s._version != st[2]) or (st[3] != -1 and z._version != st[3])):
            return None
        q = x._c  # (run's x.int_repr(): a native tensor's codes made here as there)
        if q is None:
            q = x._q
        if q.shape != st[5] or q.dtype is not _UINT8 or not q.is_cpu:
            return None
        if self._cl and not q.is_contiguous(memory_format=_CL):  # (run's layout step; the small conv reads any strides)
            cl = native.to_channels_last(q)
            q = q if cl is None else cl
        y = self._call(q, st[7], st[8], st[6])
        if y is not None:  # (None: the call declined, run serves and tallies)
            self._counts[self._key] += 1
        return y  # type: ignore[no-any-return]
