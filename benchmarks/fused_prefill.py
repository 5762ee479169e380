"""Whether a LoRA prefill can ride inside its base matmul: a Triton matmul on Hopper's bulk tensor
copies (TMA descriptors), persistent over the output tiles, with and without each tile's LoRA
expand added in its epilogue, against cuBLAS's matmul alone, at the resident population's
prefill shapes (LLaMA-7B's stacked q/k/v, o, stacked gate/up and down projections on 128 rows
of 512 tokens, each row its own adapter).

Knows: the kernel (`_matmul`) and its tilings, and how to time them. The epilogue adds
scale * v @ B.T for the tile's adapter, where v is the shrink's output per token (tokens,
max rank; zeros past a token's rank, as the engine's tile shrink writes it) and the tile's
rows share one adapter (rows of 512 tokens are whole tiles). Rows past the adapter's rank and
rows on the base model add nothing. Results are checked against float32 torch on the same
inputs. This measures one bound of issue 15 (RESULTS.md): the prefill's LoRA is nearly free
only if such a matmul is as fast as cuBLAS's. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, event_ms, table, write_jsonl  # noqa: E402

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flexoff.kernels.lora_matmul import base_tile, tile_at
except ImportError:  # measured on a GPU only
    triton = None

# (K, N): the projections' inputs and stacked outputs
SHAPES = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}
# (BM, BN, BK, stages, warps, persistent, LoRA mode, TMA store, flatten)
TILINGS = [(128, 256, 64, 3, 8, True, 3, True, True), (128, 256, 64, 3, 8, True, 3, False, True),
           (128, 256, 64, 3, 8, True, 3, False, False), (128, 256, 64, 3, 8, False, 3, False, True),
           (128, 128, 64, 4, 8, True, 3, True, True), (128, 128, 64, 4, 8, True, 3, True, False),
           (128, 128, 64, 5, 8, True, 3, False, True), (128, 256, 64, 4, 8, True, 3, False, True),
           (128, 128, 64, 4, 8, True, 2, True, False)]
RANKS = (8, 16, 32, 64)

if triton is not None:
    @triton.jit
    def _matmul(a_desc, b_desc, c_desc, v_desc, bt_desc, C, V, BT, TILE_AD, BOFF, RANK, SCALE, M, N, K,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
                GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, LORA: tl.constexpr, TMA_STORE: tl.constexpr,
                FLATTEN: tl.constexpr):
        """C = A @ B.T (A (M, K), B (N, K)), program p taking tiles p, p + PROGRAMS, ... in
        groups of GROUP_M tile rows; with LORA each tile adds scale * V[rows, :r] @ BT[:r, cols]
        of its adapter (TILE_AD per tile row, -1: none; BT an adapter's B transposed, (r, N),
        at BOFF in a flat buffer): LORA 1 loads V and BT by pointers, 2 through bulk tensor
        copies (BT's descriptor made in the kernel, its rows past r read as zeros); LORA 3 adds
        V[rows] @ BT[lane:lane + R, cols] onto the accumulator, V holding scale * x @ A.T
        (zeros past each token's rank, and for rows on the base model), every adapter's lanes
        rows of one matrix BT (bt_desc), TILE_AD each tile row's first lane."""
        npm, npn = (M + BM - 1) // BM, (N + BN - 1) // BN
        for t in tl.range(tl.program_id(0), npm * npn, PROGRAMS, flatten=FLATTEN):
            pm, pn = tile_at(t, npm, npn, GROUP_M)
            om, on = pm * BM, pn * BN
            acc = base_tile(a_desc, b_desc, om, on, K, BM, BN, BK)
            if LORA == 1:
                ad = tl.load(TILE_AD + pm)
                safe = tl.maximum(ad, 0)
                r = tl.where(ad >= 0, tl.load(RANK + safe), 0)
                lanes = tl.arange(0, R)
                rows = om + tl.arange(0, BM)
                cols = on + tl.arange(0, BN)
                live = lanes < r
                v = tl.load(V + rows[:, None] * R + lanes[None, :], mask=live[None, :], other=0.0)
                bt = tl.load(BT + tl.load(BOFF + safe) + lanes[:, None] * N + cols[None, :],
                             mask=live[:, None] & (cols < N)[None, :], other=0.0)
                acc += tl.load(SCALE + safe) * tl.dot(v, bt)
            if LORA == 2:
                ad = tl.load(TILE_AD + pm)
                if ad >= 0:
                    r = tl.load(RANK + ad)
                    if r > 0:
                        bt_desc = tl.make_tensor_descriptor(BT + tl.load(BOFF + ad), shape=[r, N], strides=[N, 1],
                                                            block_shape=[R, BN])
                        acc += tl.load(SCALE + ad) * tl.dot(v_desc.load([om, 0]), bt_desc.load([0, on]))
            if LORA == 3:  # V pre-scaled, zero past each token's rank; BT as lanes (L, N) through bt_desc
                acc = tl.dot(v_desc.load([om, 0]), bt_desc.load([tl.load(TILE_AD + pm), on]), acc)
            if TMA_STORE:
                c_desc.store([om, on], acc.to(tl.float16))
            else:
                rows = om + tl.arange(0, BM)
                cols = on + tl.arange(0, BN)
                tl.store(C + rows[:, None] * N + cols[None, :], acc.to(tl.float16),
                         mask=(rows < M)[:, None] & (cols < N)[None, :])


class Problem:
    """One projection's inputs on the GPU: x, the base weight, each row's adapter's B
    transposed in one flat buffer, the shrink's output v and the tile table."""

    def __init__(self, K: int, N: int, rows: int, per_row: int, seed: int, dtype: torch.dtype):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev = torch.device("cuda")
        self.M, self.N, self.K, self.per_row = rows * per_row, N, K, per_row
        self.x = (torch.randn(self.M, K, device=dev, generator=g) / K ** 0.5).to(dtype)
        self.w = torch.randn(N, K, device=dev, generator=g).to(dtype)
        ranks = [RANKS[i] for i in torch.randint(0, len(RANKS), (rows,)).tolist()]
        ranks[1] = 0  # one row on the base model
        offs, at = [], 0
        for r in ranks:
            offs.append(at)
            at += r * N
        self.bt = (torch.randn(max(at, 1), device=dev, generator=g) * 0.05).to(dtype)
        self.rank = torch.tensor(ranks, dtype=torch.int32, device=dev)
        self.boff = torch.tensor(offs, dtype=torch.int64, device=dev)
        self.scale = torch.rand(rows, device=dev, generator=g) + 0.5
        self.R = max(RANKS)
        v = torch.randn(self.M, self.R, device=dev, generator=g)
        lane = torch.arange(self.R, device=dev)
        self.v = torch.where(lane[None, :] < self.rank.repeat_interleave(per_row)[:, None], v, 0.0).to(dtype)
        self.ranks = ranks
        self.v_scaled = (self.v.float() * self.scale.repeat_interleave(per_row)[:, None]).to(dtype)
        self.lanes = self.bt.view(-1, N)  # every adapter's B transposed, as rows of one matrix

    def tile_adapters(self, bm: int, lanes: bool) -> torch.Tensor:
        """Each tile row's adapter, or with `lanes` its first lane in self.lanes (rows are
        whole tiles: per_row a multiple of bm)."""
        assert self.per_row % bm == 0
        if lanes:
            ids = (self.boff // self.N).to(torch.int32)
        else:
            ids = torch.arange(self.M // self.per_row, dtype=torch.int32, device="cuda")
            ids = torch.where(self.rank > 0, ids, -1)
        return ids.repeat_interleave(self.per_row // bm)

    def reference(self, lora: bool) -> torch.Tensor:
        y = self.x.float() @ self.w.float().t()
        if lora:
            for row, r in enumerate(self.ranks):
                if r:
                    lo, hi = row * self.per_row, (row + 1) * self.per_row
                    off = int(self.boff[row])
                    bt = self.bt[off:off + r * self.N].view(r, self.N).float()
                    y[lo:hi] += float(self.scale[row]) * (self.v[lo:hi, :r].float() @ bt)
        return y


def run_triton(p: Problem, tiling: tuple, lora: bool, out: torch.Tensor) -> Callable[[], Any]:
    bm, bn, bk, stages, warps, persistent, mode, tma_store, flatten = tiling
    a = TensorDescriptor.from_tensor(p.x, [bm, bk])
    b = TensorDescriptor.from_tensor(p.w, [bn, bk])
    c = TensorDescriptor.from_tensor(out, [bm, bn])
    v = TensorDescriptor.from_tensor(p.v_scaled if mode == 3 else p.v, [bm, p.R])
    lanes = TensorDescriptor.from_tensor(p.lanes, [p.R, bn])
    tiles = triton.cdiv(p.M, bm) * triton.cdiv(p.N, bn)
    programs = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count) if persistent else tiles
    ad = p.tile_adapters(bm, mode == 3)

    def call() -> None:
        _matmul[(programs,)](a, b, c, v, lanes, out, p.v, p.bt, ad, p.boff, p.rank, p.scale, p.M, p.N, p.K, BM=bm, BN=bn,
                             BK=bk, R=p.R, GROUP_M=8, PROGRAMS=programs, LORA=mode if lora else 0,
                             TMA_STORE=tma_store, FLATTEN=flatten, num_stages=stages, num_warps=warps)
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--per-row", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/fused_prefill.jsonl"))
    args = ap.parse_args()
    if cuda_missing("fused_prefill.py") or triton is None:
        return 0
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    env, records = environment(), []
    for name in args.shapes.split(","):
        K, N = SHAPES[name]
        p = Problem(K, N, args.rows, args.per_row, 0, torch.float16)
        out = torch.empty(p.M, N, dtype=torch.float16, device="cuda")
        base = event_ms(lambda: torch.mm(p.x, p.w.t(), out=out), args.reps, warmup=3) / 1e3
        refs = {lora: p.reference(lora) for lora in (False, True)}
        scale = {lora: float(refs[lora].abs().max()) for lora in (False, True)}
        for tiling in TILINGS:
            for lora in (False, True) if tiling[6] else (False,):
                try:
                    fn = run_triton(p, tiling, lora, out)
                    fn()
                    torch.cuda.synchronize()
                    err = float((out.float() - refs[lora]).abs().max()) / scale[lora]
                    t = event_ms(fn, args.reps, warmup=3) / 1e3
                except Exception as e:  # a tiling past the shared memory: recorded, not fatal
                    records.append({"shape": name, "tiling": str(tiling), "lora": lora, "error": str(e)[:200]})
                    continue
                records.append({"shape": name, "M": p.M, "K": K, "N": N, "tiling": str(tiling), "lora": lora,
                                "cublas_ms": base * 1e3, "ms": t * 1e3, "vs_cublas": t / base, "rel_err": err,
                                "tflops": 2 * p.M * N * K / t / 1e12, **env})
        torch.cuda.empty_cache()
    print(table([r for r in records if "ms" in r],
                ["shape", "tiling", "lora", "cublas_ms", "ms", "vs_cublas", "tflops", "rel_err"]))
    for r in records:
        if "error" in r:
            print("failed:", r["shape"], r["tiling"], r["lora"], r["error"])
    write_jsonl(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
