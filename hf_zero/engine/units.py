"""Finding the sharding units of a model and the parameters each unit owns.

A unit is a module whose parameters are gathered (stage 3) and reduced together: usually one
transformer block; with `wrap="auto"` also the input embedding and the output head when they are
not tied. The model itself is the root unit and owns every parameter that no inner unit owns
(the final norm; tied embeddings). A parameter used by several units (tied weights)
belongs to the innermost unit that contains all of its uses, so it is sharded once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its module, its qualified name ('' for the root) and the parameters it owns."""

    name: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    param_names: tuple[str, ...]  # first qualified name of each parameter, same order as `params`
    backward_reads_params: bool = True  # False for a lone nn.Embedding (see `_backward_reads_params`)


def find_units(model: nn.Module, wrap: str | tuple[str, ...]) -> list[UnitSpec]:
    """Split `model` into units: the matched blocks in forward-definition order, then the root.

    Args:
        model (`nn.Module`): the model to shard.
        wrap (`"auto"` or `tuple[str, ...]`): as `ZeroConfig.wrap`.

    Returns:
        `list[UnitSpec]`: inner units in module order, the root unit last.

    Raises:
        ValueError: when a named class does not exist in the model, or `"auto"` finds no block;
            the message lists the block-like classes the model does have.

    Example:

    ```python
    >>> units = find_units(model, "auto")
    >>> [u.name for u in units][:2]
    ['model.layers.0', 'model.layers.1']
    ```
    """
    class_names = _wrap_class_names(model, wrap)
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
    return _assign_params(model, blocks)


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
    repeated = _repeated_block_classes(model)
    if repeated:
        return repeated
    raise ValueError(
        f"hf_zero could not find the transformer blocks of {type(model).__name__}: it declares no "
        f"`_no_split_modules` and has no nn.ModuleList of repeated blocks. {_candidates_hint(model)}"
    )


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


def _assign_params(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[UnitSpec]:
    # Every use of every parameter, by qualified name, tied aliases included.
    uses: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        uses.setdefault(param, []).append(name)
    owned: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(blocks) + 1)]
    for param, names in uses.items():
        owner = len(blocks)  # the root, unless one block holds every use
        for i, (block_name, _) in enumerate(blocks):
            if all(n.startswith(block_name + ".") for n in names):
                owner = i
                break
        owned[owner].append((names[0], param))
    specs = [
        UnitSpec(
            name=bname, module=bmod, params=tuple(p for _, p in owned[i]), param_names=tuple(n for n, _ in owned[i]),
            backward_reads_params=_backward_reads_params(bmod, [p for _, p in owned[i]]),
        )
        for i, (bname, bmod) in enumerate(blocks)
    ]
    root = owned[len(blocks)]
    specs.append(UnitSpec(name="", module=model, params=tuple(p for _, p in root), param_names=tuple(n for n, _ in root)))
    return specs


def _backward_reads_params(module: nn.Module, params: list[nn.Parameter]) -> bool:
    """Whether a unit's backward needs the values of its parameters. A plain `nn.Embedding` unit's
    does not: the gradient of a lookup is the output gradient scattered by the indices, so at
    stage 3 its backward skips the all-gather (the input embedding of an LLM is among its
    largest matrices). Subclasses may compute anything in `forward`, so only the exact class
    qualifies, and only without `max_norm` (which rewrites the weight during the lookup)."""
    is_lookup = type(module) is nn.Embedding and module.max_norm is None and not module.sparse
    return not (is_lookup and len(params) == 1 and params[0] is module.weight)
