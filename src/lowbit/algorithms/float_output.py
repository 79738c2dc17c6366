"""``fuse_dequantize``: int8 Linears read only by float ops give their float result directly.

In a graph-mode model (``convert_fx``), a quantized ``Linear``/``LinearReLU`` whose every user is a
``DeQuantize`` node becomes a ``LinearFloatOut``: same int8 input grid, int8 weights and int32
accumulation, but the epilogue returns ``acc · s_x s_w + bias`` in float instead of requantizing to
the calibrated output grid and dequantizing at once. The layer still runs on the int8 kernels; one
8-bit rounding (and its clipping of outlier channels) disappears, and so does the work of that
requantize/dequantize pair. Modules inside untraceable parents (prepared one by one as their own
graphs) are handled too.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4), nn.Softmax(-1)).eval()
>>> x = torch.randn(32, 8)
>>> prepared = Q.prepare_fx(model, Q.get_default_qconfig(), example_inputs=(x,))
>>> _ = prepared(x)
>>> qmodel = Q.convert_fx(prepared)
>>> Q.fuse_dequantize(qmodel)                              # both Linears feed float ops (GELU, softmax)
['0', '2']
>>> bool((qmodel(x) - model(x)).abs().max() < 0.02)
True
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from ..nn.quantized.linear import Linear, LinearReLU
from ..nn.quantized.linear_float_out import LinearFloatOut
from ..nn.quantized.stubs import DeQuantize

__all__ = ["fuse_dequantize"]


def _set(gm: nn.Module, path: str, mod: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, mod)


def fuse_dequantize(model: nn.Module) -> list[str]:
    """Swap, in place, every quantized Linear whose only users are ``DeQuantize`` nodes; return their names.

    ``model``: a graph-mode converted model (or a model holding such graphs). Eager-mode modules
    (no graph) are left as they are, and so are the Linears of a float64 model (its ``DeQuantize`` returns float64).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_dequantize: model must be an nn.Module, got {type(model).__name__}")
    names = {id(m): n for n, m in model.named_modules()}
    done: list[str] = []
    for gm in list(model.modules()):
        if not isinstance(gm, fx.GraphModule):
            continue
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_module":
                continue
            mod = gm.get_submodule(node.target)
            if type(mod) not in (Linear, LinearReLU):
                continue
            users = list(node.users)
            if not users or not all(u.op == "call_module" and isinstance(gm.get_submodule(u.target), DeQuantize)
                                    for u in users):
                continue
            if sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == node.target) > 1:
                continue  # a module called at several sites: leave it
            if any(gm.get_submodule(u.target).out_dtype is not None for u in users):
                continue  # a float64 model's DeQuantize (float64 out; LinearFloatOut returns float32): leave it
            _set(gm, node.target, LinearFloatOut.from_linear(mod))
            for u in users:
                u.replace_all_uses_with(node)
                gm.graph.erase_node(u)
            prefix = names.get(id(gm), "")
            done.append(f"{prefix}.{node.target}" if prefix else str(node.target))
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
    return done
