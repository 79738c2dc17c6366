"""Block reconstruction (BRECQ, Li et al. 2021): learn the rounding of a residual block's weights together.

Layer-by-layer AdaRound (``lowbit.algorithms.adaround``) makes every layer's output match the float
layer's; what the model keeps is the *block's* output, where the rounding errors of its layers and the
grids inside it (activations, the residual add) meet and may cancel. For a span of a graph-mode
prepared model from one *cut* (a value that is the only one alive) to the next, when the span holds a
residual merge (a node with two or more computed inputs) and weighted layers, the rounding variables
``V_l`` of all its layers ``l`` minimise together::

    || B(x_q; W_hat_1(V_1), ..., W_hat_L(V_L)) - B_float(x) ||^2  +  lam * mean_l mean(1 - |2 h(V_l) - 1| ** beta)

where ``B`` is the span run as the int8 model runs it (activation observers fake-quantize on their
calibrated grids with the straight-through gradient, ``x_q`` the span's input in the quantized model)
and ``B_float`` the float model's span on the float input. The reconstruction term is normalised by
round-to-nearest's value on the first mini-batch, ``beta`` anneals 20 -> 2 after a 20 % warm-up (as
``adaround_codes``). The codes round ``h >= 0.5`` up; the caller (``layerwise``) keeps round-to-nearest
instead when that gives the lower block-output error on the first calibration batch.

>>> import torch
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> w = [torch.randn(8, 4), torch.randn(4, 8)]
>>> s = [x.abs().amax(1, keepdim=True) / 7 for x in w]; z = [torch.zeros_like(t) for t in s]   # 4-bit grids
>>> x = torch.randn(256, 2) @ torch.randn(2, 4)                 # correlated inputs (white ones: nearest is best)
>>> y = x + torch.relu(x @ w[0].T) @ w[1].T                                                  # a residual block
>>> def sample():
...     i = torch.randint(256, (64,))
...     return (lambda ws: x[i] + torch.relu(x[i] @ ws[0].T) @ ws[1].T), y[i]
>>> q = block_codes(w, s, z, -8, 7, sample, iters=200)
>>> err = lambda qs: float((x + torch.relu(x @ ((qs[0] - z[0]) * s[0]).T) @ ((qs[1] - z[1]) * s[1]).T - y).pow(2).mean())
>>> err(q) < err([torch.round(grid_position(t, g, 0 * g)) for t, g in zip(w, s)])  # round to nearest, as convert
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..fake_quant import FakeQuantize
from ..nn.intrinsic import ClampedReLU
from ..observer import ObserverBase
from ..observer.fixed import FixedQParamsObserver
from ..rounding import grid_position
from .adaround import GAMMA, ZETA, rectified_sigmoid
from .layers import is_weighted, split

__all__ = ["block_codes", "find_blocks", "span_sample", "LearnedGrid", "learnable_grids", "install_grid"]


class LearnedGrid:
    """A per-tensor activation grid whose step size learns (LSQ, Esser et al. 2020; as in BRECQ / QDrop).

    ``s = min(s0 * exp(t), cap)`` with ``t`` learned (starts at 0: the calibrated grid), the zero point ``z``
    fixed (an integer on the grid), and ``x -> (clamp(round(x / s + z), qmin, qmax) - z) * s`` with the
    straight-through gradient for the rounding, so both ``x`` and ``t`` get gradients (codes clamped at
    ``qmin`` / ``qmax`` pull ``s`` as in LSQ). ``cap`` keeps a clamped layer's grid (ReLU6: the requantize
    clamp *is* the activation) inside the clamp: ``(qmax - z) * s <= max_val``.

    >>> import torch
    >>> gr = LearnedGrid(0.1, 0, 0, 255)
    >>> gr(torch.tensor([0.04, 0.26, 30.0])).tolist() == [0.0, 0.30000001192092896, 25.5]
    True
    >>> _ = gr(torch.tensor([30.0])).sum().backward(); float(gr.t.grad) > 0   # clamped codes pull s up
    True
    """

    def __init__(self, scale: float, zero_point: int, qmin: int, qmax: int, cap: float | None = None) -> None:
        if not (scale > 0 and qmin <= zero_point <= qmax):
            raise ValueError(f"LearnedGrid: scale={scale!r} must be > 0 and zero_point={zero_point!r} in [{qmin}, {qmax}]")
        self.s0, self.z, self.qmin, self.qmax = float(scale), int(zero_point), int(qmin), int(qmax)
        self.cap = None if cap is None else max(float(cap), self.s0)
        self.t = torch.zeros((), requires_grad=True)

    def scale(self) -> torch.Tensor:
        s = self.s0 * torch.exp(self.t)
        return s.clamp(max=self.cap) if self.cap is not None else s

    def __call__(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        s = self.scale()
        v = x * torch.reciprocal(s) + self.z  # the int8 model's round(x · (1/s) + z) (``quantize``)
        v = v + (torch.round(v) - v).detach()
        return (torch.clamp(v, self.qmin, self.qmax) - self.z) * s


def learnable_grids(span: list[fx.Node], mods: dict[str, nn.Module]) -> dict[fx.Node, LearnedGrid]:
    """The span's activation observers whose grid may learn: calibrated per-tensor observers (not fake-quant
    modules) right after a weighted layer (capped by a fused ReLU6's clamp) or a residual ``add``."""
    import operator

    out = {}
    for n in span:
        obs = mods.get(n.target) if n.op == "call_module" else None  # type: ignore[arg-type]
        if not isinstance(obs, ObserverBase) or isinstance(obs, FakeQuantize) or getattr(obs, "is_dynamic", False) \
                or not getattr(obs, "is_calibrated", True) or not hasattr(obs, "quant_min") or len(n.args) != 1:
            continue
        src = n.args[0]
        if not isinstance(src, fx.Node):
            continue
        smod = mods.get(src.target) if src.op == "call_module" else None  # type: ignore[arg-type]
        if smod is not None and is_weighted(smod):
            act = split(smod)[1]
        elif src.op == "call_function" and src.target in (operator.add, torch.add) and not src.kwargs:
            act = None
        else:
            continue
        if act is not None and type(act) is not nn.ReLU and not isinstance(act, ClampedReLU):
            continue
        s, z = obs.calculate_qparams()
        if s.numel() != 1:
            continue
        cap = act.max_val / (obs.quant_max - int(z)) if isinstance(act, ClampedReLU) else None
        out[n] = LearnedGrid(float(s), int(z), obs.quant_min, obs.quant_max, cap)
    return out


def install_grid(gm: fx.GraphModule, mods: dict[str, nn.Module], node: fx.Node, grid: LearnedGrid) -> nn.Module:
    """Swap ``node``'s observer for a ``FixedQParamsObserver`` holding the learned grid (what ``convert_fx`` reads)."""
    old = mods[node.target]  # type: ignore[index]
    new = FixedQParamsObserver(float(grid.scale()), grid.z, old.qscheme, old.qdtype)
    parent, _, name = str(node.target).rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, new)
    mods[node.target] = new  # type: ignore[index]
    return new


def block_codes(weights: list[torch.Tensor], scales: list[torch.Tensor], zeros: list[torch.Tensor], qmin: int,
                qmax: int, sample: Callable[[], tuple[Callable[[list[torch.Tensor]], torch.Tensor], torch.Tensor]], *,
                iters: int = 500, lr: float = 1e-2, lam: float = 0.1, warmup: float = 0.2,
                beta: tuple[float, float] = (20.0, 2.0), grids: list[LearnedGrid] | None = None,
                grid_lr: float = 1e-3) -> list[torch.Tensor]:
    """Learned integer codes for every weight of a block, on the grids ``(scales[l], zeros[l])``.

    ``sample()`` returns ``(run, target)``: ``run(w_hats)`` is the block on a mini-batch of its
    quantized-model inputs with the weights ``w_hats`` (one per layer, in order), ``target`` the float
    block's output there. Same objective and schedule as ``adaround_codes`` (normalised), summed over
    the block's layers; see the module docstring.
    """
    if not isinstance(iters, int) or iters < 0:
        raise ValueError(f"block_codes: iters={iters!r} must be an int >= 0")
    if not (len(weights) == len(scales) == len(zeros)) or not weights:
        raise ValueError(f"block_codes: got {len(weights)} weights, {len(scales)} scales, {len(zeros)} zero points; "
                         "pass one grid per weight, at least one weight")
    floors, vs, pos = [], [], []
    for w, s, z in zip(weights, scales, zeros):
        v_pos = grid_position(w, s, z)  # convert's unrounded codes (z included), as adaround_codes
        fl = torch.floor(v_pos)
        p = (((v_pos - fl).clamp(0.0, 1.0) - GAMMA) / (ZETA - GAMMA)).clamp(1e-4, 1 - 1e-4)
        pos.append(v_pos)
        floors.append(fl)
        vs.append(torch.log(p / (1 - p)).requires_grad_(True))
    groups = [{"params": vs, "lr": lr}]
    if grids:
        groups.append({"params": [gr.t for gr in grids], "lr": grid_lr})
    opt = torch.optim.Adam(groups)
    start, scale = int(warmup * iters), None
    for it in range(iters):
        run, target = sample()
        hs = [rectified_sigmoid(v) for v in vs]
        w_hats = [(torch.clamp(fl + h, qmin, qmax) - z) * s for fl, h, z, s in zip(floors, hs, zeros, scales)]
        d = (run(w_hats) - target.detach()).pow(2)
        loss = d.sum(1).mean() if d.dim() > 1 else d.mean()
        if scale is None:  # round-to-nearest's reconstruction error on the first mini-batch (initial grids)
            with torch.no_grad():
                near = [(torch.clamp(torch.round(v_pos), qmin, qmax) - z) * s  # convert's round to nearest
                        for v_pos, s, z in zip(pos, scales, zeros)]
                e = (run(near) - target).pow(2)
                scale = float(e.sum(1).mean() if e.dim() > 1 else e.mean()) + 1e-12
        loss = loss / scale
        if it >= start:
            b = beta[0] + (beta[1] - beta[0]) * (it - start) / max(1, iters - start)
            loss = loss + lam * sum((1 - (2 * h - 1).abs().pow(b)).mean() for h in hs) / len(hs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return [torch.clamp(fl + (rectified_sigmoid(v) >= 0.5).to(torch.float32), qmin, qmax)
                for fl, v in zip(floors, vs)]


def find_blocks(nodes: list[fx.Node], mods: dict[str, nn.Module], through_observer: bool = False) -> dict[int, int]:
    """``{i: j}``: spans ``nodes[i+1 .. j]`` between consecutive cuts that hold a residual merge and weighted layers.

    A cut is a node after which it is the only value still to be read, a float tensor (``meta["lowbit_ftensor"]``
    where ``prepare_fx`` recorded it: a block's input is sampled along its batch dim). Every weighted layer in a span
    must take one positional input and no keywords (as the layer-by-layer pass requires), and a span holds no
    graph input (a model's later forward argument: the span's values must all come from the cut).
    ``through_observer``: a span also takes the observer that reads its last node (the block's output grid).
    """
    index = {n: i for i, n in enumerate(nodes)}
    last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
    # live after i: defined at <= i, read after i. Count with a sweep: +1 at definition, -1 after last read
    delta = [0] * (len(nodes) + 1)
    for n, i in index.items():
        if n in last_use and last_use[n] > i:
            delta[i] += 1
            delta[last_use[n]] -= 1
    cuts, live = [], 0
    for i, node in enumerate(nodes):
        live += delta[i]
        # (a cut is a block's input and output: a float tensor; not a tuple such as ShuffleNetV2's `x.chunk(2, 1)`)
        if node.op != "output" and live == 1 and last_use.get(node, -1) > i and node.meta.get("lowbit_ftensor", True):
            cuts.append(i)
    spans: dict[int, int] = {}
    for i, j in zip(cuts, cuts[1:]):
        nxt = nodes[j + 1] if through_observer and j + 1 < len(nodes) else None
        if nxt is not None and nxt.op == "call_module" and nxt.args == (nodes[j],) and \
                isinstance(mods.get(nxt.target), (ObserverBase, FakeQuantize)):  # type: ignore[arg-type]
            j += 1  # the block's output grid (the residual add's observer) belongs to the block
        span = nodes[i + 1: j + 1]
        weighted = [n for n in span if n.op == "call_module" and is_weighted(mods[n.target])]  # type: ignore[index]
        merge = any(sum(1 for a in n.all_input_nodes if a.op != "get_attr") >= 2 for n in span)
        simple = all(len(n.args) == 1 and not n.kwargs for n in weighted)
        # a graph input defined after the cut (a second forward argument) is not computed from the span's input
        closed = all(n.op != "placeholder" for n in span)
        if weighted and merge and simple and closed:
            spans[i] = j
    return spans


def span_sample(span: list[fx.Node], start: fx.Node, end: fx.Node, run_node: Callable[..., Any],
                xq: list[torch.Tensor], target: list[torch.Tensor], batch_size: int,
                g: torch.Generator) -> Callable[[], tuple[Callable[[list[torch.Tensor]], torch.Tensor], torch.Tensor]]:
    """``sample()`` for ``block_codes``: a random mini-batch of one calibration batch's span input ``xq[k]``
    and its target; ``run_node(node, env, w_hats)`` computes one span node the quantized model's way."""

    def sample() -> tuple[Callable[[list[torch.Tensor]], torch.Tensor], torch.Tensor]:
        k = int(torch.randint(len(xq), (1,), generator=g))
        idx = torch.randint(xq[k].shape[0], (min(batch_size, xq[k].shape[0]),), generator=g)

        def run(w_hats: list[torch.Tensor]) -> torch.Tensor:
            env: dict[fx.Node, Any] = {start: xq[k][idx]}
            for node in span:
                run_node(node, env, w_hats)
            return env[end]
        return run, target[k][idx]
    return sample
