"""Sharded checkpoints: save at step k, load (on the same or another world size and stage), train on.

The resumed run starts from a model initialized with another seed, so only the checkpoint can
make it match. Same world size and stage: losses and weights equal the uninterrupted run bit for
bit. Another world size or stage: the global batch is the same, only its split across ranks
(and so the fp32 summation order) changes: losses within 1e-6 relative, weights within 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests._training import Scenario, interrupted_run, rel_err, same_global_batch, sharded_run

# Every rank function here follows tests._dist.device(): on a machine with a GPU per rank the pools run on
# CUDA + NCCL (make gpu-check), elsewhere on CPU + gloo.
pytestmark = pytest.mark.device_agnostic

STEPS, SAVE_AT = 5, 3


WHOLE_PARAMETER_CASES = [  # optimizers on whole parameters ([Note: owned optimizer state]); lr 1e-2
    ("llama", 3, "torch_adafactor"), ("llama", 1, "muon_adamw"), ("llama", 2, "hf_adafactor"),
    ("llama", 3, "muon_and_adamw"),  # two optimizers (Muon whole, AdamW flat) in one checkpoint
]


@pytest.mark.parametrize("model, stage, optimizer",
                         [(m, s, "adamw") for m in ("llama", "falcon") for s in (1, 2, 3)] + WHOLE_PARAMETER_CASES)
def test_resume_same_world_is_bit_exact(pools, tmp_path, model, stage, optimizer):
    sc = Scenario(model=model, stage=stage, world=2, steps=STEPS, optimizer=optimizer,
                  lr=1e-3 if optimizer == "adamw" else 1e-2)
    straight = pools(2).values(sharded_run, sc)[0]
    resumed = interrupted_run(pools, sc, sc, str(tmp_path / "ckpt"), SAVE_AT)
    assert resumed["losses"] == straight["losses"]
    for name, value in straight["state"].items():
        np.testing.assert_array_equal(resumed["state"][name], value, err_msg=name)


MOVES = [
    ((2, 3), (3, 3), 12),  # 2 -> 3 ranks
    ((3, 3), (2, 3), 12),  # 3 -> 2 ranks
    ((2, 2), (1, 2), 8),  # 2 -> 1 rank
    ((1, 3), (2, 3), 8),  # 1 -> 2 ranks
    ((3, 3), (2, 2), 12),  # a stage-3 checkpoint resumes under stage 2 on fewer ranks
    ((2, 1), (3, 3), 12),  # stage 1 -> stage 3
]


# falcon's moves between world sizes at one stage in the slow tier (llama's take the same paths); its stage changes
# (tied embeddings re-cut for another layout) stay in the suite
@pytest.mark.parametrize(
    "model, before, after, global_batch",
    [("llama", *move) for move in MOVES]
    + [pytest.param("falcon", *move, marks=pytest.mark.slow) if move[0][1] == move[1][1] else ("falcon", *move)
       for move in MOVES],
)
def test_resume_on_another_world_size_and_stage(pools, tmp_path, model, before, after, global_batch):
    base = Scenario(model=model, steps=STEPS)
    sc_before = same_global_batch(base, before[0], before[1], global_batch)
    sc_after = same_global_batch(base, after[0], after[1], global_batch)
    straight = pools(sc_before.world).values(sharded_run, sc_before)[0]
    resumed = interrupted_run(pools, sc_before, sc_after, str(tmp_path / "ckpt"), SAVE_AT)
    np.testing.assert_allclose(resumed["losses"], straight["losses"], rtol=1e-6, atol=0)
    for name, value in straight["state"].items():
        assert rel_err(resumed["state"][name], value) <= 1e-5, name


def test_checkpoint_layout_is_self_describing(pools, tmp_path):
    from safetensors import safe_open

    ckpt = tmp_path / "ckpt"
    pools(2).values(sharded_run, Scenario(model="falcon", stage=3, world=2, steps=1, accum=1, save_to=str(ckpt)))
    manifest = json.loads((ckpt / "hf_zero_manifest.json").read_text())
    assert manifest["format"] == "hf_zero" and manifest["format_version"] == 3 and manifest["world_size"] == 2
    assert manifest["aliases"] == {"lm_head.weight": "transformer.word_embeddings.weight"}  # tied: stored once
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["hf_zero_manifest.json", "config.json", "generation_config.json",
         "model-rank00000-of-00002.safetensors", "model-rank00001-of-00002.safetensors",
         "optim-rank00000-of-00002.safetensors", "optim-rank00001-of-00002.safetensors"]
    )
    assert not list(tmp_path.glob(".ckpt.*"))  # no staging directory left behind
    # The manifest's index is exactly what the files say of themselves, and covers every parameter whole.
    headers = {}
    for rank in range(2):
        name = f"model-rank{rank:05d}-of-00002.safetensors"
        with safe_open(str(ckpt / name), "pt") as f:
            header = json.loads(f.metadata()["hf_zero"])
            assert header["world_size"] == 2 and header["rank"] == rank and header["format_version"] == 3
            for key, (start, end) in header["slices"].items():
                assert f.get_tensor(key).shape == (end - start,)
            headers[name] = header["slices"]
    for key, info in manifest["params"].items():
        from_files = sorted([file, *headers[file][key]] for file in headers if key in headers[file])
        assert manifest["slices"][key] == sorted(from_files, key=lambda e: e[1]), key
        bounds = [(s, e) for _, s, e in manifest["slices"][key]]
        numel = int(np.prod(info["shape"]))
        assert bounds[0][0] == 0 and bounds[-1][1] == numel and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), key
    assert any(len(v) == 2 for v in manifest["slices"].values())  # some parameter is split across the two ranks
    with safe_open(str(ckpt / "optim-rank00000-of-00002.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert any(k.endswith("::exp_avg") for k in keys) and any(k.endswith("::step") for k in keys)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_and_a_load_each_log_their_size_and_time_on_rank_0(pools, tmp_path, async_save):
    """One line on rank 0 at the end of each (for an asynchronous save, at its commit): the checkpoint's files, their
    bytes in all (the files' sizes on disk) and the seconds it took; nothing on the other ranks."""
    import re

    from tests import _checkpoint_cases as cases

    ckpt = tmp_path / "ckpt"
    results = pools(2).values(cases.save_and_load_logged, str(ckpt), async_save)
    assert results[1] == {"saved": [], "loaded": []}
    manifest = json.loads((ckpt / "hf_zero_manifest.json").read_text())
    on_disk = sum((ckpt / name).stat().st_size for name in manifest["files"])
    for verb in ("saved", "loaded"):
        (line,) = results[0][verb]
        found = re.fullmatch(rf"hf_zero: {verb} {re.escape(str(ckpt))} \(([\d.]+) MiB in (\d+) files written by 2 ranks\) "
                             r"in [\d.]+ s, [\d.]+ (MiB|GiB)/s", line)
        assert found, line
        assert int(found.group(2)) == len(manifest["files"])
        assert float(found.group(1)) == pytest.approx(on_disk / 2**20, abs=0.051), line
