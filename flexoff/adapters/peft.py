"""Hugging Face PEFT LoRA folders: reading them and checking them against a base model.

Knows: the folder (`adapter_config.json` with `adapter_model.safetensors`, or a pickled
`adapter_model.bin` only where allowed, loaded with weights_only), the LoRA fields that change
the math (`r`, `lora_alpha`, `use_rslora`, `rank_pattern`, `alpha_pattern` matched as PEFT
matches them, `fan_in_fan_out`, which PEFT turns off for linear layers), which weights map to
which of the base model's matmul tensors (by their Hugging Face module names), and what is not
supported (DoRA, `modules_to_save`, embedding or head LoRA, LoRA biases, other PEFT types,
another base model's shapes): each refused in one line naming the adapter and the field.
Does not know: where adapters live or how deltas are computed (flexoff.offload.adapters).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from flexoff.errors import InputError
from flexoff.models.spec import ModelSpec

PREFIX = "base_model.model."
REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "lora_bias": "LoRA biases",
           "layer_replication": "layer_replication", "target_parameters": "target_parameters",
           "trainable_token_indices": "trainable token indices", "use_qalora": "QA-LoRA",
           "alora_invocation_tokens": "activated LoRA"}


@dataclass
class LoraModule:
    """One adapted matmul: delta = scaling * (x @ A.T) @ B.T."""
    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r)
    scaling: float


@dataclass
class Adapter:
    name: str
    path: str
    modules: dict[tuple[int, str], LoraModule]  # (engine layer, tensor name such as "q_proj.weight") -> LoRA

    @property
    def numel(self) -> int:
        """Values the adapter holds (A and B of every module), whatever dtype they are kept in."""
        return sum(m.A.numel() + m.B.numel() for m in self.modules.values())


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(name: str, path: str, spec: ModelSpec, allow_pickle: bool = False) -> Adapter:
    """Read and check a PEFT LoRA folder for this base model."""
    where = f"adapter {name!r} ({path})"
    folder = Path(path)
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise InputError(f"{where}: no adapter_config.json (is it a PEFT adapter folder?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{where}: cannot read adapter_config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{where}: adapter_config.json must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for key, what in REFUSED.items():
        if cfg.get(key):
            raise InputError(f"{where}: {key} ({what}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise InputError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    if not (isinstance(r, int) and r >= 1) or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise InputError(f"{where}: r must be a positive integer and lora_alpha a number")
    tensors = _read_weights(folder, where, allow_pickle)
    targets = {}  # Hugging Face module name -> (engine layer, tensor name, shape)
    for j, layer in enumerate(spec.layers):
        for t in layer.tensors:
            if t.matmul:
                targets[t.hf_names[0][:-len(".weight")]] = (j, t.name, t.shape, layer.kind)
    embedding = sorted(k for k in tensors if "lora_embedding" in k)
    if embedding:
        raise InputError(f"{where}: embedding LoRA ({embedding[0]}) is not supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if not m:
            what = "embedding LoRA" if "lora_embedding" in key else "a weight that is not LoRA A or B"
            raise InputError(f"{where}: {key} is {what}; not supported")
        pairs.setdefault(m.group(1), {})[m.group(2)] = value
    modules: dict[tuple[int, str], LoraModule] = {}
    for module, ab in pairs.items():
        if module not in targets:
            raise InputError(f"{where}: {module} is not a linear layer of this base model")
        j, tname, (out_f, in_f), kind = targets[module]
        if kind in ("embed", "head"):
            raise InputError(f"{where}: LoRA on {module} (the {kind}) is not supported")
        if set(ab) != {"A", "B"}:
            raise InputError(f"{where}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        A, B = ab["A"], ab["B"]
        rank = A.shape[0]
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != in_f or B.shape != (out_f, rank):
            raise InputError(f"{where}: {module} has shapes A {tuple(A.shape)}, B {tuple(B.shape)}; this base model "
                             f"needs A (r, {in_f}) and B ({out_f}, r): an adapter of another base model?")
        want_r = _pattern_value(cfg.get("rank_pattern") or {}, module, r)
        if want_r != rank:
            raise InputError(f"{where}: {module} has rank {rank} but the config says r = {want_r}")
        a = _pattern_value(cfg.get("alpha_pattern") or {}, module, alpha)
        scaling = a / math.sqrt(rank) if cfg.get("use_rslora") else a / rank
        modules[(j, tname)] = LoraModule(A.float(), B.float(), float(scaling))
    if not modules:
        raise InputError(f"{where}: holds no LoRA weights")
    return Adapter(name, str(folder), modules)


def _read_weights(folder: Path, where: str, allow_pickle: bool) -> dict[str, torch.Tensor]:
    st, pkl = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pkl.exists():
            if not allow_pickle:
                raise InputError(f"{where}: holds only a pickled adapter_model.bin; pass --allow-pickle to load it "
                                 "with torch.load(weights_only=True)")
            return torch.load(str(pkl), map_location="cpu", weights_only=True)
    except InputError:
        raise
    except Exception as e:  # a corrupt file: safetensors and torch raise their own types
        raise InputError(f"{where}: cannot read its weights ({str(e).splitlines()[0]})") from None
    raise InputError(f"{where}: no adapter_model.safetensors")
