"""Device moves and dtype conversions of a ``QTensor``: ``to``, ``cpu`` / ``cuda``, ``type``, ``type_as``, the dtype
shortcuts (``float()``, ``int()`` ...); its text (``repr`` / ``str`` / ``format``: metadata only, so a meta QTensor
prints), and the autograd / sharing no-ops (``requires_grad_(False)``, ``share_memory_``).

One rule for every way of naming a dtype (``to(dtype)``, ``type(dtype or type string)``, ``type_as(t)``, ``int()``):

- a float or complex dtype gives ``dequantize()`` converted to it, ``(q - z) * s`` cast (an explicit request for float
  values: no warning);
- the QTensor's own quantized dtype (``torch.qint8`` / ``'torch.QInt8Tensor'`` for ``lowbit.qint8``) is a no-op and
  returns the QTensor itself, as torch's quantized tensors do;
- another quantized dtype is a ``TypeError`` (it needs a new grid); an integer or bool dtype is a ``TypeError`` too:
  ``int(x̂)`` would truncate the values silently (the codes are ``int_repr()``). torch's quantized tensors refuse all
  of these casts (``qt.int()``: "Creation of quantized tensor requires quantized dtype").

``type()`` with no argument is torch's type string, ``'torch.quantized.QUInt8Tensor'`` (4-bit lowbit grids, which
torch lacks: ``'lowbit.quantized.QInt4Tensor'``).

>>> import torch, lowbit as Q
>>> qt = Q.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.5, 0, Q.qint8)
>>> qt.type(), qt.type(torch.qint8) is qt, qt.half().tolist()
('torch.quantized.QInt8Tensor', True, [0.5, -1.0])
>>> qt.int()
Traceback (most recent call last):
...
TypeError: QTensor.int(): the values of a lowbit.qint8 QTensor are not integers; int_repr() gives its codes, \
dequantize().to(...) the values cast
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from ..qscheme import QDtype

__all__ = ["install", "to_dtype", "type_string"]

_TORCH_QDTYPES = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)
_QTYPE_NAMES = {"QInt8": torch.qint8, "QUInt8": torch.quint8, "QInt32": torch.qint32, "QUInt4x2": torch.quint4x2,
                "QUInt2x4": torch.quint2x4}
_LOWBIT_NAMES = {"qint4": "QInt4", "quint4": "QUInt4"}  # lowbit grids torch has no dtype for
# the dtype shortcut methods of torch.Tensor: each is to(dtype) under the rule above
_SHORTCUTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
              "cfloat": torch.complex64, "cdouble": torch.complex128, "chalf": torch.complex32, "int": torch.int32,
              "long": torch.int64, "short": torch.int16, "char": torch.int8, "byte": torch.uint8, "bool": torch.bool}


def to_dtype(qt: Any, dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any], what: str = "") -> Any:
    """``qt.to(..., dtype)`` (``what``: the call to name in an error): a float (or complex) dtype gives the dequantized
    values converted to it; the QTensor's own quantized dtype is a no-op move, as torch's; any other dtype is refused
    naming it: an integer cast of the values would truncate them silently (the codes are ``int_repr()``), another
    quantized dtype needs a new grid (torch refuses both, the latter deep inside its copy kernel)."""
    what = what or f"QTensor.to(dtype={dtype})"
    if dtype.is_floating_point or dtype.is_complex:
        return qt.dequantize().to(*args, **kwargs)
    if dtype == qt.qdtype.torch_dtype:
        return qt.to(*[a for a in args if a is not dtype], **{k: v for k, v in kwargs.items() if k != "dtype"})
    if dtype in _TORCH_QDTYPES:
        raise TypeError(f"{what}: a {qt.qdtype!r} QTensor cannot change its quantized dtype to {dtype} without a new "
                        "grid; quantize dequantize() onto one (lowbit.quantize_per_tensor)")
    raise TypeError(f"{what}: the values of a {qt.qdtype!r} QTensor are not integers; "
                    "int_repr() gives its codes, dequantize().to(...) the values cast")


def type_string(qt: Any) -> str:
    """torch's type string of a quantized tensor on ``qt``'s grid: ``'torch.quantized.QInt8Tensor'`` on the CPU,
    ``'torch.<device>.quantized.QInt8Tensor'`` elsewhere; lowbit's 4-bit grids ``'lowbit.quantized.QInt4Tensor'``."""
    qd = qt.qdtype
    name = next((k for k, v in _QTYPE_NAMES.items() if v == qd.torch_dtype), None)
    root = "torch" if name is not None else "lowbit"
    name = name or _LOWBIT_NAMES.get(qd.name) or f"Q{qd.name}"
    dev = qt.device.type
    return f"{root}.quantized.{name}Tensor" if dev == "cpu" else f"{root}.{dev}.quantized.{name}Tensor"


def _own_grid(qt: Any, grid: QDtype, call: str) -> None:
    """``None`` for the QTensor's own lowbit grid (``qt.to(Q.quint8)`` / ``qt.type(...)``: a no-op, as torch's own
    dtype); another grid is a ``TypeError`` naming both (new codes need a new grid, not a cast)."""
    if grid != qt.qdtype:
        raise TypeError(f"QTensor.{call}({grid!r}): a {qt.qdtype!r} QTensor cannot change its quantized dtype without "
                        "a new grid; quantize dequantize() onto one (lowbit.quantize_per_tensor)")
    return None


def _named_dtype(qt: Any, dtype: Any) -> torch.dtype | None:
    """The dtype that ``type(dtype)`` names (``None``: the QTensor's own type string, or its own lowbit grid)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, QDtype):
        return _own_grid(qt, dtype, "type")
    if isinstance(dtype, str):
        if dtype == type_string(qt):
            return None
        m = re.fullmatch(r"torch\.(?:quantized\.)?(\w+)Tensor", dtype)
        if m and m[1] in _QTYPE_NAMES:
            return _QTYPE_NAMES[m[1]]
        if dtype.startswith("torch.") and all(p.isidentifier() for p in dtype.split(".")):
            try:  # 'torch.FloatTensor', 'torch.cuda.HalfTensor' ...: torch's tensor type classes (no CUDA init)
                cls = torch._utils._import_dotted_name(dtype)
            except (AttributeError, ImportError):
                cls = None
            if isinstance(getattr(cls, "dtype", None), torch.dtype):
                return cls.dtype
        raise ValueError(f"QTensor.type({dtype!r}): invalid type")
    if isinstance(dtype, type) and isinstance(getattr(dtype, "dtype", None), torch.dtype):  # torch.FloatTensor
        return dtype.dtype
    raise TypeError(f"QTensor.type(dtype={dtype!r}): dtype must be a type, str, or dtype object")


def _type(self: Any, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """``type()``: the type string; ``type(dtype)``: the conversion rule of the module docstring."""
    if dtype is None:
        if kwargs:
            raise TypeError(f"QTensor.type() got unexpected keyword arguments {sorted(kwargs)}")
        return type_string(self)
    target = _named_dtype(self, dtype)
    if target is None or target == self.qdtype.torch_dtype:
        return self
    what = f"QTensor.type({dtype!r})"
    if target.is_floating_point or target.is_complex:  # (a type string may also name a device: torch's own cast)
        return self.dequantize().type(dtype, non_blocking, **kwargs)
    return to_dtype(self, target, (), {}, what)


def _type_as(self: Any, other: Any) -> Any:
    """``type_as(other)``: ``type(other.type())`` — a float tensor's dtype and device, or a QTensor of this very
    quantized dtype (itself); other dtypes refused as ``type`` refuses them."""
    if getattr(other, "is_quantized", False) and not isinstance(other, torch.Tensor):  # a QTensor
        if other.qdtype == self.qdtype:
            return self
        raise TypeError(f"QTensor.type_as(a {other.qdtype!r} QTensor): a {self.qdtype!r} QTensor cannot change its "
                        "quantized dtype without a new grid")
    if not isinstance(other, torch.Tensor):
        raise TypeError(f"QTensor.type_as: expected a tensor, got {type(other).__name__}")
    if other.is_floating_point() or other.is_complex():
        return self.dequantize().type_as(other)
    return to_dtype(self, other.dtype, (), {}, f"QTensor.type_as(a {other.dtype} tensor)")


def _shortcut(name: str, dtype: torch.dtype) -> Callable:
    def method(self: Any, memory_format: torch.memory_format = torch.preserve_format) -> Any:
        return to_dtype(self, dtype, (dtype,), {"memory_format": memory_format}, f"QTensor.{name}()")
    method.__name__ = name
    cast = dtype.is_floating_point or dtype.is_complex
    method.__doc__ = f"``to({dtype})``: " + ("the dequantized values cast." if cast else "refused (it would truncate).")
    return method


def _to(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Move to a device (none named: this one); with a float dtype (or a tensor to match), the dequantized values
    converted to it (an explicit request for float: no warning); other dtypes: ``to_dtype``."""
    copy = bool(kwargs.pop("copy", False))
    try:
        dev, dtype, _, fmt = torch._C._nn._parse_to(*args, **kwargs)
        grid = None
    except TypeError:  # lowbit's name of a grid, which torch's parser refuses ("invalid combination of arguments")
        grid = kwargs.get("dtype") if isinstance(kwargs.get("dtype"), QDtype) else next(
            (a for a in args if isinstance(a, QDtype)), None)
        if grid is None:
            raise
    if grid is not None:  # (checked outside the handler: the error is not chained to the parser's refusal)
        _own_grid(self, grid, "to")
        return self.to(*(a for a in args if a is not grid), copy=copy,
                       **{k: v for k, v in kwargs.items() if k != "dtype"})
    if dtype is not None:
        return to_dtype(self, dtype, args, dict(kwargs, copy=copy))
    dev = self.device if dev is None else dev  # (was the CPU: qt.to(memory_format=...) moved a CUDA QTensor)
    q = self.int_repr()
    q = q.to(dev, copy=copy) if fmt is None else q.to(dev, copy=copy, memory_format=fmt)
    return type(self)(q, self.scale.to(dev), self.zero_point.to(dev), self.qdtype, self.axis)


def _repr(self: Any) -> str:
    """Shape, dtype, grid and device, never the codes; meta qparams hold no values: ``scale=?`` (it read them)."""
    scale, zp, axis = self.scale, self.zero_point, self.axis
    meta = scale.device.type == "meta"
    if axis is None:
        grid = "scale=?, zero_point=?" if meta else f"scale={float(scale):.6g}, zero_point={int(zp)}"
    else:
        n = scale.numel()
        grid = f"axis={axis}, scales=" + (f"?({n})" if meta else f"{scale.tolist()[:4]}{'...' if n > 4 else ''}")
    return f"QTensor(shape={tuple(self.shape)}, dtype={self.qdtype!r}, {grid}, device={self.device})"


def _format(self: Any, spec: str) -> str:
    """``format(qt, spec)`` / f-strings: ``str(qt)`` for an empty spec (it was the dequantized float tensor's repr, which
    reads as a float tensor); a 0-d QTensor formats its value; other specs are refused, as torch's."""
    if not spec:
        return str(self)
    if self.dim() == 0 and self.device.type != "meta":
        return format(self.dequantize().item(), spec)
    raise TypeError(f"unsupported format string {spec!r} passed to QTensor.__format__ (a {self.dim()}-d QTensor)")


def _requires_grad_(self: Any, requires_grad: bool = True) -> Any:
    """``requires_grad_(False)`` is a no-op returning the QTensor (torch's quantized tensors: the same); ``True`` is
    refused, a ``TypeError`` as the in-place methods: integer codes hold no gradient (torch: "only Tensors of floating
    point dtype can require gradients")."""
    if requires_grad:
        raise TypeError("QTensor.requires_grad_(True): in-place ops are not supported on a QTensor, and its integer "
                        "codes cannot require gradients; use qt.dequantize().requires_grad_() (or fake quantization)")
    return self


def _share_memory_(self: Any) -> Any:
    """Move the codes and qparams into shared memory (values unchanged) and return the QTensor, as torch's."""
    for t in (self.int_repr(), self.scale, self.zero_point):
        t.share_memory_()
    return self


def install(cls: type) -> None:
    """Give ``cls`` (``QTensor``) ``to``, ``cpu``, ``cuda``, ``type``, ``type_as``, the dtype shortcuts, ``__repr__``,
    ``__format__``, ``requires_grad_`` and ``share_memory_``."""
    cls.to = _to  # type: ignore[attr-defined]
    cls.cpu = lambda self: self.to("cpu")  # type: ignore[attr-defined]
    cls.cuda = lambda self: self.to("cuda")  # type: ignore[attr-defined]
    cls.type = _type  # type: ignore[attr-defined]
    cls.type_as = _type_as  # type: ignore[attr-defined]
    for name, dtype in _SHORTCUTS.items():
        setattr(cls, name, _shortcut(name, dtype))
    cls.__repr__ = _repr  # type: ignore[method-assign]
    cls.__format__ = _format  # type: ignore[method-assign]
    cls.requires_grad_ = _requires_grad_  # type: ignore[attr-defined]
    cls.share_memory_ = _share_memory_  # type: ignore[attr-defined]
    # the DLPack protocol gives the dequantized values (float32): torch.tensor(qt) / torch.as_tensor(qt) /
    # torch.from_dlpack(qt) read the values as np.asarray(qt) does (torch.tensor(qt) walked the QTensor as a nested
    # sequence and failed at its 0-d elements: "len() of a 0-d tensor"); a QTensor comes back only from qt.clone()
    cls.__dlpack__ = lambda self, *args, **kwargs: self.dequantize().__dlpack__(*args, **kwargs)  # type: ignore
    cls.__dlpack_device__ = lambda self: self.int_repr().__dlpack_device__()  # type: ignore[attr-defined]
