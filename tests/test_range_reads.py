"""`RangeReads` ([Note: one-pass load]): planned byte ranges of safetensors files land in their tensors, cast where
the file's dtype differs, and the whole file's checksum comes from the same single pass."""

from __future__ import annotations

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from hf_zero.checkpoint import sequential
from hf_zero.checkpoint.format import Digest
from hf_zero.checkpoint.sequential import RangeReads


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(1000, generator=g),
        "b::exp_avg": torch.randn(3000, generator=g),
        "c": torch.randn(500, generator=g).to(torch.bfloat16),
        "z": torch.randn(77, generator=g).to(torch.float64),
    }
    save_file(tensors, str(tmp_path / "f.safetensors"))
    return tmp_path, tensors


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("span", [sequential.READ_BYTES, 4096], ids=["one-read", "many-reads"])
def test_ranges_land_in_their_tensors_and_the_checksum_is_the_files(stored, monkeypatch, span, direct):
    """Buffered, and around the page cache through the aligned buffers (where the filesystem takes O_DIRECT; it
    falls back to buffered reads elsewhere): the same tensors, the same checksum."""
    directory, tensors = stored
    monkeypatch.setattr(sequential, "READ_BYTES", span)
    monkeypatch.setattr(sequential, "_BOUNCE", [])  # buffers of this span
    reads = RangeReads(directory, direct=direct)
    # "a" saved as two pieces [0, 600) and [600, 1000) of one parameter, in one file under two keys is not how a
    # checkpoint stores it; one key per file, with the piece's range: elements [100, 900) of "a"
    out_a = torch.full((800,), -1.0)
    reads.add("a", [["f.safetensors", 0, 1000]], 100, 900, out_a)
    out_b = torch.empty(3000, dtype=torch.float64)  # another dtype than the file's: cast after the read
    reads.add("b::exp_avg", [["f.safetensors", 0, 3000]], 0, 3000, out_b)
    out_c = torch.empty(10, dtype=torch.bfloat16)
    reads.add("c", [["f.safetensors", 0, 500]], 490, 500, out_c)
    checksum = reads.read("f.safetensors", Digest())
    assert torch.equal(out_a, tensors["a"][100:900])
    assert torch.equal(out_b, tensors["b::exp_avg"].double())
    assert torch.equal(out_c, tensors["c"][490:])
    assert checksum == "xxh3_128:" + xxhash.xxh3_128((directory / "f.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("span", [sequential.READ_BYTES, 4096], ids=["one-read", "many-reads"])
def test_direct_reads_without_a_digest_fill_scattered_ranges(stored, monkeypatch, span):
    """Around the page cache, only the aligned spans around the wanted ranges are read, and each lands whole."""
    directory, tensors = stored
    monkeypatch.setattr(sequential, "READ_BYTES", span)
    monkeypatch.setattr(sequential, "_BOUNCE", [])
    reads = RangeReads(directory, direct=True)
    out_z, out_a = torch.empty(7, dtype=torch.float64), torch.empty(3, dtype=torch.float32)
    reads.add("z", [["f.safetensors", 0, 77]], 70, 77, out_z)
    reads.add("a", [["f.safetensors", 0, 1000]], 997, 1000, out_a)
    assert reads.read("f.safetensors") is None
    assert torch.equal(out_z, tensors["z"][70:]) and torch.equal(out_a, tensors["a"][997:])


def test_without_a_digest_only_the_ranges_are_read(stored, monkeypatch):
    directory, tensors = stored
    asked: list[int] = []
    real = sequential.os.preadv
    monkeypatch.setattr(sequential.os, "preadv", lambda fd, views, at: asked.append(len(views[0])) or real(fd, views, at))
    reads = RangeReads(directory)
    out = torch.empty(77, dtype=torch.float64)
    reads.add("z", [["f.safetensors", 0, 77]], 0, 77, out)
    assert reads.read("f.safetensors") is None
    assert torch.equal(out, tensors["z"]) and asked == [77 * 8]


def test_truncated_file_and_missing_key_raise(stored):
    directory, _ = stored
    path = directory / "f.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="past the end of the file: it is truncated"):  # from the header
        RangeReads(directory).add("z", [["f.safetensors", 0, 77]], 0, 77, torch.empty(77, dtype=torch.float64))
    save_file({"a": torch.ones(10)}, str(path))
    with pytest.raises(ValueError, match="lacks nope"):
        RangeReads(directory).add("nope", [["f.safetensors", 0, 5]], 0, 5, torch.empty(5))
    with pytest.raises(ValueError, match="covers only 0 of elements"):
        RangeReads(directory).add("a", [["f.safetensors", 0, 10]], 10, 20, torch.empty(10))
    reads = RangeReads(directory)
    reads.add("a", [["f.safetensors", 0, 10]], 0, 10, torch.empty(10))
    path.write_bytes(path.read_bytes()[:-8])  # truncated between the plan and the read
    with pytest.raises(ValueError, match="truncated"):
        reads.read("f.safetensors", Digest())


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_whole_small_tensor_comes_from_a_file_read_already(tmp_path, direct):
    """`add_whole` (a piece's `step`, held by every optimizer file of the piece): from the file this rank reads for
    its elementwise state, not the first file listed, which would bring a whole other file into the pass."""
    g = torch.Generator().manual_seed(0)
    mine = {"p::step": torch.tensor(7.0), "p::exp_avg": torch.randn(64, generator=g)}
    theirs = {"p::step": torch.tensor(-1.0), "p::exp_avg": torch.randn(64, generator=g)}
    save_file(theirs, str(tmp_path / "theirs.safetensors"))
    save_file(mine, str(tmp_path / "mine.safetensors"))
    reads = RangeReads(tmp_path, direct=direct)
    out = torch.empty(32)
    reads.add("p::exp_avg", [["theirs.safetensors", 0, 32], ["mine.safetensors", 32, 96]], 40, 72, out)
    step = reads.add_whole("p::step", ["theirs.safetensors", "mine.safetensors"])
    assert sorted(reads.wants) == ["mine.safetensors"]
    reads.read("mine.safetensors", Digest())
    assert step.shape == () and step.item() == 7.0
    assert torch.equal(out, mine["p::exp_avg"][8:40])
    with pytest.raises(ValueError, match="No file of the checkpoint holds the optimizer state p::exp_avg_sq"):
        reads.add_whole("p::exp_avg_sq", ["theirs.safetensors", "mine.safetensors"])
