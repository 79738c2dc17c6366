"""The float twins of ``search="fast"`` (``float_swap.py``; split from it): what a quantized layer or an eager
``QFunctional`` becomes when the search keeps it float, and eager mode's input grids.

Eager mode (``eager_twins``): the model built from the mapping runs a float layer ``L`` on its (dequantized) input
and hands on float ``y = L(x̂)``; whatever reads it (a flatten, a view, an add, ``L`` itself called again, the
model's return) sees ``y`` unrounded, and an int8 weighted layer ``M`` reading it quantizes it on the grid its input
observer recorded *in that model*: ``q(y') = clamp(round(y' / s_M) + z_M)`` with ``(s_M, z_M)`` from ``M``'s input
over calibration. The all-int8 model read ``M``'s input as a ``QTensor`` (no grid recorded), so the one calibration
also records, per weighted layer, its input where it was a quantized one (``record_tagged_inputs``); that grid is
given to every int8 layer with none (``give_input_grids``: the all-int8 model never uses it, its inputs are
``QTensor``). Prepared modules compute the same float values whichever layers are float, so the grid is the one the
built model records, exactly for a layer called once (a layer called several times, only some calls reading a float
layer, records the union of its calls: an approximation). A float twin's output is then always float.

>>> import torch, lowbit as Q
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.Flatten(), nn.Linear(8, 2)).eval()
>>> prepared = Q.prepare(model, Q.get_minmax_qconfig())
>>> observers, handles = record_tagged_inputs(prepared)
>>> _ = prepared(torch.randn(16, 4))
>>> for h in handles:
...     h.remove()
>>> qmodel = Q.convert(prepared)
>>> qmodel[2].input_grid is None                      # it reads layer 0's QTensor: no grid recorded
True
>>> give_input_grids(qmodel, observers)
>>> qmodel[2].input_grid[0] == float(qmodel[0].scale)  # the grid it records when layer 0 is float
True
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..fake_quant.base import holds_grid
from ..nn.quantized.functional_modules import QF_METHODS, FloatFunctional
from ..nn.quantized.stubs import Quantize
from ..qscheme import as_qdtype
from ..qtensor import QTensor
from ..speed_guard import requant_grid, run_in_own_dtype
from ..workflow.hooks import _tagged

__all__ = ["record_tagged_inputs", "give_input_grids"]


def _dq(x: Any) -> Any:
    return x.dequantize() if isinstance(x, QTensor) else x


class _FloatTwin(nn.Module):
    """A quantized layer's float form: float compute on its (dequantized) input, back on the layer's output
    grid when it had one that int8 consumers read (``grid`` None: float output). ``keep`` is cleared while
    every reader of the output is itself kept float (``_regrid``): the model built from the mapping does
    not round between two float layers.

    The output grid is a ``Quantize`` child (``requant``: scale and zero point are buffers), so it travels in
    ``state_dict`` like every int8 layer's grid (a Python tuple stayed behind: a loaded checkpoint kept the
    fresh model's grid). The float layer runs in its own parameters' dtype (a model moved with ``.double()`` /
    ``.half()``) and gives back its input's dtype, as the int8 layers around it keep float32."""

    def __init__(self, float_mod: nn.Module, qmod: nn.Module, float_out: bool,
                 grid: tuple[float, int, Any] | None = None) -> None:
        super().__init__()
        self.float_mod = float_mod
        qdtype = getattr(qmod, "out_qdtype", None) or getattr(qmod, "qdtype", None)  # (BN, activations: qdtype)
        float_out = float_out or type(qmod).__name__.endswith("FloatOut")
        if grid is None and qdtype is not None and hasattr(qmod, "scale"):
            grid = (float(qmod.scale), int(qmod.zero_point), qdtype)  # (``grid``: one call of a reused layer's)
        self.add_module("requant", None if float_out or grid is None else Quantize(*grid))
        self.keep = True

    @property
    def grid(self) -> tuple[float, int, Any] | None:
        """The output grid ``(scale, zero_point, qdtype)``, or None (float output)."""
        return requant_grid(self.requant)

    def forward(self, x: Any) -> Any:
        y = run_in_own_dtype(self.float_mod, _dq(x))
        return y if self.requant is None or not self.keep else self.requant(y)


class _FunctionalTwin(nn.Module):
    """An eager ``QFunctional`` kept float: the ``FloatFunctional`` method on dequantized operands, float out (what
    the model built from the mapping runs: its ``FloatFunctional`` given ``QTensor`` operands)."""

    def __init__(self) -> None:
        super().__init__()
        self.float_mod = FloatFunctional()

    def forward(self, op: str, *args: Any) -> Any:
        return getattr(self, op)(*args)

    def __getattr__(self, name: str) -> Any:
        if name in QF_METHODS:
            method = getattr(self._modules["float_mod"], name)
            return lambda *args: method(*(type(a)(_dq(t) for t in a) if isinstance(a, (list, tuple)) else _dq(a)
                                          for a in args))
        return super().__getattr__(name)


def record_tagged_inputs(prepared: nn.Module) -> tuple[dict[str, nn.Module], list[Any]]:
    """Eager mode: a fresh copy of every weighted layer's input observer, observing the calls whose input *is*
    quantized (tagged) in ``prepared`` (the ones its own observer skips). ``({path: observer}, hook handles)``."""
    found: dict[str, nn.Module] = {}
    handles = []
    for path, mod in prepared.named_modules():
        inp = mod._modules.get("input_activation_post_process")
        if inp is None:
            continue
        obs = found[path] = copy.deepcopy(inp)

        def hook(_m: nn.Module, inputs: Any, obs: nn.Module = obs) -> None:
            x = inputs[0] if inputs else None
            if isinstance(x, torch.Tensor) and x.is_floating_point() and _tagged(x):
                obs(x.detach())
        handles.append(mod.register_forward_pre_hook(hook, prepend=True))
    return found, handles


def give_input_grids(qmodel: nn.Module, observers: dict[str, nn.Module]) -> None:
    """Every int8 layer of ``qmodel`` with no recorded input grid gets the one ``record_tagged_inputs`` saw."""
    for path, obs in observers.items():
        try:
            q = qmodel.get_submodule(path)
        except AttributeError:
            continue
        if hasattr(q, "input_grid") and q.input_grid is None and holds_grid(obs):
            scale, zero_point = obs.calculate_qparams()
            q.input_grid = (float(scale), int(zero_point), as_qdtype(obs.qdtype))
