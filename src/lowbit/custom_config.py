"""Custom configs of the workflows: user-supplied observed/quantized module classes and graph-mode options.

torch.ao's ``PrepareCustomConfig`` / ``ConvertCustomConfig`` / ``FuseCustomConfig`` (and the older
dict forms) with the same setters and ``from_dict``/``to_dict`` keys:

====================================================  ==============================================
``PrepareCustomConfig``                               effect (eager ``prepare`` and ``prepare_fx``)
====================================================  ==============================================
``set_float_to_observed_mapping(Float, Observed)``    a module of type ``Float`` with a qconfig becomes
                                                      ``Observed.from_float(mod)`` and gets an output
                                                      observer (``activation_post_process``)
``set_non_traceable_module_names([...])`` /           graph mode: these modules are leaves of the
``set_non_traceable_module_classes([...])``           trace and stay float (nothing inside is prepared)
``set_input_quantized_indexes([i, ...])``             graph mode: input ``i`` arrives as a ``QTensor``
                                                      after convert (no ``Quantize`` for it)
``set_output_quantized_indexes([i, ...])``            graph mode: output ``i`` is returned as a
                                                      ``QTensor`` (no ``DeQuantize`` for it)
``set_preserved_attributes(["attr", ...])``           these attributes of the model are kept on the
                                                      prepared (and converted) ``GraphModule``
====================================================  ==============================================

``ConvertCustomConfig.set_observed_to_quantized_mapping(Observed, Quantized)``: ``convert`` /
``convert_fx`` build ``Quantized.from_observed(observed_mod)`` (the observed module carries its
calibrated ``activation_post_process``). In graph mode the custom module is an int op: it
receives a ``QTensor`` and must return one (a single tensor). With ``quant_type="dynamic"``
(graph mode, torch.ao's dynamic custom modules) the key is a float module declared non-traceable:
``convert_fx`` swaps it for ``Quantized.from_observed(mod)``, float in and float out.

>>> from torch import nn
>>> class Observed(nn.Module):
...     @classmethod
...     def from_float(cls, mod): return cls()
>>> cfg = PrepareCustomConfig().set_float_to_observed_mapping(nn.Identity, Observed)
>>> cfg.set_non_traceable_module_names(["head"]).set_input_quantized_indexes([0]).to_dict()["input_quantized_idxs"]
[0]
>>> PrepareCustomConfig.from_dict(cfg.to_dict()).float_to_observed_mapping == {nn.Identity: Observed}
True
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["PrepareCustomConfig", "ConvertCustomConfig", "FuseCustomConfig", "from_observed_adapter",
           "check_module_types", "swap_float_to_observed"]

_STATIC = ("static", "qat")  # quant types lowbit's custom modules take part in


def _quant_type(quant_type: Any, where: str, allowed: tuple[str, ...] = _STATIC) -> str:
    name = getattr(quant_type, "name", quant_type)
    name = str(name).lower() if name is not None else "static"
    if name not in allowed:
        raise ValueError(f"{where}: quant_type={quant_type!r} is not supported; custom modules are static or QAT "
                         "(dynamic layers come from the dynamic mapping)")
    return name


def _classes(values: Any, where: str) -> list[type]:
    if not isinstance(values, (list, tuple, set)) or not all(isinstance(v, type) for v in values):
        raise TypeError(f"{where}: expects a list of module classes, got {values!r}")
    return list(values)


def _names(values: Any, where: str) -> list[str]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise TypeError(f"{where}: expects a list of str, got {values!r}")
    return list(values)


def _indexes(values: Any, where: str) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                        for v in values):
        raise TypeError(f"{where}: expects a list of non-negative int indexes, got {values!r}")
    return list(values)


class _Config:
    """``coerce``: what the workflow functions accept for a custom config argument."""

    _arg = ""  # the argument's name in error messages

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:  # pragma: no cover - each config defines it
        raise NotImplementedError

    @classmethod
    def coerce(cls, value: Any, where: str) -> Any:
        """``None`` → empty; a dict → ``from_dict``; an instance (lowbit's, or torch.ao's via ``to_dict``)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if hasattr(value, "to_dict"):
            return cls.from_dict(value.to_dict())
        raise TypeError(f"{where}: {cls._arg} must be None, a dict or a {cls.__name__}, got {type(value).__name__}")


class PrepareCustomConfig(_Config):
    """Options of ``prepare`` / ``prepare_fx`` (see the module docstring); setters return ``self``."""

    _arg = "prepare_custom_config"

    def __init__(self) -> None:
        self.float_to_observed_mapping: dict[type, type] = {}
        self.non_traceable_module_names: list[str] = []
        self.non_traceable_module_classes: list[type] = []
        self.input_quantized_indexes: list[int] = []
        self.output_quantized_indexes: list[int] = []
        self.preserved_attributes: list[str] = []

    def set_float_to_observed_mapping(self, float_class: type, observed_class: type,
                                      quant_type: Any = "static") -> PrepareCustomConfig:
        where = "PrepareCustomConfig.set_float_to_observed_mapping"
        _quant_type(quant_type, where)
        if not isinstance(float_class, type) or not isinstance(observed_class, type):
            raise TypeError(f"{where}: expects two classes, got {float_class!r}, {observed_class!r}")
        if not hasattr(observed_class, "from_float"):
            raise TypeError(f"{where}: {observed_class.__name__} has no from_float(float_module) classmethod")
        self.float_to_observed_mapping[float_class] = observed_class
        return self

    def set_non_traceable_module_names(self, module_names: list[str]) -> PrepareCustomConfig:
        self.non_traceable_module_names = _names(module_names, "set_non_traceable_module_names")
        return self

    def set_non_traceable_module_classes(self, module_classes: list[type]) -> PrepareCustomConfig:
        self.non_traceable_module_classes = _classes(module_classes, "set_non_traceable_module_classes")
        return self

    def set_input_quantized_indexes(self, indexes: list[int]) -> PrepareCustomConfig:
        self.input_quantized_indexes = _indexes(indexes, "set_input_quantized_indexes")
        return self

    def set_output_quantized_indexes(self, indexes: list[int]) -> PrepareCustomConfig:
        self.output_quantized_indexes = _indexes(indexes, "set_output_quantized_indexes")
        return self

    def set_preserved_attributes(self, attributes: list[str]) -> PrepareCustomConfig:
        self.preserved_attributes = _names(attributes, "set_preserved_attributes")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrepareCustomConfig:
        """From torch.ao's ``prepare_custom_config_dict`` keys (unknown keys raise ``ValueError``)."""
        known = {"float_to_observed_custom_module_class", "non_traceable_module_name", "non_traceable_module_class",
                 "input_quantized_idxs", "output_quantized_idxs", "preserved_attributes"}
        if not isinstance(d, dict):
            raise TypeError(f"PrepareCustomConfig.from_dict: expects a dict, got {type(d).__name__}")
        standalone = sorted(k for k in set(d) - known if k.startswith("standalone_module"))
        if standalone:  # (torch.ao's; "unsupported keys" said nothing of what to use instead)
            raise ValueError(f"PrepareCustomConfig.from_dict: {standalone} (torch.ao's standalone modules) are not "
                             "supported: graph mode quantizes a submodule inside the model's one graph; give it its own "
                             "qconfigs with QConfigMapping.set_module_name(name, ...) / set_module_name_regex, or keep "
                             "it float with set_non_traceable_module_names([name])")
        if set(d) - known:
            raise ValueError(f"PrepareCustomConfig.from_dict: unsupported keys {sorted(set(d) - known)} "
                             f"(supported: {sorted(known)})")
        cfg = cls()
        f2o = _mapping_arg(d.get("float_to_observed_custom_module_class", {}),
                           "PrepareCustomConfig.from_dict: float_to_observed_custom_module_class")
        if f2o and all(isinstance(k, str) for k in f2o):  # {"static": {Float: Observed}}
            for qt, m in f2o.items():
                _quant_type(qt, "PrepareCustomConfig.from_dict")  # (an empty mapping too: a typo is not ignored)
                for f, o in m.items():
                    cfg.set_float_to_observed_mapping(f, o, qt)
        else:
            for f, o in f2o.items():
                cfg.set_float_to_observed_mapping(f, o)
        cfg.set_non_traceable_module_names(d.get("non_traceable_module_name", []))
        cfg.set_non_traceable_module_classes(d.get("non_traceable_module_class", []))
        cfg.set_input_quantized_indexes(d.get("input_quantized_idxs", []))
        cfg.set_output_quantized_indexes(d.get("output_quantized_idxs", []))
        cfg.set_preserved_attributes(d.get("preserved_attributes", []))
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.float_to_observed_mapping:
            d["float_to_observed_custom_module_class"] = {"static": dict(self.float_to_observed_mapping)}
        for key, val in (("non_traceable_module_name", self.non_traceable_module_names),
                         ("non_traceable_module_class", self.non_traceable_module_classes),
                         ("input_quantized_idxs", self.input_quantized_indexes),
                         ("output_quantized_idxs", self.output_quantized_indexes),
                         ("preserved_attributes", self.preserved_attributes)):
            if val:
                d[key] = list(val)
        return d



class ConvertCustomConfig(_Config):
    """Options of ``convert`` / ``convert_fx``: observed → quantized custom classes, preserved attributes."""

    _arg = "convert_custom_config"

    def __init__(self) -> None:
        self.observed_to_quantized_mapping: dict[type, type] = {}
        self.dynamic_mapping: dict[type, type] = {}  # quant_type "dynamic": float leaf -> quantized, no observer
        self.preserved_attributes: list[str] = []

    def set_observed_to_quantized_mapping(self, observed_class: type, quantized_class: type,
                                          quant_type: Any = "static") -> ConvertCustomConfig:
        """``quant_type`` "static"/"qat": ``observed_class`` was observed by prepare; "dynamic" (graph mode):
        ``observed_class`` is a float leaf (declared non-traceable) swapped as is, float in and out."""
        where = "ConvertCustomConfig.set_observed_to_quantized_mapping"
        kind = _quant_type(quant_type, where, (*_STATIC, "dynamic"))
        if not isinstance(observed_class, type) or not isinstance(quantized_class, type):
            raise TypeError(f"{where}: expects two classes, got {observed_class!r}, {quantized_class!r}")
        if not hasattr(quantized_class, "from_observed"):
            raise TypeError(f"{where}: {quantized_class.__name__} has no from_observed(observed_module) classmethod")
        (self.dynamic_mapping if kind == "dynamic" else self.observed_to_quantized_mapping)[observed_class] = \
            quantized_class
        return self

    def set_preserved_attributes(self, attributes: list[str]) -> ConvertCustomConfig:
        self.preserved_attributes = _names(attributes, "set_preserved_attributes")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConvertCustomConfig:
        known = {"observed_to_quantized_custom_module_class", "preserved_attributes"}
        if not isinstance(d, dict):
            raise TypeError(f"ConvertCustomConfig.from_dict: expects a dict, got {type(d).__name__}")
        if set(d) - known:
            raise ValueError(f"ConvertCustomConfig.from_dict: unsupported keys {sorted(set(d) - known)} "
                             f"(supported: {sorted(known)})")
        cfg = cls()
        o2q = _mapping_arg(d.get("observed_to_quantized_custom_module_class", {}),
                           "ConvertCustomConfig.from_dict: observed_to_quantized_custom_module_class")
        if o2q and all(isinstance(k, str) for k in o2q):
            for qt, m in o2q.items():
                _quant_type(qt, "ConvertCustomConfig.from_dict", (*_STATIC, "dynamic"))  # (an empty mapping too)
                for o, q in m.items():
                    cfg.set_observed_to_quantized_mapping(o, q, qt)
        else:
            for o, q in o2q.items():
                cfg.set_observed_to_quantized_mapping(o, q)
        cfg.set_preserved_attributes(d.get("preserved_attributes", []))
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        by_type = {k: dict(v) for k, v in (("static", self.observed_to_quantized_mapping),
                                            ("dynamic", self.dynamic_mapping)) if v}
        if by_type:
            d["observed_to_quantized_custom_module_class"] = by_type
        if self.preserved_attributes:
            d["preserved_attributes"] = list(self.preserved_attributes)
        return d

    def mapping(self, dynamic: bool = False) -> dict[type, type]:
        """``{observed type: adapter whose from_float calls Quantized.from_observed}`` for the swap tables
        (``dynamic=True``: the dynamic entries)."""
        table = self.dynamic_mapping if dynamic else self.observed_to_quantized_mapping
        return {o: from_observed_adapter(q) for o, q in table.items()}


class FuseCustomConfig:
    """Options of ``fuse_fx``: attributes kept on the fused ``GraphModule``."""

    def __init__(self) -> None:
        self.preserved_attributes: list[str] = []

    def set_preserved_attributes(self, attributes: list[str]) -> FuseCustomConfig:
        self.preserved_attributes = _names(attributes, "set_preserved_attributes")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FuseCustomConfig:
        if not isinstance(d, dict) or set(d) - {"preserved_attributes"}:
            raise ValueError(f"FuseCustomConfig.from_dict: expects {{'preserved_attributes': [...]}}, got {d!r}")
        return cls().set_preserved_attributes(d.get("preserved_attributes", []))

    def to_dict(self) -> dict[str, Any]:
        return {"preserved_attributes": list(self.preserved_attributes)} if self.preserved_attributes else {}


_ADAPTERS: dict[type, type] = {}


def from_observed_adapter(quantized_class: type) -> type:
    """A class whose ``from_float(mod)`` is ``quantized_class.from_observed(mod)`` (so the swap tables,
    which call ``from_float``, build user-quantized custom modules); one per class."""
    if quantized_class not in _ADAPTERS:
        def from_float(mod: nn.Module, _q: type = quantized_class) -> Any:
            return _q.from_observed(mod)  # type: ignore[attr-defined]

        _ADAPTERS[quantized_class] = type(quantized_class.__name__, (), {
            "from_float": staticmethod(from_float), "__module__": quantized_class.__module__,
            "__doc__": f"from_observed adapter of {quantized_class.__qualname__}"})
    return _ADAPTERS[quantized_class]


def _mapping_arg(m: Any, where: str) -> dict[Any, Any]:
    """A ``{from: to}`` dict, or one per quantization type (``{"static": {...}}``), checked to be dicts."""
    if not isinstance(m, dict) or not all(isinstance(v, dict) for k, v in m.items() if isinstance(k, str)):
        raise TypeError(f"{where} must be a dict {{FloatClass: ObservedClass}} or {{'static': {{...}}}}, got {m!r}")
    return m


def check_module_types(fn: str, arg: str, value: Any) -> set[type]:
    """``value`` (``None`` or a list of module classes) as a set; ``TypeError`` naming ``arg`` otherwise."""
    if value is None:
        return set()
    if not isinstance(value, (list, tuple, set)) or not all(isinstance(t, type) for t in value):
        raise TypeError(f"{fn}: {arg} must be a list of module classes, got {value!r}")
    return set(value)


def swap_float_to_observed(model: nn.Module, custom: dict[type, type], skip: Any = None) -> nn.Module:
    """Replace (in place) each module with a qconfig whose exact type is a key of ``custom`` by
    ``custom[type].from_float(mod)``, which keeps the qconfig; ``skip(qconfig)`` true leaves it alone.
    Returns the model (itself swapped if its own type matches)."""
    def swap(mod: nn.Module, name: str) -> nn.Module:
        qc = getattr(mod, "qconfig", None)
        if type(mod) in custom and qc is not None and not (skip is not None and skip(qc)):
            obs_cls = custom[type(mod)]
            try:
                new = obs_cls.from_float(mod)
            except (ValueError, TypeError, RuntimeError) as err:
                raise type(err)(f"prepare: custom module '{name or '<root>'}' ({type(mod).__name__} -> "
                                f"{obs_cls.__name__}.from_float): {err}") from err
            if not isinstance(new, nn.Module):
                raise TypeError(f"prepare: {obs_cls.__name__}.from_float returned {type(new).__name__}, "
                                "not an nn.Module")
            new.qconfig = qc
            return new
        for cname, child in list(mod.named_children()):
            mod._modules[cname] = swap(child, f"{name}.{cname}" if name else cname)
        return mod

    return swap(model, "") if custom else model
