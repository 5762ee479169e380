"""LoRA deltas for the rows of a batch, each row with its own adapter of its own rank (S-LoRA's
MBGMV/MBGMM, Punica's SGMV), Triton on CUDA, the torch reference elsewhere, behind one dispatch.

Knows: one adapted matmul's LoRA across a block's adapters as a `LoraPack`: every adapter's A
(rank, in) and B transposed (rank, out) live anywhere in one flat buffer, found by element
offsets, with a rank and a scale per adapter (rank 0 where an adapter leaves this matmul
alone), so no adapter is padded to the largest rank and adapters need not sit next to each
other (the pool pages them per adapter); adding scale * (x @ A_a.T) @ B_a.T to the rows of y
whose adapter is a (index -1: none). Where rows have many tokens (prefill) and make enough tiles to fill the GPU, one program per
row and tile of its tokens shrinks onto the adapter's rank and expands onto every output,
reading its adapter once per tile; decode steps run in two passes, as Punica and S-LoRA do: shrink (split over the input so a
few rows still fill the GPU, partial sums kept apart so the result does not depend on
timing) and expand (the rank onto the outputs, added to y in place). Decode rows (one token) reduce
with plain sums; rows of many tokens (prefill) multiply tiles with tl.dot, reading each
adapter tile once per tile of tokens.
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
    """One matmul's LoRA weights across a block's adapters."""
    buf: torch.Tensor  # flat, the compute dtype: holds every adapter's A and B transposed
    a_off: torch.Tensor  # (adapters,) int64: where each adapter's A (rank, fan_in) starts in buf
    b_off: torch.Tensor  # (adapters,) int64: where its B transposed (rank, fan_out) starts
    rank: torch.Tensor  # (adapters,) int32
    scale: torch.Tensor  # (adapters,) float32
    fan_in: int
    fan_out: int
    max_rank: int  # the largest rank this pack may hold (the kernels' tile)
    ranks: tuple[int, ...] = ()  # the same ranks, offsets and scalings on the host, exactly
    a_offs: tuple[int, ...] = ()
    b_offs: tuple[int, ...] = ()
    scales: tuple[float, ...] = ()
    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # autograd leaves replacing buf's views

    def weights(self, a: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapter a's A (rank, fan_in) and B transposed (rank, fan_out)."""
        if self.leaves is not None and a in self.leaves:
            return self.leaves[a]
        r, ao, bo = self.ranks[a], self.a_offs[a], self.b_offs[a]
        return (self.buf[ao:ao + r * self.fan_in].view(r, self.fan_in),
                self.buf[bo:bo + r * self.fan_out].view(r, self.fan_out))


def lora_delta_ref(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack,
                   host_ids: tuple[int, ...] | None = None) -> torch.Tensor:
    """y plus each row's adapter delta: x (n, ..., in), y (n, ..., out), ids (n,) adapter per row;
    `host_ids`, the same on the host, spares reading ids back (a wait for the device)."""
    hid = host_ids if host_ids is not None else tuple(ids.tolist())
    for a in sorted(set(hid) - {-1}):
        if p.ranks[a] == 0:
            continue
        A, Bt = p.weights(a)
        rows = [r for r, i in enumerate(hid) if i == a]
        if len(rows) == x.shape[0]:  # every row on this adapter (a training batch): no gathers
            y = y + (F.linear(F.linear(x, A), Bt.t()) * p.scales[a]).to(y.dtype)
            continue
        at = torch.tensor(rows, device=x.device)
        d = F.linear(F.linear(x.index_select(0, at), A), Bt.t())
        y = y.index_add(0, at, (d * p.scales[a]).to(y.dtype))
    return y


def lora_delta(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack,
               host_ids: tuple[int, ...] | None = None) -> torch.Tensor:
    """The dispatch: the kernels for CUDA tensors, the reference elsewhere and wherever autograd
    records (a training sweep's recompute differentiates through it)."""
    if HAVE_TRITON and x.is_cuda and not torch.is_grad_enabled():
        return lora_delta_triton(x, y, ids, p)
    return lora_delta_ref(x, y, ids, p, host_ids)


SPLIT_K = 512  # input features one shrink program reduces


if HAVE_TRITON:
    @triton.jit
    def _row(IDS, RANK, SCALE, per_row, row, mb, R: tl.constexpr, BM: tl.constexpr):
        """A program's row: its adapter (clamped index), rank and scale, its tile of tokens and
        which are live (rows on the base model have none), and the rank lanes in use."""
        a = tl.load(IDS + row)
        safe = tl.maximum(a, 0)
        r = tl.where(a >= 0, tl.load(RANK + safe), 0)
        ms = mb * BM + tl.arange(0, BM)
        mlive = (ms < per_row) & ((ms * 0 + r) > 0)
        ks = tl.arange(0, R)
        return safe, tl.load(SCALE + safe), row * per_row + ms, ms < per_row, mlive, ks, ks < r

    @triton.jit
    def _shrink_tile(X, W, ao, toks, mlive, ks, live, k_lo, K, sx, KS: tl.constexpr, R: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
        """The tile's tokens times the adapter's A over inputs [k_lo, k_lo + KS): (BM, R) float32."""
        acc = tl.zeros((BM, R), tl.float32)
        for k0 in range(0, KS, BK):
            cols = k_lo + k0 + tl.arange(0, BK)
            cm = cols < K
            x = tl.load(X + toks[:, None] * sx + cols[None, :], mask=mlive[:, None] & cm[None, :], other=0.0)
            at = tl.load(W + ao + ks[None, :] * K + cols[:, None], mask=live[None, :] & cm[:, None], other=0.0)
            if DOT:
                acc += tl.dot(x, at)
            else:
                acc += tl.sum(x[:, :, None].to(tl.float32) * at[None, :, :].to(tl.float32), axis=1)
        return acc

    @triton.jit
    def _expand_tile(Y, W, bo, sc, v, toks, mlive, ks, live, n0, N, sy, BN: tl.constexpr, DOT: tl.constexpr):
        """Adds scale * v @ (the adapter's B transposed)[:, n0:n0 + BN] to the tile's rows of Y."""
        outs = n0 + tl.arange(0, BN)
        om = outs < N
        bt = tl.load(W + bo + ks[:, None] * N + outs[None, :], mask=live[:, None] & om[None, :], other=0.0)
        if DOT:
            d = tl.dot(v.to(bt.dtype), bt)
        else:
            d = tl.sum(v[:, :, None] * bt[None, :, :].to(tl.float32), axis=1)
        ym = mlive[:, None] & om[None, :]
        ptr = Y + toks[:, None] * sy + outs[None, :]
        y = tl.load(ptr, mask=ym, other=0.0).to(tl.float32)
        tl.store(ptr, (y + d * sc).to(Y.dtype.element_ty), mask=ym)

    @triton.jit
    def _shrink(X, IDS, W, AOFF, RANK, SCALE, V, per_row, K, sx, SPLIT,
                R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, DOT: tl.constexpr):
        """Pass one: program (row, token tile, split) writes its split's partial shrink to V."""
        row, mb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        a, _, toks, mrow, mlive, ks, live = _row(IDS, RANK, SCALE, per_row, row, mb, R, BM)
        acc = _shrink_tile(X, W, tl.load(AOFF + a), toks, mlive, ks, live, sp * KS, K, sx, KS, R, BM, BK, DOT)
        tl.store(V + (toks[:, None] * SPLIT + sp) * R + ks[None, :], acc, mask=mrow[:, None])

    @triton.jit
    def _expand(Y, IDS, W, BOFF, RANK, SCALE, V, per_row, N, sy, SPLIT,
                R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr):
        """Pass two: program (row, token tile, block of outputs) sums the partials and expands."""
        row, mb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        a, sc, toks, _, mlive, ks, live = _row(IDS, RANK, SCALE, per_row, row, mb, R, BM)
        v = tl.zeros((BM, R), tl.float32)
        for s in range(0, SPLIT):
            v += tl.load(V + (toks[:, None] * SPLIT + s) * R + ks[None, :], mask=mlive[:, None], other=0.0)
        _expand_tile(Y, W, tl.load(BOFF + a), sc, v, toks, mlive, ks, live, nb * BN, N, sy, BN, DOT)

    @triton.jit
    def _fused(X, Y, IDS, W, AOFF, BOFF, RANK, SCALE, per_row, K, N, sx, sy, KP: tl.constexpr,
               R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr):
        """One pass: program (row, tile of its tokens) shrinks over all inputs (K rounded up to
        KP), then expands onto every output, reading the row's adapter once."""
        row, mb = tl.program_id(0), tl.program_id(1)
        a, sc, toks, _, mlive, ks, live = _row(IDS, RANK, SCALE, per_row, row, mb, R, BM)
        v = _shrink_tile(X, W, tl.load(AOFF + a), toks, mlive, ks, live, 0, K, sx, KP, R, BM, BK, DOT)
        bo = tl.load(BOFF + a)
        for n0 in range(0, N, BN):
            _expand_tile(Y, W, bo, sc, v, toks, mlive, ks, live, n0, N, sy, BN, DOT)


FUSED_PROGRAMS = 64  # prefill: at least this many (row, token tile) programs for one pass
# decode tiles (one token per row): inputs per shrink step, outputs per expand step, warps
# (benchmarks/lora.py --parts kernel on the H200: the two-pass form with 128 and 256 beat every
# one-pass tiling at 8 and 128 rows but one, so decode runs two passes; prefill tiles one pass)
DECODE = {"split_bk": 128, "split_bn": 256, "fused_bk": 256, "fused_bn": 256, "warps": 4}


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack,
                      fused: bool | None = None) -> torch.Tensor:
    """The kernels, on any device Triton reaches (the CPU under TRITON_INTERPRET=1, for tests);
    y is updated in place and returned. One pass where the rows' tiles make enough programs (or
    `fused` says so), else shrink split over the inputs and expand."""
    n = x.shape[0]
    xf = x.reshape(-1, x.shape[-1])
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    yf = y.view(-1, y.shape[-1])  # y is the fresh output of the base matmul: contiguous
    tokens, K, N = xf.shape[0], xf.shape[1], yf.shape[1]
    per_row = tokens // n
    R = max(16, triton.next_power_of_2(max(p.max_rank, 1)))
    dot = per_row >= 16  # many tokens per row: tiles through tl.dot
    BM = (64 if R <= 32 else 32) if dot else 1
    mblocks = triton.cdiv(per_row, BM)
    ids32 = ids.to(torch.int32)
    c = DECODE
    warps = 4 if dot else c["warps"]
    if fused if fused is not None else (dot and n * mblocks >= FUSED_PROGRAMS):
        bk = (32 if R >= 64 else 64) if dot else c["fused_bk"]
        _fused[(n, mblocks)](xf, yf, ids32, p.buf, p.a_off, p.b_off, p.rank, p.scale, per_row, K, N,
                             xf.stride(0), yf.stride(0), KP=triton.cdiv(K, bk) * bk, R=R, BM=BM, BK=bk,
                             BN=64 if dot else c["fused_bn"], DOT=dot, num_warps=warps)
        return y
    split = triton.cdiv(K, SPLIT_K)
    v = torch.empty(tokens, split, R, dtype=torch.float32, device=x.device)
    _shrink[(n, mblocks, split)](xf, ids32, p.buf, p.a_off, p.rank, p.scale, v, per_row, K, xf.stride(0), split,
                                 R=R, BM=BM, BK=32 if dot else c["split_bk"], KS=SPLIT_K, DOT=dot, num_warps=warps)
    BN = ((64 if R <= 32 else 32) if dot else c["split_bn"])
    _expand[(n, mblocks, triton.cdiv(N, BN))](yf, ids32, p.buf, p.b_off, p.rank, p.scale, v, per_row, N,
                                              yf.stride(0), split, R=R, BM=BM, BN=BN, DOT=dot, num_warps=warps)
    return y
