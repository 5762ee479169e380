"""Every policy of the engine's matrix gives the reference's greedy tokens.

Placement (weights on GPU / CPU / split / disk; cache and activations on the
compute device, CPU, disk, split), batch shapes including a last block that is
not full, overlap on and off, CPU attention on and off. On a CPU-only machine
the compute device is the CPU and the copy lanes are threads, so the same
schedule, with real concurrency, runs here.
"""

from __future__ import annotations

import pytest

from flexoff import LLM
from policy_matrix import FULL, pairwise
from reference import PROMPTS


@pytest.mark.parametrize("name", ["opt", "llama", "qwen2"])
def test_full_matrix_on_tiny_models(tiny, tiny_refs, name):
    want = [r for r, _ in tiny_refs[name]]
    with LLM(str(tiny[name].path)) as llm:
        for p in FULL:
            llm.policy_arg = p
            got = [c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                       max_new_tokens=8).completions]
            assert got == want, p.describe()


def test_covering_matrix_on_smollm2(smol, smol_hf):
    from reference import hf_greedy

    prompts = ["The capital of France is", "def add(a, b):", "Water boils at", "Hello"]
    want = [hf_greedy(smol_hf, smol.tokenizer.encode(p), 5)[0] for p in prompts]
    saved = smol.policy_arg
    try:
        for p in pairwise():
            smol.policy_arg = p
            got = [c.token_ids for c in smol.generate(prompts, max_new_tokens=5).completions]
            assert got == want, p.describe()
    finally:
        smol.policy_arg = saved
        smol.close()
