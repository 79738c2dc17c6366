"""Integer kernels behind one interface, with a backend chosen per device (DESIGN §4).

``linear(x, weight, bias, out, relu, cache)`` and ``conv(x, weight, bias, spec, out, relu, cache)``
take a per-tensor ``QTensor`` input and a per-channel int8 ``QTensor`` weight and return a
``QTensor`` on ``out`` (an ``OutGrid``), or float32 when ``out`` is ``None`` (dynamic use).

Backends, tried in order until one accepts the case (a backend returns ``NotImplemented`` to
decline, e.g. oneDNN for weights with zero points):

==============  ===================================================================  ==========
``onednn``      prepacked u8×s8 GEMM/conv with fused requantization (x86 CPU)         CPU default
``int_mm``      ``torch._int_mm`` + torch epilogue; linear only                       CUDA default
``reference``   float simulation (dequantize → float op → requantize), the oracle     last resort
==============  ===================================================================  ==========

``set_backend(name)`` pins one for the process and ``use_backend(name)`` for a ``with`` block; a
pinned backend that declines falls back along the automatic chain (never an error). ``counts`` tallies
what actually ran, keyed ``(backend, op)``, so a caller can check that the int8 path was taken.
``cache`` is the caller's dict of packed weights (a cache, never module state).

While ``torch.compile`` / ``torch.export`` trace (``lowbit.compile_state.tracing()``), both entry points
emit one ``torch.ops.lowbit.qlinear`` / ``qconv`` custom op instead (``lowbit.pt2``); its real
implementation calls back into this dispatcher, so backend choice, pins and ``counts`` work the same
in compiled and exported programs. The output grid then comes from ``OutGrid.scale_t`` /
``zero_point_t`` (tensors: no scale is read into Python while tracing).

>>> import torch, lowbit as Q
>>> from lowbit import kernels
>>> x = Q.quantize_per_tensor(torch.tensor([[1.0, 2.0]]), 0.1, 0, Q.quint8)
>>> w = Q.quantize_per_channel(torch.tensor([[1.0, -1.0]]), torch.tensor([0.01]), torch.tensor([0]), 0, Q.qint8)
>>> with kernels.use_backend("reference"):
...     kernels.linear(x, w, None, kernels.OutGrid(0.05, 128, Q.quint8)).int_repr().tolist()
[[108]]
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from ..compile_state import conv_config, qdtype_key, tracing
from ..qtensor import QTensor
from . import int_mm, onednn, reference
from .spec import ConvSpec, OutGrid

__all__ = ["OutGrid", "ConvSpec", "BACKENDS", "counts", "set_backend", "get_backend", "use_backend",
           "backend_chain", "linear", "conv"]

BACKENDS: dict[str, ModuleType] = {"onednn": onednn, "int_mm": int_mm, "reference": reference}
counts: Counter[tuple[str, str]] = Counter()

_UNSET = "<unset>"  # no use_backend block in this context: the process pin (set_backend) decides
_pinned: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowbit_kernel_backend", default=_UNSET)
_global: list[str | None] = [None]


def _check(name: str | None) -> str | None:
    if name is not None and (not isinstance(name, str) or name not in BACKENDS):
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {sorted(BACKENDS)} or None (automatic)")
    return name


def set_backend(name: str | None) -> None:
    """Pin a backend for the whole process (``None``: choose per device)."""
    _global[0] = _check(name)


def get_backend() -> str | None:
    """The pinned backend name (innermost ``use_backend`` first, ``use_backend(None)`` included), or ``None`` for
    automatic."""
    name = _pinned.get()
    return _global[0] if name is _UNSET else name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Pin a backend inside a ``with`` block (thread/async-task local); ``None``: the automatic choice inside it, even
    under ``set_backend``."""
    token = _pinned.set(_check(name))
    try:
        yield
    finally:
        _pinned.reset(token)


def backend_chain(device: torch.device) -> tuple[ModuleType, ...]:
    """The backends tried, in order, for tensors on ``device``."""
    auto = (onednn, int_mm, reference) if device.type == "cpu" else (int_mm, reference)
    name = get_backend()
    if name is None:
        return auto
    if name == "reference":
        return (reference,)
    return (BACKENDS[name],) + tuple(b for b in auto if b.NAME != name)


def _check_input(x: Any, weight: Any, op: str) -> None:
    if not isinstance(x, QTensor):
        raise TypeError(f"kernels.{op}: x must be a lowbit.QTensor, got {type(x).__name__}")
    if x.axis is not None:
        raise ValueError(f"kernels.{op}: x must be quantized per tensor, got a per-channel QTensor (axis={x.axis})")
    if not isinstance(weight, QTensor) or weight.int_repr().dtype != torch.int8:
        raise TypeError(f"kernels.{op}: weight must be a QTensor with int8 codes, got {weight!r}")


def linear(x: QTensor, weight: QTensor, bias: torch.Tensor | None = None, out: OutGrid | None = None,
           relu: bool = False, cache: dict[str, Any] | None = None) -> QTensor | torch.Tensor:
    """``relu?(x̂ ŵᵀ + b)`` for ``x`` ``(*, K)`` and ``weight`` ``(N, K)``, on ``out`` or float."""
    _check_input(x, weight, "linear")
    if tracing():
        return _traced_linear(x, weight, bias, out, relu)
    if x.int_repr().is_cpu and get_backend() is None:  # the automatic CPU chain, without building it
        y = onednn.linear(x, weight, bias, out, relu, cache)
        if y is not NotImplemented:
            counts[("onednn", "linear")] += 1
            return y
    for backend in backend_chain(x.device):
        y = backend.linear(x, weight, bias, out, relu, cache)
        if y is not NotImplemented:
            counts[(backend.NAME, "linear")] += 1
            return y
    raise AssertionError("the reference backend never declines")  # pragma: no cover


def conv(x: QTensor, weight: QTensor, bias: torch.Tensor | None, spec: ConvSpec, out: OutGrid | None = None,
         relu: bool = False, cache: dict[str, Any] | None = None) -> QTensor | torch.Tensor:
    """``relu?(conv(x̂, ŵ) + b)`` (or the transposed conv) for ``x`` ``(N, C, *spatial)``."""
    _check_input(x, weight, "conv")
    if tracing():
        return _traced_conv(x, weight, bias, out, relu, spec)
    op = "conv_transpose" if spec.transposed else "conv"
    if x.int_repr().is_cpu and get_backend() is None:  # the automatic CPU chain, without building it
        y = onednn.conv(x, weight, bias, spec, out, relu, cache)
        if y is not NotImplemented:
            counts[("onednn", op)] += 1
            return y
    for backend in backend_chain(x.device):
        y = backend.conv(x, weight, bias, spec, out, relu, cache)
        if y is not NotImplemented:
            counts[(backend.NAME, op)] += 1
            return y
    raise AssertionError("the reference backend never declines")  # pragma: no cover


def _traced_out(x: QTensor, out: OutGrid | None) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    """A traced kernel op's output grid arguments: scale and zero point tensors and the ``qdtype_key`` (float: none)."""
    if out is None:
        return None, None, ""
    dev = x.device
    s_out = out.scale_t if out.scale_t is not None else torch.tensor(out.scale, dtype=torch.float32, device=dev)
    z_out = (out.zero_point_t if out.zero_point_t is not None
             else torch.tensor(out.zero_point, dtype=torch.int64, device=dev))
    return s_out, z_out, qdtype_key(out.qdtype)


def _traced_linear(x: QTensor, weight: QTensor, bias: torch.Tensor | None, out: OutGrid | None,
                   relu: bool) -> QTensor | torch.Tensor:
    """The Linear as one ``torch.ops.lowbit.qlinear`` (see the module docstring)."""
    s_out, z_out, key = _traced_out(x, out)
    y = torch.ops.lowbit.qlinear(x.int_repr(), x.scale, x.zero_point, qdtype_key(x.qdtype), weight.int_repr(),
                                 weight.scale, weight.zero_point, qdtype_key(weight.qdtype), bias, s_out, z_out, key,
                                 relu)
    return y if out is None else QTensor(y, s_out, z_out, out.qdtype)


def _traced_conv(x: QTensor, weight: QTensor, bias: torch.Tensor | None, out: OutGrid | None, relu: bool,
                 spec: ConvSpec) -> QTensor | torch.Tensor:
    """The conv as one ``torch.ops.lowbit.qconv_cfg``: the grids and geometry in one string
    (``compile_state.conv_config``; ``lowbit::qconv`` takes them apart, for programs exported before)."""
    s_out, z_out, key = _traced_out(x, out)
    config = conv_config(qdtype_key(x.qdtype), qdtype_key(weight.qdtype), key, relu, list(spec.stride),
                         list(spec.padding), list(spec.dilation), spec.groups, spec.transposed,
                         list(spec.output_padding) or [0] * spec.dim)
    y = torch.ops.lowbit.qconv_cfg(x.int_repr(), x.scale, x.zero_point, weight.int_repr(), weight.scale,
                                   weight.zero_point, bias, s_out, z_out, config)
    return y if out is None else QTensor(y, s_out, z_out, out.qdtype)
