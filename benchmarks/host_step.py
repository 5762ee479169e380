"""The engine's host work per step (one layer of one GPU batch), run by run: how steady the
profiler's host step is, and what a given policy's steps cost the host.

    python benchmarks/host_step.py [--repeats 3] [--out benchmarks/out]
    python benchmarks/host_step.py --policy 32x8:0,100,15.625,84.375,3.125,96.875:wk \\
        [--policy ...] [--depth-of dummy:opt-30b] [--gen-len 8]

Every measurement is flexoff.profiler.host_step_runs: a decode of four-token prompts on a model
whose kernels and copies take next to no time, after a warm-up of the same length.
- Without `--policy`, the profiler's probe (GPU batches of two rows, KV cache compressed in CPU
  memory, activations there too): at the tiny model's 2 blocks and 16 blocks deep, 4 and 8 GPU
  batches, 16 and 48 tokens; then weights resident, streamed from CPU memory and streamed 4-bit
  at 2 and 8 GPU batches, whose medians split a layer's host time into a part per step and a
  part per layer.
- With `--policy`, each policy as given (rows, GPU batches, placement, compression, CPU
  attention) on a model of the tiny widths and the layer count of `--depth-of`, `--gen-len`
  tokens: its host seconds per engine step and per token step (every layer of every GPU batch),
  to set beside a token step of the real model (decode_s / (gen_len - 1) in
  benchmarks/throughput.py's records).
Prints tables and appends records to OUT/host-step.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from common import environment, table, write_jsonl
from throughput import parse_policy

from flexoff.dummy import dummy_config
from flexoff.errors import FlexoffError
from flexoff.models.spec import ModelSpec
from flexoff.profiler import host_probe, host_step_runs, probe_model


def probe_suite(dev: torch.device, repeats: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for blocks in (2, 16):
        with probe_model(blocks) as model:
            for nb, gen in itertools.product((4, 8), (16, 48)):
                ms = [r * 1e3 for r in host_step_runs(dev, host_probe(nb), model, gen, repeats=repeats)]
                out.append({"kind": "depth", "blocks": blocks, "gpu_batches": nb, "tokens": gen, "runs_ms": ms,
                            "median_ms": statistics.median(ms)})
                print(out[-1], flush=True)
    for label, w_gpu, comp in (("resident", 100, False), ("streamed", 0, False), ("streamed 4-bit", 0, True)):
        med = {nb: statistics.median(host_step_runs(dev, host_probe(nb, w_gpu, comp), repeats=repeats))
               for nb in (2, 8)}
        step = (8 * med[8] - 2 * med[2]) / 6  # a layer's host time is per_layer + batches * per_step
        out.append({"kind": "weights", "weights": label, "layer_2_batches_ms": 2 * med[2] * 1e3,
                    "layer_8_batches_ms": 8 * med[8] * 1e3, "per_step_ms": step * 1e3,
                    "per_layer_ms": (2 * med[2] - 2 * step) * 1e3})
    print(table([r for r in out if r["kind"] == "depth"], ["blocks", "gpu_batches", "tokens", "median_ms"]))
    print(table([r for r in out if r["kind"] == "weights"],
                ["weights", "layer_2_batches_ms", "layer_8_batches_ms", "per_step_ms", "per_layer_ms"]))
    return out


def policy_suite(dev: torch.device, repeats: int, policies: list[str], like: str, gen: int) -> list[dict[str, Any]]:
    out = []
    with probe_model(dummy_config(like.removeprefix("dummy:"))["num_hidden_layers"]) as model:
        engine_layers = len(ModelSpec.from_config("probe", dummy_config(model.removeprefix("dummy:"))).layers)
        for text in policies:
            p = parse_policy(text)
            runs = host_step_runs(dev, p, model, gen, repeats=repeats)
            step = statistics.median(runs)
            out.append({"kind": "policy", "policy": p.describe(), "depth_of": like, "tokens": gen,
                        "runs_ms": [r * 1e3 for r in runs], "median_ms": step * 1e3,
                        "token_step_host_ms": step * engine_layers * p.num_gpu_batches * 1e3})
            print(out[-1], flush=True)
    print(table(out, ["policy", "median_ms", "token_step_host_ms"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", action="append", default=None,
                    help="GBSxNB:wg,wc,cg,cc,hg,hc[:flags], as throughput.py")
    ap.add_argument("--depth-of", default="dummy:opt-30b", help="a dummy model whose layer count the policies run at")
    ap.add_argument("--gen-len", type=int, default=8, help="tokens per measured decode (with --policy)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if args.policy:
            rows = policy_suite(dev, args.repeats, args.policy, args.depth_of, args.gen_len)
        else:
            rows = probe_suite(dev, args.repeats)
    except FlexoffError as e:  # e.g. --depth-of naming no dummy model, a policy over the budget
        print(f"host_step.py: {e}", file=sys.stderr)
        return 2
    env = environment()
    write_jsonl(args.out / "host-step.jsonl", [{**env, **r} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
