"""How steady the profiler's host step is: seconds of host work per engine step (one layer of one
GPU batch), run by run.

    python benchmarks/host_step.py [--repeats 3] [--out benchmarks/out]

The decode of a tiny model whose kernels take next to no time, its KV cache compressed in CPU
memory and its activations there too (flexoff.profiler.host_step's set-up), each setting after a
warm-up of the same length:
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

from flexoff import LLM
from flexoff.dummy import CONFIGS
from flexoff.policy.policy import Policy


def runs(model: str, nb: int, gen: int, repeats: int, w_gpu: float = 100, compress_weight: bool = False) -> list[float]:
    """Seconds per engine step of `repeats` decodes after a warm-up of the same length."""
    p = Policy(gpu_batch_size=2, num_gpu_batches=nb, w_gpu_percent=w_gpu, w_cpu_percent=100 - w_gpu,
               cache_gpu_percent=0, cache_cpu_percent=100, act_gpu_percent=0, act_cpu_percent=100,
               compress_cache=True, compress_weight=compress_weight)
    prompts = [{"prompt_ids": [5 + i, 6, 7, 8]} for i in range(2 * nb)]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with LLM(model, policy=p, device=dev) as llm:
        llm.model.tokenizer.eos_ids = ()  # every step runs
        llm.generate(prompts, max_new_tokens=gen)
        steps = (gen - 1) * len(llm.model.spec.layers) * nb
        return [llm.generate(prompts, max_new_tokens=gen).stats.decode_s / steps for _ in range(repeats)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        deep = Path(tmp) / "config.json"
        deep.write_text(json.dumps({**CONFIGS["opt-tiny"], "num_hidden_layers": 16}))
        depth = []
        for blocks, model in ((2, "dummy:opt-tiny"), (16, f"dummy:{deep}")):
            for nb in (4, 8):
                for gen in (16, 48):
                    ms = [r * 1e3 for r in runs(model, nb, gen, args.repeats)]
                    depth.append({"blocks": blocks, "gpu_batches": nb, "tokens": gen, "runs_ms": ms,
                                  "median_ms": statistics.median(ms)})
                    print(depth[-1], flush=True)
    weights: list[dict[str, Any]] = []
    for label, w_gpu, comp in (("resident", 100, False), ("streamed", 0, False), ("streamed 4-bit", 0, True)):
        med = {nb: statistics.median(runs("dummy:opt-tiny", nb, 16, args.repeats, w_gpu, comp)) for nb in (2, 8)}
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
