"""Scaled dot-product attention with grouped-query heads and boolean masks.

Knows: the attention math shared by all families, on whatever device its
inputs are on (GPU, or the CPU next to a CPU-resident KV cache).
Does not know: where the cache lives or how it is laid out in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped-query heads.

    q: (b, heads, sq, d); k, v: (b, kv_heads, sk, d), any strides;
    mask: (b, sq, sk) bool, True where the query may attend. Returns (b, heads, sq, d).
    Query head i reads kv head i // (heads // kv_heads), as in Hugging Face's repeat_kv.
    """
    b, nh, sq, d = q.shape
    kvh, sk = k.shape[1], k.shape[2]
    g = nh // kvh
    qg = q.reshape(b, kvh, g * sq, d)  # (b, kv_heads, group * sq, d)
    m = mask[:, None, None].expand(b, 1, g, sq, sk).reshape(b, 1, g * sq, sk)
    if q.device.type == "cpu":
        o = _attend_math(qg, k, v, m, scale)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
    return o.reshape(b, nh, sq, d)


def _attend_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain matmul-softmax-matmul. CPU matmuls are fast only when each head's keys and values
    are contiguous matrices: strided ones (a token-major cache) are copied first."""
    if k.stride(-2) != k.shape[-1]:
        k, v = k.contiguous(), v.contiguous()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (b, kvh, g*sq, sk)
    scores.masked_fill_(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(p, v)


def attend_chunks(q: torch.Tensor, chunks: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """attend() over keys and values held in several pieces along the sequence (a prompt area and a
    generated-token area), without concatenating them: scores are joined, values summed.

    q: (b, heads, sq, d); chunks: [(k, v)] each (b, kv_heads, sk_i, d) with contiguous heads;
    mask: (b, sq, sum of sk_i)."""
    b, nh, sq, d = q.shape
    kvh = chunks[0][0].shape[1]
    g = nh // kvh
    qg = q.reshape(b, kvh, g * sq, d)
    sk = mask.shape[-1]
    m = mask[:, None, None].expand(b, 1, g, sq, sk).reshape(b, 1, g * sq, sk)
    scores = torch.cat([torch.matmul(qg, k.transpose(-1, -2)) for k, _ in chunks], dim=-1).float() * scale
    scores.masked_fill_(~m, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(chunks[0][1].dtype)
    out, at = None, 0
    for _, v in chunks:
        part = torch.matmul(p[..., at:at + v.shape[2]], v)
        out = part if out is None else out + part
        at += v.shape[2]
    return out.reshape(b, nh, sq, d)


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """Causal mask over a left-padded prompt: (b, s) valid -> (b, s, s).

    Padding queries attend to themselves only, so no row is all False (NaN-free).
    """
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(s, dtype=torch.bool, device=valid.device)
    return (valid[:, None, :] & causal) | eye


def positions(valid: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row; padding gets 0."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)
