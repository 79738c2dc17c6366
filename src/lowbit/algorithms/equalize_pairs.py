"""Which layer pairs cross-layer equalization (``lowbit.algorithms.equalize``) may rescale, and the channel maps.

A pair ``A -> act -> B`` of a prepared graph: ``A``'s output goes through one observer to ``B`` only, ``act`` is
the identity, ReLU or (``relu6`` not ``"skip"``) a ``[0, t]`` clamp, and ``B`` reads ``A``'s channels on the same
axis. ``A``'s output channels are independent whatever its ``groups`` (row ``i`` of ``W_A`` and ``b_A[i]`` make
channel ``i``), so any ``A`` is scaled by rows. ``B`` with ``g`` groups (weight ``(out, in / g, k...)``) reads input
channel ``i`` in group ``i // (in / g)``, at weight column ``i % (in / g)``, in that group's ``out / g`` filters::

    W_B viewed as (g, out / g, in / g, K):   input channel i = (j, c)  <->  W_B[j, :, c, :]

``input_weights(W_B, g)`` lays those out as one row per input channel: ``(in, out / g · K)``. A dense ``B``
(``g = 1``) reads channel ``i`` in column ``i`` of every filter, a depthwise one (``g = in = out``) in its own
filter ``i``, a depthwise one with channel multiplier ``k`` (``out = k · in``, ``g = in``) in its ``k`` filters
``k i .. k i + k - 1``, a grouped one (ResNeXt) in column ``i % (in / g)`` of group ``i // (in / g)``'s filters.
``_in_ranges(B)`` is ``r_B[i] = max |W_B[.., i, ..]|`` over that row; ``_scale_in(B, s)`` multiplies it by ``s_i``
(``input_multiplier``). Scaling ``A``'s channel ``i`` by ``1 / s_i`` and that row by ``s_i`` keeps the function
through a positively homogeneous ``act`` (Nagel et al. 2019).

>>> import torch
>>> from torch import nn
>>> b = nn.Conv2d(4, 2, 1, bias=False)
>>> with torch.no_grad(): _ = b.weight.copy_(torch.arange(8.).view(2, 4, 1, 1))
>>> _in_ranges(b).tolist()
[4.0, 5.0, 6.0, 7.0]
>>> with torch.no_grad(): _scale_in(b, torch.tensor([1., 2., 1., 1.]))
>>> b.weight[:, 1].flatten().tolist()
[2.0, 10.0]
>>> g = nn.Conv2d(4, 4, 1, groups=2, bias=False)  # out / g = 2 filters per group, in / g = 2 columns
>>> with torch.no_grad(): _ = g.weight.copy_(torch.arange(8.).view(4, 2, 1, 1))
>>> input_weights(g.weight, 2).tolist()  # input 0: column 0 of filters 0, 1; input 2: column 0 of filters 2, 3
[[0.0, 2.0], [1.0, 3.0], [4.0, 6.0], [5.0, 7.0]]
"""

from __future__ import annotations

import torch
from torch import fx, nn

from ..fake_quant import FakeQuantize
from ..nn.intrinsic import ClampedReLU
from ..observer import ObserverBase
from .layers import is_weighted, shared_layers, split


def groups_of(b: nn.Module) -> int:
    """``b``'s ``groups`` (1 for a Linear)."""
    return int(getattr(b, "groups", 1))


def input_channels(b: nn.Module) -> int:
    """How many input channels ``b`` reads: ``(in / g) · g`` (a Linear: ``in_features``)."""
    return b.weight.shape[1] * groups_of(b)


def input_weights(w: torch.Tensor, groups: int) -> torch.Tensor:
    """The weights that read each input channel, one row per channel: ``(in, out / groups · K)`` (module docstring)."""
    g, out, ipg = groups, w.shape[0], w.shape[1]
    return w.reshape(g, out // g, ipg, -1).transpose(1, 2).reshape(g * ipg, -1)


def input_multiplier(w: torch.Tensor, groups: int, s: torch.Tensor) -> torch.Tensor:
    """``s`` (one factor per input channel) laid out to multiply ``w``: ``(out, in / groups, 1, ...)``."""
    g, out, ipg = groups, w.shape[0], w.shape[1]
    m = s.reshape(g, 1, ipg).expand(g, out // g, ipg).reshape(out, ipg)
    return m.view(out, ipg, *[1] * (w.dim() - 2))


def _in_ranges(b: nn.Module) -> torch.Tensor:
    """``r_B[i]``: max |weight| over the weights that read input channel ``i`` (``input_weights``)."""
    return input_weights(b.weight.detach(), groups_of(b)).abs().amax(1)


def _same_axis(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``b`` reads ``a``'s output channels as its input channels (both Linear or both the same ConvNd; a
    Linear after a conv reads its last spatial axis, a conv after a Linear its token axis)."""
    return type(split(a)[0]) is type(split(b)[0])


def _depthwise(mod: nn.Module) -> bool:
    b, _ = split(mod)
    return getattr(b, "groups", 1) > 1 and b.weight.shape[1] == 1


def _spread(r_a: torch.Tensor, r_b: torch.Tensor) -> float:
    ok = (r_a > 0) & (r_b > 0)
    ratio = r_a[ok] / r_b[ok]
    return float(ratio.max() / ratio.min()) if ratio.numel() else 1.0


def _scale_in(b: nn.Module, s: torch.Tensor) -> None:
    """Multiply the weights that read input channel ``i`` of ``b`` by ``s_i``, in place."""
    b.weight.mul_(input_multiplier(b.weight, groups_of(b), s))


def _pairs(gm: fx.GraphModule, relu6: str) -> list[tuple[str, str]]:
    mods = dict(gm.named_modules())
    shared = shared_layers(gm)
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not is_weighted(mods[node.target]) or len(node.users) != 1:
            continue
        if str(node.target) in shared:
            continue
        (obs,) = node.users
        if obs.op != "call_module" or not isinstance(mods[obs.target], (ObserverBase, FakeQuantize)):
            continue
        if len(obs.users) != 1:
            continue
        (nxt,) = obs.users
        if nxt.op == "call_module" and is_weighted(mods[nxt.target]) and nxt.args[0] is obs and nxt.target not in shared:
            a, act = split(mods[node.target])
            b, _ = split(mods[nxt.target])
            ok_act = act is None or type(act) is nn.ReLU or (isinstance(act, ClampedReLU) and relu6 != "skip")
            if ok_act and _same_axis(a, b) and a.weight.shape[0] == input_channels(b):
                out.append((str(node.target), str(nxt.target)))
    return out


def _float_second(gm: fx.GraphModule, mods: dict[str, nn.Module]) -> list[tuple[str, str]]:
    """Clamp pairs ``A → clamp(0, t) → observer → B`` whose ``B`` is a float (no qconfig) ``Conv2d`` / ``Linear``, as
    mixed precision leaves it: any such ``B`` takes the stretch exactly (no weight grid to absorb it), dense or not."""
    out, shared = [], shared_layers(gm)
    for node in gm.graph.nodes:
        if node.op != "call_module" or not is_weighted(mods[node.target]) or len(node.users) != 1:
            continue
        if not isinstance(split(mods[node.target])[1], ClampedReLU):
            continue
        (obs,) = node.users
        if obs.op != "call_module" or not isinstance(mods[obs.target], (ObserverBase, FakeQuantize)) or len(obs.users) != 1:
            continue
        (nxt,) = obs.users
        b = mods.get(str(nxt.target)) if nxt.op == "call_module" else None
        if type(b) not in (nn.Conv2d, nn.Linear) or getattr(b, "qconfig", None) is not None or nxt.args[0] is not obs \
                or not _same_axis(mods[node.target], b):
            continue
        if input_channels(b) == split(mods[node.target])[0].weight.shape[0] \
                and not {str(node.target), str(nxt.target)} & shared:
            out.append((str(node.target), str(nxt.target)))
    return out


_CLAMPS = (nn.ReLU6, nn.Hardtanh, ClampedReLU)


def _float_clamp_pairs(gm: fx.GraphModule, mods: dict[str, nn.Module]) -> list[tuple[str, str, str, float]]:
    """``(layer, scaled, B, t)`` for every float (no qconfig) conv ``layer`` → [float ``BatchNorm2d``] → ``[0, t]``
    clamp module → observer → int8 depthwise ``B``, each output read once: mixed precision keeps such a layer float
    (``set_module_name(layer, None)``), and its clamp is then a float module the int8 pairs' pattern does not see.
    ``scaled``: the module whose output channels the stretch divides (the BN's affine parameters, else the conv's)."""
    out, shared = [], shared_layers(gm)
    for node in gm.graph.nodes:
        if node.op != "call_module" or not is_weighted(mods[node.target]) or not _depthwise(mods[node.target]):
            continue
        obs = node.args[0] if node.args else None
        if not (isinstance(obs, fx.Node) and obs.op == "call_module" and len(obs.users) == 1
                and isinstance(mods[obs.target], (ObserverBase, FakeQuantize))):
            continue
        clamp = obs.args[0]
        if not (isinstance(clamp, fx.Node) and clamp.op == "call_module" and len(clamp.users) == 1):
            continue
        c = mods[clamp.target]
        lo = 0.0 if isinstance(c, (nn.ReLU6, ClampedReLU)) else getattr(c, "min_val", None)
        t = float(c.max_val) if isinstance(c, _CLAMPS) else 0.0
        prod = clamp.args[0]
        if lo != 0 or not t > 0 or not (isinstance(prod, fx.Node) and prod.op == "call_module" and len(prod.users) == 1):
            continue
        scaled = str(prod.target)
        if type(mods[scaled]) is nn.BatchNorm2d and mods[scaled].affine:
            prod = prod.args[0]
            if not (isinstance(prod, fx.Node) and prod.op == "call_module" and len(prod.users) == 1):
                continue
        layer = mods[str(prod.target)]  # (a BN without affine parameters stays the producer: not a conv, skipped)
        if type(layer) is not nn.Conv2d or getattr(layer, "qconfig", None) is not None:
            continue
        if mods[scaled].weight.shape[0] == input_channels(split(mods[node.target])[0]) \
                and not {str(prod.target), str(node.target)} & shared:
            out.append((str(prod.target), scaled, str(node.target), t))
    return out
