"""Prefill matmuls at transformer-layer shapes, and the device's elementwise passes: what the
profile's `mm_flops_p_layers` and `gpu_mem_bdw` stand for, shape by shape.

    python benchmarks/layer_gemm.py [--hidden 4096,5120,7168,8192] [--rows 2048,8192,24576] [--out benchmarks/out]

For each hidden size h (MLP width 4h) and number of rows, times a layer's projections as the
engine calls them (`F.linear` with a bias: q, k, v together h -> 3h, the output h -> h, up
h -> 4h, down 4h -> h) with CUDA events, and the layer's rate (total FLOPs over total time);
then elementwise passes over 256 Mi half-precision values (bytes read plus written). Prints a
table and appends JSON records to OUT/layer_gemm.jsonl. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common import cuda_missing, environment, event_ms as ms, table, write_jsonl
from flexoff.policy.hardware import elementwise_passes, layer_projections


def layer_rows(hidden: int, rows: int) -> list[dict[str, Any]]:
    dt, dev = torch.float16, "cuda"
    x = {k: torch.randn(rows, k, device=dev, dtype=dt) for k in (hidden, 4 * hidden)}
    out, flops, total = [], 0.0, 0.0
    for name, n, k in layer_projections(hidden):
        w, b = torch.randn(n, k, device=dev, dtype=dt), torch.randn(n, device=dev, dtype=dt)
        t = ms(lambda: F.linear(x[k], w, b))
        f = 2 * rows * n * k
        out.append({"what": f"linear {name}", "hidden": hidden, "rows": rows, "ms": t, "TFLOPs": f / t / 1e9})
        flops, total = flops + f, total + t
    out.append({"what": "layer", "hidden": hidden, "rows": rows, "ms": total, "TFLOPs": flops / total / 1e9})
    return out


def elementwise_rows() -> list[dict[str, Any]]:
    """The profile's elementwise passes, and a plain copy, over 256 Mi half-precision values."""
    x, y = (torch.randn(1 << 15, 8192, device="cuda", dtype=torch.float16) for _ in range(2))
    passes = {"copy": (lambda: y.copy_(x), 2), **elementwise_passes(x, y)}
    return [{"what": name, "ms": (t := ms(fn)), "GBps": k * x.numel() * x.element_size() / t / 1e6}
            for name, (fn, k) in passes.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="4096,5120,7168,8192")
    ap.add_argument("--rows", default="2048,8192,24576")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args(argv)
    if cuda_missing("layer_gemm.py"):
        return 2
    rows = [r for h in map(int, args.hidden.split(",")) for m in map(int, args.rows.split(","))
            for r in layer_rows(h, m)]
    torch.cuda.empty_cache()
    rows += elementwise_rows()
    print(table(rows, ["what", "hidden", "rows", "ms", "TFLOPs", "GBps"]))
    write_jsonl(args.out / "layer_gemm.jsonl", [dict(r, **environment()) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
