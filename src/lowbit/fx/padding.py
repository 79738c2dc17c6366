"""Padding left out of calibration statistics: the tokens whose ``attention_mask`` is 0.

A model whose ``forward`` takes an argument named ``attention_mask`` (Hugging Face's convention: a ``(batch,
tokens)`` tensor, 1 at real tokens, 0 at padding) gets two hooks on its root (``attach``): each call puts its mask
(read by the forward's signature, positional or keyword) on a thread-local stack for the length of the call.
While a mask is there, ``real_rows(x, mask)`` (``lowbit.batches.real_rows``, re-exported here) keeps the rows of
``x`` at real tokens: ``x`` of shape ``(batch, tokens, channels)`` or with the tokens flattened, ``(batch * tokens,
channels)``, gives ``(n, channels)``. A tensor of any other shape (a pooled ``(batch, hidden)``, attention scores
``(batch, heads, tokens, tokens)``, even where ``hidden`` or ``heads`` equals ``tokens``) is not filtered: its padding
cannot be told from its shape.

``prepare_fx`` hooks every activation observer (``hook_observers``): the observer folds only the real tokens into its
statistics (a ``(batch, tokens, channels)`` input's as ``(1, n, channels)``: a channel axis keeps its meaning) and its
output is the full tensor, as before. So a right- or left-padded batch calibrates as its unpadded
sequences do (padding's hidden states are computed like any token's, at positions and with ids the real text never
has, and they widened the grids). ``convert_fx`` removes the root hooks (``detach``). A mask that is not 2-D or holds
values other than 0 and 1 (an additive ``-inf`` mask) filters nothing. Rows are dropped by indexing, not by a 0
weight, so a NaN in a padded row cannot leak either.

>>> import torch
>>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
>>> x = torch.arange(6.0).reshape(2, 3, 1)
>>> real_rows(x, mask.bool()).flatten().tolist()
[0.0, 1.0, 3.0]
>>> real_rows(torch.zeros(2, 5), mask.bool()) is None  # (batch, hidden): padding cannot be told
True
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
from torch import nn

from ..batches import real_rows
from ..observer import ObserverBase

__all__ = ["attach", "detach", "current", "real_rows", "hook_observers"]

_LOCAL = threading.local()
_NAME = "attention_mask"


def _stack() -> list[torch.Tensor | None]:
    if not hasattr(_LOCAL, "masks"):
        _LOCAL.masks = []
    return _LOCAL.masks


def current() -> torch.Tensor | None:
    """The innermost running call's real-token mask (bool ``(batch, tokens)``), ``None`` when none or all real."""
    s = _stack()
    return s[-1] if s else None


def _as_mask(m: Any) -> torch.Tensor | None:
    if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.numel() == 0 or m.is_complex():
        return None
    if not bool(((m == 0) | (m == 1)).all()) or bool((m == 1).all()):
        return None
    return m.bool()


def _mask_of(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    if _NAME in kwargs:
        return _as_mask(kwargs[_NAME])
    names = [n for n, p in inspect.signature(mod.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    i = names.index(_NAME) if _NAME in names else len(args)
    return _as_mask(args[i]) if i < len(args) else None


def _push(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _stack().append(_mask_of(mod, args, kwargs))


def _pop(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    s = _stack()
    if s:
        s.pop()


def attach(model: nn.Module) -> bool:
    """Register the root hooks when ``model.forward`` takes ``attention_mask`` (once); whether it does."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if _NAME not in params:
        return False
    if _push not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_push, with_kwargs=True)
        model.register_forward_hook(_pop, with_kwargs=True, always_call=True)
    return True


def detach(model: nn.Module) -> None:
    """Remove ``attach``'s hooks (on a deep copy too: they are found by function, not by handle)."""
    for hooks, fn in ((model._forward_pre_hooks, _push), (model._forward_hooks, _pop)):
        for key in [k for k, f in hooks.items() if f is fn]:
            del hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)
            model._forward_hooks_with_kwargs.pop(key, None)
            model._forward_hooks_always_called.pop(key, None)


def _observe_pre(obs: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    mask = current()
    x = args[0] if args else None
    rows = real_rows(x, mask)
    if rows is None:
        return None
    if x.dim() == 3:
        rows = rows.unsqueeze(0)  # (1, n, channels): a channel axis keeps its meaning
    ch = getattr(obs, "ch_axis", None)
    if getattr(obs, "qscheme", None) is not None and obs.qscheme.is_per_channel and ch is not None:
        lead = 2 if x.dim() == 3 else 1  # dims of x whose meaning the indexing changed
        if ch % x.dim() < lead:  # the channel axis is the batch / token axis: nothing to filter
            return None
    obs.__dict__["_lowbit_full_input"] = x
    return (rows, *args[1:])


def _observe_post(obs: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return obs.__dict__.pop("_lowbit_full_input", output)


def hook_observers(model: nn.Module) -> int:
    """Make every activation observer of a prepared ``model`` skip padding (module docstring); how many."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, ObserverBase) and name.rpartition(".")[2].startswith("activation_post_process"):
            m.register_forward_pre_hook(_observe_pre)
            m.register_forward_hook(_observe_post, always_call=True)
            n += 1
    return n
