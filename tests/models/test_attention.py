"""CPU decode attention over a two-area cache (attend_cached) against brute-force float64 math."""

import math

import pytest
import torch

from flexoff.models.attention import attend_cached
from reference import brute_force


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # scores in float32, as the engine
def test_attend_cached_writes_the_new_token_and_matches_brute_force(dtype):
    torch.manual_seed(0)
    b, nh, kvh, d, s, max_gen, g = 3, 8, 2, 16, 7, 5, 2
    q = torch.randn(b, nh, 1, d, dtype=dtype)
    kp, vp = torch.randn(2, b, kvh, s, d, dtype=dtype)
    kg, vg = torch.randn(2, b, kvh, max_gen, d, dtype=dtype)
    k_new, v_new = torch.randn(2, b, kvh, 1, d, dtype=dtype)
    mask = torch.ones(b, 1, s + g + 1, dtype=torch.bool)
    mask[0, 0, :3] = False  # left padding
    mask[2, 0, 1] = False
    before = kg.clone(), vg.clone()

    out = attend_cached(q, (kp, vp), (kg, vg), (k_new, v_new), g, mask, 0.25)

    assert torch.equal(kg[:, :, g:g + 1], k_new) and torch.equal(vg[:, :, g:g + 1], v_new)
    for new, old in zip((kg, vg), before):  # nothing else in the generated area changed
        assert torch.equal(new[:, :, :g], old[:, :, :g]) and torch.equal(new[:, :, g + 1:], old[:, :, g + 1:])
    k = torch.cat([kp, kg[:, :, :g + 1]], 2).double()
    v = torch.cat([vp, vg[:, :, :g + 1]], 2).double()
    ref = brute_force(q.double(), k, v, mask, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
