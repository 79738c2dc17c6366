"""Layer-by-layer weight rounding and bias correction on a calibrated prepared model.

One pass walks a prepared graph-mode model (``prepare_fx`` + calibration) in topological order
and runs two copies of every value side by side on the calibration batches:

- ``float``: the float model (observers are the identity, weights as they are);
- ``quant``: the int8 model simulated in float — every activation observer fake-quantizes with its
  calibrated grid, every weighted layer runs with its rounded weight ``W_hat``.

At each weighted layer (``lowbit.algorithms.layers``) with quantized-model input ``x_q`` and
float output ``y = act(op(x))``:

1. rounding (``adaround=True``): the weight codes are learned by ``adaround_codes`` so that
   ``act(op(x_q; W_hat))`` matches ``y`` (else round to nearest);
2. bias correction (``bias_correction=True``, empirical, Nagel et al. 2019 §4.2): per output channel
   ``b_c += mean(op(x; W) - op(x_q; W_hat))`` over batch and positions, which also removes the mean
   error that arrives from upstream layers;
3. the codes are frozen (``layers.freeze_weight``) so ``convert_fx`` uses exactly them.

A layer called at several nodes, or holding a tied weight, is rounded and bias-corrected once (``layers.rounded_before``),
every call's target from a float copy of the layer taken before the walk.

The pass is exact to the int8 model up to what the simulation leaves float (averaging pools,
functional convs on parameters keep float weights here and round to nearest in ``convert_fx``).
Eager-mode prepared models go through ``reconstruct_eager`` (one model pass per layer).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..fake_quant import FakeQuantize
from ..batches import check_finite_batch, iter_batches
from ..functional import fake_quantize
from ..observer import ObserverBase
from .adaround import adaround_codes
from .block import block_codes, find_blocks, install_grid, learnable_grids, span_sample
from .quadratic import quadratic_codes, supports
from .layers import (freeze_weight, is_weighted, layer_forward, layer_sample, rounded_before, rounded_forward,
                     shared_layers, split, weight_codes)

__all__ = ["LayerChange", "patch_observers", "reconstruct", "ROUNDINGS"]

ROUNDINGS = ("adaround", "quadratic", "depthwise")


@dataclass
class LayerChange:
    """What the pass did to one layer: MSE of its output against the float layer (first calibration batch,
    quantized-model inputs) with round-to-nearest and after the pass."""

    name: str
    mse_nearest: float
    mse_after: float
    codes_changed: float = 0.0  # fraction of weight codes that differ from round-to-nearest
    bias_shift: float = 0.0  # max |correction| added to the bias
    notes: list[str] = field(default_factory=list)


def _fq(obs: nn.Module) -> Any:
    """``x -> (clamp(round(x / s + z), qmin, qmax) - z) s`` on the grid ``obs`` calibrated, the int8 model's
    rounding (None: leave values as they are)."""
    if isinstance(obs, FakeQuantize):
        obs = obs.activation_post_process
    if not isinstance(obs, ObserverBase) or getattr(obs, "is_dynamic", False) or not hasattr(obs, "quant_min"):
        return None
    if not getattr(obs, "is_calibrated", True):
        return None
    s, z = obs.calculate_qparams()
    axis = obs.ch_axis if s.numel() > 1 else None
    # round(x / s + z), zero point added before rounding, as ``quantize`` (the int8 model's Quantize and
    # requantize steps) does; ``fake_quantize``'s default round(x / s) + z differs where the float32 add of z
    # lands on a tie, and one such code at MobileNetV2's input grows to a 22 dB difference in the logits
    zf = z.to(torch.float32)
    return lambda x: fake_quantize(x, s, zf, obs.quant_min, obs.quant_max, axis, float_zero_point=True) \
        if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _layer(name: str, mod: nn.Module, xq: list[torch.Tensor], xf: list[torch.Tensor], adaround: bool,
           bias_correction: bool, iters: int, batch_size: int, g: torch.Generator, window: int = 16,
           target: list[torch.Tensor] | None = None, codes: torch.Tensor | None = None,
           rounding: str = "adaround", freeze: bool = True,
           float_mod: nn.Module | None = None) -> tuple[torch.Tensor, LayerChange]:
    """Round (and bias-correct) one layer; return its simulated weight and the change record.

    ``codes``: weight codes learned elsewhere (block reconstruction) to use instead of rounding here.
    ``rounding``: ``"adaround"``, or ``"quadratic"`` / ``"depthwise"`` (``quadratic.quadratic_codes`` on every
    supported layer / on depthwise convs only; AdaRound on the others). ``freeze=False``: the codes are not
    written into the weight nor pinned (a weight another call already rounded). ``float_mod``: the float layer
    (a copy taken before any rounding) the targets come from, where ``mod``'s own weight may already be rounded."""
    op, act = split(mod)
    float_mod = mod if float_mod is None else float_mod
    q0, s, z, lo, hi = weight_codes(mod)
    if target is None:
        with torch.no_grad():
            target = [layer_forward(float_mod, x) for x in xf]

    def error(w: torch.Tensor) -> float:  # output MSE on the first calibration batch (cost: one batch)
        with torch.no_grad():
            return float((layer_forward(mod, xq[0], w) - target[0]).pow(2).mean())

    rec = LayerChange(name, error((q0 - z) * s), 0.0)
    q = q0 if codes is None else codes
    if codes is not None:
        rec.codes_changed = float((q != q0).float().mean())
    elif adaround and _quadratic(op, rounding):
        lo_hi = None if act is None else (0.0, float(getattr(act, "max_val", float("inf"))))
        q = quadratic_codes(op, op.weight, s, z, lo, hi, xq, xf, act_range=lo_hi, bias=op.bias)
        if error((q - z) * s) > rec.mse_nearest:
            q = q0
        rec.codes_changed = float((q != q0).float().mean())
        rec.notes.append("quadratic")
    elif adaround and iters > 0:
        q = adaround_codes(op.weight, s, z, lo, hi, layer_sample(mod, xq, target, batch_size, window, g), iters=iters)
        if error((q - z) * s) > rec.mse_nearest:  # a short run can end worse than round-to-nearest: keep that
            q = q0
        rec.codes_changed = float((q != q0).float().mean())
    if bias_correction:
        with torch.no_grad():
            w_hat = (q - z) * s
            total, count = torch.zeros(op.weight.shape[0]), 0
            ch = -1 if isinstance(op, nn.Linear) else 1  # a Linear's channels are last: (N, ..., C); a conv's (N, C, ...)
            for x_f, x_q, t in zip(xf, xq, target):
                pre_f = t if act is None else layer_forward(float_mod, x_f, activation=False)
                d = pre_f - layer_forward(mod, x_q, w_hat, activation=False)
                total += d.movedim(ch, 0).reshape(d.shape[ch], -1).sum(1) if d.dim() > 1 else d
                count += d.numel() // d.shape[ch] if d.dim() > 1 else 1
            delta = total / max(1, count)
            if op.bias is None:
                op.bias = nn.Parameter(torch.zeros(op.weight.shape[0], dtype=op.weight.dtype))
            op.bias.add_(delta.to(op.bias.dtype))
            rec.bias_shift = float(delta.abs().max())
    if freeze:
        freeze_weight(mod, q, s, z)
    rec.mse_after = error((q - z) * s)
    return (q - z) * s, rec


def _quadratic(op: nn.Module, rounding: str) -> bool:
    """Whether ``rounding`` takes ``quadratic_codes`` for this layer."""
    if rounding == "adaround" or not supports(op):
        return False
    return rounding == "quadratic" or (isinstance(op, nn.Conv2d) and op.groups > 1)


def batch_tuples(calib: Any, where: str) -> list[tuple[Any, ...]]:
    """``calib`` (``lowbit.batches``' convention: a tensor is one batch, a tuple/list batch holds positional
    inputs) as a list of positional-argument tuples, for the walks that feed graph placeholders in order;
    errors name ``where``. A dict batch (keywords) has no such order: a ``TypeError``. A NaN/Inf in a float input
    is refused here, before any weight or bias is changed (it would reach every bias through the correction)."""
    out = []
    for i, b in enumerate(iter_batches(calib, f"{where}: calib")):
        if isinstance(b, dict):
            raise TypeError(f"{where}: calib batch {i} is a dict; give positional inputs (a tensor or a tuple/list)")
        out.append(b if isinstance(b, tuple) else tuple(b) if isinstance(b, list) else (b,))
        check_finite_batch(out[-1], where, f"calib batch {i}", "the layers' targets need finite data")
    return out


def _check_steps(where: str, iters: Any, batch_size: Any, seed: Any) -> None:
    """``iters`` an int >= 0, ``batch_size`` an int >= 1, ``seed`` an int: else an error naming the value."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"{where}: iters={iters!r} must be an int >= 0")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{where}: batch_size={batch_size!r} must be an int >= 1 (samples per rounding step)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where}: seed={seed!r} must be an int")
    if not -2 ** 63 <= seed < 2 ** 64:  # torch.Generator's range
        raise ValueError(f"{where}: seed={seed!r} must be in [-2**63, 2**64)")


def reconstruct(prepared: nn.Module, calib: Iterable[Any], adaround: bool = True, bias_correction: bool = True,
                iters: int = 500, batch_size: int = 8, seed: int = 0, progress: bool = True,
                blocks: bool = False, learn_grids: bool = False, rounding: str = "adaround") -> list[LayerChange]:
    """Learned rounding and/or bias correction for every weighted layer of a calibrated ``prepared`` model.

    Graph-mode models (``prepare_fx``) get the one-pass lockstep walk; others ``reconstruct_eager``.
    ``blocks=True`` (graph mode, with ``adaround``): the layers of every residual block round together on
    the block's output (``lowbit.algorithms.block``, BRECQ), the others layer by layer; ``learn_grids``: a
    block's output grid joins the block and the step sizes of its activation grids learn with the rounding
    (LSQ; ``block.learnable_grids``), the learned grids replace their observers (``FixedQParamsObserver``).
    ``rounding`` (layer-by-layer path): ``"adaround"``, ``"quadratic"`` (``lowbit.algorithms.quadratic``: codes
    minimising the layer's output error on all calibration data, every Linear / dense or depthwise conv) or
    ``"depthwise"`` (those codes on depthwise convs only). Returns one ``LayerChange`` per layer, in order. The
    model is changed in place (weights, biases, weight grids pinned for ``convert``/``convert_fx``).
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"reconstruct: rounding={rounding!r}; choose one of {list(ROUNDINGS)}")
    _check_steps("reconstruct", iters, batch_size, seed)
    if not isinstance(prepared, fx.GraphModule):
        from .layerwise_eager import reconstruct_eager  # (it imports this module's per-layer step)

        return reconstruct_eager(prepared, calib, adaround, bias_correction, iters, batch_size, seed, progress)
    from tqdm.auto import tqdm

    gm, batches, g = prepared, batch_tuples(calib, "reconstruct"), torch.Generator().manual_seed(seed)
    mods = dict(gm.named_modules())
    nodes = list(gm.graph.nodes)
    last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
    n_layers = sum(1 for n in nodes if n.op == "call_module" and is_weighted(mods[n.target]))
    envs_f: list[dict[fx.Node, Any]] = [{} for _ in batches]
    envs_q: list[dict[fx.Node, Any]] = [{} for _ in batches]
    changes: list[LayerChange] = []
    desc = "bias correction" if not adaround else {"adaround": "adaround", "quadratic": "quadratic rounding",
                                                    "depthwise": "adaround + quadratic"}[rounding]
    bar = tqdm(total=n_layers, desc=desc, disable=not progress)
    patched = patch_observers(gm, "float")  # observers inside opaque leaves must not keep observing
    try:
        spans = find_blocks(nodes, mods, learn_grids) if blocks and adaround and iters > 0 else {}
        # a layer called at several nodes or holding a tied weight rounds once, never in a block (module doc)
        shared = shared_layers(gm)
        twins = {name: copy.deepcopy(mods[name]) for name in shared}
        spans = {i: j for i, j in spans.items() if not any(str(n.target) in shared for n in nodes[i + 1: j + 1])}
        # layers convert gives int8 weights that no pass rounds (transposed convs): the quantized walk runs them
        # on those weights, as the int8 model does
        rounded = {name: f for name, m in mods.items() if (f := rounded_forward(m)) is not None}
        _walk(gm, nodes, mods, batches, envs_f, envs_q, last_use, changes, bar, adaround, bias_correction, iters,
              batch_size, g, spans, learn_grids, rounding, rounded, twins)
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
        bar.close()
    return changes


def _walk(gm: fx.GraphModule, nodes: list[fx.Node], mods: dict[str, nn.Module], batches: list[tuple[Any, ...]],
          envs_f: list[dict[fx.Node, Any]], envs_q: list[dict[fx.Node, Any]], last_use: dict[fx.Node, int],
          changes: list[LayerChange], bar: Any, adaround: bool, bias_correction: bool, iters: int, batch_size: int,
          g: torch.Generator, spans: dict[int, int] | None = None, learn_grids: bool = False,
          rounding: str = "adaround", rounded: dict[str, Any] | None = None,
          twins: dict[str, nn.Module] | None = None) -> None:
    placeholders = [n for n in nodes if n.op == "placeholder"]
    done = -1
    twins = twins or {}
    holders: dict[int, nn.Module] = {}  # weight id -> the layer that rounded it
    corrected: set[int] = set()  # ids of the biases corrected so far

    def block(i: int) -> int:
        _block(gm, nodes, i, spans[i], mods, envs_f, envs_q, last_use, changes, bar,  # type: ignore[index]
               bias_correction, iters, batch_size, g, learn_grids, rounded)
        return spans[i]  # type: ignore[index]

    with torch.no_grad():
        for i, node in enumerate(nodes):
            if node.op == "output":
                break
            if i <= done:  # inside a block already reconstructed; its last node may start the next one
                if i == done and spans and i in spans:
                    done = block(i)
                continue
            mod = mods.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
            if node.op == "placeholder":
                k = placeholders.index(node)
                for ef, eq, b in zip(envs_f, envs_q, batches):
                    ef[node] = eq[node] = b[k] if k < len(b) else node.args[0] if node.args else None
            elif mod is not None and isinstance(mod, (ObserverBase, FakeQuantize)):
                fq = _fq(mod)
                for ef, eq in zip(envs_f, envs_q):
                    ef[node] = ef[node.args[0]]
                    eq[node] = fq(eq[node.args[0]]) if fq is not None else eq[node.args[0]]
            elif mod is not None and is_weighted(mod) and len(node.args) == 1 and not node.kwargs:
                src, op, twin = node.args[0], split(mod)[0], twins.get(str(node.target))
                for ef in envs_f:  # the float layer, before its weight and bias change
                    ef[node] = layer_forward(twin or mod, ef[src])
                # a weight / bias an earlier call rounded / corrected keeps its codes / shift (one int8 weight)
                again = rounded_before(mod, holders)
                fix = bias_correction and (op.bias is None or id(op.bias) not in corrected)
                with torch.enable_grad():
                    w_hat, rec = _layer(str(node.target), mod, [e[src] for e in envs_q], [e[src] for e in envs_f],
                                        adaround and not again, fix, iters, batch_size, g,
                                        target=[e[node] for e in envs_f], rounding=rounding,
                                        codes=weight_codes(mod)[0] if again else None, freeze=not again,
                                        float_mod=twin)
                holders.setdefault(id(op.weight), mod)
                corrected.update({id(op.bias)} if op.bias is not None and fix else set())
                if twin is not None:
                    rec.notes.append("shared: weight rounded once" + ("" if fix else ", bias corrected once"))
                changes.append(rec)
                bar.update(1)
                bar.set_postfix(layer=node.target)
                for eq in envs_q:
                    eq[node] = layer_forward(mod, eq[src], w_hat)
            else:
                for env in envs_f:
                    _eval(gm, mods, node, env)
                for env in envs_q:
                    _eval(gm, mods, node, env, rounded)
            for n in node.all_input_nodes:  # free values nothing later reads
                if last_use.get(n) == i:
                    for env in (*envs_f, *envs_q):
                        env.pop(n, None)
            if spans and i in spans:
                done = block(i)


def _eval(gm: fx.GraphModule, mods: dict[str, nn.Module], node: fx.Node, env: dict[fx.Node, Any],
          rounded: dict[str, Any] | None = None) -> None:
    """Compute ``node`` (not an observer, not a weighted layer) from the values in ``env``; a module named in
    ``rounded`` runs that forward instead (``layers.rounded_forward``: its int8 weights, for the quantized walk)."""
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    if node.op == "get_attr":
        val: Any = gm
        for part in str(node.target).split("."):
            val = getattr(val, part)
        env[node] = val
    elif node.op == "call_module":
        run = rounded.get(str(node.target)) if rounded else None
        env[node] = (run or mods[node.target])(*args, **kwargs)  # type: ignore[index]
    elif node.op == "call_function":
        env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    else:  # call_method
        env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)  # type: ignore[arg-type]


def _block(gm: fx.GraphModule, nodes: list[fx.Node], i: int, j: int, mods: dict[str, nn.Module],
           envs_f: list[dict[fx.Node, Any]], envs_q: list[dict[fx.Node, Any]], last_use: dict[fx.Node, int],
           changes: list[LayerChange], bar: Any, bias_correction: bool, iters: int, batch_size: int,
           g: torch.Generator, learn_grids: bool = False, rounded: dict[str, Any] | None = None) -> None:
    """Nodes ``i+1 .. j`` (a residual block): codes (and with ``learn_grids`` activation step sizes) learned
    together on the block output, then layer by layer bias correction with those, as the one-layer path does."""
    span, start, end = nodes[i + 1: j + 1], nodes[i], nodes[j]
    weighted = [n for n in span if n.op == "call_module" and is_weighted(mods[n.target])]  # type: ignore[index]
    pos = {n: k for k, n in enumerate(weighted)}
    fqs = {n: _fq(mods[n.target]) for n in span if n.op == "call_module"  # type: ignore[index]
           and isinstance(mods[n.target], (ObserverBase, FakeQuantize))}  # type: ignore[index]
    learn = learnable_grids(span, mods) if learn_grids else {}

    def run_node(node: fx.Node, env: dict[fx.Node, Any], w_hats: list[torch.Tensor] | None) -> None:
        if node in pos:  # w_hats None: the float layer
            w = None if w_hats is None else w_hats[pos[node]]
            env[node] = layer_forward(mods[node.target], env[node.args[0]], w)  # type: ignore[index]
        elif node in fqs:
            fq = learn.get(node, fqs[node]) if w_hats is not None else None
            # a copy: an in-place op after the observer (torchvision's shared `ReLU(inplace=True)`) must not
            # rewrite the layer output kept as the bias correction's target (only the observer reads the layer)
            env[node] = fq(env[node.args[0]]) if fq is not None else env[node.args[0]].clone()
        else:
            _eval(gm, mods, node, env, rounded if w_hats is not None else None)

    for ef in envs_f:  # the float block, before any weight or bias changes
        for node in span:
            run_node(node, ef, None)
    grids = [weight_codes(mods[n.target]) for n in weighted]  # type: ignore[index]
    codes = [q for q, *_ in grids]
    if len({(lo, hi) for *_, lo, hi in grids}) == 1:
        weights = [split(mods[n.target])[0].weight for n in weighted]  # type: ignore[index]
        scales, zeros = [gr[1] for gr in grids], [gr[2] for gr in grids]
        xq, target = [e[start] for e in envs_q], [e[end] for e in envs_f]
        bar.set_postfix(block=f"{start.name} -> {end.name}, {len(weighted)} layers")
        with torch.enable_grad():
            learned = block_codes(weights, scales, zeros, grids[0][3], grids[0][4],
                                  span_sample(span, start, end, run_node, xq, target, batch_size, g), iters=iters,
                                  grids=list(learn.values()))

        def error(qs: list[torch.Tensor]) -> float:  # block output MSE on the first calibration batch
            env: dict[fx.Node, Any] = {start: xq[0].clone()}  # (kept for the next runs: in-place ops)
            for node in span:
                run_node(node, env, [(q - z) * s for q, s, z in zip(qs, scales, zeros)])
            return float((env[end] - target[0]).pow(2).mean())
        e_learned, active = error(learned), dict(learn)
        learn.clear()  # round-to-nearest on the calibrated grids
        if e_learned <= error(codes):
            codes = learned
            for node, gr in active.items():  # the learned grids replace their observers
                fqs[node] = _fq(install_grid(gm, mods, node, gr))
    learn.clear()
    for p, node in enumerate(span, start=i + 1):  # layer by layer: bias correction with the block's codes
        if node in pos:
            src = node.args[0]
            with torch.enable_grad():
                w_hat, rec = _layer(str(node.target), mods[node.target], [e[src] for e in envs_q],  # type: ignore[index]
                                    [e[src] for e in envs_f], False, bias_correction, iters, batch_size, g,
                                    target=[e[node] for e in envs_f], codes=codes[pos[node]])
            rec.notes.append(f"block {start.name} -> {end.name}")
            changes.append(rec)
            bar.update(1)
            bar.set_postfix(layer=node.target)
            for eq in envs_q:
                eq[node] = layer_forward(mods[node.target], eq[src], w_hat)  # type: ignore[index]
        else:
            for eq in envs_q:
                run_node(node, eq, [])
        for n in (start, *span[: p - i]):  # free values nothing later reads
            if last_use.get(n, -1) <= p and n is not end:
                for env in (*envs_f, *envs_q):
                    env.pop(n, None)


def patch_observers(model: nn.Module, mode: str) -> list[nn.Module]:
    """Make every activation observer the identity (``float``) or a fake-quantizer (``quant``); no statistics.
    ``quant`` also runs every layer ``convert`` gives int8 weights that no pass rounds (a transposed conv) on those
    weights (``layers.rounded_forward``), so the model computes what the int8 model does. Undo: pop ``forward``
    from each returned module's ``__dict__``."""
    patched = []
    for m in model.modules():
        if isinstance(m, (ObserverBase, FakeQuantize)):
            fq = _fq(m) if mode == "quant" else None
            m.forward = fq if fq is not None else (lambda x, *a, **k: x)  # type: ignore[method-assign]
            patched.append(m)
        elif mode == "quant" and (run := rounded_forward(m)) is not None:
            m.forward = run  # type: ignore[method-assign]
            patched.append(m)
    return patched
