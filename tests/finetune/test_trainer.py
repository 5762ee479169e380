"""LoRA finetuning through the engine against PEFT + torch.optim.AdamW on the same batches: losses
equal step by step (a step in one engine block, or split over two with the weights in CPU
memory), and the saved folder loads in PEFT with the same outputs; loss masks of the three data
shapes against hand-made ones."""

from __future__ import annotations

import json

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.errors import InputError
from flexoff.finetune import LoraTrainer, TrainConfig, to_example
from flexoff.finetune.trainer import batch_input
from flexoff.offload.block import IGNORE
from reference import peft_losses

peft = pytest.importorskip("peft")

TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a b c d e f g", "hello world, hello",
         "lorem ipsum dolor", "sit amet consectetur"]


@pytest.mark.parametrize("policy", [Policy(gpu_batch_size=2, num_gpu_batches=2),
                                    Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=100)],
                         ids=["one-block", "two-blocks-offloaded"])
def test_adamw_steps_equal_peft_step_by_step(tiny, tmp_path, policy):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny["llama"].path
    torch.manual_seed(0)
    init = tmp_path / "init"  # PEFT's own initialisation: A random, B zero
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj", "down_proj"])).save_pretrained(init)
    cfg = TrainConfig(lr=5e-3, batch_size=4, max_grad_norm=0.5)
    steps = 12
    with LLM(str(path), policy=policy, lora={"mine": str(init)}) as llm:
        ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
        groups = [ex[0:4], ex[2:6]]
        trainer = LoraTrainer(llm, "mine", cfg)
        ours = [trainer.step(groups[s % 2]) for s in range(steps)]
        trainer.save(str(tmp_path / "out"))
        prompts = [{"prompt_ids": e.ids, "adapter": "mine"} for e in ex[:3]]
        lps = [c.prompt_logprobs for c in llm.generate(prompts, max_new_tokens=0, prompt_logprobs=True).completions]
    want, model = peft_losses(path, str(init), [batch_input(g, "mine") for g in groups], cfg, steps)
    assert ours[0] > ours[-1] + 0.1  # it learns
    for a, b in zip(ours, want):
        assert abs(a - b) < 1e-4 * abs(b), (ours, want)
    from peft import PeftModel

    saved = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path).float(), str(tmp_path / "out")).eval()
    with torch.no_grad():
        for e, lp in zip(ex[:3], lps):
            ref = saved(torch.tensor([e.ids])).logits[0, :-1].log_softmax(-1)
            ref = ref.gather(1, torch.tensor(e.ids[1:])[:, None])[:, 0]
            assert torch.allclose(torch.tensor(lp), ref, atol=1e-4)
    trained = dict(model.named_parameters())
    mine = dict(saved.named_parameters())
    for name, p in mine.items():  # Adam normalizes each step: near-zero gradients' float noise moves
        if "lora_" in name:        # single elements by up to lr, so compare whole tensors
            assert float((p - trained[name]).norm() / trained[name].norm()) < 1e-2, name


def test_loss_masks_of_the_three_shapes(tiny, tmp_path):
    from flexoff.tokenizer import ByteTokenizer

    tok = ByteTokenizer(512)
    text = to_example({"text": "abcd"}, tok, "x", 99)
    assert text.ids == tok.encode("abcd") and text.loss == [False] + [True] * (len(text.ids) - 1)
    pc = to_example({"prompt": "ab", "completion": "cd"}, tok, "x", 99)
    n = len(tok.encode("ab"))
    assert pc.ids == tok.encode("abcd") and pc.loss == [False] * n + [True] * (len(pc.ids) - n)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "ok"}, {"role": "assistant", "content": "k"}]
    chat = to_example({"messages": msgs}, tok, "x", 999)
    cuts = [len(tok.chat(msgs[:i], generation_prompt=False)) if i else 1 for i in range(5)]  # 1: the BOS
    want = [False] * len(chat.ids)
    for i in (1, 3):  # the assistant turns' tokens
        want[cuts[i]:cuts[i + 1]] = [True] * (cuts[i + 1] - cuts[i])
    assert chat.ids == tok.chat(msgs, generation_prompt=False) and chat.loss == want
    for bad in ({"text": ""}, {"prompt": "a"}, {"messages": [{"role": "user", "content": "x"}]}, {"txt": "a"}, [1]):
        with pytest.raises(InputError):
            to_example(bad, tok, "f line 1", 99)
    row = batch_input([pc], "a")
    assert row.labels[0].tolist() == [IGNORE] * (n - 1) + pc.ids[n:] + [IGNORE]


def test_gradient_accumulation_equals_one_large_batch_in_peft(tiny, tmp_path):
    """Two micro-batches of two per optimizer step: PEFT's losses on batches of four (one mean
    over all the step's tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny["llama"].path
    torch.manual_seed(1)
    init = tmp_path / "init"
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "o_proj", "up_proj"])).save_pretrained(init)
    cfg = TrainConfig(lr=5e-3, batch_size=2, grad_accum=2, max_grad_norm=0.5)
    with LLM(str(path), policy=Policy(gpu_batch_size=2), lora={"mine": str(init)}) as llm:
        ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
        groups = [ex[0:4], ex[2:6]]
        trainer = LoraTrainer(llm, "mine", cfg)
        ours = [trainer.step(groups[s % 2]) for s in range(6)]
    want, _ = peft_losses(path, str(init), [batch_input(g, "mine") for g in groups], cfg, 6)
    for a, b in zip(ours, want):
        assert abs(a - b) < 1e-4 * abs(b), (ours, want)


def test_llm_finetune_with_eval_data_reports_peft_eval_loss(tiny, tmp_path):
    """LLM.finetune on records: metrics carry the eval loss at each checkpoint, and the last one
    equals PEFT's mean token loss on the eval records with the saved adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny["llama"].path
    train = [{"text": t} for t in TEXTS]
    evals = [{"prompt": "hello", "completion": " world, hello"}, {"text": "the lazy dog jumps"}]
    with LLM(str(path), policy=Policy(gpu_batch_size=3)) as llm:
        losses = llm.finetune(train, str(tmp_path / "out"), {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
                              steps=4, config=TrainConfig(lr=1e-2, batch_size=3), eval_data=evals, save_every=2)
        exs = [to_example(e, llm.tokenizer, "e", 64) for e in evals]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and [m["step"] for m in metrics if "eval_loss" in m] == [2, 4]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path).float(), str(tmp_path / "out"))
    total = count = 0.0
    with torch.no_grad():
        for e in exs:
            lp = model(torch.tensor([e.ids])).logits[0, :-1].log_softmax(-1)
            for t in range(1, len(e.ids)):
                if e.loss[t]:
                    total -= float(lp[t - 1, e.ids[t]])
                    count += 1
    assert abs(metrics[-1]["eval_loss"] - total / count) < 1e-4
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["target_modules"] == ["q_proj"]


def _peft_init(path, folder, targets, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
                   ).save_pretrained(folder)
    return str(folder)


def _streaming_budget(path, tmp_path):
    """The H200 profile as a CPU device's (saved under tmp_path), and a "GPU" budget that holds
    three quarters of the model's weights and the work of four sequences of 16 tokens."""
    from flexoff.checkpoint import load_model
    from flexoff.policy.hardware import h200, save

    hw = h200()
    profile = tmp_path / "hw.json"
    save(hw.__class__(**{**hw.__dict__, "device": "cpu", "name": "test"}), profile)
    s = load_model(str(path)).spec
    return profile, s.weight_bytes(4) * 3 // 4 + s.working_bytes(4, 16, 4, "cpu")


@pytest.mark.parametrize("batch,accum", [(4, 1), (2, 2)])
def test_policy_auto_plans_an_offloaded_training_step_and_equals_peft(tiny, tmp_path, monkeypatch, batch, accum):
    """--policy auto for training under a small "GPU" budget: the searched policy streams part of
    the weights and places the stash off the compute tier, and the steps still equal PEFT's
    batches of four; the eval on the training engine needs no second search. With gradient
    accumulation (two micro-batches of two) the search plans the block for the whole step, whose
    four sequences run through one pair of weight sweeps (one engine call), not one per micro-batch."""
    from flexoff.offload.engine import Engine

    path = tiny["llama"].path
    init = _peft_init(path, tmp_path / "init", ["q_proj", "v_proj", "down_proj"], 0)
    profile, gpu_mem = _streaming_budget(path, tmp_path)
    rows: list[int] = []
    run_train = Engine.run_train
    monkeypatch.setattr(Engine, "run_train", lambda self, batches: rows.append(sum(len(b.ids) for b in batches))
                        or run_train(self, batches))
    cfg = TrainConfig(lr=5e-3, batch_size=batch, grad_accum=accum, max_grad_norm=0.5)
    with LLM(str(path), policy="auto", hardware=str(profile), gpu_mem=gpu_mem, cpu_mem=1 << 30,
             lora={"mine": init}) as llm:
        ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
        groups = [ex[0:4], ex[2:6]]
        trainer = LoraTrainer(llm, "mine", cfg, max(len(e.ids) for e in ex))
        ours = [trainer.step(groups[s % 2]) for s in range(8)]
        policy, engine = llm.last_policy, llm.engine
        trainer.eval_loss(ex[:2])
        assert llm.engine is engine  # evaluated on the training engine
    assert policy.w_gpu_percent < 100 and policy.stash_gpu_percent < 100 and llm.training_prediction is not None
    assert rows == [4] * 8, (rows, policy.describe())
    want, _ = peft_losses(path, init, [batch_input(g, "mine") for g in groups], cfg, 8)
    for a, b in zip(ours, want):
        assert abs(a - b) < 1e-4 * abs(b), (policy.describe(), ours, want)


def test_four_bit_base_trains_as_peft_on_the_dequantized_weights(tiny, tmp_path):
    """QLoRA-style: with --compress-weight the frozen base is the 4-bit one; the steps equal PEFT
    training on a model whose matmul weights are replaced by their 4-bit round trip (quant's
    reference quantizer), and differ from training on the 16-bit base."""
    from transformers import AutoModelForCausalLM

    from flexoff.checkpoint import load_model
    from flexoff.quant.format import dequantize, quantize
    from flexoff.quant.sizes import compresses, weight_config

    path = tiny["llama"].path
    init = _peft_init(path, tmp_path / "init", ["q_proj", "o_proj", "up_proj", "down_proj"], 2)
    cfg = TrainConfig(lr=5e-3, batch_size=3, max_grad_norm=0.5)
    with LLM(str(path), policy=Policy(gpu_batch_size=3, w_gpu_percent=0, w_cpu_percent=100, compress_weight=True),
             lora={"mine": init}) as llm:
        ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
        groups = [ex[0:3], ex[3:6]]
        trainer = LoraTrainer(llm, "mine", cfg)
        ours = [trainer.step(groups[s % 2]) for s in range(6)]
    spec = load_model(str(path)).spec
    qcfg = weight_config(4, 64)
    model = AutoModelForCausalLM.from_pretrained(path).float()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in spec.layers:
            for t in layer.tensors:
                if compresses(t):
                    w = params[t.hf_names[0]]
                    w.copy_(dequantize(quantize(w.data, qcfg)).float().view_as(w))
    q_path = tmp_path / "q"
    model.save_pretrained(q_path)
    batches = [batch_input(g, "mine") for g in groups]
    want, _ = peft_losses(q_path, init, batches, cfg, 6)
    plain, _ = peft_losses(path, init, batches, cfg, 6)
    for a, b in zip(ours, want):
        assert abs(a - b) < 1e-4 * abs(b), (ours, want)
    assert max(abs(a - b) for a, b in zip(ours, plain)) > 1e-3  # the 4-bit base is not the 16-bit one
