"""Save and restore calibration statistics alone: ``get_observer_state_dict`` / ``load_observer_state_dict``.

Calibrate once, keep only the observers' statistics (min/max, histograms, moving averages, a
``FakeQuantize``'s scale/zero point and switches), and load them into a freshly prepared copy of
the same model later::

    stats = get_observer_state_dict(prepared)       # {"fc.activation_post_process.min_val": ..., ...}
    load_observer_state_dict(prepare(model), stats)  # same model, prepared the same way

The entries are the ``state_dict`` items of every observer/fake-quant module that is not inside
another one (torch.ao keeps the keys containing ``"activation_post_process"``; lowbit also keeps
the graph-mode weight observers and a QAT layer's ``weight_fake_quant``, whose qparams ``convert``
reads). Loading adopts per-channel shapes from the checkpoint and raises ``RuntimeError`` naming
the keys when an observer of the model has no entry, or an entry names no observer of the model.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> model = nn.Sequential(Q.QuantStub(), nn.Linear(2, 2), Q.DeQuantStub())
>>> prepared = Q.prepare(model, Q.get_minmax_qconfig())
>>> _ = prepared(torch.randn(4, 2))
>>> stats = get_observer_state_dict(prepared)
>>> fresh = Q.prepare(model, Q.get_minmax_qconfig())
>>> load_observer_state_dict(fresh, stats)
>>> bool(torch.equal(fresh[1].activation_post_process.max_val, prepared[1].activation_post_process.max_val))
True
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from .base import ObserverBase

__all__ = ["get_observer_state_dict", "load_observer_state_dict"]


def _is_observer(m: nn.Module) -> bool:
    """An observer, or a fake-quant module (it wraps one and has the ``fake_quant_enabled`` switch; the
    fake-quant classes sit above this layer, so they are recognised by shape, not imported)."""
    inner = m._modules.get("activation_post_process")
    return isinstance(m, ObserverBase) or (isinstance(inner, ObserverBase) and "fake_quant_enabled" in m._buffers)


def _observers(mod: nn.Module) -> dict[str, nn.Module]:
    """``{path: observer}`` for the outermost observers / fake-quants of ``mod``."""
    found: dict[str, nn.Module] = {}

    def walk(m: nn.Module, path: str) -> None:
        for name, child in m.named_children():
            p = f"{path}.{name}" if path else name
            if _is_observer(child):
                found[p] = child
            else:
                walk(child, p)

    if _is_observer(mod):
        found[""] = mod
    else:
        walk(mod, "")
    return found


def get_observer_state_dict(mod: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The ``state_dict`` entries of ``mod``'s observers and fake-quants (keys as in ``mod.state_dict()``)."""
    if not isinstance(mod, nn.Module):
        raise TypeError(f"get_observer_state_dict: mod must be an nn.Module, got {type(mod).__name__}")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for path, obs in _observers(mod).items():
        for k, v in obs.state_dict().items():
            out[f"{path}.{k}" if path else k] = v
    return out


def load_observer_state_dict(mod: nn.Module, obs_dict: Any) -> None:
    """Load ``get_observer_state_dict`` output into ``mod``'s observers (in place)."""
    if not isinstance(mod, nn.Module):
        raise TypeError(f"load_observer_state_dict: mod must be an nn.Module, got {type(mod).__name__}")
    if not isinstance(obs_dict, dict):
        raise TypeError(f"load_observer_state_dict: obs_dict must be a dict of tensors, got {type(obs_dict).__name__}")
    used: set[str] = set()
    missing: list[str] = []
    subs: list[tuple[nn.Module, dict[str, Any]]] = []
    for path, obs in _observers(mod).items():  # every key checked before any observer is written
        head = f"{path}." if path else ""
        own = obs.state_dict()
        sub = {k[len(head):]: v for k, v in obs_dict.items() if k.startswith(head) and k[len(head):] in own}
        used.update(head + k for k in sub)
        # an observer's eps is optional: statistics saved before it was saved (session 36) keep the observer's own
        missing += [head + k for k in own if k not in sub and k.rsplit(".", 1)[-1] != "eps"]
        subs.append((obs, sub))
    if missing:
        raise RuntimeError(f"load_observer_state_dict: no saved statistics for observer keys {missing} (nothing loaded)")
    unexpected = [k for k in obs_dict if k not in used]
    if unexpected:
        raise RuntimeError(f"load_observer_state_dict: keys {unexpected} name no observer of this "
                           f"{type(mod).__name__} (was it prepared the same way?); nothing loaded")
    for obs, sub in subs:
        obs.load_state_dict(sub, strict=False)
