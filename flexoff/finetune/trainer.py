"""LoRA training steps through the engine: AdamW on one adapter's A and B, the base frozen and
streamed through the tiers by the engine's forward and reverse sweeps.

Knows: the adapter's parameters in float32 on the compute device, with AdamW's state (the
master copy; the engine's adapter pool holds them in the compute dtype and is refreshed after
every step), a step over a batch of examples
(left-padded rows, next-token labels where the example's loss mask says, the loss averaged over
the step's labelled tokens, split into as many engine blocks as the batch needs, each block's
gradients weighted by its share of the tokens), gradient clipping by global norm, AdamW with a
linear warm-up and a constant, linear or cosine schedule, and saving the adapter as a PEFT
folder that `peft.PeftModel.from_pretrained` loads.
Does not know: where examples come from (flexoff.finetune.data), checkpoints of a whole run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from flexoff.adapters.peft import write_folder
from flexoff.errors import InputError
from flexoff.finetune.data import Example
from flexoff.generation import pad_left
from flexoff.offload.block import IGNORE, BatchInput


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 2e-4
    batch_size: int = 8  # examples per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step (their tokens share one mean loss)
    max_grad_norm: float | None = 1.0  # clip the adapter's gradient to this global norm (None: no clipping)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup: int = 0  # steps of linear warm-up
    schedule: str = "constant"  # after warm-up: constant, linear or cosine (to 0 at `steps`)
    steps: int = 0  # the run's length, for the linear and cosine schedules

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "linear", "cosine"):
            raise InputError(f"schedule must be constant, linear or cosine, got {self.schedule!r}")
        if not self.lr > 0 or self.batch_size < 1 or self.grad_accum < 1 or self.warmup < 0:
            raise InputError("lr must be > 0, batch_size and grad_accum >= 1 and warmup >= 0")

    @property
    def per_step(self) -> int:
        """Examples per optimizer step."""
        return self.batch_size * self.grad_accum


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate's factor at a step (counted from 0)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.schedule == "constant" or cfg.steps <= cfg.warmup:
        return 1.0
    done = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return 1.0 - done if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * done))


def labelled(examples: Sequence[Example]) -> int:
    """Tokens that carry a loss (each example's first token never does: nothing predicts it)."""
    return sum(sum(e.loss[1:]) for e in examples)


def batch_input(examples: Sequence[Example], adapter: str, length: int | None = None) -> BatchInput:
    """Rows left-padded to `length` (default: the longest) with next-token labels where the loss
    mask says, all on one adapter."""
    S = length or max(len(e.ids) for e in examples)
    inp = pad_left([e.ids for e in examples], S)
    labels = torch.full_like(inp.ids, IGNORE)
    for r, e in enumerate(examples):  # a tensor op per row (one per token took 37 ms a step of 8 x 512)
        n = len(e.ids)
        nxt = torch.tensor(e.ids[1:], dtype=torch.long)
        labels[r, S - n:S - 1] = torch.where(torch.tensor(e.loss[1:], dtype=torch.bool), nxt, IGNORE)
    inp.labels, inp.adapters = labels, [adapter] * len(examples)
    return inp


class LoraTrainer:
    """Trains the loaded adapter `name` of an LLM in place."""

    def __init__(self, llm: Any, name: str, cfg: TrainConfig, max_len: int = 0):
        """max_len: the longest example the run will step on, if known: the engine (and an
        automatic policy) is sized for it once instead of growing with the steps."""
        if name not in llm.adapters:
            raise InputError(f"no adapter {name!r} is loaded to train")
        self.llm, self.name, self.cfg, self.max_len = llm, name, cfg, max_len
        self.adapter = llm.adapters[name]
        self.params: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        dev = llm.device  # the master weights and AdamW's state live beside the compute
        for key, m in sorted(self.adapter.hold().items()):  # values in memory from now on
            m.A = m.A.detach().to(dev, torch.float32, copy=True).requires_grad_(True)
            m.B = m.B.detach().to(dev, torch.float32, copy=True).requires_grad_(True)
            self.params[key] = (m.A, m.B)
        flat = [t for ab in self.params.values() for t in ab]
        self.opt = torch.optim.AdamW(flat, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                     fused=True)  # one kernel for all the adapter's tensors
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(cfg, s))
        self.steps_done = 0
        # the step being gathered: A, B of each key in turn, views of one float32 buffer (zeroed
        # with one kernel per step, added into with one foreach call per block)
        self._flat = torch.empty(sum(t.numel() for t in flat), dtype=torch.float32, device=dev)
        self._grads = [v.view_as(t) for v, t in zip(torch.split(self._flat, [t.numel() for t in flat]), flat)]
        self._gathering = False  # a step has gradients in the buffer
        self._loss = 0.0
        self.last_lr = cfg.lr

    def step(self, examples: Sequence[Example]) -> float:
        """One optimizer step on these examples; the step's mean loss before the update."""
        self.gather(examples, labelled(examples))
        return self.apply()

    def gather(self, examples: Sequence[Example], tokens: int) -> None:
        """Run these examples through the engine (as many blocks as they need) and gather their
        gradients and loss into the step, as parts of a step of `tokens` labelled tokens."""
        llm = self.llm
        max_len = max(self.max_len, *(len(e.ids) for e in examples))
        rows = min(len(examples), self._planned_rows())
        policy = llm.choose_policy_for_training(rows, max_len, self.name)
        llm.last_policy = policy
        pool = llm.adapter_pool()
        engine = llm.engine_for(policy, max_len, 1, training=True, need=pool.need([[self.name]]))
        engine.adapters = pool
        gbs, per_block = policy.gpu_batch_size, min(policy.block_size, rows)
        for b0 in range(0, len(examples), per_block):
            chunk = examples[b0:b0 + per_block]
            S = max(len(e.ids) for e in chunk)  # one padded length for the block's GPU batches
            res = engine.run_train([batch_input(chunk[i:i + gbs], self.name, S) for i in range(0, len(chunk), gbs)])
            # this block's losses were averaged over its own tokens
            self.accumulate(res.lora_grads, res.loss, res.tokens / tokens)

    def _planned_rows(self) -> int:
        """Sequences a block may take: under --policy auto the whole optimizer step's (its
        micro-batches share each pair of weight sweeps where the searched block, which fits the
        memory budget, holds them); else a micro-batch's, as the policy given or the default
        one is sized."""
        return self.cfg.per_step if self.llm.policy_arg == "auto" else self.cfg.batch_size

    def accumulate(self, lora_grads: dict[tuple[int, str], dict[str, list[torch.Tensor]]], loss: float,
                   weight: float) -> None:
        """Add a block's gradients (the engine's, for this adapter) and loss, times `weight`, to
        the step being gathered."""
        if not self._gathering:
            self._flat.zero_()
            self._gathering = True
        into, got = [], []
        for n, key in enumerate(self.params):
            per = lora_grads.get(key, {}).get(self.name)  # d loss / d (A, B transposed)
            if per is not None:
                into += self._grads[2 * n:2 * n + 2]
                got += [per[0], per[1].t()]  # float32 sums of the compute dtype's gradients
        if got:
            torch._foreach_add_(into, got, alpha=weight)
        self._loss += loss * weight

    def apply(self) -> float:
        """The optimizer step on the gathered gradients; the step's loss."""
        assert self._gathering, "no gradients gathered for this step"
        for n, (a, b) in enumerate(self.params.values()):
            a.grad, b.grad = self._grads[2 * n], self._grads[2 * n + 1]
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([t for ab in self.params.values() for t in ab], self.cfg.max_grad_norm)
        self.last_lr = self.opt.param_groups[0]["lr"]  # the rate this step used
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.llm.adapter_pool().refresh(self.name)  # the device copies follow the master weights
        self.steps_done += 1
        loss, self._gathering, self._loss = self._loss, False, 0.0
        return loss

    def eval_loss(self, examples: Sequence[Example]) -> float:
        """The adapter's mean loss over the labelled tokens of these examples (no update): the
        log-probabilities of the inference path, through the same adapter."""
        prompts = [{"id": str(n), "prompt_ids": e.ids, "adapter": self.name} for n, e in enumerate(examples)]
        policy = self.llm.choose_policy_for_training(self._planned_rows(), self.max_len, self.name) \
            if self.llm.policy_arg == "auto" else None  # the training engine's, not a search for inference
        out = self.llm.generate(prompts, max_new_tokens=0, prompt_logprobs=True, policy=policy).completions
        total = count = 0.0
        for e, c in zip(examples, out):
            for t in range(1, len(e.ids)):
                if e.loss[t]:
                    total -= c.prompt_logprobs[t - 1]
                    count += 1
        return total / max(1.0, count)

    def state(self) -> dict[str, Any]:
        """Everything a later run needs to continue: the adapter, the optimizer and the schedule."""
        params = {f"{j}:{n}": (a.detach().to("cpu", copy=True), b.detach().to("cpu", copy=True)) for (j, n), (a, b) in self.params.items()}
        return {"params": params, "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "steps": self.steps_done}

    def load_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for (j, n), (a, b) in self.params.items():
                sa, sb = state["params"][f"{j}:{n}"]
                a.copy_(sa)
                b.copy_(sb)
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.steps_done = state["steps"]
        self.llm.adapter_pool().refresh(self.name)

    def save(self, folder: str, base_config: dict[str, Any] | None = None) -> None:
        """The adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors)."""
        cfg = base_config or json.loads((Path(self.adapter.path) / "adapter_config.json").read_text())
        write_folder(folder, self.llm.model.spec, self.adapter.modules, cfg)
