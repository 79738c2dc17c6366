"""Cross-rank reduction of observer statistics (DESIGN §5): the policy, and the model-wide reductions
(``sync_observers``, ``sync_pending``, ``agree_structure``) built on ``observer.collectives``.

N ranks calibrating N shards must produce the qparams one process gets on the union. The
statistics reduce exactly for the cumulative observers and approximately for the averaging ones::

    min_val = MIN_r min_val[r],  max_val = MAX_r max_val[r]         # MinMax / PerChannelMinMax: exact
    ema     = mean_r ema[r]   (over the ranks that saw data)        # moving averages: mean of ranks
    hist    = SUM_r rebin(hist[r], common range)                    # HistogramObserver (its own module)

Policy (one rule, used by every lowbit observer that has statistics):

- Reduction is **automatic**: when ``torch.distributed`` is initialised with more than one rank,
  ``observer.calculate_qparams()`` first calls ``observer.sync_statistics()`` — a collective — if
  the observer saw data since its last reduction. Nothing is exchanged per batch. It reduces over the
  process group the observer was last reduced over (``sync_observers(model, group)``,
  ``sync_statistics(group)``), WORLD if none was given (``pending_sync``).
- A collective needs every rank: call ``calculate_qparams()`` (or ``convert``) on **every** rank,
  in the same module order — or call ``sync_observers(model)`` on every rank first, after which
  ``calculate_qparams()`` is local until the observer sees data again (so ``if rank == 0:
  convert(model)`` is safe after it). Statistics loaded from a ``state_dict`` count as reduced.
- ``convert`` follows the same rule for activation observers: it reduces the pending ones
  (``sync_pending``) before deciding whether an observer saw data, so ``convert`` on every rank
  works when a rank's shard was empty or all NaN (it adopts the others' statistics). Weight qparams
  are always local (``local_statistics()``: parameters are replicated, their statistics are the
  union already), so ``convert`` after ``sync_observers`` runs no collective at all.
- ``FakeQuantize.forward`` never reduces: QAT steps stay collective-free, so ranks may run different
  numbers of steps. Around a min/max-family observer it reads the buffers; around any other observer
  (histograms) it takes ``calculate_qparams()`` of the rank's local statistics (``local_statistics()``),
  leaving the merge pending for ``calculate_qparams()`` / ``convert`` / ``sync_observers``, which every
  rank reaches; the result is then the observer-calibration path's (until then each rank fake-quantizes
  on its own grid). DDP's buffer broadcast (``broadcast_buffers=True``) leaves the statistics of a prepared
  model alone (``observer.ddp``: the prepare functions list them in DDP's ignore list), so the merge holds every
  rank's data once; where DDP wraps another module, the overwrite is detected and the merge takes rank 0's
  statistics with a warning.
  ``FakeQuantize.calculate_qparams()`` follows the rule above.
- ``sync_observers`` and ``sync_pending`` over a model (``convert`` calls it) first compare the ordered
  module paths and observer kinds (``agree_structure``, one ``all_gather``): observers are paired by
  position, so ranks whose models differ get a ``ValueError`` on every rank naming the first differing
  path, before any statistics move; ``sync_pending`` also ORs the ranks' pending flags, so an observer
  that saw data on some ranks only is reduced on all. The lazy path (``calculate_qparams()`` of one
  observer) knows no path and compares the observer only.

Every ``sync_statistics`` starts with ``agree_observer``: the ranks compare a fingerprint of the
observer's type and settings (one small ``all_gather``), so ranks holding different observers at one
place (another class, qscheme, qdtype, ``ch_axis``, ``eps``, bins, percentile, ...) get a ``ValueError``
on every rank naming each rank's observer, instead of reducing unrelated statistics into silently
different qparams or calling different collectives (a hang until the group's timeout).

Histogram merges are not exact: one process bins rank 1's values on the edges of the range it holds
then (rank 0's range widened by rank 1's batches so far), rank 1 bins them on its own running range's
edges, and a histogram keeps counts per bin, not where the values sat inside a bin. Any merge must
re-spread bins under a within-bin model (uniform here; torch.ao's rebinning interpolates as well), so no
merge of finished histograms equals one process in rank order (measured on 3 + 5 batches of 4096 values:
bins up to 7.8 counts of 32768 apart; one process fed the same data in reverse order differs as much,
its HistogramObserver scale by 1.5e-3). Exact equality needs the ranks to agree on the range before
binning: a collective per batch, which the rule above avoids.

The helpers (``observer.collectives``, re-exported here) are no-ops on a single process, return new
tensors (inputs are not modified), and agree on per-channel shapes first: a rank whose per-channel
observer saw no data still holds the scalar ``±inf`` seed, which is expanded to the channel count the other ranks report.

>>> import torch
>>> from lowbit.observer.distributed import all_reduce_min_max, is_distributed
>>> is_distributed()
False
>>> all_reduce_min_max(torch.tensor(-1.0), torch.tensor(2.0))
(tensor(-1.), tensor(2.))
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .collectives import _LOCAL  # noqa: F401  (re-exported: local_statistics' depth, read by tests)
from .collectives import (_check_group, _group_of, _per_rank, agree_observer, all_reduce_mean, all_reduce_min_max,
                          all_reduce_sum, broadcast_first, describe_observer, is_distributed, local_statistics,
                          pending_sync, remember_group)

__all__ = ["is_distributed", "all_reduce_min_max", "all_reduce_mean", "all_reduce_sum", "sync_observers",
           "local_statistics", "sync_pending", "remember_group", "pending_sync", "agree_observer",
           "describe_observer", "agree_structure", "broadcast_first"]


def sync_observers(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Reduce the statistics of every observer in ``model`` across ranks; return how many.

    Call it on **every** rank after calibration (a collective per observer, in ``model.modules()``
    order, which is the same on every rank). Afterwards each rank holds the union statistics and
    ``calculate_qparams``/``convert`` run locally, e.g. on rank 0 only.

    >>> import torch, lowbit as Q
    >>> model = torch.nn.Sequential(Q.MinMaxObserver(), Q.PerChannelMinMaxObserver())
    >>> sync_observers(model)        # single process: nothing to exchange, nothing changes
    2
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"sync_observers: model must be an nn.Module, got {type(model).__name__}")
    _check_group("sync_observers", group)
    entries = [(name, mod) for name, mod in model.named_modules() if callable(getattr(mod, "sync_statistics", None))]
    if is_distributed(group):
        agree_structure(entries, group)
    for name, mod in entries:
        _named(mod.sync_statistics, name, group)
    return len(entries)


def agree_structure(entries: list[tuple[str, nn.Module]], group: dist.ProcessGroup | None = None,
                    pending: list[bool] | None = None) -> list[bool] | None:
    """Raise ``ValueError`` on every rank unless every rank of ``group`` lists the same observers (a collective).

    ``entries`` are ``(module path, observer)`` in the order the ranks will reduce them. The ranks compare a
    fingerprint of the ordered paths and observer class names (one small ``all_gather``) before any statistics
    move: observers are paired by position, so ranks whose models differ merged the statistics of unrelated
    observers silently, or (one observer more on a rank) hung. On a mismatch a second gather collects the lists,
    and the message names the first position where they differ, with each rank's path and observer there.
    ``pending`` (one flag per entry: this rank's observer saw data since its last reduction): returns the flags
    OR-ed over the ranks (one more small collective), the observers some rank must reduce; ``None`` without it.

    >>> import lowbit as Q
    >>> agree_structure([("fc", Q.MinMaxObserver())])       # single process: nothing to compare
    >>> agree_structure([("fc", Q.MinMaxObserver())], pending=[True])
    [True]
    """
    _check_group("agree_structure", group)
    if not isinstance(entries, (list, tuple)) or not all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], nn.Module)
            for e in entries):
        raise TypeError(f"agree_structure: entries must be a list of (module path, observer module) pairs, got "
                        f"{type(entries).__name__} {str(entries)[:60]}")
    if not is_distributed(group):
        return None if pending is None else list(pending)
    mine = [f"{name!r} ({type(mod).__name__})" for name, mod in entries]
    buf = next((b for _, mod in entries for b in mod.buffers()), None)
    device = buf.device if buf is not None else torch.device("cpu")
    codes = _per_rank([zlib.crc32("\n".join(mine).encode()), len(mine)], group, device)
    if all(c == codes[0] for c in codes):
        if pending is None or not entries:
            return None if pending is None else []
        union = torch.tensor([int(p) for p in pending], dtype=torch.int64, device=device)
        dist.all_reduce(union, op=dist.ReduceOp.MAX, group=group)
        return [bool(v) for v in union.tolist()]
    every: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(every, mine, group=group)
    k = next((i for i in range(max(map(len, every))) if len({tuple(e[i:i + 1]) for e in every}) > 1), 0)
    listed = "; ".join(f"rank {r}: {e[k] if k < len(e) else '<none>'}" for r, e in enumerate(every))
    raise ValueError(f"ranks hold different observers (their models differ): observer #{k} is {listed}; "
                     f"observer counts {[len(e) for e in every]}; every rank must hold the same model (the same "
                     "observers at the same module paths, in the same order) to reduce statistics across ranks")


def _named(sync: Callable[..., None], name: str, group: dist.ProcessGroup | None) -> None:
    """``sync(group)``; a ``ValueError`` (raised on every rank alike) gains the observer's module path."""
    try:
        sync(group)
    except ValueError as e:
        raise ValueError(f"observer {name or '<model>'!r}: {e}") from e


def sync_pending(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Reduce the observers in ``module`` that saw data since their last reduction on **any** rank — a collective
    under the same rule as ``calculate_qparams()`` (every rank, same order) and a no-op where that is local (one
    process, after ``sync_observers``, in ``local_statistics()``). ``group=None``: each observer's own group, as
    ``calculate_qparams`` (``pending_sync``).

    Over a model (more than one observer) the ranks first agree on every observer's path and kind and OR their
    pending flags (``agree_structure``), so an observer that saw data on some ranks only (a mixture-of-experts
    expert) is reduced on every rank, the others contributing what they hold (nothing new), instead of one rank
    waiting alone in its collective. A rank with **nothing** pending runs no collective (so rank 0 may convert
    alone after ``sync_observers``): when it converts with its peers, a peer whose observers saw data since the
    last ``sync_observers`` / ``load_state_dict`` waits for it in vain; call ``sync_observers(model)`` on every rank
    there (it reduces every observer, pending or not).
    ``convert`` calls it before asking whether an observer saw any data, so a rank whose shard was empty (or
    all NaN) adopts the others' statistics instead of raising alone and leaving its peers waiting in the
    collective.

    >>> import lowbit as Q
    >>> sync_pending(Q.MinMaxObserver())     # single process: nothing to do
    """
    _check_group("sync_pending", group)
    if not isinstance(module, nn.Module):  # (one process returned here silently; several failed in named_modules)
        raise TypeError(f"sync_pending: module must be an nn.Module, got {type(module).__name__}")
    if not is_distributed():  # (a group spans at most WORLD)
        return
    entries = [(name, mod, _group_of(mod) if group is None else group) for name, mod in module.named_modules()
               if hasattr(mod, "_needs_sync") and callable(getattr(mod, "sync_statistics", None))]
    entries = [(name, mod, g) for name, mod, g in entries if is_distributed(g)]
    if not any(mod._needs_sync for _, mod, _ in entries):
        return
    if len(entries) == 1 and entries[0][1] in (module, getattr(module, "activation_post_process", None)):
        name, mod, g = entries[0]  # one observer, or a FakeQuantize's: agree_observer compares it, no path to compare
        _named(mod.sync_statistics, name, g)
        return
    groups: list[dist.ProcessGroup | None] = []
    for _, _, g in entries:
        if not any(g is h for h in groups):
            groups.append(g)
    todo: set[int] = set()
    for g in groups:  # the paths, kinds and pending flags first, per group
        mine = [(i, name, mod) for i, (name, mod, h) in enumerate(entries) if h is g]
        union = agree_structure([(name, mod) for _, name, mod in mine], g, [bool(mod._needs_sync) for *_, mod in mine])
        todo.update(i for (i, _, _), p in zip(mine, union or []) if p)
    for i, (name, mod, g) in enumerate(entries):
        if i in todo:
            _named(mod.sync_statistics, name, g)
