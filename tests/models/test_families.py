"""OPT and LLaMA-family math against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from flexoff import LLM
from flexoff.errors import ModelError
from flexoff.models import ModelSpec, build_family
from reference import PROMPTS, hf_greedy, rel_err, save_tiny


def _run(path, prompts, n=8):
    """flexoff greedy tokens and per-step logits, all prompts in one batch."""
    logits: dict[str, list[torch.Tensor]] = {}

    def grab(step, ids, lg):
        for rid, row in zip(ids, lg):
            logits.setdefault(rid, []).append(row.float().clone())

    with LLM(str(path)) as llm:
        out = llm.generate([{"prompt_ids": p} for p in prompts], max_new_tokens=n, on_logits=grab)
    return [c.token_ids for c in out.completions], [logits[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["opt", "llama", "qwen2"])
def test_greedy_tokens_and_logits_match_transformers(tiny, tiny_refs, name):
    tokens, logits = _run(tiny[name].path, PROMPTS)
    assert len({t for ref, _ in tiny_refs[name] for t in ref}) > 5  # the reference is not degenerate
    for (ref_tokens, ref_logits), got_tokens, got_logits in zip(tiny_refs[name], tokens, logits):
        assert got_tokens == ref_tokens
        for a, b in zip(got_logits, ref_logits):
            assert rel_err(a, b) < 1e-4


def _llama_cfg(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                       initializer_range=0.2, **kw)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    m = save_tiny("rope", _llama_cfg(rope_scaling=rope, rope_theta=50000.0), tmp_path)
    long_prompt = list(range(3, 60))
    tokens, logits = _run(tmp_path, [long_prompt, [7, 8, 9]], n=6)
    for p, got, got_lg in zip([long_prompt, [7, 8, 9]], tokens, logits):
        ref, ref_lg = hf_greedy(m.hf, p, 6)
        assert got == ref
        assert max(rel_err(a, b) for a, b in zip(got_lg, ref_lg)) < 1e-4


def test_attention_and_mlp_bias_llama(tmp_path):
    m = save_tiny("bias", _llama_cfg(attention_bias=True, mlp_bias=True, tie_word_embeddings=True), tmp_path)
    tokens, _ = _run(tmp_path, PROMPTS[:2])
    assert tokens == [hf_greedy(m.hf, p, 8)[0] for p in PROMPTS[:2]]


def test_spec_sizes_match_the_checkpoint(tiny):
    for name, m in tiny.items():
        spec = ModelSpec.from_config(name, m.hf.config.to_dict())
        hf_params = sum(p.numel() for p in m.hf.parameters())
        tied = spec.vocab_size * spec.hidden_size if m.hf.config.tie_word_embeddings else 0
        assert spec.num_params - tied == hf_params
        assert spec.weight_bytes(2) == 2 * spec.num_params
        kvh = m.hf.config.num_key_value_heads if name != "opt" else m.hf.config.num_attention_heads
        assert spec.kv_bytes_per_token(2) == 2 * kvh * 16 * 2
        # decode FLOPs: two per multiply-add of every matmul weight, plus attention over the context
        matmul = sum(p.numel() for n, p in m.hf.named_parameters()
                     if p.dim() == 2 and "embed" not in n) + (spec.vocab_size * 64 if tied else 0)
        assert spec.decode_flops(10) == 2 * matmul + 3 * 4 * 64 * 10


def test_unsupported_configs_are_clear_errors():
    with pytest.raises(ModelError, match="not supported"):
        build_family({"model_type": "gpt2"})
    with pytest.raises(ModelError, match="opt-350m"):
        build_family({"model_type": "opt", "hidden_size": 1024, "word_embed_proj_dim": 512, "ffn_dim": 4096,
                      "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": 100,
                      "max_position_embeddings": 64})
    with pytest.raises(ModelError, match="missing the field"):
        build_family({"model_type": "llama", "hidden_size": 64})
