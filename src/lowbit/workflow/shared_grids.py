"""Functionals an int8 model runs on the codes, kept on their input's grid in an eager prepared / QAT model.

Eager ``prepare`` sees modules, not functional calls. A converted model runs ``F.interpolate`` (``nn.Upsample``,
``F.upsample*``) and functional max pooling of a ``QTensor`` on its codes, output on the input's grid; an eager
prepared model used to hand their float output to the next weighted layer, which observed it on a grid of its own
(QAT against convert: 59 % of outputs exact, 2 steps off, for a bilinear upsample between two convs). ``SharedGrids``,
a ``TorchFunctionMode`` the prepared root turns on for its forward, keeps them on the input's grid: nearest modes and
max pooling pass the tag on (they select values); bilinear goes through the input's observer again (graph mode's
``obs_share``) and takes the int8 kernel's codes (``bilinear_on_grid``: ``(bilinear_codes(round(x / s) + z) - z) s``,
the fake-quantized float op's gradient).

A mode costs a Python call per torch call of the forward (a 6-conv QAT step +14 %), so ``install`` puts it only on
models whose code can call these functionals: an ``nn.Upsample`` (``UpsamplingBilinear2d``, ...) anywhere, or a
user-defined module whose methods or held functions (a lambda, a ``functools.partial``), or the module-level
functions they name (two levels), name ``interpolate`` /
``upsample*`` / ``max_pool*`` (``calls_resampling``). A call it cannot see (``getattr`` by string, a function
passed in) keeps the old behaviour: the next layer's own grid.

>>> import torch
>>> from torch import nn
>>> import torch.nn.functional as F
>>> class Up(nn.Module):
...     def forward(self, x):
...         return F.interpolate(x, scale_factor=2, mode="bilinear")
>>> calls_resampling(nn.Sequential(nn.Conv2d(1, 1, 1), Up())), calls_resampling(nn.Sequential(nn.Conv2d(1, 1, 1)))
(True, False)
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..fake_quant import FakeQuantize, LearnableFakeQuantize
from ..observer.base import ObserverBase
from ..qtensor.resample import bilinear_on_grid
from .hooks import _enter_shared_grids, _exit_shared_grids, _grid_module, _tag, _tagged

__all__ = ["SharedGrids", "bilinear_on_shared_grid", "calls_resampling", "install"]

# ---- functionals the int8 model runs on the codes: the simulation keeps the input's grid too ---------------------
_INTERPOLATE = inspect.signature(F.interpolate)
_MAX_POOLS = (F.max_pool1d, F.max_pool2d, F.max_pool3d)


def _rounding_grid(obs: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int, int | None] | None:
    """``(scale, zero_point, quant_min, quant_max, axis)`` of the grid ``obs``'s forward rounds onto: an enabled
    ``FakeQuantize`` (LSQ: its learned grid), or a reference model's ``QuantDeQuant``; ``None`` for an observer (its
    forward returns its input), a disabled fake-quant or a float zero point."""
    if isinstance(obs, FakeQuantize):
        if not obs._switch("fake_quant_enabled") or obs.qscheme.has_float_zero_point:  # (the mirror when traced)
            return None
        s, z = obs.scale.detach(), obs.zero_point.detach()
        if isinstance(obs, LearnableFakeQuantize):  # (its calculate_qparams clamps the scale in place: no version bump
            s, z = s.clamp(min=obs.eps), z.round().clamp(obs.quant_min, obs.quant_max)  # under autograd here)
            if obs.symmetric_zero_point is not None:
                z = torch.full_like(z, obs.symmetric_zero_point)
        return s, z, obs.quant_min, obs.quant_max, obs.ch_axis
    if isinstance(obs, ObserverBase) or not isinstance(getattr(obs, "scale", None), torch.Tensor):
        return None
    qdtype = getattr(obs, "qdtype", None)
    if qdtype is None or not isinstance(getattr(obs, "zero_point", None), torch.Tensor):
        return None
    return obs.scale, obs.zero_point, qdtype.quant_min, qdtype.quant_max, None


def _share_interpolate(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """``F.interpolate`` of a tagged tensor (an observed module's output): nearest modes select its values (tagged,
    as the int8 model's codes); bilinear goes through the input's observer again (graph mode's ``obs_share``: the
    calibration sees it, QAT fake-quantizes it on the input's grid) and takes the int8 kernel's codes
    (``bilinear_on_grid``). Anything the int8 model runs in float (antialias, bicubic, a per-channel grid along a
    resampled axis) is left alone."""
    a = _INTERPOLATE.bind(*args, **kwargs).arguments
    x, mode = a["input"], a.get("mode", "nearest")
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not _tagged(x):
        return out
    obs = _grid_module(x)
    if mode in ("nearest", "nearest-exact"):
        return _tag(out, obs)
    if mode != "bilinear" or a.get("antialias", False) or x.dim() != 4 or obs is None:
        return out
    axis = getattr(obs, "ch_axis", None)
    if axis is not None and axis % 4 >= 2:
        return out
    on_codes = getattr(obs, "resample_on_codes", None)
    if on_codes is not None:  # an export twin's QDQ: lowbit's blend of the codes in the file (lowbit.export.codes)
        return _tag(on_codes(x, a.get("size"), a.get("scale_factor"), a.get("align_corners"),
                             a.get("recompute_scale_factor")), obs)
    y = obs(out)
    grid = _rounding_grid(obs)
    if grid is not None:
        s, z, qmin, qmax, ch = grid
        y = bilinear_on_grid(x, y, s, z, qmin, qmax, None if ch is None else ch % 4, a.get("size"),
                             a.get("scale_factor"), a.get("align_corners"), a.get("recompute_scale_factor"))
    return _tag(y, obs)


def bilinear_on_shared_grid(x: torch.Tensor, y: torch.Tensor, obs: nn.Module, size: Any = None,
                            scale_factor: Any = None, align_corners: Any = None,
                            recompute_scale_factor: Any = None) -> torch.Tensor:
    """Graph mode's shared-grid bilinear upsample (``fx.classify.share_bilinear_grids``: a node after the input's
    observer ``obs`` called again on ``y = obs(F.interpolate(x, ...))``): the int8 kernel's codes where ``obs``
    rounds (an enabled fake-quant: ``bilinear_on_grid``, ``(bilinear_codes(round(x / s) + z) - z) s`` with ``y``'s
    gradient), else ``y`` itself (an observer: calibration; a disabled fake-quant; an export twin's ``QDQ``, whose
    upsample ``lowbit.export.codes`` already runs on the codes). ``convert_fx`` drops the node.

    >>> import torch, torch.nn.functional as F, lowbit as Q
    >>> fq = Q.get_default_qat_qconfig().activation()
    >>> x = fq(torch.tensor([[[[0.0, 0.3], [0.6, 0.9]]]]))
    >>> y = fq(F.interpolate(x, scale_factor=2, mode="bilinear"))
    >>> out = bilinear_on_shared_grid(x, y, fq, None, 2)
    >>> torch.equal(out, y), round(float((out - y).abs().max() / fq.scale), 3)  # (a tie: the kernel rounds to even)
    (False, 1.0)
    >>> torch.equal(bilinear_on_shared_grid(x, y, Q.MinMaxObserver(), None, 2), y)
    True
    """
    if isinstance(x, torch.fx.Proxy):  # (one node when fx traces it: unpickling a GraphModule re-traces its code)
        return x.tracer.create_proxy("call_function", bilinear_on_shared_grid, (x, y, obs, size, scale_factor,
                                                                                align_corners, recompute_scale_factor), {})
    grid = _rounding_grid(obs)
    if grid is None or x.dim() != 4:
        return y
    s, z, qmin, qmax, ch = grid
    if ch is not None and ch % 4 >= 2:  # (a grid per row / column: the int8 model resamples it in float)
        return y
    return bilinear_on_grid(x, y, s, z, qmin, qmax, None if ch is None else ch % 4, size, scale_factor,
                            align_corners, recompute_scale_factor)


class SharedGrids(TorchFunctionMode):
    """Active while a prepared eager model runs (its root's hooks): ``F.interpolate`` (``nn.Upsample``,
    ``F.upsample*``) and functional max pooling of an observed module's output keep its grid, as the int8 model's
    QTensor ops do; the next weighted layer then reads them as quantized (no input observer of its own)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.interpolate and args:
            return _share_interpolate(args, kwargs, out)
        if func in _MAX_POOLS and args and isinstance(out, torch.Tensor) and _tagged(args[0]):
            return _tag(out, _grid_module(args[0]))
        return out


_NAMES = frozenset({"interpolate", "upsample", "upsample_bilinear", "upsample_nearest", "max_pool1d", "max_pool2d",
                    "max_pool3d"})


def _names(fn: Any, depth: int, seen: set[int]) -> bool:
    """Whether ``fn``'s code (nested functions and lambdas included), or a module-level function it names (``depth``
    levels), names one of ``_NAMES``."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    todo = [code]
    while todo:
        c = todo.pop()
        if _NAMES.intersection(c.co_names):
            return True
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        if depth > 0:
            glob = getattr(fn, "__globals__", {})
            for name in c.co_names:
                g = glob.get(name)
                if isinstance(g, types.FunctionType) and not g.__module__.startswith(("torch", "lowbit")) \
                        and _names(g, depth - 1, seen):
                    return True
    return False


def calls_resampling(model: nn.Module) -> bool:
    """Whether ``model`` holds an ``nn.Upsample`` or a user module whose code can call the functionals ``SharedGrids``
    handles (module doc). torch's own modules are not read (``nn.MaxPool2d`` is a module ``prepare`` already passes
    the grid through); lowbit's are (``lowbit.models`` are user models)."""
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, nn.Upsample):
            return True
        for klass in type(mod).__mro__:
            if klass.__module__.startswith("torch.") or klass is object:
                break
            if any(_names(v, 2, seen) for v in vars(klass).values() if inspect.isfunction(getattr(v, "__func__", v))):
                return True
        held = [getattr(v, "func", v) for v in vars(mod).values()]  # functions a module holds (a lambda, a partial)
        if any(_names(v, 2, seen) for v in held if inspect.isfunction(v)):
            return True
    return False


def install(root: nn.Module) -> bool:
    """Put ``SharedGrids`` on ``root``'s forward (a pre-hook turns it on, an always-called hook off) where
    ``calls_resampling(root)``; returns whether it did."""
    if not calls_resampling(root):
        return False
    if _enter_shared_grids not in root._forward_pre_hooks.values():
        root.register_forward_pre_hook(_enter_shared_grids)
        root.register_forward_hook(_exit_shared_grids, always_call=True)
    return True
