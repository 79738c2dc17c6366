"""Cross-layer equalization of an eager model (torch.ao's ``_equalize.equalize``, plus found pairs and depthwise).

``equalize(model, paired_modules_list, threshold=1e-4)`` rescales each pair ``A -> act -> B`` of
weighted layers (``nn.Conv1d/2d/3d``, ``nn.Linear`` or a fused ``lowbit.nn.intrinsic`` layer-ReLU
marker), where ``act`` commutes with positive scaling (identity, ReLU). Per channel ``i`` of ``A``'s
output / ``B``'s input (Nagel et al. 2019, "Data-Free Quantization")::

    s_i = sqrt(r_A[i] / (r_B[i] + 1e-9)),   W_A[i] /= s_i,  b_A[i] /= s_i,  W_B[:, i] *= s_i

so that both ranges become ``sqrt(r_A r_B)``; the float function is unchanged. ``ranges="minmax"``
(default, torch.ao's ``channel_range``): ``r = max - min`` of the channel's weights; ``"absmax"``:
``r = max |w|`` (the range a symmetric per-channel grid sees; what graph mode's
``lowbit.algorithms.equalize.equalize_prepared`` uses). A grouped ``B`` scales the weights that read
input channel ``i`` (``lowbit.algorithms.equalize_pairs``; torch.ao rejects every grouped ``B``): a depthwise
``B`` its own channel ``i``, a depthwise ``B`` with channel multiplier ``k`` its ``k`` filters of channel ``i``,
a ResNeXt-style ``B`` column ``i % (in / g)`` of group ``i // (in / g)``'s filters; ``r_B[i]`` is taken over
those weights. Any ``A`` is scaled by rows (its output channels are independent whatever its groups).
Sweeps over all pairs repeat until the summed
norm of every weight's change in one sweep is below ``threshold`` (torch.ao's ``converged``), at most
``max_sweeps`` times.

``paired_modules_list``: lists of module names or modules; a group ``[a, b, c]`` means the pairs
``(a, b), (b, c)`` (as torch.ao). Such pairs are trusted, as torch.ao does. ``None`` finds them:
``find_pairs(model, example_inputs)`` runs the model once with forward hooks and pairs ``A`` with ``B``
when ``B``'s input is ``A``'s output (directly or through an ``nn.ReLU``/``nn.Identity`` module) and
nothing else reads it; each found pair is kept only if the model's output on ``example_inputs`` is
unchanged after scaling it (a functional op the hooks cannot see — a residual add, a ReLU6 — would
break it). ReLU6-like clamps are not scale-equivariant: such pairs are skipped.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> m = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
>>> with torch.no_grad(): _ = m[0].weight.mul_(torch.logspace(-2, 1, 8).view(8, 1, 1, 1))
>>> x = torch.randn(4, 3, 5, 5); y = m(x)
>>> find_pairs(m, (x,))
[('0', '2')]
>>> _ = equalize(m, [["0", "2"]], progress=False)
>>> bool(torch.allclose(m(x), y, atol=1e-5))
True
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any

import torch
from torch import nn

from ..batches import eval_mode
from ..nn.intrinsic import FusedModule
from .equalize_pairs import groups_of, input_channels, input_multiplier, input_weights
from .layers import WEIGHTED

__all__ = ["equalize", "find_pairs", "equalize_pair", "channel_ranges"]

_RANGES = ("minmax", "absmax")
_PASS_THROUGH = (nn.ReLU, nn.Identity)


def _layer(mod: nn.Module, where: str) -> nn.Module:
    """The weighted op of a plain or fused (``op, ReLU``) layer."""
    op = mod[0] if isinstance(mod, FusedModule) and len(mod) >= 1 else mod
    if not isinstance(op, WEIGHTED):
        raise TypeError(f"equalize: {where} is a {type(mod).__name__}; expected nn.Linear / nn.Conv1d/2d/3d or a "
                        f"fused layer-ReLU module")
    if isinstance(mod, FusedModule) and len(mod) > 1 and type(mod[1]) is not nn.ReLU:
        raise ValueError(f"equalize: {where} ({type(mod).__name__}) ends in {type(mod[1]).__name__}, which is not "
                         "scale-equivariant (only ReLU or no activation commutes with positive scaling)")
    return op


def channel_ranges(w: torch.Tensor, axis: int, ranges: str = "minmax") -> torch.Tensor:
    """Per-channel range of ``w`` along ``axis``: ``max - min`` (``"minmax"``) or ``max |w|`` (``"absmax"``)."""
    if ranges not in _RANGES:
        raise ValueError(f"channel_ranges: ranges={ranges!r} must be one of {list(_RANGES)}")
    flat = w.detach().transpose(0, axis).reshape(w.shape[axis], -1)
    return flat.abs().amax(1) if ranges == "absmax" else flat.amax(1) - flat.amin(1)


def _pair(a: nn.Module, b: nn.Module, an: str = "the first layer", bn: str = "the second layer"
          ) -> tuple[nn.Module, nn.Module, int]:
    """The weighted ops of a pair and ``b``'s groups, or the error that pair would raise."""
    a, b = _layer(a, an), _layer(b, bn)
    if a.weight.shape[0] != input_channels(b):
        raise ValueError(f"equalize: {type(a).__name__} has {a.weight.shape[0]} output channels but the next "
                         f"{type(b).__name__} (weight {tuple(b.weight.shape)}, groups {groups_of(b)}) reads "
                         f"{input_channels(b)} input channels: it does not take them one per input channel")
    return a, b, groups_of(b)


def equalize_pair(a: nn.Module, b: nn.Module, ranges: str = "minmax") -> torch.Tensor:
    """Equalize one pair in place (see the module docstring); return the scales ``s``."""
    a, b, groups = _pair(a, b)
    r_a, r_b = channel_ranges(a.weight, 0, ranges), channel_ranges(input_weights(b.weight, groups), 0, ranges)
    s = torch.sqrt(r_a / (r_b + 1e-9))
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))  # dead channels stay as they are
    with torch.no_grad():
        a.weight.mul_(s.reciprocal().view(-1, *[1] * (a.weight.dim() - 1)))
        if a.bias is not None:
            a.bias.mul_(s.reciprocal())
        b.weight.mul_(input_multiplier(b.weight, groups, s))
    return s


def _named(model: nn.Module, paired: Any) -> list[tuple[str, str]]:
    names = {id(m): n for n, m in model.named_modules()}
    mods = dict(model.named_modules())
    pairs = []
    if not isinstance(paired, (list, tuple)):
        raise TypeError(f"equalize: paired_modules_list must be a list of module-name groups, got {type(paired).__name__}")
    for group in paired:
        if not isinstance(group, (list, tuple)) or len(group) < 2:
            raise ValueError(f"equalize: each group needs at least two modules, got {group!r}")
        keys = []
        for item in group:
            if isinstance(item, nn.Module):
                if id(item) not in names:
                    raise ValueError(f"equalize: a {type(item).__name__} in {group!r} is not a submodule of the model")
                item = names[id(item)]
            if not isinstance(item, str):
                raise TypeError(f"equalize: group items must be module names or modules, got {item!r}")
            if item not in mods:
                raise ValueError(f"equalize: the model has no module named {item!r}")
            keys.append(item)
        if len(set(keys)) != len(keys):  # a layer paired with itself: its scales would be applied twice
            raise ValueError(f"equalize: the group {group!r} names a module more than once")
        pairs += list(zip(keys[:-1], keys[1:]))
    for an, bn in pairs:  # every pair checked before any is equalized: an error leaves the model as it was
        try:
            a, b, _ = _pair(mods[an], mods[bn], an, bn)
        except ValueError as e:
            raise ValueError(f"{e} (pair {an!r} -> {bn!r})") from None
        for name, op in ((an, a), (bn, b)):  # a NaN range kept its channel unscaled and every sweep ran
            w = op.weight
            if w.is_meta:
                raise ValueError(f"equalize: the weight of {name!r} ({type(op).__name__}) is on the meta device; load "
                                 "the weights first")
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"equalize: the weight of {name!r} ({type(op).__name__}, shape {tuple(w.shape)}) holds "
                                 f"{int((~torch.isfinite(w)).sum())} NaN/Inf values (pair {an!r} -> {bn!r})")
    return pairs


def find_pairs(model: nn.Module, example_inputs: tuple[Any, ...]) -> list[tuple[str, str]]:
    """Candidate pairs ``(A, B)``: ``B`` reads ``A``'s output (or an ``nn.ReLU``/``nn.Identity`` of it) and
    nothing else does, seen by forward hooks on one run of ``model(*example_inputs)``."""
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"find_pairs: example_inputs must be a tuple of positional inputs, got "
                        f"{type(example_inputs).__name__}")
    made: dict[int, tuple[str, str | None]] = {}  # tensor id -> (module that made it, weighted source)
    reads: dict[int, int] = {}
    calls: dict[str, int] = {}
    edges: list[tuple[str, int]] = []  # (weighted module, id of its input)
    keep: list[torch.Tensor] = []  # keep tensors alive so ids stay unique during the run
    leaves = [(n, m) for n, m in model.named_modules() if n and (not list(m.children()) or isinstance(m, FusedModule))]
    fused_inner = {n + "." for n, m in leaves if isinstance(m, FusedModule)}
    leaves = [(n, m) for n, m in leaves if not any(n.startswith(p) for p in fused_inner)]

    def hook(name: str, mod: nn.Module):
        def fn(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
            ins = [a for a in args if isinstance(a, torch.Tensor)]
            if ins and out is ins[0]:  # identity / in-place: the value moves on (an in-place clamp fails the check)
                return
            keep.extend(ins)
            for a in ins:
                reads[id(a)] = reads.get(id(a), 0) + 1
            if not isinstance(out, torch.Tensor):
                return
            keep.append(out)
            try:
                op = _layer(mod, name)
            except (TypeError, ValueError):
                op = None
            if op is not None and ins and type(op).forward in tuple(t.forward for t in WEIGHTED):
                edges.append((name, id(ins[0])))
                made[id(out)] = (name, name)
            elif isinstance(mod, _PASS_THROUGH) and ins and id(ins[0]) in made and not getattr(mod, "inplace", False):
                made[id(out)] = (name, made[id(ins[0])][1])
        return fn

    handles = [m.register_forward_hook(hook(n, m)) for n, m in leaves]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    pairs = []
    for b, tid in edges:
        src = made.get(tid)
        if src is None or src[1] is None or calls.get(b, 0) != 1 or calls.get(src[1], 0) != 1:
            continue
        if reads.get(tid, 0) == 1 and (src[0] == src[1] or reads.get(_input_id(made, src), 0) <= 1):
            pairs.append((src[1], b))
    return pairs


def _input_id(made: dict[int, tuple[str, str | None]], src: tuple[str, str | None]) -> int:
    """The id of the weighted layer's own output, for a pass-through chain (read once there too)."""
    for tid, (maker, _) in made.items():
        if maker == src[1]:
            return tid
    return -1


def _outputs(model: nn.Module, example_inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    from ..batches import flatten_outputs
    with torch.no_grad():
        return [t.detach().double() for t in flatten_outputs(model(*example_inputs))]


def equalize(model: nn.Module, paired_modules_list: Any = None, threshold: float = 1e-4, inplace: bool = True, *,
             example_inputs: tuple[Any, ...] | None = None, ranges: str = "minmax", max_sweeps: int = 100,
             progress: bool = True) -> nn.Module:
    """Equalize ``model``'s layer pairs (see the module docstring) and return the model.

    ``paired_modules_list`` (names or modules, torch.ao's argument) or ``None`` with ``example_inputs``
    (pairs found and checked on them). ``inplace=False`` works on a deep copy.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"equalize: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(inplace, bool):  # a truthy "no" changed the caller's model
        raise TypeError(f"equalize: inplace must be a bool, got {inplace!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 <= threshold < math.inf:
        raise ValueError(f"equalize: threshold={threshold!r} must be a finite number >= 0")
    if ranges not in _RANGES:
        raise ValueError(f"equalize: ranges={ranges!r} must be one of {list(_RANGES)}")
    if isinstance(max_sweeps, bool) or not isinstance(max_sweeps, int) or max_sweeps < 1:
        raise ValueError(f"equalize: max_sweeps={max_sweeps!r} must be an int >= 1")
    if not isinstance(progress, bool):
        raise TypeError(f"equalize: progress={progress!r} must be True or False")
    if paired_modules_list is None and example_inputs is None:
        raise ValueError("equalize: give paired_modules_list (module name pairs) or example_inputs to find them")
    pairs = _named(model, paired_modules_list) if paired_modules_list is not None else []
    if not inplace:
        model = copy.deepcopy(model)
    mods = dict(model.named_modules())
    if paired_modules_list is None:
        assert example_inputs is not None
        with eval_mode(model):  # a training model's BatchNorm must not update its running statistics here
            pairs = _checked(model, find_pairs(model, example_inputs), example_inputs, ranges)
    from tqdm.auto import tqdm

    names = sorted({n for p in pairs for n in p})
    for _ in tqdm(range(max_sweeps), desc="equalize", disable=not progress or not pairs, leave=False):
        before: dict[str, torch.Tensor] = {}
        for an, bn in pairs:  # each weight's state before the last pair that touched it (torch.ao's test)
            before.update({n: _layer(mods[n], n).weight.detach().clone() for n in (an, bn)})
            equalize_pair(mods[an], mods[bn], ranges)
        change = sum(float(torch.norm(_layer(mods[n], n).weight.detach() - before[n])) for n in names)
        if change < threshold:
            break
    return model


def _checked(model: nn.Module, pairs: list[tuple[str, str]], example_inputs: tuple[Any, ...],
             ranges: str) -> list[tuple[str, str]]:
    """The found pairs whose equalization leaves the output on ``example_inputs`` unchanged."""
    mods = dict(model.named_modules())
    ref = _outputs(model, example_inputs)
    kept = []
    for an, bn in pairs:
        saved = {n: copy.deepcopy(mods[n].state_dict()) for n in (an, bn)}
        try:
            equalize_pair(mods[an], mods[bn], ranges)
        except (TypeError, ValueError):
            continue
        out = _outputs(model, example_inputs)
        for n in (an, bn):
            mods[n].load_state_dict(saved[n])
        ok = len(out) == len(ref) and all(torch.allclose(o, r, rtol=1e-4, atol=1e-5 * (float(r.abs().max()) + 1e-12))
                                          for o, r in zip(out, ref))
        if ok:
            kept.append((an, bn))
    return kept
