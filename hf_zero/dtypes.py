"""Dtype names, in one place: the short names of settings and the long names files record.

Example:

```python
>>> parse_dtype("bf16"), dtype_name(torch.bfloat16), dtype_from_name("bfloat16")
(torch.bfloat16, 'bfloat16', torch.bfloat16)
```
"""

from __future__ import annotations

import torch

# Elements a loop over a large tensor handles at once (16 MiB of fp32): what bounds the temporaries of the optimizer's
# chunks, `offload_dir`'s windows, the copies to the host when saving and the fingerprints of the shards.
AT_ONCE_NUMEL = 1 << 22

SAFETENSORS_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}  # as safetensors' headers name them

SHORT_NAMES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FILE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`None` (keep), a `torch.dtype`, or one of 'fp32', 'bf16', 'fp16' (or their long names)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = SHORT_NAMES.get(dtype) or (_FILE_NAMES.get(dtype) if dtype in ("float32", "bfloat16", "float16") else None)
    if found is None:
        raise ValueError(
            f"dtype must be one of 'fp32', 'bf16', 'fp16' (or None to keep the saved dtype); got {dtype!r}."
        )
    return found


def dtype_name(dtype: torch.dtype) -> str:
    """The name files record (`config.json`'s `dtype`, the checkpoint manifest): 'float32', 'bfloat16', ..."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a file records by name; `ValueError` for one this release does not know."""
    if name not in _FILE_NAMES:
        raise ValueError(f"Unknown dtype {name!r} in the checkpoint; this release reads {sorted(_FILE_NAMES)}.")
    return _FILE_NAMES[name]
