"""``quantize_dynamic``: int8 (or float16) weights ahead of time, activations quantized per call.

``qconfig_spec`` says which modules to quantize and with which dtype:

- ``None``: every module whose exact type is a key of ``mapping`` (Linear, RNN, LSTM, GRU and their cells) with ``dtype``;
- a set of types and/or dotted module names (``{nn.LSTM, "encoder.fc1"}``): modules of exactly
  those types or at those paths (and the modules inside them) with ``dtype``;
- a dict ``{type or dotted name: dtype | QConfig | None}``: per type / per name; ``None`` excludes.
  A name covers the submodules under it; a module's own name beats its type beats its parent's;
- a ``QConfig`` (every targeted module) or a ``QConfigMapping`` (resolved as in ``prepare``): each
  targeted module's weight observer gives its dtype, e.g. ``get_dynamic_qconfig(torch.float16)``.

Embeddings (``nn.Embedding``/``nn.EmbeddingBag``) become weight-only per-row tables when they resolve
to an embedding ``QConfig`` (``{nn.Embedding: get_embedding_qconfig(float_qparams=True)}``, torch.ao's
``float_qparams_weight_only_qconfig``); a plain dtype inherited from a parent leaves them float.

``dtype``: ``lowbit.qint8`` (``"qint8"``, ``torch.qint8``) or ``torch.float16``. A bare target
(``quantize_dynamic(nn.LSTM(...))``) returns the quantized module itself.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
>>> qm = quantize_dynamic(m, {"2": torch.float16, nn.Linear: Q.qint8})
>>> [type(c).__module__.startswith("lowbit.nn.quantized.dynamic") for c in qm]
[True, False, True]
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .mappings import copy_user_hooks, get_default_dynamic_quant_module_mappings
from .nn.quantized.embedding import Embedding as QEmbedding
from .nn.quantized.embedding import EmbeddingBag as QEmbeddingBag
from .qconfig import QConfig, QConfigMapping
from .qscheme import QDtype, as_qdtype, qint8
from .workflow.propagate import refuse_call_order, refuse_lazy
from .state_check import guard_loading

__all__ = ["quantize_dynamic"]

DynamicDtype = QDtype | torch.dtype
# weight-only per-row tables: quantized when a module resolves to an embedding qconfig (as torch.ao's)
_EMBEDDINGS: dict[type, type] = {nn.Embedding: QEmbedding, nn.EmbeddingBag: QEmbeddingBag}
_MISSING = object()


def _as_dynamic_dtype(dtype: Any, where: str) -> DynamicDtype:
    if dtype in (torch.float16, "float16"):
        return torch.float16
    try:
        q = as_qdtype(dtype)
    except (TypeError, ValueError):
        q = None
    if q != qint8:
        raise ValueError(f"{where}: dtype={dtype!r} must be lowbit.qint8 or torch.float16")
    return qint8


def _spec_value(v: Any, key: Any) -> tuple[DynamicDtype | None, QConfig | None] | None:
    """``None`` (exclude) or ``(dtype, qconfig)``; a QConfig's weight observer gives the dtype.

    A QConfig whose weight is no dynamic dtype (an embedding recipe: quint8 / quint4 rows) gives
    ``(None, qconfig)``; only embeddings accept it (checked when a module resolves to it).
    """
    if v is None:
        return None
    if isinstance(v, QConfig):
        try:
            return _as_dynamic_dtype(getattr(v.weight(), "qdtype", None), f"qconfig_spec[{key!r}].weight"), v
        except ValueError:
            return None, v
    return _as_dynamic_dtype(v, f"qconfig_spec[{key!r}]"), None


def _normalise_spec(qconfig_spec: Any, dtype: DynamicDtype, mapping: dict[type, type]) -> Any:
    if isinstance(qconfig_spec, QConfig):  # before the tuple check: a QConfig is a NamedTuple
        return QConfigMapping().set_global(qconfig_spec)
    if isinstance(qconfig_spec, QConfigMapping):
        return qconfig_spec
    if qconfig_spec is None:
        return {t: (dtype, None) for t in mapping}
    if isinstance(qconfig_spec, (set, frozenset, list, tuple)):
        bad = [t for t in qconfig_spec if not isinstance(t, (type, str))]
        if bad:
            raise TypeError(f"quantize_dynamic: qconfig_spec set entries must be module types or module names, "
                            f"got {bad[0]!r}")
        return {t: (dtype, None) for t in qconfig_spec}
    if isinstance(qconfig_spec, dict):
        for k in qconfig_spec:
            if not isinstance(k, (type, str)):
                raise TypeError(f"quantize_dynamic: qconfig_spec key {k!r} must be a module type or a module name")
        return {k: _spec_value(v, k) for k, v in qconfig_spec.items()}
    raise TypeError(f"quantize_dynamic: qconfig_spec={qconfig_spec!r} must be None, a set of types, a dict, "
                    "a QConfig or a QConfigMapping")


def quantize_dynamic(model: nn.Module, qconfig_spec: Any = None, dtype: Any = qint8,
                     mapping: dict[type, type] | None = None, inplace: bool = False) -> nn.Module:
    """Swap targeted modules for ``mapping[type].from_float(mod, dtype=...)``; returns the model (eval).

    ``mapping`` defaults to ``get_default_dynamic_quant_module_mappings()``; ``inplace=False``
    works on a deep copy.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_dynamic: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"quantize_dynamic: inplace must be a bool, got {inplace!r}")
    refuse_lazy("quantize_dynamic", model)
    mapping = get_default_dynamic_quant_module_mappings() if mapping is None else mapping
    if not isinstance(mapping, dict) or not all(isinstance(k, type) and hasattr(v, "from_float")
                                                for k, v in mapping.items()):
        raise TypeError(f"quantize_dynamic: mapping must be a dict {{module type: class with from_float}}, "
                        f"got {mapping!r}")
    spec = _normalise_spec(qconfig_spec, _as_dynamic_dtype(dtype, "quantize_dynamic"), mapping)
    if isinstance(spec, QConfigMapping):
        refuse_call_order("quantize_dynamic", spec, "quantize_dynamic")
    names = {n for n, _ in model.named_modules()}
    # a misspelt name would be ignored silently: warn (torch.ao ignores it; what is swapped stays the same)
    if isinstance(spec, QConfigMapping):
        spec.check_module_names(names, "quantize_dynamic", strict=False)
    else:
        typos = [k for k in spec if isinstance(k, str) and k and k not in names]
        if typos:
            warnings.warn(f"quantize_dynamic: qconfig_spec names no module of this model: {typos}; "
                          "module names are dotted paths as in named_modules()", stacklevel=2)
    from .fx.legacy import baked_copy  # (here: lowbit.fx's package imports the workflows)

    model = baked_copy(model, "quantize_dynamic", False, inplace)  # (legacy norm hooks: deepcopy refused their weights)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    found = [0]
    plan: list[tuple[nn.Module, str, nn.Module]] = []  # swaps applied once every one is built (an error changes nothing)
    touched: list[tuple[nn.Module, bool, Any]] = []  # (module, had a qconfig attribute, its value): undone on error

    def set_qconfig(mod: nn.Module, qconfig: Any) -> None:
        touched.append((mod, "qconfig" in mod.__dict__, mod.__dict__.get("qconfig")))
        mod.qconfig = qconfig

    def setting(mod: nn.Module, name: str, inherited: Any) -> Any:
        """The module's ``None | (dtype, qconfig) | QConfig`` (a mapping's, resolved lazily)."""
        if isinstance(spec, QConfigMapping):
            return spec.resolve(name, type(mod), inherited)
        d = spec.get(name, _MISSING) if name else _MISSING
        return spec.get(type(mod), inherited) if d is _MISSING else d

    def walk(mod: nn.Module, name: str, inherited: Any) -> nn.Module:
        d = setting(mod, name, inherited)
        where = name or type(mod).__name__
        if type(mod) in _EMBEDDINGS and type(mod) not in mapping and d is not None:
            wd, qconfig = _spec_value(d, where) if isinstance(d, QConfig) else d
            if qconfig is not None and wd is None:  # an embedding recipe: weight-only per-row table
                found[0] += 1
                set_qconfig(mod, qconfig)
                return _from_float(_EMBEDDINGS[type(mod)], mod, name, None)
            if isinstance(spec, dict) and (type(mod) in spec or (name and name in spec)):  # asked for by type / name
                raise ValueError(f"quantize_dynamic: {type(mod).__name__} needs an embedding qconfig "
                                 f"(get_embedding_qconfig(), float_qparams=True for torch.ao's), got dtype {d[0]!r}")
            return mod  # a dynamic recipe (dtype) inherited from a parent does not reach embeddings
        if type(mod) in mapping and d is not None:
            found[0] += 1
            wdtype, qconfig = _spec_value(d, where) if isinstance(d, QConfig) else d
            if wdtype is None:
                wdtype = _as_dynamic_dtype(getattr(qconfig.weight(), "qdtype", None),
                                           f"quantize_dynamic: module '{name or '<root>'}' ({type(mod).__name__})")
            if qconfig is not None:  # the module's weight observer comes from this qconfig
                set_qconfig(mod, qconfig)
            return _from_float(mapping[type(mod)], mod, name, wdtype)
        for cname, child in list(mod.named_children()):
            new = walk(child, f"{name}.{cname}" if name else cname, d)
            if new is not child:
                plan.append((mod, cname, new))
        return mod

    def _from_float(qcls: type, mod: nn.Module, name: str, wdtype: Any) -> nn.Module:
        try:
            new = qcls.from_float(mod) if wdtype is None else qcls.from_float(mod, dtype=wdtype)
            return copy_user_hooks(mod, new)  # the user's hooks survive the swap (as torch.ao)
        except (ValueError, TypeError, RuntimeError) as err:
            raise type(err)(f"quantize_dynamic: module '{name or '<root>'}' ({type(mod).__name__}): {err}") from err

    try:
        model = walk(model, "", spec.global_qconfig if isinstance(spec, QConfigMapping) else spec.get("", None))
    except Exception:
        for m, had, old in touched:  # the caller's model (inplace=True) as it was
            if had:
                m.qconfig = old
            else:
                m.__dict__.pop("qconfig", None)
        for m, training in modes:
            m.training = training
        raise
    for parent, cname, new in plan:
        parent._modules[cname] = new
    if found[0] == 0 and spec:
        warnings.warn("quantize_dynamic(): no module of a targeted type found — the model is returned unchanged",
                      stacklevel=2)
    return guard_loading(model)  # load_state_dict: all or nothing (state_check)
