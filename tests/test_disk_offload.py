"""Disk offload (`offload_dir`): the same numbers as in memory, checkpoints that cross between the two,
clear errors on every rank, and nothing left on disk once the model is released.

Tolerance: losses and weights within 1e-6 relative of the same run with the state in host memory
(`offload_optimizer` alone). The arithmetic is the same (only where the state rests differs), so the
runs agree bit for bit on CPU; 1e-6 leaves room for a GPU's host/device mix.
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from hf_zero.engine.step.whole import register_elementwise
from tests._training import Scenario, make_model, make_optimizer, reference_run, rel_err, sharded_run

pytestmark = pytest.mark.device_agnostic

IN_MEMORY = (("offload_optimizer", True),)


def _on_disk(directory: Path, *extra: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    return (("offload_optimizer", True), ("offload_dir", str(directory)), *extra)


def _assert_same(a: dict, b: dict, tol: float = 1e-6) -> None:
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=tol, atol=0)
    np.testing.assert_allclose(a["norms"], b["norms"], rtol=tol, atol=0)
    for name, value in a["state"].items():
        assert rel_err(b["state"][name], value) <= tol, name


@pytest.mark.parametrize(
    "stage, mixed, extra",
    [(1, "no", ()), (2, "no", ()), (3, "no", ()), (1, "bf16", ()), (2, "bf16", ()), (3, "bf16", ()),
     (3, "fp16", ()), (3, "bf16", (("offload_params", True),)), (3, "no", (("offload_params", True),))],
)
def test_disk_offload_matches_memory(pools, tmp_path, stage, mixed, extra):
    # Accumulation (2 micro-batches) and clipping (1.0) on, 5 steps, 2 ranks.
    base = Scenario(model="llama", stage=stage, world=2, mixed_precision=mixed, steps=5, accum=2, max_grad_norm=1.0)
    memory = pools(2).values(sharded_run, replace(base, config_overrides=IN_MEMORY + extra))[0]
    disk = pools(2).values(sharded_run, replace(base, config_overrides=_on_disk(tmp_path, *extra)))[0]
    _assert_same(memory, disk)
    # The master weights and the moments are on disk: what stays in host memory for the optimizer is
    # Adam's step counts; the files hold the master and two moments per trainable element of the shard.
    mem = disk["memory"]
    shard_numel = sum(p["shard"] for p in disk["parts"] if p["trainable"])
    assert mem.optimizer_states["disk"] == 3 * 4 * shard_numel
    assert mem.optimizer_states.get("host", 0) < 1024
    assert memory["memory"].optimizer_states["host"] >= 2 * 4 * shard_numel  # in memory: the moments at least
    if extra:  # [Note: parameters on disk]: the gathers read the master file; no parameter shard is kept
        assert sum(mem.parameters.values()) == 0 and sum(memory["memory"].parameters.values()) > 0
        # The steps' windows (the master at the first, master and two moments after) and at least one gather
        # of every unit per micro-batch (5 steps x 2): the fp32 master shard read again.
        windows = (4 + 4 * 3 * 4) * shard_numel
        assert disk["disk_read_bytes"] >= windows + 5 * 2 * 4 * shard_numel


def test_disk_offload_matches_the_unsharded_reference(pools, tmp_path):
    sc = Scenario(model="falcon", stage=3, world=2, steps=4, config_overrides=_on_disk(tmp_path))
    ref = reference_run(sc.single())
    disk = pools(2).values(sharded_run, sc)[0]
    np.testing.assert_allclose(disk["losses"], ref["losses"], rtol=1e-5, atol=0)
    for name, value in ref["state"].items():
        assert rel_err(disk["state"][name], value) <= 1e-5, name


@pytest.mark.parametrize("before, after", [("disk", "memory"), ("memory", "disk"), ("disk", "disk"),
                                           ("disk+params", "memory"), ("memory", "disk+params")])
def test_checkpoints_cross_between_disk_and_memory(pools, tmp_path, before, after):
    modes = {"disk": _on_disk(tmp_path / "offload"), "memory": IN_MEMORY,
             "disk+params": _on_disk(tmp_path / "offload", ("offload_params", True))}
    sc = Scenario(model="llama", stage=3, world=2, steps=5, mixed_precision="bf16")
    straight = pools(2).values(sharded_run, replace(sc, config_overrides=modes["memory"]))[0]
    ckpt = str(tmp_path / "ckpt")
    first = pools(2).values(sharded_run, replace(sc, config_overrides=modes[before], stop_step=3, save_to=ckpt))[0]
    second = pools(2).values(sharded_run, replace(sc, config_overrides=modes[after], seed=1, start_step=3,
                                                 load_from=ckpt))[0]
    assert first["losses"] + second["losses"] == straight["losses"]  # the next loss too: bit for bit
    for name, value in straight["state"].items():
        np.testing.assert_array_equal(second["state"][name], value, err_msg=name)


def test_disk_checkpoint_resumes_on_another_world_size(pools, tmp_path):
    # 12 sequences per step on 2 ranks (3 micro-batches of 2 each), then on 3 ranks (2 each).
    sc2 = Scenario(model="llama", stage=3, world=2, accum=3, micro_bs=2, steps=5)
    sc3 = replace(sc2, world=3, accum=2)
    straight = pools(2).values(sharded_run, replace(sc2, config_overrides=IN_MEMORY))[0]
    ckpt = str(tmp_path / "ckpt")
    first = pools(2).values(sharded_run, replace(sc2, config_overrides=_on_disk(tmp_path / "a"), stop_step=3,
                                                save_to=ckpt))[0]
    second = pools(3).values(sharded_run, replace(sc3, config_overrides=_on_disk(tmp_path / "b"), seed=1,
                                                 start_step=3, load_from=ckpt))[0]
    np.testing.assert_allclose(first["losses"] + second["losses"], straight["losses"], rtol=1e-6, atol=0)
    for name, value in straight["state"].items():
        assert rel_err(second["state"][name], value) <= 1e-5, name


# ---- errors --------------------------------------------------------------------------------------

def _initialize_with(offload_dir: str, bad_rank: int, how: str) -> dict[str, Any]:
    """Every rank initializes with `offload_dir`; rank `bad_rank` gets an unwritable folder or a full disk."""
    import shutil

    import torch.distributed as dist

    import hf_zero

    rank = dist.get_rank()
    directory = offload_dir
    if rank == bad_rank and how == "unwritable":
        blocker = Path(offload_dir) / "a-file"
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("not a folder")
        directory = str(blocker / "offload")
    original = shutil.disk_usage
    if rank == bad_rank and how == "full":
        shutil.disk_usage = lambda path: original(path)._replace(free=4096)  # type: ignore[assignment]
    try:
        model = make_model("llama")
        config = hf_zero.ZeroConfig(stage=3, offload_optimizer=True, offload_dir=directory)
        hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"type": type(e).__name__, "message": str(e)}
    finally:
        shutil.disk_usage = original
    return {"type": None, "message": ""}


@pytest.mark.parametrize("how, expected", [("unwritable", "cannot be written"), ("full", "GiB free; this rank needs")])
def test_bad_offload_dir_fails_on_every_rank_at_initialize(pools, tmp_path, how, expected):
    results = pools(2).values(_initialize_with, str(tmp_path / "offload"), 1, how)
    for r in results:
        assert r["type"] is not None, r
        assert "offload_dir" in r["message"] and expected in r["message"], r
    assert "failed on rank(s) [1]" in results[0]["message"]  # rank 0 names the rank that failed
    leftovers = [p for p in (tmp_path / "offload").rglob("*") if p.name != "a-file"] if (tmp_path / "offload").exists() else []
    assert leftovers == []  # the ranks that could create their files removed them


def test_offload_dir_config_errors():
    import hf_zero

    with pytest.raises(ValueError, match="offload_dir needs offload_optimizer=True"):
        hf_zero.ZeroConfig(offload_dir="/tmp/x")
    with pytest.raises(TypeError, match="offload_dir must be a folder path"):
        hf_zero.ZeroConfig(offload_optimizer=True, offload_dir=3)  # type: ignore[arg-type]
    assert hf_zero.ZeroConfig(offload_optimizer=True, offload_dir=Path("/nvme")).offload_dir == "/nvme"


# ---- the pieces ----------------------------------------------------------------------------------

def _release_removes_files(offload_dir: str) -> dict[str, Any]:
    import hf_zero
    import hf_zero.engine.step.disk as disk_module

    disk_module.WINDOW_NUMEL = 2000  # many windows for a tiny model (chunks larger than that are one window each)
    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3),
                                    hf_zero.ZeroConfig(stage=3, offload_optimizer=True, offload_dir=offload_dir))
    batch = torch.randint(0, 256, (2, 8))
    disk = model.zero_engine.disk
    made = []
    for _ in range(3):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        made.append(disk.buffers_made)
    mine = disk.files.directory
    disk.drain()
    buffers = (disk.buffers_made, disk.buffer_bytes, disk.capacity, len(disk.windows), disk.device.type)
    disk_module.WINDOW_NUMEL = 1 << 22
    del disk
    during = sorted(p.name for p in mine.iterdir())
    del model, opt
    gc.collect()
    return {"during": during, "after": mine.exists(), "made": made, "buffers": buffers}


def test_files_are_removed_when_the_model_is_released(pools, tmp_path):
    for r in pools(2).values(_release_removes_files, str(tmp_path)):
        assert r["during"] == ["master.bin", "state-exp_avg.bin", "state-exp_avg_sq.bin"]
        assert r["after"] is False
        # A fixed set of host buffers per step, each of the largest window's size, reused across its windows: at
        # most (read ahead + the stepped one + writes behind + one) x (master + 2 moments); on the CPU none is
        # held between steps.
        from hf_zero.engine.step.disk import READ_AHEAD, WRITE_BEHIND

        made, (count, held, capacity, windows, device) = r["made"], r["buffers"]
        per_step = made[0]
        assert per_step <= (READ_AHEAD + WRITE_BEHIND + 2) * 3 and capacity > 0
        if device == "cpu":  # freed after each step
            assert made == [per_step, 2 * per_step, 3 * per_step] and held == 0
        else:  # pinned: made once, reused
            assert made == [per_step] * 3 and held == count * capacity * 4
        assert windows > READ_AHEAD + WRITE_BEHIND + 2  # more windows than buffers: they really are reused


def test_streamed_safetensors_file_reads_back_and_copies_nothing(tmp_path):
    from safetensors.torch import load_file

    from hf_zero.checkpoint.stream import PIECE_NUMEL, Entry, host_pieces, write_streamed

    host = torch.randn(10, 3)
    pieces = list(host_pieces(host)())
    assert len(pieces) == 1 and pieces[0].data_ptr() == host.data_ptr()  # a host tensor is written from its memory
    big = torch.arange(PIECE_NUMEL + 5, dtype=torch.float64).to(torch.float32)
    entries = [
        Entry("a", torch.float32, (30,), host_pieces(host)),
        Entry("joined", torch.float32, (PIECE_NUMEL + 7,), host_pieces(big, torch.ones(2))),
        Entry("half", torch.bfloat16, (4,), host_pieces(torch.tensor([1.0, 2, 3, 4], dtype=torch.bfloat16))),
        Entry("scalar", torch.float64, (), host_pieces(torch.tensor(7.0, dtype=torch.float64))),
    ]
    path = tmp_path / "x.safetensors"
    digest = write_streamed(path, entries, {"hf_zero": "{}"})
    assert digest == "xxh3_128:" + xxhash.xxh3_128(path.read_bytes()).hexdigest()
    back = load_file(str(path))
    torch.testing.assert_close(back["a"], host.reshape(-1), rtol=0, atol=0)
    torch.testing.assert_close(back["joined"], torch.cat([big, torch.ones(2)]), rtol=0, atol=0)
    assert back["half"].dtype == torch.bfloat16 and back["half"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert back["scalar"].item() == 7.0
    with pytest.raises(RuntimeError, match="gave 120 bytes"):
        write_streamed(tmp_path / "y.safetensors", [Entry("a", torch.float32, (31,), host_pieces(host))])


def test_offload_files_round_trip_and_report_a_full_disk(tmp_path, monkeypatch):
    import shutil

    from hf_zero.engine.step.disk import MASTER, OffloadFiles

    files = OffloadFiles.create(tmp_path, rank=3, numel=100, dtype=torch.float32)
    (folder,) = tmp_path.iterdir()
    assert folder.name.endswith("rank00003") and (folder / "master.bin").stat().st_size == 400
    files.write(MASTER, 10, torch.arange(5, dtype=torch.float32))
    out = torch.empty(7)
    files.read(MASTER, 9, out)
    assert out[1:6].tolist() == [0, 1, 2, 3, 4]
    files.add("exp_avg", torch.bfloat16)
    assert files.nbytes == 400 + 200
    files.remove()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))  # type: ignore[attr-defined]
    with pytest.raises(OSError, match="needs 0.00 GiB"):
        OffloadFiles.create(tmp_path, rank=0, numel=100, dtype=torch.float32)
    assert list(tmp_path.iterdir()) == []
    os.sync()


def test_an_unclosed_disk_offload_is_finalized_without_joining_its_threads(tmp_path):
    """[Note: no join in a finalizer]: the finalizer of a store nobody closed, run (as the garbage collector runs it)
    in a thread that holds `threading`'s shutdown lock, as a thread starting up does: it returns and removes the
    files (it joined the I/O threads there, which take that lock to finish: a rank hung in a save)."""
    import threading

    from hf_zero.engine.step.disk import DiskOffload, OffloadFiles

    files = OffloadFiles.create(tmp_path, rank=0, numel=100, dtype=torch.float32)
    store = DiskOffload(files, torch.device("cpu"), {})
    store._io.submit(files.advise_willneed).result()  # an I/O thread started, now idle
    finalizer = store._finalizer
    done = threading.Event()

    def collect() -> None:
        with threading._shutdown_locks_lock:  # type: ignore[attr-defined]  # held by Thread._set_tstate_lock
            finalizer()
        done.set()

    threading.Thread(target=collect, daemon=True).start()
    assert done.wait(20), "the finalizer waited for the I/O threads while holding threading's shutdown lock"
    assert list(tmp_path.iterdir()) == []


def test_optimizer_state_dict_is_refused_with_a_pointer_to_checkpoints(tmp_path):
    import hf_zero

    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(
        stage=3, offload_optimizer=True, offload_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="use hf_zero.save_checkpoint"):
        opt.state_dict()
    with pytest.raises(ValueError, match="offload_dir"):
        opt.load_state_dict({})


class PrimedSGD(torch.optim.SGD):
    """An optimizer hf_zero does not know as elementwise (stepped on whole parameters) that sets its momentum
    at construction."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=1e-2, momentum=0.9)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.full_like(p, 0.01)


def test_state_set_at_construction_is_refused_on_disk_only_for_whole_parameter_optimizers(tmp_path):
    """[Note: state set at construction] Adagrad's accumulator goes into the files (test above); an optimizer
    stepped on whole parameters keeps its state in memory, so one with state at construction is refused, by name."""
    import hf_zero

    model = make_model("llama")
    with pytest.raises(ValueError, match="PrimedSGD set its state 'momentum_buffer'.*stepped on whole parameters"):
        hf_zero.initialize(model, PrimedSGD(model.parameters()), hf_zero.ZeroConfig(
            stage=3, offload_optimizer=True, offload_dir=str(tmp_path)))


@register_elementwise  # a user's own elementwise optimizer: declared, so it takes the flat path
class CountingSGD(torch.optim.Optimizer):
    """An elementwise optimizer that keeps a step counter in its param group (as schedule-free optimizers do)
    and scales its update by it: stepped window by window, it must still advance the counter once per step."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr, "k": 0})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            k = group["k"] + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["trace"] = torch.zeros_like(p)
                state["trace"].mul_(0.5).add_(p.grad)
                p.add_(state["trace"], alpha=-group["lr"] * k)
            group["k"] = k


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One step with clipping at 1.0; returns the loss."""
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    return float(loss)


def _train_with(optimizer_name: str, offload_dir: str | None, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import hf_zero

    model = make_model("llama")
    params = model.parameters()
    opt = {"amsgrad": lambda: torch.optim.Adam(params, lr=1e-3, amsgrad=True),
           "sgd": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
           "counting": lambda: CountingSGD(params, lr=1e-3),
           "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-2, initial_accumulator_value=0.1)}[optimizer_name]()
    import hf_zero.engine.step.disk as disk_module

    extra = {"offload_dir": offload_dir} if offload_dir else {}
    disk_module.WINDOW_NUMEL = 2000  # many windows, so a per-window counter would show
    try:
        model, opt = hf_zero.initialize(model, opt, hf_zero.ZeroConfig(stage=3, offload_optimizer=True, **extra))
    finally:
        disk_module.WINDOW_NUMEL = 1 << 22
    windows = len(model.zero_engine.disk.windows) if offload_dir else 0
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 256, (2, 8), generator=g)[dist.get_rank()].reshape(1, 8)
        losses.append(_train_step(model, opt, batch))
    counters = [g.get("k") for g in opt.param_groups]
    disk = model.zero_engine.disk
    files = sorted(p.name for p in disk.files.directory.iterdir()) if disk is not None else []
    state = {k: v.float().numpy().copy() for k, v in hf_zero.full_state_dict(model).items()}
    return {"losses": losses, "state": state, "counters": counters, "files": files, "windows": windows}


@pytest.mark.parametrize("name, files", [
    ("amsgrad", ["master.bin", "state-exp_avg.bin", "state-exp_avg_sq.bin", "state-max_exp_avg_sq.bin"]),
    ("sgd", ["master.bin", "state-momentum_buffer.bin"]),
    ("counting", ["master.bin", "state-trace.bin"]),
    ("adagrad", ["master.bin", "state-sum.bin"]),  # its accumulator set at construction: written at initialize
])
def test_any_elementwise_optimizer_steps_the_same_from_disk(pools, tmp_path, name, files):
    memory = pools(2).values(_train_with, name, None, 4)[0]
    disk = pools(2).values(_train_with, name, str(tmp_path), 4)[0]
    assert disk["files"] == files  # one file per elementwise state, made at the first step (or at initialize)
    assert disk["windows"] > 10
    assert disk["counters"] == memory["counters"]  # a group counter advances once per step, not once per window
    _assert_same({**memory, "norms": []}, {**disk, "norms": []})


def _reach_in_between_steps(offload_dir: str | None, offload_params: bool = False) -> dict[str, Any]:
    """What users do between steps: change a weight inside `gathered_parameters(modifier_rank=0)`, read
    `state_dict()`, load a changed one with `load_state_dict`, and train on."""
    import torch.distributed as dist

    import hf_zero

    model = make_model("llama")
    extra: dict[str, Any] = {"offload_dir": offload_dir} if offload_dir else {}
    extra["offload_params"] = offload_params
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3),
                                    hf_zero.ZeroConfig(stage=3, mixed_precision="bf16", offload_optimizer=True, **extra))
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))[dist.get_rank()].reshape(1, 8)
    losses = []

    def step() -> None:
        losses.append(_train_step(model, opt, batch))

    step()
    with hf_zero.gathered_parameters(model.lm_head.weight, modifier_rank=0):
        if dist.get_rank() == 0:
            model.lm_head.weight.mul_(0.5)
    step()
    sd = model.state_dict()
    sd["model.norm.weight"] = sd["model.norm.weight"] * 1.5
    model.load_state_dict(sd)
    step()
    return {"losses": losses, "state": {k: v.float().numpy().copy() for k, v in hf_zero.full_state_dict(model).items()}}


@pytest.mark.parametrize("offload_params", [False, True])
def test_weights_changed_between_steps_reach_the_disk_masters(pools, tmp_path, offload_params):
    memory = pools(2).values(_reach_in_between_steps, None, offload_params)[0]
    disk = pools(2).values(_reach_in_between_steps, str(tmp_path), offload_params)[0]
    assert disk["losses"] == memory["losses"]
    for name, value in memory["state"].items():
        np.testing.assert_array_equal(disk["state"][name], value, err_msg=name)
