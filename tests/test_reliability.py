"""Faults lose nothing: a rank killed mid-save, a full disk, an unwritable folder, a damaged shard."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import hf_zero
from tests import _checkpoint_cases as checkpoint_cases
from tests import _engine_cases as engine_cases
from tests._training import Scenario, sharded_run

ROOT = Path(__file__).resolve().parent.parent


def test_rank_killed_during_save_leaves_the_previous_checkpoint_and_resume_works(pools, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "_kill_during_save.py"), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0 and "unreachable" not in done.stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "step_2" in names and "step_3" not in names  # the new checkpoint never appeared at its name
    staging = [n for n in names if n.startswith(".step_3.incomplete-")]
    assert staging and not (tmp_path / staging[0] / "hf_zero_manifest.json").exists()  # recognisably incomplete
    assert hf_zero.last_complete_checkpoint(tmp_path, r"step_(\d+)", subdir="") == tmp_path / "step_2"

    sc = Scenario(model="llama", stage=3, world=2, steps=5)
    straight = pools(2).values(sharded_run, sc)[0]
    resumed = pools(2).values(sharded_run, replace(sc, seed=1, start_step=2, load_from=str(tmp_path / "step_2")))[0]
    assert resumed["losses"] == straight["losses"][2:]  # the previous checkpoint is whole and verified

    # [Note: leftovers]: the next save of the same step removes what the killed one left; nothing temporary remains
    from hf_zero.checkpoint import leftovers

    assert leftovers.under(tmp_path) == [tmp_path / staging[0]]
    pools(2).values(sharded_run, replace(sc, steps=1, accum=1, save_to=str(tmp_path / "step_3")))
    assert leftovers.under(tmp_path) == [] and (tmp_path / "step_3" / "hf_zero_manifest.json").is_file()
    assert not [p for p in tmp_path.rglob("*") if ".incomplete-" in p.name or p.name.endswith(".partial")]


def test_leftovers_vanishing_while_removed_are_no_error(tmp_path, monkeypatch):
    """[Note: leftovers] every rank removes the leftovers beside a target at once; in a shared folder another rank
    deletes files (and whole leftovers) while this one sizes and removes them. That is no error (it failed a
    2-rank save with FileNotFoundError), and what is left is removed."""
    from collections import Counter
    from pathlib import Path

    from hf_zero.checkpoint import leftovers

    staging = tmp_path / ".step_3.incomplete-0123abcd"
    (staging / "sub").mkdir(parents=True)
    for name in ("model-rank00000-of-00002.safetensors", "model-rank00001-of-00002.safetensors", "sub/x"):
        (staging / name).write_bytes(b"w" * 100)
    partial = tmp_path / ".model.safetensors.partial"
    partial.write_bytes(b"p" * 10)
    assert set(leftovers.beside(tmp_path / "step_3")) == {staging, partial}
    real_stat, seen = Path.stat, Counter[str]()

    def another_rank_got_there_first(self: Path, **kwargs):  # between this rank's look at a file and its size
        seen[self.name] += 1
        if self.name in ("model-rank00001-of-00002.safetensors", partial.name) and seen[self.name] == 2:
            self.unlink()
        return real_stat(self, **kwargs)

    monkeypatch.setattr(Path, "stat", another_rank_got_there_first)
    assert leftovers.remove([staging, partial, tmp_path / ".gone.incomplete-1"]) == 200
    assert not staging.exists() and not partial.exists()


def test_leftovers_command_lists_and_removes_what_killed_saves_left(tmp_path, capsys):
    """`hf-zero leftovers RUN_DIR` lists staging folders and temporary files of killed saves anywhere under a run
    folder (never a complete checkpoint), and `--remove` deletes them."""
    from hf_zero.cli import main

    keep = tmp_path / "checkpoint-4" / "hf_zero"
    keep.mkdir(parents=True)
    (keep / "hf_zero_manifest.json").write_text("{}")
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"x" * 10)
    staging = tmp_path / "checkpoint-6" / ".hf_zero.incomplete-0123abcd"
    staging.mkdir(parents=True)
    (staging / ".hf_zero-shard-00000.partial").write_bytes(b"y" * 2048)
    partial = tmp_path / "checkpoint-6" / ".model-00001-of-00002.safetensors.partial"
    partial.write_bytes(b"z" * 1024)
    assert main(["leftovers", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert str(staging) in listed and str(partial) in listed and "2 leftover(s)" in listed
    assert staging.exists() and partial.exists()
    assert main(["leftovers", str(tmp_path), "--remove"]) == 0
    assert "removed 2 leftover(s)" in capsys.readouterr().out
    assert not staging.exists() and not partial.exists()
    assert (keep / "hf_zero_manifest.json").exists() and (tmp_path / "checkpoint-4" / "model.safetensors").exists()
    assert main(["leftovers", str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
def test_write_failure_on_one_rank_raises_everywhere_and_keeps_the_old_checkpoint(pools, tmp_path, code):
    ckpt = tmp_path / "ckpt"
    pools(2).values(sharded_run, Scenario(model="llama", stage=3, world=2, steps=1, accum=1, save_to=str(ckpt)))
    before = (ckpt / "hf_zero_manifest.json").read_text()
    results = pools(2).values(checkpoint_cases.save_with_fault, str(ckpt), 1, code)
    assert results[1]["error_type"] == "OSError" and os.strerror(code) in results[1]["error"]
    assert results[0]["error_type"] == "OSError" and "failed on rank(s) [1]" in results[0]["error"]
    assert all(r["seconds"] < 30 for r in results)  # nobody waited for a timeout
    assert (ckpt / "hf_zero_manifest.json").read_text() == before  # the previous checkpoint is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # and the half-written one is gone
    for r in pools(2).values(checkpoint_cases.load_into_fresh_model, str(ckpt), "llama", 3):
        assert r["error_type"] is None  # it still loads, checksums verified


def test_unwritable_location_is_a_clear_error_on_every_rank(pools, tmp_path):
    """A real filesystem error, no injection: the checkpoint's parent is a regular file."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    start = time.monotonic()
    for r in pools(2).run(checkpoint_cases.save_with_fault, str(blocker / "ckpt"), -1, None):
        assert r.ok and r.value["error_type"] == "OSError" and "not-a-dir" in r.value["error"], r
    assert time.monotonic() - start < 60
    assert blocker.read_text() == "x"


def test_one_rank_with_invalid_input_makes_all_raise_within_seconds(pools):
    start = time.monotonic()
    results = pools(2).run(engine_cases.initialize_with_wrap, ["auto", ["NoSuchLayer"]], timeout=60)
    assert time.monotonic() - start < 20
    assert [r.error_type for r in results] == ["ValueError", "ValueError"]


def test_trainer_resumes_from_the_last_complete_checkpoint(pools, tmp_path):
    """checkpoint-4's save was cut short (no manifest, no trainer_state.json, as a killed save leaves
    it): resume_from_checkpoint=True takes checkpoint-2 and finishes like an uninterrupted run."""
    from tests import _trainer_cases as tc

    job = tc.Job(kind="llama", stage=3, world=2, save_steps=2, steps=6)
    straight = pools(2).values(tc.run, replace(job, out_dir=str(tmp_path / "straight")))[0]
    out = tmp_path / "run"
    pools(2).values(tc.run, replace(job, out_dir=str(out), stop_after=4))
    (out / "checkpoint-4" / "hf_zero" / "hf_zero_manifest.json").unlink()
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    resumed = pools(2).values(tc.run, replace(job, out_dir=str(out), seed=1, resume_from=True))[0]
    assert resumed["losses"][2:] == straight["losses"][2:]  # steps 3-6 after resuming at checkpoint-2
    manifest = json.loads((out / "checkpoint-6" / "hf_zero" / "hf_zero_manifest.json").read_text())
    assert manifest["user"] == {"global_step": 6}
    np.testing.assert_array_equal(resumed["state"]["lm_head.weight"].numpy(), straight["state"]["lm_head.weight"].numpy())


def _run_user_scripts(tmp_path: Path, launches: list[list[str]]) -> list[tuple[int, str]]:
    """Run tests/_exit_script.py under torchrun (2 gloo ranks) once per entry of `launches` (its extra arguments),
    two launches at a time; each launch's exit code and the tail of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    results: list[tuple[int, str]] = []
    for first in range(0, len(launches), 2):
        running = []
        for i in range(first, min(first + 2, len(launches))):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(ROOT / "tests" / "_exit_script.py"), str(tmp_path / f"ckpt{i}"), *launches[i]]
            running.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
        for proc in running:
            out, _ = proc.communicate(timeout=300)
            results.append((proc.returncode, out[-1500:]))
    return results


# Launches of the clean-exit test: 1 of each kind in the suite (CI), side by side; the soak before a change to
# teardown.py runs 20 or more (`make test-slow` does):
# HF_ZERO_EXIT_LAUNCHES=20 .venv/bin/python -m pytest tests/test_reliability.py -k exits_0
EXIT_LAUNCHES = int(os.environ.get("HF_ZERO_EXIT_LAUNCHES", "1"))


# the slow tier (25 s on 2 cores; `make test-slow` repeats it 20 times): every `accelerate launch` of the suite
# (train_clm, the TRL example) requires exit code 0 of the processes that run hf_zero too
@pytest.mark.slow
def test_a_user_script_exits_0_every_time(tmp_path):
    """[Note: clean exit]: train, save, load, destroy_process_group(), return: `EXIT_LAUNCHES` launches on 2 gloo
    ranks, and as many (at most 2) that return without destroying the process group, two launches at a time (so
    the machine is busy as a shared node is): every exit code 0."""
    kept = [["--keep-group"]] * min(EXIT_LAUNCHES, 2)
    launches = [item for pair in zip([[]] * len(kept), kept) for item in pair] + [[]] * (EXIT_LAUNCHES - len(kept))
    results = _run_user_scripts(tmp_path, launches)
    failed = [(code, tail) for code, tail in results if code != 0]
    assert not failed, f"{len(failed)} of {len(results)} launches exited non-zero; first:\n{failed[0][1]}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_job(out: Path, mode: str, max_steps: int) -> list[subprocess.Popen]:
    """The two ranks of a ZeroTrainer job (tests/_preempt_run.py), launched as torchrun would set them up."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        cmd = [sys.executable, str(ROOT / "tests" / "_preempt_run.py"), str(out), mode, str(max_steps)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list[subprocess.Popen], out: Path) -> list[dict]:
    for p in procs:
        p.communicate(timeout=300)
    return [dict(json.loads((out / f"status-{r}.json").read_text()), exit=p.returncode) for r, p in enumerate(procs)]


@pytest.mark.slow  # the launcher test below checks the same through torchrun; this one launches the ranks directly
def test_sigterm_to_one_rank_saves_a_checkpoint_and_the_resumed_run_matches(tmp_path):
    """[Note: preemption]: SIGTERM to rank 1 alone, mid-training, under --zero_save_on_preemption: both ranks stop
    at the same step with a complete checkpoint-N and exit 75 (hf_zero.PREEMPTED_EXIT_CODE); the job requeued
    with train(resume_from_checkpoint=True) logs the losses of an uninterrupted run, bit for bit. Only the
    preempted ranks leave with the collector frozen ([Note: quick exit])."""
    straight = _finish(_start_job(tmp_path / "straight", "straight", 8), tmp_path / "straight")
    assert [s["exit"] for s in straight] == [0, 0] and len(straight[0]["losses"]) == 8
    assert [(tmp_path / "straight" / f"frozen-{r}").read_text() for r in range(2)] == ["0", "0"]

    run = tmp_path / "run"
    procs = _start_job(run, "preempt", 8)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait for step 2 to be done on rank 0, then preempt rank 1 only
        progress = run / "progress-0"
        if progress.is_file() and progress.read_text().strip() and int(progress.read_text()) >= 2:
            break
        time.sleep(0.05)
    procs[1].send_signal(15)
    stopped = _finish(procs, run)
    assert [s["exit"] for s in stopped] == [hf_zero.PREEMPTED_EXIT_CODE] * 2, stopped
    assert all(int((run / f"frozen-{r}").read_text()) > 0 for r in range(2))  # [Note: quick exit]
    step = stopped[0]["step"]
    assert stopped[1]["step"] == step and 2 <= step < 8
    checkpoint = run / f"checkpoint-{step}"
    assert (checkpoint / "hf_zero" / "hf_zero_manifest.json").is_file() and (checkpoint / "trainer_state.json").is_file()
    assert hf_zero.last_complete_checkpoint(run, r"checkpoint-(\d+)", subdir="hf_zero") == checkpoint

    resumed = _finish(_start_job(run, "resume", 8), run)
    assert [s["exit"] for s in resumed] == [0, 0]
    assert resumed[0]["losses"] == straight[0]["losses"]


# the slow tier (20 s each on 2 cores); the suite keeps SIGTERM to one rank saving and resuming exactly
# (test_sigterm_to_one_rank_saves_a_checkpoint_and_the_resumed_run_matches) and the plugin's preemption stop
@pytest.mark.parametrize("launcher, requeue", [pytest.param("torchrun", False, marks=pytest.mark.slow),
                                               pytest.param("torchrun", True, marks=pytest.mark.slow),
                                               pytest.param("accelerate", False, marks=pytest.mark.slow)])
def test_a_preempted_job_exits_75_through_its_launcher(tmp_path, launcher, requeue):
    """[Note: preemption marker]: under `hf-zero preemptible OUT -- <launcher> ...`, SIGTERM to one rank mid-training
    ends the job with exit 75 (the launcher alone exits 1), leaving the marker that names the complete checkpoint;
    the preempted ranks leave with the collector frozen ([Note: quick exit]). With `requeue` (the slow tier; the
    suite resumes Trainer checkpoints exactly in test_trainer_resumes_from_the_last_complete_checkpoint) the
    requeued launch resumes from it, removes the marker, exits 0 and logs the losses of an uninterrupted run, bit
    for bit."""
    import json
    import signal

    run = tmp_path / "run"
    script = [str(ROOT / "tests" / "_preempt_run.py"), str(run)]
    if launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(_free_port()),
                  "--num_cpu_threads_per_process", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "true"}
    wrapper = [sys.executable, "-m", "hf_zero.cli", "preemptible", str(run), "--"]
    proc = subprocess.Popen(wrapper + launch + script + ["preempt", "8"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # step 2 done on rank 0: preempt rank 1 only
        progress = run / "progress-0"
        if progress.is_file() and progress.read_text().strip() and int(progress.read_text()) >= 2:
            break
        time.sleep(0.05)
    os.kill(int((run / "pid-1").read_text()), signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == hf_zero.PREEMPTED_EXIT_CODE, out[-3000:]
    marker = json.loads((run / "hf_zero_preempted.json").read_text())
    checkpoint = run / marker["checkpoint"]
    assert marker["exit_code"] == 75 and checkpoint.name == f"checkpoint-{marker['step']}"
    assert (checkpoint / "hf_zero" / "hf_zero_manifest.json").is_file() and (checkpoint / "trainer_state.json").is_file()
    assert all(int((run / f"frozen-{r}").read_text()) > 0 for r in range(2))  # [Note: quick exit]
    if requeue:  # the same wrapper, resuming
        done = subprocess.run(wrapper + launch + script + ["resume", "8"], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
        assert not (run / "hf_zero_preempted.json").exists()
        status = json.loads((run / "status-0.json").read_text())
        assert status["step"] == 8 and len(status["losses"]) == 8  # the checkpoint's log history, then the rest
        straight = _finish(_start_job(tmp_path / "straight", "straight", 8), tmp_path / "straight")
        assert [s["exit"] for s in straight] == [0, 0]
        assert [(tmp_path / "straight" / f"frozen-{r}").read_text() for r in range(2)] == ["0", "0"]
        assert status["losses"] == straight[0]["losses"]  # exact: the requeued job continues as if never stopped


# The save path's collectives a rank dies before: 1 in the suite (the save's last collective);
# HF_ZERO_SAVE_KILL_POINTS=0,1,2,3,4,5,6,7 for all (make test-slow).
KILL_POINTS = [int(k) for k in os.environ.get("HF_ZERO_SAVE_KILL_POINTS", "7").split(",")]


@pytest.mark.parametrize("k", KILL_POINTS, ids=lambda k: f"collective-{k}")
def test_a_rank_killed_inside_the_save_path_leaves_no_rank_waiting(tmp_path, k):
    """Rank 1 is SIGKILLed right before the k-th collective of a save (0: before initialize makes the background
    saves' group; then 1 the argument agreement, 2 the leftovers agreement, 3 the token broadcast, 4 the write
    agreement, 5 the record gather, 6 the manifest agreement, 7 the commit's): rank 0 raises an error within the
    group timeout (`group_timeout_s` 10 s here) instead of waiting, and nothing appears at the target before the
    commit."""
    import json

    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "_kill_in_save_collective.py"),
                                       str(tmp_path), str(k)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out0, _ = procs[0].communicate(timeout=180)
    procs[1].communicate(timeout=30)
    assert procs[1].returncode == -9
    status = json.loads((tmp_path / "status-0.json").read_text())
    assert status["error"] is not None and procs[0].returncode == 1, out0[-3000:]
    assert status["seconds"] < 90, status  # the group timeout is 10 s; start-up and the step take the rest
    if k < 7:  # before the commit's agreement nothing appears at the target
        assert not (tmp_path / "ckpt").exists()
    # (killed before the commit's agreement, every rank's files were already in: rank 0 commits a whole checkpoint)
