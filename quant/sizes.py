"""Bytes of weights and KV-cache records, dense or compressed.

Knows: which tensors compression applies to (the matmul weights, grouped along
their output channels) and the byte counts that follow. The compressed
formats, the engine's accounting and the cost model all use these.
Does not know: where bytes live.
"""

from __future__ import annotations

import math

from flexoff.models.base import LayerSpec, TensorSpec
from flexoff.quant.format import QuantConfig, compressed_bytes


def weight_config(bits: int, group: int) -> QuantConfig:
    """Weights: groups along dim 0 of a Linear weight (out, in), its output channels."""
    return QuantConfig(bits, group, dim=0)


def kv_config(bits: int, group: int, head_dim: int) -> QuantConfig:
    """KV cache: groups along the head dimension (no larger than it)."""
    return QuantConfig(bits, min(group, head_dim), dim=-1)


def compresses(t: TensorSpec) -> bool:
    return t.matmul


def tensor_bytes(t: TensorSpec, elem_bytes: int, quant: QuantConfig | None) -> int:
    if quant is not None and compresses(t):
        return compressed_bytes(t.shape, quant)
    return math.prod(t.shape) * elem_bytes


def layer_bytes(layer: LayerSpec, elem_bytes: int, quant: QuantConfig | None = None) -> int:
    return sum(tensor_bytes(t, elem_bytes, quant) for t in layer.tensors)


def kv_record_bytes(kv_heads: int, head_dim: int, elem_bytes: int, quant: QuantConfig | None = None) -> int:
    """Bytes of one token of one sequence in one layer's KV cache (keys and values)."""
    if quant is None:
        return 2 * kv_heads * head_dim * elem_bytes
    return 2 * kv_heads * compressed_bytes((head_dim,), quant)
