"""Fused elementwise work of a decode step: RMSNorm, the rotary embedding (of queries and keys
in one launch where they lie side by side), SwiGLU's silu(gate) * up, and one token's keys and
values stored into a token-major cache at a position held on the device. Each is one Triton
kernel on CUDA where eager torch runs a chain of kernels (casts, a reduction, halves swapped
and negated, products, sums, a stack and an indexed copy), each a pass over memory or at least
a launch; behind one dispatch per function, with the torch chain as the reference.

Knows: the math of each chain and where the chain rounds to the activations' dtype; the
kernels round at the same places, so they give the chain's values up to one rounding step
(the float32 summation order of RMSNorm's mean, the last float32 bit of silu's exponential);
the rotary kernel is compiled without contracting products into sums, so it gives the chain's
values exactly. Knows that Triton kernels carry no autograd: the dispatch takes the torch
chain wherever a gradient may be asked for, and off CUDA.
Does not know: layers, caches, which model calls it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton use the references
    HAVE_TRITON = False

MAX_BLOCK = 4096  # elements of a row one RMSNorm iteration reads
ROTARY_ELEMENTS = 1024  # head elements one rotary program handles (heads x head_dim)
SILU_BLOCK = 1024  # columns one silu * up program handles
ENABLED = os.environ.get("FLEXOFF_FUSED_KERNELS", "1") != "0"  # off: the torch chains everywhere (A/B runs)


def rms_norm_ref(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (h / sqrt(mean(h^2) + eps)), the norm in float32 and rounded to h's dtype first."""
    return w * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout: x (b, heads, s, d); cos, sin (b, 1, s, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _fused(*ts: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: all on CUDA, and no gradient can be asked for."""
    if not (ENABLED and HAVE_TRITON) or not all(t.is_cuda for t in ts):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def rms_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension of h (any leading shape), times w."""
    if _fused(h, w) and h.stride(-1) == 1 and w.is_contiguous():
        return rms_norm_triton(h, w, eps)
    return rms_norm_ref(h, w, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x (b, heads, s, d) at the positions cos and sin (b, 1, s, d) are for."""
    if _fused(x, cos, sin) and rotate_fits(x, cos, sin):
        return rotate_triton(x, cos, sin)
    return rotate_ref(x, cos, sin)


def rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate(q), rotate(k): one launch where k's heads follow q's in memory with the same strides
    (the query and key columns of one projection's output)."""
    if _fused(q, k, cos, sin) and q.stride() == k.stride() and q.shape[0] == k.shape[0] \
            and q.shape[2:] == k.shape[2:] and q.dtype == k.dtype \
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size():
        both = q.as_strided((q.shape[0], q.shape[1] + k.shape[1], *q.shape[2:]), q.stride())
        if rotate_fits(both, cos, sin):
            out = rotate_triton(both, cos, sin)
            return out[:, :q.shape[1]], out[:, q.shape[1]:]
    return rotate(q, cos, sin), rotate(k, cos, sin)


def store_token(cache: torch.Tensor, t: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """cache[t, :, 0] = k, cache[t, :, 1] = v for a token-major cache (T, rows, 2, kv_heads, d) and
    one token's k, v (rows, kv_heads, 1, d); t is a (1,) int64 tensor on the cache's device (a
    CUDA graph replays the store at every position)."""
    d = k.shape[-1]
    if _fused(cache, k, v) and cache.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1 \
            and k.dtype == v.dtype == cache.dtype and d & (d - 1) == 0:
        store_token_triton(cache, t, k, v)
        return
    cache.index_copy_(0, t, torch.stack((k, v), dim=1).permute(3, 0, 1, 2, 4))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, for two tensors of one shape (views of one projection's output)."""
    if _fused(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype and gate.stride(-1) == 1 \
            and up.stride(-1) == 1:
        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)


def rotate_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    d = x.shape[-1]
    return (x.dim() == 4 and d >= 4 and d & (d - 1) == 0 and x.dtype == cos.dtype == sin.dtype
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2], d)
            and x.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, last dim) without a copy where its leading dimensions allow it."""
    return t.reshape(-1, t.shape[-1])


if HAVE_TRITON:
    @triton.jit
    def _rms_kernel(X, W, Y, sx, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * sx + offs, mask=offs < N, other=0.0).to(tl.float32)
            acc += x * x
        r = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * sx + offs, mask=offs < N, other=0.0).to(tl.float32)
            w = tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
            y = (x * r).to(X.dtype.element_ty).to(tl.float32)  # the norm rounded to h's dtype, as the chain
            tl.store(Y + row * N + offs, (y * w).to(Y.dtype.element_ty), mask=offs < N)

    @triton.jit
    def _rotary_kernel(X, C, S, Y, H, L, sxb, sxh, sxs, scb, scs, HB: tl.constexpr, HALF: tl.constexpr):
        r = tl.program_id(0)  # (row, position) pair: row * L + position
        b = r // L
        p = r % L
        offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
        offs = tl.arange(0, HALF)
        keep = (offs_h < H)[:, None]
        xp = X + b * sxb + p * sxs + offs_h[:, None] * sxh + offs[None, :]
        x1 = tl.load(xp, mask=keep, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=keep, other=0.0).to(tl.float32)
        cp = b * scb + p * scs + offs
        c1 = tl.load(C + cp).to(tl.float32)[None, :]
        c2 = tl.load(C + cp + HALF).to(tl.float32)[None, :]
        s1 = tl.load(S + cp).to(tl.float32)[None, :]
        s2 = tl.load(S + cp + HALF).to(tl.float32)[None, :]
        dt = Y.dtype.element_ty
        # x * cos + cat(-x2, x1) * sin, each product rounded to the dtype, then the sum
        o1 = ((x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        yp = Y + (r * H + offs_h[:, None]) * (2 * HALF) + offs[None, :]
        tl.store(yp, o1, mask=keep)
        tl.store(yp + HALF, o2, mask=keep)

    @triton.jit
    def _store_kernel(CACHE, T_AT, K, V, skr, skh, svr, svh, D: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        rows = tl.num_programs(0)
        heads = tl.num_programs(1)
        t = tl.load(T_AT)
        offs = tl.arange(0, D)
        dst = CACHE + ((t * rows + r) * 2 * heads + h) * D + offs  # (T, rows, 2, heads, D) at [t, r, 0, h]
        tl.store(dst, tl.load(K + r * skr + h * skh + offs))
        tl.store(dst + heads * D, tl.load(V + r * svr + h * svh + offs))

    @triton.jit
    def _silu_mul_kernel(G, U, Y, N, sg, su, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < N
        g = tl.load(G + row * sg + offs, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(U + row * su + offs, mask=keep, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)  # silu rounded, as the chain
        tl.store(Y + row * N + offs, (s * u).to(Y.dtype.element_ty), mask=keep)


def rms_norm_triton(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm kernel, on any device Triton reaches (the CPU under TRITON_INTERPRET=1)."""
    N = h.shape[-1]
    x = _rows(h)
    out = torch.empty(h.shape, dtype=torch.promote_types(h.dtype, w.dtype), device=h.device)
    if x.shape[0]:
        block = min(triton.next_power_of_2(N), MAX_BLOCK)
        _rms_kernel[(x.shape[0],)](x, w, out, x.stride(0), N, eps, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out


def rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary kernel: returns a (b, heads, s, d) view of a (b, s, heads, d) tensor."""
    b, H, L, d = x.shape
    out = torch.empty(b, L, H, d, dtype=x.dtype, device=x.device)
    if out.numel():
        hb = min(triton.next_power_of_2(H), max(1, ROTARY_ELEMENTS // d))
        _rotary_kernel[(b * L, triton.cdiv(H, hb))](x, cos, sin, out, H, L, x.stride(0), x.stride(1), x.stride(2),
                                                    cos.stride(0), cos.stride(2), HB=hb, HALF=d // 2,
                                                    enable_fp_fusion=False)  # no contraction: the chain's roundings
    return out.transpose(1, 2)


def store_token_triton(cache: torch.Tensor, t: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The store kernel (head_dim a power of two)."""
    rows, heads, _, d = k.shape
    _store_kernel[(rows, heads)](cache, t, k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), D=d)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The silu * up kernel."""
    N = gate.shape[-1]
    g, u = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if g.shape[0]:
        _silu_mul_kernel[(g.shape[0], triton.cdiv(N, SILU_BLOCK))](g, u, out, N, g.stride(0), u.stride(0),
                                                                   BLOCK=SILU_BLOCK)
    return out
