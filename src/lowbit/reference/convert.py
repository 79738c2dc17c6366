"""Eager reference models: ``convert(prepared, is_reference=True)`` and ``lower_reference``.

``to_reference(prepared)`` (what ``convert(..., is_reference=True)`` runs) keeps the prepared model's
structure and float arithmetic and freezes its calibration:

- every observer / fake-quant (``activation_post_process``, ``input_activation_post_process``)
  becomes a ``QuantDeQuant`` on the grid it measured, still called by ``prepare``'s hooks: each
  observed output (and each float input of a weighted layer) is rounded onto its int8 grid;
- every observed ``Linear``/``ConvNd`` (bare, QAT, inside a fused ``(op, ReLU)`` marker, or a QAT
  conv-BN folded first), ``ConvTransposeNd`` and every ``Embedding``/``EmbeddingBag`` becomes its ``lowbit.reference``
  module: the float weight, quantized → dequantized on its weight grid on every call;
- activations, ``FloatFunctional``, stubs and pools stay the float modules (stubs are identities;
  the QDQ after them is the quantization).

So the reference model computes, in float, on exactly the grids of ``convert(prepared)``; its
outputs agree with the int8 model's within one output quantum (the int8 model rounds its exact
int32 accumulator once, the reference its float sum). ``lower_reference(ref)`` (``lower_reference_eager``) turns it into that
int8 model: reference modules become float stand-ins whose weight observer is a ``FrozenObserver``
holding the recorded weight grid, ``QuantDeQuant`` become ``FrozenObserver`` s, and ``convert`` runs
— so the lowered model has the same codes and grids as ``convert(prepared)``.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 4), nn.ReLU(), Q.DeQuantStub())
>>> p = Q.prepare(m, Q.get_minmax_qconfig()); _ = p(torch.randn(32, 4))
>>> ref = Q.convert(p, is_reference=True)
>>> [type(c).__name__ for c in ref], type(ref[1]).__module__
(['QuantStub', 'Linear', 'ReLU', 'DeQuantStub'], 'lowbit.reference.modules')
>>> q = Q.lower_reference(ref)
>>> torch.equal(q[1].weight().int_repr(), Q.convert(p)[1].weight().int_repr())
True
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

from torch import nn

from ..mappings import ConvertReport, get_default_static_quant_module_mappings
from ..nn.intrinsic import FusedModule
from ..nn.intrinsic import modules as nni
from ..nn.intrinsic.qat import modules as nniqat
from ..nn.intrinsic.qat.modules import BnFoldedBase
from ..nn.quantized._utils import weight_qparams
from ..observer.ddp import drop_removed
from ..observer.distributed import sync_pending
from ..observer.fixed import NoopObserver
from ..qconfig import QConfig
from ..workflow import convert as _convert_int8
from ..workflow.hooks import _is_observer, _observe_float_input
from ..workflow.propagate import _check_common, _path, is_dynamic_qconfig
from ..workflow.swap import _strip
from ..fake_quant.base import holds_grid
from .modules import REFERENCE_MODULES, FrozenObserver, QuantDeQuant, _WeightQDQ, weight_qparams_of

__all__ = ["to_reference", "lower_reference_eager"]

_OBSERVER_ATTRS = ("activation_post_process", "input_activation_post_process")
# QAT fused (op, ReLU) module -> the float marker its reference lives in
_QAT_FUSED = {nniqat.LinearReLU: nni.LinearReLU, nniqat.ConvReLU1d: nni.ConvReLU1d,
              nniqat.ConvReLU2d: nni.ConvReLU2d, nniqat.ConvReLU3d: nni.ConvReLU3d}


def _float_base(mod: nn.Module) -> type[nn.Module] | None:
    """The float type (key of ``REFERENCE_MODULES``) ``mod`` is, or derives from (QAT twins)."""
    return next((t for t in type(mod).__mro__ if t in REFERENCE_MODULES), None)


def _reference_of(mod: nn.Module, owner: nn.Module, name: str) -> nn.Module:
    """The reference module for a float / QAT weighted ``mod``; ``owner`` holds its qconfig or fake-quant."""
    base = _float_base(mod)
    assert base is not None
    axis = 1 if isinstance(mod, nn.modules.conv._ConvTransposeNd) else 0
    try:
        obs = weight_qparams(mod.weight, owner, axis, f"convert(is_reference=True) '{_path(name)}'")
        qparams = weight_qparams_of(obs)
        if qparams["axis"] is not None:  # observed with the channel axis moved to the front (transposed convs)
            qparams["axis"] = axis
        return REFERENCE_MODULES[base].from_float(mod, qparams)  # type: ignore[attr-defined]
    except (ValueError, TypeError, RuntimeError) as err:
        raise type(err)(f"convert(is_reference=True): module '{_path(name)}' ({type(mod).__name__}): {err}") from err


def _move_state(old: nn.Module, new: nn.Module) -> nn.Module:
    """Give ``new`` ``old``'s observers, hooks and qconfig (it takes ``old``'s place in the model)."""
    for attr in _OBSERVER_ATTRS:
        if attr in old._modules:
            new.add_module(attr, old._modules[attr])
    new._forward_hooks.update(old._forward_hooks)
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    if "qconfig" in old.__dict__:
        new.qconfig = old.qconfig
    return new.train(old.training)


def _never_ran(mod: nn.Module, name: str, report: ConvertReport) -> bool:
    """An output observer that saw no data while others did: its module never ran during calibration. Left float with
    ``convert``'s warning and ``left_float`` entry (``_strip``), so the reference and the int8 model agree (it raised
    here, where ``convert`` kept the module float)."""
    obs = mod._modules.get("activation_post_process")
    if not _is_observer(obs) or holds_grid(obs) or not getattr(report, "_calibrated", False):
        return False
    warnings.warn(f"convert(is_reference=True): module '{_path(name)}' ({type(mod).__name__}) never ran during "
                  "calibration; it is left as it is (float)", stacklevel=5)
    _strip(mod)
    report.left_float[_path(name)] = f"{type(mod).__name__} (never ran during calibration)"
    return True


def _freeze_observers(mod: nn.Module, name: str) -> None:
    for attr in _OBSERVER_ATTRS:
        obs = mod._modules.get(attr)
        if not _is_observer(obs):
            continue
        if holds_grid(obs):
            mod._modules[attr] = QuantDeQuant.from_observer(obs, f"module '{_path(name)}'")
        elif attr == "activation_post_process":
            raise RuntimeError(f"convert(is_reference=True): module '{_path(name)}' ({type(mod).__name__}) has an "
                               "observer that saw no data (or only NaN/Inf values, which observers ignore); run "
                               "calibration batches before convert()")
        else:  # it never saw a float input: nothing to round
            del mod._modules[attr]
            for key in [k for k, h in mod._forward_pre_hooks.items() if h is _observe_float_input]:
                del mod._forward_pre_hooks[key]


def _weighted_reference(mod: nn.Module, name: str) -> nn.Module | None:
    """The reference replacement of an observed weighted module, or ``None`` when it has no weights."""
    src = mod.fold() if isinstance(mod, BnFoldedBase) else mod
    if type(src) in _QAT_FUSED:
        return _move_state(mod, _QAT_FUSED[type(src)](_reference_of(src, src, name), nn.ReLU()))
    if isinstance(src, FusedModule) and _float_base(src[0]) is not None:
        src[0] = _reference_of(src[0], src, name)
        return _move_state(mod, src) if src is not mod else src
    if _float_base(src) is not None:
        return _move_state(mod, _reference_of(src, src, name))
    return None


def to_reference(model: nn.Module, mapping: dict[type, type] | None = None, inplace: bool = False,
                 return_report: bool = False) -> Any:
    """The reference form of a calibrated ``prepare``/``prepare_qat`` model (see the module docstring).

    ``mapping`` (default ``get_default_static_quant_module_mappings()``): the types ``convert``
    would quantize; only those are given reference weights. ``return_report=True`` returns
    ``(model, ConvertReport)``: ``converted`` lists the reference swaps, ``left_float`` the
    quantized types without a reference module (their weights stay float; ``ConvTranspose*``).
    """
    _check_common("convert", model, inplace)
    mapping = get_default_static_quant_module_mappings() if mapping is None else mapping
    if not isinstance(mapping, dict) or not all(isinstance(k, type) for k in mapping):  # only the keys matter here
        raise TypeError(f"convert: mapping must be a dict {{module type: quantized class}}, got {mapping!r}")
    if not inplace:
        model = copy.deepcopy(model)
    sync_pending(model)  # under torch.distributed: the ranks agree on the observers' paths, then reduce
    report = ConvertReport()
    report._calibrated = any(holds_grid(m) for m in model.modules()  # type: ignore[attr-defined]
                             if _is_observer(m) and not getattr(m, "is_dynamic", False))

    def walk(mod: nn.Module, name: str) -> nn.Module:
        qc = getattr(mod, "qconfig", None)
        if _never_ran(mod, name, report):
            return mod
        observed = _is_observer(mod._modules.get("activation_post_process"))
        table = isinstance(mod, (nn.Embedding, nn.EmbeddingBag))
        if type(mod) in mapping and qc is not None and not is_dynamic_qconfig(qc) and (observed or table):
            _freeze_observers(mod, name)
            new = _weighted_reference(mod, name)
            if new is not None:
                report.converted[_path(name)] = f"{type(mod).__name__} -> reference"
                return new
            if any(isinstance(p, nn.Parameter) for p in mod.parameters(recurse=False)):
                report.left_float[_path(name)] = f"{type(mod).__name__} (no reference module: weights stay float)"
            return mod
        for cname, child in list(mod.named_children()):
            if not _is_observer(child):
                mod._modules[cname] = walk(child, f"{name}.{cname}" if name else cname)
        _freeze_observers(mod, name)  # e.g. a QAT module's output fake-quant on a module not in mapping
        return mod

    model = drop_removed(walk(model, "").eval())  # DDP's ignore list: the frozen observers' statistics are gone
    return (model, report) if return_report else model


def _frozen_weight_qconfig(ref: _WeightQDQ, qconfig: Any) -> QConfig:
    """``qconfig`` with a weight factory that reproduces ``ref``'s recorded weight grid."""
    weight = functools.partial(FrozenObserver, ref.weight_scale, ref.weight_zero_point, ref.weight_qscheme,
                               ref.weight_dtype, ref.weight_axis)
    activation = qconfig.activation if isinstance(qconfig, QConfig) else NoopObserver.with_args()
    return QConfig(activation, weight)


def lower_reference_eager(model: nn.Module, mapping: dict[type, type] | None = None, inplace: bool = False,
                          return_report: bool = False, convert_custom_config_dict: Any = None) -> Any:
    """The lowbit int8 model of an eager reference model (``convert(..., is_reference=True)``).

    Equal, code for code and grid for grid, to ``convert`` of the prepared model the reference came
    from. ``mapping`` / ``return_report`` / ``convert_custom_config_dict`` (observed custom modules,
    which stay float with their output grid in the reference model) as in ``convert``.
    """
    _check_common("lower_reference", model, inplace)
    if not inplace:
        model = copy.deepcopy(model)

    def walk(mod: nn.Module) -> nn.Module:
        for attr in _OBSERVER_ATTRS:
            if isinstance(mod._modules.get(attr), QuantDeQuant):
                mod._modules[attr] = mod._modules[attr].as_observer()  # type: ignore[union-attr]
        if isinstance(mod, _WeightQDQ):
            stand = _move_state(mod, mod.to_float())  # type: ignore[attr-defined]
            stand.qconfig = _frozen_weight_qconfig(mod, getattr(mod, "qconfig", None))
            return stand
        if isinstance(mod, FusedModule) and isinstance(mod[0], _WeightQDQ):
            mod.qconfig = _frozen_weight_qconfig(mod[0], getattr(mod, "qconfig", None))
            mod[0] = mod[0].to_float()
            return mod
        for cname, child in list(mod.named_children()):
            mod._modules[cname] = walk(child)
        return mod

    return _convert_int8(walk(model), mapping=mapping, inplace=True, return_report=return_report,
                         convert_custom_config_dict=convert_custom_config_dict)
