"""Cross-rank reduction of observer statistics (DESIGN §5).

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

The helpers below are no-ops on a single process, return new tensors (inputs are not modified),
and agree on per-channel shapes first: a rank whose per-channel observer saw no data still holds
the scalar ``±inf`` seed, which is expanded to the channel count the other ranks report.

>>> import torch
>>> from lowbit.observer.distributed import all_reduce_min_max, is_distributed
>>> is_distributed()
False
>>> all_reduce_min_max(torch.tensor(-1.0), torch.tensor(2.0))
(tensor(-1.), tensor(2.))
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .ddp import overwritten

__all__ = ["is_distributed", "all_reduce_min_max", "all_reduce_mean", "all_reduce_sum", "sync_observers",
           "local_statistics", "sync_pending", "remember_group", "pending_sync", "agree_observer",
           "describe_observer", "agree_structure", "broadcast_first"]

_LOCAL = threading.local()


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``torch.distributed`` is available, initialised, and spans more than one rank
    (and the caller is not inside a ``local_statistics()`` block)."""
    if getattr(_LOCAL, "depth", 0):
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


@contextmanager
def local_statistics() -> Iterator[None]:
    """Inside this block (this thread) observers never reduce across ranks: qparams come from local statistics.

    For statistics that are already the union, such as those of a weight: parameters are replicated on
    every rank, so ``convert`` computes weight qparams in this block — converting on one rank alone runs
    no collective for its weights, and activation observers follow the policy above.

    >>> with local_statistics():
    ...     is_distributed()
    False
    """
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


class _Group:
    """The process group an observer was last reduced over: no state (a ``deepcopy`` shares it, a pickle drops it to
    WORLD: a group lives in one process)."""

    __slots__ = ("group",)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, object]) -> _Group:
        return self

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return _Group, (None,)


def remember_group(observer: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Record ``group`` (``None``: WORLD) as the one ``observer``'s later lazy reductions use (``sync_statistics``
    calls it)."""
    observer.__dict__["_sync_group"] = _Group(group)


def _group_of(observer: nn.Module) -> dist.ProcessGroup | None:
    ref = observer.__dict__.get("_sync_group")
    return None if ref is None else ref.group


def pending_sync(observer: nn.Module) -> None:
    """``calculate_qparams``' lazy reduction: ``observer.sync_statistics(group)`` if it saw data since its last
    reduction and its group spans more than one rank; the group is the one it was last reduced over
    (``sync_observers(model, group)``), WORLD if none was given (it was WORLD whatever the caller had given)."""
    if observer._needs_sync:
        group = _group_of(observer)
        if is_distributed(group):
            observer.sync_statistics(group)


def _per_rank(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """``values`` of every rank of ``group`` (one small ``all_gather``), indexed by group rank."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [p.tolist() for p in parts]


def describe_observer(observer: nn.Module) -> str:
    """The observer's type and every setting its reduction and qparams depend on (what ``agree_observer`` compares):
    ``qscheme``, ``qdtype`` (with its range), ``ch_axis``, ``eps`` and the names in its class's ``_sync_settings``."""
    qd = getattr(observer, "qdtype", None)
    parts = [f"qscheme={getattr(getattr(observer, 'qscheme', None), 'value', None)}",
             f"qdtype={qd!r}" + (f" [{qd.quant_min}, {qd.quant_max}]" if qd is not None else ""),
             f"ch_axis={getattr(observer, 'ch_axis', None)}", f"eps={getattr(observer, 'eps', None)!r}"]
    parts += [f"{k}={getattr(observer, k, None)!r}" for k in getattr(observer, "_sync_settings", ())]
    return f"{type(observer).__name__}({', '.join(parts)})"


def agree_observer(observer: nn.Module, group: dist.ProcessGroup | None = None) -> list[int]:
    """Raise ``ValueError`` on every rank unless every rank of ``group`` holds the same observer here (a collective);
    return the group ranks whose statistics were overwritten between forwards (``observer.ddp.overwritten``: DDP's
    buffer broadcast), the same list on every rank.

    ``sync_statistics`` calls it first: one ``all_gather`` of a fingerprint of ``describe_observer`` (and the
    overwrite mark), the same size whatever the observer, so ranks reach it in step even when their observers differ;
    on a mismatch a second gather collects the descriptions for the message. Single process: nothing to compare.
    """
    if not is_distributed(group):
        return []
    mine = describe_observer(observer)
    buf = next(iter(observer.buffers()), None)
    device = buf.device if buf is not None else torch.device("cpu")
    codes = _per_rank([zlib.crc32(mine.encode()), int(overwritten(observer))], group, device)
    if any(c[0] != codes[0][0] for c in codes):
        every: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        listed = "; ".join(f"rank {r}: {d}" for r, d in enumerate(every))
        raise ValueError(f"{type(observer).__name__}: ranks hold different observers at this place ({listed}); every "
                         "rank must build the same observer with the same settings (the same qconfig) to reduce "
                         "statistics across ranks")
    return [r for r, c in enumerate(codes) if c[1]]


def broadcast_first(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``t`` of the group's rank 0 on every rank (a collective; a copy; every rank passes the same shape)."""
    out = t.clone().contiguous()
    if is_distributed(group):
        dist.broadcast(out, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return out


def _agree_shape(t: torch.Tensor, owner: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Expand a 0-d seed to the ``(C,)`` the other ranks hold; raise on a real mismatch (on every rank).

    A 0-d statistic is a seed (nothing observed: ``±inf``) or a per-tensor one (finite); only a seed may take
    the channel count of the ranks holding ``(C,)`` statistics. The error names each rank's shape.
    """
    if t.dim() > 1:
        raise ValueError(f"{owner}: can only reduce 0-d or (C,) statistics, got shape {tuple(t.shape)}")
    size = t.numel() if t.dim() == 1 else 0                     # 0 = "no channel count yet"
    scalar_data = int(t.dim() == 0 and bool(torch.isfinite(t)))
    ranks = _per_rank([size, scalar_data], group, t.device)
    counts = {c for c, _ in ranks if c}
    if not counts:                                              # every rank holds a scalar
        return t
    if len(counts) > 1 or any(d for _, d in ranks):
        shapes = ", ".join(f"rank {r}: " + (f"{c} channels" if c else "per-tensor" if d else "no data")
                           for r, (c, d) in enumerate(ranks))
        raise ValueError(f"{owner}: ranks hold statistics of different shapes ({shapes}); every rank must hold the "
                         "same observer (per-tensor or per-channel with the same channel count) at this place")
    largest = counts.pop()
    return t.expand(largest) if size == 0 else t


def all_reduce_min_max(
    min_val: torch.Tensor, max_val: torch.Tensor, group: dist.ProcessGroup | None = None, owner: str = "observer"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise ``(MIN_r min_val, MAX_r max_val)`` over the ranks, in two small collectives.

    ``±inf`` (nothing observed on a rank) is the identity of the reduction, so ranks without data
    simply adopt the others' range. Single process: returns the inputs.
    """
    if not is_distributed(group):
        return min_val, max_val
    min_val, max_val = _agree_shape(min_val, owner, group), _agree_shape(max_val, owner, group)
    packed = torch.stack([min_val, -max_val]).to(torch.float32).contiguous()   # (2,) or (2, C)
    dist.all_reduce(packed, op=dist.ReduceOp.MIN, group=group)
    return packed[0].to(min_val.dtype), (-packed[1]).to(max_val.dtype)


def all_reduce_mean(t: torch.Tensor, group: dist.ProcessGroup | None = None, owner: str = "observer") -> torch.Tensor:
    """Elementwise mean over the ranks of the **finite** entries of ``t``.

    A rank holding ``±inf`` (an averaging observer that saw no data) does not drag the mean to
    infinity; an entry no rank has data for keeps its local value. Single process: returns ``t``.
    """
    if not is_distributed(group):
        return t
    t = _agree_shape(t, owner, group)
    finite = torch.isfinite(t)
    packed = torch.stack([torch.where(finite, t, 0.0), finite.to(t.dtype)]).to(torch.float64).contiguous()
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    total, count = packed[0], packed[1]
    return torch.where(count > 0, total / count.clamp(min=1), t.to(torch.float64)).to(t.dtype)


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None, owner: str = "observer") -> torch.Tensor:
    """Elementwise sum over the ranks (e.g. histograms already rebinned onto a common range).

    The ranks first agree on the shape: tensors of different shapes (histograms of different ``bins``) are a
    ``ValueError`` on every rank naming each rank's shape (gloo aborted the process on the size mismatch).
    """
    if not is_distributed(group):
        return t
    if t.dim() > 4:  # (statistics are 0-d, (C,), (bins,) or (C, bins))
        raise ValueError(f"{owner}: can only reduce statistics of up to 4 dimensions, got shape {tuple(t.shape)}")
    ranks = _per_rank([t.dim(), *t.shape, *[0] * (4 - t.dim())], group, t.device)
    if any(r != ranks[0] for r in ranks):
        shapes = ", ".join(f"rank {i}: {tuple(r[1:1 + r[0]])}" for i, r in enumerate(ranks))
        raise ValueError(f"{owner}: ranks hold statistics of different shapes ({shapes}), e.g. histograms of "
                         "different bins; every rank must hold the same observer at this place")
    out = t.clone().contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


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


def _check_group(fn: str, group: object) -> None:
    """``None`` (WORLD) or a ``ProcessGroup``: anything else was kept and failed deep in a later collective."""
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{fn}: group={group!r} must be None (the default group) or a torch.distributed ProcessGroup "
                        "(dist.new_group(...))")


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
