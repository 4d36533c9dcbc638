"""The capacity benchmark's model family and labels, shared by its driver, worker and report."""

from __future__ import annotations

import os

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)
SEQ = 128
if os.environ.get("HF_ZERO_CAPACITY_TINY"):  # a smoke test of the benchmark's code: a tiny model of the same kind
    SHAPE = dict(SHAPE, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1000)
LABELS = {"ddp": "DDP", "fsdp2": "FSDP2 (Accelerate's setup)", "fsdp2_reduce_fp32": "FSDP2 (Accelerate, fp32 reduce)", "ds3": "DeepSpeed ZeRO-3 (HF Trainer's config)",
          "ds3_raw": "DeepSpeed ZeRO-3 (its defaults)", "ds3_nvme": "DeepSpeed ZeRO-Infinity (NVMe, HF config)",
          "ds3_nvme_lean": "DeepSpeed ZeRO-Infinity (NVMe, sub_group_size and max_in_cpu 1e8)",
          "hf_zero3": "hf_zero ZeRO-3", "hf_zero3_disk": "hf_zero ZeRO-3 + offload_dir",
          "hf_zero3_disk_params": "hf_zero ZeRO-3 + offload_dir + offload_params",
          "hf_zero3_qlora": "hf_zero ZeRO-3, QLoRA", "hf_zero3_lora": "hf_zero ZeRO-3, LoRA (fp32 base)",
          "fsdp_qlora": "FSDP-QLoRA (PEFT / Accelerate's setup)", "ds3_qlora": "DeepSpeed ZeRO-3 QLoRA (PEFT's setup)"}
GIB = 2**30


def n_params(layers: int) -> int:
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    return 2 * v * h + h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


def hf_config(layers: int):  # noqa: ANN201
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=layers, **SHAPE)
    config._attn_implementation = "sdpa"
    return config
