"""Sequence parallelism ([Note: sequence parallelism]): each rank of a group holds 1/N of every sequence, and the
training equals single-process training on the whole sequences (fp32: losses, gradient norms and weights within
1e-5), with gradient accumulation, clipping, left and right padding and ignored labels."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests import _sequence_cases as cases
from tests._training import rel_err


@pytest.fixture(scope="module")
def reference_one_group():
    return cases.reference(1)


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow), 3])  # stage 2: its reduction is stage 1's per micro-batch
def test_two_ranks_one_sequence_equal_single_process(pools, reference_one_group, stage):
    ref = reference_one_group
    results = pools(2).values(cases.split_run, stage, 2)
    for r in results:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-6)
        np.testing.assert_allclose(r["local_losses"], ref["losses"], rtol=1e-6)  # every rank reports the whole loss
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5)
    for name, value in ref["state"].items():
        assert rel_err(results[0]["state"][name], value) <= 1e-5, name


def test_two_ranks_with_gradient_checkpointing(pools, reference_one_group):
    ref = reference_one_group
    r = pools(2).values(cases.split_run, 3, 2, True)[0]
    np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-6)
    for name, value in ref["state"].items():
        assert rel_err(r["state"][name], value) <= 1e-5, name


@pytest.mark.parametrize("size", [2, 1], ids=["sequence-parallel", "data-parallel"])
def test_tiled_mlp_trains_as_the_whole_mlp(pools, size):
    """[Note: tiled MLP]: `tiled_mlp=True` at stage 3 with gradient checkpointing, tiles of 3 tokens (uneven: 8
    tokens per rank under sequence parallelism 2, 16 without): losses, gradient norms and weights equal single-process
    training of the untiled model (1e-5), with or without sequence parallelism; the tiles did run."""
    ref = cases.reference(2 // size)
    results = pools(2).values(cases.split_run, 3, size, True, True)
    for r in results:
        assert r["tiles"] > 0
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-6)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5)
    for name, value in ref["state"].items():
        assert rel_err(results[0]["state"][name], value) <= 1e-5, name


def test_tiled_mlp_holds_one_tiles_activations():
    """[Note: tiled MLP], without any process group: a LLaMA MLP on 64 tokens in tiles of 8 saves for its backward
    only its input (the whole sequence's gate, up and activation are not kept), and its outputs and gradients equal
    the untiled MLP's; in eval and under no_grad it runs untiled."""
    from hf_zero.features import tiled_mlp
    from tests._training import make_model

    model = make_model("llama")
    mlp = model.model.layers[0].mlp
    hidden = torch.randn(2, 64, 64, requires_grad=True)

    def saved_bytes(fn):  # noqa: ANN001, ANN202
        held = {}  # by storage: the tiles are views of the input

        def pack(t):  # noqa: ANN001, ANN202
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return out, sum(held.values())

    whole, whole_bytes = saved_bytes(lambda: mlp(hidden))
    (whole * torch.arange(64.0).view(1, 64, 1)).sum().backward()
    expected = [hidden.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    hidden.grad = None
    mlp.zero_grad()
    assert tiled_mlp.enable(model) == 2
    tiled_mlp.TILE_BYTES, before = 2 * 128 * 4 * 8, tiled_mlp.TILE_BYTES  # 8 tokens per tile
    try:
        tiled, tiled_bytes = saved_bytes(lambda: mlp(hidden))
        (tiled * torch.arange(64.0).view(1, 64, 1)).sum().backward()
        mlp.eval()
        with torch.no_grad():
            torch.testing.assert_close(mlp(hidden), whole.detach(), rtol=1e-6, atol=1e-6)
    finally:
        tiled_mlp.TILE_BYTES = before
    assert tiled_bytes <= hidden.untyped_storage().nbytes() < whole_bytes / 4, (tiled_bytes, whole_bytes)
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)
    for got, want in zip([hidden.grad] + [p.grad for p in mlp.parameters()], expected):  # sums over other tiles
        assert rel_err(got.numpy(), want.numpy()) <= 1e-6


def test_trl_fused_log_probabilities_come_back_whole(pools):
    """TRL's fused LM head on the split model (2 ranks, stage 3, training, padding and ignored labels): the
    per-token log-probabilities, entropy and label mask are the unsplit model's over the whole sequence, and the
    gradient of their sum has the unsplit model's norm."""
    pytest.importorskip("trl")
    for r in pools(2).values(cases.trl_fused_head, 2):
        assert r["shape"] and r["mask"], r
        assert r["sums"] <= 1e-5 * r["scale"] and r["entropy"] <= 1e-5, r
        assert abs(r["norm"] - r["want_norm"]) <= 1e-5 * r["want_norm"], r


def test_tiled_mlp_refuses_what_it_cannot_tile():
    """No decoder MLP: refused (at `initialize`, on every rank, through `check`); an `mlp` that returns more than
    one tensor (a mixture of experts routing over the batch): refused at its first tiled forward."""
    from hf_zero.features import tiled_mlp

    with pytest.raises(ValueError, match="has no decoder MLP"):
        tiled_mlp.check(torch.nn.Sequential(torch.nn.Linear(4, 4)))

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(4, 4)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.up(x), x.mean()

    model = torch.nn.Module()
    model.mlp = Routed()
    seen = []
    installed = model.mlp.forward
    model.mlp.forward = lambda x: (seen.append(x.shape), installed(x))[1]  # as Accelerate's hooks install one
    tiled_mlp.enable(model)
    tiled_mlp.enable(model)  # again: still one tiling around the installed forward
    assert model.mlp.forward.args[1].__name__ == "<lambda>"
    with pytest.raises(ValueError, match="returns tuple, not one tensor"):
        model.mlp(torch.randn(1, 10_000_000 // 4, 4))
    assert seen, "the forward installed before tiled_mlp was dropped"


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])  # stage 1 on 2 ranks above
def test_sequence_2_by_data_2_on_four_ranks(pools, stage):
    ref = cases.reference(2)
    results = pools(4).values(cases.split_run, stage, 2)
    for r in results:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-6)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5)
    for name, value in ref["state"].items():
        assert rel_err(results[0]["state"][name], value) <= 1e-5, name


def test_fewer_key_value_heads_than_ranks_are_replicated(pools, reference_one_group):
    """4 ranks on one sequence of a model with 2 key-value heads: each rank gets a copy of the key-value head
    its query heads use; still exact."""
    ref = reference_one_group
    results = pools(4).values(cases.split_run, 3, 4)
    for r in results:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-6)
    for name, value in ref["state"].items():
        assert rel_err(results[0]["state"][name], value) <= 1e-5, name


def test_a_model_whose_layers_share_the_root_unit(pools):
    for r in pools(2).values(cases.one_unit_model_loss, 2):
        assert abs(r["loss"] - r["expected"]) <= 1e-6 * abs(r["expected"]), r


def test_a_ddp_users_loop_and_a_peft_model_train_as_unsplit(pools):
    """Two forwards before one backward with torch's clip_grad_norm_, and a LoRA model: as on the whole sequences."""
    for r in pools(2).values(cases.user_loops, 2):
        for got, expected, tol in (("norm", "expected_norm", 1e-5), ("lora_loss", "expected_lora_loss", 1e-6),
                                   ("lora_norm", "expected_lora_norm", 1e-5)):
            assert abs(r[got] - r[expected]) <= tol * abs(r[expected]), (got, r)


def test_logits_without_labels_come_back_whole_and_generate_runs_unsplit(pools):
    for r in pools(2).values(cases.logits_without_labels, 2):
        assert r["shape"] == [2, cases.SEQ, 256] and r["err"] < 1e-5
        assert r["generated"]


@pytest.mark.parametrize(
    "size,what,message",
    [
        (2, "odd", "a training sequence of 15 tokens does not split into 2 equal parts"),
        (3, "heads", "the model has 4 attention heads and 2 key-value heads; the attention heads must be a multiple"),
        (2, "falcon", "FalconForCausalLM computes attention in its own code, split around torch's "
                      "scaled_dot_product_attention only under attn_implementation='sdpa' (it runs 'eager'"),
        (2, "scaled", "this model changes the head's output before returning it"),
    ],
)
def test_what_cannot_be_split_is_refused_on_every_rank(pools, size, what, message):
    results = pools(size).values(cases.refused, size, what)
    for r in results:
        assert r["type"] == ("RuntimeError" if what == "scaled" else "ValueError") and message in r["error"], r


@pytest.mark.parametrize("via", ["plugin", "parallelism_config"])
def test_accelerate_deals_batches_to_data_parallel_groups(pools, via):
    """`ZeroPlugin(zero_sequence_parallel=2)` (or Accelerate's `ParallelismConfig(sp_size=2)`) on 4 ranks: ranks
    0-1 see the same samples, ranks 2-3 the same others, together every sample once; every rank of a group reports
    its group's loss. `gather_for_metrics` gives every rank each held-out sample once (7 samples: the last batch is
    short), as tensors and as objects."""
    results = pools(4).values(cases.accelerate_batches, 2, via)
    for r in results:
        assert sorted(r["gathered"]) == list(range(7)), r["gathered"]
        assert sorted(r["objects"]) == [f"sample {i}" for i in range(7)], r["objects"]
    assert all(r["sequence_parallel"] == 2 for r in results)
    assert results[0]["seen"] == results[1]["seen"] and results[2]["seen"] == results[3]["seen"]
    assert sorted(results[0]["seen"] + results[2]["seen"]) == list(range(8))
    assert results[0]["loss"] == results[1]["loss"] and results[2]["loss"] == results[3]["loss"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_loss_equals_the_whole_logits_loss(monkeypatch, dtype):
    """[Note: tiled loss]: tiles of 5 tokens give the loss, and the gradients of the hidden states, the head's
    weight and bias (for a loss scaled after it), that the whole (tokens x vocabulary) logits give (fp32: 1e-6; bf16: the head's matmuls in
    bf16 either way), with ignored labels."""
    from hf_zero.features import tiled_loss

    monkeypatch.setattr(tiled_loss, "TILE_BYTES", 5 * 4 * 50)  # 5 tokens per tile for a vocabulary of 50
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 13, 16, generator=g).to(dtype).requires_grad_()
    head = torch.nn.Linear(16, 50).to(dtype)
    labels = torch.randint(0, 50, (2, 13), generator=g)
    labels[0, :4] = -100
    count = (labels != -100).sum()
    with torch.no_grad():  # the loss only
        plain = tiled_loss.tiled_cross_entropy(hidden, head, labels, count)
    got = tiled_loss.tiled_cross_entropy(hidden, head, labels, count)
    assert not plain.requires_grad and torch.equal(plain, got.detach())
    (got * 0.5).backward()  # the gradients computed in the forward, scaled by the one the backward receives
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    logits = head(hidden).float()
    want = torch.nn.functional.cross_entropy(logits.view(-1, 50), labels.view(-1), ignore_index=-100, reduction="sum")
    (want / count * 0.5).backward()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want / count, rtol=tol, atol=tol)
    for a, b in zip(grads, [hidden.grad, head.weight.grad, head.bias.grad]):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    expected = hidden.grad.clone()
    hidden.grad = head.weight.grad = head.bias.grad = None
    head.requires_grad_(False)  # a frozen head (LoRA): the hidden states' gradient only, none computed for it
    frozen = tiled_loss.tiled_cross_entropy(hidden, head, labels, count)
    assert [t is None for t in frozen.grad_fn.saved_tensors[:3]] == [False, True, True]  # nothing held for the head
    (frozen * 0.5).backward()
    assert head.weight.grad is None and head.bias.grad is None
    torch.testing.assert_close(hidden.grad.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind, stage", [("llama", 1), ("llama", 2), ("llama", 3), ("falcon", 3)])
def test_packed_documents_without_sequence_parallelism_equal_one_process(pools, kind, stage):
    """Packed rows (documents end to end, position_ids restarting, labels ignored at each start, no attention mask;
    transformers then attends within each document only: checked against each document alone) train under hf_zero
    as in one process on every rank's row: losses, gradient norms and weights within 1e-5 after 3 clipped AdamW
    steps."""
    from tests import _packed_cases

    for r in pools(2).values(_packed_cases.packed_against_one_process, kind, stage):
        assert r["within_documents"] < 1e-5, r["within_documents"]
        np.testing.assert_allclose(r["losses"], r["reference"], rtol=1e-5)
        np.testing.assert_allclose(r["norms"], r["reference_norms"], rtol=1e-5)
        assert max(r["weights"].values()) <= 1e-5, {k: v for k, v in r["weights"].items() if v > 1e-5}


@functools.lru_cache(maxsize=None)
def _falcon_reference(groups: int) -> dict:
    return cases.reference(groups, "falcon")


@pytest.mark.parametrize("stage, checkpointing", [(1, False), (2, False), (3, False), (3, True)])
def test_falcon_with_one_key_value_head_splits_around_its_own_attention(pools, stage, checkpointing):
    """Falcon computes attention in its own code (multi-query: one key-value head); its sdpa call is split (heads
    for tokens around it, the key-value head replicated for the query heads and its gradient summed back): 2 ranks on
    one sequence with padding and ignored labels, accumulation and clipping, as one process on the whole sequences
    (fp32: losses 1e-6, norms and weights 1e-5), with gradient checkpointing replaying the split attention."""
    ref = _falcon_reference(1)
    results = pools(2).values(cases.split_run, stage, 2, checkpointing, False, "falcon")
    for r in results:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-6)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5)
    for name, value in ref["state"].items():
        assert rel_err(results[0]["state"][name], value) <= 1e-5, name


@pytest.mark.parametrize("kind, stage, world", [("llama", 1, 2), ("llama", 2, 2), ("llama", 3, 2), ("falcon", 1, 2),
                                                ("falcon", 2, 2), ("falcon", 3, 2), ("qwen2", 1, 2), ("qwen2", 2, 2),
                                                ("qwen2", 3, 2), ("llama", 3, 4), ("llama-sdpa", 1, 2),
                                                ("llama-sdpa", 3, 2), ("llama-sdpa", 3, 4)])
def test_packed_documents_split_by_sequence_equal_one_process(pools, kind, stage, world):
    """[Note: packed documents] Packed rows (documents restarting their positions, labels ignored at each start)
    split over 2 ranks: each rank's attention, on whole rows after the exchange, sees each document only; losses,
    gradient norms and weights equal one process on the whole rows within 1e-5 after 3 clipped AdamW steps (LLaMA
    through the attention registry under eager attention's mask and under sdpa, which attends each document on its
    own, Falcon around its own sdpa call, Qwen2 under eager attention's additive mask); on 4 ranks, 2 groups of 2
    (sequence 2 x data 2) at stage 3, each group on the same rows."""
    from tests import _packed_cases

    for r in pools(world).values(_packed_cases.packed_split, kind, stage):
        np.testing.assert_allclose(r["losses"], r["reference"], rtol=1e-5)
        np.testing.assert_allclose(r["norms"], r["reference_norms"], rtol=1e-5)
        assert max(r["weights"].values()) <= 1e-5, {k: v for k, v in r["weights"].items() if v > 1e-5}


def test_packed_documents_under_flash_attention_are_refused_naming_sdpa():
    """[Note: packed documents] flash attention takes cumulative lengths rather than a mask: a packed row split under
    it is refused by name (every rank computes the same positions, so every rank refuses)."""
    from hf_zero.features import sequence_parallel as sequence

    state = sequence.SequenceParallel(group=None, inner="flash_attention_2", handles=[])  # type: ignore[arg-type]
    restart = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    with pytest.raises(ValueError, match="packed documents .* are split with sdpa or eager attention.*'flash_attention"):
        sequence._documents(restart, state, 2)
    assert sequence._documents(torch.arange(8)[None], state, 2) is None  # one document: nothing to mask
    eager = sequence.SequenceParallel(group=None, inner="eager", handles=[])  # type: ignore[arg-type]
    assert sequence._documents(restart, eager, 2).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]]


_HEAP_PROBE = """
import sys, torch
from hf_zero.engine.pool import map_large_host_allocations
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
if sys.argv[1] == 'fixed':
    map_large_host_allocations()
big = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB: mapped, then freed, raises glibc's dynamic threshold
del big
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(16)]  # 64 MiB of 4 MiB blocks
pin = torch.ones(256 << 10, dtype=torch.uint8)  # a small block above them: the heap's top cannot be trimmed
before = rss()
del blocks
print(before - rss())
"""


def test_a_cpu_run_hands_large_freed_blocks_back_to_the_system():
    """[Note: host heap] `map_large_host_allocations` (what a sequence-parallel run on the CPU sets): 4 MiB blocks
    freed go back to the system at once; under glibc's dynamic threshold (raised past them by an earlier 8 MiB
    block) they stay in the heap, under a block still in use."""
    import subprocess
    import sys

    freed = {how: int(subprocess.run([sys.executable, "-c", _HEAP_PROBE, how], capture_output=True, text=True,
                                     check=True).stdout.split()[-1]) for how in ("dynamic", "fixed")}
    assert freed["fixed"] >= 60 << 20, freed
    assert freed["dynamic"] < 16 << 20, freed


_FROZEN_PROBE = """
import sys, torch
import hf_zero
from hf_zero.engine.pool import fixed_mmap_threshold
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
if sys.argv[1] == 'frozen':
    model[0].requires_grad_(False)  # a frozen base under an adapter
hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3), device='cpu')
print(fixed_mmap_threshold())
"""


def test_a_frozen_base_on_the_cpu_maps_large_blocks_on_their_own():
    """[Note: host heap] `initialize` fixes glibc's threshold for a model with frozen parameters on the CPU (LoRA,
    QLoRA: the adapters' small states pin the holes the gathered blocks leave), and leaves it alone for a model
    trained whole."""
    import subprocess
    import sys

    fixed = {how: subprocess.run([sys.executable, "-c", _FROZEN_PROBE, how], capture_output=True, text=True,
                                 check=True).stdout.split()[-1] for how in ("frozen", "trained")}
    assert fixed == {"frozen": str(1 << 20), "trained": "None"}, fixed


_MASK_PEAK = """
import resource, sys, torch
from hf_zero.features.sequence_parallel import _whole_mask
L = 8192
documents = (torch.arange(L) // (L // 4)).unsqueeze(0) + 1
padding = torch.ones(1, L, dtype=torch.bool)
padding[0, -5:] = False
query = torch.empty(1, 1, L, 1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = _whole_mask(padding, query, "sdpa", documents)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
d = documents[0]
expected = (d[:, None] == d[None, :]) & torch.ones(L, L, dtype=torch.bool).tril() & padding[0][None, :]
print(grown * 1024, int(torch.equal(mask[0, 0], expected)))
"""


def test_a_packed_rows_mask_takes_one_boolean_per_pair():
    """[Note: packed documents]: the whole row's per-document causal mask (with padding) is built in place, one
    boolean per pair of tokens (64 MiB at 8192 tokens; three times that when built from intermediates, which at
    16384 tokens put a 0.84B run over its 9 GiB budget), and equals causal & same document & key not padding."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", _MASK_PEAK], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}).stdout.split()
    grown, equal = int(out[-2]), int(out[-1])
    assert equal == 1
    assert grown <= 1.25 * 8192 * 8192, f"the mask grew the process by {grown / 2**20:.0f} MiB"
