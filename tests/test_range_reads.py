"""[Note: range reads]: elements of a flattened tensor read by byte range from a safetensors file, straight into
the destination or through a staging tensor of the stored dtype; damaged files raise a ValueError naming them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hf_zero.checkpoint.reader import FileCache, read_flat_range


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(7, 13, generator=g), "b": torch.randn(29, generator=g).to(torch.bfloat16),
               "i": torch.arange(11, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "f.safetensors"))
    return tmp_path, tensors


@pytest.mark.parametrize("key,start,end", [("w", 0, 91), ("w", 5, 40), ("w", 90, 91), ("b", 3, 29), ("i", 2, 2)])
def test_a_flat_range_reads_the_same_elements_as_the_flattened_tensor(stored, key, start, end):
    directory, tensors = stored
    expected = tensors[key].reshape(-1)[start:end]
    with FileCache(directory) as cache:
        got = read_flat_range(cache, "f.safetensors", key, start, end)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        into = torch.full((end - start,), -1.0)  # fp32, read through a staging tensor where the file is bf16
        cache.ranges("f.safetensors").read_into(key, start, into)
        assert torch.equal(into, expected.to(torch.float32))


def test_a_truncated_file_or_a_range_past_a_tensor_raises_naming_the_file(stored):
    directory, _ = stored
    with FileCache(directory) as cache:
        with pytest.raises(ValueError, match="f.safetensors: elements \\[90, 92\\) of w lie outside"):
            cache.ranges("f.safetensors").read_into("w", 90, torch.empty(2))
        with pytest.raises(ValueError, match="holds no readable tensor missing"):
            read_flat_range(cache, "f.safetensors", "missing", 0, 1)
    path = directory / "f.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with FileCache(directory) as cache, pytest.raises(ValueError, match="f.safetensors.*it is truncated"):
        read_flat_range(cache, "f.safetensors", "i", 0, 1)
    path.write_bytes(b"\xff" * 16)
    with FileCache(directory) as cache, pytest.raises(ValueError, match="Cannot read .*f.safetensors.*damaged"):
        read_flat_range(cache, "f.safetensors", "i", 0, 1)
