"""Quantization kernels on the GPU: dequantization bandwidth against the device copy bandwidth,
the fused dequantize-matmul against dequantize-then-matmul at decode shapes, and the KV cache's
quantize-on-store (one kernel into the records against gather, quantize, concatenate), each call
timed with its host work (CUDA events around eager calls) and without it (CUDA graphs).

    python benchmarks/kernels.py [--out benchmarks/out] [--tune] [--kv-only]

Prints a table and appends JSON records to OUT/kernels.jsonl. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from common import environment, gpu_seconds, table, write_jsonl


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds, timed with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_ms(fn, calls: int = 50) -> float:
    """Milliseconds of host time per call: calls enqueued back to back, before the GPU is awaited."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sec = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e3 * sec / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--tune", action="store_true", help="also sweep tile sizes and print the best")
    ap.add_argument("--kv-only", action="store_true", help="only the KV cache's encode")
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
    rows += kv_encode(copy_bw, args.tune)
    if args.kv_only:
        print(table(rows, ["kernel", "shape", "ms", "GB/s", "of copy", "vs unfused", "gpu ms", "gpu vs unfused",
                           "host ms", "host ms unfused", "tile"]))
        write_jsonl(args.out / "kernels.jsonl", [{**env, **r} for r in rows])
        return 0
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
            def fused_call():
                return K.qmatmul_triton(x, d, s, m, cfg, n)

            def two_call():
                return x @ K.dequantize_rows_triton(d, s, m, cfg, torch.float16)

            fused, two, dense = bench(fused_call), bench(two_call), bench(lambda: x @ w)
            # the same calls' GPU time alone (CUDA graphs: no host work per call)
            fused_gpu, two_gpu = 1e3 * gpu_seconds(fused_call, 10), 1e3 * gpu_seconds(two_call, 10)
            rows.append({"kernel": "qmatmul fused", "shape": f"{b}x{k}x{n}", "ms": fused,
                         "vs dequant+mm": two / fused, "vs dense fp16": dense / fused, "gpu ms": fused_gpu,
                         "gpu vs dequant+mm": two_gpu / fused_gpu, "host ms": host_ms(fused_call),
                         "host ms dequant+mm": host_ms(two_call)})
        w = d = s = m = None  # free before the next shape
    if args.tune:
        rows += tune(K, cfg, copy_bw)
    print(table(rows, ["kernel", "shape", "ms", "GB/s", "of copy", "vs dequant+mm", "vs dense fp16", "gpu ms",
                       "gpu vs dequant+mm", "host ms", "host ms dequant+mm", "tile"]))
    write_jsonl(args.out / "kernels.jsonl", [{**env, **r} for r in rows])
    return 0


def kv_encode(copy_bw: float, tune: bool = False) -> list[dict]:
    """OPT-30B's KV records (56 heads of 128, 4 bits in groups of 64) for 48 sequences: a 512-token
    prompt and one decode token, quantized by one kernel into the records and by the unfused
    path (records gathered, quantized into three tensors, concatenated); with tune, the kernel's
    tiles too."""
    from flexoff.kernels.quant import KV_ENCODE_TILE, kv_encode_triton
    from flexoff.quant.engine import QuantKV

    codec, out = QuantKV(56, 128, torch.float16, 4, 64), []
    for n, s in [(48, 512), (48, 1)]:
        k, v = (torch.randn(n, s, 56, 128, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(2))
        rec = torch.empty(s, n, codec.rec_bytes, dtype=torch.uint8, device="cuda")

        def fused():
            kv_encode_triton(k, v, rec, codec.cfg)

        def unfused():
            torch.cat(codec._encoded(k, v), dim=-1, out=rec)

        ms, ms_un = bench(fused), bench(unfused)
        gpu, gpu_un = 1e3 * gpu_seconds(fused, 10), 1e3 * gpu_seconds(unfused, 10)
        moved = 2 * k.numel() * 2 + rec.numel()  # k and v read, records written
        out.append({"kernel": "KV encode 4-bit", "shape": f"{n}x56x{s}x128", "ms": ms, "GB/s": moved / ms / 1e6,
                    "of copy": moved / ms / 1e6 / copy_bw, "vs unfused": ms_un / ms, "gpu ms": gpu,
                    "gpu vs unfused": gpu_un / gpu, "host ms": host_ms(fused), "host ms unfused": host_ms(unfused),
                    "tile": str(KV_ENCODE_TILE)})
        for bm, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8)) if tune else ():
            ms = bench(lambda: kv_encode_triton(k, v, rec, codec.cfg, BM=bm, num_warps=warps))
            out.append({"kernel": "KV encode 4-bit, tile", "shape": f"{n}x56x{s}x128", "ms": ms,
                        "GB/s": moved / ms / 1e6, "of copy": moved / ms / 1e6 / copy_bw, "vs unfused": ms_un / ms,
                        "tile": str({"BM": bm, "num_warps": warps})})
    return out


def tune(K, cfg, copy_bw: float) -> list[dict]:
    """Sweep tile sizes of the two 4-bit kernels; the best of each is printed (set it as the default
    in flexoff/kernels/quant.py). The fused matmul's tiles by GPU time (CUDA graphs), against
    dequantize-then-matmul timed the same way."""
    from flexoff.quant.format import quantize_rows

    out = []
    x = torch.randn(16384, 16384, device="cuda", dtype=torch.float16)
    d, s, m = quantize_rows(x, cfg)
    moved = d.numel() + 4 * s.numel() + x.numel() * 2
    for BM in (8, 16, 32):
        for HB in (128, 256, 512):
            for warps in (4, 8):
                tile = {"BM": BM, "HB": HB, "num_warps": warps}
                ms = bench(lambda: K.dequantize_rows_triton(d, s, m, cfg, torch.float16, **tile), 10, 50)
                out.append({"kernel": "tune dequantize", "shape": "16384x16384", "ms": ms, "GB/s": moved / ms / 1e6,
                            "of copy": moved / ms / 1e6 / copy_bw, "tile": tile})
    del x
    for k, n in [(7168, 7168), (7168, 28672), (28672, 7168)]:
        w = torch.randn(k, n, device="cuda", dtype=torch.float16)
        d, s, m = quantize_rows(w, cfg)
        for b in (1, 32):
            xx = torch.randn(b, k, device="cuda", dtype=torch.float16)
            two = 1e3 * gpu_seconds(lambda: xx @ K.dequantize_rows_triton(d, s, m, cfg, torch.float16), 10)
            for HB in (32, 64, 128):
                for BK in (32, 64, 128):
                    for waves in (2, 4, 8):
                        for stages in (2, 4):
                            tile = {"HB": HB, "BK": BK, "waves": waves, "num_stages": stages, "num_warps": 4}
                            ms = 1e3 * gpu_seconds(lambda: K.qmatmul_triton(xx, d, s, m, cfg, n, **tile), 10)
                            out.append({"kernel": "tune qmatmul", "shape": f"{b}x{k}x{n}", "ms": ms,
                                        "GB/s": d.numel() * 1.125 / ms / 1e6, "vs dequant+mm": two / ms, "tile": tile})
        del w
    for kind in ("tune dequantize", "tune qmatmul"):
        for shape in sorted({r["shape"] for r in out if r["kernel"] == kind}):
            best = min((r for r in out if r["kernel"] == kind and r["shape"] == shape), key=lambda r: r["ms"])
            print(f"best {kind} {shape}: {best['ms']:.3f} ms {best['tile']}")
    return [min((r for r in out if r["kernel"] == k and r["shape"] == sh), key=lambda r: r["ms"])
            for k in ("tune dequantize", "tune qmatmul") for sh in sorted({r["shape"] for r in out if r["kernel"] == k})]


if __name__ == "__main__":
    sys.exit(main())
