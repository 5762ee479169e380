"""LoRA adapters: PEFT folders read and checked against a base model (`peft`), ready for the
engine's per-row application (flexoff.offload.adapters)."""

from flexoff.adapters.peft import Adapter, LoraModule, load_adapter

__all__ = ["Adapter", "LoraModule", "load_adapter"]
