"""Row-sparse gradients of embedding lookups.

[Note: sparse lookup gradients]
The gradient of an `nn.Embedding` lookup is non-zero only in the rows of the tokens the batch
holds: 64 tokens touch 64 of a 32000-word vocabulary. Autograd's dense form of it is a full
vocabulary x hidden matrix (125 MiB for 32000 x 1024 in fp32), which ZeRO then reduce-scatters
whole. A unit that is a plain lookup (`UnitSpec.backward_reads_params` is False) runs its forward
with the module's own `sparse=True` switch on, so autograd hands the engine a sparse COO gradient
instead (indices and one value row per token), and the reduction exchanges rows: every rank
gathers every rank's coalesced `(row, values)` pairs and adds those that fall into its shard.
Neither the dense gradient nor its collective exists: at the end of the backward pass, when
every other gradient shard is already held, that is the largest transient of an LLM's step.

When the rows would cost more than the dense collective (a batch with more distinct tokens per
rank than about half the vocabulary over the group size), or when some rank got a dense
gradient (a forward that bypassed the module, or a user who set `sparse` themselves), every
rank densifies and takes the dense path; the ranks agree on that in one small all-reduce.
The row exchange needs the agreed row count on the host, so a lookup unit's reduction costs one
host sync per backward pass, at its end.

Either way each rank's rows of one token are summed in float32 and rounded once to the gradient's dtype
(`summed`), and autograd hands the sparse gradient over also where a kept buffer exists (stages 0-1): under bf16
mixed precision the two paths, and every stage, give the same gradient, the one an accelerator's embedding
backward gives (torch on the CPU sums in bf16, where a token a batch holds a thousand times stalls).
"""

from __future__ import annotations

import torch


def summed(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sparse COO gradient with the rows of each token summed in float32 at least, then rounded once to `dtype`
    (the part's gradient dtype): a token a bf16 batch holds a thousand times would otherwise stall at 256 times one
    row's size (1000 rows of 0.01 summed in bf16 give 4.0). An accelerator's dense embedding backward sums so too,
    so the row exchange and the dense path ([Note: sparse lookup gradients]) give each rank the same gradient.

    Example:

    ```python
    >>> g = torch.sparse_coo_tensor([[0] * 1000], torch.full((1000, 1), 0.01, dtype=torch.bfloat16), (2, 1))
    >>> summed(g, torch.bfloat16).values().item()
    10.0
    ```
    """
    wide = torch.promote_types(grad.dtype, torch.float32)
    return grad.to(wide).coalesce().to(dtype)


def coalesced_rows(
    grad: torch.Tensor | None, dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows, values)` of a sparse COO gradient of a `(num_rows, dim)` weight: duplicates summed,
    values cast to `dtype`. An absent gradient gives no rows.

    Example:

    ```python
    >>> g = torch.sparse_coo_tensor([[3, 1, 3]], torch.ones(3, 2), (5, 2))
    >>> rows, values = coalesced_rows(g, 2, torch.float32)
    >>> rows.tolist(), values.tolist()
    ([1, 3], [[1.0, 1.0], [2.0, 2.0]])
    ```
    """
    if grad is None:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dim, dtype=dtype, device=device)
    grad = grad.coalesce()
    return grad.indices()[0], grad.values().to(dtype).reshape(-1, dim)


def scatter_rows_(out: torch.Tensor, start: int, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Add `values[i]` into row `rows[i]` of a row-major `(num_rows, dim)` matrix of which `out` holds
    the flat elements `[start, start + out.numel())`; entries outside that range (and padding rows
    of -1) are skipped. Rows cut by either end of the range add their part. No host sync.

    Example:

    ```python
    >>> out = torch.zeros(3)  # elements 1..3 of a (2, 2) matrix: the end of row 0 and row 1
    >>> scatter_rows_(out, 1, torch.tensor([0, 1, -1]), torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]))
    tensor([2., 3., 4.])
    ```
    """
    dim = values.shape[1]
    end = start + out.numel()
    first, last = -(-start // dim), end // dim  # the rows lying wholly inside the range
    if last > first:
        body = out[first * dim - start : last * dim - start].view(-1, dim)
        local = rows - first
        inside = (local >= 0) & (local < body.shape[0])
        masked = torch.where(inside.unsqueeze(1), values, torch.zeros((), dtype=values.dtype, device=values.device))
        body.index_add_(0, torch.where(inside, local, torch.zeros_like(local)), masked)
    cut = {start // dim} if start % dim else set()
    if end % dim:
        cut.add(end // dim)
    for row in sorted(cut):  # at most the two rows that straddle the range's ends
        lo, hi = max(start, row * dim), min(end, (row + 1) * dim)
        if lo >= hi:
            continue
        picked = torch.where(
            (rows == row).unsqueeze(1), values, torch.zeros((), dtype=values.dtype, device=values.device)
        )
        out[lo - start : hi - start] += picked.sum(0)[lo - row * dim : hi - row * dim]
    return out
