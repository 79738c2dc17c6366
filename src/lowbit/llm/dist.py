"""Calibration statistics over several ranks, equal to one process's bit for bit.

Rank ``r`` of ``W`` holds the global calibration batches ``r, r + W, r + 2W, ...`` (a strided shard;
``shard(calib, rank, world)`` cuts one). A statistic that one process sums over batches,
``H = ((0 + H_0) + H_1) + ...``, is reproduced exactly by gathering the per-batch terms of every rank
and summing them in the global order — not by ``all_reduce``, whose float sums associate differently.
The terms are small (``K x K`` per batch), so the gather costs little next to the forward passes.

>>> import torch
>>> ordered_sum([torch.ones(2), torch.full((2,), 2.0)])   # one process: a plain ordered sum
tensor([3., 3.])
>>> shard(list(range(5)), 1, 2)
[1, 3]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..observer.distributed import is_distributed

__all__ = ["shard", "ordered_gather", "ordered_sum", "broadcast_tensors", "rank_and_world", "agree_calibration"]


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` without an initialised multi-rank process group."""
    if not is_distributed(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard(batches: Sequence[Any], rank: int, world: int) -> list[Any]:
    """The strided shard ``batches[rank::world]`` that rank ``rank`` of ``world`` calibrates on."""
    if isinstance(rank, bool) or isinstance(world, bool) or not (
            isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"lowbit.llm.shard: rank={rank!r} must be in [0, world={world!r})")
    return list(batches)[rank::world]


def agree_calibration(fn: str, check: Callable[[], list[Any]], group: Any = None) -> list[Any]:
    """``check()`` — this rank's validation of its calibration batches, returning them — then, on several ranks, one
    small ``all_gather`` before any other collective: every rank raises when any rank's batches were refused (that
    rank its own error), when a rank has none, or when the counts differ. A rank that raised alone left the others
    waiting in the first statistic's collective until the group's timeout.

    >>> agree_calibration("f", lambda: [1, 2])          # one process: check() as it is
    [1, 2]
    """
    if not is_distributed(group):
        return check()
    error: Exception | None = None
    try:
        batches = check()
    except (TypeError, ValueError) as e:
        error, batches = e, []
    mine = torch.tensor([len(batches), int(error is not None)], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    counts, failed = [int(p[0]) for p in parts], [r for r, p in enumerate(parts) if int(p[1])]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"{fn}: the calibration batches of rank(s) {failed} were refused (the error is raised on "
                         "that rank); every rank stops here")
    if min(counts) == 0 or len(set(counts)) > 1:
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(f"{fn}: every rank needs the same, non-zero number of calibration batches ({listed}); "
                         "give each rank lowbit.llm.shard(calib, rank, world) of a multiple of world batches")
    return batches


def ordered_gather(local: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """Every rank's per-batch tensors in global batch order (local list unchanged on one process)."""
    if not is_distributed(group):
        return list(local)
    world = dist.get_world_size(group)
    n = torch.tensor([len(local), -len(local)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    if int(n[0]) != -int(n[1]):
        raise ValueError(f"lowbit.llm: ranks hold different numbers of calibration batches (max {int(n[0])}, "
                         f"min {-int(n[1])}); give every rank the same count (lowbit.llm.shard of a multiple of W)")
    if not local:
        return []
    stacked = torch.stack(local).contiguous()
    outs = [torch.empty_like(stacked) for _ in range(world)]
    dist.all_gather(outs, stacked, group=group)
    return [outs[i % world][i // world] for i in range(len(local) * world)]


def ordered_sum(local: list[torch.Tensor], group: Any = None) -> torch.Tensor:
    """``((0 + t_0) + t_1) + ...`` over the global batch order of every rank's per-batch terms."""
    terms = ordered_gather(local, group)
    if not terms:
        raise ValueError("lowbit.llm: calibration yielded no batches")
    total = torch.zeros_like(terms[0])
    for t in terms:
        total += t
    return total


def broadcast_tensors(tensors: list[torch.Tensor], src: int, group: Any = None) -> list[torch.Tensor]:
    """``tensors`` of rank ``src`` on every rank (in place; shapes and dtypes must already agree)."""
    if is_distributed(group):
        for t in tensors:
            dist.broadcast(t, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return tensors
