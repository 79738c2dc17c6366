"""FakeQuantize: an observer plus fake quantization, the building block of QAT (DESIGN §2).

Each forward, with ``(s, z)`` the grid of the wrapped observer and ``[qmin, qmax]`` its dtype's::

    observer enabled:    observer(x.detach());  (scale, zero_point) <- observer's qparams
    fake-quant enabled:  y = (clamp(round(x / s) + z, qmin, qmax) - z) * s        # else y = x
    dy/dx = 1[qmin <= round(x / s) + z <= qmax]                                    # straight-through

``scale``/``zero_point`` are ``()`` per tensor or ``(C,)`` per channel (broadcast along
``ch_axis``). Both switches are ``uint8`` buffers, so they are saved in ``state_dict`` (unlike the
seeds' framework, like ``torch.ao``); the forward ignores ``self.training``. For the min/max
observer family the per-step qparams come straight from the observer's buffers (no validation
round trip, no cross-rank collective); a channel (or tensor) that has seen no finite data yet keeps the
neutral grid ``(1.0, 0)`` (fake-quantizing on it with the observer off is a ``RuntimeError``); for any other
observer (histograms) from its ``calculate_qparams()`` on the rank's local statistics, so no step runs a
collective. ``calculate_qparams()`` asks the observer (and so
reduces across ranks under ``torch.distributed``; see ``lowbit.observer.distributed``).

The fake quantization is ``lowbit.fake_quantize`` (NaN-propagating; bit-identical to torch's fused
kernels on finite inputs). Small per-tensor CPU inputs go through
``torch.fake_quantize_per_tensor_affine`` instead (one kernel, NaN restored), which is faster there
and gives the same bits; from ~16k elements on, lowbit's vectorised composite is as fast or faster.
(CUDA stays on the composite until the fused CUDA kernel's bit-equality is verified on a GPU.)

PyTorch 2 and meta: the switches keep their ``uint8`` buffers (torch.ao's state dict) and a Python mirror of each.
While ``torch.compile`` / ``torch.export`` trace, and with the module on the meta device, the forward branches on
the mirror (dynamo guards on it: flipping a switch recompiles; a buffer written in place or reassigned after tracing
makes the traced program raise, naming the switch), and traced code has no data-dependent step (the
observers' NaN check, the grid-overflow check and torch's fused kernel give way to their ``torch.where`` / composite
forms, the same values). A module on meta with a meta input observes nothing and returns the shape. A histogram-type observer
observes inside the graph too, but its per-step ``calculate_qparams()`` (a range search on the host) is a
``torch.compiler.disable``d call: one graph break per step under ``torch.compile``, an error naming the observer
under ``torch.export`` (export with observers off, after eager calibration / training).

>>> import torch, lowbit as Q
>>> fq = Q.FakeQuantize()                               # MovingAverageMinMaxObserver, quint8
>>> y = fq(torch.tensor([-1.0, 0.0, 0.5, 3.0]))
>>> round(fq.scale.item(), 6), fq.zero_point.item()
(0.015686, 64)
>>> fq.disable_fake_quant()(torch.tensor([0.123])).item() == torch.tensor(0.123).item()
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..compile_state import compiler_disabled, tracing
from ..fx_leaves import FxLeaf
from ..functional import check_quantized_state, fake_quantize
from ..observer.base import ObserverBase, WithArgs
from ..observer.channel_histogram import _ClipRangeObserver
from ..observer.distributed import is_distributed, local_statistics, sync_pending
from ..observer.histogram import HistogramObserver
from ..observer.minmax import MovingAverageMinMaxObserver, _MinMaxObserverBase
from ..qparams import calculate_qparams
from .switches import _assert_switch, assert_grid, grid_shape_errors, per_tensor_qparams, switch_errors

_PLACEHOLDER = ("fake quantization is on but the observer is off and has seen no data, so the grid is the placeholder "
                "scale={scale}, zero_point={zero_point}; run batches with the observer on first (disable_observer "
                "after the first steps, not before) or load a trained checkpoint")


def _is_switch_value(v: Any) -> bool:
    """0 / 1 as an int, a NumPy scalar or a one-value tensor (what a switch method takes besides a bool)."""
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex() and v.item() in (0, 1)
    return isinstance(v, (int, np.integer, np.bool_)) and v in (0, 1)


__all__ = ["FakeQuantize", "enable_observer", "disable_observer", "enable_fake_quant", "disable_fake_quant", "holds_grid",
           "per_tensor_qparams", "switch_errors"]  # (the last two from .switches)


class FakeQuantize(FxLeaf, WithArgs, nn.Module):
    """Observe (optionally) and fake-quantize (optionally) with a straight-through gradient.

    Builds ``activation_post_process = observer(**observer_kwargs)`` and mirrors its ``qdtype``,
    ``qscheme``, ``ch_axis``, ``quant_min``, ``quant_max``. Buffers: ``scale`` (float32),
    ``zero_point`` (int64), ``fake_quant_enabled`` and ``observer_enabled`` (uint8, shape ``(1,)``).

    >>> import torch, lowbit as Q
    >>> fq = Q.FakeQuantize(Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    >>> w = torch.randn(4, 3, requires_grad=True)
    >>> fq(w).shape, fq.scale.shape
    (torch.Size([4, 3]), torch.Size([4]))
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    fake_quant_enabled: torch.Tensor
    observer_enabled: torch.Tensor

    def __init__(self, observer: Callable[..., ObserverBase] = MovingAverageMinMaxObserver,
                 **observer_kwargs: Any) -> None:
        super().__init__()
        if not callable(observer):
            raise TypeError(f"FakeQuantize: observer={observer!r} must be an observer class or factory")
        if isinstance(observer, nn.Module):  # callable, but calling it would run its forward without an input
            raise TypeError(f"FakeQuantize: observer={observer!r} is an observer instance; pass its class or a "
                            f"factory ({type(observer).__name__} or {type(observer).__name__}.with_args(...)), "
                            "and its settings as keyword arguments")
        obs = observer(**observer_kwargs)
        if not isinstance(obs, ObserverBase):
            raise TypeError(f"FakeQuantize: observer={observer!r} built a {type(obs).__name__}, not a lowbit observer")
        self.activation_post_process = obs
        self.qdtype, self.qscheme, self.ch_axis = obs.qdtype, obs.qscheme, obs.ch_axis
        self.quant_min, self.quant_max = obs.qdtype.quant_min, obs.qdtype.quant_max
        self.register_buffer("scale", torch.tensor(1.0))
        # float qparams (embeddings): float32 zero points, as torch.ao's FakeQuantize
        zp_dtype = torch.float32 if self.qscheme.has_float_zero_point else torch.int64
        self.register_buffer("zero_point", torch.tensor(0, dtype=zp_dtype))
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.uint8))
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.uint8))
        self._switch_mirror: dict[str, bool] = {"fake_quant_enabled": True, "observer_enabled": True}

    # -- switches --------------------------------------------------------------------------------
    def _set_switch(self, name: str, enabled: bool) -> None:
        """Write switch ``name`` (a ``uint8`` buffer of shape ``(1,)``) and its Python mirror. ``enabled``: a bool
        (or 0 / 1); anything else (``"no"``, ``2``) raises ``TypeError`` rather than being read as truthy."""
        if enabled is not True and enabled is not False and not _is_switch_value(enabled):
            raise TypeError(f"{type(self).__name__}: enabled={enabled!r} (switch {name}) must be True or False (or 0 / 1)")
        self._buffers[name][0] = 1 if enabled else 0  # type: ignore[index]
        self._mirror()[name] = bool(enabled)

    _SWITCHES: tuple[str, ...] = ("fake_quant_enabled", "observer_enabled")  # uint8 (1,) buffers with a mirror

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling: a module pickled before the mirror existed gets one from its buffers (it was compiled, exported
        or moved to meta before any eager forward: "no Python mirror to trace with")."""
        super().__setstate__(state)
        if "_switch_mirror" not in self.__dict__:
            self._switch_mirror = {}
            self._sync_mirror()

    def _mirror(self) -> dict[str, bool]:
        mirror = getattr(self, "_switch_mirror", None)
        if mirror is None:  # a module pickled before the mirror existed
            mirror = self._switch_mirror = {}
        return mirror

    def _switch(self, name: str) -> bool:
        """Whether switch ``name`` is on (``buffer[0] == 1``).

        Eager, on real tensors, the buffer decides (so a write in place, ``fq.observer_enabled[0] = 0``, is
        seen) and its Python mirror is refreshed. While ``torch.compile`` / ``torch.export`` trace, or with the
        buffers on the meta device, the mirror decides: reading the buffer there is a data-dependent branch
        (a graph break, an export error) or ``Tensor.item()`` on a meta tensor. dynamo guards on the mirror,
        so flipping a switch recompiles. The mirror is kept by the switch methods (``enable_observer``, ...,
        ``model.apply(Q.disable_observer)``), ``load_state_dict`` and every eager forward. A write in place to
        the buffer (DDP's buffer broadcast) or a reassigned buffer cannot reach a program already traced (dynamo
        guards on no tensor value, and reads ``_version`` as a constant), so the traced graph checks
        ``(buffer[0] == 1) == traced`` (an ``_assert_async``): such a program raises naming the switch and the way
        out, where it ran the stale branch silently before."""
        buf = self._buffers[name]
        mirror = self._mirror()
        if tracing() or buf is None or buf.is_meta:
            on = mirror.get(name)
            if on is None:  # (no eager forward, switch or load since unpickling: the buffer is all there is)
                raise RuntimeError(f"{type(self).__name__}: switch {name} has no Python mirror to trace with; run "
                                   "one eager forward, or set it with its method (e.g. enable_observer()), first")
            if buf is not None and not buf.is_meta and tracing():
                _assert_switch(self, name, buf, on)
            return on
        on = bool(buf[0] == 1)
        mirror[name] = on
        return on

    def enable_observer(self, enabled: bool = True) -> FakeQuantize:
        self._set_switch("observer_enabled", enabled)
        if not enabled:
            self._note_grid()
        return self

    def _note_grid(self) -> None:
        """Record (``_grid_seen``) a grid held when the observer is switched off, so that a program traced later
        carries no ``switches.assert_grid`` (7 fake-quants, ``aot_eager``: +0.6 ms a call). Not on a load: the
        observer's own state loads after this module's."""
        if not tracing() and not self.scale.is_meta and not is_distributed() and self._has_grid():
            self.__dict__["_grid_seen"] = True

    def disable_observer(self) -> FakeQuantize:
        return self.enable_observer(False)

    def enable_fake_quant(self, enabled: bool = True) -> FakeQuantize:
        self._set_switch("fake_quant_enabled", enabled)
        return self

    def disable_fake_quant(self) -> FakeQuantize:
        return self.enable_fake_quant(False)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"FakeQuantize expects a floating-point tensor, got {got}")
        observe = self._switch("observer_enabled")
        if observe and not self._meta_run(x):
            self.activation_post_process(x.detach())
            self._set_qparams(*self._step_qparams())
        if self._switch("fake_quant_enabled"):
            if not observe:
                self._check_grid(x)
            if self.qscheme.has_float_zero_point:
                return fake_quantize(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.ch_axis,
                                     float_zero_point=True)
            return _fake_quantize_fast(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.ch_axis)
        return x

    def _check_grid(self, x: torch.Tensor) -> None:
        """Refuse to fake-quantize on the placeholder grid: fake quantization on, the observer off, and no grid
        recorded or set (``_has_grid``). ``model.apply(disable_observer)`` before the first step trained every layer on
        ``scale=1.0`` (values rounded to integers: constant outputs, silently, as in torch.ao) until ``convert``
        refused the model. Not on meta or under ``torch.distributed``, where one rank's empty shard proves nothing;
        once a grid is found the check is not repeated (``load_state_dict`` resets it). Traced (``torch.compile`` /
        ``torch.export``) before a grid was found, the program asserts the same on the buffers
        (``switches.assert_grid``): it ran the placeholder grid silently."""
        if self.__dict__.get("_grid_seen", False) or self.scale.is_meta or is_distributed():
            return
        if tracing():
            assert_grid(self, _PLACEHOLDER)
            return
        if not x.numel():
            return
        if self._has_grid():
            self.__dict__["_grid_seen"] = True
            return
        grid = _PLACEHOLDER.format(scale=self.scale.tolist(), zero_point=self.zero_point.tolist())
        raise RuntimeError(f"{type(self).__name__}: {grid}")

    def _has_grid(self) -> bool:
        """Whether the observer recorded a grid (saw finite data; observers without that record count as holding one)
        or ``scale`` was set to anything but the placeholder 1.0 (by hand, or by loading one)."""
        return bool(getattr(self.activation_post_process, "is_calibrated", True)) or bool((self.scale != 1.0).any())

    def _meta_run(self, x: torch.Tensor) -> bool:
        """A forward of a module on the meta device (``.to("meta")``) with a meta input: shapes only, nothing observed
        (a meta input to a module holding values still reaches the observer, which names the problem)."""
        return x.is_meta and self.scale.is_meta

    def _step_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The observer's current grid; for the min/max family straight from its buffers (no validation
        round trip, no collective), for any other observer its ``calculate_qparams()`` once calibrated, on the rank's
        local statistics (``local_statistics()``: no collective; the cross-rank merge stays pending)."""
        obs = self.activation_post_process
        if isinstance(obs, _MinMaxObserverBase):
            lo, hi = obs.min_val, obs.max_val
            s, z = calculate_qparams(lo, hi, obs.qscheme, obs.qdtype, obs.eps, validate=False)
            seen = torch.isfinite(lo) & torch.isfinite(hi)          # () or (C,)
            neutral_z = min(max(0, self.quant_min), self.quant_max)
            return torch.where(seen, s, 1.0), torch.where(seen, z, neutral_z)
        if not isinstance(obs, (HistogramObserver, _ClipRangeObserver)):  # (fixed, custom: traced as they are)
            return _eager_searched_qparams(self, obs)
        if torch.compiler.is_exporting():  # the histogram's range search reads its statistics on the host
            raise RuntimeError(
                f"{type(self).__name__} with {type(obs).__name__}: its per-step qparams come from the observer's "
                "calculate_qparams() (a range search over the statistics, eager only), which torch.export cannot "
                "trace; calibrate / train eagerly, then export with observers off (model.apply(Q.disable_observer)), "
                "or observe with a min/max observer (MovingAverageMinMaxObserver)")
        return _searched_qparams(self, obs)  # torch.compile: one graph break per step, after the observation

    def _set_qparams(self, s: torch.Tensor, z: torch.Tensor) -> None:
        # in place (keeps buffer identity for DDP); resize on the scalar -> (C,) change
        if self.scale.shape != s.shape:
            self.scale.resize_(s.shape)
            self.zero_point.resize_(z.shape)
        self.scale.copy_(s)
        self.zero_point.copy_(z)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The observer's ``(scale, zero_point)`` (raises if it has seen no data)."""
        return self.activation_post_process.calculate_qparams()

    def _state_errors(self, state_dict, prefix, local_metadata):  # type: ignore[no-untyped-def]
        """A NaN / 0 scale, an off-grid zero point, a switch other than 0 / 1 (pure: ``state_check.guard_loading`` runs
        it first)."""
        return switch_errors(self, state_dict, prefix) + grid_shape_errors(self, state_dict, prefix) \
            + check_quantized_state(self, state_dict, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # type: ignore[no-untyped-def]
        per_tensor_qparams(self, state_dict, prefix)
        self.__dict__.pop("_grid_seen", None)  # (the loaded state decides again)
        errors = self._state_errors(state_dict, prefix, local_metadata)
        if errors:
            error_msgs.extend(errors)
            return
        for name in ("scale", "zero_point"):  # adopt a per-channel (C,) shape from the checkpoint
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor) and saved.shape != getattr(self, name).shape:
                getattr(self, name).resize_(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._sync_mirror()

    def _sync_mirror(self) -> None:
        """The Python mirror of every switch from its buffer (after a load; buffers on meta keep the mirror)."""
        for name in dict.fromkeys([*self._mirror(), *self._SWITCHES]):
            buf = self._buffers.get(name)
            if buf is not None and not buf.is_meta and buf.numel():
                self._mirror()[name] = bool(buf[0] == 1)

    def extra_repr(self) -> str:
        axis = f", ch_axis={self.ch_axis}" if self.ch_axis is not None else ""
        return (f"fake_quant_enabled={int(self._switch('fake_quant_enabled'))}, "
                f"observer_enabled={int(self._switch('observer_enabled'))}, "
                f"qdtype={self.qdtype!r}, qscheme={self.qscheme.value}{axis}, {self._grid_repr()}")

    def _grid_repr(self) -> str:
        if self.scale.is_meta:  # moved to meta: still prints
            return "scale=<meta>, zero_point=<meta>"
        return f"scale={self.scale.tolist()}, zero_point={self.zero_point.tolist()}"


# torch's fused kernel (+ NaN restore) beats lowbit's composite only where per-op overhead dominates:
# measured on the 2-core CPU (1 thread, fwd+bwd, medians of 41 interleaved rounds) 0.12 vs 0.16 ms at
# 1k elements, even at 16k-64k, 9.7 vs 6.9 ms at 256k. On CUDA it would replace ~10 kernels, but its
# bit-equality there is unverified (no GPU in this session), so CUDA uses the composite.
_FUSED_MAX_NUMEL_CPU = 1 << 14


def _eager_searched_qparams(fq: FakeQuantize, obs: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``obs.calculate_qparams()`` on the rank's local statistics once it is calibrated, else ``fq``'s current grid
    (``_searched_qparams``: the same, outside any compiled graph, for the histogram observers)."""
    if obs.is_calibrated:
        # the rank's own statistics: a reduction per step (a collective) hung ranks with uneven batch counts;
        # the merge waits for calculate_qparams / convert / sync_observers, which every rank reaches
        with local_statistics():
            return obs.calculate_qparams()
    return fq.scale, fq.zero_point


_searched_qparams = compiler_disabled(
    _eager_searched_qparams, reason="lowbit: a histogram-type observer's calculate_qparams (its range search) runs "
    "eagerly; compile without fullgraph, or calibrate eagerly and compile with observers disabled")


def _fake_quantize_fast(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                        quant_max: int, ch_axis: int | None) -> torch.Tensor:
    """``lowbit.fake_quantize``, through torch's fused kernel where that is faster and bit-identical.

    ``torch.fake_quantize_per_tensor_affine`` equals ``lowbit.fake_quantize`` (values and
    straight-through gradient) on every non-NaN input for float32 data and grids of at most 16 bits;
    it maps NaN to ``qmin``, so NaN is put back (lowbit propagates it). The per-channel kernel is not
    used: it wraps ±inf and huge values (|x / s| >= 2**63) to ``qmin`` instead of saturating.
    """
    fits = (not tracing() and ch_axis is None and x.dtype == torch.float32 and scale.device == x.device
            and scale.numel() == 1
            and quant_max - quant_min < 1 << 16 and x.device.type == "cpu" and x.numel() <= _FUSED_MAX_NUMEL_CPU)
    if not fits:
        # the qparams come from the observer (or a checked state dict): no host read on accelerators
        # (traced or meta: no values to check; torch's kernel has no fake implementation for export's int32 zero point)
        return fake_quantize(x, scale, zero_point, quant_min, quant_max, ch_axis,
                             validate=x.device.type == "cpu" and not tracing())
    y = torch.fake_quantize_per_tensor_affine(x, scale.reshape(()), zero_point.reshape(()).to(torch.int32),
                                              quant_min, quant_max)
    return torch.where(torch.isnan(x), x.detach(), y)


def holds_grid(obs: nn.Module) -> bool:
    """Whether an observer or fake-quant module describes a grid: its observer saw data, or (``LearnableFakeQuantize``)
    it holds a learned or loaded grid. Under ``torch.distributed`` the ranks' union decides, as in
    ``calculate_qparams``. A module that keeps no such record counts as holding one."""
    sync_pending(obs)
    if hasattr(obs, "_holds_grid"):  # LearnableFakeQuantize: a learned (or loaded) grid counts, observer or not
        return bool(obs._holds_grid())
    inner = getattr(obs, "activation_post_process", None)  # FakeQuantize wraps an observer
    if isinstance(obs, FakeQuantize) and isinstance(inner, ObserverBase):
        return inner.is_calibrated
    return bool(getattr(obs, "is_calibrated", True))


# Module-level switches for ``model.apply(...)``: they act on FakeQuantize modules, ignore others.
def enable_observer(mod: nn.Module) -> None:
    """``model.apply(Q.enable_observer)`` turns every FakeQuantize's observer on."""
    if isinstance(mod, FakeQuantize):
        mod.enable_observer()


def disable_observer(mod: nn.Module) -> None:
    """``model.apply(Q.disable_observer)`` freezes every FakeQuantize's qparams."""
    if isinstance(mod, FakeQuantize):
        mod.disable_observer()


def enable_fake_quant(mod: nn.Module) -> None:
    """``model.apply(Q.enable_fake_quant)`` turns fake quantization on everywhere."""
    if isinstance(mod, FakeQuantize):
        mod.enable_fake_quant()


def disable_fake_quant(mod: nn.Module) -> None:
    """``model.apply(Q.disable_fake_quant)`` makes every FakeQuantize an identity (observers still run)."""
    if isinstance(mod, FakeQuantize):
        mod.disable_fake_quant()
