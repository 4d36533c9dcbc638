"""`CallOrder`: the engine's calls that every rank must make together, checked to be the same on every rank.

[Note: call order]
A sharded model's weights are spread over the ranks, so gathering them (`model.state_dict()`,
`hf_zero.full_state_dict`, `save_pretrained`), `gathered_parameters`, loads, checkpoints and, at stage 3, every
forward are collectives: every rank must make the same calls in the same order. DDP code makes some of them on one
rank only: `if rank == 0: torch.save(model.state_dict(), path)`, `if accelerator.is_main_process:
model.save_pretrained(...)`, a sample generated on rank 0 between steps. Under DDP those are local; here rank 0's
first collective met whatever the others issued next (the next step's collectives): a hang until the process
group's timeout (30 minutes on gloo), or at stage 3 gathers paired with gathers of the wrong units.

So each such call begins with a header: one all-gather of two integers per rank, what the call is and how many
calls this rank has begun, issued before the call's first collective. The header of a call made on one rank
meets the header of whatever call the others begin next (every call that issues collectives has one), so the
ranks learn that they are apart at once and raise, naming what each rank was doing and what to do instead,
instead of pairing the wrong collectives. Where a header is read:

- calls between steps (gathers, loads, checkpoints): at once (a host sync; these are not on the step's path);
- the root's forward (stages 0-2 with grad; stage 3 every forward) and each backward pass: at once on a backend
  whose collectives complete on the host (gloo: the call's own first collective waits for the other ranks
  anyway); on a device-stream backend (NCCL) at the next point the engine waits on the host anyway (the
  forward's units check, [Note: units run on some ranks] in checks/units_run.py, which the backward's first
  inner unit waits for too) or at the next header, so a step takes no extra sync.

The backward's header finds a backward skipped on some ranks (`if not torch.isfinite(loss): continue`, decided
from each rank's own loss): its reductions met the other ranks' next forward (on gloo a crash on mismatched
sizes, on NCCL a hang or reductions paired with gathers), as under DDP, which hangs there.

On NCCL the rank that made the odd call raises at once; the others raise at their next wait, or, where a
collective the odd rank never joins holds their stream (stage 3's gathers), are stopped by the launcher when the
failed rank exits. A forward without grad at stages 0-2 involves no other rank and has no header (evaluating
on rank 0 alone is as local as under DDP there), unless it broadcasts the buffers ([Note: buffer broadcast] in
buffers.py: the first forward after a training step, for a model with persistent buffers), where DDP hangs.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from ..collectives import CommGroup, GatheredInts, issue_ints_gather
from ..pass_events import PassListener

if TYPE_CHECKING:
    from ..buffers import BufferSync


class Call(enum.IntEnum):
    """The calls that begin with a header ([Note: call order])."""

    FORWARD = 1
    FORWARD_NO_GRAD = 2
    GATHER_WEIGHTS = 3
    GATHERED_PARAMETERS = 4
    LOAD_STATE_DICT = 5
    SAVE_CHECKPOINT = 6
    LOAD_CHECKPOINT = 7
    LOAD_OPTIMIZER_STATE = 8
    BACKWARD = 9
    DIRECT_CALL = 10


WHAT = {
    Call.FORWARD: "a forward with grad (training)",
    Call.FORWARD_NO_GRAD: "a forward without grad (evaluation or generate)",
    Call.GATHER_WEIGHTS: "gathering the weights (model.state_dict(), hf_zero.full_state_dict or save_pretrained)",
    Call.GATHERED_PARAMETERS: "hf_zero.gathered_parameters(...)",
    Call.LOAD_STATE_DICT: "model.load_state_dict(...)",
    Call.SAVE_CHECKPOINT: "hf_zero.save_checkpoint(...)",
    Call.LOAD_CHECKPOINT: "hf_zero.load_checkpoint(...)",
    Call.LOAD_OPTIMIZER_STATE: "optimizer.load_state_dict(...)",
    Call.BACKWARD: "a backward",
    Call.DIRECT_CALL: "a module of the model's root called outside its forward (model.lm_head(...), embeddings)",
}


class CallOrder(PassListener):
    """Issues and reads the headers of one engine's calls ([Note: call order]); owns the count of calls begun.

    Told of a pass's events ([Note: pass events] in pass_events.py), it begins the pass's own calls: a forward that
    issues collectives (with grad; every forward where the units are gathered, `gathers`, stage 3; or one that
    broadcasts the `buffers`, [Note: buffer broadcast] in buffers.py), a direct call that gathers, a backward; and
    before the units check is waited for, it reads the headers in flight first (they tell ranks apart). The calls
    between steps begin their headers through `begin`."""

    def __init__(self, group: CommGroup, gathers: bool = False, buffers: BufferSync | None = None) -> None:
        self._group = group
        self._gathers, self._buffers = gathers, buffers
        self._begun = 0
        self._pending: list[tuple[GatheredInts, Call, int]] = []  # headers issued, unread: (gather, call, count)

    def root_forward(self) -> None:
        grad = torch.is_grad_enabled()
        if grad or self._gathers or (self._buffers is not None and self._buffers.due):
            self.begin(Call.FORWARD if grad else Call.FORWARD_NO_GRAD, read_now=False)

    def direct_call(self) -> None:
        if self._gathers:  # its gather is a collective: the header goes first, read at once
            self.begin(Call.DIRECT_CALL, read_now=True)

    def backward(self) -> None:
        # a backward skipped on some ranks; left unread with the forward's, so that no host sync is added
        self.begin(Call.BACKWARD, read_now=False, keep_unread=True)

    def begin(self, call: Call, *, read_now: bool, keep_unread: bool = False) -> None:
        """Issue the header of `call`, first reading those before it. `read_now`: read it at once (between
        steps); otherwise at once only where collectives complete on the host (gloo), elsewhere (NCCL) at the next
        `read_headers`, at a point the engine waits anyway. `keep_unread`: leave the headers before it unread too (the
        backward's, so that its start adds no host sync where the forward's is still unread: at most two wait)."""
        if self._group.size == 1:
            return
        if not keep_unread:
            self.read_headers()
        self._begun += 1
        self._pending.append((issue_ints_gather([int(call), self._begun], self._group), call, self._begun))
        if read_now or not self._group.stream_ordered:
            self.read_headers()

    def before_waiting(self) -> None:
        self.read_headers()

    def read_headers(self) -> None:
        """Read the headers in flight, oldest first: raise on every rank that reads one if the ranks are apart."""
        pending, self._pending = self._pending, []
        for gathered, call, begun in pending:
            rows = gathered.values()
            if any(row != [int(call), begun] for row in rows):
                raise ValueError(_apart(rows, self._group))


def _apart(rows: list[list[int]], group: CommGroup) -> str:
    """The message for ranks found in different calls: who does what, and what to do instead."""
    by_call: dict[tuple[int, int], list[int]] = {}
    for rank, (call, begun) in enumerate(rows):
        by_call.setdefault((call, begun), []).append(group.global_rank_of(rank))
    doing = "; ".join(
        f"rank(s) {ranks} began {_what(call)} (their collective call {begun})"
        for (call, begun), ranks in sorted(by_call.items(), key=lambda item: item[1])
    )
    return (
        f"[rank {group.global_rank}] hf_zero: the ranks are in different collective calls: {doing}. Every rank must "
        "make hf_zero's collective calls together, in the same order: gathering the weights, gathered_parameters, "
        "loads and checkpoints take every rank's shard, and at ZeRO stage 3 so does every forward. Code written "
        "for DDP that does one of them on one rank only (`if rank == 0: torch.save(model.state_dict(), path)`, "
        "`if accelerator.is_main_process: model.save_pretrained(...)`, a sample generated on rank 0) must do it "
        "on every rank: `sd = model.state_dict()` on every rank, then `if rank == 0: torch.save(sd, path)` (or "
        "`with hf_zero.state_dict_options(model, rank0_only=True):` to gather to rank 0 only); save_pretrained on "
        "every rank writes once, from rank 0; at stage 3 evaluate or generate on every rank (generate keeps the "
        "ranks together with synced_gpus=True), or train at stages 1-2, where a forward without grad is local. A "
        "backward (or step) skipped on some ranks, decided from each rank's own loss, must be decided together: "
        "`skip = torch.tensor(float(not torch.isfinite(loss))); torch.distributed.all_reduce(skip)` on every rank, "
        "then skip where `skip > 0`." + (_UNEVEN if any(call == Call.FORWARD_NO_GRAD for call, _ in rows) else "")
    )


# a forward without grad among the calls apart: the usual cause at stage 3 is an evaluation loop whose ranks ran
# different numbers of batches (the extra forwards of one rank met the others' next call)
_UNEVEN = (
    " If a forward without grad is an evaluation batch, the ranks ran different numbers of them: at ZeRO stage 3 "
    "every rank must run the same number of evaluation forwards. Give each rank the same number of batches "
    "(DistributedSampler(..., drop_last=False) pads the last one, as Accelerate's even_batches=True and the "
    "Trainer's evaluation loop do; an IterableDataset split with datasets' split_dataset_by_node does not), or let "
    "a rank whose batches ran out run forwards on a batch of its own until every rank is done."
)


def _what(call: int) -> str:
    try:
        return WHAT[Call(call)]
    except ValueError:  # another version's call: named by its number
        return f"call {call}"
