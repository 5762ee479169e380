"""Decode attention on the CPU over a CPU-resident KV cache: layouts and dtypes against the
machine's memory bandwidth. Decides how flexoff lays out rows that CPU attention reads.

    python benchmarks/cpu_attention.py [--rows 48 --heads 56 --head-dim 128 --tokens 544]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from common import environment, table, write_jsonl


def timed(fn, repeat: int = 5) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def memcpy_bandwidth() -> tuple[float, float]:
    """Host memcpy bytes/s (read + written) of a 1 GiB buffer, and seconds per copy."""
    big = torch.empty(1 << 28, dtype=torch.float32)
    big.normal_()
    other = torch.empty_like(big)
    s = timed(lambda: other.copy_(big), 3)
    return 2 * big.numel() * 4 / s / 1e9, s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=544)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    from flexoff.models.attention import attend

    b, h, d, t = args.rows, args.heads, args.head_dim, args.tokens
    copy_bw, s = memcpy_bandwidth()
    rows = [{"variant": "memcpy (read+write)", "dtype": "", "ms": s * 1e3, "GB/s": copy_bw}]
    mask = torch.ones(b, 1, t, dtype=torch.bool)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q = torch.randn(b, h, 1, d).to(dtype)
        tok = torch.randn(t, b, 2, h, d).to(dtype)  # token-major: the layout that crosses the link
        hm = torch.randn(2, b, h, t, d).to(dtype)  # head-major: flexoff's CPU-attention rows
        kv_bytes = 2 * b * h * t * d * dtype.itemsize
        variants = {
            "token-major strided": lambda: attend(q, tok[:, :, 0].permute(1, 2, 0, 3), tok[:, :, 1].permute(1, 2, 0, 3),
                                                  mask, d**-0.5),
            "head-major": lambda: attend(q, hm[0], hm[1], mask, d**-0.5),
        }
        for name, fn in variants.items():
            s = timed(fn)
            rows.append({"variant": name, "dtype": str(dtype).replace("torch.", ""), "ms": s * 1e3,
                         "GB/s": kv_bytes / s / 1e9, "of memcpy": kv_bytes / s / 1e9 / copy_bw})
    print(f"threads {torch.get_num_threads()}, {b} rows x {h} heads x {t} tokens x {d}")
    print(table(rows, ["variant", "dtype", "ms", "GB/s", "of memcpy"]))
    env = environment()
    write_jsonl(args.out / "cpu_attention.jsonl", [{**env, **vars(args), "out": str(args.out), **r} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
