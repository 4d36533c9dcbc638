"""Trainer runs shared by the tests: the same job under ZeroTrainer (on every rank of a pool) or the
stock Trainer (in one process), returning the logged losses, the eval loss and the final weights."""

from __future__ import annotations


import functools
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from tests._training import VOCAB, apply_liger_like, hf_zero_records, make_model, with_lora


class TokenDataset(Dataset):
    def __init__(self, n: int, seq: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class PointsDataset(Dataset):
    """Noisy points of y = 2x + 3 (`dim` inputs per row, summed), for the models without blocks."""

    def __init__(self, n: int, seed: int, dim: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = 2.0 * self.x.sum(1) + 3.0 + 0.1 * torch.randn(n, generator=g)
        self.dim = dim

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_x": self.x[i, 0] if self.dim == 1 else self.x[i], "labels": self.y[i]}


class ImagesDataset(Dataset):
    """Images of 3 classes whose brightness differs by row, so each rank's BatchNorm statistics differ."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (n,), generator=g)
        scale = 1.0 + (torch.arange(n) % 4).float()
        self.pixels = torch.randn(n, 3, 16, 16, generator=g) * scale[:, None, None, None] + self.labels[:, None, None, None]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


def resnet_model(seed: int) -> torch.nn.Module:
    """A tiny transformers ResNet (BatchNorm in every block) for 3 classes."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
                          layer_type="basic")
    return ResNetForImageClassification(config)


def scalar_model(seed: int) -> torch.nn.Module:
    """The upstream Trainer tests' kind of model: a `PreTrainedModel` with two scalar parameters, no submodule."""
    from transformers import PretrainedConfig, PreTrainedModel

    class ScalarsConfig(PretrainedConfig):
        model_type = "scalars"

        def __init__(self, a: float = 0.0, b: float = 0.0, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.a, self.b = a, b

    class ScalarsModel(PreTrainedModel):
        config_class = ScalarsConfig
        base_model_prefix = "scalars"

        def __init__(self, config: ScalarsConfig) -> None:
            super().__init__(config)
            self.a = torch.nn.Parameter(torch.tensor(float(config.a)))
            self.b = torch.nn.Parameter(torch.tensor(float(config.b)))

        def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            y = input_x * self.a + self.b
            return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)

    return ScalarsModel(ScalarsConfig(a=0.5 + seed, b=-0.25))


class MLPRegressor(torch.nn.Module):
    """A plain `nn.Sequential` of Linear layers with a loss around it (what users' own models look like)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                       torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        y = self.net(input_x).squeeze(-1)
        out = {"logits": y}
        if labels is not None:
            out["loss"] = torch.nn.functional.mse_loss(y, labels)
        return out


BLOCKLESS = {"scalars": 1, "mlp": 4}  # the models without transformer blocks, and their input width


@dataclass(frozen=True)
class Job:
    kind: str = "llama"
    stage: int = 3
    world: int = 2
    global_batch: int = 8
    micro_bs: int = 2
    steps: int = 4
    out_dir: str = ""
    save_steps: int | None = None
    stop_after: int | None = None  # stop (after that step's checkpoint) to simulate an interruption
    resume_from: str | None = None
    seed: int = 0  # model init seed; a resumed job uses another one to prove the checkpoint is loaded
    checkpointing: bool = False
    save_model_to: str | None = None
    tokenizer_dir: str | None = None
    zero_args: tuple[tuple[str, Any], ...] = ()  # extra ZeroTrainingArguments fields
    measure_window: bool = False  # record model-state memory between the micro-batches of each step
    lora: bool = False  # peft LoRA around the model (tests/_training.with_lora)
    save_total_limit: int | None = None
    snapshot_on_save: bool = False  # record the full state at every checkpoint (tests/test_trainer.py)
    optim: str = "adamw_torch"  # the Trainer's --optim
    optim_target_modules: tuple[str, ...] | None = None  # the Trainer's --optim_target_modules (GaLore, APOLLO)
    oom: str | None = None  # --auto_find_batch_size with a simulated out-of-memory error: "step_end" or "forward"
    best_model: bool = False  # evaluate every save_steps, load the best at the end
    eval_steps: int | None = None  # evaluate every that many steps (without best_model)
    eval_rows: int | None = None  # held-out samples (default: global_batch)
    counts: bool = False  # compute_metrics (how many samples, their label sum, accuracy) and tokens seen
    compile_backend: str | None = None  # --torch_compile_backend (turns --torch_compile on)
    regional_compile: bool = False  # Accelerate's use_regional_compilation (ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION)
    liger: bool = False  # --use_liger_kernel, with tests._training.apply_liger_like (Liger needs triton and a GPU)
    presharded: bool = False  # the model sharded (hf_zero.initialize, no optimizer) before the Trainer is built
    neftune_alpha: float | None = None  # the Trainer's --neftune_noise_alpha (noise on the input embeddings)
    evaluate_first: bool = False  # trainer.evaluate() before trainer.train() (the base model's eval loss first)
    use_cpu_flag: bool = True  # pass use_cpu=True on a CPU machine (False: as a plain torchrun launch does)
    base_dir: str | None = None  # kinds "qlora" (quantized on load: tests/_qlora_cases.py), "kept_fp32": the checkpoint

    @property
    def accum(self) -> int:
        sequence = dict(self.zero_args).get("zero_sequence_parallel", 1)  # its ranks share their batches
        return self.global_batch // (self.micro_bs * self.world // sequence)


class _WindowMemory(TrainerCallback):
    """After every micro-batch but the last of a step (the Trainer runs them under `no_sync`): the
    gradient bytes the engine accounts and how many units hold unsharded gradients."""

    def __init__(self) -> None:
        self.samples: list[dict[str, int]] = []

    def on_substep_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        engine = model.zero_engine
        memory = engine.memory()
        self.samples.append({
            "gradients": sum(memory.gradients.values()),
            "unsharded_grads": sum(u.grads.unsharded is not None for u in engine.parts),
            "shard_bytes": sum(u.layout.shard_numel * 4 for u in engine.parts if u.has_trainable),
            "held_unsharded_bytes": sum(u.grads.unsharded.untyped_storage().nbytes() for u in engine.parts
                                        if u.grads.unsharded is not None),
            "dense_trainable_units": sum(u.has_trainable and not u.sparse_lookup for u in engine.parts),
        })


class _SnapshotOnSave(TrainerCallback):
    """The full state (masters) of the model at each checkpoint, keyed by step (on the main process)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_save(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        import hf_zero

        full = hf_zero.full_state_dict(model)  # a collective: every rank saves
        if args.process_index == 0:
            self.states[state.global_step] = {k: v.detach().cpu().clone() for k, v in full.items()}


class _OOMAtStepEnd(TrainerCallback):
    """transformers' own test double: "CUDA out of memory." at the end of a step run with the first batch size."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if state.train_batch_size >= self.limit:
            raise RuntimeError("CUDA out of memory.")


def _oom_in_forward(model: torch.nn.Module, limit: int) -> None:
    """"CUDA out of memory." inside the second decoder layer's forward, on the second micro-batch of the first
    batch size: the first micro-batch's gradients exist, units are gathered, a pass is half done."""
    calls = [0]

    def hook(module, args, kwargs):  # noqa: ANN001
        hidden = args[0] if args else kwargs["hidden_states"]
        if torch.is_grad_enabled() and hidden.shape[0] >= limit:
            calls[0] += 1
            if calls[0] >= 2:
                raise RuntimeError("CUDA out of memory.")

    model.model.layers[1].register_forward_pre_hook(hook, with_kwargs=True)


class _AttemptStart(TrainerCallback):
    """At the start of each attempt of `--auto_find_batch_size` (sharded model): how many units are gathered and
    how many hold unsharded gradients; at the end, how many units the learned forward order has."""

    def __init__(self) -> None:
        self.attempts: list[dict[str, int]] = []
        self.order = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        engine = model.zero_engine
        from hf_zero.engine.lifecycle import ShardState

        self.attempts.append({"gathered": sum(u.shard_state is not ShardState.SHARDED for u in engine.units),
                              "unsharded_grads": sum(u.grads.unsharded is not None for u in engine.parts)})

    def on_train_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        self.order = len(model.zero_engine.hooks._forward_order)


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def _common(job: Job) -> dict[str, Any]:
    from tests._dist import device

    return dict(
        output_dir=job.out_dir, per_device_train_batch_size=job.micro_bs, per_device_eval_batch_size=job.micro_bs,
        gradient_accumulation_steps=job.accum, max_steps=job.steps, learning_rate=1e-3, weight_decay=0.1,
        adam_epsilon=1e-6,  # see tests/_training.make_optimizer: keeps Adam's rounding sensitivity far below 1e-5
        max_grad_norm=1.0, logging_steps=1, report_to="none", seed=0, disable_tqdm=True, optim=job.optim,
        optim_target_modules=list(job.optim_target_modules) if job.optim_target_modules else None,
        use_cpu=device().type == "cpu" and job.use_cpu_flag,
        save_strategy="steps" if job.save_steps else "no", save_steps=job.save_steps or 500,
        save_total_limit=job.save_total_limit,
        **(dict(eval_strategy="steps", eval_steps=job.save_steps, load_best_model_at_end=True,
                metric_for_best_model="eval_loss") if job.best_model else {}),
        **(dict(eval_strategy="steps", eval_steps=job.eval_steps) if job.eval_steps else {}),
        gradient_checkpointing=job.checkpointing, dataloader_num_workers=0, auto_find_batch_size=job.oom is not None,
        include_num_input_tokens_seen="all" if job.counts else "no", use_liger_kernel=job.liger,
        neftune_noise_alpha=job.neftune_alpha,
        **(dict(torch_compile_backend=job.compile_backend) if job.compile_backend else {}),
    )


def _counts(prediction: Any) -> dict[str, float]:
    """What the evaluation saw: every sample once, whatever the ranks' layout."""
    logits, labels = prediction.predictions, prediction.label_ids
    hits = logits[:, :-1].argmax(-1) == labels[:, 1:]
    return {"samples": float(len(labels)), "label_sum": float(labels.sum()), "accuracy": float(hits.mean())}


def run(job: Job, zero: bool = True) -> dict[str, Any]:
    """Train and evaluate; returns the logged losses, the eval loss and (on the main process) the weights."""
    from transformers import AutoTokenizer

    import hf_zero

    if job.kind == "scalars":
        model = scalar_model(job.seed)
    elif job.kind == "mlp":
        model = MLPRegressor(job.seed)
    elif job.kind == "resnet":
        model = resnet_model(job.seed)
    elif job.kind == "qlora":
        from tests._qlora_cases import qlora_model

        model = qlora_model(str(job.base_dir), "nf4", True)
    elif job.kind == "kept_fp32":  # a bf16 load whose router gates transformers keeps in float32
        from tests._kept_dtype_cases import load_bf16

        model = load_bf16(str(job.base_dir))
    else:
        model = make_model(job.kind, seed=job.seed)
    if job.lora:
        model = with_lora(model, job.kind)
    if job.oom == "forward":
        _oom_in_forward(model, job.micro_bs)
    if zero:
        args = hf_zero.ZeroTrainingArguments(zero_stage=job.stage, **dict(job.zero_args), **_common(job))
        trainer_cls = hf_zero.ZeroTrainer
    else:
        args = TrainingArguments(**_common(job))
        trainer_cls = Trainer
    if zero and job.presharded:
        model, _ = hf_zero.initialize(model, None, args.to_zero_config(), device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer_dir) if job.tokenizer_dir else None
    window = _WindowMemory() if job.measure_window else None
    snapshots = _SnapshotOnSave() if job.snapshot_on_save else None
    oom = _OOMAtStepEnd(job.micro_bs) if job.oom == "step_end" else None
    attempts = _AttemptStart() if job.oom is not None and zero else None
    callbacks = [c for c in (_StopAt(job.stop_after) if job.stop_after else None, window, snapshots, oom, attempts)
                 if c is not None]
    if job.kind == "resnet":
        train_data: Dataset = ImagesDataset(job.global_batch * job.steps, seed=1)
        eval_data: Dataset = ImagesDataset(job.eval_rows or job.global_batch, seed=2)
    elif job.kind in BLOCKLESS:
        train_data = PointsDataset(job.global_batch * job.steps, seed=1, dim=BLOCKLESS[job.kind])
        eval_data: Dataset = PointsDataset(job.global_batch, seed=2, dim=BLOCKLESS[job.kind])
    else:
        train_data = TokenDataset(job.global_batch * job.steps, 16, seed=1)
        eval_data = TokenDataset(job.eval_rows or job.global_batch, 16, seed=2)
    if job.compile_backend:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = str(job.regional_compile).lower()
    try:
        trainer = trainer_cls(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                              processing_class=tokenizer, callbacks=callbacks or None,
                              compute_metrics=_counts if job.counts else None)
    finally:
        os.environ.pop("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", None)
    import transformers.trainer

    apply_liger = transformers.trainer.apply_liger_kernel
    transformers.trainer.apply_liger_kernel = apply_liger_like  # used only by `use_liger_kernel=True` runs (job.liger)
    first_eval = trainer.evaluate()["eval_loss"] if job.evaluate_first else None
    try:
        trainer.train(resume_from_checkpoint=job.resume_from)
    finally:
        transformers.trainer.apply_liger_kernel = apply_liger
    metrics = trainer.evaluate()
    compiled = dict(counters["frames"]) if job.compile_backend else None
    eval_loss = metrics["eval_loss"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    if job.save_model_to:
        trainer.save_model(job.save_model_to)
    state = hf_zero.full_state_dict(trainer.model) if zero else trainer.model.state_dict()
    main = trainer.args.process_index == 0
    return {
        "losses": losses, "norms": [float(n) for n in norms], "eval_loss": eval_loss,
        "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
        "world": trainer.args.world_size,
        "counts": {k: metrics[f"eval_{k}"] for k in ("samples", "label_sum", "accuracy")} if job.counts else None,
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "state": {k: v.detach().cpu().clone() for k, v in state.items()} if main else None,
        "checkpoints": sorted(os.listdir(job.out_dir)) if main and os.path.isdir(job.out_dir) else None,
        "window": window.samples if window is not None else None,
        "units": [u.spec.name for u in trainer.model.zero_engine.parts] if zero else None,
        "snapshots": snapshots.states if snapshots is not None and main else None,
        "best": trainer.state.best_model_checkpoint,
        "train_batch_size": trainer._train_batch_size,
        "attempts": (attempts.attempts, attempts.order, len(trainer.model.zero_engine.parts)) if attempts else None,
        "compiled_frames": compiled,
        "first_eval": first_eval,
    }


def run_launched_without_use_cpu(job: Job, configured_state: bool = False) -> dict[str, Any]:
    """`run(job)` as a plain `torchrun` launch on a CPU machine gives it: no `use_cpu`, no ACCELERATE_USE_CPU.
    `configured_state`: an Accelerate state made first without `cpu=True` (one process, as Accelerate then
    believes), which the Trainer is told to use; returns the error the arguments raise."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    import hf_zero

    saved = os.environ.pop("ACCELERATE_USE_CPU", None)
    try:
        if not configured_state:
            with hf_zero_records() as records:
                result = run(replace(job, use_cpu_flag=False))
            return {**result, "records": records}
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState()
        try:
            hf_zero.ZeroTrainingArguments(output_dir=job.out_dir, zero_stage=job.stage, report_to="none",
                                          accelerator_config={"use_configured_state": True})
        except ValueError as e:
            return {"error": str(e)}
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
        return {"error": None}
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_CPU"] = saved


def run_with_a_second_trainer(job: Job) -> dict[str, Any]:
    """A ZeroTrainer trains to `job.stop_after` (checkpointing every `save_steps`); a second ZeroTrainer gets the
    same, already sharded model and resumes from the first one's last checkpoint to `job.steps`."""
    import hf_zero

    model = make_model(job.kind, seed=job.seed)
    data = TokenDataset(job.global_batch * job.steps, 16, seed=1)
    args = hf_zero.ZeroTrainingArguments(zero_stage=job.stage, **dict(job.zero_args), **_common(job))
    first = hf_zero.ZeroTrainer(model=model, args=args, train_dataset=data, callbacks=[_StopAt(job.stop_after or 1)])
    first.train()
    args = hf_zero.ZeroTrainingArguments(zero_stage=job.stage, **dict(job.zero_args), **_common(job))
    second = hf_zero.ZeroTrainer(model=first.model, args=args, train_dataset=data)
    second.train(resume_from_checkpoint=os.path.join(job.out_dir, f"checkpoint-{job.stop_after}"))
    state = hf_zero.full_state_dict(second.model)
    return {"losses": [h["loss"] for h in second.state.log_history if "loss" in h],
            "same_model": second.model is model,
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if args.process_index == 0 else None}


def reference(job: Job) -> dict[str, Any]:
    """The stock Trainer in this process, same global batch (one rank does all the micro-batches)."""
    return run(replace(job, world=1, micro_bs=job.micro_bs, zero_args=(), measure_window=False), zero=False)


def auto_batch_then_resume(job: Job, zero: bool = True) -> dict[str, Any]:
    """transformers' `test_auto_batch_size_with_resume_from_checkpoint`: train with `--auto_find_batch_size` and
    an out-of-memory error at the first batch size (a checkpoint every step), then a new Trainer on the same
    model resumes from the last checkpoint and takes the batch size found from it. `zero=False`: the stock Trainer."""
    import hf_zero

    model = make_model(job.kind, seed=job.seed)
    data = TokenDataset(job.global_batch * job.steps, 16, seed=1)
    if zero:
        args: TrainingArguments = hf_zero.ZeroTrainingArguments(zero_stage=job.stage, **_common(job))
        trainer_cls: type[Trainer] = hf_zero.ZeroTrainer
    else:
        args, trainer_cls = TrainingArguments(**_common(job)), Trainer
    first = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[_OOMAtStepEnd(job.micro_bs)])
    first.train()
    second = trainer_cls(model=first.model, args=args, train_dataset=data)
    before = second._train_batch_size
    second.train(resume_from_checkpoint=True)
    state = hf_zero.full_state_dict(second.model) if zero else second.model.state_dict()
    return {"first": first._train_batch_size, "before": before, "after": second._train_batch_size,
            "steps": second.state.global_step,
            "losses": [h["loss"] for h in second.state.log_history if "loss" in h],
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if args.process_index == 0 else None}


def read_weights_after_training(out_dir: str, zero: bool) -> dict[str, Any]:
    """The upstream Trainer tests' pattern: train the two-scalar model, then read `trainer.model.a` directly (one
    process; ZeroTrainer at `--zero_stage 3`)."""
    import hf_zero

    job = Job(kind="scalars", stage=3, world=1, out_dir=out_dir, steps=4, global_batch=4, micro_bs=2)
    args_cls = functools.partial(hf_zero.ZeroTrainingArguments, zero_stage=3) if zero else TrainingArguments
    trainer_cls = hf_zero.ZeroTrainer if zero else Trainer
    trainer = trainer_cls(
        model=scalar_model(0),
        args=args_cls(**_common(job)),
        train_dataset=PointsDataset(16, seed=1, dim=1),
        eval_dataset=PointsDataset(4, seed=2, dim=1),
    )
    trainer.train()
    return {"a": float(trainer.model.a), "b": float(trainer.model.b), "grad": trainer.model.a.grad is None}
