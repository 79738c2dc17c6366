"""``QConfigMapping``: which ``QConfig`` applies to which module (global < exact type < regex < name).

For a module named ``name`` of type ``T`` whose parent resolved to ``inherited``::

    qconfig(name, T) = module_name[name]                     if name was set explicitly
                     = first regex r (in registration order) with r.fullmatch(name)
                     = object_type[T]                         (exact type, subclasses not matched)
                     = inherited                              (the parent's; the root inherits the global)

``resolution="exact"`` is lucid's legacy lookup: name, else exact type, else global. Graph mode adds torch.ao's
call-order key above all of these (``set_module_name_object_type_order``: the i-th call of a function or module type
in a module, counted in the traced graph).
"""

from __future__ import annotations

import difflib
import re
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .config import QConfig, _check_qconfig, _value_repr

__all__ = ["QConfigMapping"]

_DICT_KEYS = ("", "object_type", "module_name", "module_name_regex", "module_name_object_type_order")
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
        self.module_name_object_type_order_qconfigs: dict[tuple[str, type | Callable, int], QConfig | None] = {}
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

    def set_object_type(self, object_type: type | Callable | str, qconfig: QConfig | None) -> QConfigMapping:
        """Modules of exactly ``object_type`` (a class; functions such as ``F.relu`` for graph mode; for graph mode
        also a ``torch.Tensor`` method name, torch.ao's key of a method call: ``"add"`` sets ``x.add(y)``, which
        otherwise follows ``torch.add``'s setting, ``"add_"`` sets ``x.add_(y)``)."""
        if isinstance(object_type, str):
            if object_type.startswith("_") or not callable(getattr(torch.Tensor, object_type, None)):
                raise TypeError(
                    f"QConfigMapping.set_object_type: object_type={object_type!r} is no torch.Tensor method name "
                    "(a string keys a method call such as x.add(y) in graph mode; modules are keyed by class, "
                    "e.g. nn.Linear)")
        elif not isinstance(object_type, (type, types.FunctionType, types.BuiltinFunctionType)) or (
                isinstance(object_type, type) and not issubclass(object_type, torch.nn.Module)):  # (int: matched nothing)
            raise TypeError(
                f"QConfigMapping.set_object_type: object_type={object_type!r} must be a module class "
                "(e.g. nn.Linear), a function or a torch.Tensor method name"
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

    def set_module_name_object_type_order(self, module_name: str, object_type: type | Callable, index: int,
                                          qconfig: QConfig | None) -> QConfigMapping:
        """Graph mode only (torch.ao's call-order key, above every other tier): the ``index``-th call (from 0, in the
        traced graph's order) of the function ``object_type`` traced in the ``forward`` of the module at
        ``module_name``, or of the modules of exactly type ``object_type`` whose path's parent is ``module_name`` (as
        torch.ao counts them: by path, wherever the call is written). Functions count by the
        traced target (``operator.add`` for ``a + b``, ``torch.add`` for ``torch.add(a, b)``); method calls
        (``x.add(y)``) do not count. Eager ``prepare`` refuses a mapping with such entries (use ``set_module_name``)."""
        where = "QConfigMapping.set_module_name_object_type_order"
        if not isinstance(module_name, str):
            raise TypeError(f"{where}: module_name={module_name!r} must be a str (a dotted path, '' for the root)")
        if isinstance(object_type, str) and callable(getattr(torch.Tensor, object_type, None)):
            raise TypeError(f"{where}: object_type={object_type!r} is a method call, which graph mode does not count "
                            f"(nor does torch.ao's: such an entry never matched); key it by set_object_type("
                            f"{object_type!r}, ...) or write the call as a function (torch.{object_type}(x, ...))")
        if not isinstance(object_type, (type, types.FunctionType, types.BuiltinFunctionType)):
            raise TypeError(f"{where}: object_type={object_type!r} must be a module class or a function")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"{where}: index={index!r} must be an int >= 0 (0: the first call)")
        if self.resolution == "exact":
            raise ValueError(f"{where}: cannot be used with resolution='exact' (exact names and types only)")
        self.module_name_object_type_order_qconfigs[(module_name, object_type, index)] = _check_qconfig(qconfig, where)
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
        """Raise ``ValueError`` (``strict=False``: warn) for a ``set_module_name`` or
        ``set_module_name_object_type_order`` module name that names none of ``names`` (the model's module paths: a
        typo would otherwise be ignored silently); warn for a regex matching none."""
        names = set(names)
        order = dict.fromkeys(k[0] for k in self.module_name_object_type_order_qconfigs)
        for setter, keys in (("set_module_name", self.module_name_qconfigs), ("set_module_name_object_type_order", order)):
            missing = [n for n in keys if n not in names]
            if not missing:
                continue
            hints = {n: difflib.get_close_matches(n, names, n=3) for n in missing}
            did = "; ".join(f"{n!r}: did you mean {h}?" for n, h in hints.items() if h)
            msg = (f"{where}: QConfigMapping.{setter} names no module of this model: {missing}"
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
            from .defaults import get_default_qconfig_mapping  # (defaults builds on this module)

            return cls.from_qconfig(default) if default is not None else get_default_qconfig_mapping()
        if isinstance(qconfig, QConfigMapping):
            return qconfig
        if isinstance(qconfig, QConfig):
            return cls().set_global(qconfig)
        if isinstance(qconfig, dict):
            return cls._from_dict(qconfig)
        if type(qconfig).__module__.startswith("torch.ao."):  # (its repr ran to dozens of lines before the reason)
            raise TypeError(f"qconfig is torch.ao's {type(qconfig).__name__}; lowbit takes its own: "
                            f"lowbit.{type(qconfig).__name__} / lowbit.get_default_qconfig_mapping() (None, a QConfig, "
                            "a QConfigMapping or a qconfig dict)")
        raise TypeError(
            f"qconfig={qconfig!r} must be None, a QConfig, a QConfigMapping or a qconfig dict"
        )

    def to_dict(self) -> dict[str, Any]:
        """torch.ao's ``QConfigMapping.to_dict()`` layout: ``{"": global, "object_type": [(T, qc)],
        "module_name_regex": [(pattern, qc)], "module_name": [(name, qc)],
        "module_name_object_type_order": [(name, T, index, qc)]}`` (``from_dict`` reads it back)."""
        return {"": self.global_qconfig, "object_type": list(self.object_type_qconfigs.items()),
                "module_name_regex": list(self.module_name_regex_qconfigs.items()),
                "module_name": list(self.module_name_qconfigs.items()),
                "module_name_object_type_order": [(*k, v) for k, v in self.module_name_object_type_order_qconfigs.items()]}

    @classmethod
    def from_dict(cls, qconfig_dict: dict[Any, Any]) -> QConfigMapping:
        """A mapping from torch.ao's ``qconfig_dict`` / ``to_dict()`` layout (or a ``{T or name: qc}`` spec).

        >>> import torch.nn as nn, lowbit as Q
        >>> m = Q.QConfigMapping().set_global(Q.get_default_qconfig()).set_object_type(nn.Linear, None)
        >>> Q.QConfigMapping.from_dict(m.to_dict()).object_type_qconfigs
        {<class 'torch.nn.modules.linear.Linear'>: None}
        """
        if not isinstance(qconfig_dict, dict):
            raise TypeError(f"QConfigMapping.from_dict: expects a dict, got {type(qconfig_dict).__name__}")
        return cls._from_dict(qconfig_dict)

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
                          "module_name_regex": m.set_module_name_regex,
                          "module_name_object_type_order": m.set_module_name_object_type_order}[key]
                size = 4 if key == "module_name_object_type_order" else 2
                what = "(module name, object type, index, qconfig) tuple" if size == 4 else "(key, qconfig) pair"
                if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
                    raise TypeError(f"qconfig dict [{key!r}]: value={value!r} must be a list of {what}s")
                for entry in value:
                    if not (isinstance(entry, (tuple, list)) and len(entry) == size):
                        raise ValueError(f"qconfig dict [{key!r}]: entry {entry!r} must be a {what}")
                    setter(*entry)
            elif isinstance(key, str):
                if isinstance(value, (list, tuple, dict)) and not isinstance(value, QConfig):  # a misspelt tier
                    hint = difflib.get_close_matches(key, _DICT_KEYS[1:], n=1)
                    raise ValueError(f"qconfig dict key {key!r} is no tier of {_DICT_KEYS}"
                                     + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                     + f"; as a module name it would map to a QConfig or None, not {type(value).__name__}")
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
        for (name, obj, index), qc in self.module_name_object_type_order_qconfigs.items():
            lines.append(f"  module_name_object_type_order[{name!r}, {_value_repr(obj)}, {index}]: {qc!r}")
        head = "QConfigMapping(\n" if self.resolution == "hierarchical" else "QConfigMapping(resolution='exact',\n"
        return head + "\n".join(lines) + "\n)"
