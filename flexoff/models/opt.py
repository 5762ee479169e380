"""OPT (Zhang et al., 2022): learned positions, pre-LayerNorm, ReLU MLP, biases.

Knows: OPT's config fields, weight names and shapes, and the math of each layer
kind as plain functions over the weights they are handed.
Does not know: where weights or the KV cache live, batching, sampling, compression.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from flexoff.errors import ModelError
from flexoff.models.base import LayerSpec, TensorSpec, Weights, linear, linears, residual

POSITION_OFFSET = 2  # OPT's position table has two extra rows before position 0

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class OPTConfig:
    vocab_size: int  # rows of the token embedding table
    hidden_size: int  # h1: width of the residual stream
    ffn_dim: int  # h2: width of the MLP's hidden layer
    num_layers: int  # transformer blocks
    num_heads: int  # attention heads (no grouped-query attention in OPT)
    max_positions: int  # learned positions (the table has max_positions + 2 rows)
    enable_bias: bool = True  # biases on every linear layer
    ln_affine: bool = True  # LayerNorms have weight and bias
    activation: str = "relu"  # MLP nonlinearity
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "OPTConfig":
        if not d.get("do_layer_norm_before", True):
            raise ModelError("OPT models with post-LayerNorm (opt-350m) are not supported")
        if d.get("word_embed_proj_dim", d["hidden_size"]) != d["hidden_size"]:
            raise ModelError("OPT models with projected embeddings (opt-350m) are not supported")
        if d.get("_remove_final_layer_norm", False):
            raise ModelError("OPT configs without a final LayerNorm are not supported")
        act = d.get("activation_function", "relu")
        if act not in ACTIVATIONS:
            raise ModelError(f"OPT activation {act!r} is not supported; use one of {sorted(ACTIVATIONS)}")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            ffn_dim=d["ffn_dim"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            max_positions=d["max_position_embeddings"],
            enable_bias=d.get("enable_bias", True),
            ln_affine=d.get("layer_norm_elementwise_affine", True),
            activation=act,
        )


class OPT:
    """The OPT family bound to one config."""

    name = "opt"

    def __init__(self, cfg: OPTConfig):
        self.cfg = cfg
        self.num_layers = cfg.num_layers
        self.hidden_size = cfg.hidden_size
        self.intermediate_size = cfg.ffn_dim
        self.num_heads = self.num_kv_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_positions
        self.scale = self.head_dim**-0.5
        self._act = ACTIVATIONS[cfg.activation]

    # ---- weights -------------------------------------------------------
    def layers(self) -> list[LayerSpec]:
        c, H = self.cfg, self.cfg.hidden_size
        p = "model.decoder."

        def lin(name: str, hf: str, out: int, inp: int) -> list[TensorSpec]:
            ts = [TensorSpec(f"{name}.weight", (out, inp), (f"{hf}.weight",), matmul=True)]
            if c.enable_bias:
                ts.append(TensorSpec(f"{name}.bias", (out,), (f"{hf}.bias",)))
            return ts

        def ln(name: str, hf: str) -> list[TensorSpec]:
            if not c.ln_affine:
                return []
            return [TensorSpec(f"{name}.weight", (H,), (f"{hf}.weight",)),
                    TensorSpec(f"{name}.bias", (H,), (f"{hf}.bias",))]

        embed_names = (f"{p}embed_tokens.weight",)
        out = [LayerSpec("embed", -1, (
            TensorSpec("embed_tokens", (c.vocab_size, H), embed_names),
            TensorSpec("embed_positions", (c.max_positions + POSITION_OFFSET, H), (f"{p}embed_positions.weight",)),
        ))]
        for i in range(c.num_layers):
            b = f"{p}layers.{i}."
            qkv = lin("q_proj", b + "self_attn.q_proj", H, H) + lin("k_proj", b + "self_attn.k_proj", H, H) \
                + lin("v_proj", b + "self_attn.v_proj", H, H)
            out.append(LayerSpec("attn", i, tuple(  # q, k, v matrices, then their biases: each adjacent
                ln("ln", b + "self_attn_layer_norm")
                + [t for t in qkv if t.matmul] + [t for t in qkv if not t.matmul]
                + lin("out_proj", b + "self_attn.out_proj", H, H))))
            out.append(LayerSpec("mlp", i, tuple(
                ln("ln", b + "final_layer_norm")
                + lin("fc1", b + "fc1", c.ffn_dim, H)
                + lin("fc2", b + "fc2", H, c.ffn_dim))))
        out.append(LayerSpec("head", -1, tuple(
            ln("ln", p + "final_layer_norm")
            + [TensorSpec("lm_head.weight", (c.vocab_size, H), ("lm_head.weight",) + embed_names, matmul=True)])))
        return out

    # ---- math ----------------------------------------------------------
    def _ln(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, (self.hidden_size,), w.get("ln.weight"), w.get("ln.bias"), self.cfg.layer_norm_eps)

    def embed(self, w: Weights, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, w["embed_tokens"]) + F.embedding(pos + POSITION_OFFSET, w["embed_positions"])

    def attn_in(self, w: Weights, h: torch.Tensor, pos: torch.Tensor):
        b, s, _ = h.shape
        x = self._ln(w, h)
        names = ("q_proj", "k_proj", "v_proj")
        q, k, v = (y.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # (b, s, H) -> (b, heads, s, d)
                   for y in linears(x, [w[f"{p}.weight"] for p in names], [w.get(f"{p}.bias") for p in names]))
        return q, k, v

    def attn_out(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = o.shape
        o = o.transpose(1, 2).reshape(b, s, self.hidden_size)  # (b, s, H)
        return residual(h, linear(o, w["out_proj.weight"], w.get("out_proj.bias")))

    def mlp(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        x = linear(self._ln(w, h), w["fc1.weight"], w.get("fc1.bias"))
        x = F.relu_(x) if self._act is F.relu and not x.requires_grad else self._act(x)  # in place: 4h wide
        return residual(h, linear(x, w["fc2.weight"], w.get("fc2.bias")))

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(self._ln(w, h), w["lm_head.weight"])
