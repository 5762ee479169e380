"""The prefill's base matmul with each tile's LoRA expand added in its epilogue, so the deltas
never go through memory: Triton over Hopper's bulk tensor copies (TMA descriptors), persistent
over the output tiles (benchmarks/fused_prefill.py measured this matmul at 0.94-1.03 of
cuBLAS's time on an H200 at LLaMA-7B's prefill shapes, and 0.98-1.11 with the deltas).

Knows: y = x @ W.T + v @ lanes[first:first + R] for one projection, where v (tokens, R) is
the shrink's output already times each token's adapter's scale, zeros past its rank and on rows
of the base model (`lora_shrink(..., scaled=True)`), and `lanes` (lanes, fan_out) every
adapter's B transposed as rows of one matrix (a resident pool's `Dense.B`); each tile of BM
tokens lies in one row (rows of a multiple of BM tokens), so it adds one adapter's lanes. When
the fused way applies (`fits`): CUDA with TMA (compute capability 9 or more) or Triton's
interpreter, 16-bit weights, no bias, resident lanes, rows of whole tiles, ranks up to 64,
widths and addresses the copy engine takes.
Does not know: which rows have which adapter beyond the per-row ids it is handed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from flexoff.kernels.lora import LoraPack

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAVE_TMA = True
except ImportError:  # CPU-only installs, or a Triton without host descriptors
    HAVE_TMA = False

# (tokens, outputs, inputs) a tile, pipeline stages, warps; the largest rank the epilogue takes
TILE = {"bm": 128, "bn": 256, "bk": 64, "stages": 3, "warps": 8}
MAX_RANK = 64
# (dtype, inputs, lanes, tile) whose kernel the GPU compiler refused (shared memory): not tried again
REFUSED: set[tuple] = set()


if HAVE_TMA:
    @triton.jit
    def tile_at(t, npm, npn, GROUP_M: tl.constexpr):
        """Output tile t of npm x npn: its tile row and column, tiles taken GROUP_M tile rows at
        a time (so that programs running side by side share the weight's tiles in L2)."""
        per_group = GROUP_M * npn
        first = (t // per_group) * GROUP_M
        size = tl.minimum(npm - first, GROUP_M)
        return first + (t % per_group) % size, (t % per_group) // size

    @triton.jit
    def base_tile(x_desc, w_desc, om, on, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """x[om:om + BM] @ W[on:on + BN].T over K inputs, in float32."""
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            acc = tl.dot(x_desc.load([om, k]), w_desc.load([on, k]).T, acc)
        return acc

    @triton.jit
    def _fused(x_desc, w_desc, v_desc, l_desc, Y, FIRST, M, N, sy, PROGRAMS: tl.constexpr, K: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, GROUP_M: tl.constexpr):
        """Program p takes output tiles p, p + PROGRAMS, ... (GROUP_M tile rows at a time, so
        neighbours share W's tiles in L2): x @ W.T over K, then v @ lanes[FIRST[tile row]:+R]
        onto the same accumulator, written to Y (row stride sy)."""
        npm, npn = (M + BM - 1) // BM, (N + BN - 1) // BN
        for t in tl.range(tl.program_id(0), npm * npn, PROGRAMS, flatten=True):
            pm, pn = tile_at(t, npm, npn, GROUP_M)
            om, on = pm * BM, pn * BN
            acc = base_tile(x_desc, w_desc, om, on, K, BM, BN, BK)
            acc = tl.dot(v_desc.load([om, 0]), l_desc.load([tl.load(FIRST + pm), on]), acc)
            rows = (om + tl.arange(0, BM)).to(tl.int64)
            cols = on + tl.arange(0, BN)
            tl.store(Y + rows[:, None] * sy + cols[None, :], acc.to(Y.dtype.element_ty),
                     mask=(rows < M)[:, None] & (cols < N)[None, :])


def _tma_device(x: torch.Tensor) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9


def _aligned(t: torch.Tensor) -> bool:
    """What a TMA descriptor needs of a 2-D tensor: unit inner stride, 16-byte rows and base."""
    size = t.element_size()
    return t.stride(-1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def fits(xf: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, outs: Sequence[int],
         packs: Sequence["LoraPack"], per_row: int, host_ids: tuple[int, ...] | None) -> bool:
    """Whether these projections' prefill can take the fused matmul."""
    if not (HAVE_TMA and _tma_device(xf)) or bias is not None or host_ids is None:
        return False
    if xf.dtype not in (torch.float16, torch.bfloat16) or w.dtype != xf.dtype or per_row % TILE["bm"]:
        return False
    if any(p.dense is None or p.dense.B.dtype != xf.dtype or p.max_rank > MAX_RANK for p in packs):
        return False
    if not (_aligned(xf) and _aligned(w) and w.is_contiguous()) or any(n % 8 for n in outs):
        return False
    return all(_aligned(p.dense.B) for p in packs)


def first_lanes(p: "LoraPack", host_ids: tuple[int, ...], per_row: int, device: torch.device) -> torch.Tensor:
    """Each tile row's first lane in p's lanes: its row's adapter's (0 for rows on the base
    model or adapters that leave p alone: their v is zeros)."""
    b0, n = p.dense.B.storage_offset(), p.fan_out
    lanes = [(p.b_offs[a] - b0) // n if a >= 0 and p.ranks[a] else 0 for a in host_ids]
    per = per_row // TILE["bm"]
    return torch.tensor([f for f in lanes for _ in range(per)], dtype=torch.int32).to(device, non_blocking=True)


def fused_matmul(xf: torch.Tensor, w: torch.Tensor, v: torch.Tensor, lanes: torch.Tensor, first: torch.Tensor,
                 y: torch.Tensor) -> bool:
    """y (tokens, N; any row stride) = xf @ w.T + v @ lanes[first[tile] : + R] per tile of tokens;
    False, with y unwritten, where the compiler refuses this kernel (its shared memory)."""
    c = TILE
    bm, bn, bk = c["bm"], c["bn"], c["bk"]
    M, K = xf.shape
    N, R = w.shape[0], v.shape[1]
    key = (xf.dtype, K, R, tuple(c.values()))
    if key in REFUSED:
        return False
    x_d = TensorDescriptor.from_tensor(xf, [bm, bk])
    w_d = TensorDescriptor.from_tensor(w, [bn, bk])
    v_d = TensorDescriptor.from_tensor(v, [bm, R])
    l_d = TensorDescriptor.from_tensor(lanes, [R, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    sms = torch.cuda.get_device_properties(xf.device).multi_processor_count if xf.is_cuda else 4
    programs = min(tiles, sms)
    try:
        _fused[(programs,)](x_d, w_d, v_d, l_d, y, first, M, N, y.stride(0), programs, K=K, BM=bm, BN=bn, BK=bk,
                            R=R, GROUP_M=8, num_stages=c["stages"], num_warps=c["warps"])
    except triton.runtime.errors.OutOfResources:
        REFUSED.add(key)
        return False
    return True
