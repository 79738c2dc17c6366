"""Which qconfig a module gets: ``propagate_qconfig_`` (own ``.qconfig`` > mapping setting > parent),
``is_dynamic_qconfig``, and the argument checks ``prepare`` / ``convert`` share.

>>> import lowbit as Q
>>> from torch import fx, nn
>>> m = propagate_qconfig_(nn.Sequential(nn.Linear(2, 2)), Q.get_minmax_qconfig())
>>> m[0].qconfig is m.qconfig
True
"""

from __future__ import annotations

import warnings
from typing import Any, TypeGuard

import torch
from torch import fx, nn
from torch.nn.modules.lazy import LazyModuleMixin

from ..batches import check_module
from ..mappings import get_default_dynamic_quant_module_mappings
from ..nn.intrinsic import FusedModule
from ..observer import NoopObserver
from ..qconfig import QConfig, QConfigMapping

__all__ = ["propagate_qconfig_", "is_dynamic_qconfig"]

_MISSING = object()


def _path(name: str) -> str:
    return name or "<root>"


def join_name(prefix: str, name: str) -> str:
    """A child's dotted module path: ``prefix.name``, or ``name`` at the root (``prefix == ""``)."""
    return f"{prefix}.{name}" if prefix else name


def _check_common(fn: str, model: Any, inplace: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"{fn}: inplace must be a bool, got {inplace!r}")
    refuse_lazy(fn, model)


def refuse_lazy(fn: str, model: nn.Module) -> None:
    """``ValueError`` naming the first lazy module (``nn.LazyLinear``, ``nn.LazyConv2d`` ...) whose parameters are
    not made yet: the (copied) model would make its own random weights on its first calibration call, other than the
    float model's (−2 dB against it, silently), and ``quantize_dynamic`` skipped the unconverted class.

    >>> refuse_lazy("prepare", nn.Sequential(nn.LazyLinear(2)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: prepare: module '0' (LazyLinear) has uninitialized parameters (a lazy module makes them on its ...
    """
    for name, mod in model.named_modules():
        if isinstance(mod, LazyModuleMixin) and mod.has_uninitialized_params():
            raise ValueError(f"{fn}: module {name or '<model>'!r} ({type(mod).__name__}) has uninitialized parameters "
                             "(a lazy module makes them on its first call); run the float model once on an example "
                             "input before quantizing, so that the quantized model starts from its weights")


def warn_graph_mode(fn: str, model: nn.Module) -> bool:
    """Warn (as torch.ao, which accepts it, does not) when ``model`` comes from ``prepare_fx`` / ``convert_fx``: eager
    ``prepare`` adds observers around its graph's own, eager ``convert`` swaps none of them (they are graph nodes) and
    leaves it float. Returns whether it warned."""
    from ..fx.prepare import STATE_KEY, is_prepared  # (fx builds on this tier: imported when called)

    if not is_prepared(model):
        return False
    state = model.meta[STATE_KEY] if isinstance(model, fx.GraphModule) else model.__dict__[STATE_KEY]
    done = "was converted by convert_fx" if state.get("converted") else \
        "comes from prepare_fx / prepare_qat_fx (graph mode): calibrate it and call convert_fx"
    warnings.warn(f"{fn}(): this {type(model).__name__} {done}; eager {fn}() does not apply to graph-mode models "
                  "(its observers are graph nodes)", stacklevel=3)
    return True


def refuse_call_order(fn: str, mapping: QConfigMapping, what: str) -> None:
    """``ValueError`` naming ``fn`` when ``mapping`` holds ``set_module_name_object_type_order`` entries: they count calls
    in a traced graph (graph mode), which ``what`` (eager mode, ``quantize_dynamic``) does not have."""
    if mapping.module_name_object_type_order_qconfigs:
        raise ValueError(f"{fn}: QConfigMapping.set_module_name_object_type_order entries count calls in a traced graph "
                         f"(prepare_fx / prepare_qat_fx); {what} has no call order: name the module with "
                         "set_module_name instead")


def _check_mapping(fn: str, mapping: Any) -> dict[type, type]:
    if not isinstance(mapping, dict) or not all(isinstance(k, type) for k in mapping):
        raise TypeError(f"{fn}: mapping must be a dict {{module type: class with from_float}}, got {mapping!r}")
    for k, v in mapping.items():
        if not hasattr(v, "from_float"):
            raise TypeError(f"{fn}: mapping[{k.__name__}] = {v!r} has no from_float")
    return mapping


def is_dynamic_qconfig(qconfig: Any) -> TypeGuard[QConfig]:
    """Whether ``qconfig``'s activation is a dynamic placeholder (``get_dynamic_qconfig()``): quantized per call.

    >>> import lowbit as Q
    >>> is_dynamic_qconfig(Q.get_dynamic_qconfig()), is_dynamic_qconfig(Q.get_minmax_qconfig())
    (True, False)
    """
    return isinstance(qconfig, QConfig) and getattr(qconfig.activation(), "is_dynamic", False) is True


def refuse_half_static(fn: str, model: nn.Module, qconfig: Any) -> None:
    """``TypeError`` for a float16 / bfloat16 model that a static or QAT qconfig applies to (not a dynamic one, nor a
    weight-only embedding one; ``qconfig``: the resolved one, ``None`` for the modules' own ``.qconfig`` only), as
    ``prepare_fx`` refuses it: the int8 layers return float32, and the half float op after them failed deep in the
    converted model (``LayerNorm``'s "mixed dtype (CPU)"), or the output came back float32.

    >>> from lowbit import get_default_qconfig, get_dynamic_qconfig
    >>> refuse_half_static("prepare", nn.Linear(2, 2).half(), get_dynamic_qconfig())  # (dynamic: float activations)
    >>> refuse_half_static("prepare", nn.Linear(2, 2).half(), get_default_qconfig())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: prepare: static int8 needs a float32 model, but 'weight' is torch.float16 (the int8 layers return ...
    """
    half = next(((n, t.dtype) for n, t in (*model.named_parameters(), *model.named_buffers())
                 if t.dtype in (torch.float16, torch.bfloat16)), None)
    if half is None:
        return
    qconfigs = [m.__dict__.get("qconfig") for m in model.modules()]
    if qconfig is not None:
        mp = QConfigMapping.from_qconfig(qconfig)
        qconfigs += [mp.global_qconfig, *mp.object_type_qconfigs.values(), *mp.module_name_qconfigs.values(),
                     *mp.module_name_regex_qconfigs.values(), *mp.module_name_object_type_order_qconfigs.values()]
    if any(q is not None and not is_dynamic_qconfig(q) and not isinstance(q.activation(), NoopObserver)
           for q in qconfigs):  # (NoopObserver: a weight-only table recipe, whose rows return the model's dtype)
        raise TypeError(f"{fn}: static int8 needs a float32 model, but {half[0]!r} is {half[1]} (the int8 layers "
                        "return float32 to the float ops between them); call model.float() before preparing")


def _dynamic_default(dynamic_mapping: Any) -> Any:
    return get_default_dynamic_quant_module_mappings() if dynamic_mapping is None else dynamic_mapping


def propagate_qconfig_(model: nn.Module, qconfig: Any = None) -> nn.Module:
    """Set ``.qconfig`` on every module of ``model`` (in place): own attribute > mapping setting > parent.

    ``qconfig``: ``None`` (only ``.qconfig`` attributes count), a ``QConfig`` (global), a
    ``QConfigMapping`` or a qconfig dict.

    >>> import lowbit as Q
    >>> from torch import nn
    >>> m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    >>> m[1].qconfig = None                         # exclude a subtree
    >>> _ = propagate_qconfig_(m, Q.get_minmax_qconfig())
    >>> m[0].qconfig is m.qconfig, m[1][0].qconfig
    (True, None)
    """
    check_module(model, "propagate_qconfig_: model")
    mapping = QConfigMapping() if qconfig is None else QConfigMapping.from_qconfig(qconfig)
    mapping.check_module_names((n for n, _ in model.named_modules()), "propagate_qconfig_")
    exact = mapping.resolution == "exact"  # lucid's legacy mode: attributes ignored, resolve() skips parents

    def walk(mod: nn.Module, name: str, inherited: QConfig | None) -> None:
        qc = _MISSING if exact else mod.__dict__.get("qconfig", _MISSING)
        if qc is _MISSING and name == "" and not exact and (mapping.global_qconfig is not None
                                                            or "" in mapping.module_name_qconfigs):
            # the root: its name "" is the global key (torch.ao's qconfig_dict.get(prefix)): a set global beats the
            # type rule of the root's own class; with no global set, the type rule applies as before
            qc = mapping.module_name_qconfigs.get("", mapping.global_qconfig)
        if qc is _MISSING:
            qc = mapping.resolve(name, type(mod), inherited)
        elif qc is not None and not isinstance(qc, QConfig):
            raise TypeError(f"module '{_path(name)}' ({type(mod).__name__}) has .qconfig={qc!r}; "
                            "expected a lowbit QConfig or None")
        mod.qconfig = qc
        for cname, child in mod.named_children():
            walk(child, f"{name}.{cname}" if name else cname, qc)

    walk(model, "", mapping.global_qconfig)
    return model


def _resolve_user_qconfig(model: nn.Module, qconfig: Any, default: QConfigMapping) -> Any:
    """``None`` + no ``.qconfig`` attribute anywhere → ``default``; otherwise the user's value.

    A fused module's attribute (``fuse_modules_qat(..., qconfig=qc)``) does not count: it overrides
    the default for that module only.
    """
    if qconfig is not None:
        if not isinstance(qconfig, (QConfig, QConfigMapping, dict)):
            raise TypeError(f"qconfig={qconfig!r} must be None, a QConfig, a QConfigMapping or a qconfig dict")
        return qconfig
    has_attr = any("qconfig" in m.__dict__ for m in model.modules() if not isinstance(m, FusedModule))
    return None if has_attr else default
