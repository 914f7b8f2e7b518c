"""Tensor parallelism: each rank holds a slice of the attention heads, MACS pools over all of them.

transformers' `tp_plan` shards q/k/v projections by output rows ("colwise", `Shard(0)` on a one-dimensional
tensor-parallel device mesh) and the output projection by input columns ("rowwise", `Shard(1)`), so rank r of a
group of size tp computes query heads [r*H/tp, (r+1)*H/tp) and KV heads [r*H_kv/tp, (r+1)*H_kv/tp) and nothing
else. Everything MACS does per head (the softmax row, redistribution, efficient attention's projection) is then
local; only the pooling over heads crosses ranks. The pooled rows of a whole forward pass, (L, rows, N) before
the floor, are reduced in ONE collective per pass: max/min pool with MAX/MIN, mean pool with SUM of the local
means weighted by the local head count (equal on every rank), divided by the rank count.

The group is read from the model's own weights (their DTensor device mesh), never from a global flag: a model
that is not sharded, or whose attention weights are replicated, needs no reduction.
"""
from __future__ import annotations

import dataclasses

import torch

_REDUCE_OPS = {"max": "MAX", "min": "MIN", "mean": "SUM"}
_QKV = ("q_proj", "k_proj", "v_proj")
_OUTPUT = "o_proj"
_SINKS = "sinks"


@dataclasses.dataclass(frozen=True)
class HeadShards:
    """How the attention heads are split over a tensor-parallel group (even splits only)."""

    group: object  # torch.distributed.ProcessGroup
    size: int
    rank: int
    heads: int
    kv_heads: int

    @property
    def local_heads(self) -> int:
        return self.heads // self.size

    @property
    def head_offset(self) -> int:
        """Global index of this rank's first query head."""
        return self.rank * self.local_heads


def _placements(weight):
    from torch.distributed.tensor import DTensor

    return (weight.device_mesh, tuple(weight.placements)) if isinstance(weight, DTensor) else None


def head_shards(model, modules: dict[int, torch.nn.Module]) -> HeadShards | None:
    """The tensor-parallel split of the attention heads of `modules` (one attention module per layer), None when
    every rank holds every head; a clear error for shardings MACS cannot follow."""
    plan = getattr(model, "_tp_plan", None) or {}
    if any(style == "sequence_parallel" for style in plan.values()):
        raise NotImplementedError(
            "this model's tp_plan uses sequence_parallel: each rank then sees only part of the sequence, and "
            "MACS needs every key of a row; use a plan that shards heads only (colwise q/k/v, rowwise o_proj)"
        )
    layouts = set()
    for layer, module in modules.items():
        sharded = {
            name: _placements(param) for name, param in module.named_parameters(recurse=True)
            if _placements(param) is not None
        }
        if not sharded:
            layouts.add(None)
            continue
        from torch.distributed.tensor import Replicate, Shard

        if all(placements == (Replicate(),) for _, placements in sharded.values()):
            layouts.add(None)
            continue
        # Per-head sink logits (gpt-oss) split with their heads: each rank's attention sees its own heads' sinks.
        expected = {f"{name}.weight": Shard(0) for name in _QKV} | {f"{_OUTPUT}.weight": Shard(1), _SINKS: Shard(0)}
        for name, (mesh, placements) in sharded.items():
            if name.endswith(".bias") and name.split(".")[0] in _QKV and placements == (Shard(0),):
                continue
            if name.endswith(".bias") and placements == (Replicate(),):
                continue
            if mesh.ndim != 1 or placements != (expected.get(name),):
                raise NotImplementedError(
                    f"layer {layer}: parameter {name} is sharded as {placements} on a {mesh.ndim}-D mesh; MACS "
                    "follows tensor parallelism only when q/k/v projections (and sinks) are split by heads (colwise) "
                    "and o_proj by its inputs (rowwise) on one tensor-parallel mesh"
                )
        mesh = sharded[f"{_QKV[0]}.weight"][0]
        layouts.add((mesh.get_group(), mesh.size(), mesh.get_local_rank()))
    if len(layouts) != 1:
        raise NotImplementedError("attention layers are sharded differently from one another; MACS cannot pool them")
    layout = layouts.pop()
    if layout is None:
        return None
    group, size, rank = layout
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise NotImplementedError(
            f"{heads} query heads and {kv_heads} KV heads do not split evenly over {size} tensor-parallel ranks; "
            "MACS needs whole heads on every rank"
        )
    return HeadShards(group=group, size=size, rank=rank, heads=heads, kv_heads=kv_heads)


def reduce_pooled(pooled: torch.Tensor, shards: HeadShards | None, pooling: str) -> torch.Tensor:
    """Pool over every rank's heads, in place: `pooled` (..., N) holds each rank's pooling over its own heads.

    One all-reduce whatever the shape, so the caller hands over a whole pass's (L, rows, N) at once.
    """
    if shards is None:
        return pooled
    import torch.distributed as dist

    dist.all_reduce(pooled, op=getattr(dist.ReduceOp, _REDUCE_OPS[pooling]), group=shards.group)
    if pooling == "mean":
        pooled.div_(shards.size)
    return pooled


def gather_heads(local: torch.Tensor, shards: HeadShards | None, dim: int) -> torch.Tensor:
    """Every rank's per-head tensor concatenated in global head order along `dim` (rank r's heads come r-th)."""
    if shards is None:
        return local
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(shards.size)]
    dist.all_gather(parts, local.contiguous(), group=shards.group)
    return torch.cat(parts, dim=dim)
