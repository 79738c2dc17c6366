"""Whether PyTorch 2 is tracing the current call (``torch.compile`` / ``torch.export``), and qdtype keys.

Converted models run two ways with the same integer results:

- **eager**: modules call the kernels directly (Python floats read from scale buffers, packed-weight
  caches keyed on the module), the fastest path when nobody traces;
- **traced** (``tracing()`` is true while dynamo or ``torch.export`` traces): every integer step is one
  ``torch.ops.lowbit.*`` custom op (``lowbit.pt2``) whose fake implementation gives shapes and
  dtypes and whose real implementation is the eager function itself, so a compiled or exported
  program computes exactly the eager codes and no scale is read into Python during tracing.

Custom-op schemas take strings, not ``QDtype`` objects, so a grid travels as ``qdtype_key``.

``inline_float_ok()``: whether a traced integer step may be written as plain aten float32 ops (which
inductor fuses with its neighbours) instead of an opaque custom op: inductor's C++ code is built
without floating-point contraction (its default ``-ffp-contract=off``), so each float32 step rounds as
in eager and the codes are eager's. Callers also require CPU tensors (GPU code generators may contract).
``inline_quantize`` / ``inline_dequantize`` are the per-tensor ``functional.quantize`` / ``dequantize`` written
so (the Quantize / DeQuantize stubs then fuse with the float glue around them).

``compiler_disabled(fn, reason)`` is ``torch.compiler.disable(fn, reason=reason)`` without importing dynamo at
``import lowbit`` (~1.5 s of a 2.6 s import): dynamo graph-breaks at a call to it (reason in the break), and the
genuine ``torch.compiler.disable`` wrapper, made at its first call once dynamo is loaded, runs ``fn``.

>>> import lowbit as Q
>>> from lowbit.compile_state import qdtype_key, qdtype_from_key, tracing
>>> qdtype_key(Q.quint8.with_range(0, 127)), qdtype_from_key("quint8:0:127") == Q.quint8.with_range(0, 127)
('quint8:0:127', True)
>>> tracing()
False
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .qscheme import QDtype, as_qdtype

try:  # (torch.fx's trace flag, for graph_leaf)
    from torch.fx import _symbolic_trace as _fx_trace
except ImportError:  # pragma: no cover - another torch
    _fx_trace = None  # type: ignore[assignment]

__all__ = ["tensor_version", "tracing", "deferring", "refuse",
           "compiler_disabled", "graph_leaf", "inline_float_ok", "inline_quantize", "inline_dequantize",
           "qdtype_key", "conv_config",
           "qdtype_from_key"]


def tensor_version(t: torch.Tensor) -> int:
    """``t._version`` for the eager caches' keys (packed weights, grid constants).

    Inference tensors (made under ``torch.inference_mode``, e.g. a model deep-copied there) keep no
    version counter and cannot change in place outside inference mode: they key as ``-1`` (with their
    ``data_ptr`` in the same key, a new tensor still misses the cache).
    """
    return -1 if t.is_inference() else t._version


def tracing() -> bool:
    """True while ``torch.compile`` (dynamo) or ``torch.export`` traces the calling code."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def refuse(error: type[Exception], message: str, like: torch.Tensor, refused: torch.Tensor) -> torch.Tensor:
    """Raise ``error(message)`` (lowbit's refusal of the input ``refused``; ``{shape}`` in ``message`` stands for its
    shape), or, while ``torch.compile`` traces (not ``torch.export``), return ``torch.ops.lowbit.failed(like,
    refused, ...)``: an opaque step standing for the refused one's result (``like``'s shape and dtype) that raises
    the same error when the compiled program runs, after the steps that made ``refused``. Raised during the trace,
    a refusal reached a ``fullgraph=True`` caller as dynamo's ``Unsupported: Observed exception``; and a message
    formatted there from a dynamic shape could not be traced at all (``str`` of a ``SymInt``).

    >>> import torch
    >>> refuse(ValueError, "demo: got {shape}", torch.empty(0), torch.zeros(2, 3))
    Traceback (most recent call last):
    ValueError: demo: got (2, 3)
    """
    if not deferring():
        raise error(message.format(shape=tuple(refused.shape)))
    return torch.ops.lowbit.failed(like, refused, error.__name__, message)


def deferring() -> bool:
    """Whether ``refuse`` defers (``torch.compile`` traces, ``torch.export`` does not): a caller builds ``like``
    only then."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting()


_F = TypeVar("_F", bound=Callable[..., Any])


def compiler_disabled(fn: _F, reason: str) -> _F:
    """``torch.compiler.disable(fn, reason=reason)``, the wrapper made at the first call after dynamo is imported.

    Under ``torch.compile`` the returned function is a graph break (dynamo skips inlining a function marked
    ``_torchdynamo_disable``; ``reason`` is in ``break_reasons``, and ``fullgraph=True`` raises it), and its own
    frame is never compiled (a skipped code object), so ``fn`` runs through ``torch.compiler.disable``'s wrapper:
    eagerly, nothing it calls compiled, as with a module-level ``torch.compiler.disable``. Before dynamo is imported
    no frame can be compiling, and ``fn`` is called as it is (the wrapper would change nothing).

    >>> import sys
    >>> double = compiler_disabled(lambda x: 2 * x, reason="eager only")
    >>> double(21), double._torchdynamo_disable_msg
    (42, 'eager only')
    """
    disabled: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            prior = _set_eval_frame(None)  # (made under a compiled caller: dynamo would convert disable's frames)
            try:
                disabled.append(torch.compiler.disable(fn, reason=reason))
            finally:
                _set_eval_frame(prior)
        return disabled[0](*args, **kwargs)

    functools.update_wrapper(call, fn)
    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    call._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def _proxy_in(values: Any) -> Any:
    """The first ``torch.fx.Proxy`` among ``values``, looking into tuples, lists, sets and frozensets, dicts (keys and
    values) and ``slice`` bounds; ``None`` if none."""
    for v in values:
        if isinstance(v, torch.fx.Proxy):
            return v
        if isinstance(v, (tuple, list, set, frozenset)) and v:
            found = _proxy_in(v)
        elif isinstance(v, dict) and v:
            found = _proxy_in((*v.keys(), *v.values()))
        elif isinstance(v, slice):
            found = _proxy_in((v.start, v.stop, v.step))
        else:
            continue
        if found is not None:
            return found
    return None


_NO_FX_FLAG = not hasattr(_fx_trace, "_is_fx_tracing_flag")  # (a torch without it: look for proxies on every call)


def graph_leaf(fn: _F) -> _F:
    """``fn`` as one ``call_function`` node of itself whenever torch.fx traces it (an argument, or an item of a
    tuple / list / set / dict argument (key or value) or a ``slice``'s bound, is a ``Proxy``); called on values,
    ``fn(*args, **kwargs)``.

    ``torch.fx.wrap`` does this only for calls in the module that registered it, while a trace runs: a node a pass
    inserted (``graph.call_function(fn, ...)``) is in the generated code as a call from the GraphModule's own
    module, and ``pickle`` / ``torch.save`` rebuild a GraphModule by re-tracing that code, which ran ``fn``'s body on
    proxies (``scaled_operand(b, -0.5)`` came back as ``b * -0.5``). A function that checks for proxies itself stays
    one node of the same function through any re-trace. torch.fx cannot record a set argument or a dict key that
    holds a proxy: such a call is a ``TypeError`` naming ``fn`` (the body used to run on proxies).

    Proxies are looked for only while a ``torch.fx.Tracer.trace`` runs (torch.fx's ``_is_fx_tracing_flag``, one
    attribute read): an eager call costs ~0.1 µs over ``fn`` instead of the ~0.7 µs walk of every argument. As with
    ``torch.fx.wrap``, a proxy built by hand outside a trace (``GraphAppendingTracer``) runs ``fn``'s body.

    >>> import torch
    >>> from torch import fx
    >>> @graph_leaf
    ... def twice(x):
    ...     return x + x
    >>> gm = fx.symbolic_trace(lambda x: twice(x) - 1)
    >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is twice, gm(torch.ones(1)).tolist()
    (True, [1.0])
    """
    @functools.wraps(fn)
    def leaf(*args: Any, **kwargs: Any) -> Any:
        if _NO_FX_FLAG or _fx_trace._is_fx_tracing_flag:  # (a trace runs: look for proxies)
            proxy = _proxy_in(args) if not kwargs else _proxy_in((*args, *kwargs.values()))
            if proxy is not None:
                try:
                    return proxy.tracer.create_proxy("call_function", leaf, args, kwargs)
                except (NotImplementedError, RuntimeError) as e:  # torch.fx records no set, no Node as a dict key
                    raise TypeError(f"{fn.__qualname__}: a traced value inside a set or used as a dict key cannot be "
                                    f"an argument of a torch.fx node (pass a tuple, or dict values): {e}") from e
        return fn(*args, **kwargs)
    return leaf  # type: ignore[return-value]


_set_eval_frame: Callable[[Any], Any]  # torch._C's (dynamo's frame callback: None while a disabled function runs)


def _skip_frames_of(make: Callable[..., Any]) -> None:
    """Never compile the frames of the functions ``make`` returns (dynamo's ``skip_code``, through ``torch._C``).
    Where that private API is missing, ``compiler_disabled`` applies ``torch.compiler.disable`` at once (the
    import then loads dynamo, as before)."""
    global compiler_disabled, _set_eval_frame
    code = next(c for c in make.__code__.co_consts if getattr(c, "co_name", None) == "call")
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy, set_eval_frame
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
        _set_eval_frame = set_eval_frame
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another torch: the eager import
        compiler_disabled = lambda fn, reason: torch.compiler.disable(fn, reason=reason)  # noqa: E731


_skip_frames_of(compiler_disabled)


def inline_float_ok() -> bool:
    """Whether inductor compiles float32 glue without contraction (see the module docstring); read once per
    trace as a constant (marked as ``torch.compiler.assume_constant_result`` does, without importing dynamo)."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - torch without inductor
        return False
    return str(getattr(config.cpp, "enable_floating_point_contract_flag", "")).lower() == "off"


inline_float_ok._dynamo_marked_constant = True  # type: ignore[attr-defined]


def inline_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qdtype: QDtype) -> torch.Tensor | None:
    """Traced per-tensor ``quantize`` as aten ops on CPU: ``clamp(round(x · (1/s) + z))``, eager's float32 steps
    (``functional.quantize_scaled``) in eager's order; ``None`` where the opaque op must run."""
    if x.device.type != "cpu" or scale.numel() != 1 or not inline_float_ok():
        return None
    q = torch.round(x.to(torch.float32) * torch.reciprocal(scale.to(torch.float32)) + zero_point.to(torch.float32))
    return torch.clamp(q, qdtype.quant_min, qdtype.quant_max).to(qdtype.storage)


def inline_dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor | None:
    """Traced per-tensor ``dequantize`` as aten ops on CPU: ``(q - z) · s`` in float32 (exact difference, one
    rounding, as eager); ``None`` where the opaque op must run."""
    if q.device.type != "cpu" or scale.numel() != 1 or not inline_float_ok():
        return None
    return (q.to(torch.float32) - zero_point.to(torch.float32)) * scale.to(torch.float32)


def qdtype_key(qdtype: QDtype) -> str:
    """``"name:quant_min:quant_max"``: a ``QDtype`` as a custom-op string argument."""
    return qdtype._key  # (made by QDtype itself: a constant string while dynamo traces)


@functools.lru_cache(maxsize=None)
def qdtype_from_key(key: str) -> QDtype:
    """The ``QDtype`` of a ``qdtype_key`` (a builtin grid, possibly narrowed with ``with_range``)."""
    try:
        name, lo, hi = key.split(":")
        base = as_qdtype(name)
        lo_i, hi_i = int(lo), int(hi)
    except (ValueError, TypeError) as e:
        raise ValueError(f"qdtype key {key!r} must be 'name:quant_min:quant_max' with a builtin name") from e
    return base if (lo_i, hi_i) == (base.quant_min, base.quant_max) else base.with_range(lo_i, hi_i)


def conv_config(x_qdtype: str, w_qdtype: str, out_qdtype: str, relu: bool, stride: list[int], padding: list[int],
                dilation: list[int], groups: int, transposed: bool, output_padding: list[int]) -> str:
    """``qconv``'s non-tensor arguments as ``lowbit::qconv_cfg``'s one string (grids, relu, geometry).

    A 1-d conv's string ends in an 11th field, ``nlc``: the op gives its codes in eager's ``(N, C, L)`` layout with
    strides ``(L·C, 1, C)``; a ten-field 1-d string (programs traced before session 43, their AOTInductor packages
    and inductor caches) keeps the contiguous codes they were compiled against.

    >>> conv_config("quint8:0:255", "qint8:-128:127", "quint8:0:255", True, [1, 1], [1, 1], [1, 1], 1, False, [0, 0])
    'quint8:0:255|qint8:-128:127|quint8:0:255|1|1,1|1,1|1,1|1|0|0,0'
    >>> conv_config("quint8:0:255", "qint8:-128:127", "quint8:0:255", False, [1], [0], [1], 1, False, [0])
    'quint8:0:255|qint8:-128:127|quint8:0:255|0|1|0|1|1|0|0|nlc'
    """
    ints = (",".join(map(str, v)) for v in (stride, padding, dilation))
    return "|".join((x_qdtype, w_qdtype, out_qdtype, str(int(relu)), *ints, str(groups), str(int(transposed)),
                     ",".join(map(str, output_padding)), *(("nlc",) if len(stride) == 1 else ())))
