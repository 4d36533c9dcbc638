"""The fuzzer's models (tests/_fuzz.py): the peer scenarios' `Net` with the data flows of the models users train.

A program's `flow` picks how tensors move between the blocks:

- `plain`: each block takes the previous one's output (`Net`'s own forward);
- `moe`: each block is a mixture of two experts, the second reached only by the rows the data routes to it (so on
  some ranks and steps no row reaches it), and returns `(hidden, aux)`, a router loss the root adds to its output
  (Mixtral's and Qwen-MoE's `output_router_logits`);
- `long`: block 0's output also goes, past the other blocks, into the head (a long skip connection);
- `shared`: a parameter of the root is passed to every block as a keyword argument (a learned offset every layer
  reads, as prompt or position parameters of the root are);
- `relative`: block 0 computes a bias from its own parameter and returns it beside its output; every later block takes
  it as a keyword argument (T5's `position_bias`, computed by the first layer, passed to the rest);
- `tokens`: `plain`, the input taken as token ids into an embedding (the language model's case; `TokenInput`), the
  embedding a unit of its own, whose gradient travels as the rows looked up ([Note: sparse lookup gradients]); with
  `tied_head`, a second head whose weight is the embedding's (tied word embeddings: Gemma, Qwen, Llama 3.2 1B), its
  logits added to the output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from tests._peer_harness import Block, D, Net

FLOWS = ("plain", "moe", "long", "shared", "relative")  # and `tokens`, drawn after them (tests/_fuzz_grammar.py)
VOCAB = 24


class MoEBlock(Block):
    """A block with a second expert for the rows whose first feature is above 0.5, and a router loss."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, 2)
        self.alt = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = super().forward(x)
        probs = torch.softmax(self.gate(self.norm(x)), dim=-1)
        routed = (x[:, 0] > 0.5).nonzero().flatten()
        if routed.numel():
            extra = torch.tanh(self.alt(x[routed])) * probs[routed, 1:]
            h = h.index_add(0, routed, extra)
        return h, probs.mean(0).pow(2).sum()


class ShiftBlock(Block):
    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x + shift)


class RelativeBlock(Block):
    """Computes `bias` from its own `rel` when it is given none (the first block), and returns it with its output."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.linspace(-0.2, 0.2, D))

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bias = torch.tanh(self.rel * 2.0) if bias is None else bias
        return super().forward(x + bias), bias


class TokenInput(nn.Module):
    """Each input feature bucketed into one of `VOCAB` token ids, their embedding rows averaged: a batch looks up
    some rows, several times, and leaves the others without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.remainder(torch.floor(x.float() * 4).long(), VOCAB)
        return self.emb(ids).mean(1)


_BLOCKS: dict[str, type[Block]] = {"moe": MoEBlock, "shared": ShiftBlock, "relative": RelativeBlock}


class FlowNet(Net):
    """`Net` with the blocks and forward of `flow` (see the module docstring); the same keyword arguments."""

    def __init__(self, n: int, batchnorm: bool, flow: str, tied_head: bool = False) -> None:
        super().__init__(n=n, batchnorm=batchnorm, block=_BLOCKS.get(flow, Block))
        self.flow = flow
        self.shift = nn.Parameter(torch.full((D,), 0.1)) if flow == "shared" else None
        self.tied: nn.Linear | None = None
        if flow == "tokens":
            self.inp = TokenInput()  # type: ignore[assignment]
            if tied_head:
                self.tied = nn.Linear(D, VOCAB, bias=False)
                self.tied.weight = self.inp.emb.weight

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        spare: bool = False,
        reuse: int = 1,
        skip: tuple[int, ...] = (),
        recompute: bool = False,
    ) -> torch.Tensor:
        if self.flow == "plain":
            return super().forward(x, spare=spare, reuse=reuse, skip=skip, recompute=recompute)
        h, first, aux, bias = self.inp(x), None, None, None
        for i, block in enumerate(self.blocks):
            for _ in range(0 if i in skip else reuse if i == 0 else 1):
                kwargs: dict[str, Any] = {}
                if self.flow == "shared":
                    kwargs["shift"] = self.shift
                elif self.flow == "relative" and bias is not None:
                    kwargs["bias"] = bias
                out = (
                    torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, **kwargs)
                    if recompute
                    else block(h, **kwargs)
                )
                if self.flow == "moe":
                    h, aux = out[0], out[1] if aux is None else aux + out[1]
                elif self.flow == "relative":
                    h, bias = out
                else:
                    h = out
                first = h if first is None else first
        if self.flow == "long" and first is not None:
            h = h + first
        h = self.bn(h) if self.bn is not None else h
        out = self.head(h) + (self.spare(h) if spare else 0.0)
        if self.tied is not None:
            out = out + 0.05 * self.tied(h)[:, : out.shape[-1]]
        return out + 0.01 * aux if aux is not None else out


def block_class(flow: str) -> str:
    """The class name of `flow`'s blocks (`ZeroConfig.wrap`)."""
    return _BLOCKS.get(flow, Block).__name__


def unit_classes(flow: str) -> tuple[str, ...]:
    """`ZeroConfig.wrap` for `flow`: its blocks, and for `tokens` the embedding too (a unit of its own)."""
    return (block_class(flow), "Embedding") if flow == "tokens" else (block_class(flow),)
