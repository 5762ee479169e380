"""Decode attention: one query token per row over a KV cache, Triton on CUDA, the torch
reference elsewhere, behind one dispatch.

Knows: attention of q (b, heads, 1, d) over keys and values given as (b, kv_heads, T, d)
views with any strides but a contiguous last dimension (the engine's token-major cache read
in place), with a (b, 1, T) boolean mask of the positions each row may see and grouped-query
heads (head h reads kv head h // (heads // kv_heads)). The kernel splits the positions of each
(row, head) into chunks run in parallel (flash-decoding), each keeping a running maximum,
sum and weighted values in float32; a second kernel combines the chunks. Masked positions
are never read, so a cache allocated for more tokens than a step has written costs nothing.
Does not know: where the cache lives, its layout beyond strides, what the mask means.
"""

from __future__ import annotations

import torch

from flexoff.models.attention import attend

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton use the reference
    HAVE_TRITON = False

# Launch settings measured on the H200 (benchmarks/layer_kernels.py, LLaMA-7B heads, 528 positions):
# one warp a program, 32 positions an iteration, read the token-major cache at 2.1, 3.4 and 4.1 TB/s
# at batch 8, 32 and 128, as fast as torch's attention reads a head-major copy (2.2, 3.3, 4.1);
# four warps and 64 positions (the first settings) read it at 1.3, 2.2 and 2.8.
BLOCK_T = 32  # positions a program reads per iteration
TARGET_PROGRAMS = 2048  # (row, head, chunk) programs to aim for: enough to keep every SM streaming
WARPS = 1


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The reference: flexoff.models.attention.attend."""
    return attend(q, k, v, mask, scale)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for one query token: (b, heads, 1, d)."""
    if HAVE_TRITON and q.is_cuda and kernel_fits(q, k, v):
        return decode_attention_triton(q, k, v, mask, scale)
    return decode_attention_ref(q, k, v, mask, scale)


def kernel_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (q.shape[2] == 1 and d >= 16 and d & (d - 1) == 0 and k.stride(-1) == 1 and v.stride(-1) == 1
            and q.stride(-1) == 1 and q.shape[1] % k.shape[1] == 0)


def splits_for(b: int, heads: int, T: int, block: int = BLOCK_T, target: int = TARGET_PROGRAMS) -> int:
    """Chunks per (row, head): a power of two, at most one per `block` positions."""
    s = 1
    while b * heads * s * 2 <= target and s * 2 * block <= T:
        s *= 2
    return s


if HAVE_TRITON:
    @triton.jit
    def _split_kernel(Q, K, V, M, ACC, ML, sqb, sqh, skb, skh, skt, svb, svh, svt, smb, T, per_split, group,
                      scale, S: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kh = h // group
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + h * sqh + offs_d).to(tl.float32) * scale
        m_i = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        acc = tl.zeros((D,), tl.float32)
        t0 = s * per_split
        for start in range(t0, t0 + per_split, BLOCK):
            offs_t = start + tl.arange(0, BLOCK)
            seen = tl.load(M + b * smb + offs_t, mask=offs_t < T, other=0) != 0
            kk = tl.load(K + b * skb + kh * skh + offs_t[:, None] * skt + offs_d[None, :], mask=seen[:, None],
                         other=0.0).to(tl.float32)
            sc = tl.where(seen, tl.sum(kk * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(sc - m_safe)
            alpha = tl.exp(m_i - m_safe)
            vv = tl.load(V + b * svb + kh * svh + offs_t[:, None] * svt + offs_d[None, :], mask=seen[:, None],
                         other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * vv, axis=0)
            m_i = m_new
        row = (b * tl.num_programs(1) + h) * S + s
        tl.store(ACC + row * D + offs_d, acc)
        tl.store(ML + row * 2, m_i)
        tl.store(ML + row * 2 + 1, l_i)

    @triton.jit
    def _combine_kernel(ACC, ML, O, sob, soh, S: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        base = (b * tl.num_programs(1) + h) * S
        offs_s = tl.arange(0, S)
        offs_d = tl.arange(0, D)
        m = tl.load(ML + (base + offs_s) * 2)
        l = tl.load(ML + (base + offs_s) * 2 + 1)
        top = tl.max(m, axis=0)
        w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # chunks that saw nothing weigh 0
        acc = tl.load(ACC + (base + offs_s)[:, None] * D + offs_d[None, :])
        out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
        tl.store(O + b * sob + h * soh + offs_d, out.to(O.dtype.element_ty))


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float, block: int = BLOCK_T, target: int = TARGET_PROGRAMS,
                            warps: int = WARPS) -> torch.Tensor:
    """The kernel, on any device Triton reaches (the CPU under TRITON_INTERPRET=1, for tests):
    `block` positions per iteration, about `target` programs of `warps` warps."""
    b, H, _, D = q.shape
    T = k.shape[2]
    S = splits_for(b, H, T, block, target)
    per_split = -(-T // (S * block)) * block
    m = mask.reshape(b, T)
    m = (m if m.stride(-1) == 1 else m.contiguous()).view(torch.uint8)
    acc = torch.empty(b, H, S, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, H, S, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(b, H, 1, D, dtype=q.dtype, device=q.device)
    _split_kernel[(b, H, S)](q, k, v, m, acc, ml, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                             v.stride(0), v.stride(1), v.stride(2), m.stride(0), T, per_split, H // k.shape[1],
                             scale, S=S, D=D, BLOCK=block, num_warps=warps)
    _combine_kernel[(b, H)](acc, ml, out, out.stride(0), out.stride(1), S=S, D=D)
    return out
