"""LearnableFakeQuantize: fake quantization whose scale and zero point are trained (LSQ / LSQ+).

Esser et al., "Learned Step Size Quantization" (ICLR 2020), with the learnable zero point of LSQ+; the forward and
its gradients are ``fake_quant/lsq.py``'s ``fake_quantize_learnable``.

Three phases, as ``torch.ao``'s ``_LearnableFakeQuantize`` (switches are ``uint8`` buffers):
``enable_static_estimate()`` (the default: the observer runs and its qparams are copied into the
parameters; output fake-quantized), ``enable_static_observation()`` (observer runs, output is ``x``)
and ``enable_param_learning()`` (observer off, ``scale``/``zero_point`` get gradients). Outside the
static phase ``scale`` is clamped to ``eps`` (the observer's) before use. ``calculate_qparams()``
returns the learned ``(scale, round(zero_point))``, so ``convert`` builds the grid that was learned.

Departures from ``torch.ao`` (values and gradients are otherwise identical, tested):

- the backward uses the zero point the forward used, ``clamp(round_half_even(zero_point))``
  (torch's per-tensor backward truncates ``zero_point + 0.5``: one code too high for every negative
  zero point, so its mask and clipping gradients are off at the grid's edge; its per-channel backward
  rounds ``z + x / s`` jointly, which moves exact ties ``x / s = k + 1/2`` to the other side for odd ``z``);
- symmetric schemes pin ``zero_point`` to the observer's symmetric value (0 signed, the midpoint
  unsigned) and never train it (torch zeroes it, also for ``quint8``, yet computes its gradient);
- ``scale``/``zero_point`` require grad only while learning is enabled (torch's constructor leaves
  them requiring grad in the static phase, so an optimizer step there leaks into the learned start);
- the positivity floor is the observer's ``eps`` (default 1e-8; torch: float32 eps, 1.19e-7);
- per-tensor parameters are 0-d (torch: shape ``(1,)``); a per-channel module sizes them on the first
  batch unless ``channel_len`` is given; any floating dtype and device works (computed in float32).
- ``calculate_qparams()`` raises ``RuntimeError`` (naming the module) while the parameters hold no grid
  — the observer saw no finite data, nothing was learned or loaded — where torch returns the initial
  ``scale=1.0``; ``load_state_dict`` rejects a NaN/Inf/0/negative ``scale`` or a NaN/Inf ``zero_point``
  naming the key, as for ``FakeQuantize``'s buffers (torch loads them); ``state_dict()`` saves ``max(scale, eps)``
  (what every use computes with), so a checkpoint taken after an optimizer step drove a scale below zero loads back.

>>> import torch, lowbit as Q
>>> fq = Q.LearnableFakeQuantize(qdtype=Q.quint8)
>>> _ = fq(torch.tensor([-1.0, 3.0]))                   # static phase: observer sets the parameters
>>> round(fq.scale.item(), 6), fq.zero_point.item()
(0.015686, 64.0)
>>> fq = fq.enable_param_learning()
>>> fq(torch.tensor([0.5, 5.0])).sum().backward()
>>> round(fq.scale.grad.item(), 3), round(fq.zero_point.grad.item(), 5)    # 5.0 clips at qmax
(191.125, -0.01569)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..compile_state import tracing
from ..functional import _F32_MAX, _F32_TINY, _show, check_ch_axis, check_quantized_state
from ..observer.base import ObserverBase, saved_eps
from ..observer.distributed import is_distributed, sync_pending
from ..observer.minmax import MovingAverageMinMaxObserver
from ..qparams import symmetric_zero_point
from .base import FakeQuantize
from .switches import grid_shape_errors, per_tensor_qparams, switch_errors
from .lsq import fake_quantize_learnable

__all__ = ["LearnableFakeQuantize", "fake_quantize_learnable", "enable_param_learning",
           "enable_static_estimate", "enable_static_observation"]


class LearnableFakeQuantize(FakeQuantize):
    """A ``FakeQuantize`` whose ``scale``/``zero_point`` are ``nn.Parameter`` s learned by LSQ(+).

    ``LearnableFakeQuantize(observer=MovingAverageMinMaxObserver, scale=1.0, zero_point=None,
    channel_len=None, use_grad_scaling=False, **observer_kwargs)``. ``zero_point`` defaults to 0
    (affine) or the pinned symmetric value; ``channel_len`` pre-sizes per-channel parameters (else
    they take shape ``(C,)`` on the first batch, before any optimizer step). Buffers
    ``fake_quant_enabled``, ``observer_enabled`` (alias ``static_enabled``) and ``learning_enabled``.

    >>> import torch, lowbit as Q
    >>> fq = Q.LearnableFakeQuantize(Q.PerChannelMinMaxObserver, ch_axis=0, use_grad_scaling=True)
    >>> _ = fq(torch.randn(4, 3)); fq.scale.shape, fq.zero_point.requires_grad
    (torch.Size([4]), False)
    """

    scale: nn.Parameter  # type: ignore[assignment]
    zero_point: nn.Parameter  # type: ignore[assignment]
    learning_enabled: torch.Tensor

    def __init__(self, observer: Callable[..., ObserverBase] = MovingAverageMinMaxObserver, scale: float = 1.0,
                 zero_point: float | None = None, channel_len: int | None = None, use_grad_scaling: bool = False,
                 **observer_kwargs: Any) -> None:
        super().__init__(observer, **observer_kwargs)
        name = type(self).__name__
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not _F32_TINY <= scale <= _F32_MAX:
            raise ValueError(f"{name}: scale={scale!r} must be a positive finite number (in float32, as it is stored)")
        if zero_point is not None and (isinstance(zero_point, bool) or not isinstance(zero_point, (int, float))
                                       or not math.isfinite(zero_point)):
            raise ValueError(f"{name}: zero_point={zero_point!r} must be a finite number or None")
        if not isinstance(use_grad_scaling, bool):
            raise TypeError(f"{name}: use_grad_scaling={use_grad_scaling!r} must be a bool")
        if channel_len is not None:
            if isinstance(channel_len, bool) or not isinstance(channel_len, int) or channel_len <= 0:
                raise ValueError(f"{name}: channel_len={channel_len!r} must be a positive int or None")
            if self.ch_axis is None:
                raise ValueError(f"{name}: channel_len={channel_len} needs a per-channel qscheme, got {self.qscheme.value}")
        if zero_point is not None and not self.quant_min <= zero_point <= self.quant_max:
            raise ValueError(f"{name}: zero_point={zero_point!r} is outside the {self.qdtype!r} grid "
                             f"[{self.quant_min}, {self.quant_max}]")
        self.symmetric_zero_point: int | None = None
        if self.qscheme.is_symmetric:
            self.symmetric_zero_point = symmetric_zero_point(self.qdtype, name)
            if zero_point is not None and zero_point != self.symmetric_zero_point:
                raise ValueError(f"{name}: zero_point={zero_point!r} conflicts with qscheme={self.qscheme.value}, "
                                 f"whose zero point is pinned at {self.symmetric_zero_point}")
        z0 = float(self.symmetric_zero_point if self.symmetric_zero_point is not None else (zero_point or 0.0))
        shape = () if channel_len is None else (channel_len,)
        del self._buffers["scale"], self._buffers["zero_point"]         # FakeQuantize's buffers become parameters
        self.scale = nn.Parameter(torch.full(shape, float(scale)))
        self.zero_point = nn.Parameter(torch.full(shape, z0))
        self.use_grad_scaling = use_grad_scaling
        self.register_buffer("learning_enabled", torch.tensor([0], dtype=torch.uint8))
        self._grid_loaded = False  # set by load_state_dict: the parameters came from a checkpoint
        self._grid_trained = False  # set by a forward with learning enabled: the parameters are being learned
        self.toggle_qparam_learning(False)

    _SWITCHES = ("fake_quant_enabled", "observer_enabled", "learning_enabled")

    @property
    def eps(self) -> float:
        """The scale's floor: the observer's ``eps`` (read live, so a loaded checkpoint's value applies)."""
        return self.activation_post_process.eps

    # -- phases (torch.ao names) -------------------------------------------------------------------
    @property
    def static_enabled(self) -> torch.Tensor:
        """torch.ao's name for ``observer_enabled``: the observer runs and overwrites the parameters."""
        return self.observer_enabled

    def toggle_qparam_learning(self, enabled: bool = True) -> LearnableFakeQuantize:
        self._set_switch("learning_enabled", enabled)
        self.scale.requires_grad_(bool(enabled))
        self.zero_point.requires_grad_(bool(enabled) and self.symmetric_zero_point is None)
        return self

    def toggle_observer_update(self, enabled: bool = True) -> LearnableFakeQuantize:
        return self.enable_observer(enabled)  # type: ignore[return-value]

    def toggle_fake_quant(self, enabled: bool = True) -> LearnableFakeQuantize:
        return self.enable_fake_quant(enabled)  # type: ignore[return-value]

    def enable_param_learning(self) -> LearnableFakeQuantize:
        """Learn ``scale``/``zero_point`` by gradient; observer off; output fake-quantized."""
        return self.toggle_qparam_learning(True).toggle_fake_quant(True).toggle_observer_update(False)

    def enable_static_estimate(self) -> LearnableFakeQuantize:
        """Observer qparams each step (no learning); output fake-quantized. The initial phase."""
        return self.toggle_qparam_learning(False).toggle_fake_quant(True).toggle_observer_update(True)

    def enable_static_observation(self) -> LearnableFakeQuantize:
        """Observer accumulates, parameters follow it, output is ``x`` unchanged."""
        return self.toggle_qparam_learning(False).toggle_fake_quant(False).toggle_observer_update(True)

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{type(self).__name__} expects a floating-point tensor, got {got}")
        scale, zero_point, traced = self.scale, self.zero_point, tracing()
        if self._switch("observer_enabled") and not self._meta_run(x):
            if torch.compiler.is_exporting():  # (the observer's grid would be written into the parameters)
                raise RuntimeError(f"{type(self).__name__}: torch.export with the observer on (static_enabled=1) would "
                                   "write the observer's grid into the scale / zero_point parameters, which an exported "
                                   "program cannot mutate; call disable_observer() or enable_param_learning() first")
            if scale.dim() == 1 and x.dim() > self.ch_axis >= -x.dim() and x.shape[self.ch_axis] != scale.shape[0]:
                raise ValueError(f"{type(self).__name__}: its per-channel scale / zero_point hold {scale.shape[0]} "
                                 f"channels (channel_len, or a loaded checkpoint) but the batch of shape "
                                 f"{tuple(x.shape)} has {x.shape[self.ch_axis]} along ch_axis={self.ch_axis}")
            self.activation_post_process(x.detach())
            self._set_qparams(*self._step_qparams())
            self._grid_trained = False  # (a copy of the observer's grid again)
        elif traced:  # the clamped value, the gradient straight to the parameter, which is left as it is: torch.export
            # lifts a write through .data as a constant (the eager form's saved-for-backward value, no version bump)
            scale = scale + (scale.clamp(min=self.eps) - scale).detach()
        else:  # (.data, as torch.ao: no version bump, so a second call in one forward (a graph-mode shared grid, a
            # reused module) leaves what the first call saved for backward usable)
            self.scale.data.clamp_(min=self.eps)
        if self._switch("learning_enabled"):
            self._grid_trained = True
        if not self._switch("fake_quant_enabled"):
            return x
        if not self._switch("observer_enabled") and not self._switch("learning_enabled"):
            self._check_grid(x)
        if self.symmetric_zero_point is not None and traced:  # (never trained: requires no grad)
            zero_point = torch.full_like(zero_point.detach(), self.symmetric_zero_point)
        elif self.symmetric_zero_point is not None:
            self.zero_point.data.fill_(self.symmetric_zero_point)
        grad_factor = 1.0 / math.sqrt(x.numel() * self.quant_max) if self.use_grad_scaling and x.numel() else 1.0
        if self.ch_axis is not None and self.scale.dim() == 0:  # per channel, never sized by an observer batch
            if x.numel() == 0:  # an empty batch (the observer skipped it): nothing to quantize, nothing to learn
                check_ch_axis(self.ch_axis, x.dim(), x.shape)
                return x
            raise ValueError(f"{type(self).__name__}: its per-channel scale/zero_point have no channels yet; run one "
                             "batch with the observer on before enable_param_learning(), or build it with "
                             "channel_len=C (e.g. LearnableFakeQuantize.with_args(..., channel_len=C))")
        return fake_quantize_learnable(x, scale, zero_point, self.quant_min, self.quant_max, self.ch_axis, grad_factor)

    def _set_qparams(self, s: torch.Tensor, z: torch.Tensor) -> None:
        with torch.no_grad():
            for p, value in ((self.scale, s), (self.zero_point, z)):
                value = value.detach().to(device=p.device, dtype=p.dtype)
                if p.shape != value.shape:        # scalar seed -> (C,): same Parameter object, new storage
                    _resize_parameter(p, value.shape)
                p.data.copy_(value)  # (.data: no version bump, as torch.ao's copy; see forward)

    def _has_grid(self) -> bool:  # (FakeQuantize._check_grid: a learned, loaded or set grid counts)
        return self._holds_grid() or bool((self.scale.detach() != 1.0).any())

    def _holds_grid(self) -> bool:
        """Whether ``scale``/``zero_point`` hold a grid: the observer saw finite data (the static phases copy
        its grid), learning is on (they are trained), or they were loaded from a state dict."""
        obs = self.activation_post_process
        loaded = getattr(self, "_grid_loaded", False)  # (absent on modules pickled before it existed)
        return bool(self.learning_enabled[0] == 1) or loaded or bool(getattr(obs, "is_calibrated", True))

    def _adopt_reduced_grid(self) -> None:
        """Under ``torch.distributed``: parameters that only copy the observer's grid (the static phases; never
        learned, never loaded) take the grid of its statistics reduced across ranks, as a ``FakeQuantize`` does. They
        held the last local step's grid, different on every rank, or the initial ``scale=1.0`` on a rank whose shard
        was empty (its observer adopted the others' statistics, so the module counted as holding a grid)."""
        if (getattr(self, "_grid_trained", False) or getattr(self, "_grid_loaded", False)
                or self.learning_enabled[0] == 1 or not is_distributed()):
            return
        obs = self.activation_post_process
        sync_pending(obs)  # a collective unless already reduced (sync_observers), like FakeQuantize.calculate_qparams
        if getattr(obs, "is_calibrated", False):
            self._set_qparams(*self._step_qparams())

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned grid: ``(max(scale, eps), clamp(round(zero_point), qmin, qmax))`` as float32 / int64;
        ``RuntimeError`` naming the parameter when ``scale`` or ``zero_point`` is NaN or infinite.

        ``RuntimeError`` naming this module while the parameters hold no grid: its observer saw no
        finite data (no batch, or only NaN/Inf), learning was never enabled and no state was loaded
        (torch.ao returns the initial ``scale=1.0`` there; lowbit refuses, as ``FakeQuantize`` does).
        Under ``torch.distributed`` parameters never learned nor loaded take the grid of the observer's reduced
        statistics first (``_adopt_reduced_grid``: a collective unless ``sync_observers`` ran).
        """
        self._adopt_reduced_grid()
        if not self._holds_grid():
            obs = self.activation_post_process
            raise RuntimeError(f"{type(self).__name__}: scale/zero_point hold no grid yet: its observer "
                               f"({type(obs).__name__}) has not observed finite data (in every channel; no batch, "
                               "or only NaN/Inf) and the parameters were neither learned nor loaded; run calibration "
                               "batches with finite values (or enable_param_learning()) before calculate_qparams()")
        for name, p in (("scale", self.scale), ("zero_point", self.zero_point)):
            if not bool(torch.isfinite(p).all()):  # training diverged: a NaN scale, a NaN zero point cast to -2**63
                raise RuntimeError(f"{type(self).__name__}: the learned {name}={_show(p.detach())} is not finite (the "
                                   "training diverged, or the parameter was set by hand); it holds no grid to convert")
        with torch.no_grad():
            self.scale.clamp_(min=self.eps)
        z = self.zero_point.detach().round().clamp(self.quant_min, self.quant_max)
        if self.symmetric_zero_point is not None:
            z = torch.full_like(z, self.symmetric_zero_point)
        return self.scale.detach().to(torch.float32).clone(), z.to(torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # type: ignore[no-untyped-def]
        errors = self._adopt_torch_ao_keys(state_dict, prefix)
        errors += self._state_errors(state_dict, prefix, local_metadata)
        if errors:  # a NaN / 0 / negative scale, a NaN zero point: rejected naming the key, state kept
            error_msgs.extend(errors)
            return
        for name in ("scale", "zero_point"):  # adopt a per-channel (C,) shape from the checkpoint
            saved, p = state_dict.get(prefix + name), getattr(self, name)
            if isinstance(saved, torch.Tensor) and saved.shape != p.shape:
                _resize_parameter(p, saved.shape)
        n_errors = len(error_msgs)
        nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                        unexpected_keys, error_msgs)
        if len(error_msgs) == n_errors and prefix + "scale" in state_dict:
            self._grid_loaded = True
        # the loaded learning_enabled decides whether scale / zero_point require grad, as toggle_qparam_learning
        # does (a checkpoint of the learning phase loaded into a fresh module left them frozen: no gradient, an
        # optimizer that never moved them, learning_enabled=1 all along)
        self.toggle_qparam_learning(bool(self.learning_enabled[0] == 1))
        self._sync_mirror()

    def _state_errors(self, state_dict, prefix, local_metadata):  # type: ignore[no-untyped-def]
        """The buffers' problems, the ``scale`` / ``zero_point`` parameters' and a torch.ao ``eps``'s while still in
        ``state_dict`` (pure: ``guard_loading`` runs it first; the load pops ``eps`` in ``_adopt_torch_ao_keys``)."""
        eps = state_dict.get(prefix + "eps")
        problem = "" if eps is None else saved_eps(eps, prefix, type(self).__name__)[1]
        return ([problem] if problem else []) + switch_errors(self, state_dict, prefix) \
            + grid_shape_errors(self, state_dict, prefix) \
            + check_quantized_state(self, state_dict, prefix) + self._check_parameters(state_dict, prefix)

    def _adopt_torch_ao_keys(self, state_dict: dict[str, Any], prefix: str) -> list[str]:
        """Read a torch.ao ``_LearnableFakeQuantize`` checkpoint (in place): its ``static_enabled`` is lowbit's
        ``observer_enabled`` (it replaces torch.ao's own, unused ``observer_enabled``); its module-level ``eps``
        buffer (the scale's floor) is checked and dropped, lowbit's floor being the observer's ``eps`` (saved under
        ``activation_post_process.eps`` too; torch.ao's two are equal unless set apart by hand); per-tensor
        parameters of shape ``(1,)`` become 0-d."""
        static = state_dict.pop(prefix + "static_enabled", None)
        if static is not None:  # (torch.ao also saves its base class's observer_enabled, which its forward ignores)
            state_dict[prefix + "observer_enabled"] = static
        per_tensor_qparams(self, state_dict, prefix)
        eps = state_dict.pop(prefix + "eps", None)
        problem = "" if eps is None else saved_eps(eps, prefix, type(self).__name__)[1]
        return [problem] if problem else []

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """As ``nn.Module``'s, with ``scale`` saved as ``max(scale, eps)``: an optimizer step can leave a learned
        scale at or below zero, and every use (the forward, ``calculate_qparams``) clamps it to ``eps`` first, so the
        checkpoint holds the scale the module computes with, which ``load_state_dict`` accepts. The live
        parameter is not changed; a NaN scale is saved as is (and refused on load)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        scale = self.scale.detach()
        if bool((scale < self.eps).any()):
            destination[prefix + "scale"] = scale.clamp(min=self.eps)

    def _check_parameters(self, state_dict: dict[str, Any], prefix: str) -> list[str]:
        """The incoming ``scale`` (floating, finite, > 0) and ``zero_point`` (finite; a learned zero point
        is continuous, rounded and clamped onto the grid where it is used) — ``check_quantized_state``
        covers buffers only, and these are parameters."""
        errors, where = [], type(self).__name__
        for name in ("scale", "zero_point"):
            value, key = state_dict.get(prefix + name), prefix + name
            if not isinstance(value, torch.Tensor) or value.numel() == 0:
                continue
            if not value.is_floating_point() and (name == "scale" or value.is_complex() or value.dtype == torch.bool):
                errors.append(f"{key}: expected a real {'floating-point' if name == 'scale' else 'numeric'} "
                              f"tensor, got dtype {value.dtype} ({where})")
                continue
            v = value.detach()
            ok = torch.isfinite(v) & (v > 0) if name == "scale" else torch.isfinite(v)
            if not bool(ok.all()):
                need = "finite and > 0" if name == "scale" else "finite"
                errors.append(f"{key}: {name}={_show(v)} must be {need} ({where})")
        return errors

    def extra_repr(self) -> str:
        axis = f", ch_axis={self.ch_axis}" if self.ch_axis is not None else ""
        return (f"fake_quant_enabled={int(self._switch('fake_quant_enabled'))}, "
                f"static_enabled={int(self._switch('observer_enabled'))}, "
                f"learning_enabled={int(self._switch('learning_enabled'))}, use_grad_scaling={self.use_grad_scaling}, "
                f"qdtype={self.qdtype!r}, qscheme={self.qscheme.value}{axis}, {self._grid_repr()}")


def _resize_parameter(p: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> None:
    """Give ``p`` new storage of ``shape`` (same Parameter object, so optimizers keep it), a normal tensor even
    under ``torch.inference_mode()``: an inference tensor could never require grad again (``enable_param_learning``
    after a first batch run for validation under inference mode)."""
    with torch.inference_mode(False):
        p.data = torch.empty(shape, dtype=p.dtype, device=p.device)


# Module-level phase switches for ``model.apply(...)``: they act on LearnableFakeQuantize, ignore others.
def enable_param_learning(mod: nn.Module) -> None:
    """``model.apply(enable_param_learning)``: every LearnableFakeQuantize starts learning its qparams."""
    if isinstance(mod, LearnableFakeQuantize):
        mod.enable_param_learning()


def enable_static_estimate(mod: nn.Module) -> None:
    """``model.apply(enable_static_estimate)``: qparams follow the observers again (no learning)."""
    if isinstance(mod, LearnableFakeQuantize):
        mod.enable_static_estimate()


def enable_static_observation(mod: nn.Module) -> None:
    """``model.apply(enable_static_observation)``: observers run, outputs pass through unquantized."""
    if isinstance(mod, LearnableFakeQuantize):
        mod.enable_static_observation()
