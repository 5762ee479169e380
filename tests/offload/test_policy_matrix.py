"""Every policy of the engine's matrix gives the reference's greedy tokens.

Placement (weights on GPU / CPU / split / disk; cache and activations on the
compute device, CPU, disk, split), batch shapes including a last block that is
not full, overlap on and off, CPU attention on and off. On a CPU-only machine
the compute device is the CPU and the copy lanes are threads, so the same
schedule, with real concurrency, runs here.
"""

from __future__ import annotations

import pytest
import torch

from flexoff import LLM, Policy
from policy_matrix import FULL, pairwise
from reference import PROMPTS


@pytest.mark.parametrize("name", ["opt", "llama", pytest.param("qwen2", marks=pytest.mark.slow)])
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




@pytest.mark.parametrize("name", ["opt", "llama"])
def test_prefill_over_chunks_of_sequences_gives_the_same_tokens(tiny, tiny_refs, monkeypatch, name):
    """FLEXOFF_PREFILL_CHUNK: a prefill MLP computed a few sequences at a time (here one: a chunk
    of one token) gives the reference's greedy tokens, weights on the GPU and streamed from the
    CPU with CPU attention, and every prefill MLP call then saw one sequence; with a 4-bit cache,
    attention over the prompt's decoded keys and values a row at a time gives the tokens and
    logits of the whole batch's (chunks off)."""
    want = [r[:6] for r, _ in tiny_refs[name]]
    prompts = [{"prompt_ids": q} for q in PROMPTS]
    with LLM(str(tiny[name].path)) as llm:
        family = type(llm.model.family)
        plain, shapes = family.mlp, []

        def seen(self, w, h):
            shapes.append(tuple(h.shape[:2]))
            return plain(self, w, h)

        monkeypatch.setattr(family, "mlp", seen)
        monkeypatch.setenv("FLEXOFF_PREFILL_CHUNK", "1")
        for p in (Policy(4, 1, 100, 0, 100, 0, 100, 0), Policy(2, 2, 0, 100, 0, 100, 0, 100, cpu_cache_compute=True)):
            llm.policy_arg = p
            got = [c.token_ids for c in llm.generate(prompts, max_new_tokens=6).completions]
            assert got == want, p.describe()
        prefill = [s for s in shapes if s[1] > 1]
        assert prefill and all(b == 1 for b, _ in prefill), prefill
        llm.policy_arg = Policy(4, 1, 100, 0, 0, 100, 100, 0, compress_cache=True)
        out = {}
        for chunk in ("0", "1"):
            monkeypatch.setenv("FLEXOFF_PREFILL_CHUNK", chunk)
            llm.drop_engine()
            logits: list[torch.Tensor] = []
            res = llm.generate(prompts, max_new_tokens=6, on_logits=lambda i, ids, x: logits.append(x.float().clone()))
            out[chunk] = ([c.token_ids for c in res.completions], logits)
    assert out["1"][0] == out["0"][0]
    assert len(out["1"][1]) == len(out["0"][1]) > 0
    for a, b in zip(out["1"][1], out["0"][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
