"""Rates the engine measured in its own decodes on this machine, which the cost model prices with
in place of the profile's microbenchmark.

Knows: where they are kept (beside this machine's cached profile, `<key>.engine.json`); how a
decode's CPU attention lane gives a read rate (the cache bytes it read over its busy seconds, less
the fixed cost per call that the cost model prices apart, CPU_ATTN_CALL_S; over a 16-bit cache,
which the caller checks); which decodes are long enough to count; how many recent ones count
(their median); and that only a profile measured on this machine (its `machine` field) is
calibrated. FLEXOFF_CALIBRATE=0 turns both halves off.
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

from flexoff.policy.cost_model import CPU_ATTN_CALL_S
from flexoff.policy.hardware import Hardware, cache_path, machine_key

ENV = "FLEXOFF_CALIBRATE"
SAMPLES = 16  # the most recent decodes whose median prices CPU attention
MIN_BUSY_S = 1.0  # a decode's lane busy at least this long counts
MIN_CALLS = 16  # ... over at least this many calls
MIN_READ_SHARE = 0.25  # ... and reading for at least this share of its busy time (beyond the fixed cost)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def path() -> Path:
    """This machine's engine rates, beside its cached profile."""
    return cache_path().with_suffix(".engine.json")


def lane_rate(traffic: Mapping[str, Any]) -> float | None:
    """Bytes/s CPU attention read the cache at in one decode's counters (`cpu_attention` bytes,
    `cpu_attention_compute_s`, `cpu_attention_calls`), net of the fixed cost per call; None where
    the decode is too short to say, or its calls are mostly fixed cost."""
    read, busy, calls = (traffic.get("cpu_attention", 0), traffic.get("cpu_attention_compute_s", 0.0),
                         traffic.get("cpu_attention_calls", 0))
    if busy < MIN_BUSY_S or calls < MIN_CALLS or read <= 0:
        return None
    net = busy - calls * CPU_ATTN_CALL_S
    return read / net if net >= MIN_READ_SHARE * busy else None


def read_rates(where: Path) -> list[float]:
    """The CPU attention rates kept at `where`, oldest first; [] where none (or unreadable)."""
    try:
        rates = json.loads(where.read_text()).get("cpu_attn_bdw", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [float(r) for r in rates if isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0]


def record(traffic: Mapping[str, Any], where: Path | None = None) -> float | None:
    """Keep one decode's CPU attention rate (lane_rate) among the last SAMPLES at `where` (this
    machine's file by default); the rate, or None where the decode did not give one."""
    rate = lane_rate(traffic) if enabled() else None
    if rate is None:
        return None
    where = where or path()
    rates = (read_rates(where) + [rate])[-SAMPLES:]
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_name(f"{where.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"machine": machine_key(), "cpu_attn_bdw": rates}) + "\n")
    tmp.replace(where)
    return rate


def forget(where: Path | None = None) -> None:
    """Drop the kept rates (a fresh profile starts over)."""
    (where or path()).unlink(missing_ok=True)


def calibrated(hw: Hardware, where: Path | None = None, log: Callable[[str], None] | None = None) -> Hardware:
    """`hw` with CPU attention priced at the median of the engine's kept rates, where `hw` was
    measured on this machine and the engine has run CPU attention here; else `hw` unchanged."""
    if not enabled() or not hw.machine or hw.machine != machine_key():
        return hw
    rates = read_rates(where or path())[-SAMPLES:]
    if not rates or hw.cpu_attn_bdw <= 0:
        return hw
    rate = statistics.median(rates)
    if log:
        log(f"CPU attention priced at {rate / 1e9:.1f} GB/s, the median of the engine's last {len(rates)} "
            f"decodes on this machine (the profile measured {hw.cpu_attn_bdw / 1e9:.1f}; {ENV}=0 to use it)")
    return at_cpu_attention(hw, rate)


def at_cpu_attention(hw: Hardware, rate: float) -> Hardware:
    """`hw` with CPU attention reading at `rate` bytes/s (its FLOP/s scaled alike)."""
    return replace(hw, cpu_attn_bdw=rate, cpu_flops=hw.cpu_flops * rate / hw.cpu_attn_bdw)
