"""The collectives under ``observer.distributed``'s policy (its module docstring; split from it): whether a group
spans several ranks, the group an observer reduces over and its pending flag, the per-observer handshake
(``agree_observer``: the ranks compare a fingerprint of the observer's type and settings), and the tensor reductions
the observers' ``sync_statistics`` use::

    all_reduce_min_max: (MIN_r lo[r], MAX_r hi[r])      all_reduce_mean: mean_r t[r]      all_reduce_sum: SUM_r t[r]

Each returns a new tensor (the input is not modified), agrees on per-channel shapes first (a rank whose per-channel
observer saw no data holds the scalar ``+-inf`` seed, expanded to the channel count the other ranks report) and is a
no-op copy on one process. ``lowbit.observer.distributed`` re-exports every name here.

>>> import torch
>>> all_reduce_sum(torch.tensor([1.0, 2.0]))  # single process: nothing to exchange
tensor([1., 2.])
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .ddp import overwritten

__all__ = ["is_distributed", "all_reduce_min_max", "all_reduce_mean", "all_reduce_sum", "local_statistics",
           "remember_group", "pending_sync", "agree_observer", "describe_observer", "broadcast_first"]

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


def _check_group(fn: str, group: object) -> None:
    """``None`` (WORLD) or a ``ProcessGroup``: anything else was kept and failed deep in a later collective."""
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{fn}: group={group!r} must be None (the default group) or a torch.distributed ProcessGroup "
                        "(dist.new_group(...))")


def remember_group(observer: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Record ``group`` (``None``: WORLD) as the one ``observer``'s later lazy reductions use (``sync_statistics``
    calls it). Anything but ``None`` or a ``ProcessGroup`` is refused (hostile51: ``sync_statistics(group="x")``
    was kept on one process and failed in the first collective of a distributed run)."""
    _check_group(f"{type(observer).__name__}.sync_statistics", group)
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
