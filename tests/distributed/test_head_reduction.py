"""distributed.reduce_pooled / gather_heads across 3 real gloo processes: pooling each rank's head slice and
reducing once equals pooling all heads in one process, for every pooling."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from macs_kernels.core import shards as distributed

RANKS, HEADS, LAYERS, ROWS, N = 3, 9, 4, 2, 11
POOL = {"max": lambda x: x.amax(1), "min": lambda x: x.amin(1), "mean": lambda x: x.mean(1)}


def _worker(rank: int, init_file: str, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS)
    try:
        rows = torch.rand(LAYERS, HEADS, ROWS, N, generator=torch.Generator().manual_seed(5))
        local = HEADS // RANKS
        shards = distributed.HeadShards(group=dist.group.WORLD, size=RANKS, rank=rank, heads=HEADS, kv_heads=3)
        mine = rows[:, shards.head_offset: shards.head_offset + local]
        out = {}
        for pooling, pool in POOL.items():
            pooled = pool(mine).contiguous()
            out[pooling] = (distributed.reduce_pooled(pooled, shards, pooling), pool(rows))
        out["gathered"] = (distributed.gather_heads(mine, shards, dim=1), rows)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_one_reduction_pools_over_every_rank(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "init"), results), nprocs=RANKS, join=True)
        results = dict(results)
    assert sorted(results) == list(range(RANKS))
    for rank in range(RANKS):
        for name, (got, want) in results[rank].items():
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"rank {rank}, {name}")


def test_no_shards_is_a_no_op():
    pooled = torch.rand(3, 4)
    assert distributed.reduce_pooled(pooled.clone(), None, "max").equal(pooled)
    assert distributed.gather_heads(pooled, None, dim=0) is pooled


def test_unsupported_sharding_is_refused():
    class Model:
        _tp_plan = {"model.layers.*.self_attn": "sequence_parallel"}

    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        distributed.head_shards(Model(), {})
