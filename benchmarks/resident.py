"""GPU-resident decode: flexoff against its memory bound and transformers' `generate`, in one run.

Knows: for a model that fits the GPU (weights, KV cache and activations all on it), the
decode step time and generation throughput of flexoff's lean path with CUDA graphs, the
same with the torch chains instead of the fused elementwise kernels (`graphs-unfused`), the
lean path without graphs, and the scheduled loop step by step (its host time per layer step),
against transformers `generate` on the same dummy weights; the memory bound of a decode step
(weight bytes plus the KV bytes an average step reads, over the device's copy bandwidth
measured in the same run). Each system's decode step is its time for gen_len tokens less its
time for one token, over gen_len - 1. Prints a table and writes JSON records.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, table, write_jsonl  # noqa: E402

VARIANTS = ("graphs", "graphs-unfused", "eager", "loop")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """The device's memory bandwidth: bytes read plus bytes written per second in a large
    device-to-device copy."""
    a = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * 5 * nbytes / (time.perf_counter() - t0)


def flexoff_runs(model: str, batch: int, prompt_len: int, gen_len: int, variants: list[str],
                 dtype: torch.dtype) -> tuple[list[dict[str, Any]], Any]:
    """One record per variant, and the model's spec."""
    from flexoff import LLM, Policy
    from flexoff.kernels import elementwise

    g = torch.Generator().manual_seed(0)
    out = []
    with LLM(model, policy=Policy(gpu_batch_size=batch), device="cuda", dtype=dtype) as llm:
        llm.model.tokenizer.eos_ids = ()  # every step runs
        vocab = llm.model.spec.vocab_size
        prompts = [{"id": str(r), "prompt_ids": torch.randint(3, vocab, (prompt_len,), generator=g).tolist()}
                   for r in range(batch)]
        llm.generate(prompts, max_new_tokens=gen_len)  # the engine, at full size, warm
        for v in variants:
            def gen(n: int) -> Any:
                e = llm.engine
                if v == "loop":
                    e.lean = None
                elif e.lean is not None:
                    e.lean.graphs = v.startswith("graphs")
                return llm.generate(prompts, max_new_tokens=n).stats

            fused = v != "graphs-unfused"
            if elementwise.ENABLED != fused and llm.engine.lean is not None:
                llm.engine.lean.batches.clear()  # graphs captured with the other kernels
                llm.engine.lean.pool = None
            elementwise.ENABLED = fused
            gen(2)  # graphs captured, caches warm
            one, full = gen(1), gen(gen_len)
            total = full.prefill_s + full.decode_s
            first = one.prefill_s + one.decode_s
            step = (total - first) / (gen_len - 1)
            L = len(llm.model.spec.layers)
            out.append({"system": f"flexoff-{v}", "batch": batch, "total_s": total, "first_token_s": first,
                        "decode_step_ms": 1e3 * step, "generation_throughput": full.generated_tokens / total,
                        "loop_ms_per_layer_step": 1e3 * step / L if v == "loop" else None})
        elementwise.ENABLED = True
        spec = llm.model.spec
    return out, spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-7b")
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/resident.jsonl"))
    args = ap.parse_args(argv)
    if cuda_missing("resident.py"):
        return 2
    from baseline import accelerate_run

    dtype = torch.float16
    bw = copy_bandwidth()
    env = environment()
    rows = []
    for batch in args.batch or [8, 32, 128]:
        runs, spec = flexoff_runs(args.model, batch, args.prompt_len, args.gen_len, args.variants.split(","), dtype)
        gc.collect()
        torch.cuda.empty_cache()
        if not args.no_hf:
            hf = {}
            for n in (1, args.gen_len):
                hf[n] = accelerate_run(args.model, args.prompt_len, n, batch, None, None, dtype)
                gc.collect()
                torch.cuda.empty_cache()
            full = hf[args.gen_len]
            step = (full["total_s"] - hf[1]["total_s"]) / (args.gen_len - 1)
            runs.append({"system": "transformers", "batch": batch, "total_s": full["total_s"],
                         "first_token_s": hf[1]["total_s"],
                         "decode_step_ms": 1e3 * step, "generation_throughput": full["generation_throughput"],
                         "placement": full["placement"]})
        context = args.prompt_len + args.gen_len / 2  # tokens an average decode step attends over
        read = spec.weight_bytes(2) + batch * context * spec.kv_bytes_per_token(2) * spec.num_layers
        bound_ms = 1e3 * read / bw
        hf_tp = next((r["generation_throughput"] for r in runs if r["system"] == "transformers"), None)
        for r in runs:
            r.update(model=args.model, prompt_len=args.prompt_len, gen_len=args.gen_len, bound_ms=bound_ms,
                     step_over_bound=r["decode_step_ms"] / bound_ms, memory_GBps=bw / 1e9,
                     vs_transformers=r["generation_throughput"] / hf_tp if hf_tp else None, **env)
        rows += runs
        print(table(runs, ["system", "batch", "decode_step_ms", "bound_ms", "step_over_bound", "first_token_s",
                           "generation_throughput", "vs_transformers", "loop_ms_per_layer_step"]), flush=True)
    write_jsonl(args.out, rows)
    print(table(rows, ["system", "batch", "decode_step_ms", "bound_ms", "step_over_bound", "first_token_s",
                       "generation_throughput", "vs_transformers", "loop_ms_per_layer_step"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
