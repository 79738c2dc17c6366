"""Per-layer "best of" calibration: each layer gets the range methods that minimise its OUTPUT error.

For every weighted layer (``nn.Linear``, ``nn.Conv1d/2d/3d``, or a fused marker such as
``ConvReLU2d`` / ``LinearReLU`` whose first child is one) ``best_of_ranges`` records, on the
calibration batches, the layer's float input ``X`` and output ``Y = f(X, W)``, then:

    weight method  w* = argmin_w  ||f(X, Ŵ_w) - Y||²                        # Ŵ_w: W fake-quantized on w's grid
    output method  a* = argmin_a  ||q_a(f(X, Ŵ_w*)) - Y||²                  # q_a: fake-quantized on a's grid

(the candidates are the named methods of ``lowbit.recipes``: weights ``minmax``/``mse``/``percentile``,
activations ``histogram``/``minmax``/``percentile``/``entropy``/``mse``), so a weight range is judged on
what the layer computes, not on the weight error itself, and an output range on the quantized output
against the float one. The result is a ``QConfigMapping``: ``global`` = ``base`` (the ops between
layers), one ``set_module_name(layer, QConfig(a*, w*))`` per layer; use it with ``prepare`` (on the same,
already fused, model) or ``prepare_fx``. In graph mode a conv later folded with its BN is judged
before the fold. ``X`` (and ``Y``) keep whole calibration batches of the layer's input, in order, while the
samples already kept (their leading dimension: images, sequences, or rows of a 2-d input; not tokens or
pixels) number fewer than ``max_rows``: the batch that reaches ``max_rows`` is kept whole, so a layer holds
``N`` samples with ``max_rows <= N < max_rows + batch size`` (all of them when the calibration set is smaller).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
>>> x = torch.randn(256, 16)
>>> mapping, report = Q.best_of_ranges(model, x)
>>> [(r.name, r.weight in ("minmax", "mse", "percentile")) for r in report]
[('0', True), ('2', True)]
>>> prepared = Q.prepare_fx(model, mapping, example_inputs=(x,))
>>> _ = prepared(x)
>>> bool((Q.convert_fx(prepared)(x) - model(x)).abs().max() < 0.05)
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from tqdm.auto import tqdm

from ..batches import check_finite_batch, check_module, eval_mode, iter_batches, run_batch
from ..functional import fake_quantize
from ..qconfig import QConfig, QConfigMapping, get_default_qconfig
from ..recipes import ACTIVATION_METHODS, WEIGHT_METHODS

__all__ = ["LayerChoice", "best_of_ranges"]

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class LayerChoice:
    """One layer: the chosen methods and every candidate's relative output error ``||·||² / ||Y||²``."""

    name: str
    weight: str
    activation: str
    weight_errors: dict[str, float] = field(default_factory=dict)
    activation_errors: dict[str, float] = field(default_factory=dict)


def _core(mod: nn.Module) -> tuple[nn.Module, str] | None:
    """``(layer, weight parameter path)`` of a plain or fused weighted module, else ``None``."""
    if type(mod) in _LAYERS:
        return mod, "weight"
    if isinstance(mod, nn.Sequential) and len(mod) and type(mod[0]) in _LAYERS and \
            type(mod).__module__.startswith("lowbit.nn.intrinsic"):
        return mod[0], "0.weight"
    return None


def _fq(x: torch.Tensor, obs: nn.Module) -> torch.Tensor:
    obs(x)
    scale, zp = obs.calculate_qparams()
    # round(x · fl(1/s) + z) (float_zero_point: z added before rounding), convert's codes (lowbit.rounding), not
    # torch.ao's fake-quant round(x · fl(1/s)) + z, which sends a tie the other way where z is odd
    return fake_quantize(x, scale, zp, obs.quant_min, obs.quant_max, obs.ch_axis, float_zero_point=True)


def _fq_all(xs: list[torch.Tensor], obs: nn.Module) -> list[torch.Tensor]:
    """``_fq`` over batches that may differ in shape (sequence length, image size): the observer sees every batch,
    then each is fake-quantized on the one grid it chose."""
    for x in xs:
        obs(x)
    scale, zp = obs.calculate_qparams()
    return [fake_quantize(x, scale, zp, obs.quant_min, obs.quant_max, obs.ch_axis, float_zero_point=True) for x in xs]


def _rel_all(ys: list[torch.Tensor], y_hats: list[torch.Tensor]) -> float:
    """``Σ (y - ŷ)² / Σ y²`` over every batch."""
    num = sum(float(((y - h) ** 2).sum()) for y, h in zip(ys, y_hats))
    return num / max(sum(float((y * y).sum()) for y in ys), 1e-30)


def best_of_ranges(model: nn.Module, calib: Any, base: QConfig | None = None,
                   activations: Sequence[str] = ("histogram", "minmax", "percentile", "entropy", "mse"),
                   weights: Sequence[str] = ("minmax", "mse"), max_rows: int = 4096,
                   progress: bool = True) -> tuple[QConfigMapping, list[LayerChoice]]:
    """Pick, per layer, the activation and weight range methods of least output error (module docstring).

    ``calib``: a tensor or an iterable of batches (tuple/list batches are unpacked, dicts passed as
    keywords). ``base``: the global qconfig (default ``get_default_qconfig()``). ``max_rows``: the samples (leading
    dimension of a layer's input) at which a layer stops recording batches; the batch reaching it is kept whole
    (module docstring). Returns ``(mapping, choices)``; ``model`` is not modified.
    """
    check_module(model, "best_of_ranges: model")
    for side, names, table in (("activations", activations, ACTIVATION_METHODS), ("weights", weights, WEIGHT_METHODS)):
        if isinstance(names, str) or not names or any(n not in table for n in names):
            raise ValueError(f"best_of_ranges: {side}={names!r} must be a non-empty list of {sorted(table)}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"best_of_ranges: max_rows={max_rows!r} must be a positive int")
    batches = list(iter_batches(calib, "best_of_ranges: calib"))
    for i, b in enumerate(batches):  # (a NaN batch reached the histogram's "observed no finite data", naming no batch)
        check_finite_batch(b, "best_of_ranges", f"calib batch {i}", "calibration ranges need finite data", masks=True)
    layers: dict[str, nn.Module] = {}
    for n, m in model.named_modules():
        if _core(m) is not None and not any(n.startswith(f"{p}.") for p in layers):  # not a fused marker's child
            layers[n] = m
    if not layers:
        raise ValueError("best_of_ranges: the model has no Linear/Conv layer to calibrate")
    seen: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {n: ([], []) for n in layers}

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(mod: nn.Module, inputs: Any, output: Any) -> None:
            xs, ys = seen[name]
            if isinstance(inputs[0], torch.Tensor) and isinstance(output, torch.Tensor) and \
                    sum(x.shape[0] for x in xs) < max_rows:
                xs.append(inputs[0].detach())
                ys.append(output.detach())
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        with eval_mode(model), torch.no_grad():  # every module's own mode back afterwards
            for batch in tqdm(batches, desc="best_of_ranges: calibration", disable=not progress, leave=False):
                run_batch(model, batch)
    finally:
        for h in handles:
            h.remove()
    base = base if base is not None else get_default_qconfig()
    mapping = QConfigMapping().set_global(base)
    choices: list[LayerChoice] = []
    with torch.no_grad():
        for name, mod in tqdm(layers.items(), desc="best_of_ranges", disable=not progress, leave=False):
            xs, ys = seen[name]
            if not xs:
                continue  # never called during calibration: keeps the global qconfig
            layer, path = _core(mod)  # type: ignore[misc]
            w = layer.weight.detach()
            w_err, outs = {}, {}
            for method in weights:  # batch by batch: their sequence lengths / image sizes may differ
                w_hat = _fq(w, WEIGHT_METHODS[method]())
                outs[method] = [functional_call(mod, {path: w_hat}, (x,)) for x in xs]
                w_err[method] = _rel_all(ys, outs[method])
            best_w = min(w_err, key=w_err.__getitem__)
            a_err = {method: _rel_all(ys, _fq_all(outs[best_w], ACTIVATION_METHODS[method]())) for method in activations}
            best_a = min(a_err, key=a_err.__getitem__)
            mapping.set_module_name(name, QConfig(activation=ACTIVATION_METHODS[best_a], weight=WEIGHT_METHODS[best_w]))
            choices.append(LayerChoice(name, best_w, best_a, w_err, a_err))
    return mapping, choices
