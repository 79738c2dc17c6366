"""What graph mode does with module hooks before it traces a model.

torch.fx records a module call as a ``call_module`` node or traces into its ``forward``; it runs no hooks. Two kinds
of hook matter:

- the forward pre-hooks of the legacy ``torch.nn.utils.weight_norm`` / ``spectral_norm``, which recompute the
  weight on every call (``W = g v / ||v||``, ``W = W_orig / sigma``): graph mode bakes them first, each module's
  weight becomes the plain parameter ``W`` as computed now (spectral norm: no power iteration), as
  ``remove_weight_norm`` / ``remove_spectral_norm`` do. Left in place, fusion copied the hook onto the fused module
  (``'ConvReLU2d' object has no attribute 'weight_g'``) and the deep copy failed on the computed weight;
- every other user forward hook or pre-hook (on the root, a traced-through module or a module swapped for its
  quantized twin) is not part of the quantized model, so ``prepare_fx`` names them in a warning (a hook changing a value was lost
  silently: 2-6 dB against the float model, torch.ao's graph mode alike).

>>> import torch
>>> from torch import nn
>>> m = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(3, 2)))
>>> w = m[0].weight.detach().clone()
>>> bake_legacy_norms(m)
['0.weight']
>>> type(m[0].weight).__name__, bool(torch.equal(m[0].weight, w)), len(m[0]._forward_pre_hooks)
('Parameter', True, 0)
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm, remove_spectral_norm
from torch.nn.utils.weight_norm import WeightNorm, remove_weight_norm

__all__ = ["copy_model", "bake_legacy_norms", "baked_copy", "warn_user_hooks"]

_NORMS = (WeightNorm, SpectralNorm)


def _norm_hooks(mod: nn.Module) -> list[WeightNorm | SpectralNorm]:
    return [h for h in mod._forward_pre_hooks.values() if isinstance(h, _NORMS)]


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, the weights a legacy norm hook computed (non-leaf tensors after a forward with
    gradients, which ``deepcopy`` refuses) copied detached."""
    memo: dict[int, object] = {}
    for mod in model.modules():
        for hook in _norm_hooks(mod):
            w = mod.__dict__.get(hook.name)
            if isinstance(w, torch.Tensor) and not w.is_leaf:
                memo[id(w)] = w.detach().clone()
    return copy.deepcopy(model, memo)


def bake_legacy_norms(model: nn.Module) -> list[str]:
    """Remove every legacy weight / spectral norm hook of ``model``, in place, keeping the weight it computes now as a
    plain parameter; return the baked parameters' names (``"conv.weight"``)."""
    baked = []
    for path, mod in model.named_modules():
        for hook in _norm_hooks(mod):
            (remove_weight_norm if isinstance(hook, WeightNorm) else remove_spectral_norm)(mod, hook.name)
            baked.append(f"{path}.{hook.name}" if path else hook.name)
    return baked


def baked_copy(model: nn.Module, fn: str, is_qat: bool, inplace: bool) -> nn.Module:
    """``model`` (``inplace``) or its copy, legacy norms baked (``bake_legacy_norms``); in QAT a warning names them."""
    model = model if inplace else copy_model(model)
    baked = bake_legacy_norms(model)
    if baked and is_qat:
        warnings.warn(f"{fn}: legacy weight_norm / spectral_norm on {baked} baked into plain weights (QAT trains them "
                      "directly); use torch.nn.utils.parametrizations to keep the reparametrization", stacklevel=4)
    return model


def warn_user_hooks(model: nn.Module, fn: str, leaves: set[int], swapped: set[type]) -> None:
    """Warn, naming each module (``<root>`` for the model), whose forward hooks / pre-hooks the prepared and
    quantized model lose: the root, a module traced through (one with children), a module of a ``swapped`` type with a
    qconfig; not one inside a leaf (``leaves``: module ids, kept whole) or a childless float module (kept, with its
    hooks)."""
    inside: set[int] = set()
    for mod in model.modules():
        if id(mod) in leaves:
            inside.update(id(m) for m in mod.modules())
    hooked = [f"{path or '<root>'!r} ({type(mod).__name__})" for path, mod in model.named_modules()
              if (mod._forward_hooks or mod._forward_pre_hooks) and id(mod) not in inside
              and (mod is model or any(True for _ in mod.children())
                   or (type(mod) in swapped and getattr(mod, "qconfig", None) is not None))]
    if hooked:
        warnings.warn(f"{fn}: forward hooks / pre-hooks on {', '.join(hooked)} are not part of the quantized model "
                      "(torch.fx traces module calls, not their hooks): a hook that changes a value is lost; fold it "
                      "into forward() or remove it before preparing", stacklevel=4)
