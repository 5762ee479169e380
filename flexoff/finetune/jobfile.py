"""Finetuning job files for co-serving (`flexoff run --finetune JOB.yaml`).

Knows: a job file's fields (YAML or JSON, the names of `flexoff finetune`'s flags with
underscores: data, output, name, lora_r, lora_alpha, lora_targets, init_adapter, steps,
epochs, lr, batch_size, grad_accum, warmup, schedule, max_grad_norm, seed, save_every,
max_seq_len, eval_data), their checks (one-line errors naming the file and the field), and the
JobSpec they make; paths are taken as written (relative to the current directory).
Does not know: running the job (flexoff.finetune.run, flexoff.finetune.coserve).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flexoff.errors import InputError
from flexoff.finetune.run import DEFAULT_TARGETS, JobSpec, LoraSpec
from flexoff.finetune.trainer import TrainConfig

FIELDS: dict[str, type | tuple[type, ...]] = {
    "data": str, "output": str, "name": str, "lora_r": int, "lora_alpha": (int, float),
    "lora_targets": (str, list), "init_adapter": str, "steps": int, "epochs": (int, float), "lr": (int, float),
    "batch_size": int, "grad_accum": int, "warmup": int, "schedule": str, "max_grad_norm": (int, float),
    "seed": int, "save_every": int, "max_seq_len": int, "eval_data": str,
}


def read_job(path: str) -> tuple[str, JobSpec]:
    """The job's adapter name (its `name`, else the file's stem) and its spec."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"--finetune {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise InputError(f"--finetune {path}: not YAML or JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise InputError(f"--finetune {path}: a job file holds one mapping of fields (data, output, ...)")
    for key, value in doc.items():
        if key not in FIELDS:
            raise InputError(f"--finetune {path}: unknown field {key!r}; known: {', '.join(sorted(FIELDS))}")
        want = FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, want):
            names = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
            raise InputError(f"--finetune {path}: {key} must be {names}, got {value!r}")
    for key in ("data", "output"):
        if key not in doc:
            raise InputError(f"--finetune {path}: the field {key!r} is required")
    if "steps" in doc and "epochs" in doc:
        raise InputError(f"--finetune {path}: give steps or epochs, not both")
    targets = doc.get("lora_targets", DEFAULT_TARGETS)
    targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else tuple(targets)
    try:
        cfg = TrainConfig(**{"schedule": "cosine", **{k: doc[k] for k in ("lr", "batch_size", "grad_accum", "warmup",
                                                                          "schedule") if k in doc}},
                          max_grad_norm=doc.get("max_grad_norm", 1.0) or None)  # flexoff finetune's defaults
    except InputError as e:
        raise InputError(f"--finetune {path}: {e}") from None
    spec = JobSpec(doc["data"], doc["output"], LoraSpec(doc.get("lora_r", 16), doc.get("lora_alpha", 32), targets),
                   doc.get("init_adapter"), doc.get("steps"), doc.get("epochs"), cfg, doc.get("max_seq_len", 1024),
                   doc.get("seed", 0), doc.get("save_every", 10), doc.get("eval_data"))
    return doc.get("name", Path(path).stem), spec


def job_summary(name: str, losses: list[float], output: str) -> str:
    if not losses:
        return f"finetuning {name}: no steps; adapter in {output}"
    return f"finetuning {name}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; adapter in {output}"
