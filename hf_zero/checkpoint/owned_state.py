"""The optimizer state of the whole-parameter path in checkpoints, keyed by parameter name.

[Note: owned optimizer state]
On the whole-parameter path ([Note: whole-parameter step]) each parameter's optimizer state lives whole on
the rank that owns it, in whatever shapes the optimizer made (Adafactor's row and column factors, Muon's
momentum, a step count). The owner writes it into its own optimizer file under `NAME::KEY`, each tensor in
its own shape, with kind `"param"` in the manifest's state kinds, and the manifest's `optimizer.owners`
names the file that holds each parameter's state. Loading deals the owners anew for the loading world
size; each new owner reads its parameters' state from whichever file holds it. So a state saved on one
world size, stage or hybrid layout loads on any other. The state of an elementwise optimizer saved on
flat shards (kind `"elementwise"`, 1-D pieces in every rank's file) loads onto the whole path too, its
pieces joined into the parameter's shape; and a `"param"` state of the parameter's size loads onto flat
shards as elementwise state. A `"param"` state of another shape cannot be cut into flat pieces: refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..engine.step.pieces import Piece
from ..engine.step.whole import WholeStep
from .format import STATE_SEP, Manifest, optim_file_for
from .reader import FileCache, read_flat_range, read_pieces
from .stream import Entry, host_pieces

PARAM = "param"  # the kind of a state tensor saved whole, in its own shape, by the parameter's owner


def owned_entries(
    whole: WholeStep, optimizer: torch.optim.Optimizer, file: str
) -> tuple[list[Entry], dict[str, dict[str, str]], dict[str, str]]:
    """This rank's owned parameters' state as entries of its optimizer file `file`, their kinds, and
    `{name: file}` for the manifest's owners."""
    entries: list[Entry] = []
    kinds: dict[str, dict[str, str]] = {}
    owners: dict[str, str] = {}
    for name, stand_in in whole.owned_params():
        state = optimizer.state.get(stand_in)
        if not state:
            continue  # never stepped (no gradient yet, or frozen): nothing to save
        kinds[name], owners[name] = {}, file
        for key, value in state.items():
            tkey = f"{name}{STATE_SEP}{key}"
            if isinstance(value, torch.Tensor):
                kinds[name][key] = PARAM
                entries.append(Entry(tkey, value.dtype, tuple(value.shape), host_pieces(value)))
            elif isinstance(value, (bool, int, float)):
                kinds[name][key] = "int" if isinstance(value, int) and not isinstance(value, bool) else "float"
                entries.append(
                    Entry(tkey, torch.float64, (), host_pieces(torch.tensor(float(value), dtype=torch.float64)))
                )
            else:
                raise TypeError(
                    f"Optimizer state {key!r} of {name} is a {type(value).__name__}; hf_zero checkpoints hold "
                    "tensors and numbers only."
                )
    return entries, kinds, owners


def owned_files(whole: WholeStep, manifest: Manifest) -> set[str]:
    """The files that hold the state of the parameters this rank owns."""
    saved = manifest.optimizer or {}
    owners: dict[str, str] = saved.get("owners", {})
    needed: set[str] = set()
    for name, _ in whole.owned_params():
        if name in owners:
            needed.add(owners[name])
        elif name in saved.get("state", {}):
            needed.update(optim_file_for(f) for f, _, _ in manifest.slices[name])
    return needed


def load_owned(whole: WholeStep, optimizer: torch.optim.Optimizer, manifest: Manifest, cache: FileCache) -> None:
    """Fill `optimizer.state` for the parameters this rank owns ([Note: owned optimizer state])."""
    saved = manifest.optimizer or {}
    group_of = {id(t): g for g in optimizer.param_groups for t in g["params"]}
    for name, stand_in in whole.owned_params():
        kinds = saved["state"].get(name)
        if not kinds:
            continue
        stored = _stored(manifest, name)
        state: dict[str, Any] = {}
        for key, kind in kinds.items():
            tkey = f"{name}{STATE_SEP}{key}"
            if kind == "elementwise":  # saved on flat shards: join the pieces into the parameter's shape
                out = torch.empty(stand_in.numel(), dtype=stand_in.dtype)  # the master dtype, as the flat path reads
                read_pieces(cache, tkey, stored, 0, stand_in.numel(), out)
                state[key] = out.view(stand_in.shape).to(stand_in.device)
            else:
                state[key] = restore_value(key, kind, read_whole(cache, tkey, stored), group_of[id(stand_in)], stand_in)
        optimizer.state[stand_in] = state


def check_flat_loadable(manifest: Manifest, cache: FileCache, names: set[str]) -> None:
    """Raise unless every state tensor of the parameters `names` (those a flat-path optimizer loads) saved whole by
    an owner is a scalar or has its parameter's size, so that the flat path can cut it into pieces (checked before
    anything is loaded, on every rank alike)."""
    saved = manifest.optimizer or {}
    for name, file in saved.get("owners", {}).items():
        if name not in names:
            continue
        for key, kind in saved["state"].get(name, {}).items():
            if kind != PARAM:
                continue
            shape = list(cache.get(file).get_slice(f"{name}{STATE_SEP}{key}").get_shape())
            if shape and math.prod(shape) != math.prod(manifest.params[name]["shape"]):
                raise ValueError(
                    f"The checkpoint holds {name}'s optimizer state {key!r} in shape {shape}, saved by an optimizer "
                    "that stepped on whole parameters ([Note: owned optimizer state]); this optimizer steps on flat "
                    "shards (it is declared elementwise) and cannot cut that state into pieces. Load it with the "
                    "optimizer not declared with hf_zero.register_elementwise, as it was saved."
                )


def piece_param_state(piece: Piece, key: str, manifest: Manifest, cache: FileCache) -> torch.Tensor:
    """A `"param"` state saved whole by an owner, of the parameter's size (`check_flat_loadable`), cut to `piece`
    for the flat path."""
    tkey = f"{piece.name}{STATE_SEP}{key}"
    file = (manifest.optimizer or {})["owners"][piece.name]
    shape = list(cache.get(file).get_slice(tkey).get_shape())
    return read_flat_range(cache.get(file), tkey, shape, piece.start, piece.end)


def _stored(manifest: Manifest, name: str) -> list[list[Any]]:
    """Where `name`'s state is: its owner's file, or the optimizer files of its flat pieces."""
    file = (manifest.optimizer or {}).get("owners", {}).get(name)
    if file is not None:
        return [[file, 0, math.prod(manifest.params[name]["shape"])]]
    return [[optim_file_for(f), s, e] for f, s, e in manifest.slices[name]]


def read_whole(cache: FileCache, key: str, stored: list[list[Any]]) -> torch.Tensor:
    """The tensor `key` from the first of the `stored` files that holds it."""
    for file, _, _ in stored:
        handle = cache.get(file)
        if key in handle.keys():
            return handle.get_tensor(key)
    raise ValueError(f"No file of the checkpoint holds the optimizer state {key}; the checkpoint is damaged.")


def restore_value(key: str, kind: str, value: torch.Tensor, group: dict[str, Any], like: torch.Tensor) -> Any:
    """A saved state value as the optimizer keeps it, and as torch's `load_state_dict` gives it back: numbers as
    numbers, torch's `step` on the CPU in fp32 (unless the group is fused or capturable: then on `like`'s device),
    other tensors on the device of `like` (the tensor the state belongs to), floating-point ones in its dtype (NAdam's
    `mu_product`, made in float32 beside float64 weights, comes back float64, as under DDP)."""
    if kind == "int":
        return int(value.item())
    if kind == "float":
        return float(value.item())
    if key == "step" and value.ndim == 0:
        if group.get("fused") or group.get("capturable"):
            return value.to(like.device, torch.float32)
        return value.to(torch.float32)
    return value.to(like.device, like.dtype if value.is_floating_point() else value.dtype)
