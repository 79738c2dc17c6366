"""Every ``torch.Tensor`` method and attribute on a ``QTensor``: the documented float fallback.

A ``QTensor`` is not a ``torch.Tensor``; code written for tensors (``nn.MultiheadAttention`` checks
``query.is_nested``, a loss calls ``.float()``, a metric ``.argmax(-1)``) must still run on it. So, for
any public name of ``torch.Tensor`` that ``QTensor`` does not define itself:

- **metadata** (``ndim``, ``is_nested``, ``is_cuda``, ``layout``, ``stride()``, ``requires_grad`` ...)
  is the codes' (no dequantization, no warning); a QTensor holds no gradient (``grad`` is ``None``); ``dtype`` is
  the grid (``qdtype``), but ``torch.float32`` to code in ``torch.nn.modules`` (``seen_dtype``: torch's float RNNs
  and attention modules build float tensors from ``input.dtype`` before any torch function runs);
- **explicit conversions** to float or host values (``numpy()``, ``tolist()``, ``item()``, ``float(qt)``; and
  ``float()``, ``half()``, ``to(dtype)``, ``type(dtype)`` with a float dtype, ``convert.py``) return the dequantized
  values, silently — that is what they ask for; an integer dtype (``int()``, ``to(torch.int64)``) is refused;
- **in-place methods** (``add_``, ``masked_fill_``, ``qt[i] = v`` ...) and torch's in-place functions on a QTensor
  (``torch.relu_(qt)``, ``F.hardtanh_(qt)``) raise a ``TypeError`` naming the method: they would change a
  dequantized copy, not the codes, so running them would lose the write;
- **integer ids**: ``F.embedding`` / ``F.embedding_bag`` / ``F.one_hot`` given a QTensor as ids (or offsets)
  raise a ``TypeError`` naming it (a QuantStub quantized the ids);
- **everything else** (methods such as ``sum``, ``cumsum``, ``softmax``; the Python
  operators ``<``, ``**``, ``abs()`` ...) runs on ``dequantize()`` and warns once per name
  (``"lowbit: QTensor.sum has no integer implementation ..."``); the result is a float tensor.

``clone`` and ``T``/``mT``/``H``/``mH`` stay integer (they keep the grid). Plain Python attribute
lookup only — no tracing machinery (``dtype`` looks at its caller's module, not while dynamo traces) — so a converted
model stays simple for ``torch.compile``.

>>> import torch, warnings, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([[0.5, -1.0], [2.0, 4.0]]), 0.5, 0, Q.qint8)
>>> qt.ndim, qt.is_nested, qt.T.int_repr().tolist()
(2, False, [[1, 4], [-2, 8]])
>>> with warnings.catch_warnings():
...     warnings.simplefilter("ignore")
...     qt.sum().item(), qt.argmax().item(), qt.float().dtype
(5.5, 3, torch.float32)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["install", "seen_dtype", "torch_ao_kernel"]

# read from the codes: shape / layout / device metadata, no values involved
_METADATA = frozenset({
    "ndim", "is_nested", "is_cpu", "is_cuda", "is_ipu", "is_maia", "is_meta", "is_mkldnn", "is_mps", "is_mtia",
    "is_sparse", "is_sparse_csr", "is_vulkan", "is_xla", "is_xpu", "layout", "names", "name",
    "stride", "storage_offset", "is_contiguous", "ndimension", "nelement", "get_device", "data_ptr",
    "element_size", "itemsize", "nbytes", "is_pinned", "is_shared", "dim_order", "untyped_storage",
})
# a QTensor is a leaf without autograd state
_AUTOGRAD = {"requires_grad": False, "grad": None, "grad_fn": None, "is_leaf": True, "retains_grad": False,
             "output_nr": 0, "volatile": False, "grad_dtype": None}
# explicit requests for float (or host) values: dequantize without a warning
# (float() / half() / to(dtype) / type(dtype) / type_as ...: convert.py, under one rule for every dtype)
_CONVERSIONS = frozenset({"numpy", "tolist", "item", "to_dense", "real"})
# names whose in-place form is not a trailing underscore
_INPLACE = frozenset({"set_", "resize_", "retain_grad", "backward",
                      "register_hook", "register_post_accumulate_grad_hook"})


def _is_inplace(name: str) -> bool:
    return name in _INPLACE or (name.endswith("_") and not name.startswith("_"))


def tensor_getattr(self: Any, name: str) -> Any:
    """``QTensor.__getattr__``: called only for names the class does not define."""
    from . import _warn_float_fallback

    if name.startswith("_") or not hasattr(torch.Tensor, name):
        raise AttributeError(f"'QTensor' object has no attribute {name!r}")
    if name in _AUTOGRAD:
        return _AUTOGRAD[name]
    if name in _METADATA:
        return getattr(self.int_repr(), name)
    if _is_inplace(name):
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(f"QTensor.{name}: in-place ops are not supported on a QTensor (its codes are "
                            f"immutable); use qt.dequantize().{name}(...) or the out-of-place op")
        return refuse
    if name in _CONVERSIONS:
        return getattr(self.dequantize(), name)
    value = getattr(self.dequantize(), name)  # a bound method of the float tensor (or a property's value)
    if not callable(value):
        _warn_float_fallback(f"QTensor.{name}")
        return value

    def method(*args: Any, **kwargs: Any) -> Any:
        _warn_float_fallback(f"QTensor.{name}")
        return value(*args, **kwargs)
    return method


def _holds_float64(obj: Any) -> bool:
    """Whether ``obj`` (an argument tuple / list / dict, nested) holds a float64 ``torch.Tensor``."""
    if isinstance(obj, torch.Tensor):
        return obj.dtype is torch.float64
    if isinstance(obj, (list, tuple)):
        return any(_holds_float64(o) for o in obj)
    if isinstance(obj, dict):
        return any(_holds_float64(o) for o in obj.values())
    return False


def fallback_dtype(*trees: Any) -> torch.dtype | None:
    """The dtype a float fallback dequantizes its QTensors to: float64 beside a float64 operand (``qt < float64
    tensor`` gives float64 values, as ``torch.lt``; a float64 LayerNorm failed with "mixed dtype"), else ``None``
    (the QTensor's own float dtype)."""
    return torch.float64 if any(_holds_float64(t) for t in trees) else None


def _binary(name: str) -> Callable:
    def op(self: Any, *args: Any) -> Any:
        from . import _tree_dequantize, _warn_float_fallback
        _warn_float_fallback(f"QTensor.{name}")
        memo: dict[int, torch.Tensor] = {}
        dtype = fallback_dtype(args)
        return getattr(_tree_dequantize(self, memo, dtype), name)(*_tree_dequantize(args, memo, dtype))
    op.__name__ = name
    return op


def _conversion(name: str) -> Callable:
    def op(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.dequantize(), name)(*args, **kwargs)
    op.__name__ = name
    return op


def _setitem(self: Any, key: Any, value: Any) -> None:
    raise TypeError("QTensor.__setitem__: in-place ops are not supported on a QTensor (its codes are immutable); "
                    "dequantize() first, or quantize the edited float tensor again")


# Python operators are looked up on the class, never through __getattr__: install them explicitly.
# In-place operators (__iadd__ ...) are left out, so `qt += 1` rebinds to the float result of `qt + 1`;
# so are __iter__/__reversed__: iterating goes through __getitem__ and yields integer QTensor rows.
_OPERATORS = ("__abs__", "__and__", "__or__", "__xor__", "__invert__", "__pos__", "__pow__", "__rpow__",
              "__mod__", "__rmod__", "__floordiv__", "__rfloordiv__", "__rtruediv__", "__rmatmul__",
              "__lshift__", "__rshift__", "__rand__", "__ror__", "__rxor__", "__eq__", "__ne__", "__lt__", "__le__",
              "__gt__", "__ge__", "__contains__")  # iteration keeps using __len__/__getitem__: QTensor rows
_PY_CONVERSIONS = ("__float__", "__int__", "__bool__", "__complex__", "__array__", "__index__")  # (format: convert.py)
# operators with an integer form somewhere (quantized add / mul kernels, ops.py ...): through torch's function, so
# __torch_function__ picks the integer op where there is one, else the float fallback
_TORCH_OPERATORS: dict[str, Callable] = {
    "__add__": lambda self, other: torch.add(self, other), "__radd__": lambda self, other: torch.add(self, other),
    "__mul__": lambda self, other: torch.mul(self, other), "__rmul__": lambda self, other: torch.mul(self, other),
    "__sub__": lambda self, other: torch.sub(self, other), "__rsub__": lambda self, other: torch.sub(other, self),
    "__truediv__": lambda self, other: torch.div(self, other), "__matmul__": lambda self, other: torch.matmul(self, other),
    "__neg__": lambda self: torch.neg(self),
}


def _iter(self: Any) -> Any:
    """Rows along dim 0, as ``torch.Tensor``; a 0-d QTensor is not iterable (``__getitem__``'s ``IndexError`` would
    end the loop silently, giving no element)."""
    if self.dim() == 0:
        raise TypeError("iteration over a 0-d tensor")
    return iter(self.unbind(0))


def _refuse_inplace_function(cls: type, name: str) -> Callable:
    """``torch.<name>_(qt, ...)`` (``torch.relu_``, ``F.hardtanh_``, ``torch.clamp_`` ...): refused as the method is.
    The float fallback would run it on a dequantized copy and leave ``qt`` unchanged, so a caller that uses ``qt``
    afterwards (the point of an in-place call) read the old values."""
    def op(x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, cls):  # (a QTensor only as another argument: the float fallback)
            return NotImplemented
        raise TypeError(f"{name}: in-place ops are not supported on a QTensor (its codes are immutable); use the "
                        f"out-of-place {name[:-1]}(...) and its result")
    return op


def _inplace_functions(cls: type) -> dict[Callable, Callable]:
    """Every public in-place function of ``torch`` and ``torch.nn.functional`` (a name ending in one ``_``)."""
    import torch.nn.functional as F

    out: dict[Callable, Callable] = {}
    for ns in (torch, F):
        for name in dir(ns):
            fn = getattr(ns, name, None)
            if name.endswith("_") and not name.startswith("_") and callable(fn) and not isinstance(fn, type):
                out.setdefault(fn, _refuse_inplace_function(cls, name))
    return out


def _refuse_index_qtensor(cls: type, name: str, params: tuple[str | None, ...]) -> Callable:
    """``F.embedding`` / ``F.embedding_bag`` / ``F.one_hot`` with a QTensor where they take integer ids: a
    ``TypeError`` naming it. The float fallback gave them the dequantized floats and torch answered "Expected tensor
    for argument #1 'indices' to have one of the following scalar types: Long, Int; but got torch.FloatTensor" (the
    caller passed no FloatTensor). A QTensor holding ids means a ``QuantStub`` / ``QuantWrapper`` quantized them."""
    def op(*args: Any, **kwargs: Any) -> Any:
        for i, p in enumerate(params):  # (None: a position that is not ids, e.g. embedding_bag's weight)
            x = args[i] if i < len(args) else kwargs.get(p) if p else None
            if p and isinstance(x, cls):
                raise TypeError(f"{name}: {p} is a lowbit QTensor ({x.qdtype!r} codes of float values), but {name} "
                                f"takes integer ids; pass the integer tensor itself (a QuantStub or QuantWrapper quantized the "
                                f"ids: keep them out of the quantized region)")
        return NotImplemented  # (a QTensor table or another argument: the float fallback)
    return op


def torch_ao_kernel(func: Any) -> Callable | None:
    """For one of torch.ao's quantized CPU kernels (``torch.ops.quantized.*``, an op packet or overload), the fallback
    that runs it on the dequantized arguments and turns its failure into a ``TypeError`` saying what to use; else
    ``None``. On float values those kernels raise torch's "Could not run 'quantized::elu' with arguments from the 'CPU'
    backend" (``torch.ao.nn.quantized.functional.elu(qt, ...)`` calls one): that reached the user until session 37."""
    name = getattr(func, "_qualified_op_name", None)  # an OpOverloadPacket
    if name is None:
        name = getattr(getattr(func, "_schema", None), "name", None)  # an OpOverload
    if not (isinstance(name, str) and name.startswith("quantized::")):
        return None

    def run(op: Callable, args: Any, kwargs: Any) -> Any:
        try:
            return op(*args, **kwargs)
        except NotImplementedError:
            raise TypeError(
                f"lowbit: torch.ops.{name.replace('::', '.')} is a torch.ao kernel for torch's own quantized tensors "
                "(torch.ao.nn.quantized.functional calls it); it cannot take a lowbit QTensor. Use the "
                "torch.nn.functional op or the lowbit.nn.quantized module (e.g. lowbit.nn.quantized.Hardswish("
                "scale, zero_point)) on the QTensor") from None
    return run


def seen_dtype(qt: Any, caller: Any) -> Any:
    """``QTensor.dtype`` read from the frame ``caller``: the grid, ``qdtype`` (as ``torch.quint8`` is a torch
    quantized tensor's dtype), except to torch's float modules. Code in ``torch.nn.modules`` reads ``input.dtype`` to
    build float tensors *before* it calls a torch function (where the fallback takes over): an RNN's zero hidden state
    and dtype check, ``nn.MultiheadAttention``'s / ``nn.TransformerEncoder``'s padding-mask conversion. To that code it
    is ``torch.float32``, the dtype of the values the fallback computes on, so a float module fed a QTensor runs on
    ``dequantize()`` with the warning (it raised "zeros(): argument 'dtype' must be torch.dtype, not QDtype").
    While dynamo traces, ``QTensor.dtype`` is the grid without asking (dynamo cannot trace ``sys._getframe``).
    ~0.3 µs a read; lowbit's own code reads ``qdtype``."""
    return torch.float32 if caller.f_globals.get("__name__", "").startswith("torch.nn.modules.") else qt.qdtype


def install(cls: type) -> None:
    """Give ``cls`` (``QTensor``) the fallback: ``__getattr__``, the operators, ``T``/``mT``, ``clone``, and the
    refusal of torch's in-place functions (``torch.relu_(qt)``) as of the in-place methods."""
    from . import _INT_OPS

    for fn, op in _inplace_functions(cls).items():
        _INT_OPS.setdefault(fn, op)
    import torch.nn.functional as F

    for fn, params in ((F.embedding, ("input",)), (F.embedding_bag, ("input", None, "offsets")),
                       (F.one_hot, ("input",))):
        _INT_OPS.setdefault(fn, _refuse_index_qtensor(cls, f"torch.nn.functional.{fn.__name__}", params))
    cls.__getattr__ = tensor_getattr  # type: ignore[attr-defined]
    for name, fn in _TORCH_OPERATORS.items():
        setattr(cls, name, fn)
    for name in _OPERATORS:
        if name not in cls.__dict__:
            setattr(cls, name, _binary(name))
    for name in _PY_CONVERSIONS:
        if name not in cls.__dict__:
            setattr(cls, name, _conversion(name))
    cls.__setitem__ = _setitem  # type: ignore[attr-defined]
    cls.__iter__ = _iter  # type: ignore[attr-defined]
    cls.__hash__ = object.__hash__  # type: ignore[method-assign]  # identity, as torch.Tensor (== is elementwise)
    cls.__array_priority__ = 1000  # numpy defers `array op qt` to QTensor's reflected operator
    cls.T = property(lambda self: self.permute(*reversed(range(self.dim()))))  # type: ignore[attr-defined]
    cls.mT = property(lambda self: self.transpose(-2, -1))  # type: ignore[attr-defined]
    cls.data = property(lambda self: self)  # type: ignore[attr-defined]  # as detach(): the QTensor itself
    cls.H, cls.mH = cls.T, cls.mT  # type: ignore[attr-defined]  # real codes: conjugation is the identity
    cls.clone = lambda self, *args, **kwargs: type(self)(  # type: ignore[attr-defined]
        self.int_repr().clone(*args, **kwargs), self.scale.clone(), self.zero_point.clone(), self.qdtype, self.axis)
