"""Finding the sharding units of a model and the parameters each unit owns.

A unit is a module whose parameters are gathered (stage 3) and reduced together: usually one
transformer block; with `wrap="auto"` also the input embedding and the output head when they are
not tied. The model itself is the root unit and owns every parameter that no inner unit owns
(the final norm; tied embeddings). A parameter used by several units (tied weights)
belongs to the innermost unit that contains all of its uses, so it is sharded once.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .resting import parameter_holders

if TYPE_CHECKING:
    from ..config import ZeroConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its module(s), its qualified name ('' for the root) and the parameters it owns.

    A unit is usually one module; with a bucket size it may be several consecutive sibling blocks
    (`modules`, in forward-definition order; `module` is the first of them).
    """

    name: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    param_names: tuple[str, ...]  # first qualified name of each parameter, same order as `params`
    backward_reads_params: bool = True  # False for a lone nn.Embedding (see `_backward_reads_params`)
    modules: tuple[nn.Module, ...] = ()  # every module of the unit; () means (module,)
    holders: tuple[tuple[tuple[nn.Module, str], ...], ...] = ()  # per parameter: every (module, attribute) holding it
    frozen: bool = False  # the frozen part of a unit ([Note: frozen parameters] in unit.py)
    dtype: torch.dtype | None = None  # parameters kept in their own dtype ([Note: parameters kept in their own dtype])

    @property
    def all_modules(self) -> tuple[nn.Module, ...]:
        return self.modules or (self.module,)


def find_units(model: nn.Module, wrap: str | tuple[str, ...], bucket_numel: int = 0) -> list[UnitSpec]:
    """Split `model` into units: the matched blocks in forward-definition order, then the root.

    Args:
        model (`nn.Module`): the model to shard.
        wrap (`"auto"` or `tuple[str, ...]`): as `ZeroConfig.wrap`.
        bucket_numel (`int`, *optional*, defaults to 0):
            Consecutive sibling blocks (children of one module, e.g. the decoder `ModuleList`) are
            grouped into one unit until it holds at least this many parameters (see
            `ZeroConfig.bucket_size_mb`); 0 makes every block a unit of its own.

    Returns:
        `list[UnitSpec]`: inner units in module order, the root unit last.

    Raises:
        ValueError: when a named class does not exist in the model; the message lists the block-like
            classes the model does have. (`"auto"` on a model with no blocks follows
            [Note: units without blocks].)

    Example:

    ```python
    >>> units = find_units(model, "auto")
    >>> [u.name for u in units][:2]
    ['model.layers.0', 'model.layers.1']
    ```
    """
    class_names = _wrap_class_names(model, wrap)
    if not class_names:  # "auto" on a model with no transformer blocks
        return _assign_params(model, _group_blocks(_fallback_blocks(model, bucket_numel), set(), bucket_numel))
    extra = _embedding_units(model) if wrap == "auto" else set()
    blocks: list[tuple[str, nn.Module]] = []
    inside_block: set[str] = set()
    for name, module in model.named_modules():
        if module is model or (type(module).__name__ not in class_names and id(module) not in extra):
            continue
        if any(name.startswith(prefix + ".") for prefix in inside_block):
            continue  # nested inside an already-chosen block: the outer block owns it
        blocks.append((name, module))
        inside_block.add(name)
    if not blocks:
        raise ValueError(
            f"hf_zero found no module of class {sorted(class_names)} in {type(model).__name__}. "
            f"{_candidates_hint(model)}"
        )
    return _assign_params(model, _group_blocks(blocks, extra, bucket_numel))


Group = list[tuple[str, nn.Module]]  # the (qualified name, module) of each block of one unit


def units_for(model: nn.Module, config: ZeroConfig) -> list[UnitSpec]:
    """The units `hf_zero.initialize` makes of `model` under `config` (its `wrap` and bucket size).

    Example:

    ```python
    >>> [u.name for u in units_for(model, ZeroConfig(bucket_size_mb=0))][:2]
    ['model.embed_tokens', 'model.layers.0']
    ```
    """
    model_dtype = next(model.parameters(), torch.empty(0)).dtype
    return find_units(model, config.wrap, config.bucket_numel(model_dtype))


def _group_blocks(blocks: list[tuple[str, nn.Module]], ungrouped: set[int], bucket_numel: int) -> list[Group]:
    """Consecutive sibling blocks joined while a group holds fewer than `bucket_numel` parameters.
    The embedding and the head (`ungrouped`) always stay alone, and a block frozen whole joins only blocks frozen
    whole: the bottom blocks of a model frozen from below are never gathered for a backward that stops above them,
    as they would be in a bucket with a trainable block."""
    groups: list[Group] = []
    size = 0
    for name, module in blocks:
        numel = sum(p.numel() for p in module.parameters())
        last = groups[-1] if groups else None
        joins = (
            last is not None
            and size < bucket_numel
            and id(module) not in ungrouped
            and id(last[-1][1]) not in ungrouped
            and _parent(last[-1][0]) == _parent(name)
            and _frozen_whole(module) == _frozen_whole(last[-1][1])
        )
        if joins and last is not None:
            last.append((name, module))
            size += numel
        else:
            groups.append([(name, module)])
            size = numel
    return groups


def _frozen_whole(module: nn.Module) -> bool:
    return not any(p.requires_grad for p in module.parameters())


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _embedding_units(model: nn.Module) -> set[int]:
    """With untied weights, the input embedding and the output head become units of their own, so
    the root holds only what is left (the final norm) and the two largest matrices of an LLM are
    never gathered together. Tied ones stay in the root: their shared weight is one parameter.
    Found through the `get_input_embeddings` / `get_output_embeddings` methods HF models have."""
    modules = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            module = None
        if isinstance(module, nn.Module) and module is not model and any(True for _ in module.parameters()):
            modules.append(module)
    if len(modules) == 2:
        shared = {id(p) for p in modules[0].parameters()} & {id(p) for p in modules[1].parameters()}
        if shared:
            return set()
    return {id(m) for m in modules}


def _wrap_class_names(model: nn.Module, wrap: str | tuple[str, ...]) -> set[str]:
    present = {type(m).__name__ for m in model.modules()}
    if wrap != "auto":
        missing = [w for w in wrap if w not in present]
        if missing:
            raise ValueError(
                f"ZeroConfig.wrap names {missing}, which {'is' if len(missing) == 1 else 'are'} not in "
                f"{type(model).__name__}. {_candidates_hint(model)}"
            )
        return set(wrap)
    declared: set[str] = set()
    for module in model.modules():
        declared.update(getattr(module, "_no_split_modules", None) or ())
    declared &= present
    if declared:
        return declared
    return _repeated_block_classes(model)  # empty: no blocks, the fallback of `find_units`


def _fallback_blocks(model: nn.Module, bucket_numel: int) -> list[tuple[str, nn.Module]]:
    """[Note: units without blocks] A model with neither `_no_split_modules` nor a `ModuleList` of repeated
    blocks (a regression head, an `nn.Sequential`, a model with one parameter) is sharded by a rule a user can
    predict: a model of at most one bucket (`bucket_size_mb`) is one unit, the root; a larger one gets a unit
    per direct child holding parameters (after going down through wrappers with a single such child),
    consecutive small children joined up to the bucket size; parameters of the root itself stay in the root
    unit. One line on rank 0's log says what was chosen and how to choose otherwise."""
    total = sum(p.numel() for p in model.parameters())
    prefix, parent = "", model
    while True:
        children = [(n, m) for n, m in parent.named_children() if any(True for _ in m.parameters())]
        if len(children) != 1 or any(True for _ in parent.parameters(recurse=False)):
            break
        prefix, parent = f"{prefix}{children[0][0]}.", children[0][1]
    if total <= bucket_numel or not children:
        blocks: list[tuple[str, nn.Module]] = []
        chosen = "one unit, the model itself"
    else:
        blocks = [(prefix + n, m) for n, m in children]
        names = [n for n, _ in blocks]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        chosen = (
            f"a unit per child of {prefix[:-1] or 'the model'} with parameters ({shown}; consecutive small "
            "ones joined up to bucket_size_mb) and the root"
        )
    _log_on_rank0(
        f"hf_zero: {type(model).__name__} has no transformer blocks (no `_no_split_modules`, no ModuleList of "
        f"repeated blocks); {total} parameters sharded as {chosen}. Name the modules to shard one by one with "
        "ZeroConfig(wrap=[...]) (--zero_wrap) to choose otherwise."
    )
    return blocks


def _log_on_rank0(message: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message)


def _repeated_block_classes(model: nn.Module) -> set[str]:
    """Classes that appear at least twice as children of an `nn.ModuleList` (the usual block stack)."""
    found: set[str] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            counts = Counter(type(child).__name__ for child in module if any(True for _ in child.parameters()))
            found.update(name for name, n in counts.items() if n >= 2)
    return found


def _candidates_hint(model: nn.Module) -> str:
    candidates = sorted(_repeated_block_classes(model))
    if not candidates:
        with_params = Counter(
            type(m).__name__ for m in model.modules() if m is not model and any(True for _ in m.parameters())
        )
        candidates = [name for name, _ in with_params.most_common(8)]
    return (
        f"Block-like classes in this model: {candidates}. Name one with ZeroConfig(wrap=[...]) "
        "(or --zero_wrap on the command line)."
    )


def _assign_params(model: nn.Module, groups: list[Group]) -> list[UnitSpec]:
    # Every use of every parameter, by qualified name, tied aliases included.
    uses: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        uses.setdefault(param, []).append(name)
    owned: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(groups) + 1)]
    for param, names in uses.items():
        owner = len(groups)  # the root, unless one unit holds every use
        for i, group in enumerate(groups):
            if all(any(n.startswith(block_name + ".") for block_name, _ in group) for n in names):
                owner = i
                break
        owned[owner].append((names[0], param))
    specs = [
        UnitSpec(
            name=_group_name(group),
            module=group[0][1],
            params=tuple(p for _, p in owned[i]),
            param_names=tuple(n for n, _ in owned[i]),
            backward_reads_params=len(group) > 1 or _backward_reads_params(group[0][1], [p for _, p in owned[i]]),
            modules=tuple(m for _, m in group) if len(group) > 1 else (),
            holders=parameter_holders(model, tuple(p for _, p in owned[i])),
        )
        for i, group in enumerate(groups)
    ]
    root = tuple(p for _, p in owned[len(groups)])
    specs.append(
        UnitSpec(
            name="",
            module=model,
            params=root,
            param_names=tuple(n for n, _ in owned[len(groups)]),
            holders=parameter_holders(model, root),
        )
    )
    return specs


def _group_name(group: Group) -> str:
    """`model.layers.3` for one block, `model.layers.0-3` for blocks 0 to 3."""
    first = group[0][0]
    return first if len(group) == 1 else f"{first}-{group[-1][0].rsplit('.', 1)[-1]}"


def _backward_reads_params(module: nn.Module, params: list[nn.Parameter]) -> bool:
    """Whether a unit's backward needs the values of its parameters. A plain `nn.Embedding` unit's
    does not: the gradient of a lookup is the output gradient scattered by the indices, so at
    stage 3 its backward skips the all-gather (the input embedding of an LLM is among its
    largest matrices). Subclasses may compute anything in `forward`, so only the exact class
    qualifies, and only without `max_norm` (which rewrites the weight during the lookup)."""
    is_lookup = type(module) is nn.Embedding and module.max_norm is None and not module.sparse
    return not (is_lookup and len(params) == 1 and params[0] is module.weight)
