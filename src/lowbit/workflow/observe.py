"""``prepare`` (observers for static PTQ) and ``prepare_qat`` (QAT modules + output ``FakeQuantize``).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> prepared = prepare(nn.Sequential(Q.QuantStub(), nn.Linear(4, 4)), Q.get_minmax_qconfig())
>>> type(prepared[1].activation_post_process).__name__
'MinMaxObserver'
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..custom_config import PrepareCustomConfig, check_module_types, swap_float_to_observed
from ..fake_quant.base import holds_grid
from ..mappings import copy_user_hooks, get_default_qat_module_mappings, get_default_static_quant_module_mappings
from ..nn.intrinsic.qat.modules import BnFoldedBase
from ..nn.quantized.functional_modules import FloatFunctional
from ..observer.base import ObserverBase
from ..observer.ddp import keep_statistics_local
from ..observer.fixed import PlaceholderObserver
from ..qconfig import QConfigMapping, get_default_qat_qconfig_mapping, get_default_qconfig_mapping
from ..qconfig.config import build
from . import shared_grids
from .hooks import (_NO_OUTPUT_OBSERVER, _OWN_HOOKS, _QTENSOR_NATIVE, _is_observer, _is_table_recipe, _is_weighted,
                    _note_tag, _observe_float_input, _observe_input, _observe_output, _pass_tag,
                    _remove_observer_hooks)
from .propagate import (_check_common, _check_mapping, _dynamic_default, _path, _resolve_user_qconfig, refuse_half_static,
                        refuse_call_order, warn_graph_mode, is_dynamic_qconfig, join_name, propagate_qconfig_)
from ..state_check import guard_loading

__all__ = ["prepare", "prepare_qat"]


def _insert_observers(mod: nn.Module, observed: set[type], dynamic: set[type], name: str = "") -> int:
    """Give each observable module an output observer; return how many got one (or will be dynamic)."""
    if _is_observer(mod):
        return 0
    qc = getattr(mod, "qconfig", None)
    if is_dynamic_qconfig(qc):  # quantized per call after convert: nothing to observe
        if type(mod) in dynamic or _is_table_recipe(mod, qc):
            return 1
        return sum(_insert_observers(c, observed, dynamic, join_name(name, n)) for n, c in mod.named_children())
    if qc is not None and isinstance(mod, _QTENSOR_NATIVE) and _pass_tag not in mod._forward_hooks.values():
        mod.register_forward_pre_hook(_note_tag)
        mod.register_forward_hook(_pass_tag)
    if type(mod) in observed and qc is not None:
        if isinstance(mod, _NO_OUTPUT_OBSERVER):
            return 1
        where = f"prepare: module '{_path(name)}' ({type(mod).__name__})"
        mod.activation_post_process = build(qc, "activation", where)
        if getattr(mod, "_observe_input", False):  # dynamic QAT: memoryless fake-quant of the input
            _remove_observer_hooks(mod)
            mod.register_forward_pre_hook(_observe_input)
            return 1
        if not isinstance(mod, FloatFunctional):  # its methods call the observer themselves
            _remove_observer_hooks(mod)
            # first, as torch.ao's: the observer sees the module's own output, the one its int8 twin puts on the grid;
            # a user's forward hook runs after it (on a QTensor after convert), never between module and observer
            mod.register_forward_hook(_observe_output, prepend=True)
            mod.__dict__["_lowbit_where"] = f"module '{_path(name)}' ({type(mod).__name__})"  # its errors name it
        if _is_weighted(mod):
            mod.input_activation_post_process = build(qc, "activation", where)
            mod.register_forward_pre_hook(_observe_float_input)
        return 1
    return sum(_insert_observers(child, observed, dynamic, join_name(name, n)) for n, child in mod.named_children())


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
    warn_graph_mode(fn, model)
    mapping = _check_mapping(fn, default_mapping if mapping is None else mapping)
    dynamic = _check_mapping(fn, _dynamic_default(dynamic_mapping))
    qconfig = _resolve_user_qconfig(model, qconfig, default_qconfig)
    if isinstance(qconfig, (QConfigMapping, dict)):
        refuse_call_order(fn, QConfigMapping.from_qconfig(qconfig), "eager mode")
    refuse_half_static(fn, model, qconfig)
    # the copy, and legacy weight / spectral norm hooks baked into plain weights (as prepare_fx does): the hook went
    # with the module to its quantized class, whose forward then failed on 'weight_g' / 'weight_orig'
    from ..fx.legacy import baked_copy  # (here: lowbit.fx's package imports this one)

    model = baked_copy(model, fn, fn == "prepare_qat", inplace)
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
    _warn_recorded_grids("prepare", model)
    if _insert_observers(model, set(mapping) | non_leaf | set(custom.values()), set(dynamic)) == 0:
        warnings.warn("prepare(): no quantizable module got a qconfig — convert() will leave this model float",
                      stacklevel=2)
    keep_statistics_local(model)  # DDP(broadcast_buffers=True) must not overwrite the ranks' statistics (observer.ddp)
    shared_grids.install(model)
    return guard_loading(model).eval()  # (load_state_dict: all or nothing)


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

    plan: list[tuple[nn.Module, str, nn.Module]] = []  # every swap built first: an error leaves the model as it was

    def swap(mod: nn.Module, name: str) -> nn.Module:
        qc = getattr(mod, "qconfig", None)
        if type(mod) in mapping and qc is not None and not is_dynamic_qconfig(qc):
            try:
                new = mapping[type(mod)].from_float(mod)
            except (ValueError, TypeError, RuntimeError) as e:
                raise type(e)(f"prepare_qat: module '{_path(name)}' ({type(mod).__name__}): {e}") from e
            return copy_user_hooks(mod, new, _OWN_HOOKS)  # user hooks survive
        if isinstance(mod, BnFoldedBase):  # one op (built directly, or prepared before): its conv / linear is no layer
            return mod  # of its own (swapped, it got a second, unused weight_fake_quant: torch.ao stops at fused modules)
        for cname, child in list(mod.named_children()):
            new = swap(child, join_name(name, cname))
            if new is not child:
                plan.append((mod, cname, new))
        return mod

    model = swap(model, "")
    for parent, cname, new in plan:
        parent._modules[cname] = new
    _warn_recorded_grids("prepare_qat", model)
    observed = set(get_default_static_quant_module_mappings()) | set(mapping.values())
    if _insert_observers(model, observed, set(dynamic)) == 0:
        warnings.warn("prepare_qat(): no quantizable module got a qconfig — convert() will leave this model float",
                      stacklevel=2)
    shared_grids.install(model)
    _warn_post_training_qconfigs(model)
    keep_statistics_local(model)  # DDP(broadcast_buffers=True) must not overwrite the ranks' statistics (observer.ddp)
    return guard_loading(model).train()


def _warn_recorded_grids(fn: str, model: nn.Module) -> None:
    """Warn naming the modules whose output observer / fake-quant (from an earlier ``prepare`` / ``prepare_qat``) holds
    a recorded grid: preparing again replaces it with a fresh one (as torch.ao does, silently), so a QAT model given to
    ``prepare_qat`` a second time (a re-run notebook cell) lost its trained activation grids without a word."""
    held = [f"'{_path(name)}' ({type(mod).__name__})" for name, mod in model.named_modules()
            if not _is_observer(mod) and _is_observer(obs := mod._modules.get("activation_post_process"))
            and holds_grid(obs)]
    if held:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        warnings.warn(f"{fn}(): the model was prepared before: the recorded output grids of {shown} are replaced by "
                      "fresh observers / fake-quants (their statistics are lost); prepare the float model, or keep "
                      "training / calibrating the prepared one", stacklevel=3)


def _warn_post_training_qconfigs(model: nn.Module) -> None:
    """Warn naming the modules whose output observer or ``weight_fake_quant`` is a plain observer: a post-training
    qconfig (e.g. a ``.qconfig`` attribute set for ``prepare``) that ``prepare_qat`` kept, as torch.ao keeps it
    (silently). Such a module trains without fake quantization: the float forward never sees its grid."""
    plain = [f"'{_path(name)}' ({type(obs).__name__} as {attr})" for name, mod in model.named_modules()
             if not _is_observer(mod) for attr in ("weight_fake_quant", "activation_post_process")
             if isinstance(obs := mod._modules.get(attr), ObserverBase) and not isinstance(obs, PlaceholderObserver)]
    if plain:
        shown = ", ".join(plain[:4]) + (f" and {len(plain) - 4} more" if len(plain) > 4 else "")
        warnings.warn(f"prepare_qat(): {shown} got a post-training qconfig (an observer, not a fake-quant): those "
                      "modules train without fake quantization. An existing .qconfig attribute is kept, as in torch.ao; "
                      "set a QAT qconfig (get_default_qat_qconfig()) or pass qconfig= to prepare_qat", stacklevel=3)
