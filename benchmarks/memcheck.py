"""GPU memory: what the engine's plan counts against what the allocator really peaks at.

    python benchmarks/memcheck.py --model dummy:opt-30b --layers 4 --prompt-len 512 \\
        --gpu-mem 16GiB --cpu-mem 100GiB --policy auto --policy auto+c --policy "8x1:20,80,0,100,100,0:a"

Policies are searched (auto, auto+c) or written for the full model; each then runs a full block
of prompt-len + gen-len tokens on the same model cut to its first `--layers` blocks, so that the
per-layer transients (weight slots, loading, working memory, copies in flight) are the full
model's while resident cache and weights shrink with the layer count. A row passes when the
allocator's peak stays under the plan of the cut model (the full model's plan adds exactly the
resident bytes of the remaining layers). Records go to OUT/memcheck.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from common import environment, table, write_jsonl

from flexoff.errors import GpuOutOfMemoryError
from throughput import Bench, parse_policy

GiB = 2**30


def cut_model(name: str, layers: int, folder: Path) -> str:
    """`dummy:PATH` of the model's config with only its first `layers` transformer blocks."""
    from flexoff.dummy import dummy_config

    cfg = dummy_config(name.removeprefix("dummy:"))
    cfg["num_hidden_layers"] = layers
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    return f"dummy:{path}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:opt-30b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=2)
    ap.add_argument("--search-gen-len", type=int, default=32, help="generation length the searches plan for")
    ap.add_argument("--policy", action="append", required=True)
    ap.add_argument("--gpu-mem", default="16GiB")
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--hardware", default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("memcheck needs a CUDA device", file=sys.stderr)
        return 2
    from flexoff.cli import parse_size

    gpu, cpu = parse_size(args.gpu_mem), parse_size(args.cpu_mem)
    full = Bench(args.model, gpu, cpu, None, args.hardware, "auto", "auto", None)
    policies = []
    for text in args.policy:
        try:
            policies.append((text, full.resolve(parse_policy(text), args.prompt_len, args.search_gen_len, None)))
        except Exception as e:
            print(f"{text}: {type(e).__name__}: {e}", file=sys.stderr)
    full.close()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = Bench(cut_model(args.model, args.layers, Path(tmp)), gpu, cpu, None, args.hardware, "auto",
                    "auto", None).llm
        spec = llm.model.spec
        for text, p in policies:
            row: dict[str, Any] = {"label": text, "policy": p.describe()}
            try:
                engine = llm.engine_for(p, args.prompt_len, args.gen_len)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                g = torch.Generator().manual_seed(0)
                prompts = [{"prompt_ids": torch.randint(3, spec.vocab_size, (args.prompt_len,), generator=g).tolist()}
                           for _ in range(p.block_size)]
                llm.policy_arg = p
                llm.generate(prompts, max_new_tokens=args.gen_len)
                plan = engine.plan
                row.update(plan_GiB=plan.total("gpu") / GiB, working_GiB=plan.parts["working"]["gpu"] / GiB,
                           peak_GiB=torch.cuda.max_memory_allocated() / GiB,
                           reserved_GiB=torch.cuda.max_memory_reserved() / GiB)
                row["peak/plan"] = row["peak_GiB"] / row["plan_GiB"]
                row["ok"] = row["peak_GiB"] <= row["plan_GiB"]
            except (torch.OutOfMemoryError, GpuOutOfMemoryError) as e:
                row.update(ok=False, error=str(e).split(".")[0])
            llm.drop_engine()
            rows.append(row)
            print(table([row], ["label", "policy", "plan_GiB", "working_GiB", "peak_GiB", "reserved_GiB",
                                "peak/plan", "ok"]), flush=True)
        llm.close()
    env = environment()
    write_jsonl(args.out / "memcheck.jsonl", [{**env, **vars(args), "out": str(args.out), **r} for r in rows])
    print(table(rows, ["label", "policy", "plan_GiB", "peak_GiB", "reserved_GiB", "peak/plan", "ok"]))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
