"""A pytest plugin (`-p _zero_swap`): transformers' `Trainer` and `TrainingArguments` are hf_zero's, at stage 3.

Loaded before any test module is imported, it replaces the two names in `transformers` (the lazy top-level
module), `transformers.trainer` and `transformers.training_args`, so `from transformers import Trainer,
TrainingArguments` in an unchanged test file gets `ZeroTrainer` and `ZeroTrainingArguments` (`zero_stage` 3 by
default). Used by `benchmarks/upstream_trainer_tests.py`.
"""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    import transformers
    import transformers.trainer
    import transformers.training_args

    import hf_zero

    for module, name, replacement in (
        (transformers, "Trainer", hf_zero.ZeroTrainer),
        (transformers, "TrainingArguments", hf_zero.ZeroTrainingArguments),
        (transformers.trainer, "Trainer", hf_zero.ZeroTrainer),
        (transformers.training_args, "TrainingArguments", hf_zero.ZeroTrainingArguments),
    ):
        setattr(module, name, replacement)
