"""ObserverBase: the calibration contract every observer follows (DESIGN §2).

An observer is an ``nn.Module`` whose ``forward`` is the identity: it folds each batch into a
running statistic kept in registered buffers (so it travels in ``state_dict`` and with ``.to``),
and ``calculate_qparams()`` reduces that statistic to ``(scale, zero_point)`` through
``lowbit.calculate_qparams``.

>>> import torch, lowbit as Q
>>> factory = Q.PerChannelMinMaxObserver.with_args(ch_axis=0)
>>> type(factory()).__name__
'PerChannelMinMaxObserver'
"""

from __future__ import annotations

import abc
import functools
import warnings
from typing import Any

import torch
from torch import nn

from ..compile_state import tracing
from ..fx_leaves import FxLeaf
from ..functional import _F32_MAX, _F32_TINY, check_quantized_state
from ..qparams import symmetric_zero_point
from ..qscheme import QDtype, QScheme, as_qdtype, as_qscheme

__all__ = ["ObserverBase", "AbstractObserverError", "Factory", "finite_aminmax"]


class Factory(functools.partial):
    """A zero-arg factory ``cls(**kwargs)`` (what ``with_args`` returns and a ``QConfig`` stores).

    It is a ``functools.partial`` that chains: ``f.with_args(**more)`` returns a new factory with
    the keyword arguments merged, later ones overriding earlier ones (as ``torch.ao``'s).
    ``f.with_callable_args(name=fn)`` adds arguments computed when the factory is called:
    ``fn()`` on every call (a fresh value per insertion site); they override ``with_args`` values,
    and an argument passed to the call itself overrides both (``torch.ao``'s rules).

    >>> import lowbit as Q
    >>> f = Q.MinMaxObserver.with_args(qdtype=Q.qint8).with_args(qdtype=Q.quint8, eps=1e-5)
    >>> f.keywords == {"qdtype": Q.quint8, "eps": 1e-5}, f().qdtype
    (True, lowbit.quint8)
    >>> sizes = iter([1e-4, 1e-3])
    >>> g = f.with_callable_args(eps=lambda: next(sizes))
    >>> g().eps, g().eps, g(eps=0.5).eps
    (0.0001, 0.001, 0.5)
    """

    callable_args: dict[str, Any]

    def __new__(cls, func: Any, /, *args: Any, **keywords: Any) -> Factory:
        self = super().__new__(cls, func, *args, **keywords)
        self.callable_args = {}
        return self

    def __call__(self, /, *args: Any, **keywords: Any) -> Any:
        lazy = {k: fn() for k, fn in self.callable_args.items() if k not in keywords}
        return super().__call__(*args, **lazy, **keywords)

    def with_args(self, **kwargs: Any) -> Factory:
        """This factory with ``kwargs`` merged into its keyword arguments (``kwargs`` win)."""
        out = Factory(self.func, *self.args, **{**self.keywords, **kwargs})
        out.callable_args = dict(self.callable_args)
        return out

    def with_callable_args(self, **kwargs: Any) -> Factory:
        """This factory with arguments computed at each call: ``name=fn`` passes ``name=fn()``."""
        bad = [k for k, fn in kwargs.items() if not callable(fn)]
        if bad:
            raise TypeError(f"with_callable_args: {bad[0]}={kwargs[bad[0]]!r} must be a zero-arg callable")
        out = self.with_args()
        out.callable_args.update(kwargs)
        return out


class WithArgs:
    """``with_args`` / ``with_callable_args``: the factories a ``QConfig`` stores, for observers and
    fake-quant modules alike."""

    @classmethod
    def with_args(cls, **kwargs: Any) -> Factory:
        """A zero-arg factory building ``cls(**kwargs)`` — what a ``QConfig`` stores; chainable."""
        return Factory(cls, **kwargs)

    @classmethod
    def with_callable_args(cls, **kwargs: Any) -> Factory:
        """A factory passing ``name=fn()`` for each ``name=fn``, evaluated at every call (``Factory``)."""
        return Factory(cls).with_callable_args(**kwargs)


class AbstractObserverError(TypeError, NotImplementedError):
    """Raised on constructing an abstract observer: a ``TypeError`` as torch.ao's abstract
    ``ObserverBase`` raises, and a ``NotImplementedError`` as the seeds document."""


def saved_eps(eps: Any, prefix: str, owner: str) -> tuple[float, str]:
    """A checkpoint's ``eps`` (torch.ao's ``(1,)`` buffer, lowbit's too): ``(value, "")``, or ``(nan, message)``
    naming the key when it is not one positive finite float32 value."""
    v = float(eps.reshape(-1)[0]) if isinstance(eps, torch.Tensor) and eps.numel() == 1 else float("nan")
    if not _F32_TINY <= v <= _F32_MAX:
        return v, (f"{prefix}eps: expected one positive finite float32 value (torch.ao's eps buffer), got {eps!r} "
                   f"({owner})")
    return v, ""


class ObserverBase(FxLeaf, abc.ABC, WithArgs, nn.Module):
    """Abstract observer: ``forward(x) -> x`` plus ``calculate_qparams() -> (scale, zero_point)``.

    Abstract as in torch.ao: ``ObserverBase()`` itself (or a subclass missing either method) raises
    ``AbstractObserverError`` on construction — a ``TypeError`` (torch.ao) and a
    ``NotImplementedError`` (the seeds: "its calculate_qparams raises NotImplementedError").

    ``ch_axis`` is kept only for per-channel schemes (``None`` otherwise). Subclasses register
    their statistics as buffers; a buffer whose shape changes (scalar seed → ``(C,)``) is adopted
    from a ``state_dict`` on load, so a calibrated checkpoint loads into a fresh observer.

    ``eps`` (the scale's floor, ``scale = max(range / steps, eps)``) is a Python float, saved in
    ``state_dict`` under torch.ao's key ``eps`` as a ``(1,)`` tensor (``_saves_eps``; observers that
    derive no scale — fixed, placeholder, recording — save none, as torch.ao's). It is float64, so
    the float round-trips exactly (torch.ao's buffer is float32; its ``load_state_dict`` casts), and
    the state carries torch.ao's observer version 3, so torch.ao's loader adopts it rather than
    resetting it to its default as for a version-1 checkpoint. Loading adopts a saved ``eps``; a
    checkpoint without one (lowbit's before session 36) keeps the observer's own.
    """

    _saves_eps = True  # class attribute: whether state_dict carries eps (torch.ao's eps buffer)
    _version = 3  # torch.ao's observer state version: eps saved, per-channel buffers named min_val / max_val

    def __new__(cls, *args: Any, **kwargs: Any) -> ObserverBase:
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise AbstractObserverError(f"Can't instantiate abstract observer class {cls.__name__}: it does not "
                                        f"implement {', '.join(missing)}; use a concrete observer "
                                        "(MinMaxObserver, HistogramObserver, ...)")
        return super().__new__(cls)

    def __init__(
        self,
        qscheme: QScheme | str = QScheme.PER_TENSOR_AFFINE,
        qdtype: QDtype | str = "quint8",
        ch_axis: int | None = None,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.qscheme = as_qscheme(qscheme)
        self.qdtype = as_qdtype(qdtype)
        if self.qscheme.is_symmetric:  # (a signed grid without 0 has no code for the pinned zero point)
            symmetric_zero_point(self.qdtype, type(self).__name__)
        if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and _F32_TINY <= eps <= _F32_MAX):
            raise ValueError(f"{type(self).__name__}: eps={eps!r} must be a positive float, finite and > 0 in float32")
        self.eps = float(eps)
        if ch_axis is not None and (not isinstance(ch_axis, int) or isinstance(ch_axis, bool)):
            raise TypeError(f"{type(self).__name__}: ch_axis={ch_axis!r} must be an int or None")
        self.ch_axis = ch_axis if self.qscheme.is_per_channel else None

    @property
    def quant_min(self) -> int:
        return self.qdtype.quant_min

    @property
    def quant_max(self) -> int:
        return self.qdtype.quant_max

    @property
    def is_calibrated(self) -> bool:
        """Whether ``calculate_qparams()`` has data to work from."""
        return True

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fold ``x`` into the statistics; return ``x`` unchanged."""

    @abc.abstractmethod
    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` from the statistics."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """As ``nn.Module``'s, with ``eps`` first as torch.ao's observers order it: ``tensor([eps])``."""
        if self._saves_eps:
            device = next((b.device for b in self._buffers.values() if b is not None), torch.device("cpu"))
            dtype = torch.float32 if device.type == "mps" else torch.float64  # (mps has no float64)
            destination[prefix + "eps"] = torch.tensor([self.eps], dtype=dtype, device=device)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _state_errors(self, state_dict, prefix, local_metadata):  # type: ignore[no-untyped-def]
        """The problems of the incoming state (pure: ``state_check.guard_loading`` runs it on a whole checkpoint
        first): NaN ranges, bad histograms / qparams, a bad ``eps``, ranges of mismatched or per-channel shape."""
        errors = check_quantized_state(self, state_dict, prefix)  # NaN ranges, bad histograms / qparams
        eps = state_dict.get(prefix + "eps")
        if eps is not None and not getattr(eps, "is_meta", False) and saved_eps(eps, prefix, type(self).__name__)[1]:
            errors.append(saved_eps(eps, prefix, type(self).__name__)[1])
        lo, hi = state_dict.get(prefix + "min_val"), state_dict.get(prefix + "max_val")
        if "min_val" in self._buffers and isinstance(lo, torch.Tensor) and isinstance(hi, torch.Tensor):
            if self.qscheme.is_per_channel and lo.numel() == 0 and hi.numel() == 0:
                # torch.ao's per-channel observers start from empty (0,) ranges: "nothing observed", lowbit's ±inf seed
                # (adopted as (0,), calculate_qparams returned empty qparams and the next batch was refused)
                state_dict[prefix + "min_val"] = lo = torch.tensor(float("inf"), dtype=lo.dtype)
                state_dict[prefix + "max_val"] = hi = torch.tensor(float("-inf"), dtype=hi.dtype)
            if lo.shape != hi.shape:
                errors.append(f"{prefix}min_val shape {tuple(lo.shape)} != {prefix}max_val shape {tuple(hi.shape)} "
                              f"({type(self).__name__})")
            elif not self.qscheme.is_per_channel and lo.numel() != 1:
                errors.append(f"{prefix}min_val: a per-tensor observer keeps one range, got shape {tuple(lo.shape)} "
                              f"({type(self).__name__}, {self.qscheme.value})")
            elif self.qscheme.is_per_channel and lo.dim() > 1:  # (a (C,) range per channel, or the unsized 0-d seed)
                errors.append(f"{prefix}min_val: a per-channel observer keeps a (C,) range, got shape "
                              f"{tuple(lo.shape)} ({type(self).__name__}, {self.qscheme.value})")
            elif not errors:
                errors += _range_errors(self, lo, hi, prefix)
        return errors

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # type: ignore[no-untyped-def]
        errors = self._state_errors(state_dict, prefix, local_metadata)
        eps = state_dict.pop(prefix + "eps", None)  # torch.ao keeps eps as a buffer, lowbit as a float: adopt it
        if errors:
            error_msgs.extend(errors)
            return
        if eps is not None and not getattr(eps, "is_meta", False):  # (a meta eps has no value: ours stays)
            v = saved_eps(eps, prefix, type(self).__name__)[0]
            if v != float(torch.tensor(self.eps, dtype=eps.dtype if eps.is_floating_point() else torch.float64)):
                self.eps = v  # (a torch.ao float32 eps equal to ours keeps the exact Python float, e.g. 1e-8)
        for name, buf in list(self._buffers.items()):
            saved = state_dict.get(prefix + name)
            if buf is not None and isinstance(saved, torch.Tensor) and saved.shape != buf.shape:
                self._buffers[name] = torch.empty_like(saved, device=buf.device, dtype=buf.dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        axis = f", ch_axis={self.ch_axis}" if self.ch_axis is not None else ""
        return f"qscheme={self.qscheme.value}, qdtype={self.qdtype!r}{axis}"


def _range_errors(observer: nn.Module, lo: torch.Tensor, hi: torch.Tensor, prefix: str) -> list[str]:
    """A saved range no observer writes (hostile51): a finite ``min_val > max_val`` (the min/max fake quants' step
    read it as a grid: a loaded ``(5, 1)`` fake-quantized every later batch onto ``[0, ~1]``), or a per-channel
    observer given one finite range (a per-tensor checkpoint: its ``()`` range was taken as the unsized seed and
    the per-channel model converted with one grid for every channel). Seeds (``+inf`` / ``-inf``) pass."""
    if lo.is_meta or hi.is_meta or lo.numel() == 0:
        return []
    name = f"{type(observer).__name__}, {observer.qscheme.value}"
    lo_d, hi_d = lo.detach(), hi.detach()
    if observer.qscheme.is_per_channel and lo.dim() == 0 and bool(torch.isfinite(lo_d).item()):
        return [f"{prefix}min_val={lo_d.item():.6g}: a per-channel observer keeps a (C,) range, got one finite "
                f"range of shape () (a per-tensor checkpoint?) ({name})"]
    bad = torch.isfinite(lo_d) & torch.isfinite(hi_d) & (lo_d > hi_d)
    if bool(bad.any().item()):
        i = int(bad.reshape(-1).nonzero()[0].item())
        where = "" if lo.dim() == 0 else f" (channel {i})"
        return [f"{prefix}min_val={lo_d.reshape(-1)[i].item():.6g} exceeds {prefix}max_val="
                f"{hi_d.reshape(-1)[i].item():.6g}{where}: no observed range ({name})"]
    return []


_warned_nonfinite: set[str] = set()


MAX_BINS = 2**24


def check_bins(bins: object, owner: str, least: int) -> int:
    """``bins`` of a histogram observer: an int in ``[least, 2**24]`` (its buffers are allocated at once and its
    range search holds ~30 copies: a huge count exhausted memory at the first batch, not here), else a clear error.

    >>> from lowbit.observer.base import check_bins
    >>> check_bins(2048, "HistogramObserver", 2)
    2048
    """
    if isinstance(bins, bool) or not isinstance(bins, int):
        raise TypeError(f"{owner}: bins={bins!r} must be an int >= {least}")
    if not least <= bins <= MAX_BINS:
        big = f"; memory grows ~128 bytes a bin: ~{128 * bins / 2**30:.3g} GiB here" if bins > MAX_BINS else ""
        raise ValueError(f"{owner}: bins={bins!r} must be an int >= {least} and <= 2**24{big}")
    return bins


def check_observed(x: object, owner: str, observer: nn.Module | None = None) -> torch.Tensor:
    """``x`` if it is a floating-point tensor, else ``TypeError`` naming ``owner`` (what every observer's
    ``forward`` accepts); ``RuntimeError`` for a meta tensor, or an ``observer`` whose statistics are on the
    meta device (no values to read or fold: torch's error came from deep inside, ``Tensor.item()``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner} observes tensors, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{owner} observes floating-point tensors, got dtype {x.dtype}")
    if x.is_meta:
        raise RuntimeError(f"{owner} observes values, got a tensor on the meta device (shape {tuple(x.shape)}, no "
                           "values); calibrate with real data on cpu / cuda")
    if observer is not None and any(b is not None and b.is_meta for b in observer._buffers.values()):
        raise RuntimeError(f"{owner}: its statistics are on the meta device (moved with .to('meta')) and hold no "
                           "values to fold a batch into; build a fresh observer, or .to_empty(device=...) then "
                           "reset_min_max_vals()")
    return x


def refuse_meta(observer: nn.Module) -> None:
    """``RuntimeError`` naming ``observer`` when its statistics were moved to the meta device (``.to("meta")``):
    ``is_calibrated`` / ``calculate_qparams`` read their values, and torch answered "Tensor.item() cannot be called on
    meta tensors" from inside the observer."""
    if any(b is not None and b.is_meta for b in observer._buffers.values()):
        raise RuntimeError(f"{type(observer).__name__}: its statistics are on the meta device (moved with "
                           ".to('meta')) and hold no values to compute a grid from; calibrate a fresh observer on "
                           "cpu / cuda, or load_state_dict real statistics after .to_empty(device=...)")


def finite_aminmax(x: torch.Tensor, owner: str, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aminmax`` of ``x`` ignoring NaN and ±Inf (warning once per observer type).

    The fast path is one ``aminmax``; only when its result is not finite is ``x`` masked and
    reduced again. With ``dim``, reduces along ``dim`` (per channel). A tensor with no finite
    value yields ``(+inf, -inf)``, i.e. "nothing observed".
    """
    x = x.detach()
    if not x.is_floating_point():
        raise TypeError(f"{owner} observes floating-point tensors, got dtype {x.dtype}")
    if x.numel() == 0:
        # nothing to observe: the "nothing observed" seed, shaped like the reduction's result
        shape: tuple[int, ...] = ()
        if dim is not None:
            d = dim % x.dim()
            shape = tuple(x.shape[:d]) + tuple(x.shape[d + 1:])
        return (torch.full(shape, float("inf"), device=x.device), torch.full(shape, float("-inf"), device=x.device))
    x = x.to(torch.float32)
    if tracing():  # the masked form, no data-dependent branch (the same values on finite data; no warning)
        finite = torch.isfinite(x)
        lo, hi = torch.where(finite, x, float("inf")), torch.where(finite, x, float("-inf"))
        return (lo.amin(), hi.amax()) if dim is None else (lo.amin(dim), hi.amax(dim))
    # amin + amax: torch.aminmax(dim=...) is ~20x slower on CPU (measured at 2048x1536)
    mn, mx = torch.aminmax(x) if dim is None else (x.amin(dim), x.amax(dim))
    if bool(torch.isfinite(mn).all() & torch.isfinite(mx).all()):
        return mn, mx
    if owner not in _warned_nonfinite:
        _warned_nonfinite.add(owner)
        warnings.warn(f"{owner}: observed data contains NaN or Inf; those values are ignored", stacklevel=3)
    finite = torch.isfinite(x)
    lo, hi = torch.where(finite, x, float("inf")), torch.where(finite, x, float("-inf"))
    return (lo.amin(), hi.amax()) if dim is None else (lo.amin(dim), hi.amax(dim))
