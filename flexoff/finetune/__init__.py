"""LoRA finetuning through the engine's sweeps: training data with loss masks (`data`), and the
trainer that steps AdamW on an adapter's A and B while the base streams through the tiers
(`trainer`)."""

from flexoff.finetune.data import Example, read_examples, to_example
from flexoff.finetune.trainer import LoraTrainer, TrainConfig

__all__ = ["Example", "read_examples", "to_example", "LoraTrainer", "TrainConfig"]
