"""SmoothQuant: migrate activation outliers into the weights before static W8A8 quantization.

A Linear ``y = x Wᵀ + b`` whose input has a few huge channels (BERT's FFN down projections: one
channel at 24 where the others stay under 6) wastes its per-tensor activation grid on them. For
each input channel ``j`` (Xiao et al. 2023, "SmoothQuant")::

    s_j = max|X_j|^α / max|W_{:,j}|^(1-α)          # max over calibration tokens / over output rows
    y = (x / s) (W · diag(s))ᵀ + b                   # the same function, flatter activations

``1 / s`` is folded into the op that produces ``x`` when the Linear reads that op's output directly
(recorded during calibration): a ``LayerNorm`` (its weight and bias) or another ``Linear`` (its output
rows and bias), provided nothing else reads it: a fold is kept only if the model's outputs on the first
calibration batch do not change (BERT's post-norm residual stream reads its LayerNorms too).
Linears that share a producer (BERT's query/key/value) share ``s`` (``max|W_{:,j}|``
over all of them). Otherwise (a GELU in between) the Linear is replaced by ``SmoothedLinear``, an
explicit per-channel ``x * (1/s)`` (``InputScale``) followed by the Linear under the same name plus
``.linear``; it is traceable, so eager and graph mode quantize the Linear with the real int8 kernels
and the multiply stays a float op in front of the input ``Quantize``. The model's function is
unchanged (up to float rounding); the report lists every layer, where ``1/s`` went and the
activation range before and after.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
>>> with torch.no_grad():
...     model[0].weight[3] = 30.0                                # an outlier channel after the norm
>>> x = torch.randn(64, 8)
>>> smoothed, report = Q.smooth_quant(model, [x], alpha=0.5)
>>> [(r.name, r.folded_into) for r in report.layers]
[('1', '0'), ('3', '3.scale')]
>>> bool(torch.allclose(smoothed(x), model(x), atol=1e-4))
True
>>> report.layers[0].act_absmax_after < report.layers[0].act_absmax_before
True
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..fx_leaves import FxLeaf
from ..batches import check_module, eval_mode, iter_batches, run_batch
from ..batches import flatten_outputs as _flatten
from ..fx import padding
from .layers import parameter_holders

__all__ = ["InputScale", "SmoothedLinear", "SmoothQuantLayer", "SmoothQuantReport", "smooth_quant",
           "smooth_quant_scales"]


class InputScale(FxLeaf, nn.Module):
    """``x * inv_scale`` over the last dimension (``inv_scale``: buffer ``(C,)``).

    A graph-mode leaf (``_lowbit_fx_leaf``): it stays one float op, never an int8 ``mul`` whose
    second operand would be ``inv_scale`` rounded to 8 bits.
    """

    inv_scale: torch.Tensor
    _lowbit_fx_leaf = True

    def __init__(self, inv_scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_scale", inv_scale.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_scale

    def extra_repr(self) -> str:
        return f"channels={self.inv_scale.numel()}"


class SmoothedLinear(nn.Module):
    """``linear(scale(x))``: a Linear with the explicit SmoothQuant input scale in front of it."""

    def __init__(self, scale: InputScale, linear: nn.Linear) -> None:
        super().__init__()
        self.scale, self.linear = scale, linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.scale(x))


@dataclass(frozen=True)
class SmoothQuantLayer:
    """One smoothed Linear: where ``1/s`` was folded, and its input's max |x| before / after."""

    name: str
    folded_into: str          # producer module (LayerNorm / Linear) or ``<name>.scale`` (explicit)
    act_absmax_before: float
    act_absmax_after: float
    max_scale: float
    min_scale: float


@dataclass
class SmoothQuantReport:
    """What ``smooth_quant`` changed: ``layers`` in model order, ``alpha``, and skipped Linears with why."""

    alpha: float
    layers: list[SmoothQuantLayer] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"SmoothQuant (alpha={self.alpha}): {len(self.layers)} Linear smoothed, {len(self.skipped)} skipped"]
        lines += [f"  {r.name}: 1/s -> {r.folded_into}; max|x| {r.act_absmax_before:.3g} -> {r.act_absmax_after:.3g} "
                  f"(s in [{r.min_scale:.3g}, {r.max_scale:.3g}])" for r in self.layers]
        lines += [f"  skipped {n}: {why}" for n, why in self.skipped.items()]
        return "\n".join(lines)


def _check_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smooth_quant: alpha={alpha!r} must be a number in [0, 1]")
    return float(alpha)


def _collect(model: nn.Module, batches: Iterable[Any], names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Per-channel max |x| of each named Linear's input, and the module whose output it read (if any)."""
    modules = dict(model.named_modules())
    absmax: dict[str, torch.Tensor] = {}
    producer: dict[str, str | None] = {}
    # id(output) -> (module name, output) within the current batch; the tensor is kept so that its id
    # cannot be reused by a later tensor
    last_output: dict[int, tuple[str, torch.Tensor]] = {}

    def out_hook(name: str):  # type: ignore[no-untyped-def]
        def hook(mod: nn.Module, inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                last_output[id(output)] = (name, output)
        return hook

    def in_hook(name: str):  # type: ignore[no-untyped-def]
        def hook(mod: nn.Module, inputs: Any) -> None:
            x = inputs[0] if inputs else None
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
                return
            x = x.detach()
            rows = padding.real_rows(x, padding.current())  # tokens whose attention_mask is 0 are left out
            x = x if rows is None else rows
            if x.numel() == 0:
                return
            a = torch.nan_to_num(x.abs().reshape(-1, x.shape[-1]), nan=0.0, posinf=0.0).amax(0).float()
            absmax[name] = torch.maximum(absmax[name], a) if name in absmax else a
            hit = last_output.get(id(inputs[0]))
            src = hit[0] if hit is not None and hit[1] is inputs[0] else None
            if name not in producer:
                producer[name] = src
            elif producer[name] != src:
                producer[name] = None  # called on different producers: no single fold target
        return hook

    handles = [m.register_forward_hook(out_hook(n)) for n, m in modules.items()
               if isinstance(m, (nn.LayerNorm, nn.Linear)) and n]
    handles += [modules[n].register_forward_pre_hook(in_hook(n)) for n in names]
    padding.attach(model)
    try:
        with torch.no_grad():
            for batch in tqdm(batches, desc="smooth_quant: calibration", leave=False):
                last_output.clear()
                run_batch(model, batch)
    finally:
        padding.detach(model)
        for h in handles:
            h.remove()
    return absmax, {n: p for n, p in producer.items() if p is not None}


def smooth_quant_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^α / max|W_{:,j}|^(1-α)`` (``weights``: the ``(out, C)`` matrices reading ``X``).

    A channel with no activation or no weight keeps ``s = 1``; ``s`` is clamped to ``[1e-4, 1e4]``.

    >>> smooth_quant_scales(torch.tensor([16.0, 1.0]), [torch.tensor([[1.0, 1.0]])], 0.5)
    tensor([4., 1.])
    """
    w_absmax = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    ok = (act_absmax > 0) & (w_absmax > 0)
    s = act_absmax.clamp_min(1e-12).pow(alpha) / w_absmax.clamp_min(1e-12).pow(1 - alpha)
    return torch.where(ok, s, torch.ones_like(s)).clamp(1e-4, 1e4)


def _outputs(model: nn.Module, batch: Any) -> list[torch.Tensor]:
    return [t.double() for t in _flatten(run_batch(model, batch))]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    return all(x.shape == y.shape and float((x - y).norm()) <= 1e-4 * float(x.norm()) + 1e-6 for x, y in zip(a, b))


def _scale_producer(prod: nn.Module, factor: torch.Tensor) -> None:
    """Multiply the producer's output channels by ``factor`` (LayerNorm weight/bias, Linear rows/bias)."""
    w = prod.weight
    w.mul_(factor.to(w.dtype) if w.dim() == 1 else factor.to(w.dtype).unsqueeze(1))
    if prod.bias is not None:
        prod.bias.mul_(factor.to(prod.bias.dtype))


def _fold(model: nn.Module, prod: nn.Module, inv: torch.Tensor, reference: list[torch.Tensor], batch: Any) -> bool:
    """Fold ``inv`` into ``prod``; keep it only if the model's outputs did not change (else undo)."""
    _scale_producer(prod, inv)
    if _same(reference, _outputs(model, batch)):
        return True
    _scale_producer(prod, 1.0 / inv)
    return False


def _set(model: nn.Module, name: str, mod: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, mod)


def smooth_quant(model: nn.Module, calib_batches: Any, alpha: float = 0.5, layers: Iterable[str] | None = None,
                 inplace: bool = False) -> tuple[nn.Module, SmoothQuantReport]:
    """Migrate activation outliers of every ``nn.Linear`` (or the named ``layers``) into its weights.

    ``calib_batches``: a tensor or an iterable of batches (a tuple/list batch is unpacked into
    positional arguments, a dict into keywords). ``alpha`` in ``[0, 1]``: the migration strength (0:
    nothing moves, 1: all of max|X| goes into the weights). Returns ``(smoothed_model, report)``;
    ``model`` is deep-copied first unless ``inplace``. Run it on the float model, then ``prepare`` /
    ``prepare_fx``, calibrate and convert as usual.
    """
    check_module(model, "smooth_quant: model")
    if not isinstance(inplace, bool):  # a truthy string would rewrite the caller's model
        raise TypeError(f"smooth_quant: inplace={inplace!r} must be a bool")
    alpha = _check_alpha(alpha)
    batches = list(iter_batches(calib_batches, "smooth_quant"))
    if not inplace:
        model = copy.deepcopy(model)
    with eval_mode(model):  # every module's own mode back afterwards, also when a check below refuses
        report = _smooth(model, batches, layers, alpha)
    return model, report


def _smooth(model: nn.Module, batches: list[Any], layers: Iterable[str] | None, alpha: float) -> SmoothQuantReport:
    """``smooth_quant``'s work on ``model`` (in eval mode, changed in place)."""
    modules = dict(model.named_modules())
    if layers is None:
        names = [n for n, m in modules.items() if type(m) is nn.Linear and n]
    else:
        if isinstance(layers, str):  # (a string would be read as its characters)
            raise TypeError(f"smooth_quant: layers={layers!r} must be an iterable of module names, e.g. [{layers!r}]")
        names = list(layers)
        for n in names:
            if not isinstance(modules.get(n), nn.Linear):
                raise ValueError(f"smooth_quant: layers names {n!r}, which is not an nn.Linear of the model")
    report = SmoothQuantReport(alpha)
    absmax, producer = _collect(model, batches, names)
    holders = parameter_holders(model)  # a tied LM head shares the embedding's weight
    groups: dict[str, list[str]] = {}
    for n in names:
        if n not in absmax:
            report.skipped[n] = "never called on a float tensor during calibration"
            continue
        if holders.get(id(modules[n].weight), 0) > 1:
            report.skipped[n] = "its weight is shared with another module (tied): scaling it would change that one"
            continue
        p = producer.get(n)
        prod = modules.get(p) if p else None
        foldable = (isinstance(prod, nn.LayerNorm) and prod.elementwise_affine and prod.weight is not None
                    and prod.weight.dim() == 1) or type(prod) is nn.Linear
        key = p if foldable and p is not None else f"{n}.scale"
        groups.setdefault(key, []).append(n)
    with torch.no_grad():
        reference = _outputs(model, batches[0])
        for target, group in groups.items():
            lins = [modules[n] for n in group]
            act = torch.stack([absmax[n] for n in group]).amax(0)
            s = smooth_quant_scales(act, [lin.weight for lin in lins], alpha)
            for lin in lins:
                lin.weight.mul_(s.to(lin.weight.dtype))
            inv = 1.0 / s
            if target == f"{group[0]}.scale":
                _set(model, group[0], SmoothedLinear(InputScale(inv.to(lins[0].weight.dtype)), lins[0]))
            elif not _fold(model, modules[target], inv, reference, batches[0]):
                # the producer's output is read elsewhere too (a residual): explicit scales instead
                for n, lin in zip(group, lins):
                    _set(model, n, SmoothedLinear(InputScale(inv.to(lin.weight.dtype)), lin))
                target = ""
            after = float((act / s).max())
            for n in group:
                report.layers.append(SmoothQuantLayer(n, target or f"{n}.scale", float(absmax[n].max()), after,
                                                      float(s.max()), float(s.min())))
    order = {n: i for i, n in enumerate(names)}
    report.layers.sort(key=lambda r: order[r.name])
    return report
