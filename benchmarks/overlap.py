"""Do transfers and compute really overlap? One prefill step of a model whose weights stream
from CPU memory, timed four ways: compute only (weights resident on the GPU), transfer only
(the weight store streaming every layer, no compute), and the engine with overlap off and on.
Overlap works when "on" is near max(compute, transfer) and "off" near their sum.

    python benchmarks/overlap.py --model dummy:opt-6.7b --prompt-len 512 --gpu-batch-size 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from common import environment, table, write_jsonl


def prefill_seconds(llm, policy, prompts, repeat: int = 3) -> float:
    llm.policy_arg = policy
    llm.generate(prompts, max_new_tokens=1)  # warm-up (and weights placed)
    times = []
    for _ in range(repeat):
        times.append(llm.generate(prompts, max_new_tokens=1).stats.prefill_s)
    return sorted(times)[len(times) // 2]


def transfer_seconds(llm, repeat: int = 3) -> float:
    """Stream every layer's offloaded weights through the two GPU slots, as the engine does,
    with no compute: the time of the transfers alone."""
    e, w = llm.engine, llm.engine.weights
    times = []
    for _ in range(repeat):
        e.lanes.sync()
        t0 = time.perf_counter()
        for j in range(len(w.layers)):
            w.prefetch(j)
            _, deps = w.get(j)
            e.lanes.compute.wait(deps)
            w.was_read(j, e.lanes.compute.mark())
        e.lanes.sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:opt-6.7b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gpu-batch-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    from flexoff import LLM, Policy

    llm = LLM(args.model)
    llm.model.tokenizer.eos_ids = ()
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_ids": torch.randint(3, llm.model.spec.vocab_size, (args.prompt_len,), generator=g).tolist(),
                "id": str(i)} for i in range(args.gpu_batch_size)]
    resident = Policy(gpu_batch_size=args.gpu_batch_size)
    streamed = resident.replace(w_gpu_percent=0, w_cpu_percent=100)
    compute = prefill_seconds(llm, resident, prompts)
    on = prefill_seconds(llm, streamed, prompts)
    transfer = transfer_seconds(llm)
    off = prefill_seconds(llm, streamed.replace(overlap=False), prompts)
    llm.close()
    row = {"model": args.model, "tokens": args.prompt_len * args.gpu_batch_size, "compute_s": compute,
           "transfer_s": transfer, "max_s": max(compute, transfer), "sum_s": compute + transfer,
           "overlap_on_s": on, "overlap_off_s": off, "on/max": on / max(compute, transfer),
           "off/sum": off / (compute + transfer)}
    print(table([row], list(row)))
    write_jsonl(args.out / "overlap.jsonl", [{**environment(), **row}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
