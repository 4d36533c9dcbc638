"""`BinWeights`: the weights of a model directory saved with `torch.save` (`pytorch_model.bin`), read by range.

[Note: .bin weights]
transformers saved `pytorch_model.bin` (or shards named by `pytorch_model.bin.index.json`) before safetensors
became its default, and still loads them; checkpoints fine-tuned in 2023 are often in that form. Each file is a
zip archive whose tensors are stored uncompressed, so `torch.load(..., mmap=True, weights_only=True)` maps it
instead of reading it: it unpickles the names, shapes and dtypes only, and a rank that copies out its ranges
of a tensor touches those pages alone (shared between the ranks of a node through the page cache), as the
safetensors reads do. `weights_only` loads no code, as transformers loads these files. Files in torch's
format from before 1.6 (not a zip archive) cannot be mapped: they are refused with the conversion.
"""

from __future__ import annotations

import json
import threading
import zipfile
from pathlib import Path

import torch

BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."  # torch.save before 1.6: its pickled magic number


def bin_weight_map(directory: Path) -> dict[str, str] | None:
    """`{tensor name: file}` of the directory's `.bin` weights, or None where it has none."""
    index = directory / BIN_INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    if (directory / BIN_SINGLE).is_file():
        return dict.fromkeys(BinWeights(directory).names(BIN_SINGLE), BIN_SINGLE)
    return None


def is_bin(file: str) -> bool:
    """Whether a weight map's file is one of torch's `.bin` files ([Note: .bin weights])."""
    return file.endswith(".bin")


class BinWeights:
    """The `.bin` files of one directory, each mapped at its first use ([Note: .bin weights]); safe to share with
    a reading thread.

    Example:

    ```python
    >>> weights = BinWeights(Path("./falcon-7b"))
    >>> weights.tensor("pytorch_model-00001-of-00002.bin", "transformer.word_embeddings.weight").shape
    torch.Size([65024, 4544])
    ```
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def names(self, file: str) -> list[str]:
        """The names of the tensors `file` holds, in its order."""
        return list(self._mapped(file))

    def dtypes(self, file: str) -> list[torch.dtype]:
        """The dtypes of the tensors `file` holds, in its order."""
        return [t.dtype for t in self._mapped(file).values()]

    def tensor(self, file: str, key: str) -> torch.Tensor:
        """`key`'s tensor in `file`, mapped: its bytes are read where it is copied from."""
        tensors = self._mapped(file)
        if key not in tensors:
            raise ValueError(f"{self.directory / file} lacks {key}, which the index names: the files are damaged.")
        return tensors[key]

    def flat_range(self, file: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements `[start, end)` of `key` flattened in row-major order (a view where the tensor is contiguous)."""
        return self.tensor(file, key).reshape(-1)[start:end]

    def close(self) -> None:
        """Drop the mappings (a later use maps the file again)."""
        with self._lock:
            self._files.clear()

    def _mapped(self, file: str) -> dict[str, torch.Tensor]:
        with self._lock:
            tensors = self._files.get(file)
            if tensors is None:
                tensors = self._files[file] = _load_mapped(self.directory / file)
            return tensors


def _load_mapped(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in `path`, mapped; `ValueError` naming the file and the fix where it cannot be."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is named by the directory's index but does not exist: the files are incomplete."
        )
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            legacy = f.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC
        if legacy:
            raise ValueError(
                f"{path} is in torch's format from before 1.6 (not a zip archive), which cannot be mapped. Convert "
                "it once: `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)` writes safetensors."
            )
        raise ValueError(f"Cannot read {path}: not a torch.save file (no zip archive). The file is damaged.")
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors of every kind: a damaged or foreign file
        raise ValueError(f"Cannot read {path}: {e}. The file is damaged or holds more than tensors.") from e
    if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors ({type(loaded).__name__}).")
    return loaded
