"""Dummy models: published shapes with seeded random weights, for benchmarks.

Knows: Hugging Face configs of OPT-125M ... OPT-175B and LLaMA-7B/13B/70B
shapes (plus tiny ones for tests), and how to make a layer's random weights,
deterministically from (seed, layer), one layer at a time so even a 175B model
never exists in memory at full precision; and seeded random prompts for timing runs.
Does not know: placement (the engine stores each layer as it is made).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from flexoff.errors import ModelError
from flexoff.models.base import LayerSpec


def _opt(h: int, layers: int, heads: int, ffn: int | None = None) -> dict[str, Any]:
    return {"model_type": "opt", "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "ffn_dim": ffn or 4 * h, "vocab_size": 50272, "max_position_embeddings": 2048,
            "word_embed_proj_dim": h, "do_layer_norm_before": True, "bos_token_id": 2, "eos_token_id": 2}


def _llama(h: int, layers: int, heads: int, kv: int, ffn: int, vocab: int = 32000) -> dict[str, Any]:
    return {"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


CONFIGS: dict[str, dict[str, Any]] = {
    "opt-tiny": {**_opt(64, 2, 4, 128), "vocab_size": 512, "max_position_embeddings": 512},
    "opt-125m": _opt(768, 12, 12),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
    "opt-175b": _opt(12288, 96, 96),
    "llama-tiny": {**_llama(64, 2, 4, 2, 160, vocab=512), "max_position_embeddings": 512},
    "llama-7b": _llama(4096, 32, 32, 32, 11008),
    "llama-13b": _llama(5120, 40, 40, 40, 13824),
    "llama-70b": _llama(8192, 80, 64, 8, 28672),
}


def dummy_config(name: str) -> dict[str, Any]:
    """The config for `dummy:NAME` (a known shape) or `dummy:PATH/config.json`."""
    if name in CONFIGS:
        return dict(CONFIGS[name])
    p = Path(name)
    if p.suffix == ".json" or p.is_dir():
        p = p / "config.json" if p.is_dir() else p
        try:
            return json.loads(p.read_text())
        except OSError as e:
            raise ModelError(f"cannot read {p}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ModelError(f"{p} is not valid JSON: {e.msg} (line {e.lineno})") from None
    raise ModelError(f"unknown dummy model {name!r}; known: {', '.join(CONFIGS)}, or dummy:PATH/config.json")


class DummySource:
    """Seeded random weights, made one layer at a time on `device`. Each tensor is seeded by its
    canonical checkpoint name, so a tied head equals its embedding, as in the real model."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def layer(self, j: int, spec: LayerSpec, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        out = {}
        for t in spec.tensors:
            name = t.hf_names[-1]  # where the values are stored (shared by tied tensors)
            g = torch.Generator(device=device)
            g.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            x = torch.randn(t.shape, generator=g, device=device, dtype=dtype)
            if name.endswith("bias"):
                x = 0.02 * x
            elif "norm" in name:
                x = 1 + 0.1 * x  # norm scales near one
            else:
                x = x / math.sqrt(t.shape[-1])
            out[t.name] = x
        return out


def random_prompts(n: int, length: int, vocab: int, seed: int = 0, prefix: str = "") -> list[dict[str, Any]]:
    """`n` prompts of `length` token ids drawn from [3, vocab) (past the usual special ids),
    seeded, each with its id (`prefix` and its index)."""
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(3, vocab, (length,), generator=g).tolist(), "id": f"{prefix}{i}"}
            for i in range(n)]
