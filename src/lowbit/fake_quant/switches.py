"""A ``FakeQuantize``'s on / off switches and saved grid: the checks ``load_state_dict`` runs on them
(``switch_errors``, ``per_tensor_qparams``) and the assertions a traced switch read (``_assert_switch``) and a traced
fake quantization with the observer off (``assert_grid``) leave in a compiled or exported graph. Split from
``base.py`` (session 43) to keep it under ~400 lines.

A switch is a one-value ``uint8`` buffer read as ``== 1`` (torch.ao's ``FakeQuantize``); a saved switch must be 0 or
1, and a per-tensor module's saved ``(1,)`` grid (torch.ao's shape) loads as 0-d.

>>> import torch
>>> sd = {"scale": torch.tensor([0.5]), "zero_point": torch.tensor([3])}
>>> per_tensor_qparams(type("M", (), {"ch_axis": None})(), sd, "")
>>> sd["scale"].shape, sd["zero_point"].shape
(torch.Size([]), torch.Size([]))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["assert_grid", "grid_shape_errors", "per_tensor_qparams", "switch_errors"]

_SWITCH_METHODS = {"observer_enabled": "enable_observer(...)", "fake_quant_enabled": "enable_fake_quant(...)",
                   "learning_enabled": "toggle_qparam_learning(...)"}


def _assert_switch(fq: nn.Module, name: str, buf: torch.Tensor, on: bool) -> None:
    """Traced only: the graph raises when switch ``name`` no longer reads as it was traced (``on``), i.e. its buffer
    was written in place or reassigned after tracing without the switch methods, a load or an eager forward."""
    same = torch.eq(buf[0], 1) if on else torch.ne(buf[0], 1)
    method = _SWITCH_METHODS.get(name, "its method")
    torch._assert_async(same, f"{type(fq).__name__}: switch {name} was traced {'on (1)' if on else 'off (0)'} but its "
                        "buffer now reads otherwise: a write in place or a reassignment after torch.compile / "
                        f"torch.export traced it does not reach the traced program; set it with {method} (or "
                        "model.apply(Q.enable_observer / Q.disable_observer / ...), load_state_dict, or one eager "
                        "forward), then call the compiled model again (an exported program: export it again)")


def assert_grid(fq: nn.Module, message: str) -> None:
    """Traced only: the graph raises ``message`` when ``fq`` fake-quantizes on the placeholder grid, i.e. its
    ``scale`` is all 1.0 and its observer's ``min_val`` / ``max_val`` hold no finite range (``FakeQuantize._has_grid``
    on tensors). Nothing is added for a loaded grid, a learning ``LearnableFakeQuantize`` or an observer that keeps no
    range (those count as holding a grid, as in eager)."""
    if getattr(fq, "_grid_loaded", False) or ("learning_enabled" in fq._SWITCHES and fq._switch("learning_enabled")):
        return
    obs = fq.activation_post_process
    lo, hi = getattr(obs, "min_val", None), getattr(obs, "max_val", None)
    if not (isinstance(lo, torch.Tensor) and isinstance(hi, torch.Tensor)) or lo.is_meta:
        return
    seen = (torch.isfinite(lo).all() & torch.isfinite(hi).all()) | (fq.scale.detach() != 1.0).any()
    torch._assert_async(seen, f"{type(fq).__name__} (traced): " + message.format(scale="1.0", zero_point="its seed"))


def switch_errors(fq: nn.Module, state_dict: dict[str, Any], prefix: str) -> list[str]:
    """The saved switches (``fq._SWITCHES``) that are not 0 or 1: the forward tests ``== 1`` (torch.ao's
    ``FakeQuantize``) where torch's fused kernel tests ``!= 0``, and a float ``0.5`` was cast to an off ``uint8``, so
    such a value loaded as a switch that was on in one path and off in another (eager vs compiled). A wrong shape is
    left to ``load_state_dict``'s size check.

    >>> import torch, lowbit as Q
    >>> switch_errors(Q.FakeQuantize(), {"observer_enabled": torch.tensor([2], dtype=torch.uint8)}, "")
    ['observer_enabled=2 (torch.uint8) is not a switch: expected 0 (off) or 1 (on)']
    """
    errors = []
    for name in fq._SWITCHES:
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_meta:
            continue
        v = value.detach().reshape(()).cpu()
        ok = not v.is_complex() and bool(((v == 0) | (v == 1)).item())
        if not ok:
            errors.append(f"{prefix}{name}={v.item()!r} ({value.dtype}) is not a switch: expected 0 (off) or 1 (on)")
    return errors


def per_tensor_qparams(fq: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """A per-tensor module's ``scale`` / ``zero_point`` as 0-d tensors in ``state_dict`` (in place): torch.ao saves
    them with shape ``(1,)``, which lowbit kept, so a loaded module held a ``(1,)`` grid where its own is ``()``."""
    if fq.ch_axis is not None:
        return
    for name in ("scale", "zero_point"):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() > 0:
            state_dict[prefix + name] = value.reshape(())


def grid_shape_errors(fq: nn.Module, state_dict: dict[str, Any], prefix: str) -> list[str]:
    """The saved ``scale`` / ``zero_point`` whose shape does not fit the module: a per-tensor one (``ch_axis`` None)
    keeps one value (0-d, or torch.ao's ``(1,)``), a per-channel one a ``(C,)`` vector (or the unsized 0-d seed), the
    two of one length. Such a grid was adopted by the load's resize and failed only on the next forward, deep in
    the fake quantization ("per-tensor qparams must be scalars").

    >>> import torch, lowbit as Q
    >>> grid_shape_errors(Q.FakeQuantize(), {"scale": torch.ones(3), "zero_point": torch.zeros(3)}, "")
    ['scale: a per-tensor FakeQuantize keeps one value, got shape (3,)', \
'zero_point: a per-tensor FakeQuantize keeps one value, got shape (3,)']
    """
    errors, shapes = [], {}
    for name in ("scale", "zero_point"):
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor):
            continue
        shapes[name] = tuple(value.shape)
        if fq.ch_axis is None and value.numel() != 1:
            errors.append(f"{prefix}{name}: a per-tensor {type(fq).__name__} keeps one value, got shape "
                          f"{tuple(value.shape)}")
        elif fq.ch_axis is not None and value.dim() > 1:
            errors.append(f"{prefix}{name}: a per-channel {type(fq).__name__} keeps a (C,) vector, got shape "
                          f"{tuple(value.shape)}")
    if not errors and fq.ch_axis is not None and len(shapes) == 2 and len(set(shapes.values())) == 2 \
            and all(len(v) == 1 for v in shapes.values()):
        errors.append(f"{prefix}scale shape {shapes['scale']} != {prefix}zero_point shape {shapes['zero_point']} "
                      f"({type(fq).__name__})")
    return errors
