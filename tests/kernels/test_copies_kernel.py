"""Many small copies in one launch (kernels.copies) against their reference and a brute-force
copy (on the CPU via TRITON_INTERPRET=1): runs of odd lengths, longer than a piece, empty ones,
in any order, between buffers of several dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexoff.kernels import copies as C

pytestmark = pytest.mark.skipif(not C.HAVE_TRITON, reason="triton is not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU through TRITON_INTERPRET (conftest)


def test_pieces_cut_runs_at_the_piece_size():
    got = C.pieces([(5, 100, 7), (0, 0, 0), (20, 3, 25)], piece=10)
    assert got.tolist() == [[5, 100, 7], [20, 3, 10], [30, 13, 10], [40, 23, 5]]
    assert C.pieces([], 10).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_copy_runs_equal_reference_and_brute_force(dtype, monkeypatch):
    monkeypatch.setattr(C, "PIECE", 300)  # runs longer than a piece, pieces not a multiple of a step
    monkeypatch.setattr(C, "BLOCK", 128)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(5000, generator=g).to(dtype)
    runs = [(4000, 10, 999), (0, 1200, 1), (17, 2000, 0), (1000, 3000, 257), (2500, 1500, 300)]
    dst = torch.full((4000,), 7.0).to(dtype)
    want = C.copy_runs_ref(src, dst.clone(), runs)
    brute = dst.clone().numpy() if dtype != torch.bfloat16 else dst.clone().float().numpy()
    flat = src.numpy() if dtype != torch.bfloat16 else src.float().numpy()
    for s, d, n in runs:
        brute[d:d + n] = flat[s:s + n]
    assert np.array_equal(want.float().numpy(), brute.astype(np.float32))
    got = C.copy_runs_triton(src.to(DEV), dst.clone().to(DEV), runs).cpu()
    assert torch.equal(got, want)
