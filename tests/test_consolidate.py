"""Consolidation to a from_pretrained directory: offline (function and CLI) and live at the end of training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_zero
from tests import _checkpoint_cases as checkpoint_cases
from tests._cli import run_cli
from tests._training import make_tokenizer


@pytest.fixture(scope="module", params=["llama", "falcon"])
def exported(request, pools, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    make_tokenizer(str(root / "tok"))
    results = pools(2).values(
        checkpoint_cases.train_and_export, request.param, 3, str(root / "ckpt"), str(root / "live"), str(root / "tok")
    )
    return {"root": root, "kind": request.param, **results[0]}


def _check_reloaded(out: Path, exported: dict, dtype: torch.dtype = torch.float32) -> None:
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    state = model.state_dict()
    for name, value in exported["state"].items():
        assert state[name].dtype == dtype, name
        torch.testing.assert_close(state[name], value.to(dtype), rtol=0, atol=0, msg=name)  # exact (after the cast)
    if dtype == torch.float32:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(checkpoint_cases.PROMPT)).logits.numpy()
        np.testing.assert_allclose(logits, exported["logits"], rtol=1e-5, atol=1e-6)
    generated = model.generate(torch.tensor(checkpoint_cases.PROMPT), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, len(checkpoint_cases.PROMPT[0]) + 4)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("sharded training")["input_ids"]) == "sharded training"


def test_consolidate_then_from_pretrained(exported, tmp_path):
    out = tmp_path / "hf"
    files = hf_zero.consolidate(exported["root"] / "ckpt", out, progress=False)
    assert files == ["model.safetensors"]
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    architectures = json.loads((out / "config.json").read_text())["architectures"]  # as save_pretrained names it
    assert architectures == [{"llama": "LlamaForCausalLM", "falcon": "FalconForCausalLM"}[exported["kind"]]]
    if exported["kind"] == "falcon":  # tied weights are written once, as save_pretrained does
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys() and "transformer.word_embeddings.weight" in f.keys()
    _check_reloaded(out, exported)


def test_cli_bf16_with_small_shards_writes_an_index(exported, tmp_path):
    out = tmp_path / "hf-bf16"
    done = run_cli(["consolidate", str(exported["root"] / "ckpt"), str(out), "--dtype", "bf16", "--max-shard-size",
                    "40KB"])
    assert done.returncode == 0, done.stderr
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for k, v in exported["state"].items()
                                                  if k != "lm_head.weight" or exported["kind"] == "llama")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert "wrote" in done.stdout
    _check_reloaded(out, exported, torch.bfloat16)


def test_live_save_pretrained_at_end_of_training(exported):
    assert exported["files"] == ["model.safetensors"]
    _check_reloaded(exported["root"] / "live", exported)


def test_cli_errors_are_clear(tmp_path):
    done = run_cli(["consolidate", str(tmp_path / "nope"), str(tmp_path / "o")])  # (the entry point: test_estimate)
    assert done.returncode == 2 and "the directory does not exist" in done.stderr
    with pytest.raises(ValueError, match="max_shard_size must look like '5GB'"):
        hf_zero.consolidate(tmp_path, tmp_path / "o", max_shard_size="lots")
    with pytest.raises(ValueError, match="dtype must be one of 'fp32', 'bf16', 'fp16'"):
        hf_zero.consolidate(tmp_path, tmp_path / "o", dtype="int8")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cli_never_writes_over_files_it_did_not_write(exported, tmp_path):
    """`hf-zero consolidate` into a model folder (the base model a run started from), into a file, and into a
    folder of other files is refused naming what is there, every file left byte for byte; its own earlier output
    is replaced; `--overwrite` writes into the model folder and the result loads as the checkpoint."""
    from tests._training import make_model

    ckpt = str(exported["root"] / "ckpt")
    base = tmp_path / "base"
    make_model(exported["kind"], seed=3).save_pretrained(base)
    notes = tmp_path / "run"
    (notes / "logs").mkdir(parents=True)
    (notes / "notes.txt").write_text("my notes")
    (notes / "logs" / "events").write_bytes(b"\x00\x01")
    a_file = tmp_path / "model.bin"
    a_file.write_bytes(b"user data")
    cases = [(base, "is a model directory that hf_zero did not write \\(config.json, "),
             (notes, "is a folder of other files that hf_zero did not write \\(logs/, notes.txt\\)"),
             (a_file, "model.bin is a file; a from_pretrained directory is written there")]
    for target, message in cases:
        before = _tree(tmp_path)
        done = run_cli(["consolidate", ckpt, str(target)])
        assert done.returncode == 2, done.stdout
        assert __import__("re").search(message, done.stderr), done.stderr
        assert _tree(tmp_path) == before, target  # nothing written, nothing removed
        with pytest.raises(ValueError, match="Nothing was written|is a file"):
            hf_zero.consolidate(ckpt, target, progress=False)
    assert "--overwrite to write into it anyway" in run_cli(["consolidate", ckpt, str(base)]).stderr

    out = tmp_path / "out"
    assert run_cli(["consolidate", ckpt, str(out), "--quiet"]).returncode == 0
    done = run_cli(["consolidate", ckpt, str(out), "--quiet", "--max-shard-size", "40KB"])  # its own output: replaced
    assert done.returncode == 0, done.stderr
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").is_file()
    (out / "README.md").write_text("the user's model card")  # no longer only ours
    assert run_cli(["consolidate", ckpt, str(out)]).returncode == 2 and (out / "README.md").is_file()

    done = run_cli(["consolidate", ckpt, str(base), "--quiet", "--overwrite"])
    assert done.returncode == 0, done.stderr
    _check_reloaded(base, exported)


_PEAK = """
import resource, sys
import hf_zero
if sys.argv[1] != "baseline":
    hf_zero.consolidate(sys.argv[1], sys.argv[2], max_shard_size="8MB", progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _peak_rss(*args: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 26 s on 2 cores (two checkpoints, three fresh processes): the suite's 12-minute budget
def test_consolidation_memory_is_bounded_by_a_shard(tmp_path):
    """Method: save checkpoints of a 4-layer and a 16-layer LLaMA (hidden 512; 4x the parameters),
    consolidate each in a fresh process with 8MB output shards, and compare each process's peak RSS
    (ru_maxrss) above a baseline process that only imports hf_zero. The larger model's weights are
    ~150MB in fp32; its peak above baseline must stay under half of that, and under twice the small
    model's peak above baseline (a streaming writer's peak does not grow with the model)."""
    from transformers import LlamaConfig

    sizes = {}
    for layers in (4, 16):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(config)
        sizes[layers] = sum(p.numel() for p in model.parameters()) * 4
        model, _ = hf_zero.initialize(model, None, hf_zero.ZeroConfig(stage=3))
        hf_zero.save_checkpoint(tmp_path / f"ckpt{layers}", model)
        del model
    baseline = _peak_rss("baseline")
    small = _peak_rss(str(tmp_path / "ckpt4"), str(tmp_path / "out4")) - baseline
    big = _peak_rss(str(tmp_path / "ckpt16"), str(tmp_path / "out16")) - baseline
    assert sizes[16] > 3.5 * sizes[4]
    assert big < sizes[16] / 2, (big, sizes)
    assert big < 2 * max(small, 8 * 2**20), (big, small)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out16")
    assert sum(p.numel() for p in reloaded.parameters()) * 4 == sizes[16]


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def test_a_damaged_model_file_is_found_and_an_earlier_consolidation_stays(exported, tmp_path):
    """[Note: streamed consolidation]: the model files' checksums are computed from the bytes the consolidation
    reads, so a damaged file is found once the output is written; the output's temporary files are removed and
    the consolidation already in `output_dir` is left as it was."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported["root"] / "ckpt", ckpt)
    out = tmp_path / "hf"
    hf_zero.consolidate(ckpt, out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    path = ckpt / "model-rank00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # in the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model-rank00001-of-00002.safetensors is corrupted: its checksum"):
        hf_zero.consolidate(ckpt, out, dtype="bf16", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    hf_zero.consolidate(ckpt, tmp_path / "unchecked", progress=False, verify=False)  # what verify=False is for
    path.write_bytes(bytes(data[: len(data) - 64]))
    with pytest.raises(ValueError, match="model-rank00001-of-00002.safetensors has .* bytes, the manifest says"):
        hf_zero.consolidate(ckpt, out, progress=False)


def test_the_page_cache_way_writes_the_same_files(exported, tmp_path, monkeypatch):
    """Past `MAX_STREAMS` model files (or files that disagree on the order) the consolidation reads through the
    page cache, parameter by parameter: the same tensors as the streamed way, in bf16 and in small shards."""
    import importlib

    consolidation = importlib.import_module("hf_zero.checkpoint.consolidate")  # the package's name is a function
    hf_zero.consolidate(exported["root"] / "ckpt", tmp_path / "streamed", dtype="bf16", max_shard_size="40KB",
                        progress=False)
    monkeypatch.setattr(consolidation, "MAX_STREAMS", 1)
    hf_zero.consolidate(exported["root"] / "ckpt", tmp_path / "cached", dtype="bf16", max_shard_size="40KB",
                        progress=False)
    streamed, cached = _weights(tmp_path / "streamed"), _weights(tmp_path / "cached")
    assert streamed.keys() == cached.keys() and len(list((tmp_path / "streamed").glob("model-*"))) > 2
    for name, value in cached.items():
        assert value.dtype == torch.bfloat16 and torch.equal(streamed[name], value), name


def test_streams_read_unaligned_tensors_across_small_chunks(tmp_path):
    """A tensor whose bytes start at an offset its element size does not divide (a file of mixed dtypes) and cross
    chunk boundaries is assembled exactly, cast on the way; the stream's checksum is the file's; files on a
    filesystem that refuses O_DIRECT (tmpfs) read the same."""
    from hf_zero.checkpoint.consolidate import _cast_pieces, _NoBar
    from hf_zero.checkpoint.pretrained import Staging
    from hf_zero.checkpoint.format import Digest, checksum_of
    from hf_zero.checkpoint.sequential import stored_tensors
    from hf_zero.checkpoint.stream import Entry, host_pieces, write_streamed
    from hf_zero.checkpoint.streams import FileStream

    odd = torch.arange(3, dtype=torch.uint8)
    values = torch.randn(5000, dtype=torch.float32)
    entries = [Entry("odd", odd.dtype, (3,), host_pieces(odd)), Entry("v", values.dtype, (5000,), host_pieces(values))]
    for directory in (tmp_path, Path("/dev/shm")):
        path = directory / f"hf_zero-test-{os.getpid()}.safetensors"
        try:
            write_streamed(path, entries)
            where = stored_tensors(path)["v"]
            assert where.begin % 4, "the test needs an unaligned tensor"
            for dtype in (torch.float32, torch.bfloat16):
                stream = FileStream(path, Digest(), read_bytes=4096, ahead=2)
                got = torch.cat([p.clone() for p in _cast_pieces([(str(path), where, 0)], {str(path): stream},
                                                                 dtype, Staging(), _NoBar())()])
                assert torch.equal(got, values.to(dtype)), dtype
                assert stream.finish() == checksum_of(path)
        finally:
            path.unlink(missing_ok=True)


def test_stream_order_reads_every_file_front_to_back():
    from hf_zero.checkpoint.sequential import Stored
    from hf_zero.checkpoint.streams import stream_order

    def at(begin: int) -> Stored:
        return Stored(torch.float32, 1, begin, (1,))

    # a in both files; b only in f1 (after a); c in f0 before a: c, a, b
    order = stream_order({"a": [("f0", at(16)), ("f1", at(8))], "b": [("f1", at(24))], "c": [("f0", at(8))],
                          "empty": []})
    assert order is not None and order.index("c") < order.index("a") < order.index("b") and "empty" in order
    assert stream_order({"a": [("f0", at(8)), ("f1", at(16))], "b": [("f0", at(16)), ("f1", at(8))]}) is None


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]])
def test_a_peft_checkpoint_is_written_as_its_adapter(pools, tmp_path, modules_to_save):
    """[Note: adapter export] A checkpoint of a LoRA model holds its weights under PEFT's names: written as a
    transformers model directory, transformers would load a model initialized at random. It is written as what
    trained, the adapter: the same files, keys and values as the PEFT model's own `save_pretrained` (the trained copy
    of a `modules_to_save` head too), its config equal, and `PeftModel.from_pretrained` of it computes the trained
    model's logits. A checkpoint without the adapter's config (saved before hf_zero recorded it) is refused."""
    import json
    import shutil

    from peft import PeftModel
    from safetensors.torch import load_file

    from tests._training import make_model

    make_model("llama", seed=7).save_pretrained(tmp_path / "base")
    ckpt, live, out = tmp_path / "ckpt", tmp_path / "live", tmp_path / "out"
    logits = pools(2).values(checkpoint_cases.lora_checkpoint_and_adapter, str(tmp_path / "base"), str(ckpt),
                             str(live), modules_to_save)[0]["logits"]
    if modules_to_save:  # the command line says what it wrote
        done = run_cli(["consolidate", str(ckpt), str(out)])
        assert done.returncode == 0 and "wrote the PEFT adapter" in done.stdout, done.stderr
    else:
        assert hf_zero.consolidate(ckpt, out, progress=False) == ["adapter_model.safetensors"]
    ours, peft_own = load_file(out / "adapter_model.safetensors"), load_file(live / "adapter_model.safetensors")
    assert ours.keys() == peft_own.keys() and len(ours) == 8 + (1 if modules_to_save else 0)
    for key, value in peft_own.items():
        assert torch.equal(ours[key], value), key
    def config(directory: Path) -> dict:
        values = json.loads((directory / "adapter_config.json").read_text())
        return {k: set(v) if k == "target_modules" else v for k, v in values.items()}  # a set, written as a list

    assert config(out) == config(live)
    assert not (out / "config.json").exists()  # an adapter directory, not a model's
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=torch.tensor(checkpoint_cases.PROMPT)).logits, logits,
                                   rtol=1e-5, atol=1e-6)
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    manifest = json.loads((old / "hf_zero_manifest.json").read_text())
    del manifest["peft"]
    (old / "hf_zero_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="holds a PEFT model .* records no adapter config .* initialized at random"):
        hf_zero.consolidate(old, tmp_path / "old_out", progress=False)
    assert not (tmp_path / "old_out").exists()
