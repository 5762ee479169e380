"""Compression inside the engine: against transformers on fake-quantized weights, under the
policy matrix, and perplexity against plain torch fake-quantization references."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.quant import QuantConfig, dequantize, quantize
from flexoff.ppl import perplexity
from policy_matrix import pairwise
from reference import PROMPTS, hf_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from accuracy import fake_quant_cache, fake_quant_weights, hf_ppl  # noqa: E402  (the plain torch references)

TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "lighthouse.txt"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "fc1", "fc2", "gate_proj", "up_proj",
          "down_proj", "lm_head")


@pytest.mark.parametrize("name", ["opt", "llama", "qwen2"])
def test_compressed_weights_equal_transformers_on_the_same_values(tiny, name):
    hf = copy.deepcopy(tiny[name].hf)
    cfg = QuantConfig(4, 64, dim=0)  # output channels, as flexoff stores weights
    with torch.no_grad():
        if hf.config.tie_word_embeddings:  # flexoff compresses the head, not the embedding table
            hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.clone())
        for n, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and n.split(".")[-1] in LINEAR:
                mod.weight.copy_(dequantize(quantize(mod.weight, cfg)))
    want = [hf_greedy(hf, p, 8)[0] for p in PROMPTS]
    with LLM(str(tiny[name].path), policy=Policy(gpu_batch_size=5, compress_weight=True)) as llm:
        got = [c.token_ids for c in llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8).completions]
    assert got == want


def test_compression_is_deterministic_under_every_placement(tiny):
    with LLM(str(tiny["llama"].path)) as llm:
        for p in pairwise():
            llm.policy_arg = p.replace(compress_weight=True, compress_cache=True, quant_group=16)
            runs = [[c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                        max_new_tokens=6).completions] for _ in range(2)]
            assert runs[0] == runs[1] and all(len(t) == 6 for t in runs[0]), p.describe()


def test_a_compressed_cache_gives_the_same_tokens_wherever_it_is_placed(tiny):
    """The cache's records are the same bytes in every tier, so a compressed cache split over
    GPU, CPU and disk rows (each prompt encoded once, its segments copied out of the one
    encoding) generates what the cache held whole on the GPU does."""
    with LLM(str(tiny["opt"].path)) as llm:
        def run(p: Policy) -> list[list[int]]:
            llm.policy_arg = p.replace(compress_cache=True, quant_group=16)
            return [c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                      max_new_tokens=6).completions]
        want = run(Policy(gpu_batch_size=len(PROMPTS)))
        for p in pairwise():
            assert run(p) == want, p.describe()


@pytest.fixture(scope="module")
def smol_ppl(smol):
    smol.close()
    text = TEXT.read_text()
    out = {}
    for mode, pol in {"dense": Policy(gpu_batch_size=8), "weights": Policy(gpu_batch_size=8, compress_weight=True),
                      "cache": Policy(gpu_batch_size=8, compress_cache=True)}.items():
        smol.policy_arg = pol
        out[mode] = perplexity(smol, text)
    smol.policy_arg = None
    smol.close()
    return out, smol.tokenizer.encode(text)


def test_perplexity_equals_transformers(smol_ppl, smol_hf):
    ours, ids = smol_ppl
    assert ours["dense"].tokens == len(ids) - math.ceil(len(ids) / 512) and ours["dense"].window == 512
    assert ours["dense"].value == pytest.approx(hf_ppl(smol_hf, ids), rel=1e-4)


def test_compressed_perplexity_within_2_percent_of_fake_quantization(smol_ppl, smol_hf):
    ours, ids = smol_ppl
    ref_weights = hf_ppl(fake_quant_weights(smol_hf), ids)
    ref_cache = hf_ppl(fake_quant_cache(smol_hf), ids)
    dense = ours["dense"].value
    assert ref_cache > dense * 1.02 and ref_weights > dense * 1.02  # both references really degrade
    assert ours["cache"].value == pytest.approx(ref_cache, rel=0.02)
    assert ours["weights"].value == pytest.approx(ref_weights, rel=0.02)


def test_a_compressed_layer_is_dequantized_once_for_all_gpu_batches_of_a_prefill(tiny, monkeypatch):
    """Where matmuls dequantize whole weights (always on the CPU; on CUDA past the fused
    kernel's rows) a compressed layer's weights are dequantized once per sweep and shared by its
    GPU batches, and the tokens equal one big batch's."""
    import flexoff.kernels.quant as kq
    import flexoff.quant.engine as qe
    from flexoff.quant.sizes import compresses

    calls = []
    real = kq.dequantize_rows

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(kq, "dequantize_rows", counting)
    monkeypatch.setattr(qe, "dequantize_rows", counting)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_ids": torch.randint(3, 500, (20,), generator=g).tolist()} for _ in range(6)]
    with LLM(str(tiny["opt"].path)) as llm:
        layers = llm.model.spec.layers
        per_sweep = {l.kind: sum(compresses(t) for t in l.tensors) for l in layers}
        got = {}
        for nb in (1, 3):
            llm.policy_arg = Policy(gpu_batch_size=6 // nb, num_gpu_batches=nb, compress_weight=True)
            calls.clear()
            got[nb] = [c.token_ids for c in llm.generate(prompts, max_new_tokens=1).completions]
            once = sum(per_sweep[l.kind] for l in layers)
            assert len(calls) == once, nb  # was nb * once
    assert per_sweep["head"] and once and got[1] == got[3]
