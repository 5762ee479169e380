"""A finetuning run: a new or given LoRA adapter trained on a JSONL file for some steps.

Knows: making a fresh adapter folder as PEFT initialises one (A Kaiming-uniform, B zero; its
adapter_config.json in PEFT's format), the data order (shuffled by the seed, epoch by epoch),
the progress bar (loss, tokens/s), the metrics file beside the adapter (one JSON line per step:
step, loss, lr, tokens, seconds), and writing the adapter at the end.
Checkpoints (every few steps, written atomically: adapter, optimizer and schedule state, data
order and position, metrics) let a rerun of the same command continue a killed run and end
with the same adapter; a checkpoint of other data or settings is refused. A job (JobSpec) runs
as a FinetuneJob around a co-serving CoJob, alone (`flexoff finetune`) or riding on inference
blocks (`flexoff run --finetune`).
Does not know: the step's math (flexoff.finetune.trainer), how steps are gathered
(flexoff.finetune.coserve).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from flexoff.errors import InputError
from flexoff.finetune.coserve import CoJob, CoTrainer
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


def linear_targets(spec: Any) -> list[str]:
    """The module names (the last part, as PEFT's target_modules) of every linear layer LoRA may
    adapt in this model."""
    return sorted({t.hf_names[0].rsplit(".", 2)[-2] for l in spec.layers if l.kind in ("attn", "mlp")
                   for t in l.tensors if t.matmul})


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


@dataclass
class JobSpec:
    """One finetuning job as `flexoff finetune`'s flags (or a co-serving job file) give it."""
    data: str
    output: str
    lora: LoraSpec | None = None  # a fresh adapter's shape (None: LoraSpec's defaults)
    init_adapter: str | None = None  # or start from this PEFT folder
    steps: int | None = None
    epochs: float | None = None
    cfg: TrainConfig = field(default_factory=TrainConfig)
    max_seq_len: int = 1024
    seed: int = 0
    save_every: int = 10
    eval_data: str | None = None


def finetune(llm: Any, data: str, output: str, *, lora: LoraSpec | None = None, init_adapter: str | None = None,
             steps: int | None = None, epochs: float | None = None, cfg: TrainConfig = TrainConfig(),
             max_seq_len: int = 1024, seed: int = 0, progress: bool = True, save_every: int = 10,
             eval_data: str | None = None) -> list[float]:
    """Train a LoRA adapter of llm's model on a JSONL file; the PEFT folder lands in `output`,
    with a checkpoint every `save_every` steps that the same call continues after a kill (and the
    loss on `eval_data`, if given, then and at the end). Returns the loss of every step."""
    spec = JobSpec(data, output, lora, init_adapter, steps, epochs, cfg, max_seq_len, seed, save_every, eval_data)
    with FinetuneJob(llm, spec, progress=progress) as job:
        CoTrainer([job.job]).finish()
        return job.job.losses


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


class FinetuneJob:
    """A finetuning job's run around its CoJob: the adapter loaded under `name` (fresh, or the
    given one), the output folder's lock, its checkpoint continued, and after every step the
    metrics line, the progress bar, the eval loss and the checkpoint; the adapter saved when the
    job's steps are all done. A context manager."""

    def __init__(self, llm: Any, spec: JobSpec, name: str = "__training__", progress: bool = True,
                 position: int = 0):
        self.llm, self.spec, self.name = llm, spec, name
        max_len = min(spec.max_seq_len, llm.model.spec.max_positions)
        examples = read_examples(spec.data, llm.tokenizer, max_len)
        self.evals = read_examples(spec.eval_data, llm.tokenizer, max_len) if spec.eval_data is not None else None
        per_epoch = math.ceil(len(examples) / spec.cfg.per_step)
        total = spec.steps if spec.steps is not None else max(1, round((spec.epochs or 1.0) * per_epoch))
        cfg = TrainConfig(**{**spec.cfg.__dict__, "steps": total})
        self.out = Path(spec.output)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lock = OutputLock(str(self.out))  # one run per output folder
        self.lock.__enter__()
        self.made: Path | None = None
        self.metrics: list[dict[str, Any]] = []
        try:
            init = spec.init_adapter
            if init is None:  # a fresh adapter, in a folder kept until the result is saved
                self.made = Path(tempfile.mkdtemp(prefix="flexoff-lora-"))
                new_adapter(llm.model.spec, spec.lora or LoraSpec(), self.made, spec.seed)
                init = str(self.made)
            self.fingerprint = _fingerprint(spec.data, spec.init_adapter, spec.lora if self.made else None, cfg,
                                            total, spec.seed, spec.max_seq_len)
            llm.load_lora(name, init)
            trainer = LoraTrainer(llm, name, cfg, max(len(e.ids) for e in examples))
            self.job = CoJob(trainer, examples, total, spec.seed, on_step=self._after_step)
            ckpt = self.out / CHECKPOINT
            if ckpt.exists():  # a rerun: continue where the last checkpoint left off
                state = torch.load(ckpt, map_location="cpu", weights_only=False)
                if state.get("fingerprint") != self.fingerprint:
                    raise InputError(f"{self.out} holds a checkpoint of another run (other data or settings); "
                                     "use another output folder or remove it")
                trainer.load_state(state["trainer"])
                self.job.load_state(state["job"])
                self.metrics = state["metrics"]
            self.mf = open(self.out / "metrics.jsonl", "w", encoding="utf-8")
            self.mf.writelines(json.dumps(m) + "\n" for m in self.metrics)  # the steps the checkpoint holds
            self.mf.flush()
            self.bar = tqdm(total=total, initial=len(self.job.losses), desc=f"finetuning {self.out.name}",
                            unit="step", disable=not progress, position=position)
        except BaseException:
            self._release()
            raise
        self.t0 = time.perf_counter()

    def _after_step(self, job: CoJob, examples: Sequence[Any]) -> None:
        """A step is done: its metrics line, the bar, and at every save_every steps (and the last)
        the eval loss and the checkpoint."""
        now = time.perf_counter()
        dt, self.t0 = now - self.t0, now
        step, loss = len(job.losses), job.losses[-1]
        tokens = sum(len(e.ids) for e in examples)
        m = {"step": step, "loss": loss, "lr": job.trainer.last_lr, "tokens": tokens, "seconds": dt}
        saving = step % self.spec.save_every == 0 or job.finished
        if saving and self.evals:
            m["eval_loss"] = job.trainer.eval_loss(self.evals)
        self.metrics.append(m)
        self.mf.write(json.dumps(m) + "\n")
        self.mf.flush()
        self.bar.update(1)
        ev = f", eval {m['eval_loss']:.4f}" if "eval_loss" in m else ""
        self.bar.set_postfix_str(f"loss {loss:.4f}{ev}, {tokens / max(dt, 1e-9):.0f} tok/s")
        if saving:
            _write_atomic(self.out / CHECKPOINT, {"fingerprint": self.fingerprint, "trainer": job.trainer.state(),
                                                 "job": job.state(), "metrics": self.metrics})

    def __enter__(self) -> "FinetuneJob":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None and self.job.finished:
                self.job.trainer.save(str(self.out))
        finally:
            self._release()

    def _release(self) -> None:
        for closer in (getattr(self, "bar", None), getattr(self, "mf", None)):
            if closer is not None:
                closer.close()
        self.lock.__exit__(None, None, None)
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)
