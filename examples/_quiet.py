"""Imported first by the example scripts: no import-time notes of optional packages that are not about the job.

torchao (installed with hf_zero's dev extra, for its 8-bit optimizers) logs "Failed to load ..._C_*.so" for the
GPU kernels a CPU machine cannot load, and registers enums with torch's pytree, which logs a deprecation warning
per enum; bitsandbytes (the same extra) logs "Failed to load CPU gemm_4bit_forward from kernels-community" on a CPU
with AVX-512 BF16 where the `kernels` package is absent (its 4-bit kernels, which no example uses); all at import,
all harmless, all looking like errors in a training log. Their loggers are set to ERROR here, before transformers
imports them; every other warning is left as it is.
"""

import logging

for _name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
    logging.getLogger(_name).setLevel(logging.ERROR)
