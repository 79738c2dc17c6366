"""Eager-mode workflows: ``prepare`` → calibrate → ``convert``; ``prepare_qat`` → train → ``convert``;
``quantize_dynamic``.

**Which qconfig a module gets** (``propagate_qconfig_``, torch.ao semantics): the module's own
``.qconfig`` attribute if it has one (``model.qconfig = ...`` then ``prepare(model)``), else the
mapping's explicit setting for it (name > regex > type, see ``QConfigMapping``), else its parent's.
``qconfig=None`` with no ``.qconfig`` attribute anywhere means the default recipe. A
``QConfigMapping(resolution="exact")`` (lucid's legacy mode) ignores ``.qconfig`` attributes and
parents: a module gets its exact name's setting, else its exact type's, else the global one.

**Observers**: ``prepare`` gives every module whose exact type is a key of the static mapping
(Linear, Conv*, ConvTranspose*, fused markers, QAT modules, activations, ``QuantStub``,
``FloatFunctional``) and whose qconfig is not ``None`` an ``activation_post_process =
qconfig.activation()`` called on its output by a forward hook (the hook returns the observer's
output, so a ``FakeQuantize`` there fake-quantizes). Children of such modules (a fused marker's
conv, a QAT module's ``weight_fake_quant``) are not observed. ``DeQuantStub`` and embeddings get
no output observer (their outputs are float).

**Float inputs** (lowbit beyond torch.ao): a weighted module (Linear, Conv*, ConvTranspose*, their
fused/QAT forms) also gets ``input_activation_post_process``, fed by a forward pre-hook only with
inputs that no observed module produced (the output hook tags what it returns; ReLU / MaxPool /
Flatten / Dropout / Identity modules pass the tag on). ``convert`` records that grid as the
quantized module's ``input_grid``, so a layer after a float op (or in a model without
``QuantStub``) quantizes its float input on a calibrated grid instead of per call.

**convert** swaps each observed module for ``mapping[type(mod)].from_float(mod)`` (a conv-BN QAT
module is folded first), removes the remaining observers and hooks, and puts the model in eval
mode. An observer that saw no data raises ``RuntimeError`` naming the module path when no observer
saw data (convert before calibration); when others did, its module never ran (a ``FloatFunctional``
declared in every block, used in residual ones only): it stays float, with a warning and a
``left_float`` entry. Modules with
a qconfig that stay float are listed in a ``ConvertReport`` (``return_report=True`` returns
``(model, report)``; it is also logged on the ``"lowbit"`` logger at INFO).

**Dynamic qconfigs** (activation ``PlaceholderObserver(is_dynamic=True)``, ``get_dynamic_qconfig()``;
they mix with static ones in one mapping, e.g. static convs + ``set_object_type(nn.Linear, dynamic)``):
``prepare`` gives such a module no observer (``prepare_qat`` leaves it float, trained in float),
and ``convert`` swaps a module whose exact type is a key of the dynamic mapping (Linear, LSTM, GRU)
for ``dynamic_mapping[type].from_float(mod, dtype=qconfig.weight().qdtype)`` — the module
``quantize_dynamic`` builds with that qconfig; no calibration is needed. Any other module under a
dynamic qconfig (Conv*, fused markers, activations) has no dynamic kernel: it stays float and is
listed in ``ConvertReport.left_float`` (not an error, so a global dynamic recipe on a CNN works).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> model = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.ReLU(), Q.DeQuantStub())
>>> model.qconfig = Q.get_minmax_qconfig()
>>> prepared = prepare(model)
>>> _ = prepared(torch.randn(16, 4))                       # calibrate
>>> qmodel, report = convert(prepared, return_report=True)
>>> [type(m).__name__ for m in qmodel]
['Quantize', 'Linear', 'ReLU', 'DeQuantize']
>>> type(qmodel[1]).__module__.startswith("lowbit.nn.quantized"), len(report.left_float)
(True, 0)
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, TypeGuard

import torch
from torch import nn

from .custom_config import ConvertCustomConfig, PrepareCustomConfig, check_module_types, swap_float_to_observed
from .fake_quant import FakeQuantize
from .mappings import (
    ConvertReport,
    copy_user_hooks,
    get_default_dynamic_quant_module_mappings,
    get_default_qat_module_mappings,
    get_default_static_quant_module_mappings,
)
from .nn.intrinsic import FusedModule
from .nn.intrinsic.qat.modules import BnFoldedBase, freeze_bn_stats, update_bn_stats
from .nn.quantized.functional_modules import FloatFunctional
from .observer.base import ObserverBase
from .observer.distributed import sync_pending
from .qconfig import QConfig, QConfigMapping, get_default_qat_qconfig_mapping, get_default_qconfig_mapping
from .qscheme import as_qdtype, per_channel_affine_float_qparams, quint4, quint8
from .qtensor import QTensor
from .quantize_dynamic import quantize_dynamic
from .speed_guard import keep_faster
from .stubs import DeQuantStub, QuantStub

__all__ = [
    "prepare", "convert", "prepare_qat", "quantize_dynamic", "propagate_qconfig_",
    "freeze_bn_stats", "update_bn_stats", "is_dynamic_qconfig",
]

logger = logging.getLogger("lowbit")

_MISSING = object()
# outputs that stay float after convert: no output observer
_NO_OUTPUT_OBSERVER = (DeQuantStub, nn.Embedding, nn.EmbeddingBag)  # (QAT embeddings subclass these)
# leaf modules a QTensor passes through in integer (or that do nothing): not worth reporting
_QTENSOR_NATIVE = (nn.Identity, nn.ReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Flatten,
                   nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
# Averages run on dequantized values after convert and the next layer quantizes them on the grid it
# calibrated (a global average spans far less than its input, whose grid torch.ao keeps: up to ~10x
# coarser; see docs/design.md). prepare treats their outputs as float, so the twins agree.
_AVERAGING_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                    nn.AdaptiveAvgPool3d)


def _path(name: str) -> str:
    return name or "<root>"


def _check_common(fn: str, model: Any, inplace: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"{fn}: inplace must be a bool, got {inplace!r}")


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
    mapping = QConfigMapping() if qconfig is None else QConfigMapping.from_qconfig(qconfig)
    mapping.check_module_names((n for n, _ in model.named_modules()), "propagate_qconfig_")
    exact = mapping.resolution == "exact"  # lucid's legacy mode: attributes ignored, resolve() skips parents

    def walk(mod: nn.Module, name: str, inherited: QConfig | None) -> None:
        qc = _MISSING if exact else mod.__dict__.get("qconfig", _MISSING)
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


_TAG = "_lowbit_observed"  # set on tensors an observed module returned: quantized after convert


def _tag(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        setattr(t, _TAG, True)
    return t


def _observe_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook ``prepare`` registers: the output goes through ``activation_post_process``."""
    return _tag(module.activation_post_process(output))


def _pass_tag(module: nn.Module, inputs: Any, output: Any) -> None:
    """Forward hook on QTensor-native modules (ReLU, MaxPool, ...): a quantized input stays quantized."""
    if inputs and getattr(inputs[0], _TAG, False):
        _tag(output)


def _observe_float_input(module: nn.Module, inputs: Any) -> Any:
    """Forward pre-hook of weighted modules: observe (QAT: fake-quantize) an input no observed module made."""
    x = inputs[0] if inputs else None
    if isinstance(x, torch.Tensor) and x.is_floating_point() and not getattr(x, _TAG, False):
        return (module.input_activation_post_process(x), *inputs[1:])
    return None


def _dequantize_input(module: nn.Module, inputs: Any) -> Any:
    """Forward pre-hook ``convert`` puts on averaging pools and dynamic modules: a ``QTensor`` input is
    dequantized (averaged in float; quantized per call by a dynamic module)."""
    x = inputs[0] if inputs else None
    return (x.dequantize(), *inputs[1:]) if isinstance(x, QTensor) else None


def _observe_input(module: nn.Module, inputs: Any) -> Any:
    """Forward pre-hook of dynamic QAT layers: the input goes through ``activation_post_process``."""
    return (module.activation_post_process(inputs[0]), *inputs[1:]) if inputs else None


_HOOKS = (_observe_output, _pass_tag, _observe_float_input, _observe_input)
_OWN_HOOKS = (*_HOOKS, _dequantize_input)  # everything the workflow registers: never copied as a user's hook


def _remove_observer_hooks(mod: nn.Module) -> None:
    for hooks in (mod._forward_hooks, mod._forward_pre_hooks):
        for key in [k for k, h in hooks.items() if h in _HOOKS]:
            del hooks[key]


def _is_weighted(mod: nn.Module) -> bool:
    """Linear / conv (incl. transposed), bare or inside a fused marker or a QAT conv-BN module."""
    core = mod[0] if isinstance(mod, FusedModule) else (mod.layer if isinstance(mod, BnFoldedBase) else mod)
    return isinstance(core, (nn.Linear, nn.modules.conv._ConvNd))


def _is_observer(m: Any) -> bool:
    return isinstance(m, (ObserverBase, FakeQuantize))


def _is_table_recipe(mod: nn.Module, qconfig: Any) -> bool:
    """An embedding whose qconfig's weight is a table recipe (8/4-bit unsigned rows or float qparams):
    weight-only, so it is quantized whatever the activation entry is (torch.ao's ``QConfigDynamic(
    activation=default_dynamic_quant_observer, weight=float_qparams_observer)`` on an EmbeddingBag)."""
    if not isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) or not isinstance(qconfig, QConfig):
        return False
    w = qconfig.weight()
    qdtype = getattr(w, "qdtype", None)
    return getattr(w, "qscheme", None) is per_channel_affine_float_qparams or qdtype in (quint8, quint4)


def _insert_observers(mod: nn.Module, observed: set[type], dynamic: set[type]) -> int:
    """Give each observable module an output observer; return how many got one (or will be dynamic)."""
    if _is_observer(mod):
        return 0
    qc = getattr(mod, "qconfig", None)
    if is_dynamic_qconfig(qc):  # quantized per call after convert: nothing to observe
        if type(mod) in dynamic or _is_table_recipe(mod, qc):
            return 1
        return sum(_insert_observers(c, observed, dynamic) for c in mod.children())
    if qc is not None and isinstance(mod, _QTENSOR_NATIVE) and _pass_tag not in mod._forward_hooks.values():
        mod.register_forward_hook(_pass_tag)
    if type(mod) in observed and qc is not None:
        if isinstance(mod, _NO_OUTPUT_OBSERVER):
            return 1
        mod.activation_post_process = qc.activation()
        if getattr(mod, "_observe_input", False):  # dynamic QAT: memoryless fake-quant of the input
            _remove_observer_hooks(mod)
            mod.register_forward_pre_hook(_observe_input)
            return 1
        if not isinstance(mod, FloatFunctional):  # its methods call the observer themselves
            _remove_observer_hooks(mod)
            mod.register_forward_hook(_observe_output)
        if _is_weighted(mod):
            mod.input_activation_post_process = qc.activation()
            mod.register_forward_pre_hook(_observe_float_input)
        return 1
    return sum(_insert_observers(child, observed, dynamic) for child in mod.children())


def _is_module_mapping(value: Any) -> bool:
    """A non-empty ``{module class: module class}`` dict (a swap mapping, not a qconfig dict)."""
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, type) and isinstance(v, type) and issubclass(v, nn.Module) for k, v in value.items())


def _setup(fn: str, model: Any, qconfig: Any, inplace: Any, mapping: Any, dynamic_mapping: Any,
           default_mapping: dict[type, type], default_qconfig: QConfigMapping
           ) -> tuple[nn.Module, dict[type, type], dict[type, type]]:
    """The shared start of ``prepare``/``prepare_qat``: checked arguments, the (copied) model with
    ``.qconfig`` propagated, the observed-type mapping and the dynamic mapping.

    torch.ao's positional orders keep working: ``prepare(model, True)`` (its second argument is
    ``inplace``) and ``prepare_qat(model, {Float: Qat})`` (its second argument is ``mapping``)."""
    if isinstance(qconfig, bool) and inplace is False:
        qconfig, inplace = None, qconfig
    elif mapping is None and _is_module_mapping(qconfig):
        qconfig, mapping = None, qconfig
    _check_common(fn, model, inplace)
    mapping = _check_mapping(fn, default_mapping if mapping is None else mapping)
    dynamic = _check_mapping(fn, _dynamic_default(dynamic_mapping))
    qconfig = _resolve_user_qconfig(model, qconfig, default_qconfig)
    if not inplace:
        model = copy.deepcopy(model)
    return propagate_qconfig_(model, qconfig), mapping, dynamic


def prepare(model: nn.Module, qconfig: Any = None, inplace: bool = False,
            mapping: dict[type, type] | None = None, dynamic_mapping: dict[type, type] | None = None,
            observer_non_leaf_module_list: Any = None, prepare_custom_config_dict: Any = None) -> nn.Module:
    """Insert output observers for static post-training quantization; returns the model in eval mode.

    ``qconfig``: ``None`` (``.qconfig`` attributes, or the default recipe when there are none), a
    ``QConfig``, a ``QConfigMapping`` or a qconfig dict. ``mapping`` (default
    ``get_default_static_quant_module_mappings()``): its keys are the module types observed —
    pass the same extended mapping to ``convert``. ``dynamic_mapping`` (default
    ``get_default_dynamic_quant_module_mappings()``): the types a dynamic qconfig quantizes (not
    observed). ``inplace=False`` works on a deep copy.

    As torch.ao: ``observer_non_leaf_module_list`` (module types) — modules of these types get an
    output observer as a whole and their children are not observed (give ``convert`` a mapping
    entry for them, or they stay float); ``prepare_custom_config_dict`` (a dict with
    ``"float_to_observed_custom_module_class": {Float: Observed}`` or a
    ``lowbit.custom_config.PrepareCustomConfig``) — a module of type ``Float`` with a qconfig becomes
    ``Observed.from_float(mod)`` with an output observer (``convert_custom_config_dict`` makes it
    quantized).
    """
    non_leaf = check_module_types("prepare", "observer_non_leaf_module_list", observer_non_leaf_module_list)
    custom = PrepareCustomConfig.coerce(prepare_custom_config_dict, "prepare").float_to_observed_mapping
    model, mapping, dynamic = _setup("prepare", model, qconfig, inplace, mapping, dynamic_mapping,
                                     get_default_static_quant_module_mappings(), get_default_qconfig_mapping())
    model = swap_float_to_observed(model, custom, skip=is_dynamic_qconfig)
    if _insert_observers(model, set(mapping) | non_leaf | set(custom.values()), set(dynamic)) == 0:
        warnings.warn("prepare(): no quantizable module got a qconfig — convert() will leave this model float",
                      stacklevel=2)
    return model.eval()


def prepare_qat(model: nn.Module, qconfig: Any = None, inplace: bool = False,
                mapping: dict[type, type] | None = None, dynamic_mapping: dict[type, type] | None = None) -> nn.Module:
    """Swap to QAT modules (``nn.qat`` / ``nn.intrinsic.qat``) and add output ``FakeQuantize``; train mode.

    ``qconfig`` as in ``prepare`` (default: ``get_default_qat_qconfig_mapping()``); ``mapping``
    (default ``get_default_qat_module_mappings()``): float type → QAT class. Fused conv-BN markers
    from ``fuse_modules_qat`` become ``ConvBn*`` modules whose BN statistics keep updating. Modules
    with a dynamic qconfig train in float and become ``dynamic_mapping`` modules at ``convert``.
    """
    model, mapping, dynamic = _setup("prepare_qat", model, qconfig, inplace, mapping, dynamic_mapping,
                                     get_default_qat_module_mappings(), get_default_qat_qconfig_mapping())

    def swap(mod: nn.Module) -> nn.Module:
        qc = getattr(mod, "qconfig", None)
        if type(mod) in mapping and qc is not None and not is_dynamic_qconfig(qc):
            return copy_user_hooks(mod, mapping[type(mod)].from_float(mod), _OWN_HOOKS)  # user hooks survive
        for cname, child in list(mod.named_children()):
            mod._modules[cname] = swap(child)
        return mod

    model = swap(model)
    observed = set(get_default_static_quant_module_mappings()) | set(mapping.values())
    if _insert_observers(model, observed, set(dynamic)) == 0:
        warnings.warn("prepare_qat(): no quantizable module got a qconfig — convert() will leave this model float",
                      stacklevel=2)
    return model.train()


def _is_calibrated(obs: nn.Module) -> bool:
    sync_pending(obs)  # under torch.distributed: decide on the ranks' union, as calculate_qparams does
    inner = getattr(obs, "activation_post_process", None)  # FakeQuantize wraps an observer
    if isinstance(obs, FakeQuantize) and isinstance(inner, ObserverBase):
        return inner.is_calibrated
    return bool(getattr(obs, "is_calibrated", True))


def _strip(mod: nn.Module) -> None:
    """Remove what prepare added to a module that stays float."""
    _remove_observer_hooks(mod)
    if _is_observer(mod._modules.get("input_activation_post_process")):
        del mod.input_activation_post_process
    if _is_observer(mod._modules.get("activation_post_process")):
        if isinstance(mod, FloatFunctional):
            mod.activation_post_process = nn.Identity()
        else:
            del mod.activation_post_process
    mod.__dict__.pop("qconfig", None)


def _swap(mod: nn.Module, name: str, mapping: dict[type, type], report: ConvertReport) -> nn.Module:
    obs = mod._modules.get("activation_post_process")
    if obs is not None and not _is_calibrated(obs) and getattr(report, "_calibrated", False):
        # other observers saw data, this module never ran (torchvision's quantizable style declares a
        # FloatFunctional in every block, residual blocks alone use it): keep it as it is
        warnings.warn(f"convert: module '{_path(name)}' ({type(mod).__name__}) never ran during calibration; "
                      "it is left as it is (float)", stacklevel=4)
        _strip(mod)
        report.left_float[_path(name)] = f"{type(mod).__name__} (never ran during calibration)"
        return mod
    if obs is not None and not _is_calibrated(obs):
        raise RuntimeError(
            f"convert: module '{_path(name)}' ({type(mod).__name__}) has an observer that saw no data; "
            "run calibration batches through the prepared model before convert()"
        )
    qcls = mapping[type(mod)]
    src = mod.fold() if isinstance(mod, BnFoldedBase) else mod
    try:
        new = qcls.from_float(src)
    except (ValueError, TypeError, RuntimeError) as err:
        raise type(err)(f"convert: module '{_path(name)}' ({type(mod).__name__} -> {qcls.__name__}): {err}") from err
    inp = mod._modules.get("input_activation_post_process")
    if inp is not None and _is_calibrated(inp) and hasattr(new, "input_grid"):  # it saw float inputs
        scale, zero_point = inp.calculate_qparams()
        new.input_grid = (float(scale), int(zero_point), as_qdtype(inp.qdtype))
    report.converted[_path(name)] = f"{type(mod).__name__} -> {qcls.__module__}.{qcls.__name__}"
    return copy_user_hooks(mod, new, _OWN_HOOKS)  # the user's hooks survive (torch.ao's swap_module keeps them)


def _swap_dynamic(mod: nn.Module, name: str, qconfig: QConfig, dynamic: dict[type, type],
                  report: ConvertReport) -> nn.Module:
    """``dynamic[type(mod)].from_float(mod, dtype=qconfig.weight().qdtype)``, as ``quantize_dynamic`` does."""
    qcls = dynamic[type(mod)]
    try:
        new = qcls.from_float(mod, dtype=getattr(qconfig.weight(), "qdtype", None))
    except (ValueError, TypeError, RuntimeError) as err:
        raise type(err)(f"convert: module '{_path(name)}' ({type(mod).__name__} -> dynamic {qcls.__name__}): "
                        f"{err}") from err
    report.converted[_path(name)] = f"{type(mod).__name__} -> {qcls.__module__}.{qcls.__name__}"
    new.register_forward_pre_hook(_dequantize_input)  # a QTensor from a static layer before it: float in
    return copy_user_hooks(mod, new, _OWN_HOOKS)


def _convert(mod: nn.Module, name: str, mapping: dict[type, type], report: ConvertReport,
             dynamic: dict[type, type]) -> nn.Module:
    qc = getattr(mod, "qconfig", None)
    if is_dynamic_qconfig(qc) and type(mod) in dynamic:
        return _swap_dynamic(mod, name, qc, dynamic, report)
    # any other module under a dynamic qconfig stays float (an embedding with a table recipe is weight-only)
    is_dynamic = is_dynamic_qconfig(qc) and not _is_table_recipe(mod, qc)
    observed = _is_observer(mod._modules.get("activation_post_process")) or isinstance(mod, _NO_OUTPUT_OBSERVER)
    if type(mod) in mapping and qc is not None and observed and not is_dynamic:
        return _swap(mod, name, mapping, report)
    for cname, child in list(mod.named_children()):
        if _is_observer(child):
            continue
        mod._modules[cname] = _convert(child, f"{name}.{cname}" if name else cname, mapping, report, dynamic)
    _strip(mod)
    if qc is not None and isinstance(mod, _AVERAGING_POOLS) and _dequantize_input not in mod._forward_pre_hooks.values():
        mod.register_forward_pre_hook(_dequantize_input)
        return mod
    leaf = not any(True for _ in mod.children()) or isinstance(mod, FusedModule)
    if qc is not None and leaf and not isinstance(mod, (*_QTENSOR_NATIVE, QuantStub, DeQuantStub)):
        why = "not observed (prepared with another mapping?)" if type(mod) in mapping else "no quantized mapping"
        if is_dynamic:
            why = f"dynamic qconfig, but no dynamic module for it (dynamic: {', '.join(t.__name__ for t in dynamic)})"
        report.left_float[_path(name)] = f"{type(mod).__name__} ({why})"
    return mod


def convert(model: nn.Module, mapping: dict[type, type] | None = None, inplace: bool = False,
            return_report: bool = False, speed_check: Any = None,
            dynamic_mapping: dict[type, type] | None = None, convert_custom_config_dict: Any = None,
            is_reference: bool = False) -> Any:
    """Swap observed modules for ``lowbit.nn.quantized`` ones; returns the model (eval mode).

    ``mapping`` (default ``get_default_static_quant_module_mappings()``): exact type → class with
    ``from_float``; ``dynamic_mapping`` (default ``get_default_dynamic_quant_module_mappings()``): the
    same for modules with a dynamic qconfig (``from_float(mod, dtype=...)``, no observer needed).
    The root itself is swapped when it is observed (or dynamic), so use the return value.
    ``return_report=True`` returns ``(model, ConvertReport)``. ``speed_check`` (example inputs, a
    tensor or a tuple): afterwards, ``lowbit.speed_guard.keep_faster`` times every quantized layer
    against its float twin on these inputs and swaps back to float the layers where int8 is not
    faster; its ``SpeedReport`` is the ``ConvertReport``'s ``speed`` attribute (and logged at INFO).
    ``convert_custom_config_dict`` (``{"observed_to_quantized_custom_module_class": {Observed: Quantized}}``
    or a ``lowbit.custom_config.ConvertCustomConfig``): observed custom modules become
    ``Quantized.from_observed(mod)``.
    ``is_reference=True``: the reference model instead (``lowbit.reference.to_reference``: float
    modules with explicit quantize → dequantize of weights and activations; ``lower_reference``
    turns it into this int8 model).
    """
    if is_reference is not False:
        if is_reference is not True:
            raise TypeError(f"convert: is_reference must be a bool, got {is_reference!r}")
        if speed_check is not None:
            raise ValueError("convert: speed_check times int8 layers; a reference model (is_reference=True) has none")
        from .reference.convert import to_reference  # same tier; reference builds on this module

        custom = ConvertCustomConfig.coerce(convert_custom_config_dict, "convert").mapping()  # those stay float
        full = {**(get_default_static_quant_module_mappings() if mapping is None else mapping), **custom}
        return to_reference(model, mapping=full, inplace=inplace, return_report=return_report)
    _check_common("convert", model, inplace)
    if not isinstance(return_report, bool):
        raise TypeError(f"convert: return_report must be a bool, got {return_report!r}")
    mapping = _check_mapping("convert", get_default_static_quant_module_mappings() if mapping is None else mapping)
    mapping = {**mapping, **ConvertCustomConfig.coerce(convert_custom_config_dict, "convert").mapping()}
    dynamic = _check_mapping("convert", _dynamic_default(dynamic_mapping))
    if not inplace:
        model = copy.deepcopy(model)
    float_twin = copy.deepcopy(model) if speed_check is not None else None
    report = ConvertReport()
    observers = [m for m in model.modules() if _is_observer(m) and not getattr(m, "is_dynamic", False)]
    report._calibrated = any([_is_calibrated(m) for m in observers])  # type: ignore[attr-defined]
    model = _convert(model, "", mapping, report, dynamic).eval()
    if float_twin is not None:
        speed = keep_faster(model, float_twin, speed_check)
        report.speed = speed  # type: ignore[attr-defined]
        model = model if speed.model is None else speed.model
        logger.info("%s", speed)
    if not report.converted:
        warnings.warn("convert(): no prepared module found (run prepare() or prepare_qat() and calibrate first); "
                      "the model stays float", stacklevel=2)
    if report.left_float:
        logger.info("%s", report)
    return (model, report) if return_report else model
