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

import sys
import weakref
from typing import Any

import torch
from torch import nn

from ..compile_state import tracing
from ..fake_quant import FakeQuantize
from ..nn.intrinsic import FusedModule
from ..nn.intrinsic.qat.modules import BnFoldedBase
from ..observer.base import ObserverBase
from ..qconfig import QConfig
from ..qscheme import per_channel_affine_float_qparams, quint4, quint8
from ..qtensor import QTensor
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
    if tracing():  # dynamo cannot trace is_inference(), and reads _version as a data-dependent symbol: a traced
        return 0   # program does not see an in-place write to a tagged tensor (``y += z``) unmark it
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
    every later one, whose first layer then recorded no input grid (float inputs quantized dynamically). An integer
    output (token ids, a bool mask through ``QuantWrapper``'s ``QuantStub``) that its observer / fake-quant refuses
    with a ``TypeError`` is refused naming the module, not only the observer (decided on the output's dtype, never on
    the observer's wording: a ``FakeQuantize`` words it otherwise); an observer that takes integers keeps them."""
    try:
        out = module.activation_post_process(output)
    except TypeError:
        if not isinstance(output, torch.Tensor) or output.is_floating_point():
            raise
        where = module.__dict__.get("_lowbit_where", f"a {type(module).__name__}")
        raise TypeError(f"{where} gives a {output.dtype} tensor of shape {tuple(output.shape)} to its "
                        f"{type(module.activation_post_process).__name__}, which observes float activations only: "
                        "token ids / indices are not quantized (put the QuantStub after the Embedding, or give this "
                        "module qconfig=None)") from None
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


_MODES = "_lowbit_shared_grid_modes"  # the root's active shared-grid modes (one per nested call; shared_grids.py)
_FRAMES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # mode -> the frame of its forward


def _enter_shared_grids(module: nn.Module, args: Any) -> None:
    """Forward pre-hook ``prepare`` / ``prepare_qat`` put on the root: the shared-grid mode on (``torch.compile``
    traces it: a compiled QAT model gives the eager one's values)."""
    from .shared_grids import SharedGrids  # (it imports this module)

    modes, mode, eager = module.__dict__.setdefault(_MODES, []), SharedGrids(), not torch.compiler.is_compiling()
    if modes and eager:
        _drop_abandoned(modes)
    if eager:
        _FRAMES[mode] = sys._getframe(1)  # the root's _call_impl, on the call stack until its forward returns / raises
    mode.__enter__()
    modes.append(mode)


def _drop_abandoned(modes: list[Any]) -> None:
    """Turn off the modes of forwards a ``BaseException`` ended (a ``KeyboardInterrupt``: torch runs always-called
    hooks after an ``Exception`` only; the mode stayed on for every later torch call of the process): those on top of
    this thread's mode stack whose forward's frame is no longer on this thread's call stack."""
    live, f = [], sys._getframe(2)
    while f is not None:
        live.append(f)
        f = f.f_back
    stack = torch.overrides._get_current_function_mode_stack()
    while modes and stack and stack[-1] is modes[-1] and not any(f is _FRAMES.get(modes[-1]) for f in live):
        modes.pop().__exit__(None, None, None)
        stack.pop()


def _exit_shared_grids(module: nn.Module, args: Any, output: Any) -> None:
    """Its forward hook (``always_call``: after an exception too): the mode off."""
    modes = module.__dict__.get(_MODES)
    if modes:
        mode = modes.pop()
        _FRAMES.pop(mode, None)
        mode.__exit__(None, None, None)


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
