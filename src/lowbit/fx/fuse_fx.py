"""``fuse_fx``: graph-mode fusion alone (torch.ao's ``quantize_fx.fuse_fx``), no observers.

Traces the model (``lowbit.fx.trace``: an untraceable submodule stays a leaf) and fuses the same
runs ``prepare_fx`` fuses — conv/linear-BN(-ReLU), conv/linear-ReLU, BN-ReLU, ConvTranspose-BN,
``relu(a + b)`` → ``add_relu``, ``relu(F.linear(...))`` → ``linear_relu`` — plus the patterns
registered in ``lowbit.fusion_registry``, whether or not modules carry a qconfig. In eval mode a
BN is folded into the layer before it (the fused model computes the same function); in train mode
conv-BN runs become the QAT markers (``nni.ConvBn2d`` ...) that ``prepare_qat_fx`` trains.

>>> import torch
>>> from torch import nn
>>> m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
>>> f = fuse_fx(m)
>>> [type(f.get_submodule(n.target)).__name__ for n in f.graph.nodes if n.op == "call_module"]
['ConvReLU2d']
>>> x = torch.randn(2, 1, 6, 6)
>>> torch.allclose(f(x), m(x), atol=1e-5)
True
"""

from __future__ import annotations

import copy
from typing import Any

from torch import fx, nn

from ..custom_config import FuseCustomConfig
from .fusion import fuse_graph
from .custom import check_preservable, preserved_value
from .trace import trace

__all__ = ["fuse_fx"]


def fuse_fx(model: nn.Module, fuse_custom_config: Any = None) -> fx.GraphModule:
    """A fused ``GraphModule`` of ``model`` (a copy; the model is not modified).

    ``fuse_custom_config``: a ``lowbit.custom_config.FuseCustomConfig`` (or torch.ao's, or
    ``{"preserved_attributes": [...]}``): attributes of ``model`` kept on the result.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_fx: model must be an nn.Module, got {type(model).__name__}")
    if fuse_custom_config is None:
        cfg = FuseCustomConfig()
    elif isinstance(fuse_custom_config, FuseCustomConfig):
        cfg = fuse_custom_config
    elif isinstance(fuse_custom_config, dict):
        cfg = FuseCustomConfig.from_dict(fuse_custom_config)
    elif hasattr(fuse_custom_config, "to_dict"):
        cfg = FuseCustomConfig.from_dict(fuse_custom_config.to_dict())
    else:
        raise TypeError(f"fuse_fx: fuse_custom_config must be None, a dict or a FuseCustomConfig, "
                        f"got {type(fuse_custom_config).__name__}")
    training = model.training
    gm, _ = trace(copy.deepcopy(model))
    fuse_graph(gm, is_qat=training, require_qconfig=False)
    gm.delete_all_unused_submodules()
    gm.recompile()
    for name in cfg.preserved_attributes:
        if not hasattr(model, name):
            raise ValueError(f"fuse_fx: preserved attribute {name!r} is not an attribute of {type(model).__name__}")
        check_preservable(model, gm, name, "fuse_fx")
        setattr(gm, name, preserved_value(model, gm, name))
    return gm.train(training)
