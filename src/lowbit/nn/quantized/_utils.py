"""Shared helpers of the static quantized modules: weight quantization, output grid, input coercion.

Weight (per output channel ``c`` along ``ch_axis``)::

    (s_w, z_w) = observer.calculate_qparams()     # after observer(W), or a QAT weight_fake_quant's
    q_w        = clamp(round(W / s_w[c]) + z_w[c], qmin, qmax)       # int8 codes

A per-tensor weight observer's scalar qparams are broadcast to every channel, so a quantized
module always stores ``(C,)`` scales and zero points.

>>> import torch, lowbit as Q
>>> from lowbit.nn.quantized._utils import quantize_weight, as_qtensor
>>> from lowbit.observer import PerChannelMinMaxObserver
>>> w = torch.tensor([[1.0, -0.5], [0.2, 0.1]])
>>> obs = PerChannelMinMaxObserver(ch_axis=0)
>>> _ = obs(w)
>>> quantize_weight(w, obs, 0).int_repr().tolist()
[[127, -64], [127, 64]]
>>> as_qtensor(torch.tensor([0.0, 1.0]), None, "Linear").qdtype
lowbit.quint8
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...compile_state import tensor_version, tracing
from ...fake_quant.base import holds_grid
from ...functional import quantize
from ... import kernels
from ...kernels import OutGrid
from ...kernels.plan import layer_key
from ...observer.distributed import local_statistics
from ...qparams import calculate_qparams
from ...qscheme import QDtype, QScheme, as_qdtype, per_tensor_affine, quint8
from ...qtensor import QTensor, quantize_per_channel
from ._checks import check_no_nan, check_not_meta  # noqa: F401 (re-exported: modules import them from here)
from ._state import CheckedQuantState

__all__ = ["quantize_weight", "weight_qparams", "weight_qscheme", "observer_grid", "output_qparams", "as_qtensor",
           "float_op", "check_out_grid", "check_no_nan", "check_finite_weight", "check_finite_linears", "WeightedQuantModule",
           "InputGrid"]

InputGrid = tuple[float, int, QDtype]


_PRECOMPUTED = threading.local()  # .on: convert(use_precomputed_fake_quant=True) runs in this thread; .used: grids taken


@contextlib.contextmanager
def precomputed_weights(on: bool = True) -> Iterator[list[int]]:
    """Inside this block (this thread) ``weight_qparams`` takes a QAT module's ``weight_fake_quant`` grid as it
    stands, without observing the weight again: ``convert(use_precomputed_fake_quant=True)``, as in torch.ao.
    Yields a one-item list that counts the grids so taken."""
    before = getattr(_PRECOMPUTED, "on", False), getattr(_PRECOMPUTED, "used", None)
    _PRECOMPUTED.on, _PRECOMPUTED.used = bool(on), [0]
    try:
        yield _PRECOMPUTED.used
    finally:
        _PRECOMPUTED.on, _PRECOMPUTED.used = before


def check_precomputed_flag(flag: Any, where: str) -> bool:
    """``flag`` as a bool, else ``TypeError`` naming ``where`` and the value; ``True`` also inside
    ``precomputed_weights()``."""
    if not isinstance(flag, bool):
        raise TypeError(f"{where}: use_precomputed_fake_quant must be a bool, got {flag!r}")
    return flag or bool(getattr(_PRECOMPUTED, "on", False))


def precomputed_source(mod: nn.Module, where: str) -> Any:
    """``mod.weight_fake_quant`` as it stands, for ``use_precomputed_fake_quant``; ``None`` where the module has none
    (a post-training layer: its weight observer is built at convert, there is no grid to reuse). ``ValueError`` naming
    ``where`` when it holds no grid (it never saw a weight and learned none: torch.ao would quantize with the
    observer's default scale 1)."""
    obs = getattr(mod, "weight_fake_quant", None)
    if obs is None:
        return None
    if not holds_grid(obs):
        raise ValueError(f"{where}: use_precomputed_fake_quant=True, but the weight_fake_quant of {type(mod).__name__} "
                         f"({type(obs).__name__}) has seen no weight and holds no grid: run a training or calibration "
                         "step first, or convert with use_precomputed_fake_quant=False")
    used = getattr(_PRECOMPUTED, "used", None)
    if used is not None:
        used[0] += 1
    return obs


def weight_qparams(weight: torch.Tensor, mod: nn.Module, ch_axis: int, where: str, precomputed: bool = False) -> Any:
    """The weight observer (or fake-quant) for ``mod``, already fed ``weight``.

    A QAT module's ``weight_fake_quant`` is used as is (it observes ``weight`` once more only if its
    observer is enabled, as in ``torch.ao``); otherwise ``mod.qconfig.weight()`` builds a fresh
    observer. For a per-channel observer whose ``ch_axis`` is 0 while the weight's channel axis is
    ``ch_axis`` (ConvTranspose: 1), the weight is observed with that axis moved to the front.
    ``precomputed`` (or inside ``precomputed_weights()``): a ``weight_fake_quant``'s grid as it stands, not fed
    ``weight`` (``precomputed_source``; a module without one is observed as usual).
    """
    if precomputed or getattr(_PRECOMPUTED, "on", False):
        obs = precomputed_source(mod, f"{where}.from_float")
        if obs is not None:
            return obs
    obs = getattr(mod, "weight_fake_quant", None)
    if obs is None:
        qconfig = getattr(mod, "qconfig", None)
        if qconfig is None:
            raise ValueError(f"{where}.from_float: {type(mod).__name__} has no qconfig (run prepare first)")
        obs = qconfig.weight()
    with torch.no_grad():
        axis = getattr(obs, "ch_axis", None)
        obs(weight.detach().movedim(ch_axis, 0) if axis == 0 and ch_axis != 0 else weight.detach())
    return obs


def check_finite_weight(weight: torch.Tensor, where: str = "") -> None:
    """``ValueError`` (prefixed ``where: ``) for a float weight holding NaN or ±Inf: integer codes cannot
    hold it, and quantizing it would give a finite, wrong layer. ``convert`` adds the layer's name."""
    bad = ~torch.isfinite(weight.detach())
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{where + ': ' if where else ''}the weight of shape {tuple(weight.shape)} holds "
                         f"{int(bad.sum())} NaN/Inf values (first at index {first}: {float(weight.detach()[first])}); "
                         "integer codes cannot represent them — fix or exclude this layer (qconfig None)")


def check_finite_linears(named: Iterable[tuple[str, nn.Module]], fn: str, bias: bool = True) -> None:
    """``ValueError`` naming the first of the ``(name, Linear)`` pairs whose weight (or, with ``bias``, bias) holds NaN
    or ±Inf: the whole-model entry points (``quantize_weight_only``, ``quantize_llm``, ``quantize_w8a8``) check every
    layer before any copy or calibration work."""
    for name, m in named:
        if m.weight.is_meta:  # (isfinite(...).all() of a meta tensor failed in Tensor.item())
            raise ValueError(f"{fn}: layer {name or '<model>'!r} has its weight on the meta device (no values to "
                             "quantize); load or materialise the weights first (e.g. model.to_empty + load_state_dict)")
        for what, t in (("weight", m.weight), ("bias", m.bias if bias else None)):
            if t is not None and not bool(torch.isfinite(t.detach()).all()):
                raise ValueError(f"{fn}: layer {name or '<model>'!r} has {int((~torch.isfinite(t.detach())).sum())} NaN/Inf "
                                 f"{what} values (of {t.numel()}); fix the checkpoint before quantizing")


def quantize_weight(weight: torch.Tensor, observer: Any, ch_axis: int) -> QTensor:
    """Quantize a float weight with ``observer``'s qparams into a per-channel int8 ``QTensor``.

    A NaN or ±Inf weight is a ``ValueError`` (``check_finite_weight``)."""
    check_finite_weight(weight)
    with local_statistics():  # weights are replicated: their statistics are already the union (no collective)
        scale, zero_point = observer.calculate_qparams()
    qdtype = as_qdtype(observer.qdtype)
    if qdtype.storage != torch.int8:
        raise ValueError(f"quantized weights must be signed 8-bit codes, got a {qdtype!r} weight observer "
                         f"({type(observer).__name__}); use qint8 (optionally with_range(-127, 127))")
    if getattr(observer, "qscheme", None) is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS:
        raise ValueError(f"{type(observer).__name__} uses per_channel_affine_float_qparams (float zero points), "
                         "which only embeddings support; use per_channel_symmetric or per_channel_affine weights")
    c = weight.shape[ch_axis]
    scale = scale.detach().to(torch.float32).reshape(-1)
    zero_point = zero_point.detach().to(torch.int64).reshape(-1)
    if scale.numel() == 1:
        scale, zero_point = scale.expand(c).clone(), zero_point.expand(c).clone()
    if scale.numel() != c:
        raise ValueError(f"weight observer {type(observer).__name__} gave {scale.numel()} scales for "
                         f"{c} channels along axis {ch_axis} of a weight of shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    return quantize_per_channel(w, scale.to(w.device), zero_point.to(w.device), ch_axis, qdtype)


def weight_qscheme(observer: Any) -> QScheme:
    """The weight scheme recorded for ``repr`` (per-channel symmetric unless the observer says else)."""
    qs = getattr(observer, "qscheme", None)
    return qs if isinstance(qs, QScheme) else QScheme.PER_CHANNEL_SYMMETRIC


def observer_grid(obs: Any, where: str) -> tuple[float, int, QDtype]:
    """``(scale, zero_point, qdtype)`` of the per-tensor grid a calibrated observer or ``FakeQuantize``
    describes (``ValueError`` naming ``where`` for a per-channel one: an activation grid is per tensor)."""
    scale, zero_point = obs.calculate_qparams()
    if scale.numel() != 1:
        raise ValueError(f"{where}: {type(obs).__name__} is per-channel (scale shape {tuple(scale.shape)}); "
                         "an activation grid must be per tensor")
    return float(scale.reshape(())), int(zero_point.reshape(())), as_qdtype(getattr(obs, "qdtype", quint8))


def output_qparams(mod: nn.Module, where: str) -> tuple[float, int, QDtype]:
    """``(scale, zero_point, qdtype)`` of the per-tensor grid ``mod.activation_post_process`` observed."""
    obs = getattr(mod, "activation_post_process", None)
    if obs is None or not hasattr(obs, "calculate_qparams"):
        raise ValueError(f"{where}.from_float: {type(mod).__name__} has no activation_post_process observer; "
                         "run prepare() and calibrate before convert()")
    return observer_grid(obs, f"{where}.from_float: the output observer of {type(mod).__name__}")


def float_op(mod: nn.Module, kind: type[nn.Module] | tuple[type[nn.Module], ...], where: str,
             fused_relu: bool) -> nn.Module:
    """The float op inside ``mod``: ``mod`` itself, or ``mod[0]`` of a fused ``(op, relu)`` marker."""
    if isinstance(mod, nn.Sequential):
        if fused_relu is False:
            raise TypeError(f"{where}.from_float: {type(mod).__name__} is a fused (op, ReLU) module; "
                            f"convert it with the ReLU variant of {where}")
        op = mod[0]
    else:
        op = mod
    if not isinstance(op, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise TypeError(f"{where}.from_float expects a {names} (or its fused ReLU marker), got {type(op).__name__}")
    return op


def as_qtensor(x: Any, grid: InputGrid | None, where: str) -> QTensor:
    """A per-tensor 8-bit ``QTensor`` from ``x``: passed through, or quantized from float.

    Float input uses the recorded input ``grid`` when there is one, else a dynamic per-tensor
    affine quint8 grid from ``x``'s min/max.
    """
    if isinstance(x, QTensor):
        if x.axis is not None:
            raise ValueError(f"{where}: expects a per-tensor quantized input, got a per-channel QTensor "
                             f"(axis={x.axis})")
        if x.int_repr().element_size() != 1:
            if x.qdtype.quant_max - x.qdtype.quant_min > 255:
                raise TypeError(f"{where}: expects an 8-bit activation grid, got a {x.qdtype!r} QTensor")
            # an 8-bit grid whose codes are stored wider (QTensor checked they lie on the grid): narrowed, as Linear does
            return QTensor(x.int_repr().to(x.qdtype.storage), x.scale, x.zero_point, x.qdtype)
        return x
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = f"a tensor of dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: expects a lowbit.QTensor or a floating-point tensor, got {what}")
    check_no_nan(x, where)
    if grid is None:
        lo, hi = torch.aminmax(x.detach().to(torch.float32)) if x.numel() else (torch.zeros(()), torch.zeros(()))
        scale, zero_point = calculate_qparams(lo, hi, per_tensor_affine, quint8)
        return QTensor(quantize(x, scale, zero_point, quint8), scale, zero_point, quint8)
    scale, zp, qdtype = grid
    return QTensor(quantize(x, scale, zp, qdtype), scale, zp, qdtype)


def check_out_grid(scale: Any, zero_point: Any, qdtype: Any, where: str) -> tuple[float, int, QDtype]:
    """Validate a per-tensor 8-bit output grid; return it as python scalars."""
    qdtype = as_qdtype(qdtype)
    if qdtype.storage not in (torch.int8, torch.uint8):
        raise ValueError(f"{where}: out_qdtype={qdtype!r} must be an 8-bit activation dtype (quint8 or qint8)")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{where}: scale must be a scalar, got shape {tuple(scale.shape)}")
        scale = float(scale)
    if isinstance(zero_point, torch.Tensor):
        if zero_point.numel() != 1 or zero_point.is_floating_point():
            raise ValueError(f"{where}: zero_point must be an integer scalar, got {zero_point!r}")
        zero_point = int(zero_point)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"{where}: scale={scale!r} must be a positive finite float")
    if isinstance(zero_point, bool) or not isinstance(zero_point, int):
        raise TypeError(f"{where}: zero_point={zero_point!r} must be an int")
    if not qdtype.quant_min <= zero_point <= qdtype.quant_max:
        raise ValueError(f"{where}: zero_point={zero_point} is outside the {qdtype!r} grid "
                         f"[{qdtype.quant_min}, {qdtype.quant_max}]")
    return float(scale), int(zero_point), qdtype


class WeightedQuantModule(CheckedQuantState):
    """Base of the static quantized Linear / Conv family: the state and the packed-weight cache.

    ``state_dict``: ``weight_int8`` (int8 codes), ``weight_scale`` (float32, ``(C,)``),
    ``weight_zero_point`` (int64, ``(C,)``), ``bias`` (float32 buffer, absent without bias), and the
    output grid ``scale`` (0-d float32) / ``zero_point`` (0-d int64), and the recorded grid of float
    inputs ``input_scale`` / ``input_zero_point`` (scale 0: none). ``_cache`` holds packed
    weights and the prepared ``(weight QTensor, OutGrid)``; it is keyed on the buffers' versions and
    cleared by ``load_state_dict`` and ``.to()``, and never saved or deep-copied.
    """

    _relu = False
    _weight_axis = 0
    _float_type: type[nn.Module] = nn.Module

    def __init__(self, weight_shape: tuple[int, ...], n_bias: int, bias: bool, device: Any = None) -> None:
        super().__init__()
        c = weight_shape[self._weight_axis]
        self.register_buffer("weight_int8", torch.zeros(weight_shape, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(c, dtype=torch.float32, device=device))
        self.register_buffer("weight_zero_point", torch.zeros(c, dtype=torch.int64, device=device))
        self.register_buffer("bias", torch.zeros(n_bias, dtype=torch.float32, device=device) if bias else None)
        self.register_buffer("scale", torch.tensor(1.0, device=device))
        self.register_buffer("zero_point", torch.tensor(0, dtype=torch.int64, device=device))
        self.out_qdtype: QDtype = quint8
        self.weight_qdtype: QDtype = as_qdtype("qint8")
        self.weight_qscheme: QScheme = QScheme.PER_CHANNEL_SYMMETRIC
        # recorded grid for float inputs (set by convert): buffers, so it travels with state_dict;
        # input_scale == 0 means "none recorded" (float inputs are then quantized dynamically)
        self.register_buffer("input_scale", torch.tensor(0.0, device=device))
        self.register_buffer("input_zero_point", torch.tensor(0, dtype=torch.int64, device=device))
        self.input_qdtype: QDtype = quint8
        self._input_grid: InputGrid | None = None
        self._cache: dict[str, Any] = {}

    @property
    def input_grid(self) -> InputGrid | None:
        """``(scale, zero_point, qdtype)`` used to quantize float inputs, or ``None`` (dynamic)."""
        return self._input_grid

    @input_grid.setter
    def input_grid(self, grid: InputGrid | None) -> None:
        with torch.no_grad():
            if grid is None:
                self.input_scale.zero_()
                self.input_zero_point.zero_()
            else:
                scale, zero_point, qdtype = grid
                if not float(scale) > 0:
                    raise ValueError(f"{type(self).__name__}: input grid scale={scale!r} must be positive")
                self.input_scale.fill_(float(scale))
                self.input_zero_point.fill_(int(zero_point))
                self.input_qdtype = as_qdtype(qdtype)
        self._input_grid = None if grid is None else (float(grid[0]), int(grid[1]), self.input_qdtype)

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> Any:
        """From a prepared float/QAT module (or a fused ``(op, ReLU)`` marker for the ReLU variants).

        Reads ``mod.qconfig.weight`` (or ``mod.weight_fake_quant``) for the weight grid, per channel
        along ``_weight_axis``, and ``mod.activation_post_process`` for the output grid.
        ``use_precomputed_fake_quant=True`` (torch.ao's argument): a QAT module's ``weight_fake_quant`` grid as it
        stands, the weight not observed again.
        """
        precomputed = check_precomputed_flag(use_precomputed_fake_quant, f"{cls.__name__}.from_float")
        op: Any = float_op(mod, cls._float_type, cls.__name__, cls._relu)
        owner = mod if hasattr(mod, "qconfig") or hasattr(mod, "weight_fake_quant") else op
        if op.bias is not None and not bool(torch.isfinite(op.bias.detach()).all()):
            raise ValueError(f"{cls.__name__}.from_float: the bias holds NaN/Inf values; the quantized layer "
                             "would turn them into finite output codes — fix or exclude this layer (qconfig None)")
        obs = weight_qparams(op.weight, owner, cls._weight_axis, cls.__name__, precomputed)
        weight = quantize_weight(op.weight, obs, cls._weight_axis)
        q = cls.from_reference(op, weight, *output_qparams(mod, cls.__name__))  # type: ignore[attr-defined]
        q.weight_qscheme = weight_qscheme(obs)
        return q

    # ---- state ----
    def set_weight_bias(self, weight: QTensor, bias: torch.Tensor | None) -> None:
        """Store a per-channel int8 weight ``QTensor`` (axis ``_weight_axis``) and a float bias."""
        where = type(self).__name__
        if not isinstance(weight, QTensor) or weight.int_repr().dtype != torch.int8:
            raise TypeError(f"{where}: weight must be a QTensor with int8 codes, got {weight!r}")
        if tuple(weight.shape) != tuple(self.weight_int8.shape):
            raise ValueError(f"{where}: weight of shape {tuple(weight.shape)} does not match "
                             f"{tuple(self.weight_int8.shape)}")
        c = weight.shape[self._weight_axis]
        scale, zp = weight.scale.reshape(-1), weight.zero_point.reshape(-1)
        if weight.axis is None:
            scale, zp = scale.expand(c), zp.expand(c)
        elif weight.axis != self._weight_axis:
            raise ValueError(f"{where}: weight must be per-channel along axis {self._weight_axis}, "
                             f"got axis={weight.axis}")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{where}: bias={'None' if bias is None else 'a tensor'} but the module was built "
                             f"with bias={self.bias is not None}")
        if bias is not None:
            bad = int((~torch.isfinite(bias.detach())).sum())
            if bad:  # (load_state_dict and from_float refuse them too: every kernel would turn them into wrong codes)
                raise ValueError(f"{where}: the bias holds {bad} NaN/Inf value(s)")
        with torch.no_grad():
            self.weight_int8.copy_(weight.int_repr())
            self.weight_scale.copy_(scale)
            self.weight_zero_point.copy_(zp)
            if bias is not None and self.bias is not None:
                self.bias.copy_(bias.detach().reshape(-1))
        self.weight_qdtype = weight.qdtype
        self._cache.clear()

    def set_output_grid(self, scale: Any, zero_point: Any, qdtype: Any = quint8) -> None:
        """Set the per-tensor output grid ``(scale, zero_point, qdtype)``."""
        s, z, dt = check_out_grid(scale, zero_point, qdtype, type(self).__name__)
        with torch.no_grad():
            self.scale.fill_(s)
            self.zero_point.fill_(z)
        self.out_qdtype = dt
        self._cache.clear()

    def weight(self) -> QTensor:
        """The int8 weight as a per-channel ``QTensor``."""
        return QTensor(self.weight_int8, self.weight_scale, self.weight_zero_point, self.weight_qdtype,
                       self._weight_axis)

    def _prepared(self) -> tuple[QTensor, OutGrid]:
        """``(weight QTensor, OutGrid)``; the weight QTensor views the buffers, so only an in-place
        change of the output grid buffers needs a rebuild (``set_*``, ``load_state_dict`` and
        ``.to()`` clear the cache)."""
        buffers = self._buffers
        scale, zero_point = buffers["scale"], buffers["zero_point"]
        assert scale is not None and zero_point is not None
        if tracing():  # the traced kernels read the grid from the buffers (no Python float: export-safe)
            return self.weight(), OutGrid(float("nan"), 0, self.out_qdtype, scale, zero_point)
        key = (tensor_version(scale), tensor_version(zero_point))
        hit = self._cache.get("prepared")
        if hit is None or hit[0] != key:
            out = OutGrid(float(scale), int(zero_point), self.out_qdtype, scale.clone(), zero_point.clone())
            hit = (key, (self.weight(), out))
            self._cache["prepared"] = hit
        return hit[1]

    def _plan(self, x: QTensor, build: Any, q: torch.Tensor | None = None) -> Any:
        """The layer's eager per-call plan for input ``x`` (``build(weight, out, qdtype)`` makes it, e.g.
        ``kernels.plan.linear_plan``), or ``None`` where the generic path must run: tracing, a pinned backend,
        a per-channel, empty or non-CPU input. Kept in ``_cache`` for the buffers it was built from (identity
        and ``tensor_version``) and the input ``QDtype``; a plan that declines (``None``) is kept too. ``q``: ``x._meta``
        where the caller has read it."""
        if tracing() or kernels.get_backend() or x._axis is not None:  # (tracing first: no guard on the shape)
            return None
        if q is None:
            q = x._meta  # (the codes' shape and device: a native tensor's codes are not made here)
        if not q.is_cpu or not q.numel():
            return None
        b = self._buffers
        w, ws, wz, bias, s, z = (b["weight_int8"], b["weight_scale"], b["weight_zero_point"], b["bias"], b["scale"],
                                 b["zero_point"])
        key = layer_key(w, ws, wz, bias, s, z)  # type: ignore[arg-type]
        hit = self._cache.get("plan")
        if hit is None or hit[0] != key or (hit[1] is not x._qdtype and hit[1] != x._qdtype):
            weight, out = self._prepared()
            # the buffers ride along: while the plan holds them, their ids cannot be reused
            hit = self._cache["plan"] = (key, x._qdtype, build(weight, bias, out, self._relu, x._qdtype), (w, ws, wz, bias, s, z))
        return hit[2]

    # ---- the cache is never state ----
    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._cache.clear()
        return super()._apply(fn, *args, **kwargs)  # (CheckedQuantState: .double()/.half() keep the buffers' dtypes)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._cache.clear()
        super()._load_from_state_dict(*args, **kwargs)
        scale = float(self.input_scale)
        self._input_grid = (scale, int(self.input_zero_point), self.input_qdtype) if scale > 0 else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    def _grid_repr(self) -> str:
        grid = ("scale=<meta>, zero_point=<meta>" if self.scale.is_meta else  # moved to meta: still prints
                f"scale={float(self.scale):.6g}, zero_point={int(self.zero_point)}")
        return f"{grid}, dtype={self.out_qdtype!r}, qscheme={self.weight_qscheme.value}"
