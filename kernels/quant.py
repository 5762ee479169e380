"""Quantization kernels: Triton on CUDA, the torch reference elsewhere, behind one dispatch each.

Knows: three kernels over the row layout of quant.format (rows of groups,
two 4-bit values per byte, float16 scale and minimum per group):
`dequantize_rows` (packed rows to float16/bfloat16/float32, any even group
size that divides the padded row), `quantize_rows` (the KV cache's
quantize-on-store; group a power of two), and `qmatmul`, a fused
dequantize-and-matmul for decode shapes (a few rows of x times a large
weight), which never writes the dense weight to memory.
Does not know: where tensors live or what they are.

Each `*_triton` function runs its kernel on any device Triton can reach
(the CPU under TRITON_INTERPRET=1, for tests); the dispatch functions use
them only for CUDA tensors.
"""

from __future__ import annotations

import torch

from flexoff.quant.format import QuantConfig
from flexoff.quant.format import dequantize_rows as dequantize_rows_ref
from flexoff.quant.format import quantize_rows as quantize_rows_ref

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton use the references
    HAVE_TRITON = False

FUSED_MAX_ROWS = 64  # x rows up to which qmatmul uses the fused kernel


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and t.is_cuda


# ---- dispatch ----------------------------------------------------------------
def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
                    dtype: torch.dtype) -> torch.Tensor:
    """(rows, n) dense values of packed rows."""
    if _use_triton(data):
        return dequantize_rows_triton(data, scale, mn, cfg, dtype)
    return dequantize_rows_ref(data, scale, mn, cfg, dtype)


def quantize_rows(rows: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed data, scale and minimum of (rows, n) values."""
    if _use_triton(rows) and cfg.group & (cfg.group - 1) == 0:
        return quantize_rows_triton(rows, cfg)
    return quantize_rows_ref(rows, cfg)


def qmatmul_ref(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
                n: int) -> torch.Tensor:
    """x (m, k) @ W (k, n), W given as k packed rows: dequantize, then matmul."""
    w = dequantize_rows(data, scale, mn, cfg, x.dtype)[:, :n]
    return x @ w


def qmatmul(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
            n: int) -> torch.Tensor:
    if _use_triton(x) and x.shape[0] <= FUSED_MAX_ROWS:
        return qmatmul_triton(x, data, scale, mn, cfg, n)
    return qmatmul_ref(x, data, scale, mn, cfg, n)


# ---- Triton ------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _unpack(data_ptr, rows, cols, stride, mask, BITS: tl.constexpr):
        """The integer codes at (rows, cols) of packed rows."""
        if BITS == 4:
            byte = tl.load(data_ptr + rows * stride + cols // 2, mask=mask, other=0).to(tl.int32)
            return (byte >> ((cols % 2) * 4)) & 0xF
        return tl.load(data_ptr + rows * stride + cols, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _to_bf16_grid(x):
        """float32 rounded to the nearest bfloat16 (ties to even), still as float32: the
        conversion that follows is then exact on GPUs and in the interpreter alike."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _dequant_kernel(data_ptr, scale_ptr, mn_ptr, out_ptr, M, N, sd, ss, so,
                        GROUP: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        OUT_BF16: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
        cols = tl.program_id(1) * BN + tl.arange(0, BN)[None, :]
        mask = (rows < M) & (cols < N)
        q = _unpack(data_ptr, rows, cols, sd, mask, BITS)
        g = cols // GROUP
        s = tl.load(scale_ptr + rows * ss + g, mask=mask, other=0).to(tl.float32)
        m = tl.load(mn_ptr + rows * ss + g, mask=mask, other=0).to(tl.float32)
        val = q.to(tl.float32) * s + m
        if OUT_BF16:
            val = _to_bf16_grid(val)
        tl.store(out_ptr + rows * so + cols, val.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _round_half_even(y):
        f = tl.floor(y)
        d = y - f
        odd = f - 2.0 * tl.floor(f * 0.5)
        return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))

    @triton.jit
    def _quant_kernel(x_ptr, data_ptr, scale_ptr, mn_ptr, M, sx, sd, ss,
                      GROUP: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr):
        """One group (a column block of GROUP values) of BM rows per program."""
        srow = tl.program_id(0) * BM + tl.arange(0, BM)
        rows = srow[:, None]
        gi = tl.program_id(1)
        cols = gi * GROUP + tl.arange(0, GROUP)[None, :]
        rmask = rows < M
        x = tl.load(x_ptr + rows * sx + cols, mask=rmask, other=0).to(tl.float32)
        lo = tl.min(x, axis=1)
        hi = tl.max(x, axis=1)
        levels: tl.constexpr = (1 << BITS) - 1
        scale = tl.math.div_rn(hi - lo, levels + 0.0).to(tl.float16)
        mn = lo.to(tl.float16)
        step = tl.where(scale.to(tl.float32) > 0, scale.to(tl.float32), 1.0)
        y = tl.math.div_rn(x - mn.to(tl.float32)[:, None], step[:, None])
        q = tl.minimum(tl.maximum(_round_half_even(y), 0.0), levels + 0.0).to(tl.int32)
        tl.store(scale_ptr + srow * ss + gi, scale, mask=srow < M)
        tl.store(mn_ptr + srow * ss + gi, mn, mask=srow < M)
        if BITS == 4:
            even, odd = tl.split(tl.reshape(q, (BM, GROUP // 2, 2)))
            packed = (even | (odd << 4)).to(tl.uint8)
            pcols = gi * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
            tl.store(data_ptr + rows * sd + pcols, packed, mask=rmask)
        else:
            tl.store(data_ptr + rows * sd + cols, q.to(tl.uint8), mask=rmask)

    @triton.jit
    def _qmatmul_kernel(x_ptr, data_ptr, scale_ptr, mn_ptr, y_ptr, M, N, K, sx, sd, ss, sy,
                        GROUP: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
        """y[:, block] = x @ W[:, block]; W's codes are dequantized in registers, tile by tile."""
        rm = tl.program_id(1) * BM + tl.arange(0, BM)[:, None]
        cols = tl.program_id(0) * BN + tl.arange(0, BN)[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kx = k0 + tl.arange(0, BK)[None, :]
            x = tl.load(x_ptr + rm * sx + kx, mask=(rm < M) & (kx < K), other=0.0)
            kw = k0 + tl.arange(0, BK)[:, None]
            wmask = (kw < K) & (cols < N)
            q = _unpack(data_ptr, kw, cols, sd, wmask, BITS)
            g = cols // GROUP
            s = tl.load(scale_ptr + kw * ss + g, mask=wmask, other=0).to(tl.float32)
            m = tl.load(mn_ptr + kw * ss + g, mask=wmask, other=0).to(tl.float32)
            w = (q.to(tl.float32) * s + m).to(x.dtype)
            acc += tl.dot(x, w)
        tl.store(y_ptr + rm * sy + cols, acc.to(y_ptr.dtype.element_ty), mask=(rm < M) & (cols < N))


def _rows_ok(t: torch.Tensor) -> torch.Tensor:
    """Rows may be strided; values within a row must be contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dequantize_rows_triton(data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
                           dtype: torch.dtype) -> torch.Tensor:
    data, scale, mn = _rows_ok(data), _rows_ok(scale), _rows_ok(mn)
    M, N = data.shape[0], data.shape[1] * 8 // cfg.bits
    out = torch.empty(M, N, dtype=dtype, device=data.device)
    BM, BN = 8, 256
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _dequant_kernel[grid](data, scale, mn, out, M, N, data.stride(0), scale.stride(0), out.stride(0),
                          GROUP=cfg.group, BITS=cfg.bits, BM=BM, BN=BN, OUT_BF16=dtype == torch.bfloat16)
    return out


def quantize_rows_triton(rows: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = _rows_ok(rows)
    M, N = rows.shape
    assert N % cfg.group == 0 and cfg.group & (cfg.group - 1) == 0
    data = torch.empty(M, N * cfg.bits // 8, dtype=torch.uint8, device=rows.device)
    scale = torch.empty(M, N // cfg.group, dtype=torch.float16, device=rows.device)
    mn = torch.empty_like(scale)
    BM = 16
    grid = (triton.cdiv(M, BM), N // cfg.group)
    _quant_kernel[grid](rows, data, scale, mn, M, rows.stride(0), data.stride(0), scale.stride(0),
                        GROUP=cfg.group, BITS=cfg.bits, BM=BM)
    return data, scale, mn


def qmatmul_triton(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
                   n: int) -> torch.Tensor:
    x, data, scale, mn = _rows_ok(x), _rows_ok(data), _rows_ok(scale), _rows_ok(mn)
    M, K = x.shape
    assert data.shape[0] == K
    y = torch.empty(M, n, dtype=x.dtype, device=x.device)
    BM = 16 if M <= 16 else (32 if M <= 32 else 64)
    BN, BK = 64, 64
    grid = (triton.cdiv(n, BN), triton.cdiv(M, BM))
    _qmatmul_kernel[grid](x, data, scale, mn, y, M, n, K, x.stride(0), data.stride(0), scale.stride(0),
                          y.stride(0), GROUP=cfg.group, BITS=cfg.bits, BM=BM, BN=BN, BK=BK)
    return y
