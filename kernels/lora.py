"""LoRA deltas for the rows of a batch, each row with its own adapter of its own rank (S-LoRA's
MBGMV, Punica's BGMV), Triton on CUDA, the torch reference elsewhere, behind one dispatch.

Knows: the packed form of one adapted matmul across adapters: `A` (sum of ranks, in) holds
each adapter's A rows one after another, `Bt` (sum of ranks, out) its B transposed likewise,
with `rank`, `offset` and `scale` per adapter (rank 0 where an adapter does not adapt this
matmul), so no adapter is padded to the largest rank in memory; and adding
scale * (x @ A_a.T) @ B_a.T to the rows of y whose adapter is a (index -1: none). The kernel
runs a program per token and block of outputs: it shrinks the token to the adapter's rank
(masked to the pool's largest rank), then expands onto its outputs.
Does not know: where adapters come from, which rows have which adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton use the reference
    HAVE_TRITON = False


@dataclass
class LoraPack:
    """One matmul's LoRA weights across the pool's adapters."""
    A: torch.Tensor  # (sum of ranks, in)
    Bt: torch.Tensor  # (sum of ranks, out)
    rank: torch.Tensor  # (adapters,) int32
    offset: torch.Tensor  # (adapters,) int32: first row of each adapter in A and Bt
    scale: torch.Tensor  # (adapters,) float32
    ranks: tuple[int, ...]  # the same ranks on the host
    max_rank: int
    scales: tuple[float, ...] = ()  # the same scalings on the host, exactly


def lora_delta_ref(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack) -> torch.Tensor:
    """y plus each row's adapter delta: x (n, ..., in), y (n, ..., out), ids (n,) adapter per row."""
    offsets = p.offset.tolist()
    for a in sorted(set(ids.tolist()) - {-1}):
        r = p.ranks[a]
        if r == 0:
            continue
        rows = (ids == a).nonzero()[:, 0]
        o = offsets[a]
        d = F.linear(F.linear(x.index_select(0, rows), p.A[o:o + r]), p.Bt[o:o + r].t())
        y = y.index_add(0, rows, (d * p.scales[a]).to(y.dtype))
    return y


def lora_delta(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack) -> torch.Tensor:
    """The dispatch: the kernel for CUDA tensors, the reference elsewhere and wherever autograd
    records (a training sweep's recompute differentiates through it)."""
    if HAVE_TRITON and x.is_cuda and not torch.is_grad_enabled():
        return lora_delta_triton(x, y, ids, p)
    return lora_delta_ref(x, y, ids, p)


if HAVE_TRITON:
    @triton.jit
    def _lora_kernel(X, Y, IDS, A, BT, RANK, OFF, SCALE, per_row, K, N, sx, sy, sa, sb,
                     R: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
        t = tl.program_id(0)  # token
        nb = tl.program_id(1)  # block of outputs
        a = tl.load(IDS + t // per_row)
        safe = tl.maximum(a, 0)
        r = tl.where(a >= 0, tl.load(RANK + safe), 0)
        off = tl.load(OFF + safe)
        ks = tl.arange(0, R)
        live = ks < r
        v = tl.zeros((R,), tl.float32)
        for k0 in range(0, K, BK):  # shrink: v = A_a @ x
            cols = k0 + tl.arange(0, BK)
            xk = tl.load(X + t * sx + cols, mask=cols < K, other=0.0).to(tl.float32)
            ak = tl.load(A + (off + ks)[:, None] * sa + cols[None, :], mask=live[:, None] & (cols[None, :] < K),
                         other=0.0).to(tl.float32)
            v += tl.sum(ak * xk[None, :], axis=1)
        outs = nb * BN + tl.arange(0, BN)
        bt = tl.load(BT + (off + ks)[:, None] * sb + outs[None, :], mask=live[:, None] & (outs[None, :] < N),
                     other=0.0).to(tl.float32)
        d = tl.sum(v[:, None] * bt, axis=0) * tl.load(SCALE + safe)  # expand
        ym = (outs < N) & ((outs * 0 + r) > 0)  # rows on the base model: nothing to write
        y = tl.load(Y + t * sy + outs, mask=ym, other=0.0).to(tl.float32)
        tl.store(Y + t * sy + outs, (y + d).to(Y.dtype.element_ty), mask=ym)


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack) -> torch.Tensor:
    """The kernel, on any device Triton reaches (the CPU under TRITON_INTERPRET=1, for tests);
    y is updated in place and returned."""
    n = x.shape[0]
    xf = x.reshape(-1, x.shape[-1])
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    yf = y.view(-1, y.shape[-1])  # y is the fresh output of the base matmul: contiguous
    tokens, K, N = xf.shape[0], xf.shape[1], yf.shape[1]
    R = max(16, triton.next_power_of_2(max(p.max_rank, 1)))
    BN = 64 if R <= 64 else 32
    _lora_kernel[(tokens, triton.cdiv(N, BN))](xf, yf, ids.to(torch.int32), p.A, p.Bt, p.rank, p.offset, p.scale,
                                                tokens // n, K, N, xf.stride(0), yf.stride(0), p.A.stride(0),
                                                p.Bt.stride(0), R=R, BK=32, BN=BN)
    return y
