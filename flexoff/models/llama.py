"""LLaMA and its relatives (Llama 2/3, Mistral, Qwen2, SmolLM2).

RMSNorm, rotary positions (the config's theta, with linear, llama3 or yarn
scaling), SwiGLU MLP, grouped-query attention, optional attention and MLP biases
(Qwen2 has q/k/v biases), tied or untied embeddings.
Knows: the config fields, weight names and shapes, the math of each layer kind.
Does not know: where weights or the KV cache live, batching, sampling, compression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from flexoff.errors import ModelError
from flexoff.kernels.elementwise import rms_norm, rotate_pair, silu_mul
from flexoff.models.base import LayerSpec, TensorSpec, Weights, linear, linears, residual

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0  # base wavelength
    kind: str = "default"  # one of ROPE_TYPES
    params: tuple[tuple[str, Any], ...] = ()  # the scaling's own fields (factor, ...)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int  # rows of the token embedding table
    hidden_size: int  # h1: width of the residual stream
    intermediate_size: int  # h2: width of the SwiGLU hidden layer
    num_layers: int  # transformer blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int  # width of one head
    max_positions: int  # context length the model was configured for
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False  # biases on q, k, v projections (Qwen2, Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False  # biases on gate, up, down projections
    tie_embeddings: bool = False  # lm_head reuses the token embedding
    sliding_window: int | None = None  # Mistral/Qwen2 local attention span, if enabled

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"LLaMA-family activation {act!r} is not supported (only silu)")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ModelError("configs with pretraining_tp > 1 are not supported")
        model_type = d.get("model_type", "llama")
        heads = d["num_attention_heads"]
        attn_bias = bool(d.get("attention_bias", False))
        window = None
        if d.get("sliding_window") and d.get("use_sliding_window", model_type == "mistral"):
            window = int(d["sliding_window"])
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_positions=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(d),
            qkv_bias=attn_bias or model_type == "qwen2",
            o_bias=attn_bias and model_type != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=window,
        )


def _rope_from_hf(d: Mapping[str, Any]) -> RopeConfig:
    """Read rotary settings from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (older config.json files)."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    params.update(scaling)
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ModelError(f"rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "dynamic":
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
    return RopeConfig(theta, kind, tuple(sorted(params.items())))


def rope_frequencies(cfg: LlamaConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) in float32 and the attention scaling of cos/sin."""
    r, dim = cfg.rope, cfg.head_dim
    inv = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # float32, as HF
    scale = 1.0
    if r.kind == "linear":
        inv = inv / r.get("factor")
    elif r.kind == "llama3":
        factor, lo, hi = r.get("factor"), r.get("low_freq_factor"), r.get("high_freq_factor")
        old = r.get("original_max_position_embeddings")
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0 at long, 1 at short wavelengths
        inv = torch.where(wavelen < old / hi, inv, torch.where(wavelen > old / lo, inv / factor,
                                                                (1 - smooth) * inv / factor + smooth * inv))
    elif r.kind == "yarn":
        inv, scale = _yarn(cfg, inv)
    return inv.float(), scale


def _yarn(cfg: LlamaConfig, inv: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): interpolate low frequencies, keep high ones, ramp between."""
    r, dim = cfg.rope, cfg.head_dim
    factor = r.get("factor") or cfg.max_positions / r.get("original_max_position_embeddings")
    old = r.get("original_max_position_embeddings")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = r.get("attention_factor")
    if attn is None:
        m, m_all = r.get("mscale"), r.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)

    def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times over `old` positions
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    lo, hi = dim_for(r.get("beta_fast") or 32), dim_for(r.get("beta_slow") or 1)
    if r.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return inv / factor * (1 - keep) + inv * keep, float(attn)


class Llama:
    """The LLaMA family bound to one config."""

    name = "llama"

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        self.num_layers = cfg.num_layers
        self.hidden_size = cfg.hidden_size
        self.intermediate_size = cfg.intermediate_size
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_positions
        self.scale = cfg.head_dim**-0.5
        self.inv_freq, self.rope_scale = rope_frequencies(cfg)
        self._inv_on: dict[torch.device, torch.Tensor] = {}  # inv_freq per device, copied once
        self._rope_for: tuple[torch.Tensor, torch.dtype] | None = None  # (pos, dtype) of _rope_val
        self._rope_val: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_on:  # not per call: a CUDA graph cannot capture a host copy
            self._inv_on[device] = self.inv_freq.to(device)
        return self._inv_on[device]

    def check_length(self, total: int) -> None:
        """Raise if a sequence of `total` tokens needs features we do not implement."""
        r = self.cfg.rope
        if r.kind == "dynamic" and total > r.get("original_max_position_embeddings"):
            raise ModelError("dynamic RoPE scaling beyond the original context is not supported")
        if self.cfg.sliding_window and total > self.cfg.sliding_window:
            raise ModelError(f"sequences over the sliding window ({self.cfg.sliding_window} tokens) are not supported")

    # ---- weights -------------------------------------------------------
    def layers(self) -> list[LayerSpec]:
        c, H = self.cfg, self.cfg.hidden_size
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def lin(name: str, hf: str, out: int, inp: int, bias: bool) -> list[TensorSpec]:
            ts = [TensorSpec(f"{name}.weight", (out, inp), (f"{hf}.weight",), matmul=True)]
            if bias:
                ts.append(TensorSpec(f"{name}.bias", (out,), (f"{hf}.bias",)))
            return ts

        def group(*lins: list[TensorSpec]) -> list[TensorSpec]:  # matrices, then biases: each adjacent
            specs = [t for ts in lins for t in ts]
            return [t for t in specs if t.matmul] + [t for t in specs if not t.matmul]

        embed_names = ("model.embed_tokens.weight",)
        out = [LayerSpec("embed", -1, (TensorSpec("embed_tokens", (c.vocab_size, H), embed_names),))]
        for i in range(c.num_layers):
            b = f"model.layers.{i}."
            out.append(LayerSpec("attn", i, tuple(
                [TensorSpec("norm.weight", (H,), (b + "input_layernorm.weight",))]
                + group(lin("q_proj", b + "self_attn.q_proj", q_out, H, c.qkv_bias),
                        lin("k_proj", b + "self_attn.k_proj", kv_out, H, c.qkv_bias),
                        lin("v_proj", b + "self_attn.v_proj", kv_out, H, c.qkv_bias))
                + lin("o_proj", b + "self_attn.o_proj", H, q_out, c.o_bias))))
            out.append(LayerSpec("mlp", i, tuple(
                [TensorSpec("norm.weight", (H,), (b + "post_attention_layernorm.weight",))]
                + group(lin("gate_proj", b + "mlp.gate_proj", c.intermediate_size, H, c.mlp_bias),
                        lin("up_proj", b + "mlp.up_proj", c.intermediate_size, H, c.mlp_bias))
                + lin("down_proj", b + "mlp.down_proj", H, c.intermediate_size, c.mlp_bias))))
        head_names = embed_names if c.tie_embeddings else ("lm_head.weight",)
        out.append(LayerSpec("head", -1, (
            TensorSpec("norm.weight", (H,), ("model.norm.weight",)),
            TensorSpec("lm_head.weight", (c.vocab_size, H), head_names, matmul=True))))
        return out

    # ---- math ----------------------------------------------------------
    def embed(self, w: Weights, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, w["embed_tokens"])

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (b, 1, s, d) of positions pos (b, s). The same for every layer of a step:
        kept for the last pos tensor asked about (by identity, which it keeps alive)."""
        key = (pos, dtype)
        if self._rope_for is not None and self._rope_for[0] is pos and self._rope_for[1] == dtype:
            return self._rope_val
        freqs = pos[:, None, :, None].float() * self._inv_freq(pos.device)  # (b, 1, s, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._rope_for, self._rope_val = key, ((emb.cos() * self.rope_scale).to(dtype),
                                               (emb.sin() * self.rope_scale).to(dtype))
        return self._rope_val

    def attn_in(self, w: Weights, h: torch.Tensor, pos: torch.Tensor):
        b, s, _ = h.shape
        x = rms_norm(h, w["norm.weight"], self.cfg.rms_norm_eps)
        names = ("q_proj", "k_proj", "v_proj")
        q, k, v = (y.view(b, s, n, self.head_dim).transpose(1, 2)  # (b, s, n*d) -> (b, n, s, d)
                   for y, n in zip(linears(x, [w[f"{p}.weight"] for p in names], [w.get(f"{p}.bias") for p in names]),
                                   (self.num_heads, self.num_kv_heads, self.num_kv_heads)))
        cos, sin = self.rope(pos, h.dtype)
        q, k = rotate_pair(q, k, cos, sin)
        return q, k, v

    def attn_out(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = o.shape
        o = o.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # (b, s, heads*d)
        return residual(h, linear(o, w["o_proj.weight"], w.get("o_proj.bias")))

    def mlp(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, w["norm.weight"], self.cfg.rms_norm_eps)
        gate, up = linears(x, [w["gate_proj.weight"], w["up_proj.weight"]], [w.get("gate_proj.bias"), w.get("up_proj.bias")])
        return residual(h, linear(silu_mul(gate, up), w["down_proj.weight"], w.get("down_proj.bias")))

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(h, w["norm.weight"], self.cfg.rms_norm_eps), w["lm_head.weight"])
