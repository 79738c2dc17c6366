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
Eager-mode prepared models go through ``reconstruct_eager`` (one model pass per layer). The per-layer step
(``_layer``) and the helpers shared with the other walks live in ``layerwise_step``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn

from ..batches import batch_failed
from ..fake_quant import FakeQuantize
from ..observer import ObserverBase
from .block import block_codes, find_blocks, install_grid, learnable_grids, span_sample
from .layers import is_weighted, layer_forward, rounded_before, rounded_forward, shared_layers, split, weight_codes
from .children import child_graphs, observers_as, reconstruct_children
from .layerwise_eager import reconstruct_eager
# the per-layer step and the shared helpers (``layerwise_step``), importable from here as before; ``_walk`` and
# ``_block`` look ``_layer`` up in this module
from .layerwise_step import LayerChange, _check_steps, _fq, _layer, batch_tuples, patch_observers
from .layerwise_step import _quadratic as _quadratic

__all__ = ["LayerChange", "patch_observers", "reconstruct", "ROUNDINGS"]

ROUNDINGS = ("adaround", "quadratic", "depthwise")


def reconstruct(prepared: nn.Module, calib: Iterable[Any], adaround: bool = True, bias_correction: bool = True,
                iters: int = 500, batch_size: int = 8, seed: int = 0, progress: bool = True,
                blocks: bool = False, learn_grids: bool = False, rounding: str = "adaround",
                float_calib: Iterable[Any] | None = None, drop: float = 0.0) -> list[LayerChange]:
    """Learned rounding and/or bias correction for every weighted layer of a calibrated ``prepared`` model.

    Graph-mode models (``prepare_fx``) get the one-pass lockstep walk; others ``reconstruct_eager``.
    ``blocks=True`` (graph mode, with ``adaround``): the layers of every residual block round together on
    the block's output (``lowbit.algorithms.block``, BRECQ), the others layer by layer; ``learn_grids``: a
    block's output grid joins the block and the step sizes of its activation grids learn with the rounding
    (LSQ; ``block.learnable_grids``), the learned grids replace their observers (``FixedQParamsObserver``).
    ``drop`` (with ``blocks``; QDrop, Wei et al. 2022): while a block learns its codes, each element of each
    activation grid's output inside the block is its float input instead with probability ``drop`` (a fresh draw
    per step; the keep-if-better check and bias correction run every grid). 0 (default): every grid quantizes.
    ``rounding`` (layer-by-layer path): ``"adaround"``, ``"quadratic"`` (``lowbit.algorithms.quadratic``: codes
    minimising the layer's output error on all calibration data, every Linear / dense or depthwise conv) or
    ``"depthwise"`` (those codes on depthwise convs only). Returns one ``LayerChange`` per layer, in order. The
    model is changed in place (weights, biases, weight grids pinned for ``convert``/``convert_fx``).
    A model ``prepare_fx`` prepared child by child (an untraceable ``forward``: the model itself, or an opaque leaf
    of its graph) gets the same walk on each child graph, with every option (``lowbit.algorithms.children``);
    ``reconstruct_eager`` takes eager-mode (``prepare``) models. ``float_calib`` (graph mode): the float walk's
    inputs, batch for batch with ``calib`` (default: ``calib`` itself), as ``children`` feeds a child graph.
    """
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:  # (an array: `in` is elementwise)
        raise ValueError(f"reconstruct: rounding={rounding!r}; choose one of {list(ROUNDINGS)}")
    seed = _check_steps("reconstruct", iters, batch_size, seed)  # a NumPy / torch integer: a Python int
    if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0.0 <= drop < 1.0:
        raise ValueError(f"reconstruct: drop={drop!r} must be a number in [0, 1) (the probability that an "
                         "activation element stays float while a block learns its rounding)")
    if not isinstance(prepared, nn.Module):
        raise TypeError(f"reconstruct: prepared must be an nn.Module, got {type(prepared).__name__}")
    if not any(isinstance(m, (ObserverBase, FakeQuantize)) for m in prepared.modules()):  # (returned [], silently)
        raise TypeError(f"reconstruct: needs a calibrated prepared model (prepare_fx / prepare), got "
                        f"{type(prepared).__name__} with no observer (a float or converted model: nothing to round)")
    opts = dict(adaround=adaround, bias_correction=bias_correction, iters=iters, batch_size=batch_size, seed=seed,
                progress=progress, blocks=blocks, learn_grids=learn_grids, rounding=rounding, drop=float(drop))
    calib = batch_tuples(calib, "reconstruct")  # (once: a generator is read here, and again below on a failure)
    try:
        if not isinstance(prepared, fx.GraphModule) and child_graphs(prepared):  # prepare_fx on an untraceable
            return reconstruct_children(prepared, calib, **opts)  # type: ignore[arg-type]  forward: its children
        if not isinstance(prepared, fx.GraphModule):
            return reconstruct_eager(prepared, calib, adaround, bias_correction, iters, batch_size, seed, progress)
        return _reconstruct_graph(prepared, calib, float_calib, **opts)  # type: ignore[arg-type]
    except Exception as err:
        bad = failing_batch(prepared, calib, "reconstruct")
        if bad is None:  # (not the data: the error as it was)
            raise
        raise bad from err


def failing_batch(model: nn.Module, batches: list[tuple[Any, ...]], where: str) -> ValueError | None:
    """A ``ValueError`` naming the first of ``batches`` that ``model`` cannot run (its observers the identity, no
    statistics, no_grad): its index, input shapes and the model's first error line; ``None`` if every batch runs. Run
    only after a walk failed (a later batch of another shape raised torch's bare ``mat1 and mat2 shapes cannot be
    multiplied`` from inside the walk).

    >>> import torch
    >>> failing_batch(torch.nn.Linear(2, 1), [(torch.zeros(1, 2),), (torch.zeros(1, 3),)], "demo").args[0][:41]
    'demo: calib batch 1 (input shapes [(1, 3)'
    """
    with observers_as(model, "float"), torch.no_grad():
        for i, b in enumerate(batches):
            try:
                model(*b)
            except Exception as e:  # (any error of the user's model on this batch)
                return batch_failed(where, f"calib batch {i}", b, e)
    return None


def _reconstruct_graph(prepared: fx.GraphModule, calib: Iterable[Any], float_calib: Iterable[Any] | None, *,
                       adaround: bool, bias_correction: bool, iters: int, batch_size: int, seed: int, progress: bool,
                       blocks: bool, learn_grids: bool, rounding: str, drop: float = 0.0) -> list[LayerChange]:
    """``reconstruct``'s one-pass lockstep walk of one graph (its opaque leaves run as they are, float)."""
    from tqdm.auto import tqdm

    gm, batches, g = prepared, batch_tuples(calib, "reconstruct"), torch.Generator().manual_seed(seed)
    batches_f = batches if float_calib is None else batch_tuples(float_calib, "reconstruct")
    if len(batches_f) != len(batches):
        raise ValueError(f"reconstruct: float_calib has {len(batches_f)} batches, calib {len(batches)}; give one "
                         "float batch per calibration batch")
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
    patched = observers_as(gm, "float")  # observers inside opaque leaves must not keep observing
    patched.__enter__()
    try:
        spans = find_blocks(nodes, mods, learn_grids) if blocks and adaround and iters > 0 else {}
        # a layer called at several nodes or holding a tied weight rounds once, never in a block (module doc)
        shared = shared_layers(gm)
        twins = {name: copy.deepcopy(mods[name]) for name in shared}
        spans = {i: j for i, j in spans.items() if not any(str(n.target) in shared for n in nodes[i + 1: j + 1])}
        # layers convert gives int8 weights that no pass rounds (transposed convs): the quantized walk runs them
        # on those weights, as the int8 model does
        rounded = {name: f for name, m in mods.items() if (f := rounded_forward(m)) is not None}
        # opaque leaves holding child graphs (an untraceable submodule): their children are rounded when the walk
        # reaches them, on the walk's inputs; the float walk runs a copy taken now (observers the identity)
        opaque = {str(n.target): copy.deepcopy(mods[n.target]) for n in nodes  # type: ignore[index]
                  if n.op == "call_module" and child_graphs(mods[n.target])}  # type: ignore[index]
        _walk(gm, nodes, mods, batches, envs_f, envs_q, last_use, changes, bar, adaround, bias_correction, iters,
              batch_size, g, spans, learn_grids, rounding, rounded, twins, batches_f, opaque, seed, progress, blocks,
              drop)
    finally:
        patched.__exit__(None, None, None)
        bar.close()
    return changes


def _walk(gm: fx.GraphModule, nodes: list[fx.Node], mods: dict[str, nn.Module], batches: list[tuple[Any, ...]],
          envs_f: list[dict[fx.Node, Any]], envs_q: list[dict[fx.Node, Any]], last_use: dict[fx.Node, int],
          changes: list[LayerChange], bar: Any, adaround: bool, bias_correction: bool, iters: int, batch_size: int,
          g: torch.Generator, spans: dict[int, int] | None = None, learn_grids: bool = False,
          rounding: str = "adaround", rounded: dict[str, Any] | None = None,
          twins: dict[str, nn.Module] | None = None, batches_f: list[tuple[Any, ...]] | None = None,
          opaque: dict[str, nn.Module] | None = None, seed: int = 0, progress: bool = False,
          blocks: bool = False, drop: float = 0.0) -> None:
    placeholders = [n for n in nodes if n.op == "placeholder"]
    done = -1
    twins = twins or {}
    holders: dict[int, nn.Module] = {}  # weight id -> the layer that rounded it
    corrected: set[int] = set()  # ids of the biases corrected so far

    def block(i: int) -> int:
        _block(gm, nodes, i, spans[i], mods, envs_f, envs_q, last_use, changes, bar,  # type: ignore[index]
               bias_correction, iters, batch_size, g, learn_grids, rounded, drop)
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
                for ef, eq, b, bf in zip(envs_f, envs_q, batches, batches_f or batches):
                    dflt = node.args[0] if node.args else None
                    eq[node] = b[k] if k < len(b) else dflt
                    ef[node] = bf[k] if k < len(bf) else dflt
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
            elif mod is not None and opaque and str(node.target) in opaque:
                _opaque(node, mod, opaque[str(node.target)], envs_f, envs_q, changes, adaround, bias_correction,
                        iters, batch_size, seed, progress, blocks, learn_grids, rounding, drop)
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


def _opaque(node: fx.Node, mod: nn.Module, twin: nn.Module, envs_f: list[dict[fx.Node, Any]],
            envs_q: list[dict[fx.Node, Any]], changes: list[LayerChange], adaround: bool, bias_correction: bool,
            iters: int, batch_size: int, seed: int, progress: bool, blocks: bool, learn_grids: bool,
            rounding: str, drop: float = 0.0) -> None:
    """An opaque leaf holding child graphs: round its children on its inputs in the walk (quantized and float), then
    run it as the int8 model (``x_q``) and its float copy (``x_f``)."""
    def calls(envs: list[dict[fx.Node, Any]]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(fx.node.map_arg(node.args, e.__getitem__), fx.node.map_arg(node.kwargs, e.__getitem__))
                for e in envs]  # type: ignore[misc]

    cq, cf = calls(envs_q), calls(envs_f)
    with torch.enable_grad():
        recs = reconstruct_children(mod, cq, adaround, bias_correction, iters, batch_size, seed, progress, blocks,
                                    learn_grids, rounding, float_model=twin, float_calib=cf, drop=drop)
    for rec in recs:
        rec.name = f"{node.target}.{rec.name}"
        rec.notes[-1] = f"child {node.target}.{rec.notes[-1][len('child '):]}"
    changes += recs
    with observers_as(mod, "quant"):
        for eq, (a, k) in zip(envs_q, cq):
            eq[node] = mod(*a, **k)
    for ef, (a, k) in zip(envs_f, cf):
        ef[node] = twin(*a, **k)


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
           g: torch.Generator, learn_grids: bool = False, rounded: dict[str, Any] | None = None,
           drop: float = 0.0) -> None:
    """Nodes ``i+1 .. j`` (a residual block): codes (and with ``learn_grids`` activation step sizes) learned
    together on the block output, then layer by layer bias correction with those, as the one-layer path does."""
    span, start, end = nodes[i + 1: j + 1], nodes[i], nodes[j]
    weighted = [n for n in span if n.op == "call_module" and is_weighted(mods[n.target])]  # type: ignore[index]
    pos = {n: k for k, n in enumerate(weighted)}
    fqs = {n: _fq(mods[n.target]) for n in span if n.op == "call_module"  # type: ignore[index]
           and isinstance(mods[n.target], (ObserverBase, FakeQuantize))}  # type: ignore[index]
    learn = learnable_grids(span, mods) if learn_grids else {}
    dropping = [False]  # on only inside block_codes's steps (QDrop)

    def run_node(node: fx.Node, env: dict[fx.Node, Any], w_hats: list[torch.Tensor] | None) -> None:
        if node in pos:  # w_hats None: the float layer
            w = None if w_hats is None else w_hats[pos[node]]
            env[node] = layer_forward(mods[node.target], env[node.args[0]], w)  # type: ignore[index]
        elif node in fqs:
            fq = learn.get(node, fqs[node]) if w_hats is not None else None
            # a copy: an in-place op after the observer (torchvision's shared `ReLU(inplace=True)`) must not
            # rewrite the layer output kept as the bias correction's target (only the observer reads the layer)
            env[node] = fq(env[node.args[0]]) if fq is not None else env[node.args[0]].clone()
            if fq is not None and dropping[0]:  # QDrop: these elements stay float this step
                x = env[node.args[0]]
                env[node] = torch.where(torch.rand(x.shape, generator=g) < drop, x, env[node])
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
        sample = span_sample(span, start, end, run_node, xq, target, batch_size, g)
        if drop:
            sample = _dropping(sample, dropping)
        with torch.enable_grad():
            learned = block_codes(weights, scales, zeros, grids[0][3], grids[0][4], sample, iters=iters,
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


def _dropping(sample: Any, flag: list[bool]) -> Any:
    """``sample`` whose runs set ``flag[0]`` while they run (``_block``'s QDrop switch)."""
    def wrapped() -> tuple[Any, torch.Tensor]:
        run, target = sample()

        def run_dropping(w_hats: list[torch.Tensor]) -> torch.Tensor:
            flag[0] = True
            try:
                return run(w_hats)
            finally:
                flag[0] = False
        return run_dropping, target
    return wrapped
