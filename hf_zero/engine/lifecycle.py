"""The states of a unit and of a training pass, and the verbs that may move them.

[Note: unit lifecycle]
A `Unit` (unit.py) owns two states and is the only code that moves them; each of its verbs begins
by checking the states it may be called in, and an illegal call raises with the rank and the unit's
name:

- `ShardState`, where its parameters are: SHARDED (only this rank's shard holds memory; the modules
  hold stand-ins), GATHERING (an all-gather into the unsharded buffer is in flight), UNSHARDED (whole
  and registered in the modules). Units of stages 0-2 are always UNSHARDED.
- `TrainingState`, where it is in the current pass: IDLE, FORWARD (between its pre- and post-forward),
  IN_BACKWARD (its backward began: gathered, `.grad` views attached), REDUCING (its backward is through:
  gradients handed to a reduction, or dropped for a frozen unit) until the pass ends.

| verb             | acts in                       | nothing to do in      | raises in                          |
|------------------|-------------------------------|-----------------------|------------------------------------|
| prefetch         | SHARDED, training IDLE        | otherwise (in use)    |                                    |
| unshard          | SHARDED, GATHERING            | UNSHARDED             | REDUCING                           |
| reshard          | GATHERING, UNSHARDED          | SHARDED, pinned       | stages 0-2; FORWARD, IN_BACKWARD   |
| begin_forward    | IDLE                          |                       | FORWARD, IN_BACKWARD, REDUCING     |
| end_forward      | FORWARD                       |                       | IDLE, IN_BACKWARD, REDUCING        |
| begin_backward   | IDLE                          | IN_BACKWARD           | FORWARD, REDUCING                  |
| attach_grads     | IN_BACKWARD                   |                       | every other training state         |
| end_backward     | IN_BACKWARD                   | REDUCING              | IDLE, FORWARD                      |
| reduce_grads     | REDUCING                      |                       | every other training state         |
| finish_reduction | REDUCING                      |                       | every other training state         |
| end_pass         | IDLE, REDUCING                |                       | FORWARD, IN_BACKWARD               |
| give_back        | IDLE (-> UNSHARDED, for good) |                       | FORWARD, IN_BACKWARD, REDUCING     |

`abandon` (an exception stopped the pass) moves any training state to IDLE, and is the only verb
that may; `settle` (the process is leaving: [Note: clean exit] in teardown.py) waits for gathers in flight
in any state and moves nothing. The state is the truth: `is_unsharded` reads it, never the storage's byte count.

[Note: lifecycle]
For each unit (the root included), in one training iteration ([Note: unit lifecycle] in
above names the states):

1. pre_forward (module forward-pre hook, hooks.py): the stage's `before_compute` (stage 3: gather), the
   forward prefetch, and, with grad mode on, the unit's tensor inputs that require grad are passed
   through `_EndOfBackward`, whose backward is the unit's end-of-backward signal ([Note: backward end]).
2. post_forward (module forward hook): `after_forward` (stage 3: free; but the last unit of a
   forward run with grad mode on stays gathered, since it is the first unit of the backward),
   and, when grad mode is on, a hook on every output tensor that requires grad: the first of
   them to receive its gradient runs pre_backward. The root's post_forward empties the buffer
   pool ([Note: buffer reuse] in pool.py).
3. pre_backward (IDLE -> IN_BACKWARD): gather again (stage 3; not for a unit whose backward reads
   no parameters, an `nn.Embedding`, which ran its forward with `sparse=True`: [Note: sparse lookup
   gradients]) and point the trainable parameters' `.grad` at the unit's unsharded gradient
   buffer. The first pre_backward of a backward pass queues the final callback on the autograd
   engine.
4. post_backward (IN_BACKWARD -> REDUCING), on the unit's end signal: detach the `.grad` views,
   issue the asynchronous reduce-scatter (unless `no_sync()` defers it, stages 0-1 or by opt-in),
   and `after_backward` (stage 3: free; frozen units too, as soon as their backward is through).
5. final callback (end of the backward pass): post_backward for every unit that began but got no
   signal (units whose inputs need no gradient: the root, the embedding), in reverse unit order on
   every rank; wait for every issued reduction, add the means into the fp32 gradient shards,
   every unit back to IDLE, empty the buffer pool. A module of the root called outside the model's forward
   ([Note: direct calls] in hooks.py) makes the root's backward end here too.

[Note: gradient states]
A part's gradients (`FlatGrads`, grads.py) have a `GradState`, the one truth its guards read, that only its own
verbs move, each checking the state it may run in (an illegal call raises with the rank and the unit's name); the
`Unit` orders the verbs. The state is a set of three facts, since a part can be in more than one at once (at
stages 2-3 a backward accumulates fresh gradients while the previous micro-step's reduction is still in flight):

- HELD: a backward's gradients are held unreduced (`.grad` views of the unsharded buffer, a lookup's sparse
  gradient);
- IN_FLIGHT: reductions are issued and not yet finished (which ones, and which buffer each reads, the part keeps
  beside the state: their objects, not a second truth);
- SUMMED: the shard holds the sum of every reduction finished since `zero_grad` (without it the shard is a lazy
  zero and may hold no memory).

EMPTY (none of them) is the state after `zero_grad`.

| verb             | moves                                         | raises                                          |
|------------------|-----------------------------------------------|-------------------------------------------------|
| attach / collect | adds HELD                                     | IN_FLIGHT, and that reduction reads the buffer  |
| reduce           | HELD -> IN_FLIGHT                              | IN_FLIGHT, and that reduction reads the buffer  |
| finish           | adds SUMMED; drops IN_FLIGHT with the last one | not IN_FLIGHT, or that reduction is not in it   |
| zero             | any -> EMPTY                                  | IN_FLIGHT                                       |

Whether the shard holds a sum (`is_zero`: SUMMED not in the state) is read from the same owner; nothing outside
grads.py writes it.

A unit's backward ends on a unit-level signal that is the same on every rank: the gradient of its
forward inputs ([Note: backward end] in hooks.py), never on which of its parameters got gradients
(data-dependent: an expert that no token of this rank reached). Beside the units, the pass
(`PassState`, owned by the hooks' `Pass`) says where the whole iteration is: IDLE, FORWARD (the
root's forward runs), BACKWARD (a backward pass runs; its final callback is queued).
"""

from __future__ import annotations

import enum


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    IN_BACKWARD = "in_backward"
    REDUCING = "reducing"


class GradState(enum.Flag):
    """[Note: gradient states] what a part's gradients hold: a set of facts, EMPTY when none."""

    EMPTY = 0
    HELD = enum.auto()
    IN_FLIGHT = enum.auto()
    SUMMED = enum.auto()

    def describe(self) -> str:
        """The facts by name, in lower case (`held+in_flight`), or `empty`."""
        return "+".join(str(fact.name).lower() for fact in GradState if fact.value and fact in self) or "empty"


class PassState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def illegal_call(rank: int, verb: str, subject: str, state: str | None = None, why: str = "") -> RuntimeError:
    """The error every state owner raises for a verb called in a state it may not be called in (a broken invariant
    of the engine, not a user's mistake): the rank, the verb, what it was called on, its state and why."""
    where = f" in state {state}" if state is not None else ""
    return RuntimeError(f"[rank {rank}] hf_zero: {verb} on {subject}{where}" + (f": {why}" if why else ""))
