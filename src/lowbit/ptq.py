"""One call for post-training static quantization: ``quantize_ptq(model, calib, recipe)``.

Takes a plain float model (no stubs; eval mode is set) and an iterable of calibration batches
(tensors, or tuples of the model's positional inputs), and returns ``(qmodel, report)``: a model on
the real int8 kernels and a ``PTQReport`` saying what every step changed. Recipes:

``"default"``    graph mode as ``prepare_fx`` → calibrate → ``convert_fx`` with
                 ``get_default_qconfig_mapping()`` (histogram activations, per-channel weights).
``"accurate"``   fuse (BN folded; ReLU/ReLU6 folded into the layer's output grid) → equalize
                 (``lowbit.algorithms.equalize``, see below; residual streams:
                 ``lowbit.algorithms.equalize_stream``) → calibrate (``get_accurate_qconfig()``:
                 MSE-searched activation and per-channel weight ranges) → refine the 8 costliest
                 activation grids on the model's output (``lowbit.algorithms.grid_search``) → round (AdaRound on the
                 quantized model's own inputs: the layers of a residual block together on the block's
                 output, BRECQ, with the step sizes of the block's activation grids learned alongside
                 (LSQ); the others layer by layer) → correct bias (empirical) → convert → float output
                 (int8 Linears read only by dequantize return float: ``fuse_dequantize``).
``"balanced"``   the cheap middle: the default recipe's grids (histogram activations, per-channel weights,
                 no equalization) → round every Linear / dense or depthwise conv by
                 ``lowbit.algorithms.quadratic`` (codes minimising the layer's output error on all the
                 calibration data, no AdaRound) → correct bias → convert: minutes where ``"accurate"``
                 takes tens of minutes. EfficientNet-Lite0 (48 / 96 crops, ``tests/test_realdata_imagenet.py``):
                 0.948 / 24.19 dB at 1 and at 2 threads, ``quantize_ptq`` 182 s at 1 thread on a 2-core AVX2
                 EPYC at load 2-3 (435 s at load 3-4 before session 10's exact speed-ups of the quadratic
                 search: the same codes); the 8-bit input grid alone caps these
                 fractional-pixel crops near 23.6 dB, so 30 dB is not an all-int8 figure there (``docs/design.md``).
                 The ``"accurate"``-only options (``ptq_checks.ACCURATE_ONLY``: ``iters``, ``batch_size``,
                 ``seed``, ``blocks``, ``learn_grids``, ``rounding``, ``equalize``, ``streams``, ``refine``,
                 ``float_output``, ``tune``, ``distill``) do not apply to ``"balanced"`` nor ``"default"``: given
                 another value than their default there, they are refused with a ``ValueError`` naming option,
                 value and recipe (they were silently ignored; the default passed explicitly is fine).

Per-channel weights already give every output channel its own grid, so weight-range equalization
buys little; what per-tensor activation grids need is channels of alike range. ``equalize="range"``
(the default) stretches every channel of a clamped layer (ReLU6) that stays below the clamp so that
it fills it, where the next layer is depthwise and absorbs the scale exactly (``relu6="range"`` in
``lowbit.algorithms.equalize``), and by ``s^0.5`` (half of it) where the next layer is dense, whose row grids pay
the rest (``equalize_prepared(dense=0.5)``, ``ptq_steps.DENSE``: MobileNetV2's depthwise -> projection pairs, +0.2-0.3
dB logit SQNR; ``docs/design.md``); ``equalize=True`` adds the weight-range equalization of ReLU /
identity pairs, ``False`` turns both off. Measured on MobileNetV2 (``benchmarks/accuracy.py``):
default 0.688 top-1 agreement / 11.40 dB logit SQNR; accurate (100 AdaRound steps per layer)
0.875 / 15.82 dB without the stretch, 0.927 / 16.93 dB with it, 0.917 / 17.26 dB with MSE-searched
ranges too (500 steps with histogram ranges: 0.906 / 17.46 dB); with residual blocks rounded together
(``blocks``) 0.885 / 17.49 dB where layer by layer gives 0.865 / 17.26 dB, and with the blocks' activation
step sizes learned too (``learn_grids``) 0.896 / 18.17 dB, and with the residual streams equalized
(``streams``, the recipe) 0.917 / 19.54 dB (all at 1 thread, 96 evaluation crops; on 480 the recipe measures
0.867 / 19.62 dB at 1 thread, 0.898 / 19.62 dB at 2 with 48 calibration crops, 0.896 / 20.12 and 0.896 / 20.13
with 96; with the grid refinement and float logits (the recipe since session 17) and 192 crops 0.904 / 21.24 and
0.896 / 21.15, on 1440 evaluation crops 0.905 / 21.14 and 0.897 / 21.09: short of a robust 0.90, ``docs/design.md``).
The whole-model check in the report (``sqnr_db`` on the first calibration batch) compares the float
and the int8 model's outputs. A model in which the mapping quantizes nothing (no layer or op gets a qconfig:
``nn.Sequential(nn.Flatten())``, a mapping of ``None`` everywhere) is refused with a ``ValueError`` naming it and
its module types (before, the float model came back as the "int8" one, scored ``inf`` dB).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU6(), nn.Flatten(), nn.Linear(8 * 36, 4))
>>> calib = [torch.randn(8, 3, 8, 8) for _ in range(2)]
>>> qmodel, report = Q.quantize_ptq(model, calib, recipe="accurate", iters=20, progress=False)
>>> [step for step, _ in report.steps]
['fuse', 'equalize', 'calibrate', 'refine grids', 'round', 'correct bias', 'convert', 'float output']
>>> report.float_output                                  # the last Linear gives the float logits
['4']
>>> report.sqnr_db > 20
True
>>> q1, r1 = Q.quantize_ptq(model, calib, recipe="balanced", progress=False)
>>> [step for step, _ in r1.steps], r1.sqnr_db > 20
(['fuse', 'calibrate', 'round', 'correct bias', 'convert'], True)
>>> q2, r2 = Q.quantize_ptq(model, calib, recipe="default", max_float_layers=1, progress=False)
>>> len(r2.float_layers) <= 1 and [step for step, _ in r2.steps][-1]
'float layers'
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .algorithms.layerwise import LayerChange, reconstruct
from .ptq_checks import (RECIPES, batch_failed, check_model, check_options, check_quantizes_something,
                         check_sample_axis, first_failing_batch, ptq_batches, whole_graph_skip)
from . import ptq_steps
from .ptq_steps import equalize_step, refine_step, round_children
from .fx import convert_fx, prepare_fx
from .qconfig import QConfigMapping, get_default_qconfig_mapping
from .recipes import get_accurate_qconfig

__all__ = ["quantize_ptq", "PTQReport", "RECIPES"]

@dataclass
class PTQReport:
    """What ``quantize_ptq`` did: ``steps`` as (name, summary), per-layer ``layers`` changes, ``sqnr_db``."""

    recipe: str
    steps: list[tuple[str, str]] = field(default_factory=list)
    layers: list[LayerChange] = field(default_factory=list)
    equalized: list[Any] = field(default_factory=list)
    sqnr_db: float = float("nan")
    float_layers: list[str] = field(default_factory=list)
    float_output: list[str] = field(default_factory=list)
    op_keys: dict[str, tuple[str, Any, int]] = field(default_factory=dict)  # float ops: name -> call-order key
    children: dict[str, list[str]] = field(default_factory=dict)  # child graph (untraceable forward) -> what ran

    def __str__(self) -> str:
        lines = [f"quantize_ptq(recipe={self.recipe!r}): output SQNR vs float {self.sqnr_db:.2f} dB"]
        lines += [f"  {name:<13} {summary}" for name, summary in self.steps]
        if self.layers:
            lines.append("  layer                              out-MSE nearest -> after   codes changed   |bias shift|")
            lines += [f"  {c.name:<34} {c.mse_nearest:10.3g} -> {c.mse_after:<10.3g} {c.codes_changed:8.1%}"
                      f"   {c.bias_shift:10.3g}" for c in self.layers]
        if self.children:
            lines.append("  child graph (an untraceable forward's children, prepared one by one)")
            lines += [f"  {p:<34} {'; '.join(what)}" for p, what in self.children.items()]
        return "\n".join(lines)


def _sqnr(ref: Any, out: Any) -> float:
    """``10 log10(Σ ref² / Σ (ref - out)²)`` over every output tensor (nested outputs flattened)."""
    from .batches import flatten_outputs

    refs, outs = flatten_outputs(ref), flatten_outputs(out)
    if not refs or len(refs) != len(outs):
        return float("nan")
    signal = sum(float(r.detach().double().pow(2).sum()) for r in refs)
    noise = sum(float((r.detach().double() - o.detach().double()).pow(2).sum()) for r, o in zip(refs, outs))
    if noise == 0:
        return float("inf")
    return 10 * math.log10(signal / noise) if signal > 0 else float("-inf")  # a zero output with noise: -inf dB


def _mark_rescaled(qmodel: nn.Module, equalized: list[Any]) -> None:
    """Record in ``qmodel.lowbit_report.rescaled`` which layers equalization rescaled: a pair's first layer and a
    stream's writers (their output channels: ``"output"``), a pair's second layer and a stream's readers (their
    input channels: ``"weight"``). ``lowbit.debug.compare`` leaves those cells out instead of scoring a rescale."""
    report = getattr(qmodel, "lowbit_report", None)
    if report is None:
        return
    for e in equalized:
        outs, ins = (([e.first], [e.second]) if hasattr(e, "first") else (list(e.writers), list(e.readers)))
        for name in ins:
            report.rescaled.setdefault(name, "weight")
        for name in outs:
            report.rescaled[name] = "output"


def quantize_ptq(model: nn.Module, calib: Iterable[Any], recipe: str = "accurate", *,
                 qconfig_mapping: QConfigMapping | None = None, iters: int = 500, batch_size: int = 8,
                 equalize: bool | str = "range", streams: float | None = 0.75, blocks: bool = True,
                 learn_grids: bool = True, tune: int = 0, max_float_layers: int = 0, progress: bool = True,
                 seed: int = 0, rounding: str = "adaround", refine: int = 8,
                 float_output: bool = True, distill: int = 0) -> tuple[nn.Module, PTQReport]:
    """Quantize a float ``model`` with ``recipe`` (``"default"``, ``"accurate"`` or ``"balanced"``, module doc);
    return ``(qmodel, report)``.

    ``qconfig_mapping`` (default: ``get_default_qconfig_mapping()`` for ``"default"`` and ``"balanced"``,
    ``get_accurate_qconfig()``
    as the global setting for ``"accurate"``: MSE-searched ranges) chooses the grids; ``iters`` and
    ``batch_size`` are AdaRound's optimisation steps and samples per step (per layer); ``equalize``
    (``accurate`` only): ``"range"`` stretches clamped channels into depthwise layers, ``True`` adds the
    weight-range equalization of ReLU / identity pairs, ``False`` neither (nor ``streams``). ``streams``
    (``accurate`` with ``equalize``): every residual stream's channels are rescaled across its writers and
    readers (``lowbit.algorithms.equalize_stream``) with this ``alpha`` (activation ranges vs the readers'
    weight ranges), ``None`` skips it. ``blocks`` (``accurate`` only):
    the layers of every residual block learn their rounding together on the block's output (BRECQ,
    ``lowbit.algorithms.block``), with QDrop (``ptq_steps.QDROP``: while a block learns, each activation element
    inside it stays float with probability 0.5, ``reconstruct(drop=)``); ``False``: every layer on its own output.
    ``learn_grids`` (with ``blocks``):
    the block's output grid joins the block and the step sizes of its activation grids learn with the
    rounding (LSQ; zero points fixed, a ReLU6 grid kept inside its clamp); the learned grids are what
    ``convert_fx`` uses. ``tune`` (``accurate`` only, default 0: off): after rounding and bias correction, that
    many Adam steps (16 samples each) tune every layer's bias on the whole model's output against the float
    model's, codes fixed (``lowbit.algorithms.tune``, AdaQuant's bias tuning; kept only if the calibration
    error drops). Off by default: on MobileNetV2 it lifts a 100-step build to the 500-step recipe's 22.1 dB but
    not past it, and after 500 steps every run raised the calibration error (not kept; ``docs/design.md``).
    ``distill`` (``accurate`` only, default 0: off): after rounding, bias correction and ``tune``, that many
    Adam steps (16 samples each) distill the rounded model into the float model's output: weight codes, biases
    and learned activation steps together, codes straight-through on their fixed grids (``lowbit.algorithms.distill``;
    kept only if the calibration error drops). MobileNetV2 (100 AdaRound steps, 192 calibration crops, 150
    steps, 1 thread, 1440 evaluation crops): 0.899 / 21.30 dB -> 0.913 / 22.42 dB. ``refine`` (``accurate``
    only, default 8; 0: off): after calibration, the step of that many activation grids (the costliest on the
    model's output, each alone) is searched on the model's output error on the first calibration batch
    (``lowbit.algorithms.grid_search``; the output prefers more clipping than the tensor's MSE range); a shrunk
    step is kept only if it also lowers that error on the next calibration batches (up to 64 samples; none left
    with a single batch: the search's step stands).
    ``float_output`` (``accurate`` only, default True): after convert, every int8 Linear read only by dequantize
    nodes returns its float result (``lowbit.algorithms.float_output.fuse_dequantize``: the same int8 kernel, one
    8-bit rounding and clip of the output less; ``report.float_output`` names them). MobileNetV2 (1 thread,
    100 AdaRound steps, 1440 evaluation crops): 96 calibration crops 0.897 / 20.08 dB with neither, 0.896 / 20.85
    with both; 192 calibration crops 0.892 / 20.34 with neither, 0.902 / 21.02 with ``refine=8``, **0.905 / 21.14**
    with both (``docs/design.md``).
    ``max_float_layers`` (any recipe, default 0): after convert, keep up to that many
    layers or ops float, picked label-free on the first calibration batch by the output SQNR against the
    float model (``lowbit.debug.auto_mixed_precision``'s ``search="fast"`` walk on this converted model, on its
    candidates: weighted layers, BN, activations, and the adds / muls / cats a call-order key reaches, each
    ranked by the SQNR with only it float, then greedily while the SQNR improves); a float layer or op reads
    its input dequantized and its output is rounded onto its calibrated grid only where an int8 op reads it
    (a reused layer: one float copy per call, on the grid of that call's outputs), the int8 ops ``prepare_fx``
    would then keep float as islands are float too, every other layer stays on the int8 kernels: with the
    default recipe the returned model is, output for output, the one ``prepare_fx`` builds with
    ``set_module_name(L, None)`` / ``set_module_name_object_type_order(*report.op_keys[op], None)``.
    ``report.float_layers`` names them as ``auto_mixed_precision`` does (an op: ``"module:function#index"``,
    ``report.op_keys`` its key). Under ``"accurate"`` it
    buys little (EfficientNet-Lite0 23.59 -> 23.89 dB with 2 float layers): the rounding fits that batch and
    the downstream corrections keep compensating the error a float layer no longer makes; pick the layers
    before rounding instead (``auto_mixed_precision(..., search="fast")`` on ``get_accurate_qconfig()``, then
    ``qconfig_mapping=`` its mapping: Lite0 with 16 float layers 0.969 / 28.84 dB; ``docs/design.md``).
    ``rounding`` (``accurate``, layer-by-layer path; residual blocks keep BRECQ): ``"adaround"`` (default),
    ``"depthwise"`` (depthwise convs take ``lowbit.algorithms.quadratic``'s codes, minimising the layer's output
    error on all calibration data at full resolution, borders included) or ``"quadratic"`` (every Linear and
    dense / depthwise conv; with ``iters=0`` no AdaRound runs). EfficientNet-Lite0, histogram ranges,
    ``equalize=False, blocks=False, rounding="quadratic"``: 0.948 / 23.99 dB (AdaRound with those grids, the Lite0
    test's settings until session 9: 0.938 / 23.74; MobileNetV2 the same way 0.833 / 16.25 dB); the accurate grids
    and equalization with ``blocks=False, iters=0, rounding="quadratic"``: 0.938 / 24.45 dB. ``model`` itself is not changed.
    A model whose own ``forward`` torch.fx cannot trace (control flow on a shape or on data) has its children
    prepared one by one as graphs of their own, as has an untraceable submodule's; ``"accurate"`` then equalizes,
    refines grids and rounds (``rounding``, ``blocks``, ``learn_grids``, ``iters``, ``seed``) each child graph on its
    inputs in the whole model (``lowbit.ptq_steps``, ``lowbit.algorithms.children``; a grid judged on its child's
    output, pairs spanning two children not equalized), ``report.children`` saying per child what ran or why not;
    ``tune`` / ``distill`` run on the whole model (eagerly: its control flow included) with every child's layers.
    Within ``"accurate"``, an option the others leave unread is refused when given another value than its default
    (``lowbit.ptq_checks.unread_options``): ``streams`` with ``equalize=False`` (``None`` passes), ``batch_size``
    with ``iters=0``, ``seed`` with ``iters=0, tune=0, distill=0``; the error names both options.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ptq: model must be an nn.Module, got {type(model).__name__}")
    check_options(recipe, iters=iters, batch_size=batch_size, seed=seed, blocks=blocks, rounding=rounding,
                  learn_grids=learn_grids, distill=distill, tune=tune, float_output=float_output, refine=refine,
                  max_float_layers=max_float_layers, streams=streams, equalize=equalize, progress=progress)
    from tqdm.auto import tqdm

    check_model(model)
    batches = ptq_batches(calib)
    report = PTQReport(recipe)
    float_model = copy.deepcopy(model).eval()
    if recipe in ("accurate", "balanced"):  # they slice samples along dim 0
        check_sample_axis(float_model, batches[0], recipe)
    if qconfig_mapping is not None:
        mapping = qconfig_mapping
    elif recipe == "accurate":  # MSE-searched ranges on both sides (lowbit.recipes)
        mapping = QConfigMapping().set_global(get_accurate_qconfig())
    else:  # "default" and "balanced": histogram activations, per-channel weights
        mapping = get_default_qconfig_mapping()
    try:
        prepared = prepare_fx(float_model, mapping, example_inputs=batches[0])
    except ValueError as e:  # prepare_fx ran batch 0 as its example inputs: say so in calib's terms
        cause = e.__cause__
        if cause is None or not str(e).startswith("prepare_fx: running the model on example_inputs failed"):
            raise
        raise batch_failed(0, batches[0], cause) from cause
    check_quantizes_something(prepared, model)
    untraced = whole_graph_skip(prepared, model) if recipe == "accurate" else None
    fx_report = getattr(prepared, "lowbit_report", None)
    fused = list(getattr(fx_report, "fused", []) or [])
    report.steps.append(("fuse", f"{len(fused)} runs fused (BN folded, ReLU/ReLU6 into output grids)"))
    if recipe == "accurate" and equalize:
        try:
            equalize_step(prepared, batches, report, equalize=equalize, streams=streams, untraced=untraced)
        except Exception as e:  # (it runs every batch before calibration does: name a batch the model cannot run)
            named = first_failing_batch(float_model, batches)
            if named is None:
                raise
            raise named from e
    calls: dict[str, list[nn.Module]] = {}
    ends: dict[tuple[str, str], nn.Module] = {}
    handles: list[Any] = []
    if max_float_layers:  # each call of a reused layer observed on its own (its own grid when kept float)
        from .debug.graph_swap import record_call_outputs
        from .debug.swap_edges import record_share_ends

        calls, handles = record_call_outputs(prepared)
        ends, end_handles = record_share_ends(prepared)  # (where a float layer's readers observe past a max pool)
        handles += end_handles
    try:
        with torch.no_grad():
            for i, b in enumerate(tqdm(batches, desc="calibrate", disable=not progress)):
                try:
                    prepared(*b)
                except Exception as e:  # a later batch that does not fit the model (batch 0 ran in prepare_fx)
                    raise batch_failed(i, b, e) from e
    finally:
        for h in handles:
            h.remove()
    report.steps.append(("calibrate", f"{len(batches)} batches observed"))
    if recipe == "accurate" and refine:
        refine_step(prepared, batches, report, refine=refine, progress=progress, untraced=untraced)
    # the float twins of the layers kept float (max_float_layers): float weights, before rounding writes the
    # learned codes into them and bias correction shifts their biases
    calibrated = copy.deepcopy(prepared) if max_float_layers else None
    if recipe == "balanced":  # quadratic codes on every layer it supports, no AdaRound, no blocks
        iters, blocks, learn_grids, rounding = 0, False, False, "quadratic"  # (the caller's: defaults, checked)
    if recipe in ("accurate", "balanced"):  # rounding and bias correction run together, layer by layer, in one pass
        report.layers = reconstruct(prepared, batches, adaround=iters > 0 or rounding != "adaround",
                                    bias_correction=True, iters=iters,
                                    batch_size=batch_size, seed=seed, progress=progress, blocks=blocks,
                                    learn_grids=learn_grids, rounding=rounding,
                                    drop=ptq_steps.QDROP if recipe == "accurate" and blocks else 0.0)
        n = max(1, len(report.layers))
        changed = sum(c.codes_changed for c in report.layers) / n
        in_blocks = sum(any(n.startswith("block ") for n in c.notes) for c in report.layers)
        quad = sum("quadratic" in c.notes for c in report.layers)
        rest = len(report.layers) - quad - in_blocks
        report.steps.append(("round", f"{len(report.layers)} layers rounded: {quad} by the quadratic search, "
                                      f"{in_blocks} by AdaRound per residual block"
                                      f"{' (activation steps learned)' if learn_grids and blocks else ''}, "
                                      + (f"{rest} by AdaRound alone ({iters} steps each)" if iters else
                                         f"{rest} to nearest")
                                      + f"; {changed:.1%} of weight codes moved from round-to-nearest"
                                      + round_children(prepared, report, iters=iters, untraced=untraced)))
        shift = max((c.bias_shift for c in report.layers), default=0.0)
        gain = sum(c.mse_nearest > 0 and c.mse_after < c.mse_nearest for c in report.layers)
        report.steps.append(("correct bias", f"biases corrected on {len(report.layers)} layers (max |shift| "
                                             f"{shift:.3g}); output MSE lower on {gain}/{len(report.layers)}"))
        if tune:
            from .algorithms.tune import tune_biases

            # lr 1e-4, grids too (MobileNetV2, 100-step build: +0.9 dB; lr 3e-4 gained nothing; docs/design.md)
            t = tune_biases(prepared, float_model, batches, iters=tune, batch_size=16, lr=1e-4, grids=learn_grids,
                            grid_lr=1e-4, seed=seed, progress=progress)
            what = f"{t.n_biases} layers' biases" + (f" and {t.n_grids} grids" if t.n_grids else "")
            ratio = f"x{t.error_after / t.error_before:.3f}" if t.error_before else f"{t.error_after:.3g} (was 0)"
            report.steps.append(("tune biases", f"{what} tuned on the model output ({tune} steps): "
                                                f"calibration output error {ratio}"
                                                f"{'' if t.kept else ' (no gain: not kept)'}"))
        if distill:
            from .algorithms.distill import distill as distill_model

            d = distill_model(prepared, float_model, batches, iters=distill, batch_size=16, grids=learn_grids,
                              seed=seed, progress=progress)
            report.steps.append(("distill", f"{d.n_layers} layers' codes and biases"
                                            + (f", {d.n_grids} grids" if d.n_grids else "")
                                            + f" distilled on the model output ({distill} steps): calibration output"
                                            f" error x{d.error_after / max(d.error_before, 1e-30):.3f}, "
                                            f"{d.codes_moved / max(1, d.n_codes):.2%} of codes moved"
                                            + ("" if d.kept else " (no gain: not kept)")))
    qmodel = convert_fx(prepared)
    _mark_rescaled(qmodel, report.equalized)
    with torch.no_grad():
        ref = float_model(*batches[0])
        report.sqnr_db = _sqnr(ref, qmodel(*batches[0]))
    report.steps.append(("convert", f"int8 model; output SQNR on the first calibration batch {report.sqnr_db:.2f} dB"))
    if max_float_layers:
        from .debug.mixed_precision import keep_float_layers

        def score(m: nn.Module) -> float:
            return _sqnr(ref, m(*batches[0]))

        before = report.sqnr_db
        table = keep_float_layers(float_model, calibrated, qmodel, score, max_float_layers, progress=progress,
                                  who="quantize_ptq: float layers", call_outputs=calls, share_ends=ends)
        report.float_layers = list(table.float_layers)
        report.op_keys = {n: table.op_keys[n] for n in report.float_layers if n in table.op_keys}
        report.sqnr_db = table.final_metric if table.final_metric is not None else before
        n_ops = len(table.op_keys)
        report.steps.append(("float layers", f"{len(report.float_layers)} of {len(table.rows)} candidates "
                                             f"({len(table.rows) - n_ops} layers, {n_ops} ops) kept float "
                                             f"(budget {max_float_layers}): first-batch SQNR {before:.2f} -> "
                                             f"{report.sqnr_db:.2f} dB"))
    if recipe == "accurate" and float_output:
        from .algorithms.float_output import fuse_dequantize

        before = report.sqnr_db
        report.float_output = fuse_dequantize(qmodel)
        with torch.no_grad():
            report.sqnr_db = _sqnr(ref, qmodel(*batches[0]))
        report.steps.append(("float output", f"{len(report.float_output)} int8 Linears read only by dequantize give "
                                             f"their float result ({', '.join(report.float_output) or '-'}): "
                                             f"first-batch SQNR {before:.2f} -> {report.sqnr_db:.2f} dB"))
    return qmodel, report
