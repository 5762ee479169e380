"""Shared fixtures: tiny HF checkpoints, the SmolLM2 reference, GPU skipping."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reference import PROMPTS, TinyModel, hf_greedy, save_tiny, smollm2_gguf, tiny_configs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """Tiny random OPT, LLaMA (grouped-query) and Qwen2 (q/k/v biases, tied embeddings) checkpoints."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: save_tiny(name, cfg, root / name) for name, cfg in tiny_configs().items()}


@pytest.fixture(scope="session")
def tiny_refs(tiny: dict[str, TinyModel]) -> dict[str, list[tuple[list[int], list[torch.Tensor]]]]:
    """transformers' greedy tokens and logits for PROMPTS, 8 new tokens each."""
    return {name: [hf_greedy(m.hf, p, 8) for p in PROMPTS] for name, m in tiny.items()}


@pytest.fixture(scope="session")
def smol_hf():
    """SmolLM2-135M from the GGUF file through transformers (the reference)."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol():
    """flexoff's SmolLM2 (the embedded default), loaded once."""
    from flexoff import LLM

    llm = LLM("smollm2")
    yield llm
    llm.close()
