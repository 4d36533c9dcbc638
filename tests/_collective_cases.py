"""Worker-side checks of hf_zero.engine.collectives (run in the gloo pools)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hf_zero.engine.collectives import CommGroup, all_gather_into, reduce_scatter_into


def bulk_collectives(dtype_name: str, shard_numel: int) -> dict[str, Any]:
    """All-gathers and reduce-scatters through both implementations, three of each in flight at
    once and waited in reverse order; returns what each produced (rank 0's and this rank's view)."""
    dtype = getattr(torch, dtype_name)
    world = CommGroup.world()
    groups = {"native": world.using("native"), "composed": world.using("composed")}
    rank, size = world.rank, world.size
    gen = torch.Generator().manual_seed(100 + rank)
    shards = [torch.randn(shard_numel, generator=gen).to(dtype) for _ in range(3)]
    fulls = [torch.randn(size * shard_numel, generator=gen).to(dtype) for _ in range(3)]
    originals = [f.clone() for f in fulls]  # the composed reduce-scatter consumes its input
    out: dict[str, Any] = {"auto_is_composed": world.using("auto").composed}
    for name, group in groups.items():
        gathered = [torch.full((size * shard_numel,), float("nan"), dtype=dtype) for _ in shards]
        reduced = [torch.full((shard_numel,), float("nan"), dtype=dtype) for _ in fulls]
        pending = [all_gather_into(g, s, group, async_op=True) for g, s in zip(gathered, shards)]
        inputs = [f.clone() for f in originals]
        pending += [reduce_scatter_into(r, f, group, async_op=True) for r, f in zip(reduced, inputs)]
        # with a free buffer to receive into (the composed one then exchanges chunks all-to-all)
        received = [torch.full((size * shard_numel,), float("nan"), dtype=dtype) for _ in fulls]
        reduced_scratch = [torch.full((shard_numel,), float("nan"), dtype=dtype) for _ in fulls]
        pending += [reduce_scatter_into(r, f.clone(), group, async_op=True, scratch=x)
                    for r, f, x in zip(reduced_scratch, originals, received)]
        for p in reversed(pending):
            p.wait()
        # in place: this rank's shard already sits in its chunk of the output
        in_place = torch.zeros(size * shard_numel, dtype=dtype)
        own = in_place.view(size, -1)[rank]
        own.copy_(shards[0])
        all_gather_into(in_place, own, group).wait()
        out[name] = {
            "gathered": [g.float() for g in gathered],
            "in_place": in_place.float(),
            "reduced": [r.float() for r in reduced],
            "reduced_scratch": [r.float() for r in reduced_scratch],
        }
    # the exact expectations: every rank's shards, and the sums of every rank's chunks
    every_shard = [None] * size
    dist.all_gather_object(every_shard, shards)
    every_full = [None] * size
    dist.all_gather_object(every_full, originals)
    out["expected_gathered"] = [torch.cat([every_shard[r][i] for r in range(size)]).float() for i in range(3)]
    out["expected_reduced"] = [
        torch.stack([every_full[r][i].double().view(size, -1)[rank] for r in range(size)]).sum(0).float() for i in range(3)
    ]
    return out
