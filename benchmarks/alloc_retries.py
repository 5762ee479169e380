"""Prefill allocations that found the GPU memory cap reached: one policy's prefill under several
settings of FLEXOFF_PREFILL_CHUNK, in one process on the same resident weights, each run's
allocator retries and prefill time, and, with `--trace`, which allocations retried (the CUDA
allocator's memory history: an allocation right after it released segments), by size and call site.

    python benchmarks/alloc_retries.py --policy 48x8:39.3,60.7,0,100,2.08333,97.9167:wk \\
        --hardware P --set 0 --set 8192 --trace [--out benchmarks/out]

Prints one JSON line per run and writes them to OUT/alloc-retries.json. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from common import cuda_missing
from throughput import Bench, parse_policy


def retried(trace: list[dict[str, Any]]) -> tuple[Counter, Counter]:
    """Allocations that followed a release of cached segments (a retry), by call site in flexoff
    (innermost four frames) and by MiB."""
    sites, sizes, released = Counter(), Counter(), False
    for e in trace:
        if e["action"] in ("segment_unmap", "segment_free"):
            released = True
        elif e["action"] == "alloc" and released:
            frames = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in e.get("frames", [])
                      if any(part in f["filename"] for part in ("flexoff", "/offload/", "/models/"))][:4]
            sites[" < ".join(frames)] += 1
            sizes[round(e["size"] / 2**20)] += 1
            released = False
    return sites, sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:opt-30b")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gpu-mem", default="16GiB")
    ap.add_argument("--cpu-mem", default="100GiB")
    ap.add_argument("--hardware", default=None)
    ap.add_argument("--set", action="append", default=None, dest="chunks", metavar="TOKENS",
                    help="a FLEXOFF_PREFILL_CHUNK value to run with (0: whole GPU batches)")
    ap.add_argument("--trace", action="store_true", help="also record which allocations retried")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if cuda_missing("alloc_retries.py"):
        return 0
    from flexoff.cli import parse_size

    bench = Bench(args.model, parse_size(args.gpu_mem), parse_size(args.cpu_mem), None, args.hardware, "auto",
                  "auto", None)
    rows = []
    try:
        policy = bench.resolve(parse_policy(args.policy), args.prompt_len, 2, None)
        bench._measure("warm-up", policy, args.prompt_len, 2, 16, "warm-up")
        for chunk in args.chunks or ["0", "8192"]:
            os.environ["FLEXOFF_PREFILL_CHUNK"] = chunk
            bench.llm.drop_engine()  # read when an engine is built
            if args.trace:
                torch.cuda.memory._record_memory_history(max_entries=300000, stacks="python", context="alloc")
            rec = bench._measure(f"chunk={chunk}", policy, args.prompt_len, 2, None, "setting")
            row = {"chunk": chunk, "policy": rec["policy"], "prefill_s": rec["prefill_s"],
                   "predicted_prefill_s": rec["predicted_prefill_s"], "retries": rec.get("alloc_retries"),
                   "peak_allocated_GiB": rec.get("peak_allocated_GiB"),
                   "peak_reserved_GiB": rec.get("peak_reserved_GiB")}
            if args.trace:
                trace = torch.cuda.memory._snapshot()["device_traces"][0]
                torch.cuda.memory._record_memory_history(enabled=None)
                sites, sizes = retried(trace)
                row.update(retry_sites=sites.most_common(12), retry_MiB=sizes.most_common(12))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        bench.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alloc-retries.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
