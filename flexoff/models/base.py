"""What every model family shares: the description of its layers, and `linear`.

Knows: how a family describes its weights (per engine layer, each tensor's name,
shape and names in a Hugging Face checkpoint), and the layer kinds the engine
schedules: `embed`, `attn`, `mlp`, `head` (FlexGen splits each transformer block
into an attention layer and an MLP layer; we do the same).
Does not know: where tensors live, dtypes of storage, compression, adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

LayerKind = Literal["embed", "attn", "mlp", "head", "recv", "send"]  # recv, send: pipeline stages' ends


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor of a layer."""

    name: str  # our name inside the layer, e.g. "q_proj.weight"
    shape: tuple[int, ...]
    hf_names: tuple[str, ...]  # names in a HF checkpoint, first match wins (tied weights)
    matmul: bool = False  # a (out, in) matrix used by `linear`: counts FLOPs, compressible


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the engine's schedule."""

    kind: LayerKind
    block: int  # transformer block index; -1 for embed and head
    tensors: tuple[TensorSpec, ...]


Weights = Mapping[str, Any]  # name -> tensor, or a weight object that implements .linear()


def linear(x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b, where w is a tensor or a weight object with its own .linear().

    Model code calls this for every matmul weight, so transforms of the weights
    (compression, adapters) plug in here without the model file knowing them.
    """
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    return w.linear(x, b)


def residual(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """h + y, where y is a layer's fresh output: added into y when no gradient flows through
    either (the same sum, bit for bit), so a prefill's residual allocates no tensor of its own
    (at a 24576-row OPT-30B batch each one is 352 MB the caching allocator must find room for)."""
    return h + y if h.requires_grad or y.requires_grad else y.add_(h)


def linears(x: torch.Tensor, ws: Sequence[Any], bs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """[x @ w.T + b for each w, b]: several projections of one input (q, k and v; gate and up).

    Where the weights are plain matrices stored one after another (as a layer's buffer holds
    them) and so are their biases, one matmul computes them all; weight objects that can take
    several projections at once do so (their `linears`); otherwise each goes through `linear`,
    so weight objects (compression, adapters) keep their own."""
    together = getattr(ws[0], "linears", None)
    got = together(x, ws, bs) if together is not None else None
    if got is not None:
        return got
    wb = stacked_with_bias(ws, bs)
    if wb is None:
        return [linear(x, wi, bi) for wi, bi in zip(ws, bs)]
    return list(F.linear(x, *wb).split([t.shape[0] for t in ws], dim=-1))


def stacked_with_bias(ws: Sequence[Any], bs: Sequence[torch.Tensor | None]
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weights as one matrix and their biases as one vector (None where none has a bias),
    if both already lie stacked in memory; None otherwise."""
    w = stacked(ws)
    b = None if all(t is None for t in bs) else stacked(bs)
    if w is None or (b is None and any(t is not None for t in bs)):
        return None
    return w, b


def stacked(ts: Sequence[Any]) -> torch.Tensor | None:
    """The tensors as one, concatenated along dim 0, if they already lie so in memory."""
    if not all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in ts):
        return None
    first = ts[0]
    ptr = first.data_ptr()
    for t in ts:
        if t.data_ptr() != ptr or t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]:
            return None
        ptr += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in ts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def materialize(w: Any) -> torch.Tensor:
    """A weight as a plain tensor (dequantizes a compressed weight)."""
    return w if isinstance(w, torch.Tensor) else w.dense()


class Family(Protocol):
    """A model family: its config and the math of each layer kind.

    Shapes: h is (b, s, hidden); q is (b, heads, s, head_dim); k and v are
    (b, kv_heads, s, head_dim); pos is (b, s) int64 positions of real tokens.
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int

    def layers(self) -> list[LayerSpec]: ...
    def embed(self, w: Weights, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor: ...
    def attn_in(
        self, w: Weights, h: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def attn_out(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor: ...
    def mlp(self, w: Weights, h: torch.Tensor) -> torch.Tensor: ...
    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor: ...
