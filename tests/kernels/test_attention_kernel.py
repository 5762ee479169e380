"""The decode attention kernel against its reference (on the CPU via TRITON_INTERPRET=1): the
engine's token-major cache read in place, grouped heads, padding and unwritten positions masked."""

from __future__ import annotations

import pytest
import torch

from flexoff.kernels import attention as A

pytestmark = pytest.mark.skipif(not A.HAVE_TRITON, reason="triton is not installed")


def cache(b: int, kvh: int, T: int, d: int, dtype: torch.dtype):
    """Keys and values as views of a token-major (T, b, 2, kvh, d) buffer, like the engine's."""
    raw = torch.randn(T, b, 2, kvh, d, dtype=torch.float32).to(dtype)
    return raw[:, :, 0].permute(1, 2, 0, 3), raw[:, :, 1].permute(1, 2, 0, 3), raw


@pytest.mark.parametrize("b,heads,kvh,T,d,t", [
    (3, 4, 2, 37, 16, 30), (1, 8, 8, 200, 64, 199), (5, 6, 1, 130, 32, 64), (2, 2, 2, 9, 16, 0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [32, 64])
def test_kernel_equals_reference(b, heads, kvh, T, d, t, dtype, block):
    torch.manual_seed(b * 100 + T)
    k, v, raw = cache(b, kvh, T, d, dtype)
    raw[t + 1:] = float("nan")  # positions not yet written: never read
    q = torch.randn(b, heads, 1, d).to(dtype)
    mask = torch.zeros(b, 1, T, dtype=torch.bool)
    mask[:, :, :t + 1] = True
    mask[0, :, :min(3, t)] = False  # left padding of one row
    got = A.decode_attention_triton(q, k, v, mask, d ** -0.5, block=block)
    want = A.decode_attention_ref(q.float(), k[:, :, :t + 1].float(), v[:, :, :t + 1].float(),
                                  mask[:, :, :t + 1], d ** -0.5)
    assert got.dtype == dtype and got.shape == (b, heads, 1, d)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_splits_are_powers_of_two_within_the_positions():
    for b, h, T in ((1, 32, 544), (8, 32, 544), (128, 32, 544), (4, 4, 10)):
        s = A.splits_for(b, h, T)
        assert s & (s - 1) == 0 and (s == 1 or s * A.BLOCK_T <= T)
