"""Turning a Policy's percentages into bytes and rows.

Knows: weights are split per layer by bytes (the first wg% of a layer's flat
buffer on the GPU, the next wc% on the CPU, the rest on disk); the KV cache and
activations are split along the batch (the first rows of a GPU batch on the
GPU, then CPU, then disk).
Does not know: allocation, copies, or what the bytes hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TIERS = ("gpu", "cpu", "disk")


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def row_split(n: int, gpu_pct: float, cpu_pct: float) -> dict[str, int]:
    """Rows of a full batch of n on each tier."""
    g = _round(n * gpu_pct / 100)
    gc = n if gpu_pct + cpu_pct >= 100 else min(n, _round(n * (gpu_pct + cpu_pct) / 100))
    return {"gpu": g, "cpu": gc - g, "disk": n - gc}


def row_segments(n: int, split: dict[str, int]) -> list[tuple[str, int, int]]:
    """(tier, first row, end row) of a batch of n <= full rows: tiers fill in order."""
    out, r = [], 0
    for tier in TIERS:
        take = min(split[tier], n - r) if tier != "disk" else n - r
        if take > 0:
            out.append((tier, r, r + take))
            r += take
    return out


@dataclass(frozen=True)
class ByteSplit:
    """Where one layer's flat weight buffer lives: [0, a) GPU, [a, b) CPU, [b, n) disk.

    Fields wholly inside [0, a) are used in place; the rest, from `stage`, is
    copied into a GPU slot before the layer runs."""

    a: int
    b: int
    n: int
    stage: int

    @property
    def resident(self) -> bool:
        return self.stage >= self.n

    def bytes_on(self, tier: str) -> int:
        return {"gpu": self.a, "cpu": self.b - self.a, "disk": self.n - self.b}[tier]


def byte_split(n: int, gpu_pct: float, cpu_pct: float) -> tuple[int, int]:
    a = min(n, _round(n * gpu_pct / 100))
    b = n if gpu_pct + cpu_pct >= 100 else min(n, _round(n * (gpu_pct + cpu_pct) / 100))
    return a, b
