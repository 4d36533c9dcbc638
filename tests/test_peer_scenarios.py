"""Peer scenarios (tests/_peer_cases.py): PyTorch idioms that DDP trains correctly, on 2 gloo ranks at stages 1-3,
against plain data parallelism run in the same processes. Each is exact (fp32: losses, returned norms and every
final weight and buffer within 1e-5 relative) or refused at its first step, on every rank, with a message that
names the pattern and what to do instead. Never a silent difference, never a hang."""

from __future__ import annotations

import pytest
import torch

from tests import _peer_cases as peer
from tests import _peer_cases_amp as peer_amp
from tests import _peer_cases_groups as peer_groups
from tests import _peer_cases_state as peer_state

TOL = 1e-5

REFUSED = peer.REFUSED


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(peer.SCENARIOS))
def test_peer_scenario_is_exact_or_refused(pools, name, stage):
    results = pools(2).values(peer.run_scenario, name, stage)
    expected = REFUSED.get(name, {}).get(stage)
    for rank, r in enumerate(results):
        if expected is not None:
            assert r["error"] is not None and expected in r["error"], (rank, r["error"])
            assert r["error"].startswith(("ValueError", "TypeError", "RestingParameterError")), r["error"]
            continue
        assert r["error"] is None, (rank, r["error"])
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL, (rank, r["reference"], r["record"])
        assert not r["missing"], r["missing"]
        assert max(r["weights"].values()) <= TOL, (rank, {k: v for k, v in r["weights"].items() if v > TOL})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_float64_model_keeps_float64_precision(pools, stage):
    """An fp64 model: masters, norms and their reductions in fp64, so it matches DDP to fp64's precision (it
    crashed in clipping, and its norm was reduced in fp32: 7e-8 relative)."""
    for r in pools(2).values(peer.run_scenario, "float64_model", stage):
        assert r["error"] is None, r["error"]
        assert peer.worst_difference(r["reference"], r["record"]) <= 1e-12, (r["reference"], r["record"])
        assert max(r["weights"].values()) <= 1e-12, r["weights"]


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_calls_the_models_own_load_state_dict_for_its_buffers(pools, tmp_path, stage):
    """A buffer that grew during training comes back with its saved shape: the model's `load_state_dict` override
    (which resizes it) is what hf_zero's load calls, as the stock Trainer's resume does."""
    for r in pools(2).values(peer.resume_growing_buffer, stage, str(tmp_path / "ckpt")):
        assert len(r["saved"]) == 3, r
        assert r["loaded"] == r["saved"], r


@pytest.mark.parametrize("name", ["baseline", "two_forwards_one_backward", "unit_skipped_on_one_rank"])
def test_stage_3_without_prefetch(pools, name):
    """`prefetch=0`: every gather is issued on demand, checked before it is issued; exact where the ranks run the
    same units, refused naming the units where one rank skips one."""
    for r in pools(2).values(peer.run_scenario, name, 3, prefetch=0):
        if name == "unit_skipped_on_one_rank":
            assert r["error"] is not None and "gather different units (['blocks.1', 'blocks.2'])" in r["error"], r
            continue
        assert r["error"] is None, r["error"]
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL
        assert max(r["weights"].values()) <= TOL


BUCKETED = ["blocks_skipped_on_every_rank", "unit_reused", "two_forwards_one_backward", "unit_skipped_on_one_rank",
            "last_unit_skipped_on_one_rank", "accumulation_unit_skipped_on_one_rank", "unfreeze_later",
            "unfreeze_from_the_top", "unfreeze_part_of_a_unit_later"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", BUCKETED)
def test_a_bucket_of_blocks_follows_blocks_skipped_repeated_or_unfrozen(pools, name, stage):
    """[Note: bucket blocks skipped or repeated]: every block in one unit (`bucket_size_mb=25`), the model skipping
    its first, last or middle block (on every rank, or on one: the unit still runs on both) or running one twice:
    exact as DDP (the unit's state machine raised, at every stage). A block frozen at set-up and unfrozen later
    (gradual unfreezing) is exact too: alone in its bucket, or in a bucket of frozen blocks unfrozen one block at a
    time (each trains from its unfreezing), or frozen in part (its frozen part starts beside the trainable one)."""
    for rank, r in enumerate(pools(2).values(peer.run_scenario, name, stage, bucket_size_mb=25)):
        assert r["error"] is None, (rank, r["error"])
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL, (rank, r["reference"], r["record"])
        assert max(r["weights"].values()) <= TOL, (rank, {k: v for k, v in r["weights"].items() if v > TOL})


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["zero_grad_keeps_zeros_of_a_skipped_block", "zero_grad_keeps_zeros_whole_parameter",
                                  "checkpoint_loaded_into_the_live_optimizer",
                                  "checkpoint_loaded_between_backward_and_step"])
def test_kept_zero_gradients_step_from_disk(pools, tmp_path, name, stage):
    """[Note: zero gradients kept] with the optimizer's state and masters on disk (`offload_dir`): a parameter whose
    gradient `zero_grad(set_to_none=False)` kept as zeros is stepped on zeros, as in memory (it was skipped: the
    differential fuzzer's seed 593), also after a checkpoint is loaded into the live model and optimizer (the load
    dropped them, and the gradients of a backward it came after: seed 90242)."""
    for rank, r in enumerate(pools(2).values(peer.run_scenario, name, stage, offload_optimizer=True,
                                             offload_dir=str(tmp_path))):
        assert r["error"] is None, (rank, r["error"])
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL, (rank, r["reference"], r["record"])
        assert max(r["weights"].values()) <= TOL, (rank, {k: v for k, v in r["weights"].items() if v > TOL})


@pytest.mark.parametrize("name", ["weight_changed_in_forward", "root_weight_changed_in_forward"])
@pytest.mark.parametrize("setting", [{}, {"offload_params": True, "offload_optimizer": True},
                                     {"mixed_precision": "bf16"}])
def test_a_change_in_forward_at_one_rank_is_kept_or_refused(pools, name, setting):
    """[Note: changed in forward] at a world of one, stage 3: in fp32 on the device the units stay whole ([Note: a
    shard group of one]) and a weight changed in place inside a forward with grad is kept, exact as plain PyTorch;
    where each use gathers (parameters offloaded to the host, or cast under mixed precision) the change would go to a
    copy freed after the forward, and is refused at that forward, naming the parameter (it trained silently apart:
    the renormalized weights 1.03 relative off)."""
    r = pools(1).values(peer.run_scenario, name, 3, **setting)[0]
    if not setting:
        assert r["error"] is None, r["error"]
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL
        assert max(r["weights"].values()) <= TOL, r["weights"]
        return
    expected = peer.REFUSED[name][3]
    assert r["error"] is not None and r["error"].startswith("ValueError") and expected in r["error"], r["error"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_batchnorm_statistics_follow_ddps_rule(pools, stage):
    """BatchNorm against torch's DDP on the same ranks: evaluation before training, accumulation with the first
    micro-batch under no_sync, a forward without grad in train mode, two evaluation forwards after each step.
    DDP broadcasts rank 0's buffers at the first forward after a synchronising training forward (with grad or
    not), and not after a no_sync one: every loss, eval loss, weight and running statistic on every rank within
    1e-5 of DDP's (each rank evaluated with its own statistics before, 1e-1 apart)."""
    from tests import _buffer_cases

    for rank, r in enumerate(pools(2).values(_buffer_cases.batchnorm_against_ddp, stage)):
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL, (rank, r["reference"], r["record"])
        for name, value in r["ref_state"].items():
            got = r["state"][name].to(value.dtype)
            assert (got - value).abs().max() <= TOL * (value.abs().max() + 1e-12), (rank, name, got, value)


UNFROZEN = ["unfreeze_later", "unfreeze_part_of_a_unit_later", "unfreeze_from_the_top", "group_added_when_unfreezing",
            "groups_added_from_the_top"]


@pytest.mark.parametrize("setting", [{"stage": 1, "offload_optimizer": True}, {"stage": 2, "offload_optimizer": True},
                                     {"stage": 3, "offload_optimizer": True, "offload_params": True}])
@pytest.mark.parametrize("name", UNFROZEN)
def test_unfreezing_with_the_optimizer_offloaded_matches_ddp(pools, name, setting):
    """[Note: requires_grad after initialize] with `offload_optimizer` (and the stage-3 gather source on the host):
    a block frozen at initialize, whole or in part, or two unfrozen from the top, start training with their master,
    gradient shard and optimizer state where a trainable part's live: exact as DDP (it was refused)."""
    setting = dict(setting)
    for rank, r in enumerate(pools(2).values(peer.run_scenario, name, setting.pop("stage"), **setting)):
        assert r["error"] is None, (rank, r["error"])
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL, (rank, r["reference"], r["record"])
        assert max(r["weights"].values()) <= TOL, (rank, {k: v for k, v in r["weights"].items() if v > TOL})


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("build, setting", [
    ({}, {}), ({"adagrad": True}, {}), ({"adafactor": True}, {}), ({}, {"offload_optimizer": True}),
], ids=["adamw", "adagrad", "adafactor_whole_parameters", "adamw_offloaded"])
def test_unfreezing_under_mixed_precision_is_unfreezing_after_freezing(pools, stage, build, setting):
    """A bf16 model (as transformers loads a bf16 checkpoint) under bf16 mixed precision: block 0 frozen at
    initialize and unfrozen after the first step trains bit for bit as block 0 left trainable at initialize, frozen
    right after and unfrozen at the same step (the way hf_zero asked for before): its fp32 master made from its bf16
    copy, which is its weight; Adagrad's accumulator made at construction in the master's dtype in both; Adafactor's
    whole parameters and AdamW's fused kernel (chosen with the frozen block's bf16 tensors left out) as in the other
    run. Losses and every weight equal (it was refused)."""
    pair = ("unfreeze_later", "unfreeze_after_freezing")
    for rank, r in enumerate(pools(2).values(peer_state.sharded_twice, pair, stage, {"dtype": torch.bfloat16, **build},
                                             mixed_precision="bf16", **setting)):
        woken, reference = r[pair[0]], r[pair[1]]
        assert woken["error"] is None and reference["error"] is None, (rank, woken["error"], reference["error"])
        assert woken["record"] == reference["record"], (rank, woken["record"], reference["record"])
        for name, value in reference["state"].items():
            assert torch.equal(woken["state"][name], value), (rank, name)


def _assert_resumed_bit_for_bit(rank: int, r: dict) -> None:
    """A resumed run's steps (`_peer_cases_state.straight_and_resumed`) are the uninterrupted run's, bit for bit."""
    assert r["error"] is None, (rank, r["error"])
    assert r["resumed"]["record"]["loss"] == r["straight"]["record"]["loss"][2:], (rank, r)
    for name, value in r["straight"]["state"].items():
        assert torch.equal(r["resumed"]["state"][name], value), (rank, name)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("unfreeze_at", [1, 2])
def test_a_resume_unfreezes_exactly_or_refuses(pools, tmp_path, stage, unfreeze_at):
    """Gradual unfreezing under mixed precision, resumed by the same script (block 0 frozen at initialize again, the
    checkpoint loaded, unfrozen at the step it was): saved while block 0 was still frozen (its bf16 weights), the
    resumed steps equal the uninterrupted run's bit for bit; saved after it started training (fp32 masters, which
    its frozen bf16 copy holds only rounded), every rank refuses at the forward that unfreezes it, naming the way."""
    for rank, r in enumerate(pools(2).values(peer_state.resumed_with_a_block_frozen_at_initialize, stage,
                                             str(tmp_path / "ckpt"), unfreeze_at)):
        if unfreeze_at == 1:
            assert r["error"] is not None and "in the checkpoint loaded since" in r["error"], (rank, r["error"])
            assert "leave it trainable at initialize" in r["error"], r["error"]
            continue
        _assert_resumed_bit_for_bit(rank, r)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("setting, message", [
    ({"mixed_precision": "bf16"}, "under mixed precision a frozen part keeps only its torch.bfloat16 copy, and this "
     "parameter was torch.float32 at initialize (or in the checkpoint loaded since): training would start from its "
     "torch.bfloat16 rounding"),
    ({"offload_optimizer": True, "offload_dir": "<tmp>"}, "with offload_dir its master weights and optimizer state "
     "would have to join the offload files"),
])
def test_unfreezing_is_refused_where_it_cannot_start_exactly(pools, tmp_path, stage, setting, message):
    """Where a unit frozen at initialize cannot start from what DDP would train (an fp32 model under bf16 mixed
    precision keeps only the bf16 rounding of its frozen weights) or has no place to train in (the offload files are
    laid out at initialize), every rank refuses at the forward after the change, naming the parameter, why, and the
    way (trainable at initialize, frozen right after)."""
    setting = {k: str(tmp_path) if v == "<tmp>" else v for k, v in setting.items()}
    for r in pools(2).values(peer.run_scenario, "unfreeze_later", stage, **setting):
        assert r["error"] is not None and r["error"].startswith("ValueError: hf_zero: parameter 'blocks.0."), r["error"]
        assert message in r["error"] and "leave it trainable at initialize" in r["error"], r["error"]


@pytest.mark.parametrize("stage", [1, 3])
def test_grad_scaler_state_resumes_through_the_checkpoint_metadata(pools, tmp_path, stage):
    """`save_checkpoint(..., metadata={"scaler": scaler.state_dict()})`, then a fresh scaler loaded from what
    `load_checkpoint` returns: the resumed run's losses, scales (halved at the overflow, grown after) and weights
    are the uninterrupted run's."""
    for r in pools(2).values(peer_amp.grad_scaler_resumed, stage, str(tmp_path / "ckpt")):
        straight, resumed = r["straight"], r["resumed"]
        assert straight["record"]["scale"] == [2.0**17, 2.0**16, 2.0**17, 2.0**18], straight["record"]
        assert resumed["record"]["scale"] == straight["record"]["scale"]
        assert resumed["record"]["loss"][2:] == straight["record"]["loss"][2:]
        for name, value in straight["state"].items():
            assert torch.equal(resumed["state"][name], value), name


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("whole", [False, True], ids=["adamw", "adafactor_whole_parameters"])
@pytest.mark.parametrize("add_on_resume", [True, False], ids=["group_added_again", "group_missing"])
def test_a_run_that_added_a_param_group_resumes_exactly(pools, tmp_path, stage, whole, add_on_resume):
    """[Note: param group added later] A checkpoint saved after a group was added (block 0 unfrozen and added after
    the first step) resumes, in a script that adds the group again before `load_checkpoint`, bit for bit as the
    uninterrupted run; without the group the load is refused by name on every rank, as torch's `load_state_dict`
    refuses other groups."""
    for rank, r in enumerate(pools(2).values(peer_groups.resumed_after_a_group_was_added, stage,
                                             str(tmp_path / "ckpt"), whole, add_on_resume)):
        if not add_on_resume:
            assert r["error"] is not None and "param groups differ from the checkpoint's" in r["error"], (rank, r)
            assert "(2 saved group(s) vs 1" in r["error"], r["error"]
            continue
        _assert_resumed_bit_for_bit(rank, r)


@pytest.mark.parametrize("stage", [1, 3])
def test_add_param_group_refuses_what_torch_refuses_and_what_the_model_does_not_hold(pools, stage):
    """A parameter already in a group (or twice in the new one), a tensor that is not the model's, a set, a list in
    place of a dict: refused on every rank, with torch's words or naming the fix; the optimizer keeps its groups and
    steps as one never asked."""
    for r in pools(2).values(peer_groups.refused_groups, stage):
        assert r["taken"].startswith("ValueError: some parameters appear in more than one parameter group"), r
        assert "'head.weight' is in one already" in r["taken"], r
        assert "'blocks.0.lin.weight' is in one already" in r["twice"], r
        assert "not a parameter of the sharded model" in r["foreign"], r
        assert r["set"].startswith("TypeError: optimizer parameters need to be organized in ordered collections"), r
        assert r["not_a_dict"].startswith("TypeError: param_group must be a dict"), r
        assert r["groups"] == 1 and r["same_losses"], r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_param_group_added_later_steps_from_disk(pools, tmp_path, stage):
    """[Note: param group added later] with the masters and optimizer state in the offload files (`offload_dir`):
    parameters trainable at initialize but left out of the optimizer, added as a group after the first step, are
    stepped window by window from the files, exactly as DDP steps them."""
    for rank, r in enumerate(pools(2).values(peer.run_scenario, "group_added_for_parameters_left_out", stage,
                                             offload_optimizer=True, offload_dir=str(tmp_path))):
        assert r["error"] is None, (rank, r["error"])
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL, (rank, r["reference"], r["record"])
        assert max(r["weights"].values()) <= TOL, (rank, {k: v for k, v in r["weights"].items() if v > TOL})


@pytest.mark.parametrize("setting", [
    {"stage": 1, "offload_optimizer": True}, {"stage": 2, "offload_optimizer": True},
    {"stage": 3, "offload_optimizer": True, "offload_params": True}, {"stage": 2, "shard_group_size": 1},
    {"stage": 3, "bucket_size_mb": 25}, {"stage": 3, "no_sync_keeps_grads": True},
], ids=["1_offload", "2_offload", "3_offload_params", "2_replicas", "3_one_bucket", "3_grads_kept_in_no_sync"])
@pytest.mark.parametrize("name", ["left_out_and_clipped", "left_out_through_accumulation",
                                  "group_added_for_parameters_left_out"])
def test_gradients_no_optimizer_holds_add_up_in_every_setting(pools, name, setting):
    """[Note: gradients no optimizer holds] a trainable parameter in no param group keeps adding up its gradients
    through `optimizer.zero_grad()`, as under DDP, with the gradient shards on the host, replicated, in one bucket,
    and unsharded through a `no_sync` window: torch's clipping over the model counts them, a group added later steps
    on their sum. Exact (they were dropped: a norm 1e-4 apart, then the weights)."""
    setting = dict(setting)
    for rank, r in enumerate(pools(2).values(peer.run_scenario, name, setting.pop("stage"), **setting)):
        assert r["error"] is None, (rank, r["error"])
        assert peer.worst_difference(r["reference"], r["record"]) <= TOL, (rank, r["reference"], r["record"])
        assert max(r["weights"].values()) <= TOL, (rank, {k: v for k, v in r["weights"].items() if v > TOL})
