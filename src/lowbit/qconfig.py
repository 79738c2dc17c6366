"""QConfig, QConfigMapping and the default recipes: *how* and *where* to quantize.

A ``QConfig(activation, weight)`` pairs two zero-arg factories (``Observer.with_args(...)`` or
``FakeQuantize.with_args(...)``); ``prepare`` calls each once per insertion site, so no two
layers share observer state. A ``QConfigMapping`` says which ``QConfig`` applies to which module.
For a module named ``name`` of type ``T`` whose parent resolved to ``inherited``::

    qconfig(name, T) = module_name[name]                     if name was set explicitly
                     = first regex r (in registration order) with r.fullmatch(name)
                     = object_type[T]                         (exact type, subclasses not matched)
                     = inherited                              (the parent's; the root inherits the global)

A ``None`` at any tier is an explicit setting: it excludes the module (and, through inheritance,
its children unless they match a setting of their own).

``QConfigMapping(resolution="exact")`` is lucid's legacy lookup instead: ``module_name[name]``, else
``object_type[T]``, else the global setting — no parent inheritance (``set_module_name("encoder",
qc)`` does not reach ``encoder.fc``), no regexes, and ``prepare`` ignores ``.qconfig`` attributes.

>>> import torch.nn as nn, lowbit as Q
>>> m = (Q.QConfigMapping().set_global(Q.get_default_qconfig())
...      .set_object_type(nn.Linear, Q.get_minmax_qconfig())
...      .set_module_name("head", None))
>>> m.get_qconfig(nn.Linear, "encoder.fc") is m.object_type_qconfigs[nn.Linear]
True
>>> m.get_qconfig(nn.Linear, "head") is None
True
>>> type(Q.get_default_qconfig().activation()).__name__
'HistogramObserver'

Departures from ``torch.ao``: regexes must match the whole name (``re.fullmatch``; torch uses
``re.match``, a prefix match); children inherit their parent's resolved setting (torch's eager
``propagate_qconfig_`` does this, its ``QConfigMapping`` lookup does not); and a ``QConfig`` built
from an observer *instance* or a factory that needs arguments raises ``TypeError`` at construction.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from .fake_quant import FakeQuantize
from .observer.fixed import NoopObserver, PlaceholderObserver
from .observer.histogram import HistogramObserver
from .observer.minmax import MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver
from .qscheme import (QDtype, as_qdtype, per_channel_affine, per_channel_affine_float_qparams, per_channel_symmetric,
                      per_tensor_affine, qint8, quint4, quint8)

__all__ = [
    "QConfig",
    "QConfigMapping",
    "get_default_qconfig",
    "get_default_qat_qconfig",
    "get_default_qconfig_mapping",
    "get_default_qat_qconfig_mapping",
    "get_minmax_qconfig",
    "get_dynamic_qconfig",
    "get_lsq_qat_qconfig",
    "get_fused_qat_qconfig",
    "get_embedding_qconfig",
    "get_embedding_qat_qconfig",
    "qconfig_equals",
]

Factory = Callable[[], nn.Module]


def _check_factory(value: Any, field: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a zero-arg callable (not a built module)."""
    if isinstance(value, nn.Module):
        raise TypeError(
            f"QConfig {field}={type(value).__name__}(...) is an observer instance; pass a factory such as "
            f"{type(value).__name__}.with_args(...) so every insertion site gets its own observer"
        )
    if not callable(value):
        raise TypeError(f"QConfig {field}={value!r} must be a zero-arg factory (e.g. MinMaxObserver.with_args())")
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


_DICT_KEYS = ("", "object_type", "module_name", "module_name_regex")
_RESOLUTIONS = ("hierarchical", "exact")


class QConfigMapping:
    """Which ``QConfig`` applies to which module: global < exact type < first regex < module name.

    Setters are chainable and accept ``None`` (exclude). Setting a key again replaces its value
    (a regex keeps its original position in the match order). ``resolution="exact"`` (keyword):
    lucid's lookup, module name > exact type > global, with no inheritance and no regexes.

    >>> import torch.nn as nn, lowbit as Q
    >>> qc = Q.get_default_qconfig()
    >>> m = Q.QConfigMapping().set_module_name_regex(r"blocks\\.\\d+\\.attn", None).set_global(qc)
    >>> m.resolve("blocks.3.attn", nn.Linear, qc) is None, m.resolve("blocks.3.mlp", nn.Linear, None)
    (True, None)
    >>> e = Q.QConfigMapping(resolution="exact").set_global(qc).set_module_name("encoder", None)
    >>> e.resolve("encoder", nn.Sequential, qc) is None, e.resolve("encoder.fc", nn.Linear, None) is qc
    (True, True)
    """

    def __init__(self, *, resolution: str = "hierarchical") -> None:
        if not isinstance(resolution, str) or resolution not in _RESOLUTIONS:
            raise ValueError(f"QConfigMapping: resolution={resolution!r} must be one of {_RESOLUTIONS}")
        self._resolution = resolution
        self.global_qconfig: QConfig | None = None
        self.object_type_qconfigs: dict[type | Callable, QConfig | None] = {}
        self.module_name_regex_qconfigs: dict[str, QConfig | None] = {}
        self.module_name_qconfigs: dict[str, QConfig | None] = {}
        self._regex: dict[str, re.Pattern[str]] = {}

    @property
    def resolution(self) -> str:
        """``"hierarchical"`` (default) or ``"exact"`` (lucid's legacy lookup); fixed at construction."""
        return self._resolution

    # ---- setters (chainable) ----
    def set_global(self, qconfig: QConfig | None) -> QConfigMapping:
        """The root's setting, inherited by every module with no setting of its own."""
        self.global_qconfig = _check_qconfig(qconfig, "QConfigMapping.set_global")
        return self

    def set_object_type(self, object_type: type | Callable, qconfig: QConfig | None) -> QConfigMapping:
        """Modules of exactly ``object_type`` (a class; functions such as ``F.relu`` for graph mode)."""
        if not isinstance(object_type, (type, types.FunctionType, types.BuiltinFunctionType)):
            raise TypeError(
                f"QConfigMapping.set_object_type: object_type={object_type!r} must be a module class "
                "(e.g. nn.Linear) or a function"
            )
        self.object_type_qconfigs[object_type] = _check_qconfig(qconfig, "QConfigMapping.set_object_type")
        return self

    def set_module_name(self, module_name: str, qconfig: QConfig | None) -> QConfigMapping:
        """The module at exactly this dotted path (``""`` is the root); beats every other tier."""
        if not isinstance(module_name, str):
            raise TypeError(f"QConfigMapping.set_module_name: module_name={module_name!r} must be a str")
        self.module_name_qconfigs[module_name] = _check_qconfig(qconfig, "QConfigMapping.set_module_name")
        return self

    def set_module_name_regex(self, pattern: str, qconfig: QConfig | None) -> QConfigMapping:
        """Modules whose full dotted name ``re.fullmatch``-es ``pattern``; first registered wins."""
        if not isinstance(pattern, str):
            raise TypeError(f"QConfigMapping.set_module_name_regex: pattern={pattern!r} must be a str")
        if self.resolution == "exact":
            raise ValueError(f"QConfigMapping.set_module_name_regex: pattern={pattern!r} cannot be used with "
                             "resolution='exact' (exact names and types only)")
        try:
            compiled = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"QConfigMapping.set_module_name_regex: pattern={pattern!r} is not a valid regex: {err}") from None
        self.module_name_regex_qconfigs[pattern] = _check_qconfig(qconfig, "QConfigMapping.set_module_name_regex")
        self._regex[pattern] = compiled
        return self

    # ---- lookup ----
    def resolve(self, module_name: str, module_type: type | Callable, inherited: QConfig | None) -> QConfig | None:
        """This module's own explicit setting, else ``inherited`` (its parent's resolved qconfig).

        With ``resolution="exact"``, ``inherited`` is ignored: the fallback is the global setting.
        """
        if self.resolution == "exact":
            inherited = self.global_qconfig
        if module_name in self.module_name_qconfigs:
            return self.module_name_qconfigs[module_name]
        for pattern, qconfig in self.module_name_regex_qconfigs.items():
            if self._regex[pattern].fullmatch(module_name):
                return qconfig
        if module_type in self.object_type_qconfigs:
            return self.object_type_qconfigs[module_type]
        return inherited

    def check_module_names(self, names: Iterable[str], where: str, strict: bool = True) -> None:
        """Raise ``ValueError`` (``strict=False``: warn) for a ``set_module_name`` key that names none of
        ``names`` (the model's module paths: a typo would otherwise be ignored silently); warn for a
        regex matching none."""
        names = set(names)
        missing = [n for n in self.module_name_qconfigs if n not in names]
        if missing:
            hints = {n: difflib.get_close_matches(n, names, n=3) for n in missing}
            did = "; ".join(f"{n!r}: did you mean {h}?" for n, h in hints.items() if h)
            msg = (f"{where}: QConfigMapping.set_module_name names no module of this model: {missing}"
                   + (f" ({did})" if did else "") + "; module names are dotted paths as in named_modules()")
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, stacklevel=3)
        for pattern, regex in self._regex.items():
            if not any(regex.fullmatch(n) for n in names):
                warnings.warn(f"{where}: QConfigMapping.set_module_name_regex({pattern!r}) matches no module of "
                              "this model", stacklevel=3)

    def get_qconfig(self, module_type: type | Callable, module_name: str) -> QConfig | None:
        """``resolve`` with the global setting as the inherited one (no parent walk)."""
        return self.resolve(module_name, module_type, self.global_qconfig)

    # ---- construction from user input ----
    @classmethod
    def from_qconfig(cls, qconfig: Any, default: QConfigMapping | QConfig | None = None) -> QConfigMapping:
        """Normalise ``None | QConfig | QConfigMapping | dict`` into a mapping.

        ``None`` gives ``default`` (itself normalised; ``None`` there means the default static
        mapping). A ``QConfig`` becomes the global setting. A dict may be torch.ao's
        ``qconfig_dict`` (``{"": qc, "object_type": [(T, qc)], "module_name": [(name, qc)],
        "module_name_regex": [(pattern, qc)]}``) or a ``qconfig_spec`` (``{nn.Linear: qc, "fc1": qc}``).
        """
        if qconfig is None:
            return cls.from_qconfig(default) if default is not None else get_default_qconfig_mapping()
        if isinstance(qconfig, QConfigMapping):
            return qconfig
        if isinstance(qconfig, QConfig):
            return cls().set_global(qconfig)
        if isinstance(qconfig, dict):
            return cls._from_dict(qconfig)
        raise TypeError(
            f"qconfig={qconfig!r} must be None, a QConfig, a QConfigMapping or a qconfig dict"
        )

    @classmethod
    def _from_dict(cls, d: dict[Any, Any]) -> QConfigMapping:
        m = cls()
        if "" in d:
            m.set_global(d[""])
        for key, value in d.items():
            if key == "":
                continue
            if key in _DICT_KEYS:
                setter = {"object_type": m.set_object_type, "module_name": m.set_module_name,
                          "module_name_regex": m.set_module_name_regex}[key]
                for entry in value:
                    if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                        raise ValueError(f"qconfig dict [{key!r}]: entry {entry!r} must be a (key, qconfig) pair")
                    setter(*entry)
            elif isinstance(key, str):
                m.set_module_name(key, value)
            elif isinstance(key, type):
                m.set_object_type(key, value)
            else:
                raise TypeError(f"qconfig dict key {key!r} must be a module class, a module name or one of {_DICT_KEYS}")
        return m

    def __repr__(self) -> str:
        lines = [f"  global: {self.global_qconfig!r}"]
        tiers = (("object_type", self.object_type_qconfigs), ("module_name_regex", self.module_name_regex_qconfigs),
                 ("module_name", self.module_name_qconfigs))
        for tier, entries in tiers:
            for key, qc in entries.items():
                lines.append(f"  {tier}[{_value_repr(key) if not isinstance(key, str) else repr(key)}]: {qc!r}")
        head = "QConfigMapping(\n" if self.resolution == "hierarchical" else "QConfigMapping(resolution='exact',\n"
        return head + "\n".join(lines) + "\n)"


# ---- recipes ----
def get_default_qconfig() -> QConfig:
    """Static PTQ: histogram-calibrated per-tensor affine quint8 activations, per-channel symmetric qint8 weights."""
    return QConfig(
        activation=HistogramObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
    )


def get_default_qat_qconfig() -> QConfig:
    """QAT: the static recipe's grids behind ``FakeQuantize``.

    Activations use a moving-average min/max (c = 0.01). Weights use the seeds' cumulative
    ``PerChannelMinMaxObserver`` (torch uses a moving-average per-channel observer here).
    """
    return QConfig(
        activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_affine,
                                          qdtype=quint8),
        weight=FakeQuantize.with_args(observer=PerChannelMinMaxObserver, ch_axis=0,
                                      qscheme=per_channel_symmetric, qdtype=qint8),
    )


def get_minmax_qconfig() -> QConfig:
    """Static PTQ with plain min/max activations: the recipe that matches ``torch.ao`` numerics exactly."""
    return QConfig(
        activation=MinMaxObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
    )


def get_lsq_qat_qconfig() -> QConfig:
    """QAT with learned step sizes (LSQ): ``LearnableFakeQuantize`` with gradient scaling on both sides.

    Activations per-tensor affine quint8 (moving-average min/max initialises scale and zero point),
    weights per-channel symmetric qint8 (min/max initialises the scales). The qparams follow the
    observers until ``model.apply(lowbit.fake_quant_learnable.enable_param_learning)``.

    >>> import lowbit as Q
    >>> type(Q.get_lsq_qat_qconfig().weight()).__name__
    'LearnableFakeQuantize'
    """
    from .fake_quant_learnable import LearnableFakeQuantize

    return QConfig(
        activation=LearnableFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_affine,
                                                   qdtype=quint8, use_grad_scaling=True),
        weight=LearnableFakeQuantize.with_args(observer=PerChannelMinMaxObserver, ch_axis=0,
                                               qscheme=per_channel_symmetric, qdtype=qint8, use_grad_scaling=True),
    )


def get_fused_qat_qconfig() -> QConfig:
    """QAT on torch's fused observe + fake-quant kernel (``FusedMovingAvgObsFakeQuantize``), as torch.ao's
    default fused recipe: moving-average per-tensor affine quint8 activations, moving-average per-channel
    symmetric qint8 weights (c = 0.01).

    >>> import lowbit as Q
    >>> type(Q.get_fused_qat_qconfig().activation()).__name__
    'FusedMovingAvgObsFakeQuantize'
    """
    from .fake_quant_fused import FusedMovingAvgObsFakeQuantize
    from .observer.minmax import MovingAveragePerChannelMinMaxObserver

    return QConfig(
        activation=FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver,
                                                           qscheme=per_tensor_affine, qdtype=quint8),
        weight=FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0,
                                                       qscheme=per_channel_symmetric, qdtype=qint8),
    )


def get_dynamic_qconfig(dtype: QDtype | str | torch.dtype = qint8) -> QConfig:
    """Dynamic quantization: activations quantized per batch at runtime, weights ahead of time.

    ``dtype=qint8``: quint8 activations (``PlaceholderObserver(is_dynamic=True)``: the range is
    measured on each batch) and per-channel symmetric qint8 weights (torch's default dynamic recipe
    is per tensor). ``dtype=torch.float16``: float16 weight storage, float activations — torch's
    ``float16_dynamic_qconfig`` (``PlaceholderObserver`` with ``qdtype=torch.float16`` on both sides);
    ``quantize_dynamic`` with it builds the same modules as ``quantize_dynamic(..., dtype=torch.float16)``.

    >>> import torch, lowbit as Q
    >>> qc = Q.get_dynamic_qconfig(torch.float16)
    >>> qc.weight().qdtype, qc.activation().is_dynamic
    (torch.float16, True)
    """
    if dtype in (torch.float16, "float16"):
        return QConfig(
            activation=PlaceholderObserver.with_args(qdtype=torch.float16, is_dynamic=True),
            weight=PlaceholderObserver.with_args(qdtype=torch.float16),
        )
    if as_qdtype(dtype) != qint8:
        raise ValueError(f"get_dynamic_qconfig: dtype={dtype!r} is not supported; use qint8 or torch.float16")
    return QConfig(
        activation=PlaceholderObserver.with_args(qdtype=quint8, is_dynamic=True),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
    )


def _embedding_bits(fn: str, bits: Any) -> QDtype:
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ValueError(f"{fn}: bits={bits!r} must be 8 or 4")
    return quint8 if bits == 8 else quint4


def get_embedding_qconfig(bits: int = 8, float_qparams: bool = False) -> QConfig:
    """Weight-only embeddings, as ``torch.ao``'s ``float_qparams_weight_only_qconfig``: one grid per table row.

    Weights: per-row (``ch_axis=0``) affine min/max on ``quint8`` (``bits=8``) or ``quint4`` (``bits=4``,
    packed two per byte by ``nnq.Embedding``); the output stays float, so the activation entry is a
    ``NoopObserver`` (never inserted for embeddings). By default the zero point is an integer code, as
    everywhere else in lowbit (the range widened to include 0); ``float_qparams=True`` is torch.ao's
    recipe exactly: ``per_channel_affine_float_qparams``, ``s = (max - min) / (qmax - qmin)``, float
    ``z = -min / s`` (same codes and outputs as torch.ao's quantized Embedding/EmbeddingBag).

    >>> import torch, lowbit as Q
    >>> emb = torch.nn.Sequential(torch.nn.Embedding(10, 8))
    >>> emb[0].qconfig = Q.get_embedding_qconfig(4)
    >>> Q.convert(Q.prepare(emb))[0]
    Embedding(10, 8, qdtype=lowbit.quint4, qscheme=per_row_affine)
    """
    qdtype = _embedding_bits("get_embedding_qconfig", bits)
    qscheme = per_channel_affine_float_qparams if float_qparams else per_channel_affine
    return QConfig(
        activation=NoopObserver.with_args(),
        weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=qscheme, qdtype=qdtype),
    )


def get_embedding_qat_qconfig(bits: int = 8, float_qparams: bool = False) -> QConfig:
    """QAT embeddings (``nn.qat.Embedding`` / ``EmbeddingBag``): the table fake-quantized per row on every step.

    As ``torch.ao``'s ``default_embedding_qat_qconfig``: a ``FakeQuantize`` over a memoryless
    (``averaging_constant=1``) per-row moving-average min/max, so each step's grid is the current
    table's; ``bits`` and ``float_qparams`` as in ``get_embedding_qconfig``.

    >>> import lowbit as Q
    >>> fq = Q.get_embedding_qat_qconfig(4, float_qparams=True).weight()
    >>> fq.qdtype, fq.qscheme.value, fq.zero_point.dtype
    (lowbit.quint4, 'per_channel_affine_float_qparams', torch.float32)
    """
    from .observer.minmax import MovingAveragePerChannelMinMaxObserver

    qdtype = _embedding_bits("get_embedding_qat_qconfig", bits)
    qscheme = per_channel_affine_float_qparams if float_qparams else per_channel_affine
    return QConfig(
        activation=NoopObserver.with_args(),
        weight=FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0, qscheme=qscheme,
                                      qdtype=qdtype, averaging_constant=1.0),
    )


def get_default_qconfig_mapping() -> QConfigMapping:
    """``get_default_qconfig()`` as the global setting (nothing else)."""
    return QConfigMapping().set_global(get_default_qconfig())


def get_default_qat_qconfig_mapping() -> QConfigMapping:
    """``get_default_qat_qconfig()`` as the global setting (nothing else)."""
    return QConfigMapping().set_global(get_default_qat_qconfig())
