"""[Note: buffer reuse]: freed buffers of recurring sizes are handed to the next buffer of that size,
bounded, and the storages keep their identity (views and saved tensors follow the memory)."""

from __future__ import annotations

import pytest
import torch

from hf_zero.engine.pool import BufferPool
from tests import _lifecycle_cases as lifecycle_cases


def test_release_and_fill_keep_storage_identity_and_views():
    pool = BufferPool({64}, per_size=1)
    t = torch.arange(16, dtype=torch.float32)
    view = t[4:8].view(2, 2)
    storage = t.untyped_storage()
    pool.release(storage)
    assert storage.nbytes() == 0 and pool.pooled_bytes == 64
    pool.fill(storage, 64)
    assert storage.nbytes() == 64 and pool.pooled_bytes == 0 and pool.reused == 1 and pool.allocated == 0
    t.copy_(torch.full((16,), 7.0))
    assert view.tolist() == [[7.0, 7.0], [7.0, 7.0]]  # the view sees the memory that came back


def test_pool_is_bounded_and_skips_sizes_that_do_not_recur():
    pool = BufferPool({64}, per_size=2)
    held = [torch.empty(16) for _ in range(3)]
    odd = torch.empty(5)
    for t in held + [odd]:
        pool.release(t.untyped_storage())
    assert pool.pooled_bytes == 2 * 64  # the third 64-byte buffer and the 20-byte one were freed
    assert all(t.untyped_storage().nbytes() == 0 for t in held + [odd])
    fresh = pool.new_tensor(16, torch.float32, torch.device("cpu"))
    assert fresh.shape == (16,) and pool.reused == 1
    pool.clear()
    assert pool.pooled_bytes == 0
    pool.fill(held[0].untyped_storage(), 64)
    assert pool.allocated == 1


def test_fill_refuses_a_storage_that_holds_memory():
    pool = BufferPool({64}, per_size=1)
    import pytest

    with pytest.raises(RuntimeError, match="BufferPool.fill on a storage that holds 64 bytes"):
        pool.fill(torch.empty(16).untyped_storage(), 64)


# ZeroConfig fields, and the buffers each block fills per iteration: two gathers and an unsharded
# gradient; with int8 weight gathers, each gather's received blocks and scales too; with a bf16 reduction,
# the gradient's bf16 cast and the reduced shard.
POOLED = {
    "exact": ((), 3),
    "int8 weights, bf16 reduction": ((("quantized_weights", True), ("reduce_dtype", "bf16")), 2 * 3 + 3),
}


@pytest.mark.parametrize("case", sorted(POOLED))
def test_stage3_training_reuses_buffers(pools, case):
    """Per steady-state iteration, the fresh allocations stop growing with the number of blocks (6 and
    10 blocks allocate alike): each further block's gathers and gradient buffers reuse freed memory.
    The pool is empty between iterations."""
    options, per_block = POOLED[case]
    small, mid, deep = (pools(2).values(lifecycle_cases.pool_counts_per_iteration, n, options)[0] for n in (2, 6, 10))
    assert deep["allocated"] == mid["allocated"] <= small["allocated"] + 2 * per_block // 3, (small, mid, deep)
    assert deep["reused"] - mid["reused"] == 4 * per_block, (mid, deep)  # 4 more blocks
    assert mid["reused"] > mid["allocated"], mid
    assert small["pooled_after"] == mid["pooled_after"] == deep["pooled_after"] == 0
