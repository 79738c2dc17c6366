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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...compile_state import refuse
from ...fake_quant.base import holds_grid
from ...functional import quantize
from ...observer.distributed import local_statistics
from ...qconfig.config import build
from ...qparams import calculate_qparams
from ...qscheme import QDtype, QScheme, as_qdtype, per_tensor_affine, quint8
from ...qtensor import QTensor, quantize_per_channel
from ._checks import check_no_nan, check_not_meta  # noqa: F401 (re-exported: modules import them from here)

__all__ = ["quantize_weight", "weight_qparams", "weight_qscheme", "observer_grid", "output_qparams", "as_qtensor",
           "float_op", "check_out_grid", "check_no_nan", "check_finite_weight", "check_finite_linears", "InputGrid",
           "refused_result", "refused_call"]

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
    observer. For a per-channel observer whose ``ch_axis`` is 0 (or ``-weight.dim()``) while the weight's channel axis is
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
        obs = build(qconfig, "weight", f"{where}.from_float")
    with torch.no_grad():
        axis = getattr(obs, "ch_axis", None)
        # (ch_axis=-dim is axis 0 too: observed unmoved, a square transposed weight got input-channel grids, silently)
        front = isinstance(axis, int) and axis in (0, -weight.dim()) and ch_axis != 0
        obs(weight.detach().movedim(ch_axis, 0) if front else weight.detach())
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
    axis = getattr(observer, "ch_axis", None)
    if isinstance(axis, int) and scale.numel() > 1 and axis not in (0, ch_axis, ch_axis - weight.dim(), -weight.dim()):
        # (a square weight's scales along its input channels were taken for its output channels: wrong codes, silently;
        # axis 0 means the layer's output channels, which weight_qparams moves to the front for a transposed conv)
        raise ValueError(f"weight observer {type(observer).__name__} is per channel along ch_axis={axis}, but the "
                         f"quantized weight of shape {tuple(weight.shape)} keeps one grid per output channel (axis "
                         f"{ch_axis}); use ch_axis=0 in the qconfig's weight")
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
    s32 = torch.tensor(float(scale), dtype=torch.float32)  # (the buffer's value: 1e39 is inf there, 1e-50 is 0)
    if not 0 < float(s32) < float("inf") or not bool(torch.isfinite(s32.reciprocal())):
        raise ValueError(f"{where}: scale={scale!r} must be a positive finite float32 with a finite float32 reciprocal "
                         f"(in [2**-128, 3.4e38])")
    if isinstance(zero_point, bool) or not isinstance(zero_point, int):
        raise TypeError(f"{where}: zero_point={zero_point!r} must be an int")
    if not qdtype.quant_min <= zero_point <= qdtype.quant_max:
        raise ValueError(f"{where}: zero_point={zero_point} is outside the {qdtype!r} grid "
                         f"[{qdtype.quant_min}, {qdtype.quant_max}]")
    return float(scale), int(zero_point), qdtype


def refused_call(call: Callable[[Any], Any], error: type[Exception], message: str, stand_in: Any,
                 shown: torch.Tensor) -> Any:
    """While ``torch.compile`` traces a refused input (``compile_state.deferring()``): ``call(stand_in)`` (the
    refusing layer on an input it takes) as ``lowbit::failed``, which raises ``error(message)`` when the compiled
    program runs, as eager raises it there (``{shape}`` in ``message``: ``shown``'s shape; ``compile_state.refuse``).
    A QTensor result keeps its grid; its codes are the op's."""
    y = call(stand_in)
    if isinstance(y, QTensor):
        return QTensor._trusted(refuse(error, message, y.int_repr(), shown), y.scale, y.zero_point, y.qdtype)
    return refuse(error, message, y, shown)


def refused_result(module: nn.Module, error: type[Exception], message: str, qx: QTensor, shape: tuple[int, ...],
                   shown: torch.Tensor) -> Any:
    """``refused_call`` of ``module`` on zero codes of a ``shape`` it takes, on ``qx``'s grid."""
    return refused_call(module, error, message,
                        QTensor._trusted(qx.int_repr().new_zeros(shape), qx.scale, qx.zero_point, qx.qdtype), shown)
