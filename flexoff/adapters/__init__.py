"""LoRA adapters: PEFT folders read and checked against a base model (`peft`), ready for the
engine's per-row application (flexoff.offload.adapters)."""

from flexoff.adapters.peft import Adapter, LoraModule, ModuleShape, load_adapter, write_folder

__all__ = ["Adapter", "LoraModule", "ModuleShape", "load_adapter", "write_folder"]
