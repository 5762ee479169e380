"""Quantization kernels on the GPU: dequantization bandwidth against the device copy bandwidth,
and the fused dequantize-matmul against dequantize-then-matmul at decode shapes.

    python benchmarks/kernels.py [--out benchmarks/out]

Prints a table and appends JSON records to OUT/kernels.jsonl. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common import environment, table, write_jsonl


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds, timed with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    from flexoff.kernels import quant as K
    from flexoff.quant.format import QuantConfig, quantize_rows

    env = environment()
    rows = []
    # device copy bandwidth (bytes read + written)
    src = torch.randn(1 << 29, device="cuda", dtype=torch.float16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * 2 / ms / 1e6  # GB/s
    rows.append({"kernel": "device copy", "shape": "1 GiB", "ms": ms, "GB/s": copy_bw, "of copy": 1.0})
    cfg = QuantConfig(4, 64)
    for r, n in [(16384, 16384), (28672, 7168), (7168, 28672)]:
        x = torch.randn(r, n, device="cuda", dtype=torch.float16)
        d, s, m = quantize_rows(x, cfg)
        moved = d.numel() + 2 * s.numel() * 2 + r * n * 2  # packed + scales + mins read, fp16 written
        ms = bench(lambda: K.dequantize_rows_triton(d, s, m, cfg, torch.float16))
        rows.append({"kernel": "dequantize 4-bit", "shape": f"{r}x{n}", "ms": ms, "GB/s": moved / ms / 1e6,
                     "of copy": moved / ms / 1e6 / copy_bw})
        ms = bench(lambda: K.quantize_rows_triton(x, cfg))
        moved = r * n * 2 + d.numel() + 4 * s.numel()
        rows.append({"kernel": "quantize 4-bit", "shape": f"{r}x{n}", "ms": ms, "GB/s": moved / ms / 1e6,
                     "of copy": moved / ms / 1e6 / copy_bw})
        del x
    for k, n in [(7168, 7168), (7168, 28672), (28672, 7168), (8192, 28672)]:
        w = torch.randn(k, n, device="cuda", dtype=torch.float16)
        d, s, m = quantize_rows(w, cfg)
        for b in (1, 8, 16, 32, 64):
            x = torch.randn(b, k, device="cuda", dtype=torch.float16)
            fused = bench(lambda: K.qmatmul_triton(x, d, s, m, cfg, n))
            two = bench(lambda: x @ K.dequantize_rows_triton(d, s, m, cfg, torch.float16))
            dense = bench(lambda: x @ w)
            rows.append({"kernel": "qmatmul fused", "shape": f"{b}x{k}x{n}", "ms": fused,
                         "vs dequant+mm": two / fused, "vs dense fp16": dense / fused})
        del w
    print(table(rows, ["kernel", "shape", "ms", "GB/s", "of copy", "vs dequant+mm", "vs dense fp16"]))
    write_jsonl(args.out / "kernels.jsonl", [{**env, **r} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
