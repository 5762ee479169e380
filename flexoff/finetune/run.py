"""A finetuning run: a new or given LoRA adapter trained on a JSONL file for some steps.

Knows: making a fresh adapter folder as PEFT initialises one (A Kaiming-uniform, B zero; its
adapter_config.json in PEFT's format), the data order (shuffled by the seed, epoch by epoch),
the progress bar (loss, tokens/s), the metrics file beside the adapter (one JSON line per step:
step, loss, lr, tokens, seconds), and writing the adapter at the end.
Checkpoints (every few steps, written atomically: adapter, optimizer and schedule state, data
order and position, metrics) let a rerun of the same command continue a killed run and end
with the same adapter; a checkpoint of other data or settings is refused.
Does not know: the step's math (flexoff.finetune.trainer).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from flexoff.errors import InputError
from flexoff.finetune.data import read_examples
from flexoff.finetune.trainer import LoraTrainer, TrainConfig
from flexoff.lock import OutputLock

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj",
                   "fc1", "fc2")


@dataclass
class LoraSpec:
    r: int = 16
    alpha: float = 32
    targets: Sequence[str] = DEFAULT_TARGETS  # module names (the last part), as PEFT's target_modules


def new_adapter(spec: Any, lora: LoraSpec, folder: Path, seed: int) -> None:
    """A fresh PEFT LoRA folder for this model: A as nn.Linear initialises a weight (Kaiming
    uniform, a = sqrt(5)), B zero, so training starts from the base model."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors, targets = {}, set()
    for layer in spec.layers:
        if layer.kind not in ("attn", "mlp"):
            continue
        for t in layer.tensors:
            module = t.hf_names[0][:-len(".weight")]
            if not t.matmul or module.rsplit(".", 1)[-1] not in lora.targets:
                continue
            targets.add(module.rsplit(".", 1)[-1])
            out_f, in_f = t.shape
            bound = 1 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on (r, in)
            a = (torch.rand(lora.r, in_f, generator=g) * 2 - 1) * bound
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(out_f, lora.r)
    if not tensors:
        raise InputError(f"--lora-targets {','.join(lora.targets)} names no linear layer of this model")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": lora.r, "lora_alpha": lora.alpha, "target_modules": sorted(targets),
           "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "fan_in_fan_out": False, "task_type": "CAUSAL_LM",
           "inference_mode": True}
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))


def finetune(llm: Any, data: str, output: str, *, lora: LoraSpec | None = None, init_adapter: str | None = None,
             steps: int | None = None, epochs: float | None = None, cfg: TrainConfig = TrainConfig(),
             max_seq_len: int = 1024, seed: int = 0, progress: bool = True, save_every: int = 10,
             eval_data: str | None = None) -> list[float]:
    """Train a LoRA adapter of llm's model on a JSONL file; the PEFT folder lands in `output`,
    with a checkpoint every `save_every` steps that the same call continues after a kill (and the
    loss on `eval_data`, if given, then and at the end). Returns the loss of every step."""
    max_len = min(max_seq_len, llm.model.spec.max_positions)
    examples = read_examples(data, llm.tokenizer, max_len)
    evals = read_examples(eval_data, llm.tokenizer, max_len) if eval_data is not None else None
    per_epoch = math.ceil(len(examples) / cfg.per_step)
    total = steps if steps is not None else max(1, round((epochs or 1.0) * per_epoch))
    cfg = TrainConfig(**{**cfg.__dict__, "steps": total})
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    made = None
    if init_adapter is None:  # a fresh adapter, in a folder kept until the result is saved
        made = Path(tempfile.mkdtemp(prefix="flexoff-lora-"))
        new_adapter(llm.model.spec, lora or LoraSpec(), made, seed)
        init_adapter = str(made)
    fingerprint = _fingerprint(data, init_adapter if made is None else None, lora if made is not None else None,
                               cfg, total, seed, max_seq_len)
    try:
        with OutputLock(str(out)):  # one run per output folder
            return _train(llm, examples, init_adapter, out, cfg, total, seed, progress, save_every, fingerprint,
                          evals)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


CHECKPOINT = "checkpoint.pt"


def _fingerprint(data: str, init_adapter: str | None, lora: LoraSpec | None, cfg: TrainConfig, total: int,
                 seed: int, max_seq_len: int) -> str:
    """What a checkpoint must have been written by for a rerun to continue it."""
    h = hashlib.sha256(Path(data).read_bytes())
    h.update(json.dumps([init_adapter, lora and [lora.r, lora.alpha, list(lora.targets)], cfg.__dict__, total, seed,
                         max_seq_len], default=str).encode())
    return h.hexdigest()


def _write_atomic(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary file, fsync, rename over the old one, fsync the folder: a kill at
    any point leaves the last complete checkpoint."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _train(llm: Any, examples: list[Any], init_adapter: str, out: Path, cfg: TrainConfig, total: int, seed: int,
           progress: bool, save_every: int, fingerprint: str, evals: list[Any] | None = None) -> list[float]:
    llm.load_lora("__training__", init_adapter)
    trainer = LoraTrainer(llm, "__training__", cfg, max(len(e.ids) for e in examples))
    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    metrics: list[dict[str, Any]] = []
    start = 0
    ckpt = out / CHECKPOINT
    if ckpt.exists():  # a rerun: continue where the last checkpoint left off
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state.get("fingerprint") != fingerprint:
            raise InputError(f"{out} holds a checkpoint of another run (other data or settings); "
                             "use another --output or remove it")
        trainer.load_state(state["trainer"])
        rng.setstate(state["rng"])
        order, losses, metrics, start = state["order"], state["losses"], state["metrics"], state["step"]
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as mf, \
            tqdm(total=total, initial=start, desc="finetuning", unit="step", disable=not progress) as bar:
        mf.writelines(json.dumps(m) + "\n" for m in metrics)  # the steps the checkpoint holds
        mf.flush()
        for step in range(start, total):
            while len(order) < cfg.per_step:  # epochs of the data, each in a new shuffled order
                epoch = list(range(len(examples)))
                rng.shuffle(epoch)
                order += epoch
            batch = [examples[i] for i in order[:cfg.per_step]]
            del order[:cfg.per_step]
            t0 = time.perf_counter()
            lr = trainer.opt.param_groups[0]["lr"]
            loss = trainer.step(batch)
            dt = time.perf_counter() - t0
            tokens = sum(len(e.ids) for e in batch)
            losses.append(loss)
            metrics.append({"step": step + 1, "loss": loss, "lr": lr, "tokens": tokens, "seconds": dt})
            saving = (step + 1) % save_every == 0 or step + 1 == total
            if saving and evals:
                metrics[-1]["eval_loss"] = trainer.eval_loss(evals)
            mf.write(json.dumps(metrics[-1]) + "\n")
            mf.flush()
            bar.update(1)
            ev = f", eval {metrics[-1]['eval_loss']:.4f}" if "eval_loss" in metrics[-1] else ""
            bar.set_postfix_str(f"loss {loss:.4f}{ev}, {tokens / dt:.0f} tok/s")
            if saving:
                _write_atomic(ckpt, {"fingerprint": fingerprint, "step": step + 1, "trainer": trainer.state(),
                                     "rng": rng.getstate(), "order": order, "losses": losses, "metrics": metrics})
    trainer.save(str(out))
    return losses
