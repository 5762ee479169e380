"""The fused RMSNorm, rotary and silu * up kernels against the torch chains they replace (on the
CPU via TRITON_INTERPRET=1): float32 and float16, views of one projection's output as the model
passes them, odd sizes, and the dispatch's choice of chain where autograd is on."""

from __future__ import annotations

import pytest
import torch

from flexoff.kernels import elementwise as E

pytestmark = pytest.mark.skipif(not E.HAVE_TRITON, reason="triton is not installed")

HALF_STEP = {torch.float32: 1e-6, torch.float16: 1e-3}  # relative size of one rounding step, with room


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to one rounding step of the dtype."""
    return got.dtype == want.dtype and got.shape == want.shape and bool(
        ((got.float() - want.float()).abs() <= HALF_STEP[dtype] * want.float().abs() + 1e-7).all())


@pytest.mark.parametrize("shape", [(2, 3, 64), (1, 1, 4096), (5, 1, 4100), (7, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_equals_the_chain(shape, dtype):
    torch.manual_seed(shape[-1])
    h = (torch.randn(shape) * 3).to(dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    got = E.rms_norm_triton(h, w, 1e-5)
    want = E.rms_norm_ref(h, w, 1e-5)
    assert close(got, want, dtype)
    if dtype == torch.float16:  # float32's summation order moves the norm's last bit, float16 rarely
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("b,heads,L,d", [(2, 4, 3, 16), (3, 6, 1, 64), (1, 40, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_equals_the_chain_on_views_of_a_projection(b, heads, L, d, dtype):
    torch.manual_seed(heads * d)
    kvh = max(1, heads // 2)
    qkv = torch.randn(b, L, (heads + 2 * kvh) * d).to(dtype)  # one matmul's output, as linears gives it
    q, k, _ = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    q = q.view(b, L, heads, d).transpose(1, 2)
    k = k.view(b, L, kvh, d).transpose(1, 2)
    ang = torch.rand(b, 1, L, d // 2) * 50
    cos, sin = (torch.cat((f, f), dim=-1).to(dtype) for f in (ang.cos(), ang.sin()))
    for x in (q, k):
        got = E.rotate_triton(x, cos, sin)
        assert torch.equal(got, E.rotate_ref(x, cos, sin))  # the same roundings in the same order


@pytest.mark.parametrize("rows,n", [(3, 40), (2, 1024), (1, 2500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_equals_the_chain_on_halves_of_a_projection(rows, n, dtype):
    torch.manual_seed(n)
    gu = (torch.randn(rows, 1, 2 * n) * 4).to(dtype)
    gate, up = gu.split([n, n], dim=-1)
    got = E.silu_mul_triton(gate, up)
    assert close(got, E.silu_mul_ref(gate, up), dtype)


def test_dispatch_keeps_the_chain_where_autograd_may_ask_and_off_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(E, "rms_norm_triton", lambda *a: calls.append(a) or E.rms_norm_ref(*a))
    h, w = torch.randn(2, 8), torch.ones(8)
    E.rms_norm(h, w, 1e-6)
    assert calls == []  # a CPU tensor: the chain
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    E.rms_norm(h, w, 1e-6)
    assert len(calls) == 1
    E.rms_norm(h.requires_grad_(True), w, 1e-6)
    assert len(calls) == 1  # a gradient may be asked for: the chain
    with torch.no_grad():
        E.rms_norm(h, w, 1e-6)
    assert len(calls) == 2


@pytest.mark.gpu
def test_dispatch_on_cuda_gives_the_chains_values():
    torch.manual_seed(0)
    dev = "cuda"
    h = torch.randn(4, 3, 4096, device=dev, dtype=torch.float16)
    w = torch.rand(4096, device=dev, dtype=torch.float16) + 0.5
    assert close(E.rms_norm(h, w, 1e-5), E.rms_norm_ref(h, w, 1e-5), torch.float16)
    qkv = torch.randn(4, 3, 3 * 4096, device=dev, dtype=torch.float16)
    q = qkv[..., :4096].view(4, 3, 32, 128).transpose(1, 2)
    ang = torch.rand(4, 1, 3, 64, device=dev) * 100
    cos, sin = (torch.cat((f, f), -1).half() for f in (ang.cos(), ang.sin()))
    assert torch.equal(E.rotate(q, cos, sin), E.rotate_ref(q, cos, sin))  # compiled without contractions
    k = qkv[..., 4096:8192].view(4, 3, 32, 128).transpose(1, 2)
    rq, rk = E.rotate_pair(q, k, cos, sin)
    assert torch.equal(rq, E.rotate_ref(q, cos, sin)) and torch.equal(rk, E.rotate_ref(k, cos, sin))
    cache = torch.zeros(9, 4, 2, 32, 128, device=dev, dtype=torch.float16)
    E.store_token(cache, torch.tensor([5], device=dev), k[:, :, :1], q[:, :, :1])
    assert torch.equal(cache[5, :, 0], k[:, :, 0]) and torch.equal(cache[5, :, 1], q[:, :, 0])
    assert not cache[:5].any() and not cache[6:].any()
    gate, up = torch.randn(4, 3, 2 * 11008, device=dev, dtype=torch.float16).split([11008, 11008], dim=-1)
    assert close(E.silu_mul(gate, up), E.silu_mul_ref(gate, up), torch.float16)


@pytest.fixture
def cuda_dispatch(monkeypatch):
    """The dispatch functions take their kernels for CPU tensors (run by the interpreter)."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


@pytest.mark.parametrize("heads,kvh", [(4, 2), (6, 6)])
def test_rotate_pair_rotates_adjacent_queries_and_keys_in_one_launch(heads, kvh, cuda_dispatch, monkeypatch):
    torch.manual_seed(heads)
    b, L, d = 3, 2, 16
    qkv = torch.randn(b, L, (heads + 2 * kvh) * d).half()
    q, k, _ = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    q, k = q.view(b, L, heads, d).transpose(1, 2), k.view(b, L, kvh, d).transpose(1, 2)
    ang = torch.rand(b, 1, L, d // 2) * 50
    cos, sin = (torch.cat((f, f), dim=-1).half() for f in (ang.cos(), ang.sin()))
    launches = []
    real = E.rotate_triton
    monkeypatch.setattr(E, "rotate_triton", lambda *a: launches.append(a[0].shape) or real(*a))
    with torch.no_grad():
        rq, rk = E.rotate_pair(q, k, cos, sin)
        assert launches == [(b, heads + kvh, L, d)]
        assert torch.equal(rq, E.rotate_ref(q, cos, sin)) and torch.equal(rk, E.rotate_ref(k, cos, sin))
        E.rotate_pair(q, k.clone(), cos, sin)  # apart in memory: one launch each
    assert launches[1:] == [(b, heads, L, d), (b, kvh, L, d)]


@pytest.mark.parametrize("d", [16, 12])
def test_store_token_writes_one_position_of_a_token_major_cache(d, cuda_dispatch):
    torch.manual_seed(d)
    T, rows, kvh = 7, 3, 2
    cache = torch.randn(T, rows, 2, kvh, d).half()
    want = cache.clone()
    kv = torch.randn(rows, 1, 2 * kvh * d).half()  # one projection's k and v columns, as views
    k, v = (x.view(rows, 1, kvh, d).transpose(1, 2) for x in kv.split([kvh * d, kvh * d], dim=-1))
    t = torch.tensor([4])
    E.store_token(cache, t, k, v)
    want[4, :, 0], want[4, :, 1] = k[:, :, 0], v[:, :, 0]
    assert torch.equal(cache, want)
