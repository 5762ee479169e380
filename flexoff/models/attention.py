"""Scaled dot-product attention with grouped-query heads and boolean masks.

Knows: the attention math shared by all families, on whatever device its
inputs are on (GPU, or the CPU next to a CPU-resident KV cache).
Does not know: where the cache lives or how it is laid out in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexoff.kernels import cpu_attention as cpu_kernel


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
    scores = torch.matmul(q, k.transpose(-1, -2))  # (b, kvh, g*sq, sk), at least float32
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    scores.masked_fill_(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(p, v)


def attend_cached(q: torch.Tensor, prompt: tuple[torch.Tensor, torch.Tensor],
                  generated: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], g: int,
                  mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention over a cache held in two areas, without concatenating them: writes the new
    token's key and value at index g of the generated area, then attends over the prompt area and
    generated tokens 0..g (scores joined, values summed). On the CPU the compiled kernel of
    flexoff.kernels.cpu_attention runs where it builds; attend_two_areas otherwise.

    q: (b, heads, 1, d); prompt: (k, v) each (b, kv_heads, s, d), generated: (k, v) each
    (b, kv_heads, max_gen, d), contiguous heads; new: (k, v) each (b, kv_heads, 1, d);
    mask: (b, 1, s + g + 1)."""
    kp, vp = prompt
    kg, vg = generated
    kg[:, :, g:g + 1] = new[0]
    vg[:, :, g:g + 1] = new[1]
    kg, vg = kg[:, :, :g + 1], vg[:, :, :g + 1]
    if q.device.type == "cpu" and cpu_kernel.fits(q, kp, kg) and cpu_kernel.enabled():
        return cpu_kernel.decode_attention(q, (kp, vp), (kg, vg), mask, scale)
    return attend_two_areas(q, (kp, vp), (kg, vg), mask, scale)


def attend_two_areas(q: torch.Tensor, prompt: tuple[torch.Tensor, torch.Tensor],
                     generated: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, scale: float) -> torch.Tensor:
    """attend_cached's torch math (the compiled CPU kernel's reference): q over the prompt
    area's keys and values, then the generated area's, with no concatenation."""
    (kp, vp), (kg, vg) = prompt, generated
    b, nh, sq, d = q.shape
    kvh = kp.shape[1]
    grp = nh // kvh
    qg = q.reshape(b, kvh, grp * sq, d)
    sk = mask.shape[-1]
    m = mask[:, None, None].expand(b, 1, grp, sq, sk).reshape(b, 1, grp * sq, sk)
    scores = torch.cat([torch.matmul(qg, kp.transpose(-1, -2)), torch.matmul(qg, kg.transpose(-1, -2))],
                       dim=-1).float() * scale
    scores.masked_fill_(~m, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(vp.dtype)
    s = kp.shape[2]
    out = torch.matmul(p[..., :s], vp) + torch.matmul(p[..., s:], vg)
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
