"""Observers under ``DistributedDataParallel``: the statistics stay each rank's own until the merge (DESIGN §5).

``DistributedDataParallel(broadcast_buffers=True)`` (DDP's default) copies rank 0's buffers onto every rank
before each forward. For an observer's statistics that is wrong: rank ``r``'s batches are overwritten at its next
step (only its last batch survives), and the merge at ``convert`` sums what every rank holds, so a histogram
counts rank 0's data once per rank::

    hist_r = hist_0(steps 1 .. n-1) + own batch n           # every rank r, after n DDP steps
    merged = SUM_r hist_r = W * hist_0(1 .. n-1) + SUM_r own_r(n)

Two measures:

- ``keep_statistics_local(model)`` (``prepare`` / ``prepare_qat`` / ``prepare_fx`` / ``prepare_qat_fx`` call it on
  the model they return) lists the statistics buffers of every histogram observer (Histogram, Percentile, MSE,
  Entropy: the merges that sum) in the model's ``_ddp_params_and_buffers_to_ignore`` (DDP's own opt-out list, read
  when DDP wraps that model), so DDP leaves them alone and the merge holds every rank's data once (until then each
  rank fake-quantizes on its own histogram's grid). A str there is one name; ``convert`` / ``convert_fx`` drop the
  names it added (``drop_removed``: the observers are gone) and keep the user's. ``FakeQuantize`` ``scale`` /
  ``zero_point`` are still broadcast (a frozen grid follows rank 0), and so are the min/max family's statistics:
  their merge (MIN / MAX, mean) counts nothing twice, and following rank 0 is torch.ao's behaviour under DDP.
- Elsewhere (DDP around a parent of the prepared model, or ``prepare(..., inplace=True)`` on a submodule), the
  overwrite is detected: ``note_forward`` keeps a private copy (not a buffer: DDP cannot see it) of the histogram
  as the observer's last forward left it, and a mismatch at the next forward marks the observer. At the
  merge the marks travel in ``agree_observer``'s gather (no extra collective); histogram observers then adopt rank
  0's statistics (rank 0's data once, not ``W`` times: the statistics DDP made every rank follow) and every rank
  warns naming ``broadcast_buffers``.

Nothing here runs on a single process (``note_forward`` returns at once).

>>> import torch, lowbit as Q
>>> m = Q.prepare(Q.QuantWrapper(torch.nn.Linear(2, 2)), Q.get_default_qconfig())
>>> sorted(n for n in m._ddp_params_and_buffers_to_ignore if n.startswith("quant."))[:3]
['quant.activation_post_process._reduced_histogram', 'quant.activation_post_process._reduced_range', \
'quant.activation_post_process.histogram']
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["drop_removed", "keep_statistics_local", "note_forward", "overwritten", "forget", "warn_overwritten"]

_IGNORE = "_ddp_params_and_buffers_to_ignore"  # DDP's attribute (DistributedDataParallel.__init__ reads it)
_ADDED = "_lowbit_ddp_ignored"  # the names keep_statistics_local added (drop_removed drops them once gone)


def _summed(mod: nn.Module) -> bool:
    """A cross-rank observer whose merge sums (a histogram): the ones DDP's broadcast makes count rank 0 W times."""
    return callable(getattr(mod, "sync_statistics", None)) and isinstance(getattr(mod, "histogram", None), torch.Tensor)


def _user_list(model: nn.Module, where: str) -> list[str]:
    """``model._ddp_params_and_buffers_to_ignore`` as a list of names: a str is one name (DDP's ``set(...)`` of it
    would be its characters), None / absent an empty list; anything else but an iterable of str is a TypeError."""
    old = getattr(model, _IGNORE, None)
    if old is None:
        return []
    if isinstance(old, str):
        return [old]
    try:
        names = list(old)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{where}: {type(model).__name__}.{_IGNORE} must be a str or an iterable of str (parameter / "
                        f"buffer names), got {old!r}")
    return names


def keep_statistics_local(model: nn.Module) -> nn.Module:
    """Add the statistics buffers of every histogram observer in ``model`` (cross-rank observers whose merge sums)
    to ``model._ddp_params_and_buffers_to_ignore``, keeping names already there (a str there is one name);
    returns ``model``. The names added are noted (``_lowbit_ddp_ignored``) for ``drop_removed``.

    >>> m = torch.nn.Linear(2, 2)
    >>> m._ddp_params_and_buffers_to_ignore = "bias"  # one name, not the characters b, i, a, s
    >>> keep_statistics_local(m)._ddp_params_and_buffers_to_ignore
    ['bias']
    """
    _check_module(model, "keep_statistics_local")
    old = _user_list(model, "keep_statistics_local")
    names = [f"{path}.{b}" if path else b for path, mod in model.named_modules() if _summed(mod)
             for b, _ in mod.named_buffers(recurse=False)]
    stale = set(model.__dict__.get(_ADDED, ())) - set(names)  # added by an earlier call, gone (moved, renamed)
    if stale:
        old = [n for n in old if n not in stale]
    if names or stale or isinstance(getattr(model, _IGNORE, None), str):
        setattr(model, _IGNORE, old + [n for n in names if n not in old])
    if names or stale:
        added = (set(model.__dict__.get(_ADDED, ())) - stale) | {n for n in names if n not in old}
        model.__dict__[_ADDED] = sorted(added)
    return model


def _check_module(model: object, where: str, what: str = "model") -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: {what} must be an nn.Module, got {type(model).__name__}")


def drop_removed(model: nn.Module, source: nn.Module | None = None) -> nn.Module:
    """After ``convert``: ``model``'s ``_ddp_params_and_buffers_to_ignore`` (``source``'s where given: a copy that
    lost it, as a ``GraphModule`` copy does) without the names ``keep_statistics_local`` added whose buffer is gone
    (the observers ``convert`` removed); the user's own names stay. The lists ``keep_statistics_local`` put on
    submodules (a part prepared on its own, the ``module`` of a ``DistributedDataParallel`` converted whole) are
    cleaned the same way, each on its own names. Returns ``model``.

    >>> import lowbit as Q
    >>> p = Q.prepare(Q.QuantWrapper(torch.nn.Linear(2, 2)), Q.get_default_qconfig())
    >>> p._ddp_params_and_buffers_to_ignore.append("module.bias")
    >>> _ = p(torch.randn(4, 2))
    >>> Q.convert(p)._ddp_params_and_buffers_to_ignore
    ['module.bias']
    """
    _check_module(model, "drop_removed")
    if source is not None:
        _check_module(source, "drop_removed", "source")
    src = model if source is None else source
    if getattr(src, _IGNORE, None) is not None:
        _drop(model, src)
    for mod in model.modules():
        if mod is not model and mod.__dict__.get(_ADDED) and getattr(mod, _IGNORE, None) is not None:
            _drop(mod, mod)
    return model


def _drop(model: nn.Module, src: nn.Module) -> None:
    """``drop_removed`` for one list: ``src``'s names on ``model`` without the added ones whose buffer is gone."""
    names = _user_list(src, "convert")
    added = set(src.__dict__.get(_ADDED, ()))
    alive = {n for n, _ in model.named_buffers(remove_duplicate=False)} | {
        n for n, _ in model.named_parameters(remove_duplicate=False)}
    setattr(model, _IGNORE, [n for n in names if n not in added or n in alive])
    model.__dict__[_ADDED] = sorted(added & alive)


def note_forward(observer: nn.Module, before: bool) -> None:
    """Call at the start (``before=True``) and end of a histogram observer's ``forward`` under ``torch.distributed``:
    at the start compare the histogram with the copy the last forward left (a difference marks the observer: someone,
    e.g. DDP's buffer broadcast, overwrote it; a moved range rebins it), at the end keep a copy. Device ops only (no
    host read); a bins-sized copy and comparison per forward (``(C, bins)`` per channel)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    d = observer.__dict__
    hist = observer.histogram.detach()
    if not before:
        d["_ddp_left"] = hist.clone()
        return
    left = d.get("_ddp_left")
    if left is None:
        return
    if left.shape == hist.shape and left.device == hist.device:
        changed = (hist != left).any()
    else:  # a resize (per-channel seed -> (C,)) or a move between forwards
        changed = torch.tensor(True, device=hist.device)
    mark = d.get("_ddp_overwritten")
    d["_ddp_overwritten"] = changed if mark is None else mark.to(changed.device) | changed


def overwritten(observer: nn.Module) -> bool:
    """Whether ``note_forward`` saw the statistics overwritten between two forwards (a host read)."""
    mark = observer.__dict__.get("_ddp_overwritten")
    return bool(mark) if mark is not None else False


def forget(observer: nn.Module) -> None:
    """Drop the copy and the mark (after a merge, a reset or a load: the statistics were set on purpose)."""
    observer.__dict__.pop("_ddp_left", None)
    observer.__dict__.pop("_ddp_overwritten", None)


def warn_overwritten(observer: nn.Module, ranks: list[int]) -> None:
    """The warning every rank gives when ``ranks`` saw the observer's statistics overwritten between forwards."""
    what = "the merged statistics are rank 0's alone (summing would count rank 0's data once per rank)"
    warnings.warn(f"{type(observer).__name__}: its statistics were overwritten between forwards on rank(s) {ranks}: "
                  "DistributedDataParallel(broadcast_buffers=True) copies rank 0's buffers to every rank at each "
                  f"forward; {what}. Wrap the model that prepare / prepare_qat / prepare_fx returned (its histogram "
                  "statistics are kept out of DDP's broadcast) or pass broadcast_buffers=False "
                  "(forward_sync_buffers=False does not stop the first copy) to merge every rank's data", stacklevel=3)
