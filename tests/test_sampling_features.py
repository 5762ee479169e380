"""Per-request sampling features against transformers' `generate` on the same tiny models (and a
brute-force loop where transformers has no equivalent): repetition penalty, min_tokens, stop
token ids, ignore_eos, log-probabilities of generated tokens, presence and frequency penalties,
n samples; and the vLLM-shaped API."""

from __future__ import annotations

import pytest
import torch

from flexoff import LLM, SamplingParams
from reference import PROMPTS

N = 8


def hf_generate(model, prompt, **kw):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=N, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), [lg[0].float() for lg in out.logits]


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_repetition_penalty_equals_transformers(tiny, name):
    hf = tiny[name].hf
    with LLM(str(tiny[name].path)) as llm:
        got = llm.generate([{"prompt_ids": p} for p in PROMPTS], SamplingParams(max_tokens=N, repetition_penalty=1.7))
        for p, out in zip(PROMPTS, got):
            assert out.outputs[0].token_ids == hf_generate(hf, p, repetition_penalty=1.7)[0]


def test_min_tokens_stop_ids_and_ignore_eos_equal_transformers(tiny):
    hf = tiny["llama"].hf
    p = PROMPTS[0]
    free, _ = hf_generate(hf, p)
    eos = free[2]  # a token greedy decoding reaches at step 2
    with LLM(str(tiny["llama"].path)) as llm:
        llm.model.tokenizer.eos_ids = (eos,)
        early = llm.generate([{"prompt_ids": p}], max_new_tokens=N).completions[0]
        assert early.token_ids == free[:2] and early.finish_reason == "stop"
        want, _ = hf_generate(hf, p, eos_token_id=eos, min_new_tokens=5)
        late = llm.generate([{"prompt_ids": p, "min_tokens": 5}], max_new_tokens=N).completions[0]
        assert late.token_ids == [t for t in want[:want.index(eos)]] if eos in want else want
        through = llm.generate([{"prompt_ids": p, "ignore_eos": True}], max_new_tokens=N).completions[0]
        assert through.token_ids == free and through.finish_reason == "length"
        llm.model.tokenizer.eos_ids = ()
        stop = free[4]
        by_id = llm.generate([{"prompt_ids": p, "stop_token_ids": [stop]}], max_new_tokens=N).completions[0]
        assert by_id.token_ids == free[:free.index(stop)] and by_id.finish_reason == "stop"


@pytest.mark.parametrize("name", ["opt", "qwen2"])
def test_logprobs_of_generated_tokens_equal_a_log_softmax_of_transformers_logits(tiny, name):
    with LLM(str(tiny[name].path)) as llm:
        outs = llm.generate([{"prompt_ids": p} for p in PROMPTS], SamplingParams(max_tokens=N, logprobs=3))
        for p, out in zip(PROMPTS, outs):
            want_ids, logits = hf_generate(tiny[name].hf, p)
            c = out.outputs[0]
            assert c.token_ids == want_ids
            for t, (tok, got), lg in zip(range(N), zip(c.token_ids, c.logprobs), logits):
                ref = lg.double().log_softmax(-1)
                assert abs(got[tok] - float(ref[tok])) < 1e-4
                top = ref.topk(3)
                for i, v in zip(top.indices.tolist(), top.values.tolist()):
                    assert i in got and abs(got[i] - v) < 1e-4


def test_presence_and_frequency_penalties_equal_a_brute_force_loop(tiny):
    hf = tiny["opt"].hf
    pres, freq = 0.8, 0.6
    with LLM(str(tiny["opt"].path)) as llm:
        outs = llm.generate([{"prompt_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=N, presence_penalty=pres, frequency_penalty=freq))
    for p, out in zip(PROMPTS, outs):
        seq, gen = list(p), []
        with torch.no_grad():
            for _ in range(N):  # the whole sequence again each step: no cache, nothing shared
                logits = hf(torch.tensor([seq])).logits[0, -1].double()
                counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=logits.numel()).double() \
                    if gen else torch.zeros_like(logits)
                logits = logits - pres * (counts > 0) - freq * counts
                t = int(logits.argmax())
                gen.append(t)
                seq.append(t)
        assert out.outputs[0].token_ids == gen


def test_n_samples_are_seeded_rows_and_greedy_ones_agree(tiny):
    with LLM(str(tiny["llama"].path)) as llm:
        many = llm.generate([{"prompt_ids": PROMPTS[0]}], SamplingParams(max_tokens=N, temperature=1.0, seed=5, n=3))
        (req,) = list(many)
        assert [c.index for c in req.outputs] == [0, 1, 2]
        for j, c in enumerate(req.outputs):  # sample j draws from seed + j
            alone = llm.generate([{"prompt_ids": PROMPTS[0]}], SamplingParams(max_tokens=N, temperature=1.0,
                                                                              seed=5 + j))
            assert c.token_ids == alone[0].outputs[0].token_ids
        assert len({tuple(c.token_ids) for c in req.outputs}) > 1
        greedy = llm.generate([{"prompt_ids": PROMPTS[1]}], SamplingParams(max_tokens=N, n=2))[0]
        assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_n_samples_are_one_output_line_with_choices(tmp_path, capsys):
    import json

    from flexoff.cli import main

    inp, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"id": "a", "prompt": "hi", "n": 3, "temperature": 1.0, "seed": 1, "max_tokens": 3}\n'
                   '{"id": "b", "prompt": "ho"}\n')
    assert main(["run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), "-q",
                 "--gpu-batch-size", "2"]) == 0
    lines = {json.loads(l)["id"]: json.loads(l) for l in out.read_text().splitlines()}
    assert sorted(lines) == ["a", "b"] and [c["index"] for c in lines["a"]["choices"]] == [0, 1, 2]
    assert "choices" not in lines["b"]


def test_the_vllm_quickstart_runs_with_only_the_import_changed(tiny, tmp_path, monkeypatch):
    """vLLM's offline-inference quickstart, verbatim but for its import line, on a tiny OPT saved
    into a Hugging Face cache as facebook/opt-125m (no hub is reachable here)."""
    from huggingface_hub.constants import HF_HUB_CACHE  # noqa: F401  (the variable it reads)

    from reference import save_in_hf_cache

    cache = tmp_path / "hub"
    save_in_hf_cache(tiny["opt"].path, cache, "facebook/opt-125m")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))

    from flexoff import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model="facebook/opt-125m")
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    assert len(printed) == 4 and all(line.startswith("Prompt: ") for line in printed)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
    assert len(chat) == 1 and len(chat[0].outputs[0].token_ids) <= 4
    llm.close()


def test_sizes_as_strings_and_a_missing_hub_id(tmp_path, monkeypatch):
    from flexoff.errors import ModelError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="local Hugging Face cache"):
        LLM("someone/not-here")
    with LLM("dummy:opt-tiny", cpu_mem="2GiB") as llm:
        assert llm.options.budgets.cpu == 2 * 2**30
