"""Checkpoint files written with O_DIRECT ([Note: direct writes]): the same bytes as a plain write, whatever the
filesystem takes."""

import errno
import hashlib
import os

import pytest
import torch
import xxhash

from hf_zero.checkpoint import direct
from hf_zero.checkpoint.direct import BLOCK, DirectSink


def _takes_o_direct(folder) -> bool:
    """Asked of the filesystem here, independently of the sink."""
    if not direct.O_DIRECT:
        return False
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | direct.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def _write(path, parts, buffer_bytes):
    with DirectSink(path, buffer_bytes=buffer_bytes) as sink:
        for part in parts:
            if isinstance(part, bytes):
                sink.write_bytes(part)
            else:
                sink.write_tensor(part)
    return sink


def _bytes_of(parts) -> bytes:
    def raw(t: torch.Tensor) -> bytes:  # numpy has no bfloat16: its bits as int16
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).contiguous().numpy().tobytes()

    return b"".join(p if isinstance(p, bytes) else raw(p) for p in parts)


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [b"\x01\x02\x03"],
        [b"head", torch.arange(BLOCK // 4, dtype=torch.float32)],  # a block and 4 bytes
        [torch.arange(2 * BLOCK, dtype=torch.uint8)],  # exactly the buffer
        [b"h" * 13, torch.randn(3 * BLOCK + 5), torch.tensor([True, False, True]), torch.ones(7, dtype=torch.bfloat16)],
    ],
    ids=["empty", "tiny", "block-and-a-bit", "one-buffer", "many-buffers"],
)
def test_sink_writes_the_bytes_given_and_their_checksum(tmp_path, parts):
    path = tmp_path / "f.bin"
    sink = _write(path, parts, buffer_bytes=2 * BLOCK)
    expected = _bytes_of(parts)
    assert path.read_bytes() == expected  # the padding of the last block is truncated away
    assert sink.checksum() == "xxh3_128:" + xxhash.xxh3_128(expected).hexdigest()
    assert sink.direct == _takes_o_direct(tmp_path)


def test_sink_falls_back_to_the_page_cache_when_open_refuses_o_direct(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):  # noqa: ANN001, ANN202
        if direct.O_DIRECT and flags & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", no_direct)
    parts = [b"x" * 10, torch.randn(5000)]
    sink = _write(tmp_path / "f.bin", parts, buffer_bytes=BLOCK)
    assert not sink.direct
    assert (tmp_path / "f.bin").read_bytes() == _bytes_of(parts)


@pytest.mark.skipif(not direct.O_DIRECT, reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("fault", ["einval", "short"])
def test_sink_goes_on_through_the_page_cache_when_a_direct_write_fails_or_falls_short(tmp_path, monkeypatch, fault):
    if not _takes_o_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    real_write = os.write
    calls = []

    def flaky(fd, data):  # noqa: ANN001, ANN202
        calls.append(len(data))
        if len(calls) == 2:
            if fault == "einval":
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_write(fd, data[:100])  # leaves the file offset unaligned
        return real_write(fd, data)

    monkeypatch.setattr(direct.os, "write", flaky)
    parts = [torch.randn(4 * BLOCK)]
    sink = _write(tmp_path / "f.bin", parts, buffer_bytes=2 * BLOCK)
    assert not sink.direct and len(calls) > 2
    assert (tmp_path / "f.bin").read_bytes() == _bytes_of(parts)
    assert sink.checksum() == "xxh3_128:" + xxhash.xxh3_128(_bytes_of(parts)).hexdigest()


def test_sink_error_names_a_bad_buffer_size_and_a_failed_write_leaves_the_descriptor_closed(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="multiple of 4096"):
        DirectSink(tmp_path / "f.bin", buffer_bytes=1000)

    def full(fd, data):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.os, "write", full)
    sink = DirectSink(tmp_path / "g.bin", buffer_bytes=BLOCK)
    fd = sink._fd
    os.fstat(fd)  # open
    with pytest.raises(OSError, match="No space"):
        with sink:
            sink.write_tensor(torch.zeros(2 * BLOCK))
    with pytest.raises(OSError) as closed:
        os.fstat(fd)  # no descriptor leaked
    assert closed.value.errno == errno.EBADF


def test_hf_shard_writer_files_load_with_safetensors_for_every_dtype_it_names(tmp_path):
    """The `from_pretrained` layout (`HFShardWriter`, the rank-0 consolidation path) is written by the same direct
    writer: each shard loads with safetensors' own reader, every dtype equal, the index naming every tensor."""
    import json

    from safetensors.torch import load_file

    from hf_zero.checkpoint.writer import HFShardWriter

    tensors = {
        "w": torch.randn(300),
        "ids": torch.arange(300, dtype=torch.int64).reshape(3, 100),
        "half": torch.ones(5, dtype=torch.bfloat16),
        "fp8": torch.randn(8).to(torch.float8_e4m3fn),
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
        "c": torch.randn(4, dtype=torch.complex64),
        "flag": torch.tensor([True, False]),
    }
    writer = HFShardWriter(tmp_path, max_shard_size="1KB")
    for name, value in tensors.items():
        writer.add(name, value)
    files = writer.close()
    assert len(files) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    back: dict[str, torch.Tensor] = {}
    for name in files:
        back.update(load_file(str(tmp_path / name)))
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].view(torch.uint8).equal(value.view(torch.uint8)), name


@pytest.mark.parametrize("size", [0, 1, 4096, 4096 * 3 + 7])
def test_verification_hash_reads_in_pipelined_chunks_and_matches_the_checksum(tmp_path, size):
    """`checksum_of` reads chunk k+1 while hashing chunk k: the digest is still that of the bytes in order, for
    both algorithms a manifest may name."""
    from hf_zero.checkpoint.format import checksum_of

    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)).numpy()
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    assert checksum_of(path, "sha256", read_bytes=4096) == "sha256:" + hashlib.sha256(data.tobytes()).hexdigest()
    assert checksum_of(path, read_bytes=4096) == "xxh3_128:" + xxhash.xxh3_128(data.tobytes()).hexdigest()
