"""Fusion's leftovers: the submodules a fused run absorbed (its BN / ReLU modules) leave the ``GraphModule``.

``fuse_graph`` puts the run's modules inside one fused module (``nni.ConvBnReLU2d`` ...), which holds the same BN
object. Left under its old name as well, ``model.train()`` reached the BN there and put a frozen one
(``freeze_bn_stats``) back in training mode, its running statistics updating silently, and ``state_dict`` carried each
such BN twice; torch.ao's fusion drops them. Checkpoints saved with those names still load: their keys are skipped.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import fx, nn

__all__ = ["drop_absorbed"]


def drop_absorbed(gm: fx.GraphModule, targets: list[str]) -> None:
    """Delete the submodules a fusion absorbed (``targets``: a fused run's BN / ReLU module paths) from ``gm`` when no
    node reads them any more."""
    used = [str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")]
    dropped = tuple(name for name in targets if not any(u == name or u.startswith(name + ".") for u in used))
    for name in dropped:
        gm.delete_submodule(name)
    if dropped:  # checkpoints saved before held them: their keys (the fused module's tensors again) are skipped
        gm.register_load_state_dict_pre_hook(functools.partial(_skip_dropped, dropped))


def _skip_dropped(dropped: tuple[str, ...], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  *_: Any) -> None:
    """``drop_absorbed``'s load pre-hook: forget the keys under a dropped name the model does not have again."""
    present = {n for n, _ in module.named_modules(remove_duplicate=False)}
    for name in set(dropped) - present:
        for key in [k for k in state_dict if k.startswith(f"{prefix}{name}.")]:
            del state_dict[key]
