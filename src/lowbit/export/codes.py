"""Bilinear ``F.interpolate`` of a ``QTensor`` in the export twin: resampled on the codes, rounded onto the input grid.

A converted model runs bilinear resampling of a ``QTensor`` on its codes and rounds the result onto the input's grid
``(s, z)`` (``qtensor/resample.py``: ``q_out = clamp(round_half_even(bilinear(q)))``). The float twin resampled the
dequantized values and kept them off the grid: a model output up to 1.06 steps from lowbit's, and 6 % of the codes a
next layer read one step off at the exact ties of a 2x upsample (``(3a + b) / 4``-type blends land on ``k + 1/2``), as
ORT's float ``Resize`` of ``(q - z) s`` puts them on either side. The twin now writes::

    QuantizeLinear(x, s, z) -> Cast(float) -> Resize(linear) -> Round -> Clip(qmin, qmax) -> Cast -> DequantizeLinear(s, z)

which computes the same blend of integer codes (exact for dyadic weights, so ties round half to even as lowbit does).
``ResampleOnCodes`` is a ``TorchFunctionMode``: with ``grids=None`` it notes, for each ``F.interpolate`` call of the
converted model's run, the output grid of a bilinear resample of a ``QTensor`` (``None`` for any other call); given
those grids it replays them on the twin's calls in the same order (``install`` keeps it on around every forward).

>>> import torch, lowbit as Q
>>> x = torch.tensor([[[[0.0, 0.3], [0.6, 0.9]]]])
>>> y = to_codes_and_back(x, (0.1, 1, Q.quint8), lambda c: torch.nn.functional.interpolate(c, scale_factor=2,
...                                                                                     mode="bilinear"))
>>> (y / 0.1 + 1).round().int()[0, 0].tolist()  # = the QTensor's codes (resample.py's doctest)
[[1, 2, 3, 4], [2, 3, 5, 6], [6, 6, 8, 8], [7, 8, 9, 10]]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from ..qtensor import QTensor
from ..qtensor.resample import bilinear_args, bilinear_blend
from .qdq import QDQ, Grid, _storage, untraced

__all__ = ["ResampleOnCodes", "SharedGridBilinear", "bilinear_on_codes", "install", "share_grid_bilinear",
           "to_codes_and_back"]

_ONNX_FLOAT = 1  # TensorProto.FLOAT
_ONNX_TYPE = {torch.uint8: 2, torch.int8: 3}  # TensorProto.UINT8 / INT8
_INTERPOLATE = inspect.signature(F.interpolate)


class _ToCodes(torch.autograd.Function):
    """Codes of ``x`` on ``(s, z)`` as float: ``clamp(round(x / s) + z)``; ONNX: Cast(QuantizeLinear)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, zp: int, qmin: int, qmax: int,  # type: ignore[override]
                storage: torch.dtype) -> torch.Tensor:
        with untraced():  # (the symbolic is the graph; a traced body broke TorchScript's peephole: ``untraced``)
            return torch.clamp(torch.round(x / torch.tensor(scale, dtype=torch.float32)) + zp, qmin, qmax)

    @staticmethod
    def symbolic(g: Any, x: Any, scale: float, zp: int, qmin: int, qmax: int, storage: torch.dtype) -> Any:
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        z = g.op("Constant", value_t=torch.tensor(zp, dtype=storage))
        q = g.op("QuantizeLinear", x, s, z)
        full = (-128, 127) if storage == torch.int8 else (0, 255)
        if (qmin, qmax) != full:  # a narrower grid (reduce_range): clip the codes to its ends
            q = g.op("Clip", q, g.op("Constant", value_t=torch.tensor(qmin, dtype=storage)),
                     g.op("Constant", value_t=torch.tensor(qmax, dtype=storage)))
        return g.op("Cast", q, to_i=_ONNX_FLOAT)


class _FromCodes(torch.autograd.Function):
    """Float codes rounded half to even, clamped, dequantized: ``(clamp(round(c)) - z) s``; ONNX: Round, Clip, Cast,
    DequantizeLinear."""

    @staticmethod
    def forward(ctx: Any, c: torch.Tensor, scale: float, zp: int, qmin: int, qmax: int,  # type: ignore[override]
                storage: torch.dtype) -> torch.Tensor:
        with untraced():
            return (torch.clamp(torch.round(c), qmin, qmax) - zp) * torch.tensor(scale, dtype=torch.float32)

    @staticmethod
    def symbolic(g: Any, c: Any, scale: float, zp: int, qmin: int, qmax: int, storage: torch.dtype) -> Any:
        lo, hi = (g.op("Constant", value_t=torch.tensor(float(v), dtype=torch.float32)) for v in (qmin, qmax))
        q = g.op("Cast", g.op("Clip", g.op("Round", c), lo, hi), to_i=_ONNX_TYPE[storage])
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        z = g.op("Constant", value_t=torch.tensor(zp, dtype=storage))
        return g.op("DequantizeLinear", q, s, z)


def to_codes_and_back(x: torch.Tensor, grid: Grid, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``op`` on the codes of ``x`` on ``grid``, its result rounded onto ``grid`` and dequantized (module doc)."""
    s, z, d = grid
    args = (float(s), int(z), d.quant_min, d.quant_max, _storage(d, "to_onnx (bilinear on codes)"))
    # (detached: an untraced body's output must not require grad, as a QAT model's activations do; the file has no
    # gradient)
    return _FromCodes.apply(op(_ToCodes.apply(x.detach(), *args)), *args)


class ResampleOnCodes(TorchFunctionMode):
    """Records (``grids=None``) or replays the grids of the bilinear ``F.interpolate`` calls on ``QTensor`` codes."""

    def __init__(self, grids: list[Grid | None] | None = None) -> None:
        super().__init__()
        self.recording = grids is None
        self.grids: list[Grid | None] = [] if grids is None else grids
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.interpolate:
            return func(*args, **kwargs)
        bound = _INTERPOLATE.bind(*args, **kwargs)
        x, mode = bound.arguments.get("input"), bound.arguments.get("mode", "nearest")
        if self.recording:
            out = func(*args, **kwargs)
            grid = None
            if mode == "bilinear" and isinstance(x, QTensor) and isinstance(out, QTensor) and out.axis is None:
                grid = (float(out.scale), int(out.zero_point), out.qdtype)
            self.grids.append(grid)
            return out
        grid = self.grids[self.calls] if self.calls < len(self.grids) else None
        self.calls += 1
        if grid is None:
            return func(*args, **kwargs)
        a = bound.arguments
        return bilinear_on_codes(x, grid, a.get("size"), a.get("scale_factor"), a.get("align_corners"),
                                 a.get("recompute_scale_factor"))


def bilinear_on_codes(x: torch.Tensor, grid: Grid, size: Any, scale_factor: Any, align_corners: Any,
                      recompute_scale_factor: Any) -> torch.Tensor:
    """``F.interpolate(..., mode="bilinear")`` of ``x`` (on ``grid``) as lowbit's int8 model runs it: on the codes,
    lowbit's float32 blend (``qtensor/resample.py``, op for op: ONNX Gather / Mul / Add; ORT's ``Resize`` blends in
    another float order and moved near-ties) and its rounding of ``z + (v - z)``, onto ``grid``."""
    out, scales = bilinear_args(x.shape, size, scale_factor, recompute_scale_factor)
    z = float(grid[1])
    return to_codes_and_back(x, grid, lambda c: (bilinear_blend(c, out, bool(align_corners), scales) - z) + z)


class SharedGridBilinear(nn.Module):
    """A prepared / QAT graph's bilinear upsample between two calls of one fake-quant (``qdq``, its export twin: the
    shared grid ``convert`` keeps the codes on) as the converted model runs it (``bilinear_on_codes``)."""

    def __init__(self, qdq: QDQ, size: Any, scale_factor: Any, align_corners: Any, recompute_scale_factor: Any) -> None:
        super().__init__()
        self.qdq = [qdq]  # (a list: the fake-quant stays the graph's own submodule)
        self.args = (size, scale_factor, align_corners, recompute_scale_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bilinear_on_codes(x, self.qdq[0].grid, *self.args)


def _bilinear_args(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, ...] | None:
    """``(input, size, scale_factor, align_corners, recompute_scale_factor)`` of a 4-d-capable bilinear upsample
    node (``F.interpolate`` / ``nn.Upsample`` / ``nn.UpsamplingBilinear2d``), or None."""
    if node.op == "call_function" and node.target is F.interpolate:
        a = _INTERPOLATE.bind(*node.args, **node.kwargs).arguments
        if a.get("mode", "nearest") != "bilinear" or a.get("antialias"):
            return None
        return a["input"], a.get("size"), a.get("scale_factor"), a.get("align_corners"), a.get(
            "recompute_scale_factor")
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        m = gm.get_submodule(str(node.target))
        if isinstance(m, nn.Upsample) and m.mode == "bilinear":  # (UpsamplingBilinear2d too: align_corners=True)
            return node.args[0], m.size, m.scale_factor, m.align_corners, m.recompute_scale_factor
    return None


def share_grid_bilinear(model: nn.Module) -> int:
    """In every ``fx.GraphModule`` of the export twin ``model``, each bilinear upsample read from a ``QDQ`` call and
    read only by calls of that same ``QDQ`` (graph-mode prepare's shared grid) becomes a ``SharedGridBilinear``;
    returns how many."""
    done = 0
    for gm in [m for m in model.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(gm.graph.nodes):
            found = _bilinear_args(gm, node)
            if found is None or not isinstance(found[0], fx.Node) or found[0].op != "call_module":
                continue
            target = found[0].target
            qdq = gm.get_submodule(str(target))
            if not isinstance(qdq, QDQ) or not node.users or any(
                    u.op != "call_module" or u.target != target for u in node.users):
                continue
            name = f"_lowbit_bilinear_on_codes_{done}"
            gm.add_submodule(name, SharedGridBilinear(qdq, *found[1:]))
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(name, (found[0],))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            done += 1
        gm.recompile()
    return done


def install(model: nn.Module, grids: list[Grid | None]) -> None:
    """Keep a replaying ``ResampleOnCodes(grids)`` on around every forward of ``model`` (the twin's root)."""
    mode = ResampleOnCodes(grids)

    def enter(mod: nn.Module, args: Any) -> None:
        mode.calls = 0
        mode.__enter__()

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        mode.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
