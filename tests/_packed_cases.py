"""Packed rows (several documents in one row, `position_ids` restarting at each, no attention mask: what
transformers' `DataCollatorWithFlattening` and TRL's `padding_free` give) under hf_zero without sequence
parallelism, against one process (tests/test_sequence_parallel.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from tests._training import make_model, make_optimizer


def packed_row(rank: int, step: int) -> dict[str, torch.Tensor]:
    """One row of 3-4 documents of different lengths, as DataCollatorWithFlattening packs them (labels ignored at
    each document's first token)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = [5 + int(torch.randint(0, 9, (1,), generator=g)) for _ in range(3 + rank % 2)]
    docs = [torch.randint(0, 200, (n,), generator=g) for n in lengths]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])
    return {"input_ids": torch.cat(docs)[None], "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "labels": labels[None]}


def _steps(
    model: torch.nn.Module, opt: Any, rows: list[list[dict[str, torch.Tensor]]]
) -> tuple[list[float], list[float]]:
    """3 steps; in each, every row of `rows[step]` is a rank's (the losses of a step averaged over them, as DDP
    averages the gradients). The losses and the gradient norms before clipping."""
    losses, norms = [], []
    for step_rows in rows:
        loss = sum(model(**row, use_cache=False).loss for row in step_rows) / len(step_rows)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def packed_against_one_process(kind: str, stage: int) -> dict[str, Any]:
    """The unsharded model on packed rows attends within documents (its logits for a packed row equal those of
    each document alone); 3 steps of hf_zero at `stage` on each rank's packed row against one process on all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_model(kind).eval()
    row = packed_row(0, 0)
    with torch.no_grad():
        packed = ref(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits[0]
        starts = (row["position_ids"][0] == 0).nonzero().flatten().tolist() + [row["input_ids"].shape[1]]
        alone = torch.cat([ref(input_ids=row["input_ids"][:, a:b], use_cache=False).logits[0]
                           for a, b in zip(starts, starts[1:])])
    ref.train()
    ref_opt = make_optimizer(ref, 1e-3)
    ref_losses, ref_norms = _steps(ref, ref_opt, [[packed_row(r, s) for r in range(world)] for s in range(3)])
    model = make_model(kind)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3),
                                    hf_zero.ZeroConfig(stage=stage))
    own, norms = _steps(model, opt, [[packed_row(rank, s)] for s in range(3)])
    losses = torch.tensor(own)
    dist.all_reduce(losses)
    state = hf_zero.full_state_dict(model, rank0_only=False)
    return {
        "within_documents": float((packed - alone).abs().max()),
        "reference": ref_losses, "losses": (losses / world).tolist(), "reference_norms": ref_norms, "norms": norms,
        "weights": {k: float((state[k] - v).norm() / v.norm()) for k, v in ref.state_dict().items()},
    }


def _even_row(step: int) -> dict[str, torch.Tensor]:
    """A packed row of an even length (it splits over 2 ranks), two rows in a batch."""
    rows = []
    for r in range(2):
        row = packed_row(r, step)
        if row["input_ids"].shape[1] % 2:
            row = {k: v[:, :-1] for k, v in row.items()}
        rows.append(row)
    length = min(r["input_ids"].shape[1] for r in rows)
    return {k: torch.cat([r[k][:, :length] for r in rows]) for k in rows[0]}


def packed_split(kind: str, stage: int) -> dict[str, Any]:
    """[Note: packed documents] 2 ranks, one sequence-parallel group, each holding half of every packed row, 3
    clipped AdamW steps, against one process on the whole rows."""
    kind, _, attention = kind.partition("-")  # "llama-sdpa": LLaMA under sdpa, through the attention registry
    ref = make_model(kind)
    if kind == "falcon" or attention == "sdpa":  # Falcon's attention is split around torch's sdpa call
        ref.config._attn_implementation = "sdpa"
    ref_opt = make_optimizer(ref, 1e-3)
    ref_losses, ref_norms = _steps(ref, ref_opt, [[_even_row(s)] for s in range(3)])
    model = make_model(kind)
    if kind == "falcon" or attention == "sdpa":
        model.config._attn_implementation = "sdpa"
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3),
                                    hf_zero.ZeroConfig(stage=stage, sequence_parallel=2))
    losses, norms = _steps(model, opt, [[_even_row(s)] for s in range(3)])
    state = hf_zero.full_state_dict(model, rank0_only=False)
    return {"reference": ref_losses, "losses": losses, "reference_norms": ref_norms, "norms": norms,
            "weights": {k: float((state[k] - v).norm() / v.norm()) for k, v in ref.state_dict().items()}}
