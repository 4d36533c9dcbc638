"""Every collective the engine issues, behind one door: `from .collectives import ...`.

- group.py: `CommGroup` (a process group and its backend's facts, fixed once), `Pending`, hybrid groups;
- ops.py: the data collectives (all-gather, reduce-scatter, all-to-all, all-reduce, broadcast), staged
  through the communication device ([Note: staging], [Note: composed collectives]);
- agree.py: agreement among ranks (a failure on one rank raises on all of them), small objects.
"""

from .agree import (
    agreement,
    all_agree,
    barrier,
    broadcast_object,
    digest_of,
    failed_ranks,
    first_to_differ,
    gather_objects,
    raise_if_any_failed,
)
from .group import (
    BulkCollectives,
    CommGroup,
    Pending,
    bound_device,
    comm_device,
    host_side_group,
    hybrid_groups,
    issue_after,
)
from .ops import (
    GatheredFlags,
    GatheredInts,
    all_gather_into,
    all_gather_rows,
    all_reduce_,
    all_to_all_into,
    all_to_all_uneven,
    broadcast_,
    broadcast_tensors,
    issue_flags_gather,
    issue_ints_gather,
    max_ints,
    max_scalar_,
    reduce_scatter_into,
    sum_scalars,
)

__all__ = [
    "BulkCollectives",
    "CommGroup",
    "Pending",
    "agreement",
    "all_agree",
    "digest_of",
    "first_to_differ",
    "all_gather_into",
    "all_gather_rows",
    "all_reduce_",
    "all_to_all_into",
    "all_to_all_uneven",
    "barrier",
    "bound_device",
    "broadcast_",
    "broadcast_object",
    "broadcast_tensors",
    "comm_device",
    "failed_ranks",
    "GatheredFlags",
    "GatheredInts",
    "issue_flags_gather",
    "issue_ints_gather",
    "gather_objects",
    "host_side_group",
    "hybrid_groups",
    "issue_after",
    "max_ints",
    "max_scalar_",
    "raise_if_any_failed",
    "reduce_scatter_into",
    "sum_scalars",
]
