"""A prefill projection and its rows' LoRA deltas in one Triton matmul: the base product
x @ w.T (+ bias) accumulated tile by tile, then, before the tile is stored, each of its rows'
scale * v @ B.T added from the shrink's v (kernels.lora's tiles), so the deltas never make a
trip of their own through memory (unfused, the expand writes y and the matmul reads it back:
at 512-token prompts that traffic cost the 1000-adapter population most of its prefill LoRA
time).

Knows: a tile of BM tokens may straddle rows (prompts of any length); its epilogue adds each
row's delta in turn with the other rows' tokens masked out; projections stacked in one weight
(q, k, v; gate, up) go in one launch, each tile of outputs inside one projection (its
adapter's tables found by kernels.lora's shifts). Tiles run in groups of GROUP tiles of
tokens down each column of tiles, so a block of w stays in L2 while those tiles read it.
Does not know: which adapter a row has (the ids), the shrink (kernels.lora).
"""

from __future__ import annotations

import torch

from flexoff.kernels.lora import HAVE_TRITON, NO_STACK, LoraPack, _Stack

# Tile of the fused matmul: bm tokens by bn outputs, bk inputs a step; `group` tiles of tokens
# in a column before the next column; software pipeline stages and warps.
FUSED = {"bm": 128, "bn": 256, "bk": 64, "group": 8, "stages": 3, "warps": 8}

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from flexoff.kernels.lora import _adapter, _shift

    @triton.jit
    def _matmul_lora(X, W, BIAS, Y, IDS, BUF, BOFF, RANK, SCALE, V, T, K, N, NB, NP, per_row, sx, sw, sy,
                     SB1, SB2, SR1, SR2, SS1, SS2, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, HAS_B: tl.constexpr):
        """Program: tile (tokens pid_m, outputs nb of projection pj, its N columns from pj * N)
        of y = x @ w.T + bias + each row's scale * v @ B.T (v: (projections, T, R), lanes past
        an adapter's rank never read)."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(T, BM)
        per_group = GROUP * NP * NB  # a group: GROUP tiles of tokens by every projection's blocks of outputs
        first_m = (pid // per_group) * GROUP
        size_m = tl.minimum(tiles_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        pj, nb = pid_n // NB, pid_n % NB
        toks = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        cols = nb * BN + tl.arange(0, BN)
        mm, om = toks < T, cols < N
        wrow = (pj * N + cols % N).to(tl.int64)  # clamped: columns past N load a real row, never stored
        trow = toks % T
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            c = k0 + ks
            if EVEN_K:
                a = tl.load(X + trow[:, None] * sx + c[None, :])
                b = tl.load(W + wrow[None, :] * sw + c[:, None])
            else:
                a = tl.load(X + trow[:, None] * sx + c[None, :], mask=(c < K)[None, :], other=0.0)
                b = tl.load(W + wrow[None, :] * sw + c[:, None], mask=(c < K)[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
        lanes = tl.arange(0, R)
        m0 = pid_m * BM
        for row in range(m0 // per_row, (tl.minimum(m0 + BM, T) - 1) // per_row + 1):
            r, sc, bo = _adapter(IDS, RANK + _shift(pj, SR1, SR2), SCALE + _shift(pj, SS1, SS2),
                                 BOFF + _shift(pj, SB1, SB2), row)
            if r > 0:
                live = lanes < r
                mine = mm & (toks >= row * per_row) & (toks < (row + 1) * per_row)
                v = tl.load(V + (pj * T + toks[:, None]) * R + lanes[None, :], mask=mine[:, None] & live[None, :],
                            other=0.0)
                bt = tl.load(BUF + bo + lanes[:, None] * N + cols[None, :], mask=live[:, None] & om[None, :],
                             other=0.0)
                acc = tl.dot((v.to(tl.float32) * sc).to(v.dtype), bt, acc)
        if HAS_B:
            acc += tl.load(BIAS + pj * N + cols, mask=om, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + toks[:, None] * sy + (pj * N + cols)[None, :], acc.to(Y.dtype.element_ty),
                 mask=mm[:, None] & om[None, :])


def matmul_lora(xf: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, v: torch.Tensor, y: torch.Tensor,
                ids: torch.Tensor, p: LoraPack, per_row: int, stack: _Stack = NO_STACK) -> torch.Tensor:
    """y (tokens, out) = xf @ w.T + b plus each row's delta from v (the tiles' shrink: (tokens,
    R), or (projections, tokens, R) for a stack led by p, each projection onto its equal share
    of w's rows and y's columns); y may be a column slice of a wider tensor."""
    c = FUSED
    tokens, K = xf.shape
    n = stack.count
    N = w.shape[0] // n
    R = v.shape[-1]
    nb = triton.cdiv(N, c["bn"])
    bias = b if b is not None else w
    _matmul_lora[(triton.cdiv(tokens, c["bm"]) * n * nb,)](
        xf, w, bias, y, ids, p.buf, p.b_off, p.rank, p.scale, v, tokens, K, N, nb, n, per_row, xf.stride(0), w.stride(0),
        y.stride(0), *stack.b, *stack.rank, *stack.scale, R=R, BM=c["bm"], BN=c["bn"], BK=c["bk"], GROUP=c["group"],
        EVEN_K=K % c["bk"] == 0, HAS_B=b is not None, num_warps=c["warps"], num_stages=c["stages"])
    return y
