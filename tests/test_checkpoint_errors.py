"""A damaged or foreign checkpoint raises a clear error on every rank and modifies nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from tests import _async_save_cases as async_save_cases
from tests import _checkpoint_cases as checkpoint_cases
from tests._training import Scenario, sharded_run


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> Path:
    """A good 2-rank stage-3 llama checkpoint (copied by each test before it is damaged)."""
    ckpt = tmp_path_factory.mktemp("good") / "ckpt"
    pools(2).values(sharded_run, Scenario(model="llama", stage=3, world=2, steps=1, accum=1, save_to=str(ckpt)))
    return ckpt


def _copy(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved, target)
    return target


def _expect(
    pools, ckpt: Path, error_type: str, message: str, kind: str = "llama", verify: bool = True, stage: int = 3
) -> None:
    for r in pools(2).values(checkpoint_cases.load_into_fresh_model, str(ckpt), kind, stage, verify):
        assert r["error_type"] == error_type, r
        assert message in r["error"], r["error"]
        assert r["unchanged"] and r["opt_state_empty"]


def test_good_checkpoint_loads(pools, saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    for r in pools(2).values(checkpoint_cases.load_into_fresh_model, str(ckpt), "llama", 3):
        assert r["error_type"] is None and not r["unchanged"]  # the control: loading does change the model


def test_a_trainer_checkpoint_folder_loads_and_consolidates_and_a_run_folder_names_its_checkpoints(pools, saved,
                                                                                                 tmp_path):
    """`checkpoint-N` (the Trainer's, holding the sharded state in `hf_zero/`: what `last_complete_checkpoint`
    returns) is read through its `hf_zero/` by `load_checkpoint` and `consolidate`; the run folder above it is
    refused naming the checkpoints it holds."""
    import hf_zero

    run = tmp_path / "run"
    shutil.copytree(saved, run / "checkpoint-2" / "hf_zero")
    assert hf_zero.last_complete_checkpoint(run) == run / "checkpoint-2"
    for r in pools(2).values(checkpoint_cases.load_into_fresh_model, str(run / "checkpoint-2"), "llama", 3):
        assert r["error_type"] is None and not r["unchanged"], r
    hf_zero.consolidate(run / "checkpoint-2", tmp_path / "a", progress=False)
    hf_zero.consolidate(saved, tmp_path / "b", progress=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    _expect(pools, run, "FileNotFoundError", "It holds checkpoints (checkpoint-2): pass one of them")


def test_missing_shard_file(pools, saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    (ckpt / "model-rank00001-of-00002.safetensors").unlink()
    _expect(pools, ckpt, "FileNotFoundError", "model-rank00001-of-00002.safetensors is missing")


def test_truncated_file(pools, saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    path = ckpt / "optim-rank00000-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    _expect(pools, ckpt, "ValueError", "optim-rank00000-of-00002.safetensors has")
    _expect(pools, ckpt, "ValueError", "truncated", verify=False)  # sizes are checked even without verify


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_corrupted_model_file_leaves_the_weights_as_they_were(pools, saved, tmp_path, stage):
    """[Note: master backup]: the model files are read once, straight into the masters (at stages 1-2 in fp32
    the parameters themselves); rank 0's damaged file is found after its masters changed, rank 1's loads
    whole: both raise, both put their masters back."""
    ckpt = _copy(saved, tmp_path)
    path = ckpt / "model-rank00000-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF  # one flipped byte inside a tensor
    path.write_bytes(bytes(data))
    _expect(pools, ckpt, "ValueError", "model-rank00000-of-00002.safetensors is corrupted: its checksum", stage=stage)


def test_corrupted_optimizer_file_is_found_before_the_model_changes(pools, saved, tmp_path):
    """[Note: one-pass load]: the optimizer state is read in the same pass as its file's checksum, into fresh
    tensors; a flipped byte there raises on every rank with the weights untouched and no state handed over."""
    ckpt = _copy(saved, tmp_path)
    path = ckpt / "optim-rank00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside the moments
    path.write_bytes(bytes(data))
    _expect(pools, ckpt, "ValueError", "optim-rank00001-of-00002.safetensors is corrupted: its checksum")


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_load_into_a_trained_optimizer_reads_in_place_and_resumes_exactly(pools, tmp_path, stage):
    """[Note: one-pass load]: loading into an optimizer that has state reads the moments into its own tensors
    (no fresh memory), and the two steps after the load repeat the two steps after the save exactly; a damaged
    optimizer file then raises on every rank, the weights unchanged and the half-read state cleared."""
    for r in pools(2).values(checkpoint_cases.reload_into_trained_model, str(tmp_path / "a"), stage, False):
        assert r["same_memory"]
        assert r["again"] == r["first"]
    for r in pools(2).values(checkpoint_cases.reload_into_trained_model, str(tmp_path / "b"), stage, True):
        assert r["error"] is not None and "optim-rank00001-of-00002.safetensors is corrupted" in r["error"], r
        assert r["unchanged"] and r["state_cleared"]


def test_version_1_checkpoint_with_sha256_loads_and_is_verified(pools, saved, tmp_path):
    """[Note: checksums]: a checkpoint of format version 1 (SHA-256 checksums) still loads, exactly, and its
    checksums are still checked."""
    import hashlib

    ckpt = _copy(saved, tmp_path)
    manifest = json.loads((ckpt / "hf_zero_manifest.json").read_text())
    manifest["format_version"] = 1
    manifest["files"] = {
        name: {"bytes": entry["bytes"], "sha256": hashlib.sha256((ckpt / name).read_bytes()).hexdigest()}
        for name, entry in manifest["files"].items()
    }
    (ckpt / "hf_zero_manifest.json").write_text(json.dumps(manifest))
    good = pools(2).values(checkpoint_cases.load_into_fresh_model, str(ckpt), "llama", 3)
    assert all(r["error_type"] is None and not r["unchanged"] for r in good)
    path = ckpt / "model-rank00000-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF
    path.write_bytes(bytes(data))
    _expect(pools, ckpt, "ValueError", "model-rank00000-of-00002.safetensors is corrupted: its checksum")


def test_checkpoint_of_another_model(pools, saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    _expect(pools, ckpt, "ValueError", "is for another model", kind="falcon")


def test_unknown_format_version(pools, saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    manifest = json.loads((ckpt / "hf_zero_manifest.json").read_text())
    manifest["format_version"] = 99
    (ckpt / "hf_zero_manifest.json").write_text(json.dumps(manifest))
    _expect(pools, ckpt, "ValueError", "format version 99; this release of hf_zero reads versions 1, 2")


def test_incomplete_checkpoint_without_manifest(pools, saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    (ckpt / "hf_zero_manifest.json").unlink()
    _expect(pools, ckpt, "FileNotFoundError", "its save did not finish")


def test_missing_directory(pools, tmp_path):
    _expect(pools, tmp_path / "nope", "FileNotFoundError", "the directory does not exist")


def test_saving_over_an_existing_checkpoint_replaces_it(pools, saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    pools(2).values(sharded_run, Scenario(model="llama", stage=2, world=2, steps=2, accum=1, save_to=str(ckpt)))
    manifest = json.loads((ckpt / "hf_zero_manifest.json").read_text())
    assert manifest["stage"] == 2 and manifest["user"] == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left aside


def test_saving_through_a_link_to_a_checkpoint_replaces_the_link_not_what_it_names(pools, saved, tmp_path):
    """`latest -> step-1`, then a save to `latest`: the new checkpoint is at `latest`, `step-1` is as it was, and
    nothing is left aside (the commit raised from `rmtree` on the link it had moved aside, after committing). A link
    to nothing is replaced too."""
    step = _copy(saved, tmp_path)
    before = (step / "hf_zero_manifest.json").read_text()
    (tmp_path / "latest").symlink_to("ckpt")
    pools(2).values(sharded_run, Scenario(model="llama", stage=2, world=2, steps=2, accum=1,
                                          save_to=str(tmp_path / "latest")))
    assert not (tmp_path / "latest").is_symlink()
    assert json.loads((tmp_path / "latest" / "hf_zero_manifest.json").read_text())["stage"] == 2
    assert (step / "hf_zero_manifest.json").read_text() == before
    (tmp_path / "dangling").symlink_to("gone")  # a link to nothing is replaced as well
    pools(2).values(sharded_run, Scenario(model="llama", stage=2, world=2, steps=1, accum=1,
                                          save_to=str(tmp_path / "dangling")))
    assert (tmp_path / "dangling" / "hf_zero_manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "dangling", "latest"]


def test_a_path_that_holds_something_else_is_refused_and_left_as_it_was(pools, tmp_path):
    """`save_checkpoint` swaps its directory in as a whole (the old one deleted): given a run folder with the user's
    files (or a file) it deleted them. Now every rank raises a `ValueError` naming what is there before anything
    is written; an empty directory is fine. `save_pretrained` into a file raises a `ValueError` too (it was a bare
    FileExistsError)."""
    (tmp_path / "run" / "runs").mkdir(parents=True)
    (tmp_path / "run" / "train.log").write_text("step 1")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "empty").mkdir()
    for r in pools(2).values(checkpoint_cases.save_where_something_else_is, str(tmp_path)):
        for key in ("run_folder", "file", "pretrained_file", "parallel_file"):
            assert r[key]["error_type"] == "ValueError", (key, r[key])
        assert "not an hf_zero checkpoint (no hf_zero_manifest.json; it holds runs, train.log)" in r["run_folder"]["error"]
        assert "is a file" in r["file"]["error"] and "is a file" in r["pretrained_file"]["error"]
        assert r["empty"]["error"] is None, r["empty"]
        assert r["run_left"] == ["runs", "train.log"] and r["file_left"] == "keep me"
        assert "hf_zero_manifest.json" in r["empty_left"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "notes.txt", "run"]  # nothing left aside


@pytest.mark.parametrize("stage,budget", [(3, None), (2, 6000)], ids=["stage3", "stage2-bf16-budget"])
def test_async_save_writes_the_checkpoint_a_sync_save_writes(pools, tmp_path, stage, budget):
    """[Note: asynchronous save]: an asynchronous save, with training steps taken while it writes, gives the
    checkpoint a synchronous save of the same state gives, file for file (every checksum); with a snapshot budget
    (part of the state written from the training tensors before the call returns) too; a second asynchronous
    save starts after the first is committed."""
    results = pools(2).values(async_save_cases.async_equals_sync, str(tmp_path), stage, budget)
    r = results[0]
    assert r["sync"] == r["async"] and len(r["sync"]) > 3
    assert r["sync4"] == r["async4"] and r["sync4"] != r["sync"]
    assert all(x["writing_when_returned"] for x in results)  # the writes were still going when training went on
    assert all(x["first_done_before_second"] for x in results)
    assert r["leftovers"] == []


def test_async_save_failure_raises_on_every_rank_at_wait(pools, tmp_path):
    """A background write that fails on rank 1 (disk full): the call returned, `wait` raises on both ranks (the
    failing rank's OSError; the other names it), and the previous checkpoint is intact with nothing left over."""
    results = pools(2).values(async_save_cases.async_save_with_fault, str(tmp_path), 1, errno.ENOSPC)
    assert all(r["returned"] for r in results)
    assert results[1]["error_type"] == "OSError" and os.strerror(errno.ENOSPC) in results[1]["error"]
    assert results[0]["error_type"] == "OSError" and "failed on rank(s) [1]" in results[0]["error"]
    assert all(r["intact"] for r in results)
    assert results[0]["leftovers"] == ["ckpt"]


def test_chained_background_saves_run_one_after_another_and_pass_on_a_failure(tmp_path):
    """`chain` ([Note: asynchronous save]): a save started while another is written begins once it has finished
    (they share one save group), and a failure of the first is raised by the second's wait (on every rank alike:
    the ranks agreed on the first's outcome)."""
    import threading
    import time

    from hf_zero.checkpoint import background

    from types import SimpleNamespace

    owner = SimpleNamespace(key=12345, save_group=SimpleNamespace(pg=None))  # an engine's facade: a group of one
    order: list[str] = []
    release = threading.Event()

    def first() -> None:
        release.wait(10)
        order.append("first")

    background.chain(owner, tmp_path / "a", first)
    second = background.chain(owner, tmp_path / "b", lambda: order.append("second"))
    time.sleep(0.2)
    assert order == [] and not second.done()  # the second waits for the first
    release.set()
    assert second.wait() == tmp_path / "b" and order == ["first", "second"]
    assert background.pending_save(owner) is None

    def broken() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    background.chain(owner, tmp_path / "c", broken)
    third = background.chain(owner, tmp_path / "d", lambda: order.append("third"))
    with pytest.raises(OSError, match="No space left"):
        background.finish_previous(owner)  # what the next save (or train()'s end) does
    assert order == ["first", "second"] and third.done()  # the chained work never ran


@pytest.mark.parametrize("how", ["checkpoint", "async", "pretrained"])
def test_a_directory_not_shared_by_every_rank_is_refused_before_anything_is_written(pools, tmp_path, how):
    """[Note: shared directory] The output path on a node-local disk of a multi-node job (here: each rank its own
    root): rank 0 would have committed a checkpoint without the other node's files, found unloadable only at the
    resume. Every rank raises a ValueError before writing, naming the directory and the fix; no checkpoint appears
    at either root, and the earlier checkpoint at the shared root stays loadable."""
    roots = [tmp_path / "node0", tmp_path / "node1"]
    for root in roots:
        root.mkdir()
    got = pools(2).values(checkpoint_cases.save_into_a_directory_per_rank, [str(r) for r in roots], how)
    for outcome in got:
        assert outcome["error_type"] == "ValueError", outcome
        assert "is not on a filesystem every rank shares" in outcome["error"] and outcome["seconds"] < 30, outcome
    assert "failed on rank(s) [1]" in got[0]["error"]
    assert got[0]["left"] == ["ckpt"] and got[1]["left"] == []  # rank 0's root: only the first, shared save
    manifest = json.loads((roots[0] / "ckpt" / "hf_zero_manifest.json").read_text())
    assert manifest["user"] == {"attempt": "first"}


def test_ranks_given_different_checkpoints_are_refused_on_every_rank(pools, tmp_path):
    """Each rank reads only its own shards from the checkpoint it is given: rank 0 given step 1's and rank 1 step
    2's (paths that differ, or a "latest" each rank resolved while a save was being committed) resumed a model
    whose shards came from two steps, silently. Now every rank raises a ValueError naming both checkpoints."""
    got = pools(2).values(checkpoint_cases.load_a_checkpoint_per_rank, str(tmp_path))
    for outcome in got:
        assert outcome["error_type"] == "ValueError", outcome
        assert "the ranks load different checkpoints" in outcome["error"], outcome
    assert f"{tmp_path / 'one'} (metadata {{'step': 1}}) here, {tmp_path / 'two'} (metadata {{'step': 2}}) on rank 1" \
        in got[0]["error"], got[0]["error"]


def test_a_save_of_another_model_waits_for_the_save_in_flight_on_the_same_ranks(pools, tmp_path):
    """Two models on the same ranks share their save group ([Note: groups made once]): model B's save, made while
    model A's asynchronous save was still writing, starts after A's is committed (keyed by the engine, they ran
    together on one group: in a long fuzzer run, a later program's collectives timed out and every one after
    crashed); both checkpoints reload to the weights they were saved from."""
    for r in pools(2).values(async_save_cases.saves_of_two_engines, str(tmp_path)):
        assert r["writing"] and r["a_done"], r
        assert r["same"] == {"a": True, "b": True}, r
