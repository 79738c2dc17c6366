"""What ``prepare`` attaches and ``convert`` removes: the forward hooks that observe outputs and float
inputs, the tag that marks a tensor an observed module produced, and the module classes the two
treat specially.

A tensor an observed module returned carries the tag (it is quantized after ``convert``); ReLU /
MaxPool / Flatten / Dropout / Identity pass it on. A weighted module observes only untagged float
inputs (``input_activation_post_process``), the grid ``convert`` records as ``input_grid``.

>>> import torch
>>> from torch import nn
>>> relu = nn.ReLU()
>>> _ = relu.register_forward_pre_hook(_note_tag), relu.register_forward_hook(_pass_tag)
>>> _tagged(relu(_tag(torch.ones(2)))), _tagged(relu(torch.ones(2)))
(True, False)
>>> y = _tag(torch.ones(2))
>>> y += 1                                   # written in place: no longer an observed module's output
>>> _tagged(y)
False
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..fake_quant import FakeQuantize, LearnableFakeQuantize
from ..nn.intrinsic import FusedModule
from ..nn.intrinsic.qat.modules import BnFoldedBase
from ..observer.base import ObserverBase
from ..qconfig import QConfig
from ..qscheme import per_channel_affine_float_qparams, quint4, quint8
from ..qtensor import QTensor
from ..qtensor.resample import bilinear_on_grid
from ..stubs import DeQuantStub

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


_TAG = "_lowbit_observed"  # set on tensors an observed module returned: quantized after convert
_GRID = "_lowbit_grid"  # a weak reference to the observer / fake-quant whose grid a tagged tensor is on
_NO_VERSION = -1  # an inference tensor (calibration under torch.inference_mode) has no version counter


def _version(t: torch.Tensor) -> int:
    return _NO_VERSION if t.is_inference() else t._version


def _tag(t: Any, grid: nn.Module | None = None) -> Any:
    """Tag ``t`` with its version: an in-place write afterwards (``y += z``) unmarks it. ``grid``: the observer /
    fake-quant whose grid ``t`` is on (``_grid_module``; a weak reference: a kept tensor keeps no module alive, a
    deep copy copies no module)."""
    if isinstance(t, torch.Tensor):
        setattr(t, _TAG, _version(t))
        if grid is not None:
            setattr(t, _GRID, weakref.ref(grid))
    return t


def _tagged(t: Any) -> bool:
    """``t`` carries the tag, or is a view of a tensor that does: ``torch.flatten(x, 1)``, ``x.view(...)``,
    ``x.permute(...)``, ``x[:, :k]`` keep the codes after ``convert`` (QTensor's integer-preserving ops), so the
    next layer must not observe them as a float input of its own (the QAT model would fake-quantize them twice, on a
    grid the converted model never uses). A tensor written in place since (``y += z``, a view's ``add_``: views share
    the version counter) is not: its values left the grid, and after ``convert`` the write made a float tensor (a
    QTensor's ``+=`` runs on float values), so the next layer observes it as a float input and records its grid."""
    if not isinstance(t, torch.Tensor):
        return False
    base = t._base
    tag = getattr(t, _TAG, None)
    if tag is None and base is not None:
        tag = getattr(base, _TAG, None)
    return tag is not None and tag == _version(t)


def _grid_module(t: Any) -> nn.Module | None:
    """The observer / fake-quant whose grid tagged ``t`` (or the tensor it is a view of) is on, else ``None``."""
    if not _tagged(t):
        return None
    ref = getattr(t, _GRID, None)
    if ref is None and t._base is not None and getattr(t, _TAG, None) is None:
        ref = getattr(t._base, _GRID, None)
    return ref() if ref is not None else None


def _observe_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook ``prepare`` registers: the output goes through ``activation_post_process``. An output that is
    one of the module's inputs (``QuantStub`` returns its input, and so does the observer) is tagged as an alias,
    never the caller's own tensor: a calibration batch tagged by one prepared model read as "already quantized" in
    every later one, whose first layer then recorded no input grid (float inputs quantized dynamically)."""
    out = module.activation_post_process(output)
    if isinstance(out, torch.Tensor) and any(out is i for i in inputs):
        out = out.view_as(out)
    return _tag(out, module.activation_post_process)


_IN_TAGGED = "_lowbit_input_tagged"  # what _note_tag saw before the forward, for _pass_tag after it


def _note_tag(module: nn.Module, inputs: Any) -> None:
    """Forward pre-hook on QTensor-native modules: whether the input is tagged, read before the forward (an in-place
    module, ``nn.ReLU(inplace=True)``, writes its input: its version moves, yet its values stay on the grid)."""
    tagged = bool(inputs) and _tagged(inputs[0])
    grid = _grid_module(inputs[0]) if tagged else None
    module.__dict__[_IN_TAGGED] = (weakref.ref(grid) if grid is not None else True) if tagged else False


def _pass_tag(module: nn.Module, inputs: Any, output: Any) -> None:
    """Forward hook on QTensor-native modules (ReLU, MaxPool, ...): a quantized input stays quantized."""
    seen = module.__dict__.pop(_IN_TAGGED, False)
    if seen:
        _tag(output, seen() if isinstance(seen, weakref.ref) else None)


def _observe_float_input(module: nn.Module, inputs: Any) -> Any:
    """Forward pre-hook of weighted modules: observe (QAT: fake-quantize) an input no observed module made."""
    x = inputs[0] if inputs else None
    if isinstance(x, torch.Tensor) and x.is_floating_point() and not _tagged(x):
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


# ---- functionals the int8 model runs on the codes: the simulation keeps the input's grid too ---------------------
_INTERPOLATE = inspect.signature(F.interpolate)
_MAX_POOLS = (F.max_pool1d, F.max_pool2d, F.max_pool3d)
_MODES = "_lowbit_shared_grid_modes"  # the root's active modes (one per nested call)


def _rounding_grid(obs: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int, int | None] | None:
    """``(scale, zero_point, quant_min, quant_max, axis)`` of the grid ``obs``'s forward rounds onto: an enabled
    ``FakeQuantize`` (LSQ: its learned grid), or a reference model's ``QuantDeQuant``; ``None`` for an observer (its
    forward returns its input), a disabled fake-quant or a float zero point."""
    if isinstance(obs, FakeQuantize):
        if obs.fake_quant_enabled[0] != 1 or obs.qscheme.has_float_zero_point:
            return None
        s, z = obs.scale.detach(), obs.zero_point.detach()
        if isinstance(obs, LearnableFakeQuantize):  # (its calculate_qparams clamps the scale in place: no version bump
            s, z = s.clamp(min=obs.eps), z.round().clamp(obs.quant_min, obs.quant_max)  # under autograd here)
            if obs.symmetric_zero_point is not None:
                z = torch.full_like(z, obs.symmetric_zero_point)
        return s, z, obs.quant_min, obs.quant_max, obs.ch_axis
    if isinstance(obs, ObserverBase) or not isinstance(getattr(obs, "scale", None), torch.Tensor):
        return None
    qdtype = getattr(obs, "qdtype", None)
    if qdtype is None or not isinstance(getattr(obs, "zero_point", None), torch.Tensor):
        return None
    return obs.scale, obs.zero_point, qdtype.quant_min, qdtype.quant_max, None


def _share_interpolate(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """``F.interpolate`` of a tagged tensor (an observed module's output): nearest modes select its values (tagged,
    as the int8 model's codes); bilinear goes through the input's observer again (graph mode's ``obs_share``: the
    calibration sees it, QAT fake-quantizes it on the input's grid) and takes the int8 kernel's codes
    (``bilinear_on_grid``). Anything the int8 model runs in float (antialias, bicubic, a per-channel grid along a
    resampled axis) is left alone."""
    a = _INTERPOLATE.bind(*args, **kwargs).arguments
    x, mode = a["input"], a.get("mode", "nearest")
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not _tagged(x):
        return out
    obs = _grid_module(x)
    if mode in ("nearest", "nearest-exact"):
        return _tag(out, obs)
    if mode != "bilinear" or a.get("antialias", False) or x.dim() != 4 or obs is None:
        return out
    axis = getattr(obs, "ch_axis", None)
    if axis is not None and axis % 4 >= 2:
        return out
    on_codes = getattr(obs, "resample_on_codes", None)
    if on_codes is not None:  # an export twin's QDQ: a Resize of the codes in the file (lowbit.export.codes)
        rest = {k: v for k, v in a.items() if k != "input"}
        return _tag(on_codes(x, lambda c: F.interpolate(c, **rest)), obs)
    y = obs(out)
    grid = _rounding_grid(obs)
    if grid is not None:
        s, z, qmin, qmax, ch = grid
        y = bilinear_on_grid(x, y, s, z, qmin, qmax, None if ch is None else ch % 4, a.get("size"),
                             a.get("scale_factor"), a.get("align_corners"), a.get("recompute_scale_factor"))
    return _tag(y, obs)


class _SharedGrids(TorchFunctionMode):
    """Active while a prepared eager model runs (its root's hooks): ``F.interpolate`` (``nn.Upsample``,
    ``F.upsample*``) and functional max pooling of an observed module's output keep its grid, as the int8 model's
    QTensor ops do; the next weighted layer then reads them as quantized (no input observer of its own)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.interpolate and args:
            return _share_interpolate(args, kwargs, out)
        if func in _MAX_POOLS and args and isinstance(out, torch.Tensor) and _tagged(args[0]):
            return _tag(out, _grid_module(args[0]))
        return out


def _enter_shared_grids(module: nn.Module, args: Any) -> None:
    """Forward pre-hook ``prepare`` / ``prepare_qat`` put on the root: the shared-grid mode on (``torch.compile``
    traces it: a compiled QAT model gives the eager one's values)."""
    mode = _SharedGrids()
    mode.__enter__()
    module.__dict__.setdefault(_MODES, []).append(mode)


def _exit_shared_grids(module: nn.Module, args: Any, output: Any) -> None:
    """Its forward hook (``always_call``: after an exception too): the mode off."""
    modes = module.__dict__.get(_MODES)
    if modes:
        modes.pop().__exit__(None, None, None)


def _install_shared_grids(root: nn.Module) -> None:
    if _enter_shared_grids not in root._forward_pre_hooks.values():
        root.register_forward_pre_hook(_enter_shared_grids)
        root.register_forward_hook(_exit_shared_grids, always_call=True)


_HOOKS = (_observe_output, _pass_tag, _note_tag, _observe_float_input, _observe_input, _enter_shared_grids,
          _exit_shared_grids)
_OWN_HOOKS = (*_HOOKS, _dequantize_input)  # everything the workflow registers: never copied as a user's hook


def _remove_observer_hooks(mod: nn.Module) -> None:
    for hooks in (mod._forward_hooks, mod._forward_pre_hooks):
        for key in [k for k, h in hooks.items() if h in _HOOKS]:
            del hooks[key]
            mod._forward_hooks_always_called.pop(key, None)
    mod.__dict__.pop(_IN_TAGGED, None)
    mod.__dict__.pop(_MODES, None)


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
