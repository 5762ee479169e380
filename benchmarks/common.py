"""Shared by the benchmark scripts: where and when a result was measured, JSON records, tables.

Knows: the device, torch version, commit and date of a run; writing records as JSON
lines; printing a fixed-width table; a call's GPU time without its launch overhead. Does not
know what is measured.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def environment() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or 'x86_64'})",
            "cpus": os.cpu_count(), "torch": torch.__version__, "commit": os.environ.get("FLEXOFF_COMMIT", commit()),
            "date": datetime.date.today().isoformat(), "host": platform.node(),
            "settings": {k: v for k, v in os.environ.items() if k.startswith("FLEXOFF_") and k != "FLEXOFF_COMMIT"}}


class AllocatorWatch:
    """The CUDA caching allocator over a stretch of work: its peaks and how often an allocation
    found the memory cap reached and had to wait for the device and free its cache before trying
    again (`num_alloc_retries`; each one stalls the host). Empty without CUDA."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)

    def stats(self) -> dict[str, Any]:
        if not self.cuda:
            return {}
        s = torch.cuda.memory_stats()
        return {"alloc_retries": s.get("num_alloc_retries", 0) - self.retries0,
                "peak_reserved_GiB": s.get("reserved_bytes.all.peak", 0) / 2**30,
                "peak_allocated_GiB": s.get("allocated_bytes.all.peak", 0) / 2**30,
                # allocated, or freed with a stream use not yet seen done (record_stream)
                "peak_active_GiB": s.get("active_bytes.all.peak", 0) / 2**30,
                # free pieces of split blocks: reserved memory a larger request cannot use
                "peak_inactive_split_GiB": s.get("inactive_split_bytes.all.peak", 0) / 2**30}


def cuda_missing(script: str) -> bool:
    """True, with a line on stderr, where there is no CUDA device for a GPU benchmark."""
    if torch.cuda.is_available():
        return False
    print(f"{script} measures on a GPU; no CUDA device here", file=sys.stderr)
    return True


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def event_ms(fn: Callable[[], Any], repeat: int = 10, warmup: int = 1) -> float:
    """Median milliseconds of fn on the current stream, timed by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gpu_seconds(fn: Callable[[], Any], calls: int) -> float:
    """GPU time of one fn() from a CUDA graph of `calls` calls replayed 10 times (no launch overhead)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (10 * calls)
