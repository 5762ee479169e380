"""Rates the engine measured in its own decodes on this machine, which the cost model prices with
in place of the profile's microbenchmark.

Knows: where they are kept (beside this machine's cached profile, `<key>.engine.json`: each
decode's CPU attention counters, so that a rate is derived with the profile it prices); how a
decode's lane gives a read rate (the cache bytes it read over its busy seconds, less what the cost
model prices apart: CPU_ATTN_CALL_S per call, and the host memory its disk reads took,
page_cache_copy_s; over a 16-bit cache, which the caller checks); which decodes are long enough to
count (a few token steps are mostly the first step's one-time costs: warm-ups read 31-53 GB/s on
hosts whose full decodes read 38-49); how many recent ones count (their median); and that only a
profile measured on this machine (its `machine` field) is calibrated. FLEXOFF_CALIBRATE=0 turns
both halves off.
Does not know: the engine (it is handed a decode's counters) or the search.

Why: the profile times CPU attention over a few seconds of a fresh process, and host memory's
rate drifts. On one H100 host the profile read 31.9 GB/s while the engine's decodes on it read
38-47 over the next 25 minutes, and `--policy auto` planned around a lane that slow (benchmarks/RESULTS.md,
2026-11-27, thirteenth session).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from flexoff.policy.cost_model import CPU_ATTN_CALL_S, page_cache_copy_s
from flexoff.policy.hardware import Hardware, cache_path, machine_key

ENV = "FLEXOFF_CALIBRATE"
SAMPLES = 16  # the most recent decodes whose median prices CPU attention
MIN_STEPS = 8  # a decode of at least this many token steps counts
MIN_BUSY_S = 1.0  # ... with its lane busy at least this long
MIN_CALLS = 16  # ... over at least this many calls
MIN_READ_SHARE = 0.25  # ... and reading for at least this share of its busy time (beyond the fixed cost)
# what is kept of a decode: its traffic counters by these names
COUNTERS = ("cpu_attention", "cpu_attention_compute_s", "cpu_attention_calls", "disk_read")


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def path() -> Path:
    """The decodes kept on this machine, beside its cached profile."""
    return cache_path().with_suffix(".engine.json")


def counters(traffic: Mapping[str, Any]) -> dict[str, float] | None:
    """A decode's counters that calibration keeps (COUNTERS: the bytes CPU attention read, its
    busy seconds, its calls, the bytes read from disk), from its traffic; None where the lane ran
    too briefly or too few calls to say (or they are not numbers)."""
    try:
        got = {k: float(traffic.get(k) or 0) for k in COUNTERS}
    except (TypeError, ValueError):
        return None
    busy, calls, read = got["cpu_attention_compute_s"], got["cpu_attention_calls"], got["cpu_attention"]
    return got if busy >= MIN_BUSY_S and calls >= MIN_CALLS and read > 0 else None


def lane_rate(traffic: Mapping[str, Any], hw: Hardware) -> float | None:
    """Bytes/s the lane read the cache at in one decode's traffic (or kept counters), net of its
    fixed cost per call and of its disk reads' page-cache copies at `hw`'s host memory rate;
    None where the decode is too short to say, or its busy time is mostly those."""
    got = counters(traffic)
    if got is None:
        return None
    busy = got["cpu_attention_compute_s"]
    net = busy - got["cpu_attention_calls"] * CPU_ATTN_CALL_S - page_cache_copy_s(got["disk_read"], hw)
    return got["cpu_attention"] / net if net >= MIN_READ_SHARE * busy else None


def read_decodes(where: Path) -> list[dict[str, float]]:
    """The decodes' counters kept at `where`, oldest first; [] where none (or unreadable)."""
    try:
        kept = json.loads(where.read_text()).get("decodes", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [got for d in kept if isinstance(d, dict) and (got := counters(d)) is not None] \
        if isinstance(kept, list) else []


def record(traffic: Mapping[str, Any], steps: int, where: Path | None = None) -> dict[str, float] | None:
    """Keep one decode of `steps` token steps (its counters) among the last SAMPLES at `where`
    (this machine's file by default); the counters kept, or None where the decode does not count."""
    got = counters(traffic) if enabled() and steps >= MIN_STEPS else None
    if got is None:
        return None
    where = where or path()
    kept = (read_decodes(where) + [got])[-SAMPLES:]
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_name(f"{where.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"machine": machine_key(), "decodes": kept}) + "\n")
    tmp.replace(where)
    return got


def forget(where: Path | None = None) -> None:
    """Drop the kept decodes (a fresh profile starts over)."""
    (where or path()).unlink(missing_ok=True)


def calibrated(hw: Hardware, where: Path | None = None, log: Callable[[str], None] | None = None) -> Hardware:
    """`hw` with CPU attention priced at the median of the engine's kept rates (lane_rate at
    `hw`), where `hw` was measured on this machine and the engine has run CPU attention here;
    else `hw` unchanged."""
    if not enabled() or not hw.machine or hw.machine != machine_key() or hw.cpu_attn_bdw <= 0:
        return hw
    rates = [r for d in read_decodes(where or path())[-SAMPLES:] if (r := lane_rate(d, hw)) is not None]
    if not rates:
        return hw
    rate = statistics.median(rates)
    if log:
        log(f"CPU attention priced at {rate / 1e9:.1f} GB/s, the median of the engine's last {len(rates)} "
            f"decodes on this machine (the profile measured {hw.cpu_attn_bdw / 1e9:.1f}; {ENV}=0 to use it)")
    return at_cpu_attention(hw, rate)


def at_cpu_attention(hw: Hardware, rate: float) -> Hardware:
    """`hw` with CPU attention reading at `rate` bytes/s (its FLOP/s scaled alike)."""
    return replace(hw, cpu_attn_bdw=rate, cpu_flops=hw.cpu_flops * rate / hw.cpu_attn_bdw)
