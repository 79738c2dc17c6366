"""Output-aware activation grids: step sizes chosen on the model's output error, not on the tensor's.

A calibrated per-tensor observer (``MSEObserver``: the range of least squared error of *its own* tensor)
weighs every element alike. What the model keeps is the output: for a grid ``k`` with step ``s`` and zero
point ``z``, the error that matters is::

    E_k(s) = || f_k(x; Q_{s,z}) - f(x) ||^2

where ``f`` is the float prepared model (every observer the identity) on the calibration inputs ``x`` and
``f_k(.; Q)`` the same float model with only grid ``k`` quantizing, as the int8 model rounds
(``(clamp(round(v / s + z), qmin, qmax) - z) s``; weights and every other activation float), at step ``s``.
``refine_grids`` first ranks the grids by the output error each causes alone at its calibrated step on a
few samples (``rank_samples``), then, for each of the ``top`` costliest, tries ``s = m s_0`` for every
multiplier ``m`` in ``mults`` (at most 1: a clamped layer's grid stays inside its clamp; the zero point
stays) on the first calibration batch, each grid alone, and keeps the ``m`` of least error (an observer that
quantizes at several nodes, a reused module's output, is not searched: it is not one value). With ``held = H``
(``quantize_ptq`` passes 64) a shrunk step must also win on data it was not chosen on: the next calibration
batches, up to ``H`` samples, ``H_k`` the same output error summed over them; ``m`` stays only if
``H_k(m s_0) < H_k(s_0)``, else the calibrated step stays. A small first batch fits steps that clip the other
batches' larger values (an ``nn.MultiheadAttention`` wrapper, 4 batches of 4: the ``pre`` grid at m = 0.8 cut
its search batch's error to 0.38x and raised the three others' 25-30x; accurate 29.5 dB against 38.4 without the
search); a held-out check of one 4-sample batch still let such steps through (35.3 dB), 12 samples did not. A changed grid
replaces its observer by a ``FixedQParamsObserver`` (what the rounding pass and ``convert_fx`` read). Only
the nodes downstream of grid ``k`` are recomputed per candidate (upstream values are cached), so late
grids are cheap. Each grid is judged alone and with the weights float, so the choices do not add up
exactly: with multipliers down to 0.4 MobileNetV2's late-stream grids went to 0.4-0.5 and the int8 model
lost 2.6 dB, hence ``MULTS`` stop at 0.6 (``docs/design.md``).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
>>> batches = [(torch.randn(64, 8),)]
>>> p = Q.prepare_fx(model, Q.QConfigMapping().set_global(Q.get_accurate_qconfig()), example_inputs=batches[0])
>>> _ = p(*batches[0])
>>> changes = refine_grids(p, batches, top=2, progress=False)
>>> len(changes) == 2 and all(c.error_after <= c.error_before for c in changes)
True
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..batches import batch_failed, check_finite_batch, input_shapes
from ..fake_quant import FakeQuantize
from ..functional import fake_quantize
from ..observer import ObserverBase
from ..observer.fixed import FixedQParamsObserver
from ..fx.state import STATE_KEY

__all__ = ["GridChange", "refine_grids"]

MULTS = (0.6, 0.7, 0.8, 0.85, 0.9, 0.95)


@dataclass
class GridChange:
    """One searched grid: the observer's name, what it quantizes, the step before/after and the model's output
    error ``E_k`` (sum of squares over the search batch) with each; ``held_before`` / ``held_after``: ``H_k`` on the
    held-out batches at the calibrated step and at the step the search found (kept or not), ``None`` where none
    was checked (no held-out batch, ``held=0``, or the search kept the calibrated step)."""

    name: str
    source: str
    scale_before: float
    scale_after: float
    error_before: float
    error_after: float
    held_before: float | None = None
    held_after: float | None = None


def _eligible(node: fx.Node, mods: dict[str, nn.Module]) -> bool:
    obs = mods.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
    if not isinstance(obs, ObserverBase) or isinstance(obs, FakeQuantize) or getattr(obs, "is_dynamic", False) \
            or not getattr(obs, "is_calibrated", True) or not hasattr(obs, "quant_min") or len(node.args) != 1:
        return False
    return obs.calculate_qparams()[0].numel() == 1


def _is_obs(node: fx.Node, mods: dict[str, nn.Module]) -> bool:
    return node.op == "call_module" and isinstance(mods.get(node.target), (ObserverBase, FakeQuantize))  # type: ignore[arg-type]


class _Runner:
    """The prepared graph run in float (every observer the identity) with all values cached, and reruns of the
    nodes downstream of one node whose value is replaced."""

    def __init__(self, gm: fx.GraphModule, mods: dict[str, nn.Module], inputs: tuple[Any, ...]) -> None:
        self.gm, self.mods, self.nodes = gm, mods, list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.env: dict[fx.Node, Any] = {}
        ph = iter(inputs)
        for n in self.nodes:
            if n.op == "placeholder":
                self.env[n] = next(ph, n.args[0] if n.args else None)
            elif n.op == "output":
                self.out = n.args[0]
            else:
                self.env[n] = self._compute(n, self.env.__getitem__)
        self.ref = self._outputs(self.env.__getitem__)

    def _compute(self, n: fx.Node, get: Any) -> Any:
        if _is_obs(n, self.mods):
            return get(n.args[0])
        if n.op == "get_attr":
            val: Any = self.gm
            for part in str(n.target).split("."):
                val = getattr(val, part)
            return val
        args, kwargs = fx.node.map_arg(n.args, get), fx.node.map_arg(n.kwargs, get)
        if n.op == "call_module":
            return self.mods[n.target](*args, **kwargs)  # type: ignore[index]
        if n.op == "call_function":
            return n.target(*args, **kwargs)  # type: ignore[operator]
        return getattr(args[0], n.target)(*args[1:], **kwargs)  # type: ignore[arg-type]

    def _outputs(self, get: Any) -> list[torch.Tensor]:
        flat: list[torch.Tensor] = []
        fx.node.map_arg(self.out, lambda n: flat.append(get(n)) or n)
        return [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]

    def error(self, node: fx.Node, value: torch.Tensor) -> float:
        """Output error (sum of squares) with ``node``'s value replaced and everything downstream recomputed."""
        new: dict[fx.Node, Any] = {node: value}
        get = lambda m: new[m] if m in new else self.env[m]  # noqa: E731
        for n in self.nodes[self.index[node] + 1:]:
            if n.op == "output":
                break
            if any(a in new for a in n.all_input_nodes):
                new[n] = self._compute(n, get)
        return sum(float((o.double() - r.double()).pow(2).sum()) for o, r in zip(self._outputs(get), self.ref))


def _batched(batch: tuple[Any, ...]) -> bool:
    """Whether the tensor inputs of ``batch`` share one leading (sample) size: a batch with an attention mask
    ``(L, S)`` beside ``(N, L, E)`` inputs is not sliced by samples (the whole batch; it was, and the mask broke)."""
    return len({t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0}) <= 1


def _positional(i: int, b: Any) -> tuple[Any, ...]:
    """Batch ``i`` as the forward's positional arguments (a tuple / list of them, or one input), as
    ``quantize_ptq`` reads calibration batches; a dict is a ``TypeError``, an empty batch a ``ValueError``."""
    b = b if isinstance(b, tuple) else tuple(b) if isinstance(b, list) else (b,)
    if len(b) == 1 and isinstance(b[0], dict):
        raise TypeError(f"refine_grids: batch {i} is a dict; graph mode feeds inputs by position: give a tensor or a "
                        "tuple/list of the forward's arguments")
    if any(isinstance(t, torch.Tensor) and t.dim() and not t.shape[0] for t in b):
        raise ValueError(f"refine_grids: batch {i} has no samples (input shapes {input_shapes(b)}); every batch needs one")
    return b


def _run(gm: fx.GraphModule, mods: dict[str, nn.Module], b: tuple[Any, ...], i: int) -> _Runner:
    """``_Runner`` on batch ``i``; the model's error on it names the batch."""
    try:
        return _Runner(gm, mods, b)
    except Exception as e:  # (any error of the user's model on this batch)
        raise batch_failed("refine_grids", f"batch {i}", b, e) from e


def _fq(x: torch.Tensor, s: float, z: int, qmin: int, qmax: int) -> torch.Tensor:
    return fake_quantize(x, torch.tensor([s]), torch.tensor([float(z)]), qmin, qmax, None, float_zero_point=True)


def refine_grids(gm: fx.GraphModule, batches: Iterable[Any], *, top: int = 8, mults: Sequence[float] = MULTS,
                 rank_samples: int = 4, progress: bool = True, samples: int = 0,
                 only: Sequence[str] = (), held: int = 0) -> list[GridChange]:
    """Search the step of the ``top`` activation grids of a calibrated graph-mode ``gm`` with the most output
    error on the model's output error (module docstring); return one ``GridChange`` per searched grid, in graph
    order. Changed grids replace their observers (``FixedQParamsObserver``) in place.

    ``samples`` (default 0: the first batch): search on the first that many samples of the batches, concatenated
    (ranking still takes the first ``rank_samples``). ``held`` (default 0: no check): a shrunk step is kept only if
    it also lowers the output error on the batches after the searched ones, read up to ``held`` samples (whole
    batches); with no batch left the search's step stands. ``only``: consider only the grids whose input node's name
    starts with one of these prefixes (fx names: ``features.14.conv.2`` is ``features_14_conv_2``). MobileNetV2
    (``docs/design.md``, session 11) ``top=8, samples=48, only=("features_14", "features_15", "features_16",
    "add_8", "add_9")``: 0.896 / 20.83 dB at 1 thread, 0.904 / 20.75 at 2 (480 crops; without the search 0.896 /
    20.12 and 0.896 / 20.13)."""
    from tqdm.auto import tqdm

    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"refine_grids: needs a graph-mode prepared model (prepare_fx), got {type(gm).__name__}")
    if gm.meta.get(STATE_KEY, {}).get("converted"):  # (it returned [], silently: no observer left to search)
        raise TypeError("refine_grids: needs a calibrated prepared model (prepare_fx), got a converted one (no "
                        "observer: no grid to search); run it before convert_fx")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"refine_grids: top={top!r} must be an int >= 0")
    mults = tuple(mults) if isinstance(mults, Iterable) and not isinstance(mults, (str, bytes)) else (mults,)
    if not mults or any(isinstance(m, bool) or not isinstance(m, numbers.Real) or not 0 < m <= 1 for m in mults):
        raise ValueError(f"refine_grids: mults={tuple(mults)!r} must be multipliers in (0, 1]")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"refine_grids: samples={samples!r} must be an int >= 0 (0: the first batch)")
    if isinstance(held, bool) or not isinstance(held, int) or held < 0:
        raise ValueError(f"refine_grids: held={held!r} must be an int >= 0 (0: no held-out check)")
    if isinstance(rank_samples, bool) or not isinstance(rank_samples, int) or rank_samples < 1:
        raise ValueError(f"refine_grids: rank_samples={rank_samples!r} must be an int >= 1")
    if isinstance(batches, (str, bytes, dict)) or not isinstance(batches, Iterable):
        raise TypeError(f"refine_grids: batches must be an iterable of calibration batches, got {type(batches).__name__}")
    if isinstance(only, str) or not isinstance(only, Iterable) or not all(isinstance(p, str) for p in only):
        raise TypeError(f"refine_grids: only={only!r} must be a sequence of node-name prefixes, e.g. ('features_14',)")
    taken, got = [], 0  # only the batches the search reads: one, or enough for ``samples`` (a generator is not drained)
    rest, got_held = [], 0  # then the held-out batches, enough for ``held`` samples
    for i, b in enumerate(batches):
        b = _positional(i, b)
        k = b[0].shape[0] if b and isinstance(b[0], torch.Tensor) and b[0].dim() else 1
        if not taken or got < samples:
            taken.append(b)
            got += k
        else:
            rest.append(b)
            got_held += k
        if got >= samples and got_held >= held:
            break
    if not taken:
        raise ValueError("refine_grids: batches is empty; pass the calibration batches")
    first = taken[0]
    for i, b in enumerate([*taken, *rest]):
        check_finite_batch(b, "refine_grids", f"batch {i}", "the search compares output errors on it", masks=True)
    if samples and all(_batched(r) and all(isinstance(t, torch.Tensor) and t.dim() for t in r) for r in taken):
        if any(tuple(t.shape[1:]) != tuple(f.shape[1:]) for r in taken for t, f in zip(r, first)):
            raise ValueError(f"refine_grids: samples={samples} joins the first batches, whose input shapes differ "
                             f"beyond the batch dimension: {[input_shapes(r) for r in taken]}")
        first = tuple(torch.cat([r[k] for r in taken])[:samples] for k in range(len(first)))
    mods = dict(gm.named_modules())
    # an observer module called at several nodes (a reused module's output grid, as prepare_fx shares it) is one
    # grid that the search would judge at one node with the others float, then pin for all: left as calibrated
    calls: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[str(n.target)] = calls.get(str(n.target), 0) + 1
    grids = [n for n in gm.graph.nodes if _eligible(n, mods) and calls[str(n.target)] == 1 and (not only or any(
        isinstance(n.args[0], fx.Node) and n.args[0].name.startswith(p) for p in only))]
    if not grids or top == 0:
        return []
    qp = {n: mods[n.target].calculate_qparams() for n in grids}  # type: ignore[index]
    qp = {n: (float(s), int(z)) for n, (s, z) in qp.items()}
    few = tuple(t[:rank_samples] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in first) \
        if _batched(first) else first
    with torch.no_grad():
        runner = _run(gm, mods, few, 0)
        cost = {}
        for n in tqdm(grids, desc="rank grids", disable=not progress):
            o = mods[n.target]  # type: ignore[index]
            cost[n] = runner.error(n, _fq(runner.env[n], *qp[n], o.quant_min, o.quant_max))
        chosen = sorted(sorted(grids, key=lambda n: -cost[n])[:top], key=lambda n: runner.index[n])
        runner = _run(gm, mods, first, 0)
        found = {}
        for n in tqdm(chosen, desc="search grids", disable=not progress):
            o = mods[n.target]  # type: ignore[index]
            s0, z = qp[n]
            x = runner.env[n]
            errs = {m: runner.error(n, _fq(x, s0 * m, z, o.quant_min, o.quant_max)) for m in (1.0, *mults)}
            best = min(errs, key=lambda m: (errs[m], abs(1 - m)))
            found[n] = (best, errs[1.0], errs[best])
        check = {n: [0.0, 0.0] for n, f in found.items() if f[0] != 1.0}  # held-out error at m = 1 and at the best m
        for i, b in enumerate(rest if held and check else [], len(taken)):
            runner = _run(gm, mods, b, i)
            for n, e in check.items():
                o, (s0, z), m = mods[n.target], qp[n], found[n][0]  # type: ignore[index]
                e[0] += runner.error(n, _fq(runner.env[n], s0, z, o.quant_min, o.quant_max))
                e[1] += runner.error(n, _fq(runner.env[n], s0 * m, z, o.quant_min, o.quant_max))
        changes = []
        for n, (best, e1, eb) in found.items():
            o = mods[n.target]  # type: ignore[index]
            s0, z = qp[n]
            if held and rest and n in check and not check[n][1] < check[n][0]:
                best, eb = 1.0, e1  # the shrunk step fits the search batch only: the calibrated step stays
            src = n.args[0]
            changes.append(GridChange(str(n.target), src.name if isinstance(src, fx.Node) else str(src), s0, s0 * best,
                                      e1, eb, *(check[n] if n in check and rest else (None, None))))
            if best != 1.0:
                new = FixedQParamsObserver(s0 * best, z, o.qscheme, o.qdtype)
                parent, _, attr = str(n.target).rpartition(".")
                setattr(gm.get_submodule(parent) if parent else gm, attr, new)
                mods[n.target] = new  # type: ignore[index]
    return changes
