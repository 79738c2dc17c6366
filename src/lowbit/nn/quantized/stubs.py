"""The entry and exit of a quantized region: ``Quantize`` (float -> QTensor) and ``DeQuantize``.

``convert`` swaps a calibrated ``QuantStub`` for ``Quantize`` and a ``DeQuantStub`` for ``DeQuantize``::

    Quantize:   q = clamp(round_half_even(x / scale) + zero_point, qmin, qmax)    # (*) float -> (*) codes
    DeQuantize: x̂ = (q - zero_point) * scale                                      # (*) codes -> (*) float32

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized.stubs import Quantize, DeQuantize
>>> qx = Quantize(0.1, 10, Q.quint8)(torch.tensor([-1.0, 0.0, 0.26]))
>>> qx.int_repr().tolist()
[0, 10, 13]
>>> DeQuantize()(qx).tolist()
[-1.0, 0.0, 0.30000001192092896]
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from typing import Any

import torch
from torch import nn

from ... import native, qstore
from ...qscheme import QDtype, quint8
from ...compile_state import qdtype_key, refuse, tensor_version, tracing
from ...fx_leaves import FxLeaf
from ...functional import dense_format, dequantize_fast, quantize_scaled, scalar_qparams, scalar_tensors
from ...qtensor import QTensor, quantize_per_tensor
from ._utils import check_no_nan, check_not_meta, check_out_grid, output_qparams
from ._state import CheckedQuantState

__all__ = ["Quantize", "DeQuantize"]  # (grid_numbers, quantize_cpu: the stub's internals, shared with pt2.module_ops)


def _store(qdtype: QDtype, z: float) -> tuple[Any, ...] | None:
    """``qstore.codes``' one-pass route for codes on ``qdtype`` with zero point ``z`` (see ``Quantize._grid``)."""
    spec = qstore._TORCH_Q.get(qdtype.storage)
    if spec is None or not z.is_integer() or not spec[1] <= z <= spec[2] or not qstore.exact(True):
        return None
    zi, (dtype, smin, smax) = int(z), spec
    lo, hi = qdtype.quant_min, qdtype.quant_max
    return (lo - zi if lo > smin else None), (hi - zi if hi < smax else None), zi, dtype


_PLAIN = {torch.quint8: torch.uint8, torch.qint8: torch.int8}

_NATIVE_DQ_MIN = 1 << 13  # codes from which DeQuantize's native pass beats torch's (its per-call cost ~1 µs more: the
#                           float32 output made in Python, the ctypes call; Zen 4 EPYC, session 20)


def grid_numbers(scale: torch.Tensor, zero_point: torch.Tensor,
                 qdtype: QDtype) -> tuple[torch.Tensor, float, tuple[Any, ...] | None]:
    """``Quantize._grid``'s numbers for this grid (new objects: nothing in them refers to ``scale`` or ``zero_point``)."""
    inv_z = scalar_qparams(scale, zero_point)
    if inv_z is None:
        raise ValueError(f"Quantize: scale={float(scale)!r} has no finite float32 reciprocal")
    with torch.inference_mode(False):  # (the zero point as a Python number: quantize_scaled's store takes one)
        store = _store(qdtype, inv_z[1])
        return scalar_tensors(*inv_z)[0], inv_z[1], None if store is None else (*store, inv_z[0])


def quantize_cpu(x: torch.Tensor, grid: tuple[torch.Tensor, float, tuple[Any, ...] | None], scale: torch.Tensor,
                 zero_point: torch.Tensor, qdtype: QDtype) -> QTensor:
    """``Quantize``'s eager forward for a float32 CPU tensor ``x`` on the grid ``(scale, zero_point, qdtype)``, whose
    ``grid_numbers`` are ``grid``: the native one pass where it fits, else one max for the NaN check and one
    ``quantize_per_tensor`` (the stub's module and the traced ``lowbit::quantize_codes`` both run this)."""
    inv, z, store = grid
    lib = native._lib()
    fmt = dense_format(x)
    if store is not None and lib is not None and fmt is not None and not x.requires_grad:
        # the path below (NaN check, v = x · inv, the 7-bit clamp, quantize_per_tensor at scale 1) in one pass,
        # into plain codes at every size (every consumer takes them: oneDNN, lowbit.native's Linears and
        # DeQuantize; a torch quantized tensor around them costs ~2 µs more to make, and ~2 more to view as
        # plain codes for oneDNN: session 20); the pass is elementwise over memory, so a channels-last input
        # gives channels-last codes in the same pass
        lo, hi, zi, dtype, inv_f = store
        t = torch.empty_like(x, dtype=_PLAIN[dtype])  # (dense: its layout; ~1 µs less than torch.empty)
        if native.rows._quantize(lib, x, inv_f, float(zi), -math.inf if lo is None else lo,
                                 math.inf if hi is None else hi, dtype == torch.qint8, t):
            return QTensor._trusted(t, scale, zero_point, qdtype)
    # the eager fast path: one max for the NaN check (torch's max propagates NaN and makes none: no false
    # alarm from ``inf - inf`` as a sum had; about half the sum's instruction-cache misses: its reduction
    # kernel is smaller), check_no_nan's exact check and error only when it is NaN; one fused-by-hand quantize
    top = x.max().item() if x.numel() else 0.0
    if top != top:
        check_no_nan(x, "Quantize")
    if store is not None and x.is_contiguous() and not x.requires_grad:
        # quantize_scaled → qstore.codes, their decisions made once (_grid): v = x · inv, the 7-bit clamp of v,
        # then add, round, clamp and the 8-bit store in one quantize_per_tensor at scale 1. The upper clamp only
        # where the NaN check's max says v passes it: v ≤ fl(top · inv) (inv > 0, float32 rounding monotone) and
        # top · inv is exact in double, so top · inv ≤ hi means no v above hi (the clamp would change nothing)
        lo, hi, zi, dtype, inv_f = store
        v = torch.mul(x, inv)
        if hi is not None and top * inv_f <= hi:
            hi = None
        if lo is not None or hi is not None:
            v.clamp_(lo, hi)
        t = torch.quantize_per_tensor(v, 1.0, zi, dtype) if qstore._QUIET[0] else qstore._qpt(v, zi, dtype)
        # the codes stay in t (the QTensor's _tu: a Linear's fbgemm call takes it as it is; the plain codes
        # are made only where something reads them)
        return QTensor._trusted(None, scale, zero_point, qdtype, None, None, t)
    codes = quantize_scaled(x, inv, z, qdtype)
    return QTensor._trusted(codes, scale, zero_point, qdtype)


class Quantize(CheckedQuantState):
    """Float tensor -> per-tensor ``QTensor`` on the grid ``(scale, zero_point, qdtype)``.

    A ``QTensor`` input already on this grid passes through; one on another grid is requantized
    onto it. ``scale`` (float32) and ``zero_point`` (int64) are 0-d buffers (``state_dict``).
    """

    def __init__(self, scale: float, zero_point: int, qdtype: QDtype | str | torch.dtype = quint8) -> None:
        super().__init__()
        scale, zero_point, self.qdtype = check_out_grid(scale, zero_point, qdtype, "Quantize")
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor(zero_point, dtype=torch.int64))

    def forward(self, x: torch.Tensor | QTensor) -> QTensor:
        traced = tracing()  # (read once: two torch.compiler queries, ~1 µs per eager call on a Zen 1 EPYC)
        if traced and isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_cpu and native.traced_available():
            # the opaque op runs this module's eager native pass: inductor's kernel of the same float32 steps took
            # 0.65 ms for an 8 x 3 x 224^2 image against the native pass's 0.19 (AVX2 EPYC, 1 thread, session 28; its
            # uint8 stores go through a scratch buffer there), and at a model's input nothing fuses with it
            check_not_meta(x, "Quantize")
            bufs = self._buffers
            codes = torch.ops.lowbit.quantize_codes(x, bufs["scale"], bufs["zero_point"], qdtype_key(self.qdtype))
            return QTensor._trusted(codes, bufs["scale"], bufs["zero_point"], self.qdtype)  # type: ignore[arg-type]
        if type(x) is torch.Tensor and x.dtype == torch.float32 and x.is_cpu and not traced:  # (.is_cpu: no device object)
            bufs = self._buffers  # (nn.Module.__getattr__ costs ~1 µs per buffer read)
            return quantize_cpu(x, self._grid(), bufs["scale"], bufs["zero_point"], self.qdtype)  # type: ignore[arg-type]
        if isinstance(x, QTensor):
            if (x.axis is None and x.qdtype == self.qdtype and torch.equal(x.scale, self.scale)
                    and torch.equal(x.zero_point, self.zero_point)):
                return x
            x = x.dequantize()
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            bad = (f"Quantize expects a float tensor or a QTensor, got {type(x).__name__}"
                   + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
            if not isinstance(x, torch.Tensor):
                raise TypeError(bad)
            # (torch.compile: raised by the compiled program, as eager raises it, not dynamo's "Observed exception")
            codes = refuse(TypeError, bad, torch.empty_like(x, dtype=self.qdtype.storage), x)
            return QTensor._trusted(codes, self.scale, self.zero_point, self.qdtype)
        check_no_nan(x, "Quantize")
        if x.device.type == "cpu" and not traced:
            inv, z, _ = self._grid()
            return QTensor._trusted(quantize_scaled(x, inv, z, self.qdtype), self.scale, self.zero_point,
                                    self.qdtype)
        return quantize_per_tensor(x, self.scale, self.zero_point, self.qdtype)

    def _grid(self) -> tuple[torch.Tensor, float, tuple[Any, ...] | None]:
        """``(float32(1 / scale), zero_point, store)`` (a 0-d float32 tensor, a Python float), once per buffer version;
        ``store``: ``qstore.codes``' one-pass route decided for this grid, ``(lo - z or None, hi - z or None, z,
        torch qdtype, float32(1 / scale) as a Python float)`` (the clamp of ``v`` on a side where the grid is narrower
        than its 8-bit storage), or ``None``
        where ``quantize_scaled`` must decide per call (other storage, a zero point outside it, a torch whose
        ``quantize_per_tensor`` is not exact at scale 1)."""
        scale, zero_point = self._buffers["scale"], self._buffers["zero_point"]
        key = (tensor_version(scale), tensor_version(zero_point))  # type: ignore[arg-type]  # (no raise: inference -1)
        hit = self.__dict__.get("_grid_cache")
        if (hit is None or hit[0] != key or hit[2] is not scale or hit[3] is not zero_point  # (held: ids stay unique)
                or hit[4] is not self.qdtype):
            hit = self.__dict__["_grid_cache"] = (key, grid_numbers(scale, zero_point, self.qdtype), scale, zero_point,
                                                  self.qdtype)
        return hit[1]

    @classmethod
    def from_float(cls, mod: nn.Module) -> Quantize:
        """Build from a calibrated ``QuantStub`` (its ``activation_post_process`` gives the grid)."""
        return cls(*output_qparams(mod, "Quantize"))

    def extra_repr(self) -> str:
        if self.scale.is_meta:  # a model moved to meta (no values) still prints
            return f"scale=<meta>, zero_point=<meta>, qdtype={self.qdtype!r}"
        return f"scale={self.scale.item():.6g}, zero_point={self.zero_point.item()}, qdtype={self.qdtype!r}"


class DeQuantize(FxLeaf, nn.Module):
    """``QTensor`` -> float32 ``(q - zero_point) * scale`` (``dtype=torch.float64``: those values as float64, what
    ``convert`` / ``convert_fx`` give a float64 model's int8 region); a float tensor passes through unchanged. A tuple / list /
    dict (a detector's ``(boxes, scores)``, a multi-head ``{"cls": ..., "aux": ...}``, a namedtuple) is dequantized
    item by item, as ``QuantWrapper`` around such a model needs (``None``, strings, numbers and ``torch.Size`` items
    kept; a dict subclass keeps its type).

    >>> import torch, lowbit as Q
    >>> qx = Q.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.5, 0, Q.quint8)
    >>> out = DeQuantize()({"cls": qx, "aux": (qx, None)})
    >>> out["cls"].tolist(), out["aux"][0].tolist(), out["aux"][1]
    ([0.5, 1.0], [0.5, 1.0], None)
    """

    #: the float dtype a ``QTensor`` comes back as when not float32: convert sets ``torch.float64`` for a float64
    #: model (``region_dtype``), whose float ops after the int8 region then get the dtype the region was entered
    #: with (float32 made a float64 ``LayerNorm`` after it fail with "mixed dtype"); ``None``: float32
    out_dtype: torch.dtype | None = None

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if dtype is not None and dtype is not torch.float32:
            if dtype is not torch.float64:
                raise TypeError(f"DeQuantize: dtype={dtype!r} must be None, torch.float32 or torch.float64")
            self.out_dtype = dtype

    def forward(self, x: Any) -> Any:
        if isinstance(x, (tuple, list, dict)) and type(x) is not QTensor:
            return _map_items(self, x)
        return self._one(x)

    def _one(self, x: torch.Tensor | QTensor) -> torch.Tensor:
        if type(x) is QTensor:
            if self.out_dtype is not None:  # (float64 model: its float32 values, exactly; the lean paths are float32)
                return x.dequantize().to(self.out_dtype)
            if not tracing():
                if x._tq is not None:  # a kernel's own quantized output on this grid: one op
                    return x._tq.dequantize()
                t = x._tu if x._tu is not None else x._c  # Quantize's codes on scale 1, or plain codes
                if t is not None and x._axis is None and t.numel() >= _NATIVE_DQ_MIN:
                    y = _native_dequantize(x, t)
                    if y is not None:
                        return y
                if x._tu is not None:  # codes on scale 1: (q - z) · 1 is exact, then float32 · s
                    return x._tu.dequantize().mul_(x._scale)
                if x._axis is None:
                    # a QTensor's grid was checked where it was made: the lean one-pass dequantize, no re-check
                    return dequantize_fast(x.int_repr(), x.scale, x.zero_point)
            return x.dequantize()
        if isinstance(x, torch.Tensor):
            if self.out_dtype is not None and x.dtype is torch.float32:  # a float op's fallback result in the region
                return x.to(self.out_dtype)  # (float32 out of a float64 model, silently: session 49's leftover)
            return x
        raise TypeError(f"DeQuantize expects a QTensor or a tensor, got {type(x).__name__}")

    @classmethod
    def from_float(cls, mod: nn.Module) -> DeQuantize:
        """Build from a ``DeQuantStub`` (it carries no state)."""
        return cls()

    def extra_repr(self) -> str:
        return "" if self.out_dtype is None else f"dtype={self.out_dtype}"


def region_dtype(model: nn.Module) -> torch.dtype | None:
    """``torch.float64`` when every floating parameter of ``model`` is float64 (its int8 region is entered with
    float64 values, and its float ops after it take float64 only), else ``None`` (float32: ``DeQuantize``'s default).
    A model mixing float64 with other float parameters keeps float32 (which of its dequantizes feed float64 layers
    is not known from the parameters) and is warned once here, at convert: cast it to one dtype first.

    >>> region_dtype(nn.Linear(2, 2).double()), region_dtype(nn.Linear(2, 2))
    (torch.float64, None)
    """
    dtypes = {t.dtype for t in model.parameters() if t.is_floating_point()}
    if dtypes == {torch.float64}:
        return torch.float64
    if torch.float64 in dtypes:
        others = ", ".join(sorted(str(d) for d in dtypes - {torch.float64}))
        warnings.warn(f"lowbit: the model mixes float64 and {others} parameters; its int8 region "
                      "returns float32 (float64 only for a model whose every floating parameter is float64): cast "
                      "the model to one dtype (model.double() / model.float()) before prepare", stacklevel=3)
    return None


def set_region_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Give every ``DeQuantize`` of ``model`` the output dtype ``dtype`` (``region_dtype`` of the float model)."""
    if dtype is not None:
        for m in model.modules():
            if isinstance(m, DeQuantize):
                m.out_dtype = dtype


#: items of a returned container that hold no tensor: kept as they are (a ``(logits, "label")`` or ``(y, y.shape)``
#: output raised "DeQuantize expects a QTensor or a tensor, got int")
_KEPT_ITEMS = (str, bytes, numbers.Number, torch.Size, torch.dtype, torch.device, type(None))


def _map_items(dq: DeQuantize, x: Any) -> Any:
    """``x`` (a tuple / list / dict, nested) with every QTensor / tensor item dequantized; ``None``, strings, numbers,
    ``torch.Size`` / dtype / device items kept. A dict subclass keeps its type and state (a ``defaultdict``'s
    factory: ``type(x)(items)`` raised "first argument must be callable or None")."""
    if isinstance(x, dict):
        items = [(k, _map_items(dq, v)) for k, v in x.items()]
        if type(x) is dict:
            return dict(items)
        out = copy.copy(x)
        for k, v in items:
            out[k] = v
        return out
    if isinstance(x, _KEPT_ITEMS):
        return x
    if isinstance(x, (tuple, list)):
        items = [_map_items(dq, v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return dq._one(x)


_SIGNED = {torch.uint8: False, torch.quint8: False, torch.int8: True, torch.qint8: True}


def _native_dequantize(x: QTensor, t: torch.Tensor) -> torch.Tensor | None:
    """A per-tensor ``QTensor``'s ``(q - z) · s`` in one native pass (``lowbit.native.dequantize``: torch's dequantize bit
    for bit) on the codes ``t`` it holds (its ``_tu`` on scale 1, or its plain codes: torch would need a quantized
    tensor made around them first, or a second pass for the scale), or ``None`` (no native build, codes it does not
    take). The grid was checked where the ``QTensor`` was made."""
    lib = native._lib()
    if lib is None or not t.is_cpu or x._scale.dtype != torch.float32:
        return None
    sgn = _SIGNED.get(t.dtype)
    fmt = None if sgn is None else dense_format(t)
    if fmt is None:
        return None
    return native.rows._dequantize(lib, t, sgn, x._scale.item(), x._zero_point.item(), fmt)  # type: ignore[arg-type]
