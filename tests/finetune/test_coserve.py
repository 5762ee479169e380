"""Co-serving through LLM.generate: two finetuning jobs whose windows ride on inference blocks
reach the adapters (and losses) of the same jobs run standalone in the same data order, and the
inference rows still get transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.errors import InputError
from flexoff.finetune import LoraTrainer, TrainConfig, to_example
from flexoff.finetune.coserve import CoJob, CoTrainer
from reference import PROMPTS

peft = pytest.importorskip("peft")

TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a b c d e f g", "hello world, hello",
         "lorem ipsum dolor", "sit amet consectetur"]
JOBS = {"one": (["q_proj", "v_proj", "down_proj"], 0), "two": (["o_proj", "up_proj"], 1)}


def _init(path, folder, targets, seed) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
                   ).save_pretrained(folder)
    return str(folder)


def _jobs(llm: LLM, cfg: TrainConfig, steps: int) -> list[CoJob]:
    ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
    return [CoJob(LoraTrainer(llm, name, cfg, max(len(e.ids) for e in ex)), ex, steps, seed=s)
            for name, (_, s) in JOBS.items()]


def _adapters(jobs: list[CoJob]) -> dict[str, list[torch.Tensor]]:
    return {j.name: [t.detach().clone() for ab in j.trainer.params.values() for t in ab] for j in jobs}


def test_coserved_jobs_reach_their_standalone_adapters_and_inference_its_tokens(tiny, tiny_refs, tmp_path):
    path = tiny["llama"].path
    lora = {name: _init(path, tmp_path / name, targets, seed) for name, (targets, seed) in JOBS.items()}
    cfg = TrainConfig(lr=3e-2, batch_size=3, max_grad_norm=0.5)
    steps = 6
    with LLM(str(path), policy=Policy(gpu_batch_size=3), lora=lora) as llm:  # standalone, one job after the other
        alone = _jobs(llm, cfg, steps)
        CoTrainer(alone).finish()
        want = _adapters(alone)
    with LLM(str(path), policy=Policy(gpu_batch_size=2, num_gpu_batches=4), lora=lora) as llm:
        jobs = _jobs(llm, cfg, steps)
        rider = CoTrainer(jobs, batches=2)
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8, rider=rider)
        carried = {j.name: len(j.losses) for j in jobs}  # steps taken on inference blocks
        rider.finish()
        got = _adapters(jobs)
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["llama"]]
    assert all(n >= 1 for n in carried.values()), carried
    for a, b in zip(alone, jobs):
        assert len(b.losses) == steps
        for x, y in zip(a.losses, b.losses):
            assert abs(x - y) < 1e-4 * abs(x), (a.losses, b.losses)
        for x, y in zip(want[a.name], got[b.name]):
            assert float((x - y).norm()) <= 1e-3 * float(x.norm()) + 1e-6
    assert min(a.losses[-2:]) < a.losses[0] - 0.05, a.losses  # it learns


def test_coserving_needs_a_spare_gpu_batch(tiny, tmp_path):
    path = tiny["llama"].path
    lora = {"one": _init(path, tmp_path / "one", ["q_proj"], 0)}
    with LLM(str(path), policy=Policy(gpu_batch_size=2, num_gpu_batches=1), lora=lora) as llm:
        ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
        rider = CoTrainer([CoJob(LoraTrainer(llm, "one", TrainConfig(batch_size=2)), ex, 1)])
        with pytest.raises(InputError, match="raise --num-gpu-batches"):
            llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=2, rider=rider)
