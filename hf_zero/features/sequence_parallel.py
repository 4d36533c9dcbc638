"""Sequence parallelism for Hugging Face decoders: each rank of a group holds 1/N of every sequence.

[Note: sequence parallelism]
With `ZeroConfig(sequence_parallel=N)`, groups of N consecutive ranks are given the same batches. A forward
pre-hook on the model cuts each sequence into N contiguous parts and keeps this rank's: the input ids (or
embeddings), the positions (`position_ids`, global: RoPE sees where each token really is), and the labels,
shifted over the whole sequence first so that the last token of a part predicts the first of the next.
Everything a token computes alone (embeddings, norms, MLPs, the LM head, the loss) then costs 1/N per rank.

Attention needs every token: the model's attention function is replaced, through transformers' attention
registry (`AttentionInterface`), by one that exchanges, with an all-to-all over the group, the rank's tokens of
every head for every token of 1/N of the heads (the Ulysses scheme); runs the model's own attention
implementation (sdpa, eager, flash) on whole sequences with causal masking over global positions, and the
padding mask of the whole batch where there is one; and exchanges back. Any decoder that calls its attention
through the registry (LLaMA, Mistral, Qwen2, Gemma, ...) works without model code; the attention heads must be a
multiple of N, the key-value heads a multiple or a divisor (then each rank gets a copy of the ones its query heads
use). A model whose attention is its own code and ends in `torch.nn.functional.scaled_dot_product_attention`
(Falcon with rotary positions, under sdpa: `OWN_ATTENTION`) is split the same way around that call: while one of
its attention modules runs a split forward, the function it calls is the exchange around torch's own (the
module's own mask, built for this rank's tokens, is replaced by the whole sequence's).

The loss: each rank's cross-entropy is summed over its tokens and divided by the number of labelled tokens of
the whole micro-batch (every rank of the group holds all the labels, so no collective is needed to count
them). The value returned is the group's sum of those parts (one scalar all-reduce): the loss of the whole
micro-batch, the same on every rank of the group. Its gradient is N times the rank's own part, so that the
engine's reduction, which averages over all ranks, sums over the group and averages over the data-parallel
replicas. In training with labels the LM head computes the loss itself, in tiles ([Note: tiled loss]): no
logits are returned. Without labels, and in evaluation, the logits are gathered along the sequence
(differentiably) so that a caller's own loss or metric sees every token. TRL's fused LM head
(`fused_lm_head=True`: per-token log-probabilities, entropy, label mask) computes on the rank's tokens; each
per-token field comes back whole the same way, so TRL's losses and metrics see every token. Metrics gathered over
ranks (`gather_for_metrics`) take each sample from one rank of its group (`gather_once_per_group`).

Generation (any forward that asks for a cache), or a sequence that does not divide by N outside training,
runs unsplit on every rank (correct, without the memory saving): for that forward the model's own attention
implementation is set back in its config, so its masks and attention are exactly the unsplit model's; each
forward sets the one it uses.
"""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..engine.collectives import CommGroup
from ..engine.collectives.ops import all_reduce_
from ..engine.collectives.sequence import all_to_all_dims, gather_dim
from ..engine.module import wrapped_model
from ..engine.passes import in_backward
from .tiled_loss import tiled_cross_entropy

ATTENTION = "hf_zero_sequence"  # the name registered in transformers' attention and mask registries
IGNORE = -100


class SequenceSplit:
    """What the attention function of one forward needs: the group, and the padding mask of the whole batch
    (`None` when every token is real). Passed to it through the model's keyword arguments; `calls` counts the
    attention calls it served (none at all means the model computes attention some other way: refused). A plain
    class, not a dataclass: hooks that map over a forward's inputs (the engine's, Accelerate's) rebuild
    dataclasses, and the attention would count on a copy."""

    __slots__ = ("group", "padding", "calls", "labels", "count", "head_loss", "unshifted", "documents", "spans")

    def __init__(
        self,
        group: CommGroup,
        padding: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> None:
        self.group = group
        self.padding = padding  # (batch, sequence) bool, True for real tokens
        self.documents = documents  # (batch, sequence) int: each token's document in a packed row, or None
        self.spans = _document_spans(documents) if documents is not None else None  # per row, each document's range
        self.calls = [0]
        self.labels = labels  # this rank's shifted labels, when the head computes the loss in tiles
        self.count = count  # labelled tokens of the whole micro-batch (or the caller's num_items)
        self.head_loss: list[torch.Tensor] = []  # what the head returned ([Note: tiled loss])
        self.unshifted = False  # TRL's fused head given `labels` only: it scores all but the last position


@dataclass
class SequenceParallel:
    """The model's sequence-parallel state, set by `enable` on the model and each of its modules."""

    group: CommGroup
    inner: str  # the attention implementation the model had (run on whole sequences)
    handles: list[Any]  # the model's two hooks
    head: nn.Module | None = None  # the LM head whose forward computes the tiled loss ([Note: tiled loss])
    active: SequenceSplit | None = None  # the split of the forward running now
    own_attention: bool = False  # attention in the model's own code, split around its sdpa call (`OWN_ATTENTION`)
    # the split of each forward by its rotary tables, for a recomputation in the backward (gradient checkpointing
    # replays the attention with the same inputs, after the forward's split ended): id -> (weak ref, split)
    recomputed: dict[int, tuple[Any, SequenceSplit]] = field(default_factory=dict)


def check(model: nn.Module, size: int) -> None:
    """Raise `ValueError` where the model cannot be split over `size` ranks by sequence."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_attention_heads"):
        raise ValueError(
            "ZeroConfig.sequence_parallel works on Hugging Face decoder models (a `config` with "
            f"num_attention_heads); {type(model).__name__} has none."
        )
    base = wrapped_model(model)  # peft: the model inside
    if not getattr(base, "_supports_attention_backend", False):
        _check_own_attention(base, config)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % size or (kv % size and size % kv):
        raise ValueError(
            f"ZeroConfig.sequence_parallel={size}: the model has {heads} attention heads and {kv} key-value heads; "
            f"the attention heads must be a multiple of {size} (each rank attends with 1/{size} of them) and the "
            f"key-value heads a multiple or a divisor of {size} (then they are replicated). Use a sequence_parallel "
            "that divides both."
        )
    inner = getattr(config, "_attn_implementation", None) or "eager"
    if _own_attention_modules(base):
        return
    if inner != ATTENTION and inner != "eager" and inner not in _attention_functions():
        raise ValueError(
            f"ZeroConfig.sequence_parallel: the model's attention implementation {inner!r} is not in transformers' "
            "attention registry; load the model with attn_implementation='sdpa' (or 'eager', 'flash_attention_2')."
        )


OWN_ATTENTION = ("FalconAttention",)  # attention modules of their own code that end in torch's sdpa


def _own_attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in OWN_ATTENTION]


def _check_own_attention(base: nn.Module, config: Any) -> None:
    """A model that computes attention in its own code: split around its sdpa call where that is the whole of it
    (`OWN_ATTENTION`, rotary positions, sdpa), else refused naming why."""
    own = _own_attention_modules(base)
    why = None
    if not own:
        why = "computes attention in its own code rather than through transformers' attention registry"
    elif getattr(config, "alibi", False):
        why = "adds ALiBi biases inside its own attention code, which would see only this rank's tokens"
    elif (getattr(config, "_attn_implementation", None) or "eager") != "sdpa":
        why = (
            f"computes attention in its own code, split around torch's scaled_dot_product_attention only under "
            f"attn_implementation='sdpa' (it runs {getattr(config, '_attn_implementation', None)!r}: load it with "
            "attn_implementation='sdpa')"
        )
    if why is not None:
        raise ValueError(
            f"ZeroConfig.sequence_parallel: {type(base).__name__} {why}, so its attention cannot be split by "
            "sequence. Models that use the registry (LLaMA, Mistral, Qwen2, Gemma, ...) and Falcon with rotary "
            "positions under sdpa can; train this one without sequence_parallel."
        )


def enable(model: nn.Module, group: CommGroup) -> None:
    """Split the model's sequences over `group` ([Note: sequence parallelism]); `check` first."""
    _register()
    disable(model)
    config: Any = model.config
    inner = getattr(config, "_attn_implementation", None) or "eager"
    handles = [
        model.register_forward_pre_hook(_split_inputs, with_kwargs=True),
        model.register_forward_hook(_join_outputs, with_kwargs=True),
    ]
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    own = _own_attention_modules(wrapped_model(model))
    for module in own:  # the exchange around its sdpa call, while a split forward runs
        handles.append(module.register_forward_pre_hook(_own_attention_begins, with_kwargs=True))
        handles.append(module.register_forward_hook(_own_attention_ends, always_call=True))
    state = SequenceParallel(
        group, inner, handles, head if isinstance(head, nn.Linear) else None, own_attention=bool(own)
    )
    for sub in model.modules():
        sub._hf_zero_sequence = state  # type: ignore[assignment]
    if state.head is not None:
        state.head.forward = functools.partial(_head_forward, state.head, state.head.forward)
    if not own:
        config._attn_implementation = ATTENTION


def disable(model: nn.Module) -> None:
    """Undo `enable` (the model's own attention implementation back, the hooks removed); nothing if not enabled."""
    state = getattr(model, "_hf_zero_sequence", None)
    if not isinstance(state, SequenceParallel):
        return
    for handle in state.handles:
        handle.remove()
    if state.head is not None:
        state.head.__dict__.pop("forward", None)
    for sub in model.modules():
        sub.__dict__.pop("_hf_zero_sequence", None)
    config: Any = model.config
    config._attn_implementation = state.inner


def _attention_functions() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if ATTENTION not in _attention_functions():
        AttentionInterface.register(ATTENTION, _attention)
    if ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        # the model builds its mask as for sdpa; the split attention uses it only where it runs unsplit
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _split_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Keep this rank's part of every sequence, with global positions and labels shifted over the whole."""
    state = _owner(module)
    state.active = None
    group = state.group
    config: Any = module.config
    config._attn_implementation = state.inner  # unsplit: the model exactly as it was (attention and masks)
    kwargs = dict(kwargs)
    if args:  # input_ids given positionally
        kwargs["input_ids"], args = args[0], args[1:]
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    cached = kwargs.get("past_key_values") is not None or kwargs.get("use_cache") is True
    if tokens is None or cached or kwargs.get("cache_position") is not None:
        return args, kwargs  # generation (it asks for a cache): unsplit, on every rank
    length = tokens.shape[1]
    if length % group.size:
        if module.training:
            raise ValueError(
                f"ZeroConfig.sequence_parallel={group.size}: a training sequence of {length} tokens does not split "
                f"into {group.size} equal parts; pad the batch to a multiple of {group.size} (e.g. "
                f"DataCollatorForLanguageModeling(pad_to_multiple_of={group.size}) or block_size a multiple)."
            )
        return args, kwargs  # evaluation of an odd length: unsplit, on every rank
    part = length // group.size
    lo, hi = group.rank * part, (group.rank + 1) * part
    for key in ("input_ids", "inputs_embeds", "token_type_ids"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key][:, lo:hi]
    positions = kwargs.get("position_ids")
    documents = _documents(positions, state, group.size)  # [Note: packed documents]
    if positions is None:
        positions = torch.arange(length, device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)
    kwargs["position_ids"] = positions[..., lo:hi]
    mask = kwargs.pop("attention_mask", None)
    padding = None if mask is None or bool(mask.all()) else mask.bool()
    labels = kwargs.get("labels")
    split = SequenceSplit(group, padding, documents=documents)
    split.unshifted = bool(kwargs.get("fused_lm_head")) and kwargs.get("shift_labels") is None
    if labels is not None:
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)
        kwargs["labels"] = kwargs["shift_labels"] = shifted[:, lo:hi].contiguous()
        if kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = (shifted != IGNORE).sum()
        fused = bool(kwargs.get("fused_lm_head"))  # TRL's fused head: per-token outputs of this rank's tokens
        if module.training and state.head is not None and not fused:  # [Note: tiled loss]: the head, in tiles
            count = kwargs.pop("num_items_in_batch")
            split = SequenceSplit(
                group, padding, labels=kwargs.pop("labels"), count=torch.as_tensor(count), documents=documents
            )
            kwargs.pop("shift_labels")
    kwargs["use_cache"] = False
    kwargs[ATTENTION] = split
    state.active = split
    if not state.own_attention:
        config._attn_implementation = ATTENTION  # split: attention through `_attention`
    return args, kwargs


def _head_forward(head: nn.Module, own: Callable[..., Any], hidden: torch.Tensor) -> torch.Tensor:
    """The LM head: its own forward, or in a split training forward with labels the tiled loss."""
    split = _owner(head).active
    if split is None or split.labels is None:
        return own(hidden)
    if hidden.shape[1] != split.labels.shape[1]:
        raise RuntimeError(
            f"[rank {split.group.global_rank}] hf_zero: the LM head was called on {hidden.shape[1]} tokens where "
            f"this rank holds {split.labels.shape[1]}; the tiled loss needs the head applied to every token once"
        )
    loss = tiled_cross_entropy(hidden, head, split.labels, split.count)  # type: ignore[arg-type]
    split.head_loss.append(loss)
    return loss


def _join_outputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """The loss of the whole micro-batch (gradient: N x this rank's part), or the whole sequence's logits."""
    split = kwargs.get(ATTENTION)
    if not isinstance(split, SequenceSplit):
        return output
    if split.calls[0] == 0:
        raise RuntimeError(
            f"[rank {split.group.global_rank}] hf_zero: {type(module).__name__}'s forward split its sequences but "
            "never called the attention registry's function: it computes attention in its own code, which would see "
            "only this rank's tokens. Train it without sequence_parallel."
        )
    _owner(module).active = None
    loss: torch.Tensor | None
    if split.labels is not None:  # [Note: tiled loss]: the head's output is this rank's part of the loss
        loss = _tiled_part(output, split)
    else:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is not None:
        whole = loss.detach().clone()
        all_reduce_(whole, split.group)
        n = split.group.size
        output["loss"] = loss * n + (whole - loss.detach() * n)
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if logits is not None and (loss is None or not module.training):  # whole for the caller's own use
        output["logits"] = gather_dim(logits, split.group, dim=1)
    if kwargs.get("fused_lm_head") and isinstance(output, dict):
        _gather_per_token(output, split, kwargs["position_ids"].shape[-1], split.unshifted)
    return output


def _gather_per_token(output: dict[str, Any], split: SequenceSplit, part: int, unshifted: bool) -> None:
    """TRL's fused LM head (`fused_lm_head=True`) returns per-token fields (log-probabilities, entropy, the label
    mask, ...) of this rank's tokens: each comes back whole along the sequence, so that the caller's loss, sums per
    sequence and metrics see every token; the gradient of a loss computed from them on every rank of the group is
    the gather's sum, N times the rank's own part, as the model's own loss's is. Given `labels` alone (`unshifted`)
    the unsplit head scores every position but the last (whose label is past the sequence): the last is dropped,
    so each field has the shape it would have unsplit."""
    for key, value in list(output.items()):
        per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == part
        if key in ("loss", "logits") or not per_token:
            continue
        if value.dtype == torch.bool:
            whole = gather_dim(value.to(torch.uint8), split.group, dim=1).bool()
        else:
            whole = gather_dim(value, split.group, dim=1)
        output[key] = whole[:, :-1] if unshifted else whole


def _tiled_part(output: Any, split: SequenceSplit) -> torch.Tensor:
    """The loss the head computed, taken out of the output's logits (the model must have returned it as is)."""
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if len(split.head_loss) != 1 or logits is not split.head_loss[0]:
        raise RuntimeError(
            f"[rank {split.group.global_rank}] hf_zero: with sequence_parallel the LM head computes the loss in "
            "tiles, but this model changes the head's output before returning it (logit scaling or capping) or "
            "calls the head more than once; train it without sequence_parallel."
        )
    OrderedDict.__delitem__(output, "logits")  # the tiles' logits exist no more: none is returned
    object.__setattr__(output, "logits", None)
    return logits


def _inner_function(module: nn.Module, inner: str) -> Callable[..., Any]:
    if inner == "eager":
        found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if found is None:
            raise ValueError(
                f"hf_zero sequence parallelism: {type(module).__name__} has no eager_attention_forward; load the "
                "model with attn_implementation='sdpa'."
            )
        return found
    return _attention_functions()[inner]


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention: heads for tokens, the model's own attention on whole sequences, and back."""
    split = kwargs.pop(ATTENTION, None)
    owner = _owner(module)
    inner = _inner_function(module, owner.inner)
    if not isinstance(split, SequenceSplit):  # an unsplit forward (generation, odd lengths in evaluation)
        return inner(module, query, key, value, attention_mask, **kwargs)
    group = split.group
    split.calls[0] += 1
    runs: Any = module
    if key.shape[1] % group.size:  # fewer key-value heads than ranks: each query head gets its own copy
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        runs = _OneGroup(module)
    # (batch, heads, tokens/N, dim) -> (batch, heads/N, tokens, dim)
    query, key, value = (all_to_all_dims(t, group, split_dim=1, cat_dim=2) for t in (query, key, value))
    if split.spans is not None and split.padding is None and owner.inner == "sdpa":  # [Note: packed documents]

        def attend(row: int, start: int, end: int) -> torch.Tensor:
            part = (t[row : row + 1, :, start:end] for t in (query, key, value))
            return inner(runs, *part, None, **kwargs)[0]  # no mask: causal within the document

        out = _by_document(split.spans, attend, token_dim=1)
    else:
        mask = _whole_mask(split.padding, query, owner.inner, split.documents)
        out, _ = inner(runs, query, key, value, mask, **kwargs)  # (batch, tokens, heads/N, dim)
    return all_to_all_dims(out, group, split_dim=1, cat_dim=2), None  # (batch, tokens/N, heads, dim)


_TORCH_SDPA: dict[str, Callable[..., torch.Tensor]] = {}


def _own_attention_begins(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
    """An `OWN_ATTENTION` module starts: in a split forward, or its replay in the backward (found by the rotary
    tables it is given, the same tensors), its sdpa call becomes the exchange around torch's."""
    state = _owner(module)
    tables = kwargs.get("position_embeddings")
    cos = tables[0] if isinstance(tables, tuple) and tables and isinstance(tables[0], torch.Tensor) else None
    split = state.active
    if split is not None and cos is not None:
        for old in [k for k, (ref, _) in state.recomputed.items() if ref() is None]:
            del state.recomputed[old]
        state.recomputed[id(cos)] = (weakref.ref(cos), split)
    elif split is None and cos is not None and in_backward():
        ref, found = state.recomputed.get(id(cos), (None, None))
        split = found if ref is not None and ref() is cos else None
    if split is None:
        return
    _TORCH_SDPA.setdefault("sdpa", torch.nn.functional.scaled_dot_product_attention)
    torch.nn.functional.scaled_dot_product_attention = functools.partial(_split_sdpa, split)


def _own_attention_ends(module: nn.Module, args: Any, output: Any) -> None:
    if "sdpa" in _TORCH_SDPA:
        torch.nn.functional.scaled_dot_product_attention = _TORCH_SDPA["sdpa"]


def _split_sdpa(
    split: SequenceSplit,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """torch's sdpa on whole sequences for 1/N of the heads: (batch, heads, tokens/N, dim) in and out. The module's
    own mask (causal over this rank's tokens) is replaced by the whole sequence's, with the batch's padding."""
    group = split.group
    split.calls[0] += 1
    if key.shape[1] % group.size:  # fewer key-value heads than ranks (Falcon's one): each query head its own copy
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    query, key, value = (all_to_all_dims(t, group, split_dim=1, cat_dim=2) for t in (query, key, value))
    sdpa = _TORCH_SDPA["sdpa"]
    if split.spans is not None and split.padding is None:  # [Note: packed documents]

        def attend(row: int, start: int, end: int) -> torch.Tensor:
            part = (t[row : row + 1, :, start:end] for t in (query, key, value))
            return sdpa(*part, dropout_p=dropout_p, is_causal=True, scale=scale)

        out = _by_document(split.spans, attend, token_dim=2)
    else:
        mask = _whole_mask(split.padding, query, "sdpa", split.documents)
        out = sdpa(query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, scale=scale)
    return all_to_all_dims(out, group, split_dim=2, cat_dim=1)


class _OneGroup:
    """An attention module seen with one query head per key-value head (its key-value heads were replicated)."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _documents(positions: torch.Tensor | None, state: SequenceParallel, size: int) -> torch.Tensor | None:
    """[Note: packed documents]
    A packed row (documents end to end, `position_ids` restarting at each: `DataCollatorWithFlattening`, TRL's
    `padding_free`) is split like any row: each rank keeps its part of the tokens and their per-document positions
    (RoPE sees each token where it is in its document), and the labels, shifted over the whole row, ignore each
    document's first token as the collator set them. Attention sees whole rows after the all-to-all, and each
    document only, as transformers' block-diagonal mask has the unsplit model see it, from the document index of
    every token of the whole row, computed here before the split: under sdpa each document of each row is attended
    on its own, causally, with no mask (no tokens x tokens tensor: at 16384 tokens a boolean mask took 256 MiB and
    the float mask sdpa makes of it 1 GiB, per layer's call; and the blocks across documents are not computed);
    under eager attention, or with padding in the batch, the whole block-diagonal mask. Flash attention would take
    cumulative lengths instead: refused by name."""
    if positions is None or not bool((positions[..., 1:] != positions[..., :-1] + 1).any()):
        return None
    if state.inner not in ("sdpa", "eager"):
        raise ValueError(
            f"ZeroConfig.sequence_parallel={size}: packed documents (position_ids restarting inside a row) are split "
            f"with sdpa or eager attention, which take the per-document mask; the model runs {state.inner!r}. Load it "
            "with attn_implementation='sdpa'."
        )
    restarts = torch.ones_like(positions, dtype=torch.long)
    restarts[..., 1:] = (positions[..., 1:] != positions[..., :-1] + 1).long()
    return restarts.cumsum(-1)


def _document_spans(documents: torch.Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """[Note: packed documents] per row, each document's `[start, end)` in the whole row."""
    spans = []
    for row in documents:
        ends = list(itertools.accumulate(torch.unique_consecutive(row, return_counts=True)[1].tolist()))
        spans.append(tuple(zip([0, *ends[:-1]], ends)))
    return tuple(spans)


def _by_document(
    spans: tuple[tuple[tuple[int, int], ...], ...], attend: Callable[[int, int, int], torch.Tensor], token_dim: int
) -> torch.Tensor:
    """[Note: packed documents] `attend(row, start, end)` of every document of every row (causal within it, no
    mask), joined along the tokens, then the rows."""
    rows = [torch.cat([attend(b, start, end) for start, end in row], dim=token_dim) for b, row in enumerate(spans)]
    return torch.cat(rows, dim=0)


def _whole_mask(
    padding: torch.Tensor | None, query: torch.Tensor, inner: str, documents: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Causal over the whole sequence, with the batch's padding (keys that are padding are masked), as transformers
    builds it for the unsplit model, so that a query with no key left (left padding) gets what the implementation
    gives it there; `None` (the kernel's own causal masking) when nothing is padded and the implementation masks
    causally by itself."""
    length = query.shape[2]
    if padding is None and documents is None and inner != "eager":
        return None
    if documents is not None:  # [Note: packed documents]: within each document only, built in place (one boolean
        documents = documents.to(query.device)  # per pair of tokens: 256 MiB at 16384 tokens, not three times it)
        allowed = (documents[:, :, None] == documents[:, None, :]).tril_()
        if padding is not None:
            allowed.logical_and_(padding.to(query.device)[:, None, :])
    else:
        causal = torch.ones(1, length, length, dtype=torch.bool, device=query.device).tril_()
        allowed = causal if padding is None else causal & padding.to(query.device)[:, None, :]
    allowed = allowed.unsqueeze(1)
    if inner == "eager":  # an additive mask
        return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~allowed, torch.finfo(query.dtype).min
        )
    return allowed


def _owner(module: nn.Module) -> SequenceParallel:
    """The sequence-parallel state of the model an attention module belongs to (`enable` marks each module)."""
    state = getattr(module, "_hf_zero_sequence", None)
    if not isinstance(state, SequenceParallel):
        raise RuntimeError(
            f"hf_zero: {type(module).__name__} runs the sequence-parallel attention but belongs to no model that "
            "hf_zero.initialize split by sequence"
        )
    return state
