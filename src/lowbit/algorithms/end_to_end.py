"""The training loop the end-to-end passes share (``tune.tune_biases``, ``distill.distill``): what is learned on the
whole model's output against the float model's, with the prepared model run as the int8 model runs.

``check_args`` refuses bad arguments naming them, and a ``prepare_qat_fx`` model (its layers fake-quantize their
own weights: nothing here would learn). A model ``prepare_fx`` prepared child by child (an untraceable ``forward``,
the model's own or a submodule's) runs eagerly, its control flow included; the layers and grids of every child graph
learn with the model graph's (``graphs``). ``EndToEnd(prepared, float_model, calib, where, seed)`` takes the float
model's outputs ``M(x)`` on every calibration batch (in eval mode) and a copy of ``prepared``'s state.
``freeze(grids)`` pins every weighted layer's codes (``layers.freeze_weight``), gives a layer without a bias a zero
one (removed again when nothing is kept) and builds the learnable activation grids (``block.LearnedGrid``). ``fit``
then runs Adam for ``iters`` steps on ``batch_size`` random samples of one calibration batch, minimising::

    L(theta) = || M_q(x; theta) - M(x) ||^2 / L_0       (summed over the output's dim 1, averaged over samples)

``M_q`` the prepared model with every activation observer fake-quantizing on its grid
(``layerwise_step.patch_observers(model, "quant")``), ``L_0`` the loss of the first mini-batch; the learning rates
stay constant or follow a cosine schedule to 0. It returns the error summed over all calibration batches before and
after. ``finish(kept)`` installs the learned grids (``block.install_grid``) when the result is kept and otherwise
restores ``prepared`` byte for byte: its state_dict (values and keys), its layers' qconfigs.

>>> import copy, lowbit as Q
>>> model, calib, p, err = example()
>>> before = err(Q.convert_fx(copy.deepcopy(p)))
>>> e = EndToEnd(p, model, calib, "example", seed=0)
>>> biases = [op.bias for _, op, *_ in e.freeze(grids=False)]
>>> first, last = e.fit([{"params": biases, "lr": 1e-3}], iters=50, batch_size=16, cosine=False, desc="", progress=False)
>>> e.finish(last < first)
>>> last < first and err(Q.convert_fx(p)) < before
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn

from ..batches import input_shapes, output_tensors
from ..fx import prepare_fx
from ..fx.state import STATE_KEY
from ..qconfig import get_default_qconfig_mapping
from .block import install_grid, learnable_grids
from .children import child_graphs
from .layers import freeze_weight, is_weighted, split, weight_codes
from .layerwise_step import batch_tuples, check_seed, patch_observers

__all__ = ["EndToEnd", "check_args", "check_outputs", "example", "graphs"]


def example() -> tuple[nn.Module, list[torch.Tensor], fx.GraphModule, Callable[[nn.Module], float]]:
    """The doctests' toy problem: ``(model, calib, prepared, err)``, a calibrated 8-16-4 MLP and the summed squared
    error of a model's outputs against the float model's on ``calib``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    calib = [torch.randn(32, 8) + 2 for _ in range(2)]
    p = prepare_fx(model, get_default_qconfig_mapping(), example_inputs=(calib[0],))
    for b in calib:
        p(b)

    def err(m: nn.Module) -> float:
        return sum(float((m(b) - model(b)).pow(2).sum().detach()) for b in calib)
    return model, calib, p, err


def _tensors(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a (nested) output, in order, gradients kept."""
    return [t for t in output_tensors(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _error(out: Any, target: list[torch.Tensor]) -> torch.Tensor:
    """Squared error summed over dim 1 and averaged over the rest, summed over the output's tensors."""
    total = torch.zeros(())
    for o, t in zip(_tensors(out), target):
        d = (o - t).pow(2)
        total = total + (d.sum(1).mean() if d.dim() > 1 else d.mean())
    return total


def check_outputs(out: Any, target: list[torch.Tensor], where: str, i: int) -> None:
    """``ValueError`` unless the prepared model's output ``out`` on calibration batch ``i`` holds as many
    floating-point tensors as the float model's (``target``), each of the same shape: a float model of another output
    structure was compared element by element (``zip`` stopped at the shorter, a ``(N, 1)`` target broadcast)."""
    got = _tensors(out)
    if len(got) != len(target) or any(o.shape != t.shape for o, t in zip(got, target)):
        raise ValueError(f"{where}: on calib batch {i} the prepared model returned float tensors of shapes "
                         f"{[tuple(o.shape) for o in got]}, float_model {[tuple(t.shape) for t in target]}; "
                         "float_model must be the model that was prepared (the same outputs)")


def _subsample(batch: tuple[Any, ...], target: list[torch.Tensor], batch_size: int,
               g: torch.Generator) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """``batch_size`` random samples of a batch and its targets (the whole batch where the inputs and
    outputs do not share one leading batch dimension)."""
    sizes = {a.shape[0] for a in (*batch, *target) if isinstance(a, torch.Tensor) and a.dim() > 0}
    if len(sizes) != 1 or not all(t.dim() > 0 for t in target):
        return batch, target
    n = sizes.pop()
    idx = torch.randint(n, (min(batch_size, n),), generator=g)
    return tuple(a[idx] if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in batch), [t[idx] for t in target]


def _targets(float_model: nn.Module, batches: list[tuple[Any, ...]], where: str) -> list[list[torch.Tensor]]:
    """``float_model``'s float output tensors on every batch, in eval mode (its modes restored); a batch with no
    samples or one the model fails on is refused naming it."""
    for i, b in enumerate(batches):
        if any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 0 for t in b):
            raise ValueError(f"{where}: calib batch {i} has no samples (input shapes {input_shapes(b)})")
    modes = [(m, m.training) for m in float_model.modules()]
    float_model.eval()
    out = []
    try:
        with torch.no_grad():
            for i, b in enumerate(batches):
                try:
                    y = float_model(*b)
                except Exception as e:
                    raise ValueError(f"{where}: float_model failed on calib batch {i} (input shapes {input_shapes(b)}): "
                                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
                out.append([t.detach() for t in _tensors(y)])
    finally:
        for m, mode in modes:
            m.training = mode
    return out


def graphs(prepared: nn.Module) -> list[fx.GraphModule]:
    """``prepared``'s own graph (if it is one) and its child graphs (``children.child_graphs``)."""
    return ([prepared] if isinstance(prepared, fx.GraphModule) else []) + list(child_graphs(prepared).values())


def _check_prepared(prepared: Any, where: str) -> None:
    """A graph-mode model from ``prepare_fx``; one from ``prepare_qat_fx`` is refused naming its first QAT layer (its
    layers fake-quantize their own weights: no layer here would learn, the pass would end as a silent no-op)."""
    if not isinstance(prepared, fx.GraphModule) and not (isinstance(prepared, nn.Module) and child_graphs(prepared)):
        raise TypeError(f"{where}: prepared must be a graph-mode prepared model (prepare_fx), "
                        f"got {type(prepared).__name__}")
    qat = next(((n, m) for n, m in prepared.named_modules() if hasattr(m, "weight_fake_quant")), None)
    if qat is not None or any((g.meta.get(STATE_KEY) or {}).get("is_qat") for g in graphs(prepared)):
        layer = f" (layer '{qat[0]}' is a QAT {type(qat[1]).__name__} that fake-quantizes its own weight)" if qat else ""
        raise ValueError(f"{where}: prepared comes from prepare_qat_fx{layer}; give a prepare_fx model, "
                         "or fine-tune the QAT model itself")


def check_args(where: str, prepared: Any, float_model: Any, iters: Any, batch_size: Any, seed: Any,
               flags: dict[str, Any], rates: dict[str, Any]) -> None:
    """The models (``prepared`` from ``prepare_fx``, not ``prepare_qat_fx``), ``iters`` / ``batch_size`` /
    ``seed`` ints in range, ``flags`` booleans, ``rates`` finite numbers >= 0: else an error naming the value."""
    _check_prepared(prepared, where)
    if not isinstance(float_model, nn.Module):
        raise TypeError(f"{where}: float_model must be an nn.Module, got {type(float_model).__name__}")
    for name, v in (("iters", iters), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or not (0 if name == "iters" else 1) <= v < 2 ** 63:
            raise ValueError(f"{where}: {name}={v!r} must be an int in [{0 if name == 'iters' else 1}, 2**63)")
    for name, v in rates.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {name}={v!r} must be a finite number >= 0")
    check_seed(where, seed)  # the one rule (layerwise_step.check_seed): quantize_ptq's and reconstruct's
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{where}: {name}={v!r} must be True or False")


class EndToEnd:
    """One end-to-end fit of ``prepared`` to ``float_model``'s outputs on ``calib``; see the module docstring."""

    def __init__(self, prepared: nn.Module, float_model: nn.Module, calib: Iterable[Any], where: str,
                 seed: int) -> None:
        self.prepared, self.where = prepared, where
        self.batches, self.g = batch_tuples(calib, where), torch.Generator().manual_seed(check_seed(where, seed))
        # the model's graph and the child graphs of an untraceable forward (its own or a submodule's), each with its
        # modules: every layer and grid in them learns (the model itself runs eagerly, its control flow included)
        self.graphs = [(gm, dict(gm.named_modules())) for gm in graphs(prepared)]
        self.owner: dict[fx.Node, tuple[fx.GraphModule, dict[str, nn.Module]]] = {}
        self.targets = _targets(float_model, self.batches, where)
        self.layers = self._layers()
        self.saved = {k: v.detach().clone() for k, v in prepared.state_dict().items()}
        self.qconfigs = [(m, m.qconfig, split(m)[0].qconfig if split(m)[0] is not m else None) for m in self.layers]
        self.added: list[nn.Module] = []
        self.learn: dict[fx.Node, Any] = {}

    def _layers(self) -> list[nn.Module]:
        """The weighted layers the graphs call, each once, in graph order (the model's graph first)."""
        out: list[nn.Module] = []
        for gm, mods in self.graphs:
            for node in gm.graph.nodes:
                m = mods.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
                if m is not None and is_weighted(m) and all(m is not k for k in out):
                    out.append(m)
        return out

    def freeze(self, grids: bool) -> list[tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor,
                                                int, int]]:
        """Pin every layer's codes (a no-op on layers a rounding pass froze), give a bias-less layer a zero bias,
        build the learnable grids (with ``grids``); ``(layer, op, q, s, z, qmin, qmax)`` per layer."""
        out = []
        for m in self.layers:
            q, s, z, qmin, qmax = weight_codes(m)
            freeze_weight(m, q, s, z)
            op = split(m)[0]
            if op.bias is None:
                op.bias = nn.Parameter(torch.zeros(q.shape[0], dtype=op.weight.dtype))
                self.added.append(op)
            out.append((m, op, q, s, z, qmin, qmax))
        self.learn, self.owner = {}, {}
        for gm, mods in self.graphs if grids else []:
            learn = learnable_grids(list(gm.graph.nodes), mods)
            self.learn.update(learn)
            self.owner.update({node: (gm, mods) for node in learn})
        return out

    def biases(self) -> list[nn.Parameter]:
        """The layers' biases, each once, in graph order."""
        out: list[nn.Parameter] = []
        for m in self.layers:
            b = split(m)[0].bias
            if all(b is not k for k in out):
                out.append(b)
        return out

    def total(self) -> float:
        """The error summed over all calibration batches (no gradients)."""
        with torch.no_grad():
            outs = [(self.prepared(*b), t) for b, t in zip(self.batches, self.targets)]
        for i, (o, t) in enumerate(outs):
            check_outputs(o, t, self.where, i)
        return sum(float(_error(o, t)) for o, t in outs)

    def fit(self, groups: list[dict[str, Any]], iters: int, batch_size: int, cosine: bool, desc: str,
            progress: bool) -> tuple[float, float]:
        """Adam on ``groups`` (the learned grids' steps are a group of their own, at ``grid_lr`` of the caller)
        for ``iters`` steps; ``(error before, error after)`` over all calibration batches. Every parameter's
        ``requires_grad`` is restored and its gradient dropped, the observers unpatched, also on an error."""
        from tqdm.auto import tqdm

        prepared = self.prepared
        groups = [gr for gr in groups if gr["params"]]
        flags = {p: p.requires_grad for p in prepared.parameters()}
        patched = patch_observers(prepared, "quant")
        for node, gr in self.learn.items():
            self.owner[node][1][node.target].forward = gr  # type: ignore[index]
        try:
            for p in prepared.parameters():
                p.requires_grad_(False)
            for gr in groups:
                for p in gr["params"]:
                    p.requires_grad_(True)
            before = after = self.total()
            if groups and iters:
                opt = torch.optim.Adam(groups)
                sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, iters) if cosine else None
                scale = None
                for _ in tqdm(range(iters), desc=desc, disable=not progress):
                    k = int(torch.randint(len(self.batches), (1,), generator=self.g))
                    args, target = _subsample(self.batches[k], self.targets[k], batch_size, self.g)
                    loss = _error(prepared(*args), target)
                    if not loss.requires_grad:  # nothing learnable reaches the output (e.g. only float ops)
                        break
                    if scale is None:
                        scale = float(loss.detach()) + 1e-12
                    opt.zero_grad()
                    (loss / scale).backward()
                    opt.step()
                    if sched is not None:
                        sched.step()
                after = self.total()
        finally:
            for m in patched:
                m.__dict__.pop("forward", None)
            for p, f in flags.items():
                p.requires_grad_(f)
                p.grad = None
        return before, after

    def finish(self, kept: bool) -> None:
        """Kept: the learned grids replace their observers. Not kept: ``prepared`` as it was, byte for byte (the
        biases ``freeze`` added removed, the layers' qconfigs and every state_dict value restored)."""
        with torch.no_grad():
            if kept:
                for node, gr in self.learn.items():
                    install_grid(*self.owner[node], node, gr)
                return
            for op in self.added:
                op.bias = None
            for m, qc, opqc in self.qconfigs:
                m.qconfig = qc
                if opqc is not None:
                    split(m)[0].qconfig = opqc
            state = self.prepared.state_dict()
            for k, v in self.saved.items():
                state[k].copy_(v)
