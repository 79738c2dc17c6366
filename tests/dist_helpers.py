"""Helpers shared by the distributed tests (not a test module): N gloo ranks in spawned processes.

The ranks meet through a ``FileStore`` (what ``init_method="file://..."`` builds) in a fresh temporary
directory, so no TCP port is picked: a ``free_port()`` released and then bound again by the master races
with every other process on the machine (a rank that loses dies with SIGABRT at fixture setup).
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_gloo = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")

_STORE: dist.Store | None = None


def rank_store() -> dist.Store:
    """The store this rank joined the group through (for ``set``/``wait`` outside any collective)."""
    if _STORE is None:
        raise RuntimeError("rank_store() is for a worker started by run_ranks")
    return _STORE


def _entry(rank: int, fn: Callable[..., Any], world: int, tmp: str, pg_timeout_s: float, args: tuple) -> None:
    global _STORE
    _STORE = dist.FileStore(os.path.join(tmp, "rendezvous"), world)
    dist.init_process_group("gloo", store=_STORE, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    torch.set_num_threads(1)
    result = fn(rank, *args)
    torch.save(result, os.path.join(tmp, f"rank{rank}.part"))
    os.replace(os.path.join(tmp, f"rank{rank}.part"), os.path.join(tmp, f"rank{rank}.pt"))  # (whole or absent)
    dist.barrier()                      # no rank leaves the group while another is still in a collective
    dist.destroy_process_group()


def _preload() -> None:
    """What the forkserver imports before it forks any rank (it starts at the first ``run_ranks``; set before)."""
    import multiprocessing.forkserver as fs

    fs.set_forkserver_preload(["torch", "torch.distributed", "lowbit", "dist_helpers"])


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, pg_timeout_s: float = 60,
              timeout_s: float = 300) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world`` spawned ranks of one gloo group; return what each rank returned.

    ``fn`` must be a module-level function (spawn pickles it by name) and its result picklable with
    ``torch.save``. A collective that a rank never joins fails after ``pg_timeout_s``; the whole run after
    ``timeout_s``. A failing rank fails the test with its rank, exit code or signal, and traceback.
    """
    with tempfile.TemporaryDirectory(prefix="lowbit-gloo-") as tmp:
        # not fork: a parent whose OpenMP pool already ran (earlier tests) deadlocks forked children. forkserver: the
        # ranks fork from a clean server process that ran nothing but the imports below (started once per session,
        # each rank still a new process with its own memory), so each rank no longer pays its own torch + lowbit
        # import as a spawned one did (~4 s of CPU per rank, 2 ranks x 16 run_ranks calls in the suite)
        _preload()
        ctx = mp.start_processes(_entry, args=(fn, world, tmp, pg_timeout_s, args), nprocs=world, join=False,
                                 start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    codes = {r: p.exitcode for r, p in enumerate(ctx.processes) if not p.is_alive()}
                    pytest.fail(f"{fn.__name__}: rank(s) {alive} still running after timeout_s={timeout_s} "
                                f"(a collective hung?); finished ranks' exit codes: {codes}", pytrace=False)
        except mp.ProcessExitedException as e:
            saved = all(os.path.exists(os.path.join(tmp, f"rank{r}.pt")) for r in range(world))
            if not (saved and e.signal_name == "SIGABRT"):
                how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
                pytest.fail(f"{fn.__name__}: rank {e.error_index} (pid {e.error_pid}) died with {how}", pytrace=False)
            # every rank had saved its result, so the abort came after the work (barrier / gloo's teardown / exit):
            # the results stand. Session 34 saw rank 0 die with SIGABRT ("terminate called without an active
            # exception") in 2 of 57 runs of this file (one a fresh-clone CI run) and in 1 of 18 at session 33's head,
            # never since, so where it aborts was not pinned down; an abort before the saves still fails the test
            sys.stderr.write(f"run_ranks: {fn.__name__}: rank {e.error_index} aborted after saving its result\n")
        except mp.ProcessRaisedException as e:
            pytest.fail(f"{fn.__name__}: rank {e.error_index} (pid {e.error_pid}) raised (exit code 1):{e.msg}",
                        pytrace=False)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def error_of(fn: Callable[[], Any]) -> str:
    """``"ExcType: message"`` of the ``ValueError`` / ``RuntimeError`` ``fn()`` raises, or ``"no error"`` (a rank's
    outcome, picklable back to the test)."""
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
