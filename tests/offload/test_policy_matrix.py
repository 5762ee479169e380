"""Every policy of the engine's matrix gives the reference's greedy tokens.

Placement (weights on GPU / CPU / split / disk; cache and activations on the
compute device, CPU, disk, split), batch shapes including a last block that is
not full, overlap on and off, CPU attention on and off. On a CPU-only machine
the compute device is the CPU and the copy lanes are threads, so the same
schedule, with real concurrency, runs here.
"""

from __future__ import annotations

import itertools

import pytest

from flexoff import LLM, Policy
from reference import PROMPTS

WEIGHTS = [(100, 0), (0, 100), (30, 40), (0, 0)]
PLACES = {"device": (100, 0), "cpu": (0, 100), "disk": (0, 0), "split": (30, 40)}
SHAPES = [(1, 1), (2, 3), (4, 2)]


def policy(w, place, shape, overlap, cpu_attn) -> Policy:
    (cg, cc), (gbs, nb) = PLACES[place], shape
    return Policy(gpu_batch_size=gbs, num_gpu_batches=nb, w_gpu_percent=w[0], w_cpu_percent=w[1],
                  cache_gpu_percent=cg, cache_cpu_percent=cc, act_gpu_percent=cg, act_cpu_percent=cc,
                  overlap=overlap, cpu_cache_compute=cpu_attn)


FULL = [policy(*combo) for combo in itertools.product(WEIGHTS, PLACES, SHAPES, (True, False), (True, False))]


def pairwise() -> list[Policy]:
    """A covering subset: every value of each dimension, and every pair of placement values."""
    out = []
    for n, (w, place) in enumerate(itertools.product(WEIGHTS, PLACES)):
        out.append(policy(w, place, SHAPES[n % 3], n % 2 == 0, (n // 2) % 2 == 0))
    return out


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
