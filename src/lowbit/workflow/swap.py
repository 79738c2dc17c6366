"""``convert``: observed modules become ``lowbit.nn.quantized`` ones (or dynamic ones under a dynamic
qconfig); what stays float is listed in a ``ConvertReport``.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> prepared = Q.prepare(nn.Sequential(Q.QuantStub(), nn.Linear(4, 4)), Q.get_minmax_qconfig())
>>> _ = prepared(torch.randn(8, 4))
>>> [type(m).__name__ for m in convert(prepared)]
['Quantize', 'Linear']
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

from torch import nn

from ..custom_config import ConvertCustomConfig
from ..fake_quant import FakeQuantize
from ..fake_quant.base import holds_grid
from ..mappings import ConvertReport, copy_user_hooks, get_default_static_quant_module_mappings
from ..nn.intrinsic import FusedModule
from ..nn.intrinsic.qat.modules import BnFoldedBase
from ..nn.quantized._utils import precomputed_weights
from ..nn.quantized.functional_modules import FloatFunctional
from ..nn.quantized.normalization import batchnorm_float_reason
from ..nn.quantized.stubs import region_dtype, set_region_dtype
from ..observer.ddp import drop_removed
from ..observer.distributed import sync_pending
from ..observer.fixed import PlaceholderObserver
from ..qconfig import QConfig
from ..qscheme import as_qdtype
from ..speed_guard import keep_faster
from ..stubs import DeQuantStub, QuantStub
from .hooks import (_AVERAGING_POOLS, _NO_OUTPUT_OBSERVER, _OWN_HOOKS, _QTENSOR_NATIVE, _dequantize_input,
                    _is_observer, _is_table_recipe, _remove_observer_hooks)
from .propagate import (_check_common, _check_mapping, _dynamic_default, _path, warn_graph_mode,
                        is_dynamic_qconfig)
from ..state_check import LOAD_HINT, guard_loading

__all__ = ["convert"]

logger = logging.getLogger("lowbit")


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # empty: not a layer, nothing to report


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
    inner = obs.activation_post_process if isinstance(obs, FakeQuantize) else obs
    if isinstance(inner, PlaceholderObserver):  # (NoopObserver too) a static layer needs a grid it never records
        raise RuntimeError(
            f"convert: module '{_path(name)}' ({type(mod).__name__}) has a {type(inner).__name__} activation "
            "(qconfig.activation), which records no grid: a static int8 layer needs an observer such as "
            "HistogramObserver or MinMaxObserver; for a layer quantized per call give it a dynamic qconfig "
            "(get_dynamic_qconfig())")
    if obs is not None and not holds_grid(obs) and getattr(report, "_calibrated", False):
        # other observers saw data, this module never ran (torchvision's quantizable style declares a
        # FloatFunctional in every block, residual blocks alone use it): keep it as it is
        warnings.warn(f"convert: module '{_path(name)}' ({type(mod).__name__}) never ran during calibration; "
                      "it is left as it is (float)", stacklevel=4)
        _strip(mod)
        report.left_float[_path(name)] = f"{type(mod).__name__} (never ran during calibration)"
        return mod
    if obs is not None and not holds_grid(obs):
        raise RuntimeError(
            f"convert: module '{_path(name)}' ({type(mod).__name__}) has an observer that saw no data (or only NaN/Inf "
            "values, which observers ignore); run calibration batches through the prepared model before convert() "
            f"({LOAD_HINT})"
        )
    qcls = mapping[type(mod)]
    src = mod.fold() if isinstance(mod, BnFoldedBase) else mod
    try:
        new = qcls.from_float(src)
    except (ValueError, TypeError, RuntimeError) as err:
        raise type(err)(f"convert: module '{_path(name)}' ({type(mod).__name__} -> {qcls.__name__}): {err}") from err
    inp = mod._modules.get("input_activation_post_process")
    if inp is not None and holds_grid(inp) and hasattr(new, "input_grid"):  # it saw float inputs
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
        stays_float = batchnorm_float_reason(mod)
        if stays_float is None:
            return _swap(mod, name, mapping, report)
        # batch statistics: float (with its fused ReLU), reading the int8 layer before it through a dequantize
        for sub in mod.modules():
            _strip(sub)
        if _dequantize_input not in mod._forward_pre_hooks.values():
            mod.register_forward_pre_hook(_dequantize_input)
        report.left_float[_path(name)] = f"{type(mod).__name__} ({stays_float})"
        return mod
    for cname, child in list(mod.named_children()):
        if _is_observer(child):
            continue
        mod._modules[cname] = _convert(child, f"{name}.{cname}" if name else cname, mapping, report, dynamic)
    _strip(mod)
    if qc is not None and isinstance(mod, _AVERAGING_POOLS) and _dequantize_input not in mod._forward_pre_hooks.values():
        mod.register_forward_pre_hook(_dequantize_input)
        return mod
    # a leaf: no children but fake-quants (a QAT layer's weight_fake_quant stays on a layer left float)
    leaf = all(_is_observer(c) for c in mod.children()) or isinstance(mod, FusedModule)
    if isinstance(mod, _CONTAINERS) and not mod._modules:  # an empty Sequential (identity) / ModuleList: no layer
        return mod
    if qc is not None and leaf and not isinstance(mod, (*_QTENSOR_NATIVE, QuantStub, DeQuantStub)):
        why = "not observed (prepared with another mapping?)" if type(mod) in mapping else "no quantized mapping"
        if observed and type(mod) not in mapping:
            why = _unmapped(type(mod), dynamic)
        if is_dynamic:
            why = f"dynamic qconfig, but no dynamic module for it (dynamic: {', '.join(t.__name__ for t in dynamic)})"
        report.left_float[_path(name)] = f"{type(mod).__name__} ({why})"
    return mod


_UNMAPPED = "prepared, but convert's mapping has no entry for"  # (convert's warning looks for it)


def _unmapped(cls: type, dynamic: dict[type, type]) -> str:
    """Why a prepared module of type ``cls`` stayed float: its type is not a key of convert's mapping."""
    full = f"{cls.__module__}.{cls.__qualname__}"
    if cls in dynamic:  # e.g. lowbit.nn.qat.dynamic.Linear (dynamic QAT: torch.ao's convert needs the entry too)
        to = dynamic[cls]
        return f"{_UNMAPPED} {full}; pass mapping={{{full}: {to.__module__}.{to.__qualname__}}} to convert"
    return f"{_UNMAPPED} {full}; pass convert the mapping given to prepare / prepare_qat"


def convert(model: nn.Module, mapping: dict[type, type] | None = None, inplace: bool = False,
            return_report: bool = False, speed_check: Any = None,
            dynamic_mapping: dict[type, type] | None = None, convert_custom_config_dict: Any = None,
            is_reference: bool = False, *, remove_qconfig: bool = True,
            use_precomputed_fake_quant: bool = False) -> Any:
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
    turns it into this int8 model). ``remove_qconfig=False`` (keyword, torch.ao's argument): every module
    keeps the ``.qconfig`` it had (by name), as torch.ao's leaves them; by default they are removed.
    ``use_precomputed_fake_quant=True`` (keyword, torch.ao's argument): each QAT layer's weight takes its
    ``weight_fake_quant`` grid as it stands (by default convert observes the weight once more, which moves a
    moving-average grid and refits a min/max one to the last optimizer step's weight); a fake-quant
    that never saw a weight is a ``ValueError`` naming it; a layer without one (post-training) is observed as usual.
    """
    if not isinstance(remove_qconfig, bool):
        raise TypeError(f"convert: remove_qconfig must be a bool, got {remove_qconfig!r}")
    if not isinstance(use_precomputed_fake_quant, bool):
        raise TypeError(f"convert: use_precomputed_fake_quant must be a bool, got {use_precomputed_fake_quant!r}")
    kept = {} if remove_qconfig or not isinstance(model, nn.Module) else {
        n: m.__dict__["qconfig"] for n, m in model.named_modules() if "qconfig" in m.__dict__}
    if is_reference is not False:
        if is_reference is not True:
            raise TypeError(f"convert: is_reference must be a bool, got {is_reference!r}")
        if speed_check is not None:
            raise ValueError("convert: speed_check times int8 layers; a reference model (is_reference=True) has none")
        from ..reference.convert import to_reference  # same tier; reference builds on this module

        custom = ConvertCustomConfig.coerce(convert_custom_config_dict, "convert").mapping()  # those stay float
        full = {**(get_default_static_quant_module_mappings() if mapping is None else mapping), **custom}
        with precomputed_weights(use_precomputed_fake_quant):
            return to_reference(model, mapping=full, inplace=inplace, return_report=return_report)
    if isinstance(speed_check, bool):  # (read as a switch: it went on to the model as its input)
        raise TypeError(f"convert: speed_check={speed_check!r} takes the example inputs to time the layers on (a tensor "
                        "or a tuple of positional arguments), or None (no speed check)")
    _check_common("convert", model, inplace)
    graph_mode = warn_graph_mode("convert", model)
    if not isinstance(return_report, bool):
        raise TypeError(f"convert: return_report must be a bool, got {return_report!r}")
    mapping = _check_mapping("convert", get_default_static_quant_module_mappings() if mapping is None else mapping)
    mapping = {**mapping, **ConvertCustomConfig.coerce(convert_custom_config_dict, "convert").mapping()}
    dynamic = _check_mapping("convert", _dynamic_default(dynamic_mapping))
    if not inplace:
        model = copy.deepcopy(model)
    float_twin = copy.deepcopy(model) if speed_check is not None else None
    report = ConvertReport()
    sync_pending(model)  # under torch.distributed: the ranks agree on the observers' paths, then reduce (one pass)
    observers = [m for m in model.modules() if _is_observer(m) and not getattr(m, "is_dynamic", False)]
    report._calibrated = any([holds_grid(m) for m in observers])  # type: ignore[attr-defined]
    dtype = region_dtype(model)  # (before the swaps: a float64 model's DeQuantize returns float64)
    with precomputed_weights(use_precomputed_fake_quant) as taken:
        model = _convert(model, "", mapping, report, dynamic).eval()
    set_region_dtype(model, dtype)
    if use_precomputed_fake_quant and not taken[0] and report.converted:
        warnings.warn("convert(use_precomputed_fake_quant=True): no converted layer has a weight_fake_quant (a QAT "
                      "layer's), so every weight was observed at convert as usual", stacklevel=2)
    if float_twin is not None:
        speed = keep_faster(model, float_twin, speed_check)
        report.speed = speed  # type: ignore[attr-defined]
        model = model if speed.model is None else speed.model
        logger.info("%s", speed)
    unmapped = {k: v for k, v in report.left_float.items() if _UNMAPPED in v}
    if not report.converted and not graph_mode and unmapped:
        warnings.warn(f"convert(): nothing converted: {len(unmapped)} prepared module(s) have no entry in convert's "
                      f"mapping: " + "; ".join(f"'{k}': {v}" for k, v in list(unmapped.items())[:3]), stacklevel=2)
    elif not report.converted and not graph_mode:
        warnings.warn("convert(): no prepared module found (run prepare() or prepare_qat() and calibrate first); "
                      "the model stays float", stacklevel=2)
    if report.left_float:
        logger.info("%s", report)
    for n, m in model.named_modules():
        if n in kept and "qconfig" not in m.__dict__:
            m.qconfig = kept[n]
    drop_removed(model)  # DDP's ignore list: the removed observers' statistics buffers are gone (observer.ddp)
    guard_loading(model)  # load_state_dict: all or nothing (state_check)
    return (model, report) if return_report else model
