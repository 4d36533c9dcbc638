"""Checkpoint and loading cases: loading into a fresh model, exporting, training from pretrained weights, faults while saving. Functions run on every rank of a pool (importable by name)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from tests._training import make_model, make_optimizer


def load_into_fresh_model(ckpt: str, kind: str, stage: int, verify: bool = True) -> dict[str, Any]:
    """Try to load `ckpt`; report the error and whether the model was left exactly as it was."""
    model = make_model(kind, seed=1)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=stage))
    before = hf_zero.full_state_dict(model, rank0_only=False)
    error_type = error = None
    try:
        hf_zero.load_checkpoint(ckpt, model, opt, verify=verify)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error_type, error = type(e).__name__, str(e)
    after = hf_zero.full_state_dict(model, rank0_only=False)
    return {
        "error_type": error_type,
        "error": error,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "opt_state_empty": len(opt.state) == 0,
    }


def reload_into_trained_model(ckpt: str, stage: int, damage: bool) -> dict[str, Any]:
    """Train 2 steps, save, train 2 more, load the checkpoint back into the same model and optimizer (whose
    state exists: read in place, [Note: one-pass load]) and train the 2 steps again. With `damage`, one byte of
    this rank's optimizer file is flipped before the load: it must raise with the weights unchanged and the
    optimizer's state cleared (read into in part)."""
    model = make_model("llama", seed=0)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), hf_zero.ZeroConfig(stage=stage))
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(4)]

    def step(batch: torch.Tensor) -> float:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    for batch in batches[:2]:
        step(batch)
    hf_zero.save_checkpoint(ckpt, model, opt)
    first = [step(b) for b in batches[2:]]
    tensors = [v for state in opt.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    pointers = sorted(t.data_ptr() for t in tensors if t.numel() > 1)
    if damage:
        dist.barrier()
        if dist.get_rank() == 0:
            path = os.path.join(ckpt, f"optim-rank00001-of-{dist.get_world_size():05d}.safetensors")
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 0x01
            open(path, "wb").write(bytes(data))
        dist.barrier()
        before = hf_zero.full_state_dict(model, rank0_only=False)
        try:
            hf_zero.load_checkpoint(ckpt, model, opt)
        except ValueError as e:
            after = hf_zero.full_state_dict(model, rank0_only=False)
            return {"error": str(e), "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                    "state_cleared": len(opt.optimizer.state) == 0}
        return {"error": None}
    hf_zero.load_checkpoint(ckpt, model, opt)
    tensors = [v for state in opt.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    again = [step(b) for b in batches[2:]]
    return {"first": first, "again": again, "same_memory": sorted(t.data_ptr() for t in tensors if t.numel() > 1) == pointers}


PROMPT = [[5, 17, 42, 7, 99, 3]]


def train_and_export(kind: str, stage: int, ckpt: str, live_out: str, tokenizer_dir: str) -> dict[str, Any]:
    """Train 2 steps, then write a sharded checkpoint and a live from_pretrained directory."""
    from transformers import AutoTokenizer

    model = make_model(kind)
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), hf_zero.ZeroConfig(stage=stage))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf_zero.save_checkpoint(ckpt, model, opt, tokenizer=tokenizer)
    model.save_pretrained(live_out, dtype=torch.float32)  # the masters, as the consolidation writes them
    if dist.get_rank() == 0:
        tokenizer.save_pretrained(live_out)
    files = sorted(f for f in os.listdir(live_out) if f.endswith(".safetensors"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    state = hf_zero.full_state_dict(model)
    if dist.get_rank() != 0:
        return {"files": files}
    return {"files": files, "logits": logits.numpy().copy(), "state": {k: v.clone() for k, v in state.items()}}


def train_from_pretrained(path: str, mode: str, stage: int, steps: int = 3, lora: bool = False) -> dict[str, Any]:
    """Load `path` the sharded way (hf_zero.from_pretrained) or the ordinary way, then train a few steps. `lora`: a
    LoRA adapter on the attention projections, added by `from_pretrained(peft_config=...)` with each rank's random
    state seeded differently (`torch.manual_seed(rank)`: rank 0's adapter must reach every rank), or by
    `get_peft_model` on the loaded model under `torch.manual_seed(0)`."""
    from transformers import AutoModelForCausalLM

    config = hf_zero.ZeroConfig(stage=stage)
    adapter = None
    if lora:
        from peft import LoraConfig

        adapter = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    if mode == "sharded":
        torch.manual_seed(dist.get_rank())
        model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, path, config, peft_config=adapter,
                                             optimizer_fn=lambda m: make_optimizer(m, 1e-3))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        if adapter is not None:
            from peft import get_peft_model

            torch.manual_seed(0)
            model = get_peft_model(model, adapter)
        model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), config)
    model.train()
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state = hf_zero.full_state_dict(model)
    head = model.get_output_embeddings()
    return {"losses": losses, "state": state, "tied": getattr(model.config, "tie_word_embeddings", False)
            and head is not None and head.weight is model.get_input_embeddings().weight}


def adapter_saved_then_loaded(path: str, adapter_dir: str, stage: int, modules_to_save: list[str] | None = None
                              ) -> dict[str, Any]:
    """LoRA trained 2 steps on a sharded load, saved with the PEFT model's `save_pretrained` (every rank), then a
    fresh sharded load given that directory as `peft_config`: the trained and the reloaded adapter weights, which
    reloaded parameters train, and the reloaded model's logits on a batch."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    config = hf_zero.ZeroConfig(stage=stage)
    adapter = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                         modules_to_save=modules_to_save)
    model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, path, config, peft_config=adapter,
                                         optimizer_fn=lambda m: make_optimizer(m, 1e-2))
    model.train()
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(2):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(adapter_dir)
    ours = ("lora_", "modules_to_save")  # the adapter's weights
    trained = {k: v.clone() for k, v in hf_zero.full_state_dict(model, rank0_only=False).items()
               if any(o in k for o in ours)}
    again, _ = hf_zero.from_pretrained(AutoModelForCausalLM, path, config, peft_config=adapter_dir)
    reloaded = {k: v.clone() for k, v in hf_zero.full_state_dict(again, rank0_only=False).items()
                if any(o in k for o in ours)}
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = again(input_ids=ids).logits
    return {"trained": trained, "reloaded": reloaded, "logits": logits,
            "trainable": sorted(n for n, p in again.named_parameters() if p.requires_grad)}


def adapter_per_rank(path: str, adapter_dirs: list[str], stage: int) -> dict[str, torch.Tensor]:
    """A sharded load with `adapter_dirs[rank]` as `peft_config` (nodes whose copies of the adapter differ): the
    adapter's weights the model holds, whole."""
    from transformers import AutoModelForCausalLM

    model, _ = hf_zero.from_pretrained(AutoModelForCausalLM, path, hf_zero.ZeroConfig(stage=stage),
                                       peft_config=adapter_dirs[dist.get_rank()])
    return {k: v.clone() for k, v in hf_zero.full_state_dict(model, rank0_only=False).items() if "lora_" in k}


def other_heads_from(path: str, stage: int) -> dict[str, Any]:
    """A causal LM's files loaded, with each rank's random state seeded differently (`torch.manual_seed(rank)`), into
    `AutoModelForSequenceClassification` (its `score` head absent from the files: initialized) and into `AutoModel`
    (the files' `model.` prefix taken away): every rank's full state, and the classifier's logits on a batch."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(dist.get_rank())
    config = hf_zero.ZeroConfig(stage=stage)
    classifier, _ = hf_zero.from_pretrained(AutoModelForSequenceClassification, path, config, num_labels=3,
                                            pad_token_id=0)
    ids = torch.randint(1, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = classifier(input_ids=ids).logits
    base, _ = hf_zero.from_pretrained(AutoModel, path, config)
    return {
        "classifier": {k: v.clone() for k, v in hf_zero.full_state_dict(classifier, rank0_only=False).items()},
        "logits": logits,
        "base": {k: v.clone() for k, v in hf_zero.full_state_dict(base, rank0_only=False).items()},
    }


def saved_both_ways(path: str, out: str) -> None:
    """`path` loaded the sharded way at stage 3, then written by `model.save_pretrained` (rank 0 gathers) into
    `out/gathered`, by `hf_zero.save_pretrained(..., parallel=True)` (every rank its share) into `out/parallel`, and
    as a checkpoint into `out/checkpoint`."""
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint import save_pretrained

    model, optimizer = hf_zero.from_pretrained(AutoModelForCausalLM, path, hf_zero.ZeroConfig(stage=3),
                                               optimizer_fn=lambda m: torch.optim.AdamW(m.parameters()))
    model.save_pretrained(f"{out}/gathered")
    save_pretrained(model, f"{out}/parallel", parallel=True, max_shard_size="40KB", progress=False)
    hf_zero.save_checkpoint(f"{out}/checkpoint", model, optimizer)


def initialize_from(path: str) -> None:
    model = make_model("llama")
    hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3), weights_from=path)


def save_with_fault(path: str, failing_rank: int, errno_code: int | None) -> dict[str, Any]:
    """Save to `path` (a good checkpoint may already be there) while `failing_rank` hits an OSError."""
    import errno as errno_module
    import os

    import hf_zero.checkpoint.save as save_module  # where the shard files are written ([Note: streamed save])

    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    original = save_module.write_streamed

    def failing_save_file(filename, entries, metadata=None):  # noqa: ANN001
        if dist.get_rank() == failing_rank and errno_code is not None:
            raise OSError(errno_code, os.strerror(errno_code), filename)
        return original(filename, entries, metadata)

    save_module.write_streamed = failing_save_file
    try:
        outcome = _attempt(lambda: hf_zero.save_checkpoint(path, model, opt, metadata={"attempt": "second"}))
    finally:
        save_module.write_streamed = original
    del errno_module
    return outcome


def _attempt(call: Any) -> dict[str, Any]:
    """`call()`'s outcome on this rank: the error's type and text (None for none) and the seconds it took."""
    start = time.monotonic()
    try:
        call()
        outcome: dict[str, Any] = {"error_type": None, "error": None}
    except Exception as e:  # noqa: BLE001
        outcome = {"error_type": type(e).__name__, "error": str(e)}
    outcome["seconds"] = time.monotonic() - start
    return outcome


def save_into_a_directory_per_rank(roots: list[str], how: str) -> dict[str, Any]:
    """Each rank saves into the same name under its own root (`roots[rank]`), as ranks on nodes whose output path
    is a node-local disk: `how` is "checkpoint" (`save_checkpoint`, after one at the shared root that must stay
    whole), "async" (the same, asynchronous) or "pretrained" (`model.save_pretrained(..., parallel=True)`). The
    ranks wait 1 s for the shared directory instead of 120."""
    import hf_zero.checkpoint.shared as shared

    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    mine = Path(roots[dist.get_rank()])
    hf_zero.save_checkpoint(Path(roots[0]) / "ckpt", model, opt, metadata={"attempt": "first"})  # shared: fine
    before, shared.VISIBLE_WITHIN_S = shared.VISIBLE_WITHIN_S, 1.0
    try:
        if how == "pretrained":
            outcome = _attempt(lambda: model.save_pretrained(mine / "model", parallel=True))
        else:
            outcome = _attempt(lambda: hf_zero.save_checkpoint(mine / "ckpt", model, opt, metadata={"attempt": "second"},
                                                               async_save=how == "async"))
    finally:
        shared.VISIBLE_WITHIN_S = before
    dist.barrier()  # the process group is still usable
    outcome["left"] = sorted(p.name for p in mine.iterdir())
    return outcome


def save_where_something_else_is(root: str) -> dict[str, Any]:
    """Each write of a sharded model given a path that holds something else: `save_checkpoint` into a run folder
    with the user's files, into a file, and into an empty directory (fine); `save_pretrained` (both ways) into a
    file. The outcome of each on this rank, and what the run folder holds afterwards."""
    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    base = Path(root)
    outcomes = {
        "run_folder": _attempt(lambda: hf_zero.save_checkpoint(base / "run", model, opt)),
        "file": _attempt(lambda: hf_zero.save_checkpoint(base / "notes.txt", model, opt)),
        "empty": _attempt(lambda: hf_zero.save_checkpoint(base / "empty", model, opt)),
        "pretrained_file": _attempt(lambda: model.save_pretrained(base / "notes.txt")),
        "parallel_file": _attempt(lambda: model.save_pretrained(base / "notes.txt", parallel=True)),
    }
    dist.barrier()  # the process group is still usable
    outcomes["run_left"] = sorted(p.name for p in (base / "run").iterdir())
    outcomes["file_left"] = (base / "notes.txt").read_text()
    outcomes["empty_left"] = sorted(p.name for p in (base / "empty").iterdir())
    return outcomes


def load_a_checkpoint_per_rank(root: str) -> dict[str, Any]:
    """Save checkpoints after step 1 (`root/one`) and step 2 (`root/two`), then rank 0 loads `one` and rank 1 `two`
    (each complete and valid); the process group must stay usable after the error (a barrier)."""
    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    for step, name in enumerate(("one", "two"), 1):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        hf_zero.save_checkpoint(Path(root) / name, model, opt, metadata={"step": step})
    outcome = _attempt(lambda: hf_zero.load_checkpoint(Path(root) / ("one", "two")[dist.get_rank()], model, opt))
    dist.barrier()
    return outcome


def _buffered_classes() -> tuple[type, type]:
    """A tiny transformers model whose one buffer only `_init_weights` fills (its `__init__` leaves zeros),
    registered with AutoConfig as `hfz_buffered`."""
    from torch import nn
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
    from transformers import initialization as init

    class BufferedConfig(PretrainedConfig):
        model_type = "hfz_buffered"

        def __init__(self, width: int = 8, **kwargs: Any) -> None:
            self.width = width
            super().__init__(**kwargs)

    class BufferedModel(PreTrainedModel):
        config_class = BufferedConfig

        def __init__(self, config: BufferedConfig) -> None:
            super().__init__(config)
            self.proj = nn.Linear(config.width, config.width)
            self.register_buffer("scale", torch.zeros(config.width), persistent=False)
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            super()._init_weights(module)
            if module is self:
                init.copy_(self.scale, torch.arange(1.0, self.config.width + 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * self.scale

    try:
        AutoConfig.register("hfz_buffered", BufferedConfig)
    except ValueError:  # registered already in this worker
        pass
    return BufferedConfig, BufferedModel


def from_pretrained_buffers(path: str) -> dict[str, Any]:
    """Save the buffered model at `path` (rank 0), then load it both ways; their buffers and outputs."""
    config_class, model_class = _buffered_classes()
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(3)
        model_class(config_class()).save_pretrained(path)
    dist.barrier()
    ordinary = model_class.from_pretrained(path)
    sharded, _ = hf_zero.from_pretrained(model_class, path, hf_zero.ZeroConfig(stage=3))
    x = torch.ones(2, 8)
    with torch.no_grad():
        return {"ordinary": ordinary.scale.clone(), "sharded": sharded.scale.clone(),
                "same_output": torch.equal(ordinary(x), sharded(x))}


def trained_from_pretrained(path: str, mode: str, model_class: str, config_kwargs: dict[str, Any],
                            lora_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`model_class` (a causal LM, a sequence classifier, ...) loaded from `path` with `config_kwargs` (`num_labels`,
    `ignore_mismatched_sizes`), with a LoRA adapter of `lora_kwargs` where given (`modules_to_save`, `task_type`),
    the sharded way (each rank seeded with its rank: rank 0's new head and adapter must reach every rank) or the
    ordinary way (transformers' load, `get_peft_model`, `initialize`, under seed 0), then 2 ZeRO-3 steps: losses,
    trainable names, full state."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model_type = getattr(transformers, model_class)
    targets = ["query_key_value"] if "falcon" in path else ["q_proj", "v_proj"]
    adapter = None if lora_kwargs is None else LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                          **lora_kwargs)
    config = hf_zero.ZeroConfig(stage=3)
    if mode == "sharded":
        torch.manual_seed(dist.get_rank())
        model, opt = hf_zero.from_pretrained(model_type, path, config, peft_config=adapter,
                                             optimizer_fn=lambda m: make_optimizer(m, 1e-2), **config_kwargs)
    else:
        torch.manual_seed(0)
        model = model_type.from_pretrained(path, **config_kwargs)
        model = get_peft_model(model, adapter) if adapter is not None else model
        model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-2), config)
    model.train()
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(2):
        batch = torch.randint(1, 256, (2, 16), generator=g)
        labels = torch.randint(0, 3, (2,), generator=g) if "Sequence" in model_class else batch
        loss = model(input_ids=batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {"losses": losses, "trainable": trainable, "state": hf_zero.full_state_dict(model)}


def lora_checkpoint_and_adapter(path: str, ckpt: str, adapter_dir: str, modules_to_save: list[str] | None
                                ) -> dict[str, Any]:
    """LoRA (with `modules_to_save`) trained one step on a sharded load, saved with `save_checkpoint`, and its adapter
    written by the PEFT model's own `save_pretrained` (every rank) into `adapter_dir`: the logits on a batch."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    adapter = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                         modules_to_save=modules_to_save)
    model, opt = hf_zero.from_pretrained(AutoModelForCausalLM, path, hf_zero.ZeroConfig(stage=3), peft_config=adapter,
                                         optimizer_fn=lambda m: make_optimizer(m, 1e-2))
    model.train()
    batch = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    hf_zero.save_checkpoint(ckpt, model, opt)
    model.save_pretrained(adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    return {"logits": logits}


def save_and_load_logged(ckpt: str, async_save: bool) -> dict[str, Any]:
    """A step, a save (synchronous or asynchronous, finished) and a load, the hf_zero log records of each kept."""
    from tests._training import hf_zero_records

    model = make_model("llama")
    model, opt = hf_zero.initialize(model, make_optimizer(model, 1e-3), hf_zero.ZeroConfig(stage=3))
    x = torch.randint(0, 100, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    with hf_zero_records() as saved:
        handle = hf_zero.save_checkpoint(ckpt, model, opt, async_save=async_save)
        if async_save:
            handle.wait()
    with hf_zero_records() as loaded:
        hf_zero.load_checkpoint(ckpt, model, opt)
    return {"saved": saved, "loaded": loaded}
