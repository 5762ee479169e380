"""ModelSpec: one source of truth for a model's sizes and costs.

Knows: for a family and config, the bytes of each layer's weights, KV-cache
bytes per token, activation bytes per token, and FLOPs per token in prefill and
decode. The cost model (policy/) and the engine (offload/) both read it, so
what the LP plans is what the engine allocates.
Does not know: placement, hardware, compression formats (callers pass bytes
per element, or a compressed layout, when they need other sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from flexoff import validate
from flexoff.errors import ModelError
from flexoff.models.base import Family, LayerSpec
from flexoff.models.llama import Llama, LlamaConfig
from flexoff.models.opt import OPT, OPTConfig

FAMILIES = {
    "opt": lambda d: OPT(OPTConfig.from_hf(d)),
    "llama": lambda d: Llama(LlamaConfig.from_hf(d)),
    "mistral": lambda d: Llama(LlamaConfig.from_hf(d)),
    "qwen2": lambda d: Llama(LlamaConfig.from_hf(d)),
}


def build_family(config: Mapping[str, Any]) -> Family:
    """The family object for a Hugging Face config dict."""
    if not isinstance(config, Mapping):
        raise ModelError("config.json must be a JSON object")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ModelError(
            f"model type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    validate.config_sizes(config, ("vocab_size", "hidden_size", "intermediate_size", "ffn_dim", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "max_position_embeddings"))
    validate.config_numbers(config, ("rms_norm_eps", "layer_norm_eps", "rope_theta"))
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ModelError(f"config.json: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    if heads and not config.get("head_dim") and config.get("hidden_size", 0) % heads:
        raise ModelError(f"config.json: hidden_size ({config['hidden_size']}) must be a multiple of "
                         f"num_attention_heads ({heads})")
    try:
        return FAMILIES[model_type](config)
    except KeyError as e:
        raise ModelError(f"config.json for {model_type} is missing the field {e.args[0]!r}") from None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "opt" or "llama"
    num_layers: int  # transformer blocks (the engine schedules 2 * num_layers + 2 layers)
    hidden_size: int  # h1
    intermediate_size: int  # h2
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_family(cls, name: str, fam: Family) -> "ModelSpec":
        return cls(name, fam.name, fam.num_layers, fam.hidden_size, fam.intermediate_size,
                   fam.num_heads, fam.num_kv_heads, fam.head_dim, fam.vocab_size,
                   fam.max_positions, tuple(fam.layers()))

    @classmethod
    def from_config(cls, name: str, config: Mapping[str, Any]) -> "ModelSpec":
        return cls.from_family(name, build_family(config))

    # ---- weights -------------------------------------------------------
    def layer_elements(self, j: int) -> int:
        return sum(math.prod(t.shape) for t in self.layers[j].tensors)

    def layer_bytes(self, j: int, elem_bytes: float = 2) -> int:
        return int(self.layer_elements(j) * elem_bytes)

    def weight_bytes(self, elem_bytes: float = 2) -> int:
        return sum(self.layer_bytes(j, elem_bytes) for j in range(len(self.layers)))

    @cached_property
    def num_params(self) -> int:
        return sum(self.layer_elements(j) for j in range(len(self.layers)))

    @cached_property
    def attn_layers(self) -> tuple[int, ...]:
        """Indices (in `layers`) of the attention layers, which own a KV cache."""
        return tuple(j for j, l in enumerate(self.layers) if l.kind == "attn")

    # ---- cache and activations ----------------------------------------
    def kv_bytes_per_token(self, elem_bytes: float = 2) -> int:
        """KV-cache bytes of one token in one attention layer (keys and values)."""
        return int(2 * self.num_kv_heads * self.head_dim * elem_bytes)

    def act_bytes_per_token(self, elem_bytes: float = 2) -> int:
        """Bytes of the hidden state of one token between two layers."""
        return int(self.hidden_size * elem_bytes)

    def largest_matmul_bytes(self, elem_bytes: int) -> int:
        """Bytes of the largest matmul weight in the compute dtype (a compressed weight is
        dequantized into a temporary this big at prefill shapes)."""
        return max(math.prod(t.shape) for l in self.layers for t in l.tensors if t.matmul) * elem_bytes

    def largest_layer_matmul_bytes(self, elem_bytes: int) -> int:
        """Bytes of the matmul weights of the layer that has the most, in the compute dtype (a
        training step's reverse sweep dequantizes all of a compressed layer's weights at once)."""
        return max(sum(math.prod(t.shape) for t in l.tensors if t.matmul) for l in self.layers) * elem_bytes

    def dequantized_bytes(self, elem_bytes: int, whole_layer: bool) -> int:
        """Device bytes a compressed model's weights take dequantized at once: one matmul's
        temporary, or a whole layer's where the engine keeps them (a training step's reverse
        sweep; a block of several GPU batches, which share one dequantization per layer)."""
        return self.largest_layer_matmul_bytes(elem_bytes) if whole_layer else self.largest_matmul_bytes(elem_bytes)

    def inflight_bytes(self, batch: int, seq: int, elem_bytes: int) -> int:
        """Device memory of outputs still being copied away when the next layer runs: the keys,
        values and hidden states of up to two layer-batches (the store lane trails compute)."""
        return 2 * batch * seq * (self.kv_bytes_per_token(elem_bytes) + self.act_bytes_per_token(elem_bytes))

    def loading_bytes(self, elem_bytes: int) -> int:
        """Compute-device temporaries while a layer is placed: its tensors and its flat buffer."""
        return 2 * max(self.layer_bytes(j, elem_bytes) for j in range(len(self.layers)))

    def working_bytes(self, batch: int, seq: int, elem_bytes: int, device: str = "cuda") -> int:
        """Transient memory of computing the largest layer on `batch` sequences of `seq` tokens
        (FlexGen's gpu_w working term): hidden states, q/k/v and MLP intermediates in the compute
        dtype, logits in float32, and attention's masks; on the CPU attention also materializes
        its float32 scores (flexoff.models.attention), on CUDA the fused kernel does not."""
        tokens, h1 = batch * seq, self.hidden_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        group = self.num_heads // self.num_kv_heads
        scores = batch * group * seq * seq * (1 + elem_bytes)  # boolean mask and its additive form
        if device != "cuda":
            scores += batch * self.num_heads * seq * seq * 4 * 2
        attn = tokens * (3 * h1 + 2 * qkv) * elem_bytes + scores
        gates = 3 if self.family == "llama" else 2  # SwiGLU holds gate, silu(gate) and up at once
        mlp = tokens * (2 * h1 + gates * self.intermediate_size) * elem_bytes
        head = batch * self.vocab_size * 4 * 2
        return max(attn, mlp, head, self.loading_bytes(elem_bytes))

    # ---- FLOPs ---------------------------------------------------------
    def linear_flops(self, j: int) -> int:
        """Matmul FLOPs of layer j for one token (2 per multiply-add)."""
        return 2 * sum(math.prod(t.shape) for t in self.layers[j].tensors if t.matmul)

    def lora_width(self, j: int) -> int:
        """Sum of (in + out) over layer j's matmuls that LoRA may adapt (not the embedding or
        head): one rank of an adapter on all of them holds this many values, and costs twice as
        many FLOPs per token."""
        if self.layers[j].kind in ("embed", "head"):
            return 0
        return sum(sum(t.shape) for t in self.layers[j].tensors if t.matmul)

    def elementwise_bytes(self, j: int, elem_bytes: int = 2) -> int:
        """Bytes read plus written per token by layer j's passes outside its matmuls and attention
        kernel (flexoff.models' math): an attention layer's norm (2 h), residual add (3 h), q, k
        and v moved to heads and the output back (each read and written once), and LLaMA's
        rotary embedding of q and k; an MLP layer's norm, residual add and activation (ReLU in
        place: 2 widths of the intermediate; SwiGLU's silu and product: 5). The embedding and
        the head: none counted."""
        kind, h = self.layers[j].kind, self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if kind == "attn":
            out = 5 * h + 2 * (q + 2 * kv) + 2 * q + (2 * (q + kv) if self.family == "llama" else 0)
        elif kind == "mlp":
            out = 5 * h + (5 if self.family == "llama" else 2) * self.intermediate_size
        else:
            out = 0
        return out * elem_bytes

    def attn_flops(self, context: int) -> int:
        """Score and value FLOPs of one attention layer for one query over `context` keys."""
        return 4 * self.num_heads * self.head_dim * context

    def prefill_flops(self, prompt_len: int) -> int:
        """FLOPs to prefill one sequence (causal: query t sees t + 1 keys; head on the last token)."""
        total = 0
        for j, layer in enumerate(self.layers):
            n = 1 if layer.kind == "head" else prompt_len
            total += n * self.linear_flops(j)
            if layer.kind == "attn":
                total += self.attn_flops(1) * prompt_len * (prompt_len + 1) // 2
        return total

    def decode_flops(self, context: int) -> int:
        """FLOPs to generate one token of one sequence that attends over `context` keys."""
        return sum(self.linear_flops(j) + (self.attn_flops(context) if l.kind == "attn" else 0)
                   for j, l in enumerate(self.layers))
