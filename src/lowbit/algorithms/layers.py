"""Weighted layers of a prepared model, simulated on their int8 grids, with frozen learned weight codes.

A *weighted layer* is a prepared ``nn.Linear`` / ``nn.ConvNd`` or a fused ``(op, ReLU)`` marker
(``lowbit.nn.intrinsic``; the ReLU may be a ``ClampedReLU``). Its weight grid comes from
``qconfig.weight()`` fed the current weight (per channel ``c`` along axis 0)::

    q = clamp(round(W · fl(1 / s_c) + z_c), qmin, qmax),    W_hat = (q - z_c) * s_c

in float32 (``lowbit.rounding.round_codes``: ``quantize``'s formula, so ``q`` is code for code what ``convert`` gives
the layer, ties included; ``round(W / s_c) + z_c`` differed at 1,464 of MobileNetV2's 3.47 M weight codes).
``freeze_weight(mod, q, s, z)`` stores ``W_hat`` as the float weight and swaps the qconfig's weight
observer for a ``FrozenWeightObserver`` that returns ``(s, z)``, so ``convert`` / ``convert_fx``
reproduce exactly the codes ``q`` (learned rounding survives conversion onto the int8 kernels); it checks that
they do (a ``ValueError`` where float32 cannot carry them, e.g. a scale below ~3e-39 whose reciprocal overflows).

>>> import torch, lowbit as Q
>>> from torch import nn
>>> lin = nn.Linear(3, 2); lin.qconfig = Q.get_default_qconfig()
>>> q, s, z, lo, hi = weight_codes(lin)
>>> freeze_weight(lin, q.clone(), s, z)
>>> bool((weight_codes(lin)[0] == q).all())
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..nn.intrinsic import FusedModule
from ..qconfig import QConfig
from ..rounding import round_codes

__all__ = ["WEIGHTED", "TRANSPOSED", "is_weighted", "split", "layer_forward", "weight_codes", "freeze_weight",
           "FrozenWeightObserver", "layer_sample", "shared_layers", "parameter_holders", "rounded_forward",
           "rounded_before"]

WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)  # int8 after convert, not rounded here
_FORWARDS = tuple(t.forward for t in WEIGHTED)


def split(mod: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """``(op, activation)`` of a weighted layer (activation None for a plain layer)."""
    if isinstance(mod, FusedModule) and len(mod._types) == 2 and isinstance(mod[0], WEIGHTED):
        return mod[0], mod[1]
    return mod, None


def is_weighted(mod: nn.Module) -> bool:
    """A static-quantizable weighted layer: Linear / ConvNd (not transposed), or its ReLU marker, with a qconfig."""
    op, _ = split(mod)
    qc = getattr(mod, "qconfig", None)
    plain = isinstance(op, WEIGHTED) and type(op).forward in _FORWARDS  # not a subclass with its own forward
    return plain and qc is not None and not getattr(qc.activation(), "is_dynamic", False)


def layer_forward(mod: nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, activation: bool = True) -> torch.Tensor:
    """``act(op(x))`` with ``weight`` / ``bias`` in place of the layer's own (None: the layer's)."""
    op, act = split(mod)
    w = op.weight if weight is None else weight
    b = op.bias if bias is None else bias
    y = F.linear(x, w, b) if isinstance(op, nn.Linear) else op._conv_forward(x, w, b)  # type: ignore[operator]
    return act(y) if act is not None and activation else y


def rounded_forward(mod: nn.Module) -> Callable[..., Any] | None:
    """The forward of a layer the rounding passes do not round but ``convert`` runs on int8 weights — a transposed
    conv with a static qconfig — with its weight replaced by the int8 layer's, round to nearest::

        W_hat = (clamp(round(W · fl(1 / s_c) + z_c), qmin, qmax) - z_c) * s_c      (c along weight axis 1, the output channels)

    computed with the same observer and ``quantize_weight`` call as ``from_float`` (bit for bit the converted
    layer's weight); the bias stays float, as there. ``None`` for every other module. The simulations of the int8
    model (``layerwise``'s quantized walk, ``patch_observers(mode="quant")``, ``tune``) run it, so the error they
    fit and report is the converted model's (with the float weight they optimised against another model)."""
    qc = getattr(mod, "qconfig", None)
    if type(mod) not in TRANSPOSED or qc is None or getattr(qc.activation(), "is_dynamic", False):
        return None
    from ..nn.quantized._utils import quantize_weight, weight_qparams

    with torch.no_grad():
        obs = weight_qparams(mod.weight, mod, 1, type(mod).__name__)
        w_hat = quantize_weight(mod.weight, obs, 1).dequantize().to(mod.weight.dtype)
    forward = type(mod).forward

    def run(*args: Any, **kwargs: Any) -> Any:
        saved = mod._parameters["weight"]
        mod._parameters["weight"] = w_hat  # type: ignore[assignment]
        try:
            return forward(mod, *args, **kwargs)
        finally:
            mod._parameters["weight"] = saved
    return run


class FrozenWeightObserver(nn.Module):
    """A weight observer with fixed qparams: the base observer's grid attributes, ``(scale, zero_point)`` pinned."""

    def __init__(self, base: Any, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        super().__init__()
        obs = base()
        for attr in ("qdtype", "qscheme", "ch_axis", "eps"):
            setattr(self, attr, getattr(obs, attr, None))
        self.quant_min, self.quant_max = int(obs.quant_min), int(obs.quant_max)
        self.register_buffer("frozen_scale", scale.detach().clone().to(torch.float32))
        self.register_buffer("frozen_zero_point", zero_point.detach().clone().to(torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.frozen_scale.clone(), self.frozen_zero_point.clone()


def weight_codes(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(q, s, z, qmin, qmax)``: the layer's integer weight codes and grid (``s``, ``z`` shaped to broadcast)."""
    op, _ = split(mod)
    obs = mod.qconfig.weight()  # type: ignore[union-attr,operator]
    if getattr(obs, "ch_axis", 0) not in (0, None):
        raise ValueError(f"weight_codes: {type(op).__name__}'s weight observer has ch_axis={obs.ch_axis}; "
                         "learned rounding supports per-output-channel (axis 0) or per-tensor weight grids")
    w = op.weight.detach().to(torch.float32)
    obs(w)
    scale, zp = obs.calculate_qparams()
    c = w.shape[0]
    shape = (c,) + (1,) * (w.dim() - 1)
    s = scale.reshape(-1).expand(c).reshape(shape).to(torch.float32) if scale.numel() == 1 else \
        scale.reshape(shape).to(torch.float32)
    z = zp.reshape(-1).expand(c).reshape(shape).to(torch.float32) if zp.numel() == 1 else \
        zp.reshape(shape).to(torch.float32)
    q = round_codes(w, s, z, obs.quant_min, obs.quant_max)  # convert's formula (quantize_weight), bit for bit
    return q, s, z, int(obs.quant_min), int(obs.quant_max)


def freeze_weight(mod: nn.Module, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """Store ``(q - z) * s`` as the float weight and pin the weight grid to ``(s, z)`` for convert.

    ``ValueError`` (nothing changed) where ``convert`` would not give back exactly ``q`` from that float weight
    (``round_codes``): codes off the grid (not integers in ``[qmin, qmax]``), or a scale float32 cannot carry them
    with (``fl(1 / s)`` overflows below ~3e-39; ``(q - z) * s`` overflows above ~1e36), or a weight dtype too coarse."""
    op, _ = split(mod)
    qc: QConfig = mod.qconfig  # type: ignore[assignment]
    base = getattr(qc.weight, "keywords", {}).get("base", qc.weight)  # re-freezing keeps the original observer
    factory = functools.partial(FrozenWeightObserver, base=base, scale=s.reshape(-1),
                                zero_point=z.reshape(-1).round().to(torch.int64))
    with torch.no_grad():
        w_hat = ((q - z) * s).to(op.weight.dtype)
        obs = factory()
        # what convert's quantize_weight computes; unchecked: a step float32 cannot carry gives codes off ``q`` (NaN
        # for 0 · inf), named below with the code and the grid (round_codes' own check names only the step)
        back = round_codes(w_hat, s, z, obs.quant_min, obs.quant_max, check=False)
        off = back != q
        if bool(off.any()):
            i = tuple(int(k) for k in off.nonzero()[0])
            c = i[0] if s.numel() > 1 else 0
            raise ValueError(f"freeze_weight: {type(op).__name__}'s weight code q={float(q[i])!r} at {i} on the grid "
                             f"scale={float(s.reshape(-1)[c])!r}, zero_point={float(z.reshape(-1)[c])!r} "
                             f"[{obs.quant_min}, {obs.quant_max}] would convert to {float(back[i])!r} "
                             f"({int(off.sum())} of {q.numel()} codes): freeze integer codes on the grid, with a "
                             f"scale float32 can carry them with (about 1e-38 to 1e36) and a float32 weight")
        op.weight.copy_(w_hat)
    new = QConfig(activation=qc.activation, weight=factory)
    mod.qconfig = new
    if op is not mod:
        op.qconfig = new


def layer_sample(mod: nn.Module, xq: list[torch.Tensor], target: list[torch.Tensor], batch_size: int, window: int,
             g: torch.Generator) -> Any:
    """``sample()`` for ``adaround_codes``: random samples of one batch and, for a 2-d conv, a random
    ``window x window`` output window, computed exactly from a zero-padded slice of the input (padding 0
    on the slice), so a step costs a fraction of a full-resolution conv and nothing is copied up front.
    """
    op, act = split(mod)
    t0 = target[0]
    spatial = isinstance(op, nn.Conv2d) and op.padding_mode == "zeros" and t0.dim() == 4 and \
        not isinstance(op.padding, str) and (t0.shape[2] > window or t0.shape[3] > window)

    def sample() -> tuple[Any, torch.Tensor]:
        k = int(torch.randint(len(xq), (1,), generator=g))
        x, t = xq[k], target[k]
        idx = torch.randint(x.shape[0], (min(batch_size, x.shape[0]),), generator=g)
        if not spatial:
            return (lambda w: layer_forward(mod, x[idx], w)), t[idx]
        (ph, pw), (sh, sw), (dh, dw), (kh, kw) = op.padding, op.stride, op.dilation, op.kernel_size  # type: ignore[misc]
        oh, ow = min(window, t.shape[2]), min(window, t.shape[3])
        r = int(torch.randint(t.shape[2] - oh + 1, (1,), generator=g))
        c = int(torch.randint(t.shape[3] - ow + 1, (1,), generator=g))
        # rows r*sh - ph ... of the unpadded input; pad the slice where it runs past the border
        r0, r1 = r * sh - ph, r * sh - ph + (oh - 1) * sh + (kh - 1) * dh + 1
        c0, c1 = c * sw - pw, c * sw - pw + (ow - 1) * sw + (kw - 1) * dw + 1
        xs = x[idx][:, :, max(r0, 0): min(r1, x.shape[2]), max(c0, 0): min(c1, x.shape[3])]
        xs = nn.functional.pad(xs, [max(0, -c0), max(0, c1 - x.shape[3]), max(0, -r0), max(0, r1 - x.shape[2])])

        def run(w: torch.Tensor) -> torch.Tensor:
            y = nn.functional.conv2d(xs, w, op.bias, op.stride, 0, op.dilation, op.groups)
            return act(y) if act is not None else y
        return run, t[idx, :, r: r + oh, c: c + ow]
    return sample


def rounded_before(mod: nn.Module, holders: dict[int, nn.Module]) -> bool:
    """Whether an earlier layer (``holders``: weight id -> the layer that rounded it) rounded ``mod``'s weight: the
    same module called again, or a tied weight (another module holding the same ``Parameter``). A tied layer then
    takes that layer's weight grid where both grids have the same integer range, so its codes are the rounded
    weight's own (its observer would round the rounded weight a second time, onto a grid of its own)."""
    first = holders.get(id(split(mod)[0].weight))
    if first is None:
        return False
    if first is not mod:
        q, s, z, lo, hi = weight_codes(first)
        if weight_codes(mod)[3:] == (lo, hi):
            freeze_weight(mod, q, s, z)  # (the weight already holds (q - z) s: only the grid is pinned)
    return True


def parameter_holders(model: nn.Module) -> dict[int, int]:
    """``{id(parameter): how many modules hold it}``: more than one is a tied weight (an LM head and its embedding)."""
    holders: dict[int, int] = {}
    for m in model.modules():
        for t in m._parameters.values():
            if t is not None:
                holders[id(t)] = holders.get(id(t), 0) + 1
    return holders


def shared_layers(gm: Any) -> set[str]:
    """Targets of a graph's weighted modules that a rescale of their channels would change elsewhere too: a module
    called at more than one node, or one whose weight ``Parameter`` another module also holds (a tied weight).
    Equalization leaves them alone (it assumes each layer's weight serves that one call)."""
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    holders = parameter_holders(gm)
    out = set()
    for name, mod in gm.named_modules(remove_duplicate=False):
        if name in calls and is_weighted(mod):
            if calls[name] > 1 or holders.get(id(split(mod)[0].weight), 0) > 1:
                out.add(name)
    return out
