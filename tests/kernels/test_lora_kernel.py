"""The LoRA kernels (token by token, and in tiles of tokens) against their reference and against plain matmuls (on the CPU via
TRITON_INTERPRET=1): adapters of mixed ranks scattered through one buffer (in another order,
with gaps), rows on the base model among them, decode shapes (one token per row) and prefill
shapes (tiles through tl.dot), odd sizes and dtypes."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from flexoff.kernels import lora as L

pytestmark = pytest.mark.skipif(not L.HAVE_TRITON, reason="triton is not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU through TRITON_INTERPRET (conftest)


def scattered(ranks: list[int], fin: int, fout: int, dtype: torch.dtype, seed: int):
    """A pack whose adapters lie in reverse order with gaps, and each adapter's (A, B, scale)."""
    g = torch.Generator().manual_seed(seed)
    mats = [(torch.randn(r, fin, generator=g), torch.randn(fout, r, generator=g), 0.5 + i)
            for i, r in enumerate(ranks)]
    buf = torch.full((sum(r * (fin + fout) + 7 for r in ranks) + 3,), float("nan"), dtype=dtype)
    at, a_off, b_off = 3, [0] * len(ranks), [0] * len(ranks)
    for i in reversed(range(len(ranks))):
        A, B, _ = mats[i]
        r = ranks[i]
        a_off[i], b_off[i] = at, at + r * fin + 5
        buf[a_off[i]:a_off[i] + r * fin] = A.flatten().to(dtype)
        buf[b_off[i]:b_off[i] + r * fout] = B.t().flatten().to(dtype)
        at = b_off[i] + r * fout + 2
    pack = L.LoraPack(buf.to(DEV), torch.tensor(a_off, device=DEV), torch.tensor(b_off, device=DEV),
                      torch.tensor(ranks, dtype=torch.int32, device=DEV),
                      torch.tensor([m[2] for m in mats], dtype=torch.float32, device=DEV), fin, fout, max(ranks),
                      tuple(ranks), tuple(a_off), tuple(b_off), tuple(m[2] for m in mats))
    return pack, mats


@pytest.mark.parametrize("n,s,fin,fout,ranks,ids", [
    (5, 1, 37, 70, [3, 16, 0, 1], [0, -1, 1, 3, 0]),
    (3, 4, 600, 33, [8, 64], [1, 0, -1]),
    (2, 1, 130, 96, [256, 2], [0, 1]),
    (4, 2, 16, 16, [5], [-1, -1, 0, -1]),
    (3, 20, 45, 70, [4, 32, 0], [1, 2, 0]),  # prefill: tl.dot tiles, a partial tile
    (2, 70, 520, 40, [64, 8], [0, 1]),  # prefill: two tiles of tokens, two splits of the input
    (3, 17, 1100, 300, [100, 24, 7], [2, 0, 1]),  # three splits, rank lanes in several steps, R=128
    (20, 1, 300, 50, [8, 16, 3], [0, 1, 2, -1] * 5),  # decode rows enough to shrink by rank lanes
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", [False, True], ids=["tokens", "tiles"])
def test_kernel_equals_reference_and_matmuls(n, s, fin, fout, ranks, ids, dtype, tiles):
    torch.manual_seed(n * 7 + fin)
    p, mats = scattered(ranks, fin, fout, dtype, n + s)
    x = torch.randn(n, s, fin).to(dtype)
    y = torch.randn(n, s, fout).to(dtype)
    idx = torch.tensor(ids, dtype=torch.int32)
    want = L.lora_delta_ref(x.to(DEV), y.to(DEV).clone(), idx.to(DEV), p).cpu()
    got = L.lora_delta_triton(x.to(DEV), y.to(DEV).clone(), idx.to(DEV), p, tiles=tiles).cpu()
    plain = y.double().clone()  # each row's delta from its own adapter, in float64
    for r, a in enumerate(ids):
        if a >= 0 and ranks[a]:
            A, B, sc = mats[a]
            plain[r] += sc * (x[r].double() @ A.to(dtype).double().t()) @ B.to(dtype).double().t()
    tol = (1e-4 if DEV == "cpu" else 2e-3) if dtype == torch.float32 else 2e-2  # TF32 in tl.dot on a GPU
    scale = plain.abs().max()
    assert (got.double() - plain).abs().max() <= tol * scale
    assert (want.double() - plain).abs().max() <= tol * scale
    base_rows = [r for r, a in enumerate(ids) if a < 0 or ranks[a] == 0]
    assert torch.equal(got[base_rows], y[base_rows])  # rows without LoRA untouched


@pytest.mark.parametrize("n,s,ranks,ids", [(6, 1, [4, 16], [1, -1, 0, 0, 1, -1]),
                                           (20, 1, [8, 3], [0, 1, -1, 1] * 5),
                                           (3, 18, [32, 5], [-1, 1, 0])])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("first", [True, False], ids=["delta-first", "delta-after"])
def test_stacked_projections_with_deltas_equal_matmul_plus_reference(n, s, ranks, ids, bias, first, monkeypatch):
    """lora_linears through the kernels (two projections stacked in one weight, each with its
    own adapters; the deltas written first and the matmul added onto them, or added after)
    against the matmul plus the reference's deltas; rows on the base model get the plain
    projection."""
    torch.manual_seed(n + s)
    fin, outs = 70, [90, 33]
    packs = [scattered(ranks, fin, fout, torch.float32, n + i)[0] for i, fout in enumerate(outs)]
    x = torch.randn(n, s, fin, device=DEV)
    w = torch.randn(sum(outs), fin, device=DEV)
    b = torch.randn(sum(outs), device=DEV) if bias else None
    idx = torch.tensor(ids, dtype=torch.int32, device=DEV)
    want = [L.lora_delta_ref(x, y, idx, p) for y, p in zip(F.linear(x, w, b).split(outs, -1), packs)]
    monkeypatch.setattr(L, "WRITE_FIRST", first)
    got = L.lora_linears(x, w, b, outs, idx, packs, kernels=True)
    tol = 1e-4 if DEV == "cpu" else 2e-3
    for g, r in zip(got, want):
        assert g.shape == r.shape
        assert (g - r).abs().max() <= tol * r.abs().max()


@pytest.mark.parametrize("tiling", [{"lane_k": 128, "bk": 64}, {"lane_k": 64, "bk": 64, "rc": 32, "bn": 32},
                                    {"lanes_from": 1, "lane_k": 256, "bk": 128, "rc": 16},
                                    {"lanes_from": 64, "split_k": 128, "split_bk": 64, "split_rc": 8},
                                    {"erc": 32, "bn": 64}, {"lanes_from": 64, "erc": 16}],
                         ids=["lane-splits", "lane-splits-wide", "lanes-for-few", "splits", "wide-expand",
                              "splits-expand-16"])
def test_decode_tilings_equal_reference(tiling, monkeypatch):
    """Every decode tiling the benchmark may pick (rank lanes over splits of the input, wide
    lane steps, splits for a few tokens) gives the reference's deltas; a split that is not a
    whole number of steps is refused."""
    monkeypatch.setattr(L, "DECODE", {**L.DECODE, **tiling})
    ranks, ids = [8, 16, 3, 64, 0], [0, 1, 2, -1, 3, 4, 3, 1] * 3
    p, _ = scattered(ranks, 300, 70, torch.float32, 5)
    x = torch.randn(len(ids), 1, 300, device=DEV)
    y = torch.randn(len(ids), 1, 70, device=DEV)
    idx = torch.tensor(ids, dtype=torch.int32, device=DEV)
    want = L.lora_delta_ref(x, y.clone(), idx, p)
    got = L.lora_delta_triton(x, y.clone(), idx, p, tiles=False)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    monkeypatch.setattr(L, "DECODE", {**L.DECODE, "lane_k": 100, "split_k": 100})
    with pytest.raises(ValueError, match="not a multiple"):
        L.lora_delta_triton(x, y.clone(), idx, p, tiles=False)


@pytest.mark.parametrize("tiling", [{"bn": 16, "blocks": 3}, {"bn": 32, "blocks": 1, "ewarps": 4},
                                    {"bm": 16, "bn": 16, "blocks": 8},
                                    {"ebm": 16, "bn": 32, "blocks": 2, "ewarps": 2, "estages": 3}],
                         ids=["chunks-partial", "block-a-program", "small-tiles-one-chunk", "expand-tiles-apart"])
def test_prefill_tilings_equal_reference(tiling, monkeypatch):
    """Every prefill tiling the benchmark may pick (several blocks of outputs per expand
    program, a last chunk and block that are partial; one block a program; tiles of tokens
    straddling a row's end) gives the reference's deltas, added in place and written first
    under the base matmul with a bias."""
    monkeypatch.setattr(L, "PREFILL", {**L.PREFILL, **tiling})
    ranks, ids = [8, 16, 3, 64, 0], [0, 1, 2, -1, 3, 4]
    p, _ = scattered(ranks, 90, 70, torch.float32, 6)
    x = torch.randn(len(ids), 21, 90, device=DEV)
    y = torch.randn(len(ids), 21, 70, device=DEV)
    w, b = torch.randn(70, 90, device=DEV), torch.randn(70, device=DEV)
    idx = torch.tensor(ids, dtype=torch.int32, device=DEV)
    tol = 1e-4 if DEV == "cpu" else 2e-3
    want = L.lora_delta_ref(x, y.clone(), idx, p)
    got = L.lora_delta_triton(x, y.clone(), idx, p, tiles=True)
    assert (got - want).abs().max() <= tol * want.abs().max()
    monkeypatch.setattr(L, "WRITE_FIRST", True)
    want = L.lora_delta_ref(x, F.linear(x, w, b), idx, p)
    got = L.lora_linears(x, w, b, [70], idx, [p], kernels=True)[0]
    assert (got - want).abs().max() <= tol * want.abs().max()


def pooled(ranks: list[list[int]], fin: int, fout: int, rows: list[int], seed: int):
    """Packs laid out as the adapter pool lays them (offload.adapters): every projection's
    adapters in one buffer, and each field a row of one table per field, projection k's tables
    at row rows[k] (the pool orders its rows by name, so q, k and v need not be neighbours)."""
    g = torch.Generator().manual_seed(seed)
    m, n = max(rows) + 1, max(len(r) for r in ranks)
    offs = torch.zeros(2 * m, n, dtype=torch.int64)
    rk = torch.zeros(m, n, dtype=torch.int32)
    sc = torch.zeros(m, n, dtype=torch.float32)
    chunks, at, meta = [], 0, []
    for k, rs in enumerate(ranks):
        a_off, b_off, scales = [], [], []
        for i, r in enumerate(rs):
            A, Bt = torch.randn(r, fin, generator=g), torch.randn(r, fout, generator=g)
            a_off.append(at)
            b_off.append(at + r * fin)
            chunks += [A.flatten(), Bt.flatten()]
            at += r * (fin + fout)
            scales.append(0.25 + 0.5 * i + k)
        offs[2 * rows[k], :len(rs)], offs[2 * rows[k] + 1, :len(rs)] = torch.tensor(a_off), torch.tensor(b_off)
        rk[rows[k], :len(rs)], sc[rows[k], :len(rs)] = torch.tensor(rs, dtype=torch.int32), torch.tensor(scales)
        meta.append((tuple(rs), tuple(a_off), tuple(b_off), tuple(scales)))
    buf = torch.cat(chunks).to(DEV)
    offs, rk, sc = offs.to(DEV), rk.to(DEV), sc.to(DEV)
    top = max(max(r) for r in ranks)
    return [L.LoraPack(buf, offs[2 * rows[k]], offs[2 * rows[k] + 1], rk[rows[k]], sc[rows[k]], fin, fout, top, *meta[k])
            for k in range(len(ranks))]


@pytest.mark.parametrize("rows,n", [([2, 0, 3], 6), ([0, 1], 20), ([4, 1, 2], 20)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens,side", [(1, False), (18, False)] + ([(1, True)] if DEV == "cuda" else []),
                         ids=lambda v: {1: "decode", 18: "tiles", True: "side-stream", False: "in-order"}[v])
def test_stacked_deltas_in_one_launch_equal_the_reference(rows, n, bias, tokens, side, monkeypatch):
    """Rows of stacked projections whose packs come from the pool's shared tables, decode rows
    (one token) and tiles (many), go through one launch of each pass (tables found `rows`
    apart, before or after the first), with the reference's deltas per projection, written
    first or added after; packs that do not share storage, or of unequal widths, go one
    projection at a time."""
    fin, fout = 70, 48
    ranks = [[8, 3, 0, 16][:len(rows) + 1], [5, 16, 2, 1][:len(rows) + 1], [1, 7, 4, 9][:len(rows) + 1]][:len(rows)]
    packs = pooled(ranks, fin, fout, rows, n)
    outs = [fout] * len(rows)
    tiles = tokens > 1
    assert L._stack(packs, outs, tiles) is not None
    assert L._stack(packs, outs[:-1] + [fout - 1], tiles) is None  # unequal widths
    alone = [pooled([r], fin, fout, [0], n + k)[0] for k, r in enumerate(ranks)]  # tables of their own
    assert L._stack(alone, outs, tiles) is None
    assert L._stack([packs[0], replace(packs[1], max_rank=packs[1].max_rank + 1), *packs[2:]], outs, tiles) is None
    ids = torch.tensor(([0, -1, 1, len(rows), 2] * 4)[:n], dtype=torch.int32, device=DEV) % (len(rows) + 1)
    ids[1] = -1
    torch.manual_seed(n + len(rows))
    x = torch.randn(n, tokens, fin, device=DEV)
    w = torch.randn(sum(outs), fin, device=DEV)
    b = torch.randn(sum(outs), device=DEV) if bias else None
    want = [L.lora_delta_ref(x, y, ids, p) for y, p in zip(F.linear(x, w, b).split(outs, -1), packs)]
    # TF32 in both passes' tl.dot on a GPU: 2e-3 of the largest output failed once in 81 tests
    tol = 1e-4 if DEV == "cpu" or not tiles else 5e-3
    monkeypatch.setattr(L, "SIDE_STREAM", side)
    launches = []
    real = L.lora_shrink
    monkeypatch.setattr(L, "lora_shrink", lambda *a, **k: launches.append(1) or real(*a, **k))
    for first in (True, False):
        monkeypatch.setattr(L, "WRITE_FIRST", first)
        got = L.lora_linears(x, w, b, outs, ids, packs, kernels=True)
        for g, r in zip(got, want):
            assert (g - r).abs().max() <= tol * r.abs().max()
    assert len(launches) == 2  # one shrink for every projection, each time
    monkeypatch.setattr(L, "TILES_STACKED" if tiles else "STACKED", False)
    got = L.lora_linears(x, w, b, outs, ids, packs, kernels=True)
    assert len(launches) == 2 + len(rows)
    for g, r in zip(got, want):
        assert (g - r).abs().max() <= tol * r.abs().max()


@pytest.mark.parametrize("tokens,per_row,lanes", [(5, 1, 37), (6, 3, 1500), (1, 1, 2049)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lane_mask_kernel_equals_reference(tokens, per_row, lanes, dtype):
    """The dense decode's mask: each token keeps its row's adapter's lanes times their scale,
    every other lane (another adapter's, a free lane marked -1, any lane of a base row) 0,
    whatever was there (infinities included)."""
    g = torch.Generator().manual_seed(tokens * lanes)
    rows = tokens // per_row
    ids = torch.tensor([(-1 if r % 3 == 1 else r % 4) for r in range(rows)], dtype=torch.int32)
    owner = torch.randint(-1, 4, (lanes,), generator=g, dtype=torch.int32)
    scale = torch.rand(lanes, generator=g) + 0.5
    v = torch.randn(tokens, lanes, generator=g).to(dtype)
    v[:, owner == -1] = float("inf")
    want = L.lane_mask_ref(v.clone(), ids, owner, scale, per_row)
    got = L.lane_mask_triton(v.clone().to(DEV), ids.to(DEV), owner.to(DEV), scale.to(DEV), per_row).cpu()
    # the interpreter rounds float32 to bfloat16 its own way: one unit in the last place
    torch.testing.assert_close(got, want, rtol=2 ** -7 if dtype == torch.bfloat16 else 0, atol=0)
    brute = torch.zeros(tokens, lanes)
    for t in range(tokens):
        for c in range(lanes):
            if owner[c] >= 0 and owner[c] == ids[t // per_row]:
                brute[t, c] = v[t, c].float() * scale[c]
    assert torch.equal(want, brute.to(dtype))


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import flexoff.kernels.lora as L
import flexoff.kernels.copies as C
import flexoff.kernels.lora_matmul as M
p16, i32, i64 = "*fp16", "i32", "i64"
common = dict(IDS="*i32", W=p16, RANK="*i32", SCALE="*fp32", V="*fp32", per_row=i32)
kernels = [
    (L._tok_shrink, dict(X=p16, **common, AOFF="*i64", K=i32, sx=i32, SPLIT=i32, RP=i32, LG=i32, KS=i32, NT=i32,
                         SA1=i64, SA2=i64, SR1=i64, SR2=i64), dict(BK=512, RC=8)),
    (L._tok_expand, dict(Y=p16, B=p16, **common, BOFF="*i64", N=i32, sy=i32, SPLIT=i32, RP=i32, NT=i32,
                         SB1=i64, SB2=i64, SR1=i64, SR2=i64, SS1=i64, SS2=i64),
     dict(SP=1, BN=256, RC=8, ADD=False, HAS_B=True)),
    *[(L._tile_shrink, dict(X=p16, **{**common, "V": p16}, AOFF="*i64", K=i32, sx=i32, NT=i32, TILES=i32, NP=i32,
                            SA1=i64, SA2=i64, SR1=i64, SR2=i64, SS1=i64, SS2=i64),
       dict(R=64, BM=128, BK=64, SCALED=scaled)) for scaled in (False, True)],
    # the fused prefill matmul at its default tile, few inputs and many (the compiler's shared memory differs)
    *[(M._fused, dict(x_desc="tensordesc<fp16[128,64]>", w_desc="tensordesc<fp16[256,64]>",
                      v_desc="tensordesc<fp16[128,64]>", l_desc="tensordesc<fp16[64,256]>", Y=p16, FIRST="*i32",
                      M=i32, N=i32, sy=i32),
       dict(PROGRAMS=132, K=k, BM=M.TILE["bm"], BN=M.TILE["bn"], BK=M.TILE["bk"], R=64, GROUP_M=8),
       dict(num_stages=M.TILE["stages"], num_warps=M.TILE["warps"])) for k in (64, 4096, 11008)],
    (L._tile_expand, dict(Y=p16, B=p16, **{**common, "V": p16}, BOFF="*i64", N=i32, sy=i32, NT=i32, NB=i32,
                          TILES=i32, CH=i32, NP=i32, SB1=i64, SB2=i64, SR1=i64, SR2=i64, SS1=i64, SS2=i64),
     dict(R=64, BM=128, BN=128, EB=8, ADD=True, HAS_B=False)),
    (L._lane_mask, dict(V=p16, IDS="*i32", OWNER="*i32", SCALE="*fp32", per_row=i32, L=i32, sv=i32), dict(BL=1024)),
    (C._copy_pieces, dict(SRC=p16, DST=p16, TABLE="*i64"), dict(BLOCK=C.BLOCK, PIECE=C.PIECE)),
]
for fn, sig, ce, *options in kernels:
    order = list(fn.arg_names)
    full = {**sig, **dict.fromkeys(ce, "constexpr")}
    k = triton.compile(ASTSource(fn=fn, signature={a: full[a] for a in order}, constexprs=ce),
                       target=GPUTarget("cuda", 90, 32), options=options[0] if options else None)
    # the shared memory a block may take on an H100 or H200 (a launch past it fails)
    assert k.metadata.shared <= 232448, (fn.__name__, ce, k.metadata.shared)
"""


def test_kernels_compile_for_the_gpu():
    """The decode and prefill passes, stacked projections' shifts included, the dense decode's
    mask, the fused prefill matmul (kernels.lora_matmul) and the pool's copies (kernels.copies)
    compile for sm_90 within its shared memory (no GPU needed): the interpreter accepts code the
    GPU compiler may refuse."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
