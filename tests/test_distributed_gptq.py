"""Distributed block-by-block GPTQ + AWQ (``lowbit.quantize_llm``): 2 gloo processes, each calibrating a
strided half of the batches, give codes, scales and zero points bit-identical to one process on all
batches (Hessians and AWQ samples gathered and summed in the global batch order; group ``j`` quantized
on rank ``j % 2`` and broadcast). A small random Llama (2 blocks, grouped-query attention, tied head)."""

import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")
WORLD, BATCHES = 2, 4


def calib():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (1, 48), generator=g) for _ in range(BATCHES)]


def quantize(batches):
    import lowbit as Q
    model = Q.llm.toy_llama(layers=2, hidden=64)
    qm = Q.quantize_llm(model, batches, bits=4, group_size=32, progress=False)
    return {k: v.clone() for k, v in qm.state_dict().items()}


def worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    from lowbit.llm import shard
    state = quantize(shard(calib(), rank, WORLD))
    dist.barrier()
    torch.save(state, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_give_the_one_process_codes_bit_exactly(tmp_path):
    # spawn, not fork: a parent whose OpenMP pool already ran deadlocks forked children
    mp.start_processes(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = quantize(calib())
    finally:
        torch.set_num_threads(threads)
    coded = [k for k in one if k.endswith(("qweight", "scales", "zero_points"))]
    assert len(coded) >= 3 * 7 * 2  # 7 Linears per block, 2 blocks (+ the head)
    for r in ranks:
        assert r.keys() == one.keys()
        for k in one:
            assert torch.equal(r[k], one[k]), k


def test_shard_and_unequal_rank_counts_are_checked():
    from lowbit.llm import shard
    assert shard(list(range(6)), 1, 2) == [1, 3, 5]
    with pytest.raises(ValueError, match="rank=2"):
        shard([1, 2], 2, 2)
