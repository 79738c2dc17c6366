"""Distributed block-by-block GPTQ + AWQ (``lowbit.quantize_llm``): 2 gloo processes, each calibrating a
strided half of the batches, give codes, scales and zero points bit-identical to one process on all
batches (Hessians and AWQ samples gathered and summed in the global batch order; group ``j`` quantized
on rank ``j % 2`` and broadcast). A small random Llama (2 blocks, grouped-query attention, tied head)."""

import pytest
import torch
from dist_helpers import needs_gloo, run_ranks

pytest.importorskip("transformers")
pytestmark = needs_gloo
WORLD, BATCHES = 2, 4


def calib():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (1, 48), generator=g) for _ in range(BATCHES)]


def quantize(batches):
    import lowbit as Q
    model = Q.llm.toy_llama(layers=2, hidden=64)
    qm = Q.quantize_llm(model, batches, bits=4, group_size=32, progress=False)
    return {k: v.clone() for k, v in qm.state_dict().items()}


def worker(rank):
    from lowbit.llm import shard
    return quantize(shard(calib(), rank, WORLD))


def test_two_ranks_give_the_one_process_codes_bit_exactly():
    ranks = run_ranks(worker, world=WORLD, pg_timeout_s=60)
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
