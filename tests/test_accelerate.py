"""ZeroAccelerator: a plain Accelerate loop under hf_zero matches its DDP version (fp32, 1e-5 relative)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import _accelerate_cases as ac
from tests._training import rel_err

TOL = 1e-5


# stage 1 in the slow tier (its engine paths are the Trainer's and the peer scenarios'; Accelerate's are stage 3's)
@pytest.mark.parametrize("stage, two_optimizers, model_first", [pytest.param(1, False, False, marks=pytest.mark.slow),
                                                                (3, False, False), (3, True, False), (3, True, True)])
def test_accelerate_loop_matches_ddp(pools, stage, two_optimizers, model_first):
    """Two optimizers: Adafactor on the matrices (whole parameters) and AdamW on the rest, prepared together.
    `model_first`: the model prepared alone, its optimizers built over the sharded model's parameters and prepared
    after (Accelerate's FSDP guide's order); they are attached to the model then."""
    zero = pools(2).values(ac.loop, True, stage, two_optimizers=two_optimizers, model_first=model_first)[0]
    ddp = pools(2).values(ac.loop, False, two_optimizers=two_optimizers, model_first=model_first)[0]
    assert zero["world"] == ddp["world"] == 2
    np.testing.assert_allclose(zero["losses"], ddp["losses"], rtol=TOL, atol=0)
    np.testing.assert_allclose(zero["norms"], ddp["norms"], rtol=TOL, atol=0)
    assert zero["lr"] == ddp["lr"]  # the scheduler drives the sharded optimizer's lr like DDP's
    for name, value in ddp["state"].items():
        assert rel_err(zero["state"][name].numpy(), value.numpy()) <= TOL, name


def test_prepare_refuses_an_optimizer_it_cannot_attach_and_a_second_trained_model(pools):
    for messages in pools(2).values(ac.prepare_refusals):
        assert "an optimizer was prepared before its model. Prepare the model first" in messages["optimizer_first"]
        assert "trains one model (with its optimizers) per accelerator" in messages["two_trained"]
        assert "had no trainable parameters, so they were sharded for inference" in messages["frozen_then_optimizer"]
        assert messages["model_again"] == "" and messages["model_again_attached"] == "True", messages


@pytest.mark.parametrize("teacher_later", [False, True])
def test_a_frozen_teacher_is_sharded_for_inference_and_distillation_matches_ddp(pools, teacher_later):
    """A distillation's frozen teacher prepared with its student, or in a later call: sharded for inference (no
    optimizer), the student trained as under DDP."""
    zero = pools(2).values(ac.distill, True, teacher_later=teacher_later)[0]
    ddp = pools(2).values(ac.distill, False, teacher_later=teacher_later)[0]
    assert zero["teacher_sharded"] and not ddp["teacher_sharded"]
    np.testing.assert_allclose(zero["losses"], ddp["losses"], rtol=TOL, atol=0)
    for name, value in ddp["state"].items():
        assert rel_err(zero["state"][name].numpy(), value.numpy()) <= TOL, name


# the slow tier (12 s on 2 cores): the Trainer's regional compilation (tests/test_trainer.py) takes the same
# `compile_as_requested`, and the refusals below reach ZeroAccelerator's own check
@pytest.mark.slow
def test_a_dynamo_backend_compiles_the_sharded_blocks_and_trains_as_ddp_compiled(pools):
    """[Note: compile] `Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager",
    use_regional_compilation=True))` (what `accelerate launch`'s dynamo settings give): ZeroAccelerator compiles the
    sharded model's blocks (compiled frames on every rank; before, nothing was compiled) and trains as DDP compiled
    the same way, at stage 3."""
    zero = pools(2).values(ac.loop, True, 3, steps=2, compile_backend="aot_eager")
    ddp = pools(2).values(ac.loop, False, steps=2, compile_backend="aot_eager")[0]
    assert all(r["compiled_frames"] >= 1 for r in zero) and ddp["compiled_frames"] >= 1
    np.testing.assert_allclose(zero[0]["losses"], ddp["losses"], rtol=TOL, atol=0)
    np.testing.assert_allclose(zero[0]["norms"], ddp["norms"], rtol=TOL, atol=0)
    for name, value in ddp["state"].items():  # Accelerate's regional compilation renames DDP's modules
        ours = name.removeprefix("module.").replace("._orig_mod", "")
        assert rel_err(zero[0]["state"][ours].numpy(), value.numpy()) <= TOL, name


def test_compile_settings_that_cannot_hold_on_a_sharded_model_are_refused_by_name():
    """[Note: compile] fullgraph on the whole model (the hooks break the graph at every unit) and, at stage 3, the
    CUDA-graph modes are refused before anything is compiled; fullgraph with regional compilation (each block's
    forward, no hooks inside) and the rest pass through; no dynamo backend asks for nothing."""
    from accelerate.utils import TorchDynamoPlugin

    from hf_zero.features.compile import check_compile_request

    assert check_compile_request(None, 3) is None and check_compile_request(TorchDynamoPlugin(), 3) is None
    assert check_compile_request(TorchDynamoPlugin(backend="inductor", mode="reduce-overhead"), 2) == {
        "backend": "inductor", "mode": "reduce-overhead"}
    with pytest.raises(ValueError, match="fullgraph=True cannot compile a whole model sharded by hf_zero"):
        check_compile_request(TorchDynamoPlugin(backend="inductor", fullgraph=True), 1)
    regional = TorchDynamoPlugin(backend="inductor", fullgraph=True, use_regional_compilation=True)
    assert check_compile_request(regional, 3) == {"backend": "inductor", "fullgraph": True}
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match=f"mode='{mode}' records CUDA graphs.*max-autotune-no-cudagraphs"):
            check_compile_request(TorchDynamoPlugin(backend="inductor", mode=mode), 3)


@pytest.mark.parametrize("two_optimizers,async_save", [(False, False), (True, False), (False, True)],
                         ids=["one", "two-optimizers", "async-save"])
def test_save_state_and_load_state_resume(pools, tmp_path, two_optimizers, async_save):
    """save_state after 2 of 4 steps; load_state into a model with another init and finish: the
    remaining losses, the lr and the final weights equal the uninterrupted run's, bit for bit (with two
    optimizers too: both states in one sharded checkpoint; with the plugin's zero_async_save, written in the
    background and waited for with wait_for_checkpoints, its zero_snapshot_budget bounding the host copy)."""
    two = {"two_optimizers": two_optimizers}
    straight = pools(2).values(ac.loop, True, 3, **two)[0]
    budget = "4KB" if async_save else None  # zero_snapshot_budget: most of the state is streamed at the call
    saved = pools(2).values(ac.loop, True, 3, save_at=2, save_dir=str(tmp_path / "state"), async_save=async_save,
                            snapshot_budget=budget, **two)
    for rank in saved:
        assert len(rank["snapshots"]) == (1 if async_save else 0)
        for taken in rank["snapshots"]:  # the plugin's budget bounds the host copy; the rest was streamed
            assert taken["budget"] == 4000 and taken["host_bytes"] <= 4000 and taken["live_bytes"] > 4000
    assert (tmp_path / "state" / "hf_zero" / "hf_zero_manifest.json").is_file()
    assert not list((tmp_path / "state").glob("optimizer*.bin"))  # the optimizer is sharded, not Accelerate's
    resumed = pools(2).values(ac.loop, True, 3, load_dir=str(tmp_path / "state"), resume_step=2, seed=1, **two)[0]
    assert resumed["losses"] == straight["losses"][4:]
    assert resumed["lr"] == straight["lr"]
    for name, value in straight["state"].items():
        np.testing.assert_array_equal(resumed["state"][name].numpy(), value.numpy())


def test_automatic_checkpoint_naming_rotates_and_load_state_takes_the_newest(pools, tmp_path):
    """Accelerate's automatic checkpoint naming: `save_state()` writes `checkpoints/checkpoint_N` (the sharded state
    in its `hf_zero/`), `total_limit` rotates them, and `load_state()` with no directory loads the newest, as
    stock Accelerate does (it was refused, asking for a directory)."""
    results = pools(2).values(ac.automatic_checkpoint_naming, str(tmp_path))
    assert list(results[0]["folders"]) == ["checkpoint_1", "checkpoint_2"]
    assert all("hf_zero" in contents for contents in results[0]["folders"].values())
    assert results[0]["equal"] is True


def test_state_hooks_that_would_get_no_model_are_refused_on_every_rank(pools, tmp_path):
    """Accelerate calls `register_save_state_pre_hook` / `register_load_state_pre_hook` hooks with the models it
    saves; hf_zero saves the sharded model itself, so they got an empty list and did nothing, silently. Now
    `save_state` / `load_state` refuse them on every rank, naming the way; without them the state saves."""
    for r in pools(2).values(ac.state_hooks_refused, str(tmp_path / "state")):
        assert "accelerator.register_save_state_pre_hook would get no model" in r["save"], r
        assert "accelerator.register_load_state_pre_hook would get no model" in r["load"], r
        assert r["hook_calls"] == []
    assert (tmp_path / "state" / "hf_zero" / "hf_zero_manifest.json").is_file()


# the slow tier (16 s on 2 cores): the same world size resumes in test_save_state_and_load_state_resume, another
# world size through hf_zero.load_checkpoint in tests/test_checkpoint.py
@pytest.mark.parametrize("resume_world", [pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_load_state_on_another_world_size(pools, tmp_path, resume_world):
    """State saved by 2 ranks loads on 1 or 3: the weights and the lr equal those saved, exactly.
    (Training on from there follows Accelerate's own rules for another world size: its scheduler
    wrapper steps once per process, so the lr trajectory itself depends on the world size.)"""
    saved = pools(2).values(ac.loop, True, 3, save_at=2, save_dir=str(tmp_path / "state"))[0]
    loaded = pools(resume_world).values(ac.loop, True, 2, load_dir=str(tmp_path / "state"), seed=1, train=False)[0]
    assert loaded["world"] == resume_world and loaded["lr"] == saved["lr"]
    for name, value in saved["state"].items():
        np.testing.assert_array_equal(loaded["state"][name].numpy(), value.numpy())


def test_preemption_stops_every_rank_at_the_same_step(pools, tmp_path):
    """[Note: preemption] with Accelerate: SIGUSR1 reaches rank 1 alone during step 2; `accelerator.preempted()`
    is True on both ranks at step 2, the state saved there is complete, and end_training restores the handler."""
    results = pools(2).values(ac.preemption_stops_together, str(tmp_path / "state"), 1, 2)
    assert [r["stopped"] for r in results] == [2, 2]
    assert (tmp_path / "state" / "hf_zero" / "hf_zero_manifest.json").is_file()
    assert all(r["handler_restored"] for r in results)


def test_a_launch_believed_to_be_one_process_is_refused_on_every_rank(pools):
    """[Note: launched world] Accelerate's view of the job against the launcher's WORLD_SIZE, before any step."""
    for r in pools(2).values(ac.launched_world_checked):
        assert r["processes"] == 2, r
        assert r["error"] is not None and "started 2 processes (WORLD_SIZE=2) but Accelerate sees 1" in r["error"], r
