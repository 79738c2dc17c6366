"""Residual-stream equalization: one per-channel scale for every tensor of a residual stream.

In a residual stage (MobileNetV2's inverted residuals, ResNet's bottlenecks without a final ReLU) the
values joined by ``add`` nodes form one *stream*: the stage's first projection writes it, every block
reads it (expand conv) and adds its own projection to it, and the next stage reads the last sum. All
those tensors share their channels, and nothing nonlinear touches them, so for any ``s_c > 0``::

    writers:  W[c] /= s_c,  b[c] /= s_c          (every layer whose output joins the stream)
    readers:  W[:, c] *= s_c                     (every layer that reads it; depthwise: W[c] *= s_c)

divides channel ``c`` of every stream tensor by ``s_c`` and leaves every reader's output — hence the
float model — unchanged (zero padding stays zero). Per-tensor activation grids on the stream (the adds'
outputs, the projections' outputs) then see channels of alike range: MobileNetV2's stream after
``features.16`` spans -25.8 .. 33.7 where the median channel's std is 0.53. Writers keep their error
(per-channel weight grids scale with their rows); a dense reader's column ``c`` grows by ``s_c``, so
its row grids coarsen where a large channel is shrunk: the scale balances the two, SmoothQuant-style,

    s_c = (a_c / gm(a)) ** alpha * (gm(r) / r_c) ** (1 - alpha)

with ``a_c`` the largest ``|x_c|`` over the stream's tensors on the calibration data, ``r_c`` the largest
``|W[:, c]|`` over its readers and ``gm`` the geometric mean over channels. A stream is equalized only
when every producer is a weighted conv without activation (or an ``add`` / observer of the stream) and
every other consumer is a dense or depthwise conv reading it as its input; anything else (pooling, the
model's output, a Linear, a placeholder) leaves that stream alone. Layers that mixed precision keeps float
count too: a float conv, as a writer or a reader, or a float BatchNorm after a float conv, as a writer
(its ``γ, β`` take ``1 / s_c``). Scaling a float layer is exact, since it has no weight grid.

MobileNetV2 (48 calibration crops, MSE-searched grids, round to nearest, 96 other crops; 1 thread): the
late stream's channel spread 16.2 -> 2.4 (``alpha=0.75``); activations-only logit SQNR 15.35 -> 16.98 dB
(``alpha`` 0.5: 16.66, 1.0: 16.78), weights-only 14.95 -> 14.95 dB (1.0: 14.65); the accurate recipe
(``quantize_ptq``, 100 steps) 0.896 / 18.17 -> 0.917 / 19.54 dB. Per-channel RMS in place of ``max |x_c|``
simulated 17.43 dB activations-only and gave 0.875 / 20.11 dB on the recipe (2 threads: 0.885 / 20.15 dB
where ``max |x_c|`` gives 0.865 / 19.70): more SQNR, not more agreement; not adopted.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a, self.b, self.c = nn.Conv2d(3, 6, 1), nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 4, 1)
...     def forward(self, x):
...         y = self.a(x)
...         return self.c(y + self.b(y))
>>> _ = torch.manual_seed(0); net = Net().eval()
>>> with torch.no_grad(): _ = net.a.weight.mul_(torch.logspace(-1, 1, 6).view(6, 1, 1, 1))
>>> x = torch.randn(4, 3, 8, 8); y = net(x)
>>> p = Q.prepare_fx(net, Q.get_default_qconfig_mapping(), example_inputs=(x,))
>>> [(s.writers, s.readers) for s in equalize_streams(p, [(x,)])]
[(['a', 'b'], ['b', 'c'])]
>>> bool(torch.allclose(p(x), y, atol=1e-5))
True
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..fake_quant import FakeQuantize
from ..observer import ObserverBase
from .equalize import _run_hooked
from .equalize_pairs import _scale_in
from .layers import is_weighted, shared_layers, split
from .layerwise_step import batch_tuples

__all__ = ["EqualizedStream", "equalize_streams"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class EqualizedStream:
    """One equalized stream: its writer / reader layers and the spread (max / min over channels) of the
    channels' largest ``|x_c|`` before and after."""

    writers: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    spread_before: float = 1.0
    spread_after: float = 1.0


def _is_obs(node: fx.Node, mods: dict[str, nn.Module]) -> bool:
    return node.op == "call_module" and isinstance(mods.get(node.target), (ObserverBase, FakeQuantize)) \
        and len(node.args) == 1 and isinstance(node.args[0], fx.Node)  # type: ignore[arg-type]


def _is_add(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (operator.add, torch.add) and not node.kwargs \
        and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args)


def _conv(node: fx.Node, mods: dict[str, nn.Module]) -> nn.Module | None:
    """The conv of a weighted conv node (None for anything else)."""
    if node.op != "call_module" or not is_weighted(mods[node.target]):  # type: ignore[index]
        return None
    op, _ = split(mods[node.target])  # type: ignore[index]
    return op if isinstance(op, _CONVS) else None


def _float_conv(node: fx.Node, mods: dict[str, nn.Module]) -> nn.Module | None:
    """A float (no qconfig: mixed precision) plain conv node's module, else None: scaling its rows or its input
    channels is exact (no weight grid)."""
    m = mods.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
    return m if type(m) in _CONVS and getattr(m, "qconfig", None) is None else None


def _writer(node: fx.Node, mods: dict[str, nn.Module]) -> nn.Module | None:
    """The module whose output channels a stream writer's ``1 / s_c`` divides: a weighted conv without activation, a
    float conv, or a float affine BatchNorm that alone reads a float conv (mixed precision keeps that run float)."""
    conv = _conv(node, mods)
    if conv is not None:
        return conv if split(mods[node.target])[1] is None else None  # type: ignore[index]
    if _float_conv(node, mods) is not None:
        return mods[node.target]  # type: ignore[index]
    m = mods.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
    prev = node.args[0] if node.args else None
    if (isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine and getattr(m, "qconfig", None) is None
            and isinstance(prev, fx.Node) and len(prev.users) == 1 and _float_conv(prev, mods) is not None):
        return m
    return None


def _streams(gm: fx.GraphModule, mods: dict[str, nn.Module]) -> list[tuple[list[fx.Node], list[fx.Node], list[fx.Node]]]:
    """``(values, writers, readers)`` of every stream that can be equalized (module docstring)."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in gm.graph.nodes:
        if _is_add(node):
            for a in node.args:
                parent[find(a)] = find(node)  # type: ignore[arg-type]
        elif _is_obs(node, mods):
            parent[find(node.args[0])] = find(node)  # type: ignore[arg-type]
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        groups.setdefault(find(node), []).append(node)
    shared = shared_layers(gm)
    out = []
    for values in groups.values():
        if not any(_is_add(n) for n in values):
            continue
        members = set(values)
        writers = [n for n in values if not _is_add(n) and not _is_obs(n, mods)]
        readers = sorted({u for n in values for u in n.users if not (u in members and (_is_add(u) or _is_obs(u, mods)))},
                         key=lambda u: list(gm.graph.nodes).index(u))
        ok = all(_writer(w, mods) is not None for w in writers) and not {str(n.target) for n in writers + readers} & shared
        for r in readers:
            conv = _conv(r, mods) or _float_conv(r, mods)
            dense = conv is not None and getattr(conv, "groups", 1) == 1
            depthwise = conv is not None and conv.groups == conv.in_channels == conv.out_channels
            ok = ok and (dense or depthwise) and len(r.args) == 1 and not r.kwargs
        channels = {_writer(w, mods).weight.shape[0] for w in writers if ok}  # type: ignore[union-attr]
        channels |= {(split(mods[r.target])[0]).in_channels for r in readers if ok}  # type: ignore[index,union-attr]
        if ok and writers and readers and len(channels) == 1:
            out.append((values, writers, readers))
    return out


def _absmax(gm: fx.GraphModule, groups: list[list[nn.Module]], calib: Iterable[Any]) -> list[torch.Tensor | None]:
    """Per group of observers: per-channel ``max |x|`` over every tensor they see on ``calib`` (observers
    inert). Rescaling one stream leaves every other tensor as it is, up to float rounding."""
    got: list[torch.Tensor | None] = [None] * len(groups)
    # the first batch runs whole and counts the hooked calls; later batches stop once they are all made (the
    # rest of the model would compute nothing these statistics read: same values, a shorter pass)
    calls = {"n": 0, "total": None}

    def hook(k: int, args: Any) -> None:
        x = args[0].detach()
        v = x.abs().amax(dim=[d for d in range(x.dim()) if d != 1])
        old = got[k]
        got[k] = v if old is None else torch.maximum(old, v)
        calls["n"] += 1
        if calls["total"] is not None and calls["n"] >= calls["total"]:
            raise _Done
    hooks = [m.register_forward_hook(lambda _m, args, _out, k=k: hook(k, args)) for k, obs in enumerate(groups) for m in obs]

    def batches() -> Any:
        for i, batch in enumerate(calib):
            if i == 1:
                calls["total"] = calls["n"]
            calls["n"] = 0
            yield batch
    _run_hooked(gm, hooks, batches(), stop=_Done)
    return got


class _Done(Exception):
    """Raised by ``_absmax``'s last hook of a batch: the rest of the forward is not needed."""


def _spread(a: torch.Tensor) -> float:
    a = a[a > 0]
    return float(a.max() / a.min()) if a.numel() else 1.0


def _gm(t: torch.Tensor) -> torch.Tensor:
    return t.clamp_min(1e-12).log().mean().exp()


def equalize_streams(prepared: fx.GraphModule, calib: Iterable[Any], alpha: float = 0.75) -> list[EqualizedStream]:
    """Equalize every residual stream of a graph-mode prepared model (before calibration), in place.

    ``alpha`` in ``[0, 1]`` weighs the stream's activation ranges against its readers' weight ranges
    (module docstring). Returns one record per equalized stream, in graph order.
    """
    if not isinstance(prepared, fx.GraphModule):
        raise TypeError(f"equalize_streams: expects a prepare_fx model (fx.GraphModule), got {type(prepared).__name__}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"equalize_streams: alpha={alpha!r} must be a number in [0, 1]")
    calib = batch_tuples(calib, "equalize_streams")  # one pass per stream; a list batch is positional inputs
    mods = dict(prepared.named_modules())
    records = []
    with torch.no_grad():
        for values, writers, readers in _streams(prepared, mods):  # one pass per stream, each on the model so far
            (a,) = _absmax(prepared, [[mods[n.target] for n in values if _is_obs(n, mods)]], calib)  # type: ignore[index]
            if a is None:
                continue
            convs = [split(mods[r.target])[0] for r in readers]  # type: ignore[index]
            r = torch.stack([(c.weight.abs().transpose(0, 1) if c.groups == 1 else c.weight.abs()).reshape(len(a), -1)
                             .amax(1) for c in convs]).amax(0)
            live = (a > 0) & (r > 0)
            s = torch.ones_like(a)
            if bool(live.any()):
                s[live] = (a[live] / _gm(a[live])) ** alpha * (_gm(r[live]) / r[live]) ** (1 - alpha)
            for w in writers:
                op = _writer(w, mods)  # type: ignore[assignment]
                op.weight.div_(s.view(-1, *[1] * (op.weight.dim() - 1)))
                if op.bias is not None:
                    op.bias.div_(s)
            for c in convs:
                _scale_in(c, s)
            records.append(EqualizedStream([str(w.target) for w in writers], [str(n.target) for n in readers],
                                           _spread(a), _spread(a / s)))
    return records
