"""Triton kernels against their torch references (on the CPU via TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flexoff.kernels import quant as K
from flexoff.quant.format import QuantConfig, dequantize_rows, quantize_rows, to_rows

pytestmark = pytest.mark.skipif(not K.HAVE_TRITON, reason="triton is not installed")


def packed(rows: int, n: int, cfg: QuantConfig, stride_pad: int = 0):
    """Quantized random rows; with stride_pad, as views into wider buffers (strided rows)."""
    x = torch.randn(rows, n) * 2 - 0.5
    d, s, m = quantize_rows(to_rows(x, cfg), cfg)  # rows padded to whole groups
    if stride_pad:
        def strided(t):
            big = torch.zeros(t.shape[0], t.shape[1] + stride_pad, dtype=t.dtype)
            big[:, :t.shape[1]] = t
            return big[:, :t.shape[1]]
        d, s, m = strided(d), strided(s), strided(m)
    return d, s, m


@pytest.mark.parametrize("rows,n,bits,group,pad", [
    (1, 64, 4, 64, 0), (37, 384, 4, 64, 3), (130, 96, 4, 6, 0), (5, 256, 8, 32, 7), (9, 1000, 4, 10, 1),
    (20, 1536, 4, 128, 0), (3, 2048, 4, 16, 5),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_equals_reference(rows, n, bits, group, pad, dtype):
    cfg = QuantConfig(bits, group)
    d, s, m = packed(rows, n, cfg, pad)
    assert torch.equal(K.dequantize_rows_triton(d, s, m, cfg, dtype), dequantize_rows(d, s, m, cfg, dtype))


@pytest.mark.parametrize("rows,n,bits,group", [(1, 64, 4, 64), (33, 256, 4, 64), (7, 128, 4, 16), (20, 64, 8, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_equals_reference(rows, n, bits, group, dtype):
    cfg = QuantConfig(bits, group)
    x = (torch.randn(rows, n) * 3).to(dtype)
    x[0, :group] = 1.5  # a constant group
    got = K.quantize_rows_triton(x, cfg)
    want = quantize_rows(x.float(), cfg)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("m,k,n,group", [(1, 64, 64, 64), (3, 97, 130, 64), (16, 128, 200, 8), (40, 70, 64, 32),
                                          (2, 200, 300, 6), (64, 300, 1000, 128)])
def test_fused_qmatmul_matches_dequantize_then_matmul(m, k, n, group):
    cfg = QuantConfig(4, group)
    d, s, mn = packed(k, n, cfg)
    x = torch.randn(m, k, dtype=torch.float16)
    got = K.qmatmul_triton(x, d, s, mn, cfg, n).double()
    want = (x.double() @ dequantize_rows(d, s, mn, cfg, torch.float16).double()[:, :n])
    assert got.shape == (m, n)
    assert ((got - want).norm() / want.norm()) < 2e-3  # float16 operands, float32 accumulation


def test_dispatch_uses_references_off_cuda():
    cfg = QuantConfig()
    d, s, m = packed(4, 128, cfg)
    assert torch.equal(K.dequantize_rows(d, s, m, cfg, torch.float32), dequantize_rows(d, s, m, cfg, torch.float32))
    x = torch.randn(2, 4)
    assert torch.equal(K.qmatmul(x, d, s, m, cfg, 100), x @ dequantize_rows(d, s, m, cfg, torch.float32)[:, :100])


@pytest.mark.parametrize("m", [3, 40])  # the fused kernel's rows, and a prefill's (dequantize, then addmm)
def test_qmatmul_adds_the_bias_inside(m):
    """A bias given to qmatmul equals adding it after, in float64 (both paths: fused and dense)."""
    cfg = QuantConfig(4, 64)
    k, n = 128, 200
    d, s, mn = packed(k, n, cfg)
    x, b = torch.randn(m, k), torch.randn(n)
    want = x.double() @ dequantize_rows(d, s, mn, cfg, torch.float64)[:, :n] + b.double()
    for got in (K.qmatmul(x, d, s, mn, cfg, n, b), K.qmatmul_triton(x[:32], d, s, mn, cfg, n, b)):
        assert torch.allclose(got.double(), want[:got.shape[0]], rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_fused_qmatmul_is_deterministic_on_cuda():
    """The K slices' partial sums are added in a fixed order: the same call gives the same bits
    every time (atomic float adds once made greedy ties come out either way between runs)."""
    torch.manual_seed(0)
    cfg = QuantConfig(4, 64)
    k, n = 7168, 1024  # few column blocks and a long K: many slices
    d, s, mn = (t.cuda() for t in packed(k, n, cfg))
    x = torch.randn(32, k, dtype=torch.float16, device="cuda")
    first = K.qmatmul_triton(x, d, s, mn, cfg, n)
    assert all(torch.equal(K.qmatmul_triton(x, d, s, mn, cfg, n), first) for _ in range(30))


@pytest.mark.parametrize("rows,heads,s,d,bits,group", [(3, 4, 5, 64, 4, 64), (2, 3, 7, 80, 4, 32), (1, 2, 3, 48, 8, 16),
                                                     (4, 1, 2, 128, 4, 128), (2, 5, 9, 64, 4, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_encode_writes_the_reference_records(rows, heads, s, d, bits, group, dtype, monkeypatch):
    """Keys and values quantized straight into the cache's records equal the reference encode
    (gather, quantize, concatenate) byte for byte: strided k and v (as attention makes them),
    head dimensions padded to whole groups, 8 bits, a constant group, and a write at token t
    into a larger buffer, which must leave the bytes around it alone."""
    from flexoff.quant import engine as E

    def strided(x):  # (rows, heads, s, d) as a view of (rows, s, heads, d)
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    k = strided((torch.randn(rows, heads, s, d) * 3).to(dtype))
    v = strided((torch.randn(rows, heads, s, d) - 1).to(dtype))
    k[0, 0, 0, :min(group, d)] = 0.75
    codec = E.QuantKV(heads, d, dtype, bits, group)
    want = codec.encode(k, v)  # the reference path off CUDA
    got = torch.full_like(want, 7)
    K.kv_encode_triton(k, v, got, codec.cfg)
    assert torch.equal(got, want)
    monkeypatch.setattr(E, "kv_encode_ok", lambda *a: True)  # QuantKV.write through the kernel
    t, rec = 2, codec.rec_bytes
    buf = torch.full(((t + s + 1) * rows * rec,), 9, dtype=torch.uint8)
    codec.write(buf, rows, t, k, v)
    assert torch.equal(buf[t * rows * rec:(t + s) * rows * rec].view(s, rows, rec), want)
    assert (buf[:t * rows * rec] == 9).all() and (buf[(t + s) * rows * rec:] == 9).all()


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import flexoff.kernels.quant as K
i32, f16, u8 = "i32", "*fp16", "*u8"
kernels = {
    K._quant_kernel: dict(x_ptr=f16, data_ptr=u8, scale_ptr=f16, mn_ptr=f16, M=i32, sx=i32, sd=i32, ss=i32),
    K._kv_encode_kernel: dict(k_ptr=f16, v_ptr=f16, out_ptr=u8, out16_ptr=f16, **dict.fromkeys(
        ("M", "R", "H", "D", "skb", "skh", "skt", "svb", "svh", "svt", "rec", "code_bytes"), i32)),
}
for fn, sig in kernels.items():
    for bits in (4, 8):
        ce = dict(GROUP=64, BITS=bits, BM=16)
        triton.compile(ASTSource(fn=fn, signature={**sig, **dict.fromkeys(ce, "constexpr")}, constexprs=ce),
                       target=GPUTarget("cuda", 90, 32))
"""


def test_quantize_kernels_compile_for_the_gpu():
    """The interpreter runs code that the GPU compiler refuses (it took an early return inside a
    branch of a helper); compiling for sm_90 needs no GPU, so the CPU checks that too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
