"""The profile's CPU attention measurement over caches laid out in host memory in different ways:
whether any of them reads at the rate the engine's lane gets (compare with `cpu_lane.py` on the
same machine, or with the rates the engine keeps, policy.calibration).

    python benchmarks/cpu_attn_layouts.py [--rounds 3] [--out benchmarks/out]

Layouts of the same cache (the profile's call: 32 rows, 32 heads of 128, 1024 positions, fp16 on
a GPU machine): `randn` (pageable, filled by torch's threads, as the profile does), `registered`
(page-locked in place as the engine's CPU tier is, filled by a CPU copy), `registered-dma` (the
same, filled from the GPU, as prefill fills the engine's cache), `one-thread` (pageable, first
touched by one thread). Each round measures every layout in turn: the median, the best and the
quartile of hardware.cpu_attention_samples' contended calls, and the CPU share of
hardware.joint_read_samples' windows. The registered layouts need CUDA; on a CPU machine
they are left out (and the calls are not contended). Prints a table and writes
OUT/cpu-attn-layouts.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from common import environment, table, write_jsonl

from flexoff.policy import hardware

SHAPE = (32, 32, 1024, 128)  # rows, heads, positions, head width: the profile's call
LAYOUTS = ("randn", "registered", "registered-dma", "one-thread")


def cache(layout: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """K and V of the call's rows, laid out as `layout` says."""
    from flexoff.offload.tiers import _registered

    numel = 1
    for n in shape:
        numel *= n
    if layout == "randn":
        return torch.randn(*shape, dtype=dtype)
    if layout == "one-thread":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return torch.randn(*shape, dtype=dtype)
        finally:
            torch.set_num_threads(threads)
    kv = _registered(numel * dtype.itemsize).view(dtype).view(shape)
    src = torch.randn(*shape, dtype=dtype, device="cuda" if layout == "registered-dma" else "cpu")
    kv.copy_(src)
    if src.is_cuda:
        torch.cuda.synchronize()
    return kv


def measure(layout: str, call: hardware.AttentionCall, rnd: int) -> dict[str, Any]:
    kv_bytes, _, secs = hardware.cpu_attention_samples(call=call)
    secs = sorted(secs)
    joint = [c / 1e9 for _, c in hardware.joint_read_samples(call=call)]
    return {"round": rnd, "layout": layout, "median_GBps": kv_bytes / statistics.median(secs) / 1e9,
            "best_GBps": kv_bytes / secs[0] / 1e9, "quartile_GBps": kv_bytes / secs[len(secs) // 4] / 1e9,
            "joint_cpu_GBps": statistics.median(joint) if joint else None, "calls": len(secs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print("cpu_attn_layouts.py: --rounds must be at least 1", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dtype = torch.float16 if cuda else torch.float32
    b, heads, s, d = SHAPE if cuda else (4, 8, 256, 64)
    layouts = LAYOUTS if cuda else ("randn", "one-thread")
    calls = {k: hardware.attention_call_over(cache(k, (2, b, heads, s - 1, d), dtype)) for k in layouts}
    env, rows = environment(), []
    for rnd in range(args.rounds):
        for k in layouts:
            row = {**measure(k, calls[k], rnd), **env}
            rows.append(row)
            print(table([row], ["round", "layout", "median_GBps", "best_GBps", "quartile_GBps", "joint_cpu_GBps"]),
                  flush=True)
    write_jsonl(args.out / "cpu-attn-layouts.jsonl", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
