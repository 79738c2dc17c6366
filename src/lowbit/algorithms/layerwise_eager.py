"""Eager-mode layer-wise reconstruction (``reconstruct_eager``): ``reconstruct``'s per-layer AdaRound and bias
correction for models prepared with ``prepare`` (no graph to walk).

The layer order is the order the weighted layers first run on the first calibration batch. For each layer ``L`` the
simulated int8 model (activation observers fake-quantizing on their calibrated grids) gives ``L``'s quantized input
``x_q`` and a float copy of the model gives its float input ``x_f``; ``L``'s codes are then learned (or rounded to
nearest) to minimise ``||W_q x_q - W x_f||²`` and its bias corrected by the mean output error, as in graph mode
(``layerwise_step._layer``).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> m = nn.Sequential(Q.QuantStub(), nn.Linear(8, 4), Q.DeQuantStub()).eval()
>>> p = Q.prepare(m, Q.get_default_qconfig())
>>> x = torch.randn(32, 8)
>>> _ = p(x)
>>> [c.name for c in reconstruct_eager(p, [x], iters=5, progress=False)]
['1']
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .layers import is_weighted, rounded_before, split, weight_codes
from .layerwise_step import LayerChange, _check_steps, _layer, batch_tuples, patch_observers

__all__ = ["reconstruct_eager"]


def _run(model: nn.Module, batch: tuple[Any, ...]) -> None:
    model(*batch)


def _capture(model: nn.Module, mod: nn.Module, batches: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    got: list[torch.Tensor] = []
    h = mod.register_forward_pre_hook(lambda _m, args: got.append(args[0].detach()))
    try:
        with torch.no_grad():
            for b in batches:
                _run(model, b)
    finally:
        h.remove()
    return got


def reconstruct_eager(prepared: nn.Module, calib: Iterable[Any], adaround: bool = True, bias_correction: bool = True,
                      iters: int = 500, batch_size: int = 8, seed: int = 0, progress: bool = True) -> list[LayerChange]:
    """``reconstruct`` for eager-mode prepared models: per layer, one float and one simulated-int8 model pass.

    The layer order is the order the layers first run on the first batch.
    """
    from tqdm.auto import tqdm

    seed = _check_steps("reconstruct_eager", iters, batch_size, seed)  # a NumPy / torch integer: a Python int
    batches, g = batch_tuples(calib, "reconstruct_eager"), torch.Generator().manual_seed(seed)
    names = {m: n for n, m in prepared.named_modules()}
    float_model = copy.deepcopy(prepared)  # before the order hooks, which must not travel with the copy
    fnames = dict(float_model.named_modules())
    order: list[nn.Module] = []
    hooks = [m.register_forward_pre_hook(lambda m, _a: order.append(m) if m not in order else None)
             for m in prepared.modules() if is_weighted(m)]
    obs = patch_observers(prepared, "float")
    try:
        with torch.no_grad():
            _run(prepared, batches[0])
    finally:
        for h in hooks:
            h.remove()
    patch_observers(float_model, "float")
    changes, quant = [], []
    try:
        for m in obs:
            del m.forward
        quant = patch_observers(prepared, "quant")  # (also transposed convs: on their int8 weights)
        holders: dict[int, nn.Module] = {}  # a weight tied to an earlier layer's keeps the codes that layer learned
        corrected: set[int] = set()
        for mod in tqdm(order, desc="adaround" if adaround else "bias correction", disable=not progress):
            xq = _capture(prepared, mod, batches)
            fmod = fnames[names[mod]]  # the float layer (mod's weight may be tied to one already rounded)
            xf = _capture(float_model, fmod, batches)
            op = split(mod)[0]
            again = rounded_before(mod, holders)
            fix = bias_correction and (op.bias is None or id(op.bias) not in corrected)
            with torch.enable_grad():
                _, rec = _layer(names[mod], mod, xq, xf, adaround and not again, fix, iters, batch_size, g,
                                codes=weight_codes(mod)[0] if again else None, freeze=not again, float_mod=fmod)
            holders.setdefault(id(op.weight), mod)
            corrected.update({id(op.bias)} if op.bias is not None and fix else set())
            changes.append(rec)
    finally:
        for m in (*obs, *quant):
            m.__dict__.pop("forward", None)
    return changes
