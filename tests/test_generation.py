"""The generation driver and Python API: batching, sampling, stopping, dtypes, log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.errors import InputError
from flexoff.sampling import BlockSampler, SamplingParams, filter_logits
from reference import PROMPTS, rel_err


def test_outputs_do_not_depend_on_batch_mates(tiny):
    with LLM(str(tiny["llama"].path), policy=Policy(gpu_batch_size=5)) as llm:
        for temp in (0.0, 0.9):
            batch = llm.generate([{"prompt_ids": p, "id": f"p{i}"} for i, p in enumerate(PROMPTS)],
                                 max_new_tokens=6, temperature=temp, seed=3).completions
            for i, p in enumerate(PROMPTS):
                alone = llm.generate([{"prompt_ids": p, "id": f"p{i}"}], max_new_tokens=6,
                                     temperature=temp, seed=3).completions[0]
                assert alone.token_ids == batch[i].token_ids


def test_sampling_is_seeded_and_top_k_one_is_greedy(tiny, tiny_refs):
    with LLM(str(tiny["opt"].path)) as llm:
        reqs = [{"prompt_ids": p} for p in PROMPTS]
        a = llm.generate(reqs, max_new_tokens=8, temperature=1.0, seed=1).completions
        b = llm.generate(reqs, max_new_tokens=8, temperature=1.0, seed=1).completions
        c = llm.generate(reqs, max_new_tokens=8, temperature=1.0, seed=2).completions
        assert [x.token_ids for x in a] == [x.token_ids for x in b]
        assert [x.token_ids for x in a] != [x.token_ids for x in c]
        k1 = llm.generate(reqs, max_new_tokens=8, temperature=0.7, top_k=1).completions
        assert [x.token_ids for x in k1] == [r for r, _ in tiny_refs["opt"]]


def test_filter_logits_against_brute_force():
    torch.manual_seed(0)
    logits = torch.randn(50, dtype=torch.float64)
    probs = logits.softmax(-1)
    for k, p in [(0, 1.0), (5, 1.0), (0, 0.5), (10, 0.3), (1, 0.9), (0, 0.999)]:
        got = filter_logits(logits, k, p).softmax(-1)
        order = sorted(range(50), key=lambda i: -probs[i])
        keep = order[:k] if k else order
        total = float(probs[keep].sum())  # top-k first, then the nucleus of what is left (as HF)
        mass, nucleus = 0.0, []
        for i in keep:  # smallest prefix whose mass reaches p
            if mass >= p:
                break
            nucleus.append(i)
            mass += float(probs[i]) / total
        want = torch.zeros(50, dtype=torch.float64)
        want[nucleus] = probs[nucleus] / probs[nucleus].sum()
        assert torch.allclose(got, want, atol=1e-12)


def test_sampler_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=1.0)]
    counts = torch.zeros(4)
    for seed in range(4000):
        counts[BlockSampler([params], [[seed]], torch.device("cpu"))(logits.clone(), 0, 0)[0]] += 1
    expected = logits[0].softmax(-1) * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom


def test_per_request_settings_and_eos(tiny, tiny_refs):
    ref = tiny_refs["llama"]
    eos = ref[0][0][3]  # the 4th greedy token of the first prompt ends it
    with LLM(str(tiny["llama"].path)) as llm:
        llm.model.tokenizer.eos_ids = (eos,)
        out = llm.generate([{"prompt_ids": PROMPTS[0], "max_new_tokens": 8},
                            {"prompt_ids": PROMPTS[1], "max_new_tokens": 2}], max_new_tokens=5).completions
    first = ref[0][0][:3]
    assert out[0].token_ids == first and out[0].finish_reason == "stop"
    want = ref[1][0][:2]
    if eos in want:
        want = want[:want.index(eos)]
    assert out[1].token_ids == want


def test_stop_strings_and_chat_on_smollm2(smol):
    out = smol.generate(["1, 2, 3, 4,"], max_new_tokens=12, stop=[", 7"]).completions[0]
    assert out.text == " 5, 6" and out.finish_reason == "stop"
    chat = smol.generate([{"messages": [{"role": "user", "content": "What is the capital of France?"}]}],
                         max_new_tokens=16).completions[0]
    assert "Paris" in chat.text and chat.finish_reason == "stop"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tiny, tiny_refs, dtype):
    logits = []
    with LLM(str(tiny["llama"].path), dtype=dtype) as llm:
        out = llm.generate([{"prompt_ids": PROMPTS[0]}], max_new_tokens=1,
                           on_logits=lambda i, ids, lg: logits.append(lg[0].float()))
    assert len(out.completions[0].token_ids) == 1
    assert rel_err(logits[0], tiny_refs["llama"][0][1][0]) < 5e-2


def test_prompt_logprobs_match_transformers(tiny):
    m = tiny["qwen2"]
    with LLM(str(m.path)) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=1, prompt_logprobs=True)
    for p, c in zip(PROMPTS, out.completions):
        with torch.no_grad():
            lp = m.hf(torch.tensor([p])).logits[0].double().log_softmax(-1)
        want = [float(lp[t, p[t + 1]]) for t in range(len(p) - 1)]
        assert c.prompt_logprobs == pytest.approx(want, abs=1e-4)


def test_bad_requests_are_input_errors(tiny):
    with LLM(str(tiny["opt"].path)) as llm:
        with pytest.raises(InputError, match="empty"):
            llm.generate([{"prompt_ids": []}])
        with pytest.raises(InputError, match="context of 256"):
            llm.generate([{"prompt_ids": [5] * 250}], max_new_tokens=10)
        with pytest.raises(InputError, match="top_p"):
            llm.generate([{"prompt_ids": [5]}], top_p=0)
        with pytest.raises(InputError, match="duplicate"):
            llm.generate([{"prompt_ids": [5], "id": "a"}, {"prompt_ids": [6], "id": "a"}])
        with pytest.raises(InputError, match="token ids below 512"):
            llm.generate([{"prompt_ids": [5, 9999]}])


def test_stats_count_tokens_and_time(tiny):
    with LLM(str(tiny["opt"].path), policy=Policy(gpu_batch_size=2, num_gpu_batches=2)) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=4)
    st = out.stats
    assert st.prompt_tokens == sum(map(len, PROMPTS))
    assert st.generated_tokens == 4 * len(PROMPTS)
    assert st.blocks == math.ceil(len(PROMPTS) / 4)
    assert st.prefill_s > 0 and st.decode_s > 0 and st.generation_throughput > 0
    assert st.padded_prompt_tokens >= st.prompt_tokens


def test_blocks_group_a_many_adapter_job_by_adapter_across_near_lengths():
    """Prompts of lengths 201-225 (one LENGTH_STEP band) spread over 20 adapters, 6 rows each: in
    exact-length order a block of 12 holds 8 adapters or more; grouped by adapter within the band
    it holds at most three, with every row in one block and a block's lengths within the step.
    A job of fewer than MANY_ADAPTERS adapters keeps the exact-length order."""
    import random

    from flexoff.generation import LENGTH_STEP, MANY_ADAPTERS, Request, plan_blocks

    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=4)
    reqs = [Request(f"r{i}", None, [1] * rng.randint(201, 225), params, adapter=f"a{i % 20}") for i in range(120)]
    blocks = plan_blocks(reqs, 12)
    assert sorted(r.id for b in blocks for r in b) == sorted(r.id for r in reqs)
    by_length = sorted(reqs, key=lambda r: len(r.prompt_ids))
    assert max(len({r.adapter for r in by_length[i:i + 12]}) for i in range(0, 120, 12)) >= 8  # what grouping avoids
    assert max(len({r.adapter for r in b}) for b in blocks) <= 3
    for b in blocks:
        lengths = [len(r.prompt_ids) for r in b]
        assert max(lengths) <= min(lengths) * LENGTH_STEP
    few = [Request(r.id, None, r.prompt_ids, params, adapter=f"a{i % (MANY_ADAPTERS - 1)}") for i, r in enumerate(reqs)]
    assert [len(r.prompt_ids) for b in plan_blocks(few, 12) for r in b] == sorted(len(r.prompt_ids) for r in few)
