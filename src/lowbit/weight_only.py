"""``quantize_weight_only``: every ``nn.Linear`` of a model -> ``WeightOnlyLinear`` (int4/int8 group-wise).

Activations stay float; only weights shrink (int4 g128: ~0.53 bytes per weight incl. scales). Methods:

- ``"rtn"``: round to nearest on each group's min/max range (no data).
- ``"mse"``: per group, the clipping ratio of the range that minimises the weight MSE (no data). Lower
  weight error is not lower model error: on SmolLM2-135M int4 g128 it scored ppl 42.5 against RTN's 41.2
  (clipping trims the large weights that matter most); use ``"gptq"`` when calibration text is at hand (36.0).
- ``"gptq"``: GPTQ. One pass of the float model over ``calib`` with forward hooks accumulates
  ``H = Σ_batches Xᵀ X`` ``(K, K)`` per targeted Linear (X: its inputs, ``(tokens, K)``; Linears fed the
  same tensor, like q/k/v, share the product and are quantized in one GPTQ pass over their stacked
  rows); each weight is then quantized column by column with the rounding error spread by ``H⁻¹``
  (see ``lowbit.nn.quantized.weight_only``).

Group size (``nn.quantized.group_size``, ``quantize_llm``'s rule): a ``group_size`` given (or -1, per channel)
must divide every quantized Linear's ``in_features``, else a ``ValueError`` names the layers; the default
(``None``) is 128, halved per layer where it does not divide (576 features -> 64; warned once, listing the layers).

>>> import torch, lowbit as Q
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
>>> qm = Q.quantize_weight_only(model, bits=4, group_size=32, method="mse")
>>> type(qm[0]).__name__, qm[2].group_size, model[0].__class__.__name__
('WeightOnlyLinear', 32, 'Linear')
>>> calib = [torch.randn(16, 64) for _ in range(4)]
>>> qg = Q.quantize_weight_only(model, bits=4, group_size=32, method="gptq", calib=calib)
>>> qg(torch.randn(2, 64)).shape
torch.Size([2, 16])
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .nn.quantized._utils import check_finite_linears
from .nn.quantized.group_size import DEFAULT_GROUP_SIZE, checked_group_size, fit_group_size
from .nn.quantized.group_codes import warn_few_rows
from .nn.quantized.weight_only import METHODS, WeightOnlyLinear, check_recipe, gptq_quantize
from .state_check import guard_loading
from .workflow.propagate import refuse_lazy

__all__ = ["quantize_weight_only", "collect_hessians"]


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether ``name``, or its last name component(s), is in ``skip``."""
    return any(name == s or name.endswith("." + s) for s in skip)


def _targets(model: nn.Module, skip: tuple[str, ...]) -> dict[str, nn.Linear]:
    """Named ``nn.Linear`` modules (exact type) not ``_skipped``."""
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and not _skipped(n, skip)}


def _run(model: nn.Module, batch: Any) -> None:
    if isinstance(batch, dict):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


@torch.no_grad()
def collect_hessians(model: nn.Module, linears: dict[str, nn.Linear], calib: Iterable[Any],
                     tokens: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """``{name: Σ XᵀX}`` (float32 ``(K, K)``) of each Linear's inputs over ``calib`` batches.

    A batch is passed as ``model(**b)`` (dict), ``model(*b)`` (tuple/list) or ``model(b)``. ``tokens``, when given,
    is filled with each Linear's count of input rows (the rank of ``XᵀX`` is at most that).
    """
    hs = {n: torch.zeros(m.in_features, m.in_features) for n, m in linears.items()}
    rows: dict[str, int] = {} if tokens is None else tokens
    rows.update(dict.fromkeys(linears, 0))
    last: list[Any] = [None, None]  # (input, XᵀX) of the latest call: q/k/v or gate/up get the same tensor

    def hook(name: str):
        def fn(_mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if x is not last[0]:  # holding the input keeps its memory from being reused by another tensor
                x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32).cpu()  # (tokens, K)
                last[:] = [x, x2.T @ x2]
            hs[name] += last[1]
            rows[name] += x.shape[:-1].numel()
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    batches = 0
    try:
        for batch in calib:
            try:
                _run(model, batch)
            except Exception as e:  # a batch that does not fit the model (the hooks run first): name it
                raise ValueError(f"quantize_weight_only: calib batch {batches} failed in the model: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from e
            batches += 1
    finally:
        for h in handles:
            h.remove()
        last[:] = [None, None]
    if batches == 0:
        raise ValueError("quantize_weight_only: calib yielded no batches; GPTQ needs calibration inputs")
    return hs


def _same_input_runs(names: list[str], hessians: dict[str, torch.Tensor]) -> list[list[str]]:
    """Consecutive Linears with identical ``H`` (they read the same tensor) as runs; one name per run without H."""
    runs: list[list[str]] = []
    for n in names:
        prev = runs[-1][0] if runs else None
        if (prev is not None and n in hessians and prev in hessians and hessians[n].shape == hessians[prev].shape
                and torch.equal(hessians[n], hessians[prev])):
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _gptq_stacked(lins: list[nn.Linear], hessian: torch.Tensor, bits: int, g: int, symmetric: bool,
                  act_order: bool) -> list[WeightOnlyLinear]:
    """GPTQ of Linears sharing one input, on their weights stacked by rows (rows are independent in GPTQ)."""
    qs = [WeightOnlyLinear(lin.in_features, lin.out_features, lin.bias is not None, bits, g, symmetric) for lin in lins]
    w = torch.cat([lin.weight.detach().cpu().float() for lin in lins])  # (sum N, K)
    codes, s, z = gptq_quantize(w, hessian, qs[0]._g, qs[0].qdtype, symmetric, act_order=act_order)
    rows = [lin.out_features for lin in lins]
    for q, lin, c, s_i, z_i in zip(qs, lins, codes.split(rows), s.split(rows), z.split(rows)):
        q.set_codes(c, s_i, z_i)
        if lin.bias is not None:
            q.bias = lin.bias.detach().to(torch.float32).cpu().clone()
        q.to(lin.weight.device)
    return qs


_DEFAULT_SKIP = ("lm_head",)


def _check_calib(calib: Any) -> None:
    """An iterable of batches: a dict or string (one batch, iterated by key / character) or a non-iterable is refused."""
    if isinstance(calib, (dict, str, bytes)) or not isinstance(calib, Iterable):
        what = "a dict is one batch (its keys would be iterated)" if isinstance(calib, dict) else "not a sequence of batches"
        raise TypeError(f"quantize_weight_only: calib={type(calib).__name__} is {what}; pass an iterable of model "
                        "inputs, e.g. [batch] or a DataLoader")


def _warn_unmatched_skip(model: nn.Module, skip: tuple[str, ...]) -> None:
    """Warn about ``skip`` entries that name no ``nn.Linear`` (a typo, or a parent module: its Linears are still
    quantized, as only a Linear's own name or its trailing components match)."""
    if skip == _DEFAULT_SKIP:
        return
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    unmatched = [s for s in skip if not any(_skipped(n, (s,)) for n in names)]
    if unmatched:
        warnings.warn(f"quantize_weight_only: skip entries {unmatched} name no nn.Linear of this model (a skip entry "
                      "matches a Linear's dotted name or its last components; a parent module's name does not skip the "
                      "Linears inside it)", stacklevel=3)


def quantize_weight_only(model: nn.Module, bits: int = 4, group_size: int | None = None, method: str | None = None,
                         calib: Iterable[Any] | None = None, skip: Iterable[str] = _DEFAULT_SKIP,
                         inplace: bool = False, symmetric: bool = True, act_order: bool = True) -> nn.Module:
    """Replace each ``nn.Linear`` (not named in ``skip``) by a ``WeightOnlyLinear``; return the model.

    ``method=None`` picks the most accurate recipe the inputs allow: ``"gptq"`` when ``calib`` is given,
    else ``"rtn"`` (``"mse"`` has the lower weight error but scored worse on SmolLM2).
    ``calib`` (an iterable of model inputs) is required for ``method="gptq"`` and ignored otherwise;
    ``act_order`` (GPTQ only) quantizes the most active input columns first. ``group_size``: weight columns per
    scale; a given size (or -1, per channel) must divide every quantized Linear's ``in_features``; ``None``: 128,
    halved per layer where it does not divide, with a warning.
    The model is deep-copied unless ``inplace``; it is put in eval mode.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_weight_only: model must be an nn.Module, got {type(model).__name__}")
    if method is None:
        method = "rtn" if calib is None else "gptq"
    if method not in METHODS:
        raise ValueError(f"quantize_weight_only: method={method!r} must be one of {METHODS}")
    check_recipe(bits, DEFAULT_GROUP_SIZE if group_size is None else group_size, "quantize_weight_only", symmetric)
    for arg, v in (("inplace", inplace), ("act_order", act_order)):
        if not isinstance(v, bool):  # a truthy "no" rewrote the caller's model / reordered the columns
            raise TypeError(f"quantize_weight_only: {arg}={v!r} must be a bool")
    if isinstance(skip, str) or not isinstance(skip, Iterable) or not all(isinstance(s, str) for s in skip):
        raise TypeError(f"quantize_weight_only: skip={skip!r} must be a tuple of module names")
    if method == "gptq" and calib is None:
        raise ValueError("quantize_weight_only: method='gptq' needs calib= (an iterable of model inputs)")
    if method == "gptq":
        _check_calib(calib)
    skip = tuple(skip)
    refuse_lazy("quantize_weight_only", model)  # (a copy would make its own random weights on its first call)
    _warn_unmatched_skip(model, skip)
    targets = _targets(model, skip)
    if not targets:
        warnings.warn(f"quantize_weight_only: no nn.Linear to quantize (skip={skip}); the model is returned unchanged",
                      stacklevel=2)
    check_finite_linears(targets.items(), "quantize_weight_only", bias=False)  # before any copy or work
    odd = [n or "<model>" for n, lin in targets.items() if bits == 4 and lin.in_features % 2]
    if odd:  # (was raised by WeightOnlyLinear after calibration, naming no layer)
        raise ValueError(f"quantize_weight_only: bits=4 packs two codes per byte, so in_features must be even; layer(s) "
                         f"{odd} have an odd number: skip them (skip=(..., {odd[0]!r})) or use bits=8")
    group_size = checked_group_size({n or "<model>": lin.in_features for n, lin in targets.items()}, group_size,
                                    "quantize_weight_only")  # a given size refused where it does not divide
    from .fx.legacy import baked_copy  # (here: lowbit.fx's package imports the workflows)

    model = baked_copy(model, "quantize_weight_only", False, inplace)  # (legacy norm hooks: deepcopy refused their weights)
    model.eval()
    linears = _targets(model, skip)
    tokens: dict[str, int] = {}
    hessians = collect_hessians(model, linears, calib, tokens) if method == "gptq" else {}  # type: ignore[arg-type]
    few = {n or "<model>": (tokens[n], lin.in_features) for n, lin in linears.items()
           if n in hessians and 0 < tokens[n] < lin.in_features and bool(hessians[n].any())}
    warn_few_rows("quantize_weight_only", few, "method='rtn' / 'mse'", stacklevel=2)  # XᵀX of rank < K
    for name, h in hessians.items():
        if not bool(torch.isfinite(h).all()):
            raise ValueError(f"quantize_weight_only: the calibration inputs reaching layer {name or '<model>'!r} hold "
                             "NaN/Inf (or values whose squares overflow float32, |x| above ~1e19): their XᵀX is not "
                             "finite; GPTQ needs finite calibration data")
    built: dict[str, WeightOnlyLinear] = {}
    for names in _same_input_runs(list(linears), hessians):
        lins = [linears[n] for n in names]
        g = fit_group_size(lins[0].in_features, group_size)  # group_size itself when the caller gave it
        if method == "gptq" and not bool(hessians[names[0]].any()):  # no calibration signal reached these layers
            warnings.warn(f"quantize_weight_only: no calibration input reached {[n or '<model>' for n in names]} (their "
                          "XᵀX is 0: never called, or all-zero inputs); GPTQ has nothing to minimise there, so they "
                          "are rounded to nearest (method='rtn')", stacklevel=2)
            built.update((n, WeightOnlyLinear.from_float(lin, bits, g, symmetric, "rtn")) for n, lin in zip(names, lins))
            for n in names:
                del hessians[n]
        elif method == "gptq":  # layers fed one input (q/k/v, gate/up) share H: one GPTQ pass over their stacked rows
            built.update(zip(names, _gptq_stacked(lins, hessians[names[0]], bits, g, symmetric, act_order)))
            for n in names:
                del hessians[n]
        else:
            built.update((n, WeightOnlyLinear.from_float(lin, bits, g, symmetric, method)) for n, lin in zip(names, lins))
    if "" in built:  # the model itself is a Linear
        return guard_loading(built[""])
    # every place a quantized Linear sits, shared (aliased) ones included (named_modules lists each object once):
    # one WeightOnlyLinear for all of them, as eager convert does; a place named in skip keeps the float Linear
    by_id = {id(linears[n]): q for n, q in built.items()}
    places = [(n, by_id[id(m)]) for n, m in model.named_modules(remove_duplicate=False)
              if n and id(m) in by_id and not _skipped(n, skip)]
    for name, q in places:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)
    return guard_loading(model)  # load_state_dict: all or nothing (state_check)
