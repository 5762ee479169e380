"""The profile's host rates, call by call: CPU attention (contended by host-to-device copies, as
`flexoff profile` measures it), a host memcpy, and host memory's joint read rate (the link's
copies and CPU attention streaming at once, per window), in a fresh process, again after the
rest of the machine's rates (links, disk, GPU matmuls), and again after the engine probes that
`flexoff profile` runs (host steps and the decode link rate), all in one process.

    python benchmarks/host_rates.py [--rounds 3] [--out benchmarks/out]

Each round is one measurement as the profile makes it (CPU_ATTENTION_SAMPLES calls of CPU
attention, CPU_COPY_SAMPLES copies, each after a warm-up); the table gives each round's median
rate and the spread of its calls. The profile takes its host rates before the probes: this
script shows what that is worth on a machine (on an H100 host, 20.5 GB/s of CPU attention after
the probes and the GPU's rates against 47.6-51.5 GB/s fresh, where the engine's own CPU attention ran at 41-43).
Prints a table and appends records to OUT/host-rates.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from common import environment, table, write_jsonl

from flexoff.policy.hardware import cpu_attention_samples, host_copy_samples, joint_rates, joint_read_samples, measure
from flexoff.profiler import engine_probes

COPY_BYTES = 512 << 20  # as the profile's copy on a GPU machine


def rounds(phase: str, n: int, quick: bool) -> list[dict[str, Any]]:
    out = []
    nbytes = COPY_BYTES >> (6 if quick else 0)
    for r in range(n):
        kv_bytes, _, secs = cpu_attention_samples(quick)
        copies = host_copy_samples(nbytes)
        joint = joint_read_samples(quick)  # (link, CPU attention) bytes/s per window; none without CUDA
        out.append({"joint_GBps": joint_rates(joint)[0] / 1e9 if joint else None,
                    "joint_windows_GBps": [(round(a / 1e9, 2), round(b / 1e9, 2)) for a, b in joint],
                    "phase": phase, "round": r,
                    "cpu_attn_GBps": kv_bytes / statistics.median(secs) / 1e9,
                    "cpu_attn_call_ms": [round(t * 1e3, 4) for t in secs],
                    "cpu_attn_min_max_ms": f"{min(secs) * 1e3:.1f}-{max(secs) * 1e3:.1f}",
                    "cpu_mem_GBps": 2 * nbytes / statistics.median(copies) / 1e9,  # read plus written
                    "copy_min_max_ms": f"{min(copies) * 1e3:.1f}-{max(copies) * 1e3:.1f}"})
        print(out[-1], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small shapes and no link probe (seconds; a smoke test)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if args.rounds < 1:
        print("host_rates.py: --rounds must be at least 1", file=sys.stderr)
        return 2
    rows = rounds("fresh", args.rounds, args.quick)
    measure(quick=args.quick)  # the rest of the machine's rates: links, disk, GPU matmuls
    rows += rounds("after the GPU's rates", args.rounds, args.quick)
    probes = engine_probes(quick=args.quick)
    rows += rounds("after engine probes", args.rounds, args.quick)
    print(table(rows, ["phase", "round", "cpu_attn_GBps", "cpu_attn_min_max_ms", "cpu_mem_GBps", "copy_min_max_ms",
                      "joint_GBps", "joint_windows_GBps"]))
    env = environment()
    write_jsonl(args.out / "host-rates.jsonl", [{**env, **r, "probes": probes} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
