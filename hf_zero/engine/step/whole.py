"""The whole-parameter step: optimizers whose math reads a parameter's shape or the whole tensor.

[Note: whole-parameter step]
The flat path ([Note: optimizer shards]) hands the optimizer 1-D pieces of this rank's shard. That
is exact only for elementwise optimizers: Adafactor factors a matrix's second moment by rows and
columns, Muon orthogonalizes a matrix, LARS/LAMB scale by a tensor's norm, 8-bit optimizers quantize
in blocks of the tensor. On flat pieces such an optimizer runs silently different math. So every
optimizer not known to be elementwise steps on whole parameters:

- each parameter of the optimizer is owned by one rank of the shard group, dealt largest first to
  the rank with the fewest bytes so far (as `ZeroRedundancyOptimizer` partitions); the owner's
  optimizer holds, for each parameter it owns, a tensor of the parameter's shape (its storage
  allocated only while it steps) and the state the optimizer builds for it, whole;
- the master weights stay in the flat shards, reduced, clipped and unscaled gradients in the flat
  gradient shards, exactly as on the flat path; at `step()` rank r's k-th owned parameter moves in
  round k: one all-to-all brings its master and gradient pieces from every rank to the owner, the
  owner calls the optimizer's `step()` with only that parameter's `.grad` set, and one all-to-all
  sends the new values back into every rank's master pieces. All owners step their round-k
  parameter at the same time; a rank holds at most one parameter whole in transit (its master and
  gradient), beyond the optimizer state of the parameters it owns (about 1/N of the whole).
- `step()` is therefore called once per owned parameter, and the known optimizers that couple the
  parameters (a learning-rate estimate or line search over all of them) are refused at `initialize`
  (`COUPLED`).

[Note: group state on the whole path]
Some optimizers keep state in their param groups and change it in `step()`: optimi's StableAdamW
counts steps in `group["step"]`, others set a group up at the first call (`group["setup"]`). Called
once per owned parameter, such a counter would advance as many times as the rank owns parameters. So
every call of one step starts from the group state the step began with (restored in place before each
call after the first), and after the rounds the state one call left is broadcast from the owner of
the first stepped parameter to every rank of the shard group, including ranks that owned nothing
that stepped: each rank's groups then read as after one call of an unsharded `step()`. Two calls of
the same step that leave different group states mean the group state depends on the parameters
(the coupling above): refused on every rank. The broadcast stops once a step after the first
leaves the group state as it found it (state set up once); until then it costs one small broadcast
per step.
"""

from __future__ import annotations

import copy
import heapq
from typing import Any

import torch

from ..collectives import CommGroup, all_to_all_uneven, broadcast_object, comm_device, raise_if_any_failed
from ..flat import FlatPart

# Elementwise optimizers: the flat path is exact for them. (module prefix, class name) pairs.
ELEMENTWISE: set[tuple[str, str]] = {
    *(
        ("torch.optim", name)
        for name in (
            "Adam",
            "AdamW",
            "SGD",
            "RMSprop",
            "Adagrad",
            "Adamax",
            "NAdam",
            "RAdam",
            "Adadelta",
            "ASGD",
            "Rprop",
        )
    ),
    ("lion_pytorch", "Lion"),
    *(("schedulefree", name) for name in ("AdamWScheduleFree", "SGDScheduleFree", "RAdamScheduleFree")),
}
# Optimizers whose step couples parameters: neither path can step them on shards.
COUPLED = {
    "LBFGS": "its line search and history run over all parameters as one vector",
    "Prodigy": "its learning-rate estimate d sums over all parameters",
    "DAdaptAdam": "its learning-rate estimate d sums over all parameters",
    "DAdaptSGD": "its learning-rate estimate d sums over all parameters",
    "DAdaptAdaGrad": "its learning-rate estimate d sums over all parameters",
    "DAdaptLion": "its learning-rate estimate d sums over all parameters",
}


def register_elementwise(cls: type) -> type:
    """Declare an optimizer class elementwise: each element's update reads only that element's parameter,
    gradient and state, so hf_zero steps it on flat shards ([Note: optimizer shards]), the cheaper path.
    Declaring an optimizer that reads a tensor's shape, norm or blocks makes its math silently different.

    Example:

    ```python
    >>> @hf_zero.register_elementwise
    ... class MySignSGD(torch.optim.Optimizer):
    ...     ...
    ```
    """
    ELEMENTWISE.add((cls.__module__, cls.__name__))
    return cls


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` takes the flat path (its class is a known or declared elementwise one)."""
    cls = type(optimizer)
    return any(cls.__module__.startswith(module) and cls.__name__ == name for module, name in ELEMENTWISE)


def deal(sizes: list[int], ranks: int, loads: list[int] | None = None) -> list[list[int]]:
    """Indices of `sizes` per rank, largest first to the rank with the least so far (ties: lowest rank); `loads`:
    what each rank holds already (none).

    Example:

    ```python
    >>> deal([5, 1, 3, 3], 2)
    [[0, 1], [2, 3]]
    ```
    """
    owned: list[list[int]] = [[] for _ in range(ranks)]
    load = [(0 if loads is None else loads[r], r) for r in range(ranks)]
    heapq.heapify(load)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        size, rank = heapq.heappop(load)
        owned[rank].append(i)
        heapq.heappush(load, (size + sizes[i], rank))
    return owned


class WholeStep:
    """The whole-parameter path of one optimizer on this rank ([Note: whole-parameter step])."""

    def __init__(
        self,
        slots: list[tuple[FlatPart, int]],
        group: CommGroup,
        pieces: dict[tuple[int, int], Any],
    ) -> None:
        self.slots: list[tuple[FlatPart, int]] = []  # (part, slot index) of every parameter stepped, in group order
        self.group = group
        self.pieces = pieces  # (id(part), slot index) -> this rank's Piece
        self.owned: list[list[int]] = [[] for _ in range(group.size)]
        self.rounds = 0
        self.whole: dict[int, torch.Tensor] = {}  # index in `slots` -> this rank's stand-in of an owned parameter
        self.device = comm_device(group)
        self.extend(slots)

    def extend(self, slots: list[tuple[FlatPart, int]]) -> None:
        """Take on the parameters of `slots` too (a param group added to the optimizer: [Note: param group added
        later] in optim.py), dealt to the ranks with the fewest bytes so far, after the ones taken before."""
        start = len(self.slots)
        sizes = [part.layout.slots[i].numel * part.master_dtype.itemsize for part, i in slots]
        loads = [sum(self._nbytes(i) for i in owned) for owned in self.owned]
        for owned, more in zip(self.owned, deal(sizes, self.group.size, loads)):
            owned.extend(start + i for i in more)
        self.slots += slots
        self.rounds = max((len(o) for o in self.owned), default=0)
        for i in (i for i in self.owned[self.group.rank] if i >= start):
            part, s = self.slots[i]
            t = torch.empty(part.layout.slots[s].shape, dtype=part.master_dtype, device=part.master_device)
            t.untyped_storage().resize_(0)
            self.whole[i] = t
        self._sync_groups = True  # carry the group state of a step to every rank ([Note: group state on the whole
        self._synced_steps = 0  # path]); again for a group added later

    def _nbytes(self, index: int) -> int:
        part, s = self.slots[index]
        return part.layout.slots[s].numel * part.master_dtype.itemsize

    def owned_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, stand-in) of every parameter this rank owns, in the order the optimizer holds them: what a
        checkpoint saves and loads its state by ([Note: checkpoint layout])."""
        return [(self.slots[i][0].layout.slots[self.slots[i][1]].name, self.whole[i]) for i in sorted(self.whole)]

    def stand_in(self, index: int) -> torch.Tensor | None:
        """What the optimizer holds for parameter `index` of `slots`: its whole stand-in here, or None (another
        rank owns it)."""
        return self.whole.get(index)

    def follow_master(self, part: FlatPart) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each stand-in of `part`'s parameters this rank owns, with an empty tensor in the part's master dtype and
        device to point it at (the part started training under mixed precision or offload: [Note: requires_grad
        after initialize] in unfreeze.py)."""
        moved = []
        for i, t in self.whole.items():
            if self.slots[i][0] is part:
                new = torch.empty(t.shape, dtype=part.master_dtype, device=part.master_device)
                new.untyped_storage().resize_(0)
                moved.append((t, new))
        return moved

    def _span(self, index: int, rank: int) -> tuple[int, int]:
        """Elements `[a, b)` of parameter `index` that group rank `rank`'s shard holds."""
        part, s = self.slots[index]
        slot = part.layout.slots[s]
        lo, hi = part.layout.shard_range(rank)
        a, b = max(lo - slot.offset, 0), min(hi - slot.offset, slot.numel)
        return a, max(a, b)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, used: dict[int, list[bool]]) -> None:
        """Step every parameter that got a gradient on some rank (`used`: per unit, per slot; [Note: unused
        parameters]; with a zero gradient where `zero_grad(set_to_none=False)` kept one: [Note: zero gradients kept]
        in stepping.py), each on its owner, round by round ([Note: group state on the whole path])."""
        stepped = [used[id(part)][s] for part, s in self.slots]
        before = [_group_state(g) for g in optimizer.param_groups]
        after: list[dict[str, Any]] | None = None
        coupled: list[str] = []
        for k in range(self.rounds):
            round_params = [o[k] if k < len(o) and stepped[o[k]] else None for o in self.owned]
            mine = round_params[self.group.rank]
            stand_in = self.whole[mine] if mine is not None else None
            if stand_in is not None:  # the master arrives straight into it where it lives on the comm device
                stand_in.untyped_storage().resize_(stand_in.numel() * stand_in.element_size())
            master = self._bring(round_params, "master", stand_in)
            grad = self._bring(round_params, "grad")
            if stand_in is not None:
                if after is not None:  # every call of the step starts from the step's group state
                    _set_group_state(optimizer.param_groups, before)
                if master.data_ptr() != stand_in.data_ptr():
                    stand_in.copy_(master.view(stand_in.shape))
                stand_in.grad = grad.view(stand_in.shape).to(device=stand_in.device, dtype=stand_in.dtype)
                del master, grad
                try:
                    optimizer.step()
                finally:
                    stand_in.grad = None
                now = [_group_state(g) for g in optimizer.param_groups]
                coupled += [] if after is None else _differ(now, after)
                after = now
            self._send_back(round_params, mine)
            if mine is not None:
                self.whole[mine].untyped_storage().resize_(0)
        self._agree_on_group_state(optimizer, stepped, before, after, coupled)

    def _agree_on_group_state(
        self,
        optimizer: torch.optim.Optimizer,
        stepped: list[bool],
        before: list[dict[str, Any]],
        after: list[dict[str, Any]] | None,
        coupled: list[str],
    ) -> None:
        """Give every rank the group state one call of the step left ([Note: group state on the whole path]),
        while the steps change it; refuse an optimizer whose calls left different group states."""
        if not self._sync_groups:
            return
        error = None
        if coupled:
            error = ValueError(
                f"{type(optimizer).__name__} changed its param groups' {sorted(set(coupled))} differently for "
                "different parameters inside step(): its group state depends on the parameters, which couples them, "
                "so hf_zero cannot step it on whole parameters one owner at a time ([Note: whole-parameter step]). "
                "Use stage 0, or declare it with hf_zero.register_elementwise if its math is elementwise."
            )
        raise_if_any_failed(error, self.group, "the whole-parameter step")
        first = min((i for i, s in enumerate(stepped) if s), default=None)
        if first is None:
            return
        source = next(r for r, owned in enumerate(self.owned) if first in owned)
        state = broadcast_object(after if self.group.rank == source else None, self.group, source)
        _set_group_state(optimizer.param_groups, state)
        self._synced_steps += 1
        if self._synced_steps >= 2 and not _differ(state, before):
            self._sync_groups = False  # set up at the first step, unchanged by the second: nothing to carry

    def _bring(self, round_params: list[int | None], what: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """The round's pieces of masters (`what="master"`) or gradients, from every rank to each owner (received
        into `into`, this rank's stand-in, when its device and dtype are the collective's)."""
        me = self.group.rank
        send_splits, recv_splits, parts = [0] * self.group.size, [0] * self.group.size, []
        for owner, index in enumerate(round_params):
            if index is None:
                continue
            a, b = self._span(index, me)
            if b > a:
                piece = self.pieces[(id(self.slots[index][0]), self.slots[index][1])]
                if what == "master":  # [Note: master stores]: a view in memory, read from the files on disk
                    parts.append(piece.part.store.values(piece.local[0] + a - piece.start, b - a))
                else:
                    parts.append(piece.grad[a - piece.start : b - piece.start])
                send_splits[owner] = b - a
        mine = round_params[me]
        if mine is not None:
            for rank in range(self.group.size):
                a, b = self._span(mine, rank)
                recv_splits[rank] = b - a
        dtype = self._dtype(round_params, what)
        send = (
            torch.cat([p.to(self.device, dtype) for p in parts])
            if parts
            else torch.empty(0, dtype=dtype, device=self.device)
        )
        if into is not None and into.device == self.device and into.dtype == dtype and into.numel() == sum(recv_splits):
            recv = into.view(-1)
        else:
            recv = torch.empty(sum(recv_splits), dtype=dtype, device=self.device)
        all_to_all_uneven(recv, send, recv_splits, send_splits, self.group)
        return recv

    def _dtype(self, round_params: list[int | None], what: str) -> torch.dtype:
        for index in round_params:
            if index is not None:
                part = self.slots[index][0]
                return part.master_dtype if what == "master" else part.grads.shard.dtype
        return torch.float32

    def _send_back(self, round_params: list[int | None], mine: int | None) -> None:
        """The owners' new values into every rank's master pieces."""
        me = self.group.rank
        send_splits, recv_splits = [0] * self.group.size, [0] * self.group.size
        if mine is not None:
            for rank in range(self.group.size):
                a, b = self._span(mine, rank)
                send_splits[rank] = b - a
        targets = []
        for owner, index in enumerate(round_params):
            if index is None:
                continue
            a, b = self._span(index, me)
            if b > a:
                recv_splits[owner] = b - a
                targets.append((index, a, b))
        dtype = self._dtype(round_params, "master")
        send = (
            self.whole[mine].reshape(-1).to(self.device)
            if mine is not None
            else torch.empty(0, dtype=dtype, device=self.device)
        )
        recv = torch.empty(sum(recv_splits), dtype=dtype, device=self.device)
        all_to_all_uneven(recv, send, recv_splits, send_splits, self.group)
        at = 0
        for index, a, b in targets:
            piece = self.pieces[(id(self.slots[index][0]), self.slots[index][1])]
            values = recv[at : at + b - a]
            piece.part.store.write_range(piece.local[0] + a - piece.start, values)  # [Note: master stores]
            at += b - a


def _group_state(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of a param group's entries but its parameters (tensors cloned: optimizers count in place)."""
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in group.items() if k != "params"
    }


def _set_group_state(groups: list[dict[str, Any]], states: list[dict[str, Any]]) -> None:
    """Make each group's entries but its parameters those of `states` (entries a step added and the state lacks
    are removed)."""
    for group, state in zip(groups, states):
        for key in [k for k in group if k != "params" and k not in state]:
            del group[key]
        for key, value in state.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current.shape == value.shape:
                current.copy_(value)  # in place: an optimizer may hold the tensor
            else:
                group[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _differ(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """The group entries whose values differ between two lists of group states."""
    out = []
    for x, y in zip(a, b):
        for key in set(x) | set(y):
            u, v = x.get(key), y.get(key)
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                same = (
                    isinstance(u, torch.Tensor)
                    and isinstance(v, torch.Tensor)
                    and u.shape == v.shape
                    and u.dtype == v.dtype
                    and bool(torch.equal(u.cpu(), v.cpu()))
                )
            else:
                try:
                    same = bool(u == v)
                except Exception:  # noqa: BLE001 - a value without a plain comparison counts as changed
                    same = False
            if not same:
                out.append(key)
    return out
