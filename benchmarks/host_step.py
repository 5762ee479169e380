"""How steady the profiler's host step is: seconds of host work per engine step (one layer of one
GPU batch), run by run.

    python benchmarks/host_step.py [--repeats 3] [--out benchmarks/out]

flexoff.profiler.host_step_runs (a tiny model's decode, its KV cache compressed in CPU memory and
its activations there too), each setting after a warm-up of the same length:
- depth: the tiny model's 2 blocks (6 engine layers) and a copy 16 blocks deep (34 layers), 4 and
  8 GPU batches, 16 and 48 tokens; every run's seconds per step;
- weights: resident on the device, streamed from CPU memory, streamed 4-bit; 2 and 8 GPU batches,
  16 tokens. The medians at 2 and 8 batches split a layer's host time into a part per step and a
  part per layer.
Prints tables and appends records to OUT/host-step.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from common import environment, table, write_jsonl

from flexoff.dummy import CONFIGS
from flexoff.profiler import host_step_runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    env = environment()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def runs(model: str, nb: int, gen: int, w_gpu: float = 100, comp: bool = False) -> list[float]:
        return host_step_runs(dev, model=model, nb=nb, gen=gen, repeats=args.repeats, w_gpu_percent=w_gpu,
                              compress_weight=comp)

    with tempfile.TemporaryDirectory() as tmp:
        deep = Path(tmp) / "config.json"
        deep.write_text(json.dumps({**CONFIGS["opt-tiny"], "num_hidden_layers": 16}))
        depth = []
        for blocks, model in ((2, "dummy:opt-tiny"), (16, f"dummy:{deep}")):
            for nb in (4, 8):
                for gen in (16, 48):
                    ms = [r * 1e3 for r in runs(model, nb, gen)]
                    depth.append({"blocks": blocks, "gpu_batches": nb, "tokens": gen, "runs_ms": ms,
                                  "median_ms": statistics.median(ms)})
                    print(depth[-1], flush=True)
    weights: list[dict[str, Any]] = []
    for label, w_gpu, comp in (("resident", 100, False), ("streamed", 0, False), ("streamed 4-bit", 0, True)):
        med = {nb: statistics.median(runs("dummy:opt-tiny", nb, 16, w_gpu, comp)) for nb in (2, 8)}
        step = (8 * med[8] - 2 * med[2]) / 6  # a layer's host time is per_layer + batches * per_step
        weights.append({"weights": label, "layer_2_batches_ms": 2 * med[2] * 1e3, "layer_8_batches_ms": 8 * med[8] * 1e3,
                        "per_step_ms": step * 1e3, "per_layer_ms": (2 * med[2] - 2 * step) * 1e3})
    print(table(depth, ["blocks", "gpu_batches", "tokens", "median_ms"]))
    print(table(weights, ["weights", "layer_2_batches_ms", "layer_8_batches_ms", "per_step_ms", "per_layer_ms"]))
    write_jsonl(args.out / "host-step.jsonl", [{**env, "kind": "depth", **r} for r in depth]
                + [{**env, "kind": "weights", **r} for r in weights])
    return 0


if __name__ == "__main__":
    sys.exit(main())
