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

import functools

import torch

from flexoff.quant.format import QuantConfig, padded
from flexoff.quant.format import dequantize_rows as dequantize_rows_ref
from flexoff.quant.format import quantize_rows as quantize_rows_ref

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton use the references
    HAVE_TRITON = False

FUSED_MAX_ROWS = 32  # x rows up to which qmatmul uses the fused kernel (faster than dequantize + matmul)


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
                n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (m, k) @ W (k, n) (+ bias (n,)), W given as k packed rows: dequantize, then matmul. The
    bias goes into the matmul (added before its one rounding, and without a broadcast pass over
    the output, which took 7% of an OPT-30B compressed prefill's GPU time)."""
    w = dequantize_rows(data, scale, mn, cfg, x.dtype)[:, :n]
    return x @ w if bias is None else torch.addmm(bias, x, w)


def fuses(rows: int, device: torch.device) -> bool:
    """Whether qmatmul dequantizes in registers (the fused kernel) for x of `rows` rows on
    `device`; otherwise it dequantizes the whole weight first."""
    return HAVE_TRITON and device.type == "cuda" and rows <= FUSED_MAX_ROWS


def qmatmul(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
            n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    if fuses(x.shape[0], x.device):
        return qmatmul_triton(x, data, scale, mn, cfg, n, bias)
    return qmatmul_ref(x, data, scale, mn, cfg, n, bias)


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
    def _quant_groups(x, BM: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
        """Codes (packed: two 4-bit values per byte, the even column low), float16 scale and
        minimum of a (BM, GROUP) float32 tile whose rows are one group each."""
        lo = tl.min(x, axis=1)
        hi = tl.max(x, axis=1)
        levels: tl.constexpr = (1 << BITS) - 1
        scale = tl.math.div_rn(hi - lo, levels + 0.0).to(tl.float16)
        mn = lo.to(tl.float16)
        step = tl.where(scale.to(tl.float32) > 0, scale.to(tl.float32), 1.0)
        y = tl.math.div_rn(x - mn.to(tl.float32)[:, None], step[:, None])
        q = tl.minimum(tl.maximum(_round_half_even(y), 0.0), levels + 0.0).to(tl.int32)
        if BITS == 4:  # (no return inside the branch: the compiler refuses an early return)
            even, odd = tl.split(tl.reshape(q, (BM, GROUP // 2, 2)))
            q = even | (odd << 4)
        return q.to(tl.uint8), scale, mn

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
        codes, scale, mn = _quant_groups(x, BM, GROUP, BITS)
        tl.store(scale_ptr + srow * ss + gi, scale, mask=srow < M)
        tl.store(mn_ptr + srow * ss + gi, mn, mask=srow < M)
        CB: tl.constexpr = GROUP * BITS // 8  # code bytes per group
        tl.store(data_ptr + rows * sd + gi * CB + tl.arange(0, CB)[None, :], codes, mask=rmask)

    @triton.jit
    def _kv_encode_kernel(k_ptr, v_ptr, out_ptr, out16_ptr, M, R, H, D, skb, skh, skt, svb, svh, svt,
                          rec, code_bytes, GROUP: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr):
        """One group of BM record rows per program. Record row m is ((token * R + seq) * 2 + kv)
        * H + head, as quant.engine.records orders them; it is read from k or v (any strides, the
        head dimension contiguous, padded by repeating its last value) and its codes, scale and
        minimum go to row m % 2H of each part of the (token, seq) record, rec bytes apart."""
        m = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        mask = m < M
        h = m % H
        is_k = (m // H) % 2 == 0
        tb = m // (2 * H)
        b, t = tb % R, tb // R
        gi = tl.program_id(1)
        ng = tl.num_programs(1)
        cols = tl.minimum(gi * GROUP + tl.arange(0, GROUP), D - 1)[None, :]
        xk = tl.load(k_ptr + (b * skb + h * skh + t * skt)[:, None] + cols, mask=(mask & is_k)[:, None], other=0)
        xv = tl.load(v_ptr + (b * svb + h * svh + t * svt)[:, None] + cols, mask=(mask & ~is_k)[:, None], other=0)
        x = tl.where(is_k[:, None], xk.to(tl.float32), xv.to(tl.float32))
        codes, scale, mn = _quant_groups(x, BM, GROUP, BITS)
        r = m % (2 * H)
        CB: tl.constexpr = GROUP * BITS // 8
        tl.store(out_ptr + (tb * rec + r * code_bytes + gi * CB)[:, None] + tl.arange(0, CB)[None, :], codes,
                 mask=mask[:, None])
        s_at = (tb * rec + 2 * H * code_bytes) // 2 + r * ng + gi  # float16 index of the scale
        tl.store(out16_ptr + s_at, scale, mask=mask)
        tl.store(out16_ptr + s_at + 2 * H * ng, mn, mask=mask)

    @triton.jit
    def _group_broadcast(t, ROWS: tl.constexpr, NG: tl.constexpr, HB: tl.constexpr):
        """(ROWS, NG) per-group values repeated over each group's HB // NG byte columns."""
        return tl.reshape(tl.broadcast_to(t[:, :, None], (ROWS, NG, HB // NG)), (ROWS, HB))

    @triton.jit
    def _dequant4_kernel(data_ptr, scale_ptr, mn_ptr, out_ptr, M, NB, sd, ss, so,
                         GROUP: tl.constexpr, BM: tl.constexpr, HB: tl.constexpr, OUT_BF16: tl.constexpr):
        """4-bit rows, a power-of-two group dividing 2 * HB: whole tiles of packed bytes; the low
        and high nibbles are the even and odd columns, interleaved in registers."""
        NG: tl.constexpr = 2 * HB // GROUP
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        bcols = tl.program_id(1) * HB + tl.arange(0, HB)
        gcols = tl.program_id(1) * NG + tl.arange(0, NG)
        rmask = rows[:, None] < M
        b = tl.load(data_ptr + rows[:, None] * sd + bcols[None, :], mask=rmask & (bcols[None, :] < NB), other=0)
        gmask = rmask & (gcols[None, :] < NB * 2 // GROUP)
        s = tl.load(scale_ptr + rows[:, None] * ss + gcols[None, :], mask=gmask, other=0).to(tl.float32)
        m = tl.load(mn_ptr + rows[:, None] * ss + gcols[None, :], mask=gmask, other=0).to(tl.float32)
        s = _group_broadcast(s, BM, NG, HB)
        m = _group_broadcast(m, BM, NG, HB)
        b = b.to(tl.int32)
        lo = (b & 0xF).to(tl.float32) * s + m
        hi = (b >> 4).to(tl.float32) * s + m
        if OUT_BF16:
            lo = _to_bf16_grid(lo)
            hi = _to_bf16_grid(hi)
        out = tl.reshape(tl.join(lo, hi), (BM, 2 * HB))
        cols = tl.program_id(1) * 2 * HB + tl.arange(0, 2 * HB)
        tl.store(out_ptr + rows[:, None] * so + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rmask & (cols[None, :] < 2 * NB))

    @triton.jit
    def _qmatmul4_kernel(x_ptr, data_ptr, scale_ptr, mn_ptr, y_ptr, M, NB, K, sx, sd, ss, sy, s_split, K_SPLIT,
                         GROUP: tl.constexpr, BM: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr):
        """y[slice] (M, 2 NB) = x (M, K) @ W for one block of output columns and one slice of K.
        W's codes are unpacked and dequantized tile by tile in registers (never written to
        memory); low and high nibbles feed two dots (even and odd columns); each K slice writes
        its own float32 partial sums (the caller adds them in a fixed order: atomic adds made
        the result depend on timing, and greedy ties came out either way between runs)."""
        NG: tl.constexpr = 2 * HB // GROUP
        bcols = tl.program_id(0) * HB + tl.arange(0, HB)
        gcols = tl.program_id(0) * NG + tl.arange(0, NG)
        rm = tl.arange(0, BM)
        acc_lo = tl.zeros((BM, HB), dtype=tl.float32)
        acc_hi = tl.zeros((BM, HB), dtype=tl.float32)
        k_begin = tl.program_id(1) * K_SPLIT
        for k0 in range(k_begin, k_begin + K_SPLIT, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < K
            x = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
            b = tl.load(data_ptr + kk[:, None] * sd + bcols[None, :],
                        mask=kmask[:, None] & (bcols[None, :] < NB), other=0).to(tl.int32)
            gmask = kmask[:, None] & (gcols[None, :] < NB * 2 // GROUP)
            s = _group_broadcast(tl.load(scale_ptr + kk[:, None] * ss + gcols[None, :], mask=gmask,
                                         other=0).to(tl.float32), BK, NG, HB)
            m = _group_broadcast(tl.load(mn_ptr + kk[:, None] * ss + gcols[None, :], mask=gmask,
                                         other=0).to(tl.float32), BK, NG, HB)
            lo = ((b & 0xF).to(tl.float32) * s + m).to(x.dtype)
            hi = ((b >> 4).to(tl.float32) * s + m).to(x.dtype)
            acc_lo += tl.dot(x, lo)
            acc_hi += tl.dot(x, hi)
        out = tl.reshape(tl.join(acc_lo, acc_hi), (BM, 2 * HB))
        cols = tl.program_id(0) * 2 * HB + tl.arange(0, 2 * HB)
        tl.store(y_ptr + tl.program_id(1) * s_split + rm[:, None] * sy + cols[None, :], out,
                 mask=(rm[:, None] < M) & (cols[None, :] < 2 * NB))


def _rows_ok(t: torch.Tensor) -> torch.Tensor:
    """Rows may be strided; values within a row must be contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _fast4(cfg: QuantConfig, width: int) -> bool:
    """The tiled 4-bit kernels apply: a power-of-two group that divides a tile of `width` values."""
    return cfg.bits == 4 and cfg.group & (cfg.group - 1) == 0 and width % cfg.group == 0


DEQUANT_TILE = {"BM": 16, "HB": 512, "num_warps": 4}  # tuned on an H200 (benchmarks/kernels.py --tune)
QMATMUL_TILE = {"HB": 128, "BK": 64, "waves": 2, "num_warps": 4, "num_stages": 4}


def dequantize_rows_triton(data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
                           dtype: torch.dtype, **tile: int) -> torch.Tensor:
    data, scale, mn = _rows_ok(data), _rows_ok(scale), _rows_ok(mn)
    M, N = data.shape[0], data.shape[1] * 8 // cfg.bits
    out = torch.empty(M, N, dtype=dtype, device=data.device)
    t = {**DEQUANT_TILE, **tile}
    if _fast4(cfg, 2 * t["HB"]):
        grid = (triton.cdiv(M, t["BM"]), triton.cdiv(data.shape[1], t["HB"]))
        _dequant4_kernel[grid](data, scale, mn, out, M, data.shape[1], data.stride(0), scale.stride(0),
                               out.stride(0), GROUP=cfg.group, BM=t["BM"], HB=t["HB"],
                               OUT_BF16=dtype == torch.bfloat16, num_warps=t["num_warps"])
        return out
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


def kv_encode_ok(k: torch.Tensor, cfg: QuantConfig) -> bool:
    """kv_encode_triton serves QuantKV here: CUDA tensors and a power-of-two group."""
    return _use_triton(k) and cfg.group & (cfg.group - 1) == 0


KV_ENCODE_TILE = {"BM": 16, "num_warps": 2}  # tuned on an H200 (benchmarks/kernels.py --kv-only --tune)


def kv_encode_triton(k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cfg: QuantConfig, **tile: int) -> None:
    """Quantize keys and values (rows, kv_heads, s, head_dim) straight into KV records: out is
    (s, rows, rec) contiguous bytes, each record the (2, kv_heads) rows of codes, then of float16
    scales, then of minimums (quant.engine.QuantKV's layout; one kernel instead of a gather, a
    quantize into three tensors and a concatenation)."""
    k, v = _rows_ok(k), _rows_ok(v)
    R, H, S, D = k.shape
    Dp = padded(D, cfg.group)
    assert out.is_contiguous() and out.dtype == torch.uint8 and out.shape[:2] == (S, R) and out.shape[2] % 2 == 0
    M, t = S * R * 2 * H, {**KV_ENCODE_TILE, **tile}
    grid = (triton.cdiv(M, t["BM"]), Dp // cfg.group)
    _kv_encode_kernel[grid](k, v, out, out.view(torch.float16), M, R, H, D, k.stride(0), k.stride(1), k.stride(2),
                            v.stride(0), v.stride(1), v.stride(2), out.shape[2], Dp * cfg.bits // 8,
                            GROUP=cfg.group, BITS=cfg.bits, BM=t["BM"], num_warps=t["num_warps"])


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """The device's multiprocessors (asked once: the query costs host time at every decode matmul)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def qmatmul_triton(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
                   n: int, bias: torch.Tensor | None = None, **tile: int) -> torch.Tensor:
    """x (m, k) @ W (k, n) (+ bias, added in float32 before the one rounding) with W's 4-bit rows
    dequantized in registers; m up to 64. Other formats (8 bits, groups the tiles cannot hold)
    dequantize first."""
    t = {**QMATMUL_TILE, **tile}
    HB, BK = t["HB"], t["BK"]  # byte columns (2 * HB outputs) and rows of W per step
    if not _fast4(cfg, 2 * HB):
        return qmatmul_ref(x, data, scale, mn, cfg, n, bias)
    x, data, scale, mn = _rows_ok(x), _rows_ok(data), _rows_ok(scale), _rows_ok(mn)
    M, K = x.shape
    assert data.shape[0] == K and M <= 64  # the kernel's limit; dispatch uses it up to FUSED_MAX_ROWS
    NB = data.shape[1]
    BM = max(16, triton.next_power_of_2(M))
    blocks = triton.cdiv(NB, HB)
    sms = _sm_count(x.device) if x.is_cuda else 4
    splits = max(1, min(triton.cdiv(K, BK), t["waves"] * sms // blocks))  # enough programs to fill the GPU
    k_split = triton.cdiv(triton.cdiv(K, splits), BK) * BK
    grid = (blocks, triton.cdiv(K, k_split))
    parts = torch.empty(grid[1], M, 2 * NB, dtype=torch.float32, device=x.device)
    _qmatmul4_kernel[grid](x, data, scale, mn, parts, M, NB, K, x.stride(0), data.stride(0), scale.stride(0),
                           parts.stride(1), parts.stride(0), k_split, GROUP=cfg.group, BM=BM, HB=HB, BK=BK,
                           num_warps=t["num_warps"], num_stages=t["num_stages"])
    y = (parts[0] if grid[1] == 1 else parts.sum(0))[:, :n]
    return (y if bias is None else y + bias).to(x.dtype)
