"""LoRA deltas for the rows of a batch, each row with its own adapter of its own rank (S-LoRA's
MBGMV/MBGMM, Punica's SGMV), Triton on CUDA, the torch reference elsewhere, behind one dispatch.

Knows: one adapted matmul's LoRA across a block's adapters as a `LoraPack`: every adapter's A
(rank, in) and B transposed (rank, out) live anywhere in one flat buffer, found by element
offsets, with a rank and a scale per adapter (rank 0 where an adapter leaves this matmul
alone), so no adapter is padded to the largest rank and adapters need not sit next to each
other (the pool pages them per adapter); adding scale * (x @ A_a.T) @ B_a.T to the rows of y
whose adapter is a (index -1: none). Two passes, as Punica and S-LoRA run them: shrink onto the
adapter's rank (partial results kept apart and summed in a fixed order, so results do not depend
on timing) and expand onto the outputs, added to y in place. Rows of one token (decode) go token
by token, memory-bound: the shrink split over the inputs so a few rows still fill the GPU, both
passes stepping through an adapter's own rank a few lanes at a time, so a rank-8 adapter costs
what its bytes cost and not the pool's largest rank. Rows of many tokens (prefill) go in tiles
of tokens through tl.dot: the shrink reads each input once, the expand each output once.
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


# Tilings (benchmarks/lora.py --parts kernel compares others on the GPU). Decode rows (fewer
# than 16 tokens) go token by token: `split_k` inputs per shrink program, `bk` of them per load,
# `rc` rank lanes per step of the adapter's own rank, `bn` outputs per expand program. Prefill
# rows go in tiles of `bm` tokens through tl.dot: `bk` inputs per shrink step, `bn` outputs per
# expand program.
DECODE = {"split_k": 512, "bk": 128, "rc": 16, "bn": 256, "warps": 4, "lanes": False, "whole": False}
PREFILL = {"bm": 64, "bk": 64, "bn": 128, "warps": 4, "nloop": False}


if HAVE_TRITON:
    @triton.jit
    def _adapter(IDS, RANK, SCALE, OFF, row):
        """Row's adapter: its rank (0 for rows on the base model), scale and where its matrix starts."""
        a = tl.load(IDS + row)
        safe = tl.maximum(a, 0)
        r = tl.where(a >= 0, tl.load(RANK + safe), 0)
        return r, tl.load(SCALE + safe), tl.load(OFF + safe)

    @triton.jit
    def _tok_shrink(X, IDS, W, AOFF, RANK, SCALE, V, per_row, K, sx, SPLIT, RP,
                    KS: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr):
        """Decode pass one: program (token, split) writes x[split] @ A[:, split].T to V, RC rank
        lanes at a time up to the adapter's own rank (no work for lanes past it)."""
        tok, sp = tl.program_id(0).to(tl.int64), tl.program_id(1)
        r, _, ao = _adapter(IDS, RANK, SCALE, AOFF, tok // per_row)
        ks = tl.arange(0, RC)
        cols = sp * KS + tl.arange(0, BK)
        for r0 in range(0, r, RC):
            live = r0 + ks < r
            acc = tl.zeros((RC, BK), tl.float32)
            for k0 in range(0, KS, BK):
                c = cols + k0
                cm = c < K
                x = tl.load(X + tok * sx + c, mask=cm, other=0.0).to(tl.float32)
                at = tl.load(W + ao + (r0 + ks)[:, None] * K + c[None, :], mask=live[:, None] & cm[None, :], other=0.0)
                acc += at.to(tl.float32) * x[None, :]
            tl.store(V + (tok * SPLIT + sp) * RP + r0 + ks, tl.sum(acc, axis=1), mask=live)

    @triton.jit
    def _tok_shrink_lanes(X, IDS, W, AOFF, RANK, SCALE, V, per_row, K, sx, RP,
                          BK: tl.constexpr, RC: tl.constexpr):
        """Decode pass one, by lanes: program (token, RC rank lanes) writes x @ A[lanes].T to V,
        reading those lanes' rows of A (one contiguous run of memory) over every input;
        programs past the adapter's rank do nothing."""
        tok, r0 = tl.program_id(0).to(tl.int64), tl.program_id(1) * RC
        r, _, ao = _adapter(IDS, RANK, SCALE, AOFF, tok // per_row)
        if r0 < r:
            ks = r0 + tl.arange(0, RC)
            live = ks < r
            acc = tl.zeros((RC, BK), tl.float32)
            for k0 in range(0, K, BK):
                c = k0 + tl.arange(0, BK)
                cm = c < K
                x = tl.load(X + tok * sx + c, mask=cm, other=0.0).to(tl.float32)
                at = tl.load(W + ao + ks[:, None] * K + c[None, :], mask=live[:, None] & cm[None, :], other=0.0)
                acc += at.to(tl.float32) * x[None, :]
            tl.store(V + tok * RP + ks, tl.sum(acc, axis=1), mask=live)

    @triton.jit
    def _tok_expand(Y, IDS, W, BOFF, RANK, SCALE, V, per_row, N, sy, SPLIT, RP,
                    SP: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr, RT: tl.constexpr, WHOLE: tl.constexpr):
        """Decode pass two: program (token, block of outputs) sums the splits' partials (in a fixed
        order: the result does not depend on timing) and adds scale * v @ B.T to them."""
        tok, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        r, sc, bo = _adapter(IDS, RANK, SCALE, BOFF, tok // per_row)
        ks, ss = tl.arange(0, RC), tl.arange(0, SP)
        outs = nb * BN + tl.arange(0, BN)
        om = outs < N
        if WHOLE:  # every lane up to RT in one load (lanes past the rank masked, never read)
            kt = tl.arange(0, RT)
            lt = kt < r
            v = tl.sum(tl.load(V + (tok * SPLIT + ss[:, None]) * RP + kt[None, :],
                               mask=(ss < SPLIT)[:, None] & lt[None, :], other=0.0), axis=0)
            bt = tl.load(W + bo + kt[:, None] * N + outs[None, :], mask=lt[:, None] & om[None, :], other=0.0)
            d = tl.sum(v[:, None] * bt.to(tl.float32), axis=0)
        else:
            acc = tl.zeros((RC, BN), tl.float32)
            for r0 in range(0, r, RC):
                live = r0 + ks < r
                v = tl.sum(tl.load(V + (tok * SPLIT + ss[:, None]) * RP + r0 + ks[None, :],
                                   mask=(ss < SPLIT)[:, None] & live[None, :], other=0.0), axis=0)
                bt = tl.load(W + bo + (r0 + ks)[:, None] * N + outs[None, :], mask=live[:, None] & om[None, :], other=0.0)
                acc += v[:, None] * bt.to(tl.float32)
            d = tl.sum(acc, axis=0)
        ym = om & (outs * 0 + r > 0)
        ptr = Y + tok * sy + outs
        y = tl.load(ptr, mask=ym, other=0.0).to(tl.float32)
        tl.store(ptr, (y + d * sc).to(Y.dtype.element_ty), mask=ym)

    @triton.jit
    def _tile(IDS, RANK, SCALE, OFF, per_row, R: tl.constexpr, BM: tl.constexpr):
        """Program (row, tile of its tokens): the adapter's rank, scale and matrix, the tile's
        tokens and which exist, the rank lanes and which are live."""
        row, mb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        r, sc, off = _adapter(IDS, RANK, SCALE, OFF, row)
        ms = mb * BM + tl.arange(0, BM)
        ks = tl.arange(0, R)
        return r, sc, off, row * per_row + ms, ms < per_row, ks, ks < r

    @triton.jit
    def _tile_shrink(X, IDS, W, AOFF, RANK, SCALE, V, per_row, K, sx,
                     R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        """Prefill pass one: program (row, tile of tokens) writes x @ A.T for the tile to V
        (float32, R lanes per token), reading each input once."""
        r, _, ao, toks, mm, ks, live = _tile(IDS, RANK, SCALE, AOFF, per_row, R, BM)
        if r > 0:
            acc = tl.zeros((BM, R), tl.float32)
            for k0 in range(0, K, BK):
                c = k0 + tl.arange(0, BK)
                cm = c < K
                x = tl.load(X + toks[:, None] * sx + c[None, :], mask=mm[:, None] & cm[None, :], other=0.0)
                at = tl.load(W + ao + ks[None, :] * K + c[:, None], mask=live[None, :] & cm[:, None], other=0.0)
                acc += tl.dot(x, at)
            tl.store(V + toks[:, None] * R + ks[None, :], acc, mask=mm[:, None])

    @triton.jit
    def _tile_add(Y, W, bo, sc, v, toks, mm, live, ks, n0, N, sy, BN: tl.constexpr):
        """Adds scale * v @ B.T[:, n0:n0 + BN] to the tile's rows of y."""
        outs = n0 + tl.arange(0, BN)
        om = outs < N
        bt = tl.load(W + bo + ks[:, None] * N + outs[None, :], mask=live[:, None] & om[None, :], other=0.0)
        d = tl.dot(v, bt)
        ym = mm[:, None] & om[None, :]
        ptr = Y + toks[:, None] * sy + outs[None, :]
        y = tl.load(ptr, mask=ym, other=0.0).to(tl.float32)
        tl.store(ptr, (y + d * sc).to(Y.dtype.element_ty), mask=ym)

    @triton.jit
    def _tile_expand(Y, IDS, W, BOFF, RANK, SCALE, V, per_row, N, sy,
                     R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NLOOP: tl.constexpr):
        """Prefill pass two: program (row, tile of tokens[, block of outputs]) adds
        scale * v @ B.T (v rounded to the compute dtype, as two matmuls would) to y: to one
        block of outputs, or (NLOOP) to every block in turn, reading v once."""
        r, sc, bo, toks, mm, ks, live = _tile(IDS, RANK, SCALE, BOFF, per_row, R, BM)
        if r > 0:
            v = tl.load(V + toks[:, None] * R + ks[None, :], mask=mm[:, None], other=0.0).to(W.dtype.element_ty)
            if NLOOP:
                for n0 in range(0, N, BN):
                    _tile_add(Y, W, bo, sc, v, toks, mm, live, ks, n0, N, sy, BN)
            else:
                _tile_add(Y, W, bo, sc, v, toks, mm, live, ks, tl.program_id(2) * BN, N, sy, BN)


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack,
                      tiles: bool | None = None) -> torch.Tensor:
    """The kernels, on any device Triton reaches (the CPU under TRITON_INTERPRET=1, for tests);
    y is updated in place and returned. Rows of 16 tokens or more go in tiles through tl.dot,
    shorter ones token by token (`tiles` forces either)."""
    n = x.shape[0]
    xf = x.reshape(-1, x.shape[-1])
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    yf = y.view(-1, y.shape[-1])  # y is the fresh output of the base matmul: contiguous
    tokens, K, N = xf.shape[0], xf.shape[1], yf.shape[1]
    per_row = tokens // n
    ids32 = ids.to(torch.int32)
    if tiles if tiles is not None else per_row >= 16:
        c = PREFILL
        R = max(16, triton.next_power_of_2(max(p.max_rank, 1)))
        bm = c["bm"] if R <= 64 else c["bm"] // 2
        v = torch.empty(tokens, R, dtype=torch.float32, device=x.device)
        grid = (n, triton.cdiv(per_row, bm))
        _tile_shrink[grid](xf, ids32, p.buf, p.a_off, p.rank, p.scale, v, per_row, K, xf.stride(0),
                           R=R, BM=bm, BK=c["bk"] if R <= 64 else c["bk"] // 2, num_warps=c["warps"])
        _tile_expand[grid if c["nloop"] else grid + (triton.cdiv(N, c["bn"]),)](
            yf, ids32, p.buf, p.b_off, p.rank, p.scale, v, per_row, N, yf.stride(0), R=R, BM=bm, BN=c["bn"],
            NLOOP=c["nloop"], num_warps=c["warps"])
        return y
    c = DECODE
    rc = c["rc"]
    rp = triton.cdiv(max(p.max_rank, 1), rc) * rc
    split = 1 if c["lanes"] else triton.cdiv(K, c["split_k"])
    v = torch.empty(tokens, split, rp, dtype=torch.float32, device=x.device)
    if c["lanes"]:
        _tok_shrink_lanes[(tokens, rp // rc)](xf, ids32, p.buf, p.a_off, p.rank, p.scale, v, per_row, K, xf.stride(0),
                                              rp, BK=c["bk"], RC=rc, num_warps=c["warps"])
    else:
        _tok_shrink[(tokens, split)](xf, ids32, p.buf, p.a_off, p.rank, p.scale, v, per_row, K, xf.stride(0), split,
                                     rp, KS=c["split_k"], BK=c["bk"], RC=rc, num_warps=c["warps"])
    _tok_expand[(tokens, triton.cdiv(N, c["bn"]))](yf, ids32, p.buf, p.b_off, p.rank, p.scale, v, per_row, N,
                                                   yf.stride(0), split, rp, SP=triton.next_power_of_2(split),
                                                   BN=c["bn"], RC=rc, RT=triton.next_power_of_2(rp),
                                                   WHOLE=c["whole"], num_warps=c["warps"])
    return y
