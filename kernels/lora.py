"""LoRA deltas for the rows of a batch, each row with its own adapter of its own rank (S-LoRA's
MBGMV/MBGMM, Punica's SGMV), Triton on CUDA, the torch reference elsewhere, behind one dispatch.

Knows: one adapted matmul's LoRA across a block's adapters as a `LoraPack`: every adapter's A
(rank, in) and B transposed (rank, out) live anywhere in one flat buffer, found by element
offsets, with a rank and a scale per adapter (rank 0 where an adapter leaves this matmul
alone), so no adapter is padded to the largest rank and adapters need not sit next to each
other (the pool pages them per adapter); adding scale * (x @ A_a.T) @ B_a.T to the rows of y
whose adapter is a (index -1: none). Two passes, as Punica and S-LoRA run them: shrink onto the
adapter's rank (partial results kept apart and summed in a fixed order, so results do not depend
on timing) and expand onto the outputs, added to y in place or (for plain base weights,
`lora_linears`) optionally written first with the base matmul added onto them. Rows of few tokens (decode)
go token by token, memory-bound: the shrink by rank lanes (each program one contiguous run of
A), or for a handful of tokens split over the inputs so they still fill the GPU; both passes
step through an adapter's own rank a few lanes at a time, so a rank-8 adapter costs what its
bytes cost and not the pool's largest rank; projections stacked in one weight (q, k, v; gate,
up) whose packs share the pool's buffer and tables go through one launch of each pass. Rows of
many tokens (prefill) go in tiles of tokens through tl.dot: the shrink reads each input once
(stacked projections too: their programs for one tile run side by side), the expand each
output once. Where the pool lays a matmul's adapters out as one matrix of rank lanes (`Dense`:
resident adapters), decode rows go densely instead: one cuBLAS matmul shrinks every token onto
every lane (beside the base matmul, on a stream of its own), a mask keeps each token's own
adapter's lanes times its scale, and one batched matmul for stacked projections (else one per
projection) adds their expansion to y. The lanes' bytes are read once, not once per token, and
a few launches replace the per-token passes, whose cost was their latency
(benchmarks/lora_step.py). Prefill rows in long runs of one adapter (a job's blocks group rows
by adapter), each row's adapter known on the host, go one run at a time through cuBLAS
(`_segment_deltas`), whose expand writes the outputs faster than the Triton expand over mixed
adapters does. Before either, prefill rows of a resident pool on a Hopper GPU (rows of whole
tiles, no bias) go through kernels.lora_matmul: the shrink times the scale, then the base
matmul with each tile's expand in its epilogue, so the deltas never go through memory.
Does not know: where adapters come from, which rows have which adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from flexoff.models.base import stacked
from flexoff.kernels.lora_matmul import first_lanes, fits, fused_matmul

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
    dense: "Dense | None" = None  # the same adapters as rank lanes of one matrix (a resident pool)

    def weights(self, a: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapter a's A (rank, fan_in) and B transposed (rank, fan_out)."""
        if self.leaves is not None and a in self.leaves:
            return self.leaves[a]
        r, ao, bo = self.ranks[a], self.a_offs[a], self.b_offs[a]
        return (self.buf[ao:ao + r * self.fan_in].view(r, self.fan_in),
                self.buf[bo:bo + r * self.fan_out].view(r, self.fan_out))


@dataclass
class Dense:
    """One matmul's adapters as rank lanes: each adapter's A rows and B transposed rows a run of
    lanes, lanes no adapter of the block holds marked -1 (finite values, scale 0)."""
    A: torch.Tensor  # (lanes, fan_in)
    B: torch.Tensor  # (lanes, fan_out): B transposed
    owner: torch.Tensor  # (lanes,) int32: the block's adapter whose lane it is, -1 for none
    scale: torch.Tensor  # (lanes,) float32: that adapter's scale


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


def _kernels(x: torch.Tensor) -> bool:
    """Whether the kernels serve: CUDA tensors where autograd does not record (a training
    sweep's recompute differentiates through the reference)."""
    return HAVE_TRITON and x.is_cuda and not torch.is_grad_enabled()


def lora_delta(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack,
               host_ids: tuple[int, ...] | None = None) -> torch.Tensor:
    """The dispatch for y = x's projection: the kernels or the reference."""
    if _kernels(x):
        return lora_delta_triton(x, y, ids, p)
    return lora_delta_ref(x, y, ids, p, host_ids)


# Tilings (benchmarks/lora.py --parts kernel compares others on the GPU). Decode rows (fewer
# than 16 tokens each) go token by token: a batch of `lanes_from` tokens or more shrinks by rank
# lanes (program: `rc` lanes of one token over `lane_k` inputs, 0: all of them; `bk` inputs per
# load), a smaller one by splits of `split_k` inputs (enough programs for a few tokens; every
# lane, `split_rc` at a time, `split_bk` inputs a step); the expand steps through the rank
# `erc` lanes at a time (0: the shrink's step) over `bn` outputs per program.
# Prefill rows go in tiles of `bm` tokens through tl.dot: `bk` inputs per shrink step; the
# expand's tiles of `ebm` tokens (0: `bm`) by `bn` outputs, `blocks` tiles of outputs per
# program, with `ewarps` warps (0: `warps`) and `estages` software pipeline stages.
DECODE = {"lanes_from": 16, "lane_k": 0, "split_k": 256, "bk": 512, "split_bk": 256, "rc": 8, "split_rc": 32,
          "erc": 0, "bn": 256, "warps": 4}
PREFILL = {"bm": 128, "bk": 64, "bn": 128, "ebm": 64, "blocks": 8, "warps": 8, "ewarps": 4, "estages": 3}
DENSE = True  # lora_linears, decode rows of packs with lanes (`Dense`): the dense matmuls, not the passes
BATCHED_EXPAND = True  # the dense way: a stack's expands as one batched matmul where lanes and widths match
WRITE_FIRST = True  # lora_linears, tiles: the deltas written first and the base matmul added onto them
SIDE_STREAM = True  # lora_linears, decode rows on CUDA: deltas beside the base matmul on a stream of their own
STACKED = True  # lora_linears, decode rows: stacked projections' deltas in one launch of each pass (`_stack`)
TILES_STACKED = True  # the same for tiles (prefill), whose shrink then reads each tile of x once for all
# lora_linears, tiles (prefill) with WRITE_FIRST, no bias, each row's adapter known on the host: where
# rows run in groups of one adapter (a job's blocks group them) of SEGMENT_TOKENS tokens or more on
# average, each group's deltas go through cuBLAS (`_segment_deltas`): "expand" (the Triton shrink,
# cuBLAS's expands), "both" (cuBLAS's shrinks too) or "off" (the Triton passes)
SEGMENTS = "both"
SEGMENT_TOKENS = 2048
# lora_linears, tiles (prefill): where kernels.lora_matmul `fits` (a resident pool on a Hopper GPU, rows of
# whole tiles, no bias), the base matmul with the deltas added in its epilogue, before segments or passes
FUSED = True


if HAVE_TRITON:
    @triton.jit
    def _adapter(IDS, RANK, SCALE, OFF, row):
        """Row's adapter: its rank (0 for rows on the base model), scale and where its matrix starts."""
        a = tl.load(IDS + row)
        safe = tl.maximum(a, 0)
        r = tl.where(a >= 0, tl.load(RANK + safe), 0)
        return r, tl.load(SCALE + safe), tl.load(OFF + safe)

    @triton.jit
    def _shift(pj, S1, S2):
        """Projection pj's table shift (elements) from projection 0's: 0, S1 or S2."""
        return tl.where(pj == 1, S1, tl.where(pj == 2, S2, 0))

    @triton.jit
    def _tok_shrink(X, IDS, W, AOFF, RANK, SCALE, V, per_row, K, sx, SPLIT, RP, LG, KS, NT, SA1, SA2, SR1, SR2,
                    BK: tl.constexpr, RC: tl.constexpr):
        """Decode pass one: program (token, group of LG rank lanes, split of KS inputs of
        projection pj) writes x[split] @ A[lanes, split].T to V, RC lanes at a time up to the
        adapter's own rank; groups past the rank do nothing. By lanes (LG = RC): each program
        reads one contiguous run of A; by splits (one group of every lane): a handful of tokens
        still fill the GPU. Stacked projections (q, k, v) share x and one launch: projection
        pj's offsets and ranks lie SA/SR elements from the first's (`_Stack`)."""
        tok, g, z = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        sp, pj = z % SPLIT, z // SPLIT
        r, _, ao = _adapter(IDS, RANK + _shift(pj, SR1, SR2), SCALE, AOFF + _shift(pj, SA1, SA2), tok // per_row)
        lo = g * LG
        if lo < r:
            ks = tl.arange(0, RC)
            cols = sp * KS + tl.arange(0, BK)
            for r0 in range(lo, tl.minimum(r, lo + LG), RC):
                live = r0 + ks < r
                acc = tl.zeros((RC, BK), tl.float32)
                for k0 in range(0, KS, BK):
                    c = cols + k0
                    cm = c < K
                    x = tl.load(X + tok * sx + c, mask=cm, other=0.0).to(tl.float32)
                    at = tl.load(W + ao + (r0 + ks)[:, None] * K + c[None, :], mask=live[:, None] & cm[None, :],
                                 other=0.0)
                    acc += at.to(tl.float32) * x[None, :]
                tl.store(V + ((pj * NT + tok) * SPLIT + sp) * RP + r0 + ks, tl.sum(acc, axis=1), mask=live)

    @triton.jit
    def _store(Y, B, ptr, d, outs, om, mask, r, sc, ADD: tl.constexpr, HAS_B: tl.constexpr):
        """y + scale * d (ADD), or scale * d + bias written over y (the base matmul adds itself
        afterwards); rows on the base model: untouched (ADD) or the bias alone. outs: the
        output columns (om: which exist), mask: which elements of y."""
        d = d * sc
        if ADD:
            mask = mask & ((outs * 0 + r) > 0)
            d += tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        else:
            d = tl.where((outs * 0 + r) > 0, d, 0.0)
            if HAS_B:
                d += tl.load(B + outs, mask=om, other=0.0).to(tl.float32)
        tl.store(ptr, d.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _tok_expand(Y, B, IDS, W, BOFF, RANK, SCALE, V, per_row, N, sy, SPLIT, RP, NT, SB1, SB2, SR1, SR2, SS1, SS2,
                    SP: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr, ADD: tl.constexpr, HAS_B: tl.constexpr):
        """Decode pass two: program (token, block of outputs, projection pj: its N columns from
        pj * N) sums the shrink's partials (in a fixed order: the result does not depend on
        timing) and expands them, RC lanes at a time."""
        tok, nb, pj = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        r, sc, bo = _adapter(IDS, RANK + _shift(pj, SR1, SR2), SCALE + _shift(pj, SS1, SS2),
                             BOFF + _shift(pj, SB1, SB2), tok // per_row)
        ks, ss = tl.arange(0, RC), tl.arange(0, SP)
        outs = nb * BN + tl.arange(0, BN)
        om = outs < N
        acc = tl.zeros((BN,), tl.float32)
        for r0 in range(0, r, RC):
            live = r0 + ks < r
            v = tl.sum(tl.load(V + ((pj * NT + tok) * SPLIT + ss[:, None]) * RP + r0 + ks[None, :],
                               mask=(ss < SPLIT)[:, None] & live[None, :], other=0.0), axis=0)
            bt = tl.load(W + bo + (r0 + ks)[:, None] * N + outs[None, :], mask=live[:, None] & om[None, :], other=0.0)
            acc += tl.sum(v[:, None] * bt.to(tl.float32), axis=0)
        col = pj * N
        _store(Y, B + col, Y + tok * sy + col + outs, acc, outs, om, om, r, sc, ADD, HAS_B)

    @triton.jit
    def _tile(IDS, RANK, SCALE, OFF, row, mb, per_row, R: tl.constexpr, BM: tl.constexpr):
        """Tile mb of row's tokens: the adapter's rank, scale and matrix, the tile's tokens and
        which exist, the rank lanes and which are live."""
        r, sc, off = _adapter(IDS, RANK, SCALE, OFF, row)
        ms = mb * BM + tl.arange(0, BM)
        ks = tl.arange(0, R)
        return r, sc, off, row * per_row + ms, ms < per_row, ks, ks < r

    @triton.jit
    def _tile_shrink(X, IDS, W, AOFF, RANK, SCALE, V, per_row, K, sx, NT, TILES, NP, SA1, SA2, SR1, SR2, SS1, SS2,
                     R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr):
        """Prefill pass one: program (projection pj of NP, tile of tokens, row) writes x @ A.T
        for the tile to V[pj] (in the compute dtype, as a matmul's output; R lanes per token,
        those past the rank never written; SCALED: times the adapter's scale, and every lane
        written, zeros past the rank and on rows of the base model), reading each input once.
        Projections vary fastest, then tiles: stacked projections' programs for one tile run
        side by side and read its x once from memory, a row's tiles read its adapter's A once
        (the others find them in L2; tiles ordered by row before, the shrink ran at 0.57 of
        the H100's copy bandwidth, 0.82 so ordered)."""
        pid = tl.program_id(0).to(tl.int64)
        pj, t = pid % NP, pid // NP
        r, sc, ao, toks, mm, ks, live = _tile(IDS, RANK + _shift(pj, SR1, SR2), SCALE + _shift(pj, SS1, SS2),
                                              AOFF + _shift(pj, SA1, SA2), t // TILES, t % TILES, per_row, R, BM)
        acc = tl.zeros((BM, R), tl.float32)
        if r > 0:
            for k0 in range(0, K, BK):
                c = k0 + tl.arange(0, BK)
                cm = c < K
                x = tl.load(X + toks[:, None] * sx + c[None, :], mask=mm[:, None] & cm[None, :], other=0.0)
                at = tl.load(W + ao + ks[None, :] * K + c[:, None], mask=live[None, :] & cm[:, None], other=0.0)
                acc += tl.dot(x, at)
        out = V + (pj * NT + toks[:, None]) * R + ks[None, :]
        if SCALED:
            tl.store(out, tl.where(live[None, :], acc * sc, 0.0).to(V.dtype.element_ty), mask=mm[:, None])
        elif r > 0:
            tl.store(out, acc.to(V.dtype.element_ty), mask=mm[:, None] & live[None, :])

    @triton.jit
    def _tile_expand(Y, B, IDS, W, BOFF, RANK, SCALE, V, per_row, N, sy, NT, NB, TILES, CH, NP, SB1, SB2, SR1, SR2,
                     SS1, SS2, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EB: tl.constexpr,
                     ADD: tl.constexpr, HAS_B: tl.constexpr):
        """Prefill pass two: program (row, projection pj of NP, chunk of EB blocks of BN
        outputs of its N columns from pj * N, tile of tokens) loads the tile's v once (lanes
        past the rank never read) and expands it onto each block in turn, so each program
        writes EB blocks of y. On the H200, 64 tokens by 128 outputs a tile with 4 warps wrote
        y at 0.45-0.54 of the copy bandwidth, 128 tokens with 8 warps at 0.32-0.36.
        Tiles vary fastest: a row's tiles run side by side and read each block of the
        adapter's B once from memory."""
        pid = tl.program_id(0).to(tl.int64)
        mb, t = pid % TILES, pid // TILES
        c, t = t % CH, t // CH
        pj, row = t % NP, t // NP
        r, sc, bo, toks, mm, ks, live = _tile(IDS, RANK + _shift(pj, SR1, SR2), SCALE + _shift(pj, SS1, SS2),
                                              BOFF + _shift(pj, SB1, SB2), row, mb, per_row, R, BM)
        v = tl.load(V + (pj * NT + toks[:, None]) * R + ks[None, :], mask=mm[:, None] & live[None, :], other=0.0)
        col = pj * N
        for nb in range(c * EB, tl.minimum(c * EB + EB, NB)):
            outs = nb * BN + tl.arange(0, BN)
            om = outs < N
            bt = tl.load(W + bo + ks[:, None] * N + outs[None, :], mask=live[:, None] & om[None, :], other=0.0)
            _store(Y, B + col, Y + toks[:, None] * sy + col + outs[None, :], tl.dot(v, bt), outs[None, :],
                   om[None, :], mm[:, None] & om[None, :], r, sc, ADD, HAS_B)


    @triton.jit
    def _lane_mask(V, IDS, OWNER, SCALE, per_row, L, sv, BL: tl.constexpr):
        """Program (token, block of BL lanes): v times the lane's scale where the lane is the
        token's adapter's, else 0."""
        tok, lb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        a = tl.load(IDS + tok // per_row)
        ls = lb * BL + tl.arange(0, BL)
        lm = ls < L
        own = tl.load(OWNER + ls, mask=lm, other=-1)
        v = tl.load(V + tok * sv + ls, mask=lm, other=0.0).to(tl.float32) * tl.load(SCALE + ls, mask=lm, other=0.0)
        tl.store(V + tok * sv + ls, tl.where((own == a) & (own >= 0), v, 0.0).to(V.dtype.element_ty), mask=lm)


class _Stack(NamedTuple):
    """Projections stacked in one weight (q, k and v; gate and up), of equal widths, whose packs
    share one buffer and whose tables lie in shared storage (the adapter pool's): how far each
    later projection's offsets, ranks and scales lie from the first's, in elements, so that one
    launch of each decode pass serves them all."""
    count: int
    a: tuple[int, int]  # projections 1 and 2 (0 where absent)
    b: tuple[int, int]
    rank: tuple[int, int]
    scale: tuple[int, int]


NO_STACK = _Stack(1, (0, 0), (0, 0), (0, 0), (0, 0))


def _stack(packs: Sequence[LoraPack], outs: Sequence[int], tiles: bool) -> _Stack | None:
    """The packs as one stack, where STACKED (TILES_STACKED for tiles) and they can go together:
    two or three of equal widths, fan-in and largest rank over one buffer, each table a view of
    the first's storage."""
    if not (TILES_STACKED if tiles else STACKED) or not 2 <= len(packs) <= 3 or len(set(outs)) != 1:
        return None
    p0 = packs[0]
    if any(p.buf.data_ptr() != p0.buf.data_ptr() or (p.fan_in, p.max_rank) != (p0.fan_in, p0.max_rank)
           for p in packs):
        return None

    def shifts(field: str) -> tuple[int, int] | None:
        t0 = getattr(p0, field)
        out = [0, 0]
        for i, p in enumerate(packs[1:]):
            t = getattr(p, field)
            d = t.data_ptr() - t0.data_ptr()
            if t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() or d % t.element_size():
                return None
            out[i] = d // t.element_size()
        return out[0], out[1]

    fields = [shifts(f) for f in ("a_off", "b_off", "rank", "scale")]
    if any(f is None for f in fields):
        return None
    return _Stack(len(packs), *fields)  # type: ignore[arg-type]


def lora_shrink(xf: torch.Tensor, ids: torch.Tensor, p: LoraPack, per_row: int, tiles: bool,
                stack: _Stack = NO_STACK, scaled: bool = False) -> torch.Tensor:
    """Pass one over x (tokens, in), rows of per_row tokens: each token's x @ A.T, as float32
    partial sums (tokens, splits, lanes) for token-by-token rows ((projections, tokens, splits,
    lanes) for a stack led by p), (tokens, lanes) in the compute dtype for tiles; `scaled`
    (tiles): times the scale, with zeros past each rank and on the base model's rows."""
    tokens, K = xf.shape
    n = stack.count
    if tiles:
        R = max(16, triton.next_power_of_2(max(p.max_rank, 1)))  # tl.dot takes 16 at least
        v = torch.empty(*((n,) if n > 1 else ()), tokens, R, dtype=p.buf.dtype, device=xf.device)
        bm, bk = _shrink_tile(R)
        tiles_per_row = triton.cdiv(per_row, bm)
        _tile_shrink[(n * tiles_per_row * (tokens // per_row),)](
            xf, ids, p.buf, p.a_off, p.rank, p.scale, v, per_row, K, xf.stride(0), tokens, tiles_per_row, n,
            *stack.a, *stack.rank, *stack.scale, R=R, BM=bm, BK=bk, SCALED=scaled, num_warps=PREFILL["warps"])
        return v
    t = _decode_tiling(tokens, K, p.max_rank)
    v = torch.empty(*((n,) if n > 1 else ()), tokens, t.splits, t.rp, dtype=torch.float32, device=xf.device)
    _tok_shrink[(tokens, t.rp // t.lg, t.splits * n)](xf, ids, p.buf, p.a_off, p.rank, p.scale, v, per_row, K,
                                                       xf.stride(0), t.splits, t.rp, t.lg, t.ks, tokens, *stack.a,
                                                       *stack.rank, BK=t.bk, RC=t.rc, num_warps=DECODE["warps"])
    return v


def lora_expand(v: torch.Tensor, yf: torch.Tensor, ids: torch.Tensor, p: LoraPack, per_row: int,
                add: bool = True, bias: torch.Tensor | None = None, stack: _Stack = NO_STACK) -> torch.Tensor:
    """Pass two onto y (tokens, out): y + scale * v @ B.T where `add`, else scale * v @ B.T
    (+ bias) written over y, every row (base rows: zeros or the bias); for a stack led by p,
    each projection onto its own equal share of y's columns."""
    tokens, N = yf.shape
    b = bias if bias is not None else yf
    n = stack.count
    N //= n
    if v.dim() - (n > 1) == 2:  # tiles: (tokens, lanes), led by projections for a stack
        c = PREFILL
        R = v.shape[-1]
        bm, bn = _expand_tile(R, v.element_size())
        nb, tiles = triton.cdiv(N, bn), triton.cdiv(per_row, bm)
        eb = min(c["blocks"], nb)
        chunks = triton.cdiv(nb, eb)
        _tile_expand[(tokens // per_row * n * chunks * tiles,)](
            yf, b, ids, p.buf, p.b_off, p.rank, p.scale, v, per_row, N, yf.stride(0), tokens, nb, tiles, chunks, n,
            *stack.b, *stack.rank, *stack.scale, R=R, BM=bm, BN=bn, EB=eb, ADD=add, HAS_B=bias is not None,
            num_warps=c["ewarps"] or c["warps"], num_stages=c["estages"])
        return yf
    c = DECODE
    split, rp = v.shape[-2], v.shape[-1]
    rc = c["erc"] or _lane_step(tokens)[1]
    _tok_expand[(tokens, triton.cdiv(N, c["bn"]), n)](yf, b, ids, p.buf, p.b_off, p.rank, p.scale, v, per_row, N,
                                                      yf.stride(0), split, rp, tokens, *stack.b, *stack.rank,
                                                      *stack.scale, SP=triton.next_power_of_2(split), BN=c["bn"],
                                                      RC=rc, ADD=add, HAS_B=bias is not None, num_warps=c["warps"])
    return yf


def _expand_tile(R: int, size: int) -> tuple[int, int]:
    """A prefill expand's tile, tokens by outputs, for R rank lanes of `size` bytes: halved in
    both past 128 bytes of lanes a token (fp16 past rank 64; shared memory)."""
    c = PREFILL
    bm, bn = c["ebm"] or c["bm"], c["bn"]
    return (bm, bn) if R * size <= 128 else (max(bm // 2, 16), max(bn // 2, 16))


def _shrink_tile(R: int) -> tuple[int, int]:
    """A prefill shrink's tile of tokens and inputs per step for R rank lanes (halved past 64:
    registers); the expand's is `_expand_tile`."""
    c = PREFILL
    return (c["bm"], c["bk"]) if R <= 64 else (c["bm"] // 2, c["bk"] // 2)


class _Decode(NamedTuple):
    """A decode shrink's tiling: rank lanes per program (lg) and per step (rc), lanes in V (rp),
    inputs per program (ks) and per load (bk), and the splits of the input."""
    lg: int
    rc: int
    rp: int
    ks: int
    bk: int
    splits: int


def _lane_step(tokens: int) -> tuple[bool, int, int]:
    """Whether a decode batch of this many tokens shrinks by rank lanes, the lanes a step of
    either pass takes, and the inputs a shrink step loads."""
    c = DECODE
    lanes = tokens >= c["lanes_from"]
    return (lanes, c["rc"], c["bk"]) if lanes else (lanes, c["split_rc"], c["split_bk"])


def _decode_tiling(tokens: int, K: int, max_rank: int) -> _Decode:
    """By rank lanes for `lanes_from` tokens or more (a program per rc lanes, over lane_k
    inputs), else by splits of the input (a program per split, over every lane)."""
    lanes, rc, bk = _lane_step(tokens)
    rp = triton.cdiv(max(max_rank, 1), rc) * rc
    ks = DECODE["lane_k" if lanes else "split_k"] or triton.cdiv(K, bk) * bk
    if ks % bk:  # a program's last step would reach into the next split
        raise ValueError(f"DECODE: {'lane_k' if lanes else 'split_k'} {ks} is not a multiple of its step {bk}")
    return _Decode(rc if lanes else rp, rc, rp, ks, bk, triton.cdiv(K, ks))


def _flat(x: torch.Tensor, ids: torch.Tensor, tiles: bool | None) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """x as (tokens, in) with unit stride, the ids as int32, tokens per row, and whether rows go in tiles."""
    xf = x.reshape(-1, x.shape[-1])
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    per_row = xf.shape[0] // x.shape[0]
    return xf, ids.to(torch.int32), per_row, tiles if tiles is not None else per_row >= 16


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, p: LoraPack,
                      tiles: bool | None = None) -> torch.Tensor:
    """The kernels, on any device Triton reaches (the CPU under TRITON_INTERPRET=1, for tests);
    y is updated in place and returned. Rows of 16 tokens or more go in tiles through tl.dot,
    shorter ones token by token (`tiles` forces either)."""
    xf, ids32, per_row, tiles = _flat(x, ids, tiles)
    lora_expand(lora_shrink(xf, ids32, p, per_row, tiles), y.view(-1, y.shape[-1]), ids32, p, per_row)
    return y


def lora_linears(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, outs: Sequence[int], ids: torch.Tensor,
                 packs: Sequence[LoraPack], host_ids: tuple[int, ...] | None = None,
                 kernels: bool | None = None) -> list[torch.Tensor]:
    """x @ w.T + b for projections stacked in w (`outs`: their widths; one, or q, k and v, or
    gate and up), each plus its rows' deltas from its own pack: one base matmul for all. With
    the kernels (where `_kernels` says, or `kernels` forces them): decode rows of packs with
    lanes (a resident pool's) go densely with DENSE (`_dense_linears`); other decode rows on a
    CUDA device with SIDE_STREAM compute the deltas on a stream of their own while the base
    matmul runs (neither fills the GPU's memory bandwidth alone at decode sizes) and add them
    after; prefill rows with FUSED, where kernels.lora_matmul `fits`, go through the base matmul
    with the deltas in its epilogue; other rows with WRITE_FIRST (the default) have the expands
    write scale * v @ B.T + b into each projection's columns and the base matmul add itself
    onto them (cuBLAS reads them in its epilogue, so y is read and written once less), else
    have the deltas added after the matmul; written first, rows in long runs of one adapter
    go by segments (`_segments`).
    Which way is faster at a shape changed from one H100 run to the next
    (`benchmarks/lora.py --parts kernel`); the 1000-adapter population ran the same either way."""
    if not (kernels if kernels is not None else _kernels(x)):
        return [lora_delta_ref(x, y, ids, p, host_ids) for y, p in zip(F.linear(x, w, b).split(list(outs), -1), packs)]
    xf, ids32, per_row, tiles = _flat(x, ids, None)
    if DENSE and not tiles and all(p.dense is not None for p in packs):
        return list(_dense_linears(xf, w, b, outs, ids32, packs, per_row).view(*x.shape[:-1], w.shape[0])
                    .split(list(outs), -1))

    stack = _stack(packs, outs, tiles)

    def deltas(y: torch.Tensor, add: bool, bias: torch.Tensor | None) -> None:
        if stack is not None:  # one launch of each pass for every projection
            v = lora_shrink(xf, ids32, packs[0], per_row, tiles, stack)
            lora_expand(v, y, ids32, packs[0], per_row, add, bias, stack)
            return
        c0 = 0
        for n, p in zip(outs, packs):
            lora_expand(lora_shrink(xf, ids32, p, per_row, tiles), y[:, c0:c0 + n], ids32, p, per_row, add,
                        bias[c0:c0 + n] if bias is not None else None)
            c0 += n

    fused = _fused_linears(xf, w, outs, ids32, packs, per_row, host_ids, stack) \
        if tiles and FUSED and fits(xf, w, b, outs, packs, per_row, host_ids) else None
    if fused is not None:
        y = fused
    elif SIDE_STREAM and not tiles and xf.is_cuda:
        main = torch.cuda.current_stream(xf.device)
        side = _side_stream(main)
        d = torch.empty(xf.shape[0], w.shape[0], dtype=x.dtype, device=x.device)  # on main: freed after the join
        side.wait_stream(main)
        with torch.cuda.stream(side):
            deltas(d, False, None)
        y = F.linear(xf, w, b)
        main.wait_stream(side)
        y += d
    elif WRITE_FIRST:
        y = torch.empty(xf.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        runs = _segments(host_ids, per_row, xf.shape[0]) if tiles and b is None else None
        if runs is not None:
            _segment_deltas(xf, y, ids32, per_row, packs, outs, runs, stack)
        else:
            deltas(y, False, b)
        y.addmm_(xf, w.t())
    else:
        y = F.linear(xf, w, b)
        deltas(y, True, None)
    return list(y.view(*x.shape[:-1], w.shape[0]).split(list(outs), -1))


def _fused_linears(xf: torch.Tensor, w: torch.Tensor, outs: Sequence[int], ids32: torch.Tensor,
                   packs: Sequence[LoraPack], per_row: int, host_ids: tuple[int, ...] | None, stack: _Stack | None
                   ) -> torch.Tensor | None:
    """Prefill rows through kernels.lora_matmul: the shrink times each adapter's scale (one
    launch for a stack), then each projection's base matmul with its deltas in the epilogue,
    onto its columns of y; None where the compiler refused the kernel (the other ways then)."""
    assert host_ids is not None
    if stack is not None:
        vs = list(lora_shrink(xf, ids32, packs[0], per_row, True, stack, scaled=True))
    else:
        vs = [lora_shrink(xf, ids32, p, per_row, True, scaled=True) for p in packs]
    y = torch.empty(xf.shape[0], w.shape[0], dtype=xf.dtype, device=xf.device)
    c0 = 0
    for n, p, v in zip(outs, packs, vs):
        assert p.dense is not None
        if not fused_matmul(xf, w[c0:c0 + n], v, p.dense.B, first_lanes(p, host_ids, per_row, xf.device),
                            y[:, c0:c0 + n]):
            return None
        c0 += n
    return y


class _Segment(NamedTuple):
    """Tokens [lo, hi) of rows that share one adapter (-1: the base model)."""
    lo: int
    hi: int
    adapter: int


def _segments(host_ids: tuple[int, ...] | None, per_row: int, tokens: int) -> list[_Segment] | None:
    """The rows as runs of one adapter, where SEGMENTS is on, the ids are known on the host and
    the runs average SEGMENT_TOKENS tokens or more; else None (the Triton passes)."""
    if SEGMENTS == "off" or host_ids is None or len(host_ids) * per_row != tokens:
        return None
    out: list[_Segment] = []
    for r, a in enumerate(host_ids):
        if out and out[-1].adapter == a:
            out[-1] = out[-1]._replace(hi=(r + 1) * per_row)
        else:
            out.append(_Segment(r * per_row, (r + 1) * per_row, a))
    return out if len(out) * SEGMENT_TOKENS <= tokens else None


def _spaced(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Contiguous tensors of one shape at equal distances in one storage as one (n, ...) view."""
    t0 = ts[0]
    if not all(t.is_contiguous() and t.shape == t0.shape and t.dtype == t0.dtype
               and t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() for t in ts):
        return None
    gaps = {b.data_ptr() - a.data_ptr() for a, b in zip(ts, ts[1:])}
    if len(gaps) != 1:
        return None
    gap = gaps.pop()
    if gap <= 0 or gap % t0.element_size():
        return None
    return t0.as_strided((len(ts), *t0.shape), (gap // t0.element_size(), *t0.stride()))


def _segment_deltas(xf: torch.Tensor, y: torch.Tensor, ids32: torch.Tensor, per_row: int,
                    packs: Sequence[LoraPack], outs: Sequence[int], runs: Sequence[_Segment],
                    stack: _Stack | None) -> None:
    """Each projection's deltas, scale * (x @ A.T) @ B.T, written over its columns of y (zeros
    for the base model's rows and for adapters that leave a projection alone), one segment of
    rows of one adapter at a time through cuBLAS, whose expands wrote an H200's prefill outputs
    at about 0.65 of the copy bandwidth where the Triton expand over mixed adapters reached
    about half. With SEGMENTS "expand" the shrink is still the Triton pass over every row (it
    reads x once for a stack), with "both" a cuBLAS matmul per segment. Projections of equal
    ranks, scales and widths whose A's and B's lie at equal distances (q, k and v; gate and up,
    in a resident pool's lanes) go as one batched matmul."""
    vs: list[torch.Tensor] | None = None  # the Triton shrink's output per projection
    v_all: torch.Tensor | None = None  # the same for a stack as one (projections, tokens, lanes)
    if SEGMENTS != "both":
        if stack is not None:
            v_all = lora_shrink(xf, ids32, packs[0], per_row, True, stack)
            vs = list(v_all)
        else:
            vs = [lora_shrink(xf, ids32, p, per_row, True) for p in packs]
    starts = [sum(outs[:i]) for i in range(len(outs))]
    for lo, hi, a in runs:
        if a < 0:
            y[lo:hi].zero_()
            continue
        x = xf[lo:hi]
        ranks = [p.ranks[a] for p in packs]
        if (len(packs) > 1 and len(set(ranks)) == 1 and ranks[0] and len({p.scales[a] for p in packs}) == 1
                and len(set(outs)) == 1 and (vs is None or v_all is not None)):
            As, Bs = zip(*(p.weights(a) for p in packs))
            B3 = _spaced(Bs)
            A3 = _spaced(As) if v_all is None else None
            if B3 is not None and (v_all is not None or A3 is not None):
                n, r, N = B3.shape
                # the shrink for all n at once, x broadcast to each (a batch stride of 0)
                v = v_all[:, lo:hi, :r] if A3 is None else torch.bmm(x.expand(n, *x.shape), A3.transpose(1, 2))
                y[lo:hi, :n * N].view(hi - lo, n, N).transpose(0, 1).baddbmm_(v, B3, beta=0,
                                                                            alpha=packs[0].scales[a])
                continue
        for i, (p, c, N) in enumerate(zip(packs, starts, outs)):
            out = y[lo:hi, c:c + N]
            if not ranks[i]:
                out.zero_()
                continue
            A, B = p.weights(a)
            v = x @ A.t() if vs is None else vs[i][lo:hi, :ranks[i]]
            out.addmm_(v, B, beta=0, alpha=p.scales[a])


def lane_mask_ref(v: torch.Tensor, ids: torch.Tensor, owner: torch.Tensor, scale: torch.Tensor,
                  per_row: int) -> torch.Tensor:
    """v (tokens, lanes) in place: each token's lanes of its row's adapter (ids, per row of
    per_row tokens) times their scale, every other lane 0."""
    a = ids.repeat_interleave(per_row)[:, None]
    keep = (owner[None, :] == a) & (owner[None, :] >= 0)
    wide = v if v.dtype == torch.float64 else v.float()  # the kernel's float32, float64 kept
    return v.copy_(torch.where(keep, wide * scale, 0.0))


def lane_mask_triton(v: torch.Tensor, ids: torch.Tensor, owner: torch.Tensor, scale: torch.Tensor,
                     per_row: int) -> torch.Tensor:
    """lane_mask_ref's kernel (ids int32; v's lanes of unit stride)."""
    tokens, lanes = v.shape
    bl = 1024
    _lane_mask[(tokens, triton.cdiv(lanes, bl))](v, ids, owner, scale, per_row, lanes, v.stride(0), BL=bl)
    return v


def lane_mask(v: torch.Tensor, ids: torch.Tensor, owner: torch.Tensor, scale: torch.Tensor,
              per_row: int) -> torch.Tensor:
    """The dispatch: the kernel on CUDA, else the reference."""
    if HAVE_TRITON and v.is_cuda:
        return lane_mask_triton(v, ids, owner, scale, per_row)
    return lane_mask_ref(v, ids, owner, scale, per_row)


class _Run(NamedTuple):
    """Packs whose lanes one matmul shrinks onto: their lane matrices, owners and scales as one
    each, and each pack's first lane in them."""
    A: torch.Tensor
    owner: torch.Tensor
    scale: torch.Tensor
    starts: list[int]


def _lane_runs(packs: Sequence[LoraPack]) -> list[_Run]:
    """The packs' lanes as runs: consecutive packs whose lane matrices, owners and scales lie
    side by side in memory (q, k, v in the pool's layout) as one run; any other pack a run of its own."""
    runs: list[_Run] = []
    for p in packs:
        d = p.dense
        assert d is not None
        if runs:
            r = runs[-1]
            A, owner, scale = stacked([r.A, d.A]), stacked([r.owner, d.owner]), stacked([r.scale, d.scale])
            if A is not None and owner is not None and scale is not None:
                runs[-1] = _Run(A, owner, scale, r.starts + [r.A.shape[0]])
                continue
        runs.append(_Run(d.A, d.owner, d.scale, [0]))
    return runs


def _dense_linears(xf: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, outs: Sequence[int],
                   ids32: torch.Tensor, packs: Sequence[LoraPack], per_row: int) -> torch.Tensor:
    """Decode rows through the packs' lanes (`Dense`): the shrink onto every lane and the mask
    (on a side stream beside the base matmul, with SIDE_STREAM on CUDA), then each projection's
    masked lanes expanded onto its columns of y."""
    runs = _lane_runs(packs)
    vs = [torch.empty(xf.shape[0], r.A.shape[0], dtype=xf.dtype, device=xf.device) for r in runs]  # on main

    def shrink() -> None:
        for r, v in zip(runs, vs):
            torch.mm(xf, r.A.t(), out=v)
            lane_mask(v, ids32, r.owner, r.scale, per_row)

    side = SIDE_STREAM and xf.is_cuda
    if side:
        main = torch.cuda.current_stream(xf.device)
        s = _side_stream(main)
        s.wait_stream(main)
        with torch.cuda.stream(s):
            shrink()
        y = F.linear(xf, w, b)
        main.wait_stream(s)
    else:
        shrink()
        y = F.linear(xf, w, b)
    c0, at = 0, 0
    for r, v in zip(runs, vs):
        mine, widths = packs[at:at + len(r.starts)], outs[at:at + len(r.starts)]
        if not (BATCHED_EXPAND and _batched_expand(y[:, c0:], v, mine, widths)):
            c = c0
            for lo, p, n in zip(r.starts, mine, widths):
                assert p.dense is not None
                y[:, c:c + n].addmm_(v[:, lo:lo + p.dense.A.shape[0]], p.dense.B)
                c += n
        c0 += sum(widths)
        at += len(r.starts)
    return y


def _batched_expand(y: torch.Tensor, v: torch.Tensor, packs: Sequence[LoraPack], outs: Sequence[int]) -> bool:
    """A run's expands as one batched matmul onto y's first columns, where its projections have
    equal lanes (v: theirs side by side) and widths and their B's lie at equal distances; whether it could."""
    n = len(packs)
    Bs = [p.dense.B for p in packs if p.dense is not None]
    B = _spaced(Bs) if n >= 2 and len(Bs) == n and len(set(outs)) == 1 else None
    if B is None:
        return False
    _, lanes, width = B.shape
    tokens = y.shape[0]
    y[:, :n * width].view(tokens, n, width).transpose(0, 1).baddbmm_(v.view(tokens, n, lanes).transpose(0, 1), B)
    return True


_SIDE: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(main: "torch.cuda.Stream") -> "torch.cuda.Stream":
    """The stream beside `main` that decode deltas run on (one per stream that computes)."""
    if main.cuda_stream not in _SIDE:
        _SIDE[main.cuda_stream] = torch.cuda.Stream(main.device)
    return _SIDE[main.cuda_stream]
