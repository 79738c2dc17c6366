"""``QConfig``: a pair of zero-arg observer factories, and ``qconfig_equals`` (equality by value).

``QConfig(activation, weight)``: ``prepare`` calls each factory once per insertion site, so no two
layers share observer state. A factory is ``Observer.with_args(...)`` or ``FakeQuantize.with_args(...)``;
an observer *instance* or a factory that needs arguments raises ``TypeError`` at construction.

>>> import lowbit as Q
>>> act, w = Q.QConfig(Q.MinMaxObserver.with_args(), Q.PerChannelMinMaxObserver.with_args(ch_axis=0))
>>> type(act()).__name__, w().ch_axis
('MinMaxObserver', 0)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..fake_quant import FakeQuantize
from ..observer.base import ObserverBase

__all__ = ["QConfig", "qconfig_equals"]

Factory = Callable[[], nn.Module]


_AO_KEYWORDS = {"dtype": "qdtype=lowbit.quint8 (or qint8 ...)", "quant_min": "qdtype=lowbit.quint8.with_range(lo, hi)",
                "quant_max": "qdtype=lowbit.quint8.with_range(lo, hi)",
                "reduce_range": "qdtype=lowbit.quint8.with_range(0, 127) (the 7-bit grid)"}


def _ao_hint(msg: str) -> str:
    """The lowbit spelling of a torch.ao observer keyword an error message names ("" if none)."""
    return next((f"; lowbit writes {v}" for k, v in _AO_KEYWORDS.items() if f"argument '{k}'" in msg), "")


def _check_factory(value: Any, field: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a zero-arg callable (not a built module)."""
    if isinstance(value, nn.Module):
        raise TypeError(
            f"QConfig {field}={type(value).__name__}(...) is an observer instance; pass a factory such as "
            f"{type(value).__name__}.with_args(...) so every insertion site gets its own observer"
        )
    if not callable(value):
        raise TypeError(f"QConfig {field}={value!r} must be a zero-arg factory (e.g. MinMaxObserver.with_args())")
    func, keywords = getattr(value, "func", None), getattr(value, "keywords", None)
    if func is not None and isinstance(keywords, dict):  # a with_args factory: its keywords must fit the class
        try:
            inspect.signature(func).bind_partial(*getattr(value, "args", ()), **keywords)
        except TypeError as err:
            raise TypeError(f"QConfig {field}={_factory_repr(value)}: {err}{_ao_hint(str(err))}") from None
        except ValueError:  # no signature to check
            pass
    try:
        sig = inspect.signature(value)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        sig.bind(**dict.fromkeys(getattr(value, "callable_args", {})))  # with_callable_args supplies these
    except TypeError as err:
        raise TypeError(f"QConfig {field}={_factory_repr(value)} cannot be called without arguments: {err}") from None


def _value_repr(v: Any) -> str:
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, functools.partial):
        return _factory_repr(v)
    return repr(v).removeprefix("lowbit.")


def _factory_repr(f: Any) -> str:
    """``HistogramObserver.with_args(qscheme=per_tensor_affine, ...)`` for a partial, else the name."""
    if isinstance(f, functools.partial):
        args = [_value_repr(a) for a in f.args] + [f"{k}={_value_repr(v)}" for k, v in f.keywords.items()]
        lazy = getattr(f, "callable_args", {})
        tail = f".with_callable_args({', '.join(f'{k}={_value_repr(v)}' for k, v in lazy.items())})" if lazy else ""
        return f"{_value_repr(f.func)}.with_args({', '.join(args)}){tail}"
    return _value_repr(f)


class _QConfigFields(NamedTuple):
    activation: Factory
    weight: Factory


class QConfig(_QConfigFields):
    """``(activation, weight)`` zero-arg factories; immutable, unpacks as ``act, w = qconfig``.

    >>> import lowbit as Q
    >>> qc = Q.QConfig(Q.MinMaxObserver.with_args(), Q.PerChannelMinMaxObserver.with_args(ch_axis=0))
    >>> qc
    QConfig(activation=MinMaxObserver.with_args(), weight=PerChannelMinMaxObserver.with_args(ch_axis=0))
    >>> Q.QConfig(Q.MinMaxObserver(), Q.MinMaxObserver)
    Traceback (most recent call last):
    ...
    TypeError: QConfig activation=MinMaxObserver(...) is an observer instance; pass a factory such as ...
    """

    __slots__ = ()

    def __new__(cls, activation: Factory, weight: Factory) -> QConfig:
        _check_factory(activation, "activation")
        _check_factory(weight, "weight")
        return super().__new__(cls, activation, weight)

    def __deepcopy__(self, memo: dict[int, Any]) -> QConfig:
        return self  # immutable recipe of stateless factories: a deep-copied model shares it

    def __repr__(self) -> str:
        return f"QConfig(activation={_factory_repr(self.activation)}, weight={_factory_repr(self.weight)})"


def build(qconfig: QConfig, field: str, where: str) -> Any:
    """``qconfig.activation()`` / ``qconfig.weight()`` (``field``), or its error naming ``where`` (the module) and
    the field; torch.ao's observer keywords that lowbit spells differently get the lowbit spelling."""
    try:
        built = getattr(qconfig, field)()
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: qconfig.{field}() failed: {e}{_ao_hint(str(e))}") from e
    kind = f"{type(built).__module__}.{type(built).__qualname__}"
    # refused: torch's classes (torch.ao's MinMaxObserver, an nn.Identity: prepare put it in, convert found no lowbit
    # grid and left the layer float, silently) and anything without calculate_qparams (a weight of 3: "'int' object is
    # not callable" at convert); a user's (or lowbit.algorithms') own observer module with calculate_qparams is kept
    if not isinstance(built, (ObserverBase, FakeQuantize)) and (
            kind.startswith("torch.") or not callable(getattr(built, "calculate_qparams", None))):
        raise TypeError(f"{where}: qconfig.{field}() built a {kind}, not a lowbit observer or FakeQuantize"
                        + ("; torch.ao's observers do not fit lowbit's workflows: use lowbit's of the same name "
                           f"(lowbit.{type(built).__name__})" if kind.startswith("torch.ao.") else ""))
    return built


def _check_qconfig(qconfig: Any, where: str) -> QConfig | None:
    if qconfig is None or isinstance(qconfig, QConfig):
        return qconfig
    raise TypeError(f"{where}: qconfig={qconfig!r} must be a lowbit QConfig or None")


def _flatten_factory(f: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``(callable, args, keywords)`` of a factory, nested ``partial``s merged (outer keywords win)."""
    args: tuple[Any, ...] = ()
    keywords: dict[str, Any] = {}
    while isinstance(f, functools.partial):
        lazy = {k: ("<callable>", fn) for k, fn in getattr(f, "callable_args", {}).items()}  # with_callable_args
        args, keywords = f.args + args, {**f.keywords, **lazy, **keywords}
        f = f.func
    return f, args, keywords


def _recipe_value_equals(a: Any, b: Any) -> bool:
    if isinstance(a, functools.partial) or isinstance(b, functools.partial):
        return _factory_equals(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a is b or bool(a == b)


def _factory_equals(a: Any, b: Any) -> bool:
    """Same callable and equal arguments after flattening; nested factories (``observer=``) compared alike."""
    fa, args_a, kw_a = _flatten_factory(a)
    fb, args_b, kw_b = _flatten_factory(b)
    if fa != fb or len(args_a) != len(args_b) or kw_a.keys() != kw_b.keys():
        return False
    return (all(_recipe_value_equals(x, y) for x, y in zip(args_a, args_b))
            and all(_recipe_value_equals(kw_a[k], kw_b[k]) for k in kw_a))


def qconfig_equals(q1: QConfig | None, q2: QConfig | None) -> bool:
    """Whether two qconfigs build the same observers: same classes and equal arguments.

    Factories compare by value, not identity (two ``with_args`` calls with the same arguments are
    equal; chained ``with_args`` compare as their merged arguments), as ``torch.ao``'s.

    >>> import lowbit as Q
    >>> a = Q.QConfig(Q.MinMaxObserver.with_args(qdtype=Q.quint8), Q.MinMaxObserver.with_args(qdtype=Q.qint8))
    >>> b = Q.QConfig(Q.MinMaxObserver.with_args().with_args(qdtype=Q.quint8), Q.MinMaxObserver.with_args(qdtype=Q.qint8))
    >>> Q.qconfig_equals(a, b), Q.qconfig_equals(a, None), Q.qconfig_equals(None, None)
    (True, False, True)
    """
    for q in (q1, q2):
        if q is not None and not isinstance(q, QConfig):
            raise TypeError(f"qconfig_equals: {q!r} is not a lowbit QConfig or None")
    if q1 is None or q2 is None:
        return q1 is q2
    return _factory_equals(q1.activation, q2.activation) and _factory_equals(q1.weight, q2.weight)
