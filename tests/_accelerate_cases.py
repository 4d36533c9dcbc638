"""The same plain Accelerate loop under DDP (`Accelerator`) and under hf_zero (`ZeroAccelerator`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from tests._async_save_cases import recording_snapshots
from tests._trainer_cases import TokenDataset
from tests._training import make_model, make_optimizer


def _fresh_accelerator(use_zero: bool, stage: int, accum: int, async_save: bool = False,
                       budget: str | None = None, compile_backend: str | None = None) -> Any:
    """`compile_backend`: Accelerate's dynamo plugin with that backend and regional compilation."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    import hf_zero

    AcceleratorState._reset_state(True)  # each test builds its own accelerator in these long-lived workers
    GradientState._reset_state()
    dynamo = {"dynamo_plugin": TorchDynamoPlugin(backend=compile_backend, use_regional_compilation=True)
              } if compile_backend else {}
    if use_zero:
        plugin = hf_zero.ZeroPlugin(zero_stage=stage, zero_async_save=async_save, zero_snapshot_budget=budget)
        return hf_zero.ZeroAccelerator(zero_plugin=plugin, gradient_accumulation_steps=accum, **dynamo)
    return Accelerator(cpu=True, gradient_accumulation_steps=accum, **dynamo)


def _optimizers(model: torch.nn.Module, two: bool) -> list[torch.optim.Optimizer]:
    """The Trainer's AdamW groups; or (`two`) Adafactor on the matrices (whole parameters, [Note: whole-parameter
    step]) and AdamW on the rest (flat shards)."""
    if not two:
        return [make_optimizer(model, 1e-3)]
    matrices = [p for p in model.parameters() if p.ndim == 2]
    taken = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in taken]
    return [torch.optim.Adafactor(matrices, lr=1e-2), torch.optim.AdamW(rest, lr=1e-3, eps=1e-6)]


def loop(use_zero: bool, stage: int = 3, steps: int = 4, accum: int = 2, save_at: int | None = None,
         save_dir: str | None = None, load_dir: str | None = None, resume_step: int = 0,
         seed: int = 0, train: bool = True, two_optimizers: bool = False, async_save: bool = False,
         snapshot_budget: str | None = None, compile_backend: str | None = None,
         model_first: bool = False) -> dict[str, Any]:
    """Train `steps` optimizer steps; optionally save_state after `save_at` steps or load_state first.
    `two_optimizers`: two optimizers over disjoint parameters (`_optimizers`), each with its scheduler; `async_save`:
    the plugin's zero_async_save (the save returns at once; the loop waits for it before returning), with
    `snapshot_budget` as its zero_snapshot_budget; the snapshots taken are in the result (`snapshots`).
    `compile_backend`: the accelerator compiles the model's blocks with it (dynamo's compiled frames in the result).
    `model_first`: the model prepared alone, then the optimizers built over its parameters and prepared with the
    loader (Accelerate's FSDP guide's order)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    accelerator = _fresh_accelerator(use_zero, stage, accum, async_save, snapshot_budget, compile_backend)
    model = make_model("llama", seed=seed)
    if model_first:
        model = accelerator.prepare(model)
    optimizers = _optimizers(model, two_optimizers)
    world = accelerator.num_processes
    loader = DataLoader(TokenDataset(2 * world * accum * steps, 16, seed=1), batch_size=2, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + 0.1 * step)) for o in optimizers]
    if model_first:
        loader, *rest = accelerator.prepare(loader, *optimizers, *schedulers)
    else:
        model, loader, *rest = accelerator.prepare(model, loader, *optimizers, *schedulers)
    optimizers, schedulers = rest[: len(optimizers)], rest[len(optimizers):]
    start = 0
    if load_dir is not None:
        accelerator.load_state(load_dir)
        start = resume_step
        loader = accelerator.skip_first_batches(loader, start * accum)
    losses, norms, done = [], [], start
    snapshots: list[dict[str, Any]] = []
    for batch in loader if train else []:
        with accelerator.accumulate(model):
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            accelerator.backward(out.loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            for optimizer, scheduler in zip(optimizers, schedulers):
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        losses.append(float(accelerator.gather(out.loss.detach()).mean()))
        if accelerator.sync_gradients:
            done += 1
            if save_at is not None and done == save_at:
                with recording_snapshots() as snapshots:
                    accelerator.save_state(save_dir)
                if async_save:
                    accelerator.wait_for_checkpoints()
                break
    state = accelerator.get_state_dict(model)
    return {
        "losses": losses, "norms": norms, "world": world, "lr": [s.get_last_lr() for s in schedulers],
        "snapshots": snapshots, "compiled_frames": counters["frames"]["ok"],
        "state": {k: v.detach().clone() for k, v in state.items()} if accelerator.is_main_process else None,
    }


def automatic_checkpoint_naming(project_dir: str) -> dict[str, Any]:
    """Accelerate's `ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)`: `save_state()` after
    each of 3 steps (Accelerate names and rotates `checkpoints/checkpoint_N`), one more step, then `load_state()`
    with no directory (the newest). The folders left, each one's contents, and whether the loaded weights equal
    those of the last save."""
    import os

    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    import hf_zero

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    project = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = hf_zero.ZeroAccelerator(zero_plugin=hf_zero.ZeroPlugin(zero_stage=3), project_config=project)
    model = make_model("llama")
    model, opt = accelerator.prepare(model, make_optimizer(model, 1e-3))
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(accelerator.process_index))
    saved: dict[str, torch.Tensor] = {}
    for _ in range(3):
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
        accelerator.save_state()
        saved = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}
    accelerator.backward(model(input_ids=batch, labels=batch).loss)
    opt.step()
    opt.zero_grad()
    accelerator.load_state()
    loaded = accelerator.get_state_dict(model)
    root = os.path.join(project_dir, "checkpoints")
    return {"folders": {f: sorted(os.listdir(os.path.join(root, f))) for f in sorted(os.listdir(root))},
            "equal": all(torch.equal(loaded[k], v) for k, v in saved.items()) if accelerator.is_main_process else None}


def state_hooks_refused(directory: str) -> dict[str, Any]:
    """A save-state and a load-state pre-hook registered on a ZeroAccelerator (diffusers' way of saving a model
    themselves): what `save_state` and `load_state` raise on this rank, and that the group is still usable."""
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = hf_zero.ZeroAccelerator(zero_plugin=hf_zero.ZeroPlugin(zero_stage=3))
    model = make_model("llama")
    model, opt = accelerator.prepare(model, make_optimizer(model, 1e-3))
    seen: list[int] = []
    outcome: dict[str, Any] = {}
    handle = accelerator.register_save_state_pre_hook(lambda models, weights, out: seen.append(len(models)))
    try:
        accelerator.save_state(directory)
    except ValueError as e:
        outcome["save"] = str(e)
    handle.remove()
    accelerator.save_state(directory)  # without the hook: fine
    accelerator.register_load_state_pre_hook(lambda models, input_dir: seen.append(len(models)))
    try:
        accelerator.load_state(directory)
    except ValueError as e:
        outcome["load"] = str(e)
    torch.distributed.barrier()
    outcome["hook_calls"] = seen
    return outcome


def preemption_stops_together(save_dir: str, signal_rank: int, signal_step: int) -> dict[str, Any]:
    """ZeroPlugin(zero_save_on_preemption=True): rank `signal_rank` gets SIGUSR1 during step `signal_step`; the
    loop asks `accelerator.preempted()` after each step and, once it says so, saves and stops. Returns the step
    this rank stopped at and whether the SIGUSR1 handler was put back by end_training."""
    import os
    import signal

    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    before = signal.getsignal(signal.SIGUSR1)
    plugin = hf_zero.ZeroPlugin(zero_stage=3, zero_save_on_preemption=True)
    accelerator = hf_zero.ZeroAccelerator(zero_plugin=plugin)
    model = make_model("llama")
    model, opt = accelerator.prepare(model, make_optimizer(model, 1e-3))
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
    stopped = None
    for step in range(1, 7):
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
        if step == signal_step and accelerator.process_index == signal_rank:
            os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler's signal, to this rank only
        if accelerator.preempted():
            stopped = step
            accelerator.save_state(save_dir)
            break
    state = accelerator.state
    destroy, state.destroy_process_group = state.destroy_process_group, lambda *a, **k: None  # the pool keeps it
    try:
        accelerator.end_training()
    finally:
        state.destroy_process_group = destroy
    return {"stopped": stopped, "handler_restored": signal.getsignal(signal.SIGUSR1) == before}


def prepare_refusals() -> dict[str, str]:
    """What `prepare` refuses, by name: an optimizer before its model (its step would meet an unattached
    optimizer), a second model with trainable parameters (a GAN's two: one model per accelerator trains), and an
    optimizer after a model prepared with every parameter frozen (sharded for inference); and what it takes: the
    model prepared again with its optimizer."""
    messages = {}
    for case in ("optimizer_first", "two_trained", "frozen_then_optimizer", "model_again"):
        accelerator = _fresh_accelerator(True, 3, 1)
        model = make_model("llama")
        optimizer = make_optimizer(model, 1e-3)
        try:
            if case == "optimizer_first":
                accelerator.prepare(optimizer)
            elif case == "two_trained":
                accelerator.prepare(model, make_model("llama", seed=1))
            elif case == "frozen_then_optimizer":  # every parameter frozen when prepared alone: for inference
                accelerator.prepare(model.requires_grad_(False))
                accelerator.prepare(optimizer)
            else:  # the model prepared again with its optimizer: not refused, the optimizer attached to it
                sharded = accelerator.prepare(model)
                again, prepared = accelerator.prepare(sharded, make_optimizer(sharded, 1e-3))
                messages["model_again_attached"] = str(again is sharded and prepared.optimizer in
                                                       accelerator._zero_optimizers)
            messages[case] = ""
        except ValueError as e:
            messages[case] = str(e)
    return messages


def two_trainings(use_zero: bool, steps: int = 2) -> dict[str, Any]:
    """Accelerate's `find_executable_batch_size` idiom: one accelerator, `free_memory()`, then a new model and
    optimizer prepared and trained, twice (the second a fresh model from another seed)."""
    accelerator = _fresh_accelerator(use_zero, 3, 1)
    losses: list[float] = []
    state: dict[str, torch.Tensor] = {}
    for seed in (0, 1):
        accelerator.free_memory()
        model = make_model("llama", seed=seed)
        loader = DataLoader(TokenDataset(2 * accelerator.num_processes * steps, 16, seed=1), batch_size=2)
        model, optimizer, loader = accelerator.prepare(model, make_optimizer(model, 1e-3), loader)
        for batch in loader:
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(accelerator.gather(loss.detach()).mean()))
        state = accelerator.get_state_dict(model)
    return {"losses": losses,
            "state": {k: v.detach().clone() for k, v in state.items()} if accelerator.is_main_process else None}


def distill(use_zero: bool, steps: int = 2, teacher_later: bool = False) -> dict[str, Any]:
    """Distillation: a frozen teacher prepared with the student (or, `teacher_later`, in a call of its own after
    them; under DDP, which cannot wrap a frozen model, moved to the device instead, as FSDP users prepare it); the
    loss is the student's own plus a KL term to the teacher's logits, computed without grad."""
    accelerator = _fresh_accelerator(use_zero, 3, 1)
    student, teacher = make_model("llama", seed=0), make_model("llama", seed=1).requires_grad_(False)
    loader = DataLoader(TokenDataset(2 * accelerator.num_processes * steps, 16, seed=1), batch_size=2)
    if not use_zero:  # DDP cannot take a frozen model (Accelerate would wrap it): the teacher stays whole
        student, optimizer, loader = accelerator.prepare(student, make_optimizer(student, 1e-3), loader)
        teacher = teacher.to(accelerator.device)
    elif teacher_later:
        student, optimizer, loader = accelerator.prepare(student, make_optimizer(student, 1e-3), loader)
        teacher = accelerator.prepare(teacher)
    else:
        student, teacher, optimizer, loader = accelerator.prepare(
            student, teacher, make_optimizer(student, 1e-3), loader)
    losses: list[float] = []
    for batch in loader:
        with torch.no_grad():
            target = teacher(input_ids=batch["input_ids"]).logits.log_softmax(-1)
        out = student(input_ids=batch["input_ids"], labels=batch["labels"])
        kl = torch.nn.functional.kl_div(out.logits.log_softmax(-1), target, log_target=True, reduction="batchmean")
        loss = out.loss + 0.5 * kl
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.gather(loss.detach()).mean()))
    from hf_zero.engine.module import is_sharded

    state = accelerator.get_state_dict(student)
    return {"losses": losses, "teacher_sharded": is_sharded(teacher),
            "state": {k: v.detach().clone() for k, v in state.items()} if accelerator.is_main_process else None}


def launched_world_checked() -> dict[str, Any]:
    """A launch of 2 processes without ACCELERATE_USE_CPU: `ZeroAccelerator()` on a machine without GPUs sees both
    ranks; after an Accelerate state made first without `cpu=True` (one process, as Accelerate then believes) it
    refuses on every rank, naming the fix."""
    import os

    from accelerate import PartialState
    from accelerate.state import AcceleratorState, GradientState

    import hf_zero

    saved = os.environ.pop("ACCELERATE_USE_CPU", None)
    try:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        processes = hf_zero.ZeroAccelerator().num_processes
        AcceleratorState._reset_state(True)
        PartialState(cpu=False)
        try:
            hf_zero.ZeroAccelerator(cpu=False)
            error = None
        except ValueError as e:
            error = str(e)
        AcceleratorState._reset_state(True)
        return {"processes": processes, "error": error}
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_CPU"] = saved
