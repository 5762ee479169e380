"""Many small device copies as one launch: runs of elements (source offset, destination offset,
length) from one flat buffer to another, as a Triton kernel on CUDA (each program one piece of
at most PIECE elements of a run) beside the torch reference (a copy per run) behind one dispatch.

Knows: the adapter pool moves a block's adapters from one layout (each adapter flat, as copied
from host memory) to another (each matmul's rank lanes) in hundreds of runs per adapter; a copy
launch per run costs microseconds of host time each, one launch for all of them does not.
Does not know: what the runs hold.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton use the reference
    HAVE_TRITON = False

PIECE = 1 << 16  # elements one program copies at most
BLOCK = 4096  # elements one step of a program moves


if HAVE_TRITON:
    @triton.jit
    def _copy_pieces(SRC, DST, TABLE, BLOCK: tl.constexpr, PIECE: tl.constexpr):
        """Program p copies piece p: TABLE[p] = (source offset, destination offset, length)."""
        p = tl.program_id(0).to(tl.int64)
        s, d, n = tl.load(TABLE + 3 * p), tl.load(TABLE + 3 * p + 1), tl.load(TABLE + 3 * p + 2)
        for i0 in range(0, PIECE, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            m = i < n
            tl.store(DST + d + i, tl.load(SRC + s + i, mask=m), mask=m)


def pieces(runs: Sequence[tuple[int, int, int]], piece: int) -> np.ndarray:
    """The runs cut into pieces of at most `piece` elements: (pieces, 3) int64 rows of source
    offset, destination offset and length."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    r = r[r[:, 2] > 0]
    counts = -(-r[:, 2] // piece)
    first = np.repeat(r, counts, axis=0)
    k = np.arange(len(first)) - np.repeat(np.cumsum(counts) - counts, counts)  # piece index within its run
    out = first.copy()
    out[:, 0] += k * piece
    out[:, 1] += k * piece
    out[:, 2] = np.minimum(piece, first[:, 2] - k * piece)
    return out


def copy_runs_ref(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """dst[d:d + n] = src[s:s + n] for each run (s, d, n) of the flat buffers; returns dst."""
    for s, d, n in runs:
        dst[d:d + n].copy_(src[s:s + n])
    return dst


def copy_runs_triton(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """copy_runs_ref's kernel: one launch (flat buffers of one dtype, on one device)."""
    table = pieces(runs, PIECE)
    if len(table):
        t = torch.from_numpy(table).to(dst.device, non_blocking=True)
        _copy_pieces[(len(table),)](src, dst, t, BLOCK=BLOCK, PIECE=PIECE)
    return dst


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """The dispatch: the kernel on CUDA, else the reference."""
    if HAVE_TRITON and dst.is_cuda:
        return copy_runs_triton(src, dst, runs)
    return copy_runs_ref(src, dst, runs)
