"""What `optimizer.state_dict()` of a sharded optimizer holds, and what its `load_state_dict` accepts.

[Note: optimizer state dicts]
A sharded optimizer's `state_dict()` is torch's format over what this rank steps (pieces of its shard, or the
whole parameters it owns): one rank's part of the optimizer state. DDP code saves the optimizer's state from one
rank (`if rank == 0: torch.save(optimizer.state_dict(), f)`, Accelerate's `accelerator.save`) and loads it on every
rank. Rank 0's part loaded on rank 1 would be taken without a word (the pieces have the same sizes), and rank 1
would step its shard with rank 0's moments: a silently wrong resume. So the state dict says whose part it is (an
`"hf_zero"` entry: the shard rank and group size, and the sizes of the pieces of each group), and
`load_state_dict` takes:

- a state dict this optimizer wrote: only on the shard rank that wrote it (any rank of its replicas under hybrid
  sharding), with the same pieces; any other rank refuses it, naming the rank that saved it and the ways to save
  every rank's part;
- torch's own format, with no `"hf_zero"` entry (a plain optimizer over the whole parameters: a DDP or
  single-process run, the same parameters in the same groups): each rank takes its pieces of every state tensor
  (the same cut `initialize` applies to state an optimizer sets at construction, [Note: state set at
  construction]), and each group's hyperparameters, as torch's load does.

Every rank then agrees (one small all-reduce): a refusal on one rank raises on all of them, before any rank has
loaded anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping
from typing import Any, Protocol

import torch

from ..collectives import CommGroup, raise_if_any_failed

FORMAT = "hf_zero sharded optimizer state: one rank's part"


@dataclasses.dataclass(frozen=True)
class PieceMap:
    """Where each parameter of the optimizer (in torch's order: group by group) went in the sharded one.

    `targets[i]`: `(index, span)` of every tensor the sharded optimizer steps for parameter `i` on this rank, its
    index in torch's numbering of the sharded groups and the elements `[a, b)` of the flattened parameter it holds
    (None: the whole parameter, [Note: whole-parameter step]); empty where another rank holds all of it.
    `numels[i]`: parameter `i`'s element count. `group_sizes[g]`: the parameters of group `g`.
    """

    targets: tuple[tuple[tuple[int, tuple[int, int] | None], ...], ...]
    numels: tuple[int, ...]
    group_sizes: tuple[int, ...]

    def with_group(
        self, targets: tuple[tuple[tuple[int, tuple[int, int] | None], ...], ...], numels: tuple[int, ...]
    ) -> PieceMap:
        """The map with a group added at the end ([Note: param group added later] in optim.py): its parameters'
        `targets` and `numels`."""
        return PieceMap(self.targets + targets, self.numels + numels, (*self.group_sizes, len(numels)))


def described(state: dict[str, Any], param_groups: list[dict[str, Any]], shard_group: CommGroup) -> dict[str, Any]:
    """`state` (the inner optimizer's `state_dict()`) with the `"hf_zero"` entry that says whose part it is."""
    return {**state, "hf_zero": _description(param_groups, shard_group)}


def _description(param_groups: list[dict[str, Any]], shard_group: CommGroup) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "shard_rank": shard_group.rank,
        "shard_group_size": shard_group.size,
        "pieces": [[int(p.numel()) for p in group["params"]] for group in param_groups],
    }


def to_load(
    state_dict: dict[str, Any],
    param_groups: list[dict[str, Any]],
    pieces: PieceMap,
    shard_group: CommGroup,
    world: CommGroup,
) -> dict[str, Any]:
    """What the inner optimizer's `load_state_dict` gets for `state_dict` (see the note); refused on every rank
    (`ValueError`) where any rank cannot take its own."""
    error: Exception | None = None
    out: dict[str, Any] = {}
    try:
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise TypeError(
                "optimizer.load_state_dict expects an optimizer state dict (a dict with 'state' and "
                f"'param_groups'), got {type(state_dict).__name__}."
            )
        if "hf_zero" in state_dict:
            _check_own(state_dict["hf_zero"], param_groups, shard_group)
            out = {k: v for k, v in state_dict.items() if k != "hf_zero"}
        else:
            out = _cut(state_dict, param_groups, pieces)
    except (ValueError, TypeError) as e:
        error = e
    raise_if_any_failed(error, world, "optimizer.load_state_dict")
    return out


def _check_own(saved: dict[str, Any], param_groups: list[dict[str, Any]], shard_group: CommGroup) -> None:
    mine = _description(param_groups, shard_group)
    rank, size = saved.get("shard_rank"), saved.get("shard_group_size")
    if (rank, size) != (mine["shard_rank"], mine["shard_group_size"]):
        raise ValueError(
            f"hf_zero: this optimizer state dict is shard rank {rank}'s part (of {size}) of a sharded optimizer's "
            f"state, and this is shard rank {shard_group.rank} (of {shard_group.size}). A sharded optimizer's "
            "state_dict() holds only the calling rank's part, so one saved from a single rank (`if rank == 0: "
            "torch.save(optimizer.state_dict(), path)`, `accelerator.save(...)`) cannot resume the other ranks. "
            "Save it on every rank to a file of its own (`torch.save(optimizer.state_dict(), "
            "f'optimizer-rank{rank}.pt')`) and load each rank's own file, or use hf_zero.save_checkpoint / "
            "hf_zero.load_checkpoint (the Trainer's and Accelerate's save_state do), which resume on any number "
            "of ranks."
        )
    if saved.get("pieces") != mine["pieces"]:
        raise ValueError(
            "hf_zero: this optimizer state dict was saved by a sharded optimizer over other pieces (another "
            "model, other param groups, or other ZeroConfig settings), so its state does not fit this one's. "
            "Load it into the optimizer of the run that saved it, or resume with hf_zero.load_checkpoint, which "
            "re-cuts the state for any layout and number of ranks."
        )


def _cut(state_dict: dict[str, Any], param_groups: list[dict[str, Any]], pieces: PieceMap) -> dict[str, Any]:
    """Torch's own format over the whole parameters, cut to this rank's pieces."""
    groups = state_dict["param_groups"]
    sizes = tuple(len(g["params"]) for g in groups)
    if sizes != pieces.group_sizes:
        raise ValueError(
            f"hf_zero: this optimizer state dict has param groups of {list(sizes)} parameters, where the sharded "
            f"optimizer was built with {list(pieces.group_sizes)}. A plain optimizer's state dict (a DDP or "
            "single-process run) loads into a sharded one built over the same parameters in the same groups."
        )
    order = [i for g in groups for i in g["params"]]  # torch's keys of the saved parameters, in order
    state: dict[int, dict[str, Any]] = {}
    for position, key in enumerate(order):
        saved = state_dict["state"].get(key)
        if not saved:
            continue
        for index, span in pieces.targets[position]:
            device = _device_of(param_groups, index)
            state[index] = {k: _piece(v, device, span, pieces.numels[position], k) for k, v in saved.items()}
    new_groups, start = [], 0
    for saved_group, group in zip(groups, param_groups):
        count = len(group["params"])
        new_groups.append({**saved_group, "params": list(range(start, start + count))})
        start += count
    return {"state": state, "param_groups": new_groups}


def _device_of(param_groups: list[dict[str, Any]], index: int) -> torch.device:
    for group in param_groups:
        if index < len(group["params"]):
            return torch.device(group["params"][index].device)
        index -= len(group["params"])
    raise RuntimeError(f"hf_zero: no optimizer tensor at index {index} (an inconsistent piece map)")


def _piece(value: Any, device: torch.device, span: tuple[int, int] | None, numel: int, key: str) -> Any:
    """Elements `span` of a saved state tensor (whole with no span; 0-d and non-tensor values as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.ndim == 0:
        return value.clone()  # a step count: where torch's load puts it (host or device) is its own policy
    if span is None:
        return value.to(device, copy=True)
    if value.numel() != numel:
        raise ValueError(
            f"hf_zero: the optimizer state '{key}' holds {value.numel()} elements for a parameter of {numel}: it is "
            "not shaped like its parameter, so it cannot be cut into this rank's shard. Resume with "
            "hf_zero.load_checkpoint, or build the optimizer's state anew."
        )
    return value.reshape(-1)[span[0] : span[1]].to(device, copy=True)


class _Owner(Protocol):
    def owns(self, param: torch.Tensor) -> bool: ...

    def name_of(self, param: torch.Tensor) -> str: ...


class OptimizerState(MutableMapping[Any, Any]):
    """[Note: optimizer state by parameter]
    `optimizer.state` of a sharded optimizer: the inner optimizer's own state (keyed by what this rank steps,
    the tensors of `optimizer.param_groups`), through a view that follows it when torch's `load_state_dict`
    replaces it. DDP code indexes it by model parameter: `optimizer.state[p]["exp_avg"]` to log a moment, or
    `optimizer.state[p] = {}` to start a parameter's state afresh (after new token rows were initialized). Keyed by
    a model parameter the inner state is an empty entry: a KeyError on a read, and a reset that changes nothing,
    silently. So a model parameter as a key is refused by name (a `TypeError`), saying where its state is.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owner: _Owner) -> None:
        self._optimizer = optimizer
        self._owner = owner

    @property
    def _inner(self) -> MutableMapping[Any, Any]:
        return self._optimizer.state

    def _refuse(self, key: Any) -> None:
        if isinstance(key, torch.Tensor) and self._owner.owns(key):
            raise TypeError(
                f"hf_zero: optimizer.state['{self._owner.name_of(key)}'] (keyed by a model parameter): a sharded "
                "optimizer keeps its state per piece of this rank's shard (the tensors of optimizer.param_groups), "
                "not per model parameter, so no rank holds a parameter's whole state under that key. To save or "
                "resume the state use hf_zero.save_checkpoint / hf_zero.load_checkpoint (or every rank's "
                "optimizer.state_dict()); to start it afresh, attach a new optimizer with "
                "hf_zero.initialize(model, new_optimizer, config)."
            )

    def __getitem__(self, key: Any) -> Any:
        self._refuse(key)
        return self._inner[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._refuse(key)
        self._inner[key] = value

    def __delitem__(self, key: Any) -> None:
        self._refuse(key)
        del self._inner[key]

    def __contains__(self, key: object) -> bool:
        self._refuse(key)
        return key in self._inner

    def __iter__(self) -> Iterator[Any]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def __repr__(self) -> str:
        return f"OptimizerState({len(self)} tensors of this rank)"
