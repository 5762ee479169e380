"""Hugging Face PEFT LoRA folders: reading them and checking them against a base model.

Knows: the folder (`adapter_config.json` with `adapter_model.safetensors`, checked from its
header and read again whenever the values are needed, or a pickled `adapter_model.bin` only
where allowed, loaded whole with weights_only), the LoRA fields that change
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
from typing import Any, Callable, Mapping

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


@dataclass(frozen=True)
class ModuleShape:
    """One adapted matmul's sizes and scale, known without its values."""
    rank: int
    fan_in: int
    fan_out: int
    scaling: float

    @property
    def numel(self) -> int:
        return self.rank * (self.fan_in + self.fan_out)


Key = tuple[int, str]  # (engine layer, tensor name such as "q_proj.weight")


class Adapter:
    """A LoRA adapter: its modules' shapes always, their values either held in memory (made in
    memory, trained, or read from a pickle) or read from its file each time they are asked for
    (`read`: a PEFT folder's safetensors, checked at load from its header alone), so that
    thousands of adapters need host memory only for those a block uses (the pool's cache)."""

    def __init__(self, name: str, path: str, modules: dict[Key, LoraModule] | None = None, *,
                 shapes: dict[Key, ModuleShape] | None = None,
                 read: Callable[[], dict[Key, LoraModule]] | None = None):
        if modules is None and (shapes is None or read is None):
            raise ValueError("an adapter needs its modules, or their shapes and a reader")
        self.name, self.path = name, path
        self._modules, self._read, self._shapes = modules, read, shapes

    @property
    def held(self) -> bool:
        """Whether the values are held in memory (else each use reads them from the file)."""
        return self._modules is not None

    @property
    def modules(self) -> dict[Key, LoraModule]:
        """The values: the held ones (changes to them stay), or a fresh read of the file."""
        if self._modules is not None:
            return self._modules
        assert self._read is not None
        return self._read()

    def hold(self) -> dict[Key, LoraModule]:
        """Read the values once and hold them from now on (a trainer changes them in place)."""
        if self._modules is None:
            self._modules, self._read = self.modules, None
        return self._modules

    @property
    def shapes(self) -> dict[Key, ModuleShape]:
        if self._shapes is None:
            self._shapes = {k: ModuleShape(m.A.shape[0], m.A.shape[1], m.B.shape[0], m.scaling)
                            for k, m in self.modules.items()}
        return self._shapes

    @property
    def numel(self) -> int:
        """Values the adapter holds (A and B of every module), whatever dtype they are kept in."""
        return sum(s.numel for s in self.shapes.values())


def write_folder(folder: str | Path, spec: ModelSpec, modules: Mapping[Key, LoraModule], config: Mapping[str, Any]
                 ) -> None:
    """An adapter's values as a PEFT folder: adapter_model.safetensors (float32, written whole
    before it replaces an older one) and adapter_config.json (`config`, in inference mode)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (j, tname), m in modules.items():
        module = next(t.hf_names[0] for t in spec.layers[j].tensors if t.name == tname)[:-len(".weight")]
        tensors[f"{PREFIX}{module}.lora_A.weight"] = m.A.detach().float().cpu().contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = m.B.detach().float().cpu().contiguous()
    tmp = out / "adapter_model.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({**config, "inference_mode": True}, indent=2))


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(name: str, path: str, spec: ModelSpec, allow_pickle: bool = False) -> Adapter:
    """Check a PEFT LoRA folder for this base model: its config, and its weights' names and
    shapes from the safetensors header alone (the values are read when a block uses them; a
    pickle is read whole, and held)."""
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
    listed, tensors = _list_weights(folder, where, allow_pickle)
    targets = {}  # Hugging Face module name -> (engine layer, tensor name, shape)
    for j, layer in enumerate(spec.layers):
        for t in layer.tensors:
            if t.matmul:
                targets[t.hf_names[0][:-len(".weight")]] = (j, t.name, t.shape, layer.kind)
    embedding = sorted(k for k in listed if "lora_embedding" in k)
    if embedding:
        raise InputError(f"{where}: embedding LoRA ({embedding[0]}) is not supported")
    pairs: dict[str, dict[str, str]] = {}  # module -> "A"/"B" -> the file's tensor name
    for key in listed:
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if not m:
            what = "embedding LoRA" if "lora_embedding" in key else "a weight that is not LoRA A or B"
            raise InputError(f"{where}: {key} is {what}; not supported")
        pairs.setdefault(m.group(1), {})[m.group(2)] = key
    named: dict[Key, tuple[str, str, ModuleShape]] = {}
    for module, ab in pairs.items():
        if module not in targets:
            raise InputError(f"{where}: {module} is not a linear layer of this base model")
        j, tname, (out_f, in_f), kind = targets[module]
        if kind in ("embed", "head"):
            raise InputError(f"{where}: LoRA on {module} (the {kind}) is not supported")
        if set(ab) != {"A", "B"}:
            raise InputError(f"{where}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a_shape, b_shape = listed[ab["A"]], listed[ab["B"]]
        rank = a_shape[0] if a_shape else 0
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_f or b_shape != (out_f, rank):
            raise InputError(f"{where}: {module} has shapes A {a_shape}, B {b_shape}; this base model "
                             f"needs A (r, {in_f}) and B ({out_f}, r): an adapter of another base model?")
        want_r = _pattern_value(cfg.get("rank_pattern") or {}, module, r)
        if want_r != rank:
            raise InputError(f"{where}: {module} has rank {rank} but the config says r = {want_r}")
        a = _pattern_value(cfg.get("alpha_pattern") or {}, module, alpha)
        scaling = a / math.sqrt(rank) if cfg.get("use_rslora") else a / rank
        named[(j, tname)] = (ab["A"], ab["B"], ModuleShape(rank, in_f, out_f, float(scaling)))
    if not named:
        raise InputError(f"{where}: holds no LoRA weights")
    if tensors is not None:  # a pickle, read whole already: held
        return Adapter(name, str(folder), {k: LoraModule(tensors[a].float(), tensors[b].float(), sh.scaling)
                                           for k, (a, b, sh) in named.items()})
    file = folder / "adapter_model.safetensors"
    return Adapter(name, str(folder), shapes={k: sh for k, (_, _, sh) in named.items()},
                   read=lambda: _read_safetensors(file, where, named))


def _list_weights(folder: Path, where: str, allow_pickle: bool
                  ) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.Tensor] | None]:
    """The weights' names and shapes (from a safetensors header alone), and the tensors where
    the file had to be read whole (a pickle)."""
    st, pkl = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.exists():
            from safetensors import safe_open

            with safe_open(str(st), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, None
        if pkl.exists():
            if not allow_pickle:
                raise InputError(f"{where}: holds only a pickled adapter_model.bin; pass --allow-pickle to load it "
                                 "with torch.load(weights_only=True)")
            tensors = torch.load(str(pkl), map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise InputError(f"{where}: adapter_model.bin is not a dict of tensors")
            return {k: tuple(t.shape) for k, t in tensors.items()}, tensors
    except InputError:
        raise
    except Exception as e:  # a corrupt file: safetensors and torch raise their own types
        raise InputError(f"{where}: cannot read its weights ({str(e).splitlines()[0]})") from None
    raise InputError(f"{where}: no adapter_model.safetensors")


def _read_safetensors(file: Path, where: str, named: Mapping[Key, tuple[str, str, ModuleShape]]
                      ) -> dict[Key, LoraModule]:
    """An adapter's values from its file, in the file's dtype, checked against the shapes it was
    loaded with (a file changed since then is refused, not misread)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            out = {k: LoraModule(f.get_tensor(a), f.get_tensor(b), sh.scaling) for k, (a, b, sh) in named.items()}
    except Exception as e:
        raise InputError(f"{where}: cannot read its weights ({str(e).splitlines()[0]})") from None
    for k, m in out.items():
        sh = named[k][2]
        if tuple(m.A.shape) != (sh.rank, sh.fan_in) or tuple(m.B.shape) != (sh.fan_out, sh.rank):
            raise InputError(f"{where}: adapter_model.safetensors changed since it was loaded")
    return out
