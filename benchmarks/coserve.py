"""Co-serving on the GPU: inference alone, finetuning alone and both in the same blocks, in one run.

Knows: a block shape (GPU batch size, inference batches per block, window batches per block),
random prompts of `--prompt-len` tokens generating `--gen-len`, random training sequences of
`--seq` tokens (loss on every token) for one fresh LoRA adapter (rank r on every linear layer);
three runs on the same weights: the prompts alone (blocks of the inference batches only), the
finetuning steps alone (LoraTrainer, micro-batches of one GPU batch), and the prompts with the
finetuning job riding on their blocks (LLM.generate with a CoTrainer), every block and under
an inference-slowdown bound (`--max-slowdown`). Reports generation
tokens/s and training tokens/s of each, and the co-served run's ratios to the runs alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, table, write_jsonl  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-7b")
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--infer-batches", type=int, default=8, help="inference GPU batches per block")
    ap.add_argument("--train-batches", type=int, default=1, help="GPU batches per block given to training windows")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--train-steps", type=int, default=6, help="finetuning steps of the run alone")
    ap.add_argument("--max-slowdown", type=float, default=0.1,
                    help="one more co-served run under this inference-slowdown bound (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/flexoff-coserve-bench")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/coserve.jsonl"))
    args = ap.parse_args(argv)
    if cuda_missing("coserve.py"):
        return 2
    from flexoff import LLM, Policy
    from flexoff.finetune.coserve import CoJob, CoTrainer, SlowdownBound
    from flexoff.finetune.data import Example
    from flexoff.finetune.run import LoraSpec, linear_targets, new_adapter
    from flexoff.finetune.trainer import LoraTrainer, TrainConfig

    gbs = args.gpu_batch_size
    g = torch.Generator().manual_seed(args.seed)
    policy = Policy(gpu_batch_size=gbs, num_gpu_batches=args.infer_batches + args.train_batches)
    alone_policy = Policy(gpu_batch_size=gbs, num_gpu_batches=args.infer_batches)
    rows: list[dict[str, Any]] = []
    # the LLM's own policy is the finetuning-alone one (one GPU batch a block); the others are passed
    with LLM(args.model, policy=Policy(gpu_batch_size=gbs), device="cuda", dtype=torch.float16) as llm:
        spec = llm.model.spec
        prompts = [{"prompt_ids": torch.randint(3, spec.vocab_size, (args.prompt_len,), generator=g).tolist(),
                    "max_new_tokens": args.gen_len, "ignore_eos": True} for _ in range(args.prompts)]
        examples = [Example(torch.randint(3, spec.vocab_size, (args.seq,), generator=g).tolist(),
                            [False] + [True] * (args.seq - 1)) for _ in range(gbs * (args.train_steps + 64))]
        folder = Path(args.work) / "fresh"
        new_adapter(spec, LoraSpec(args.rank, 2 * args.rank, linear_targets(spec)), folder, 0)
        llm.load_lora("train", str(folder))
        cfg = TrainConfig(lr=1e-4, batch_size=gbs)

        def timed(fn: Any) -> tuple[Any, float]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            return out, time.perf_counter() - t0

        llm.generate(prompts[:gbs], max_new_tokens=2, policy=policy)  # warm-up: engine, graphs
        alone, sec = timed(lambda: llm.generate(prompts, policy=alone_policy))
        gen = alone.stats.generated_tokens
        rows.append({"run": "inference alone", "policy": alone_policy.describe(), "seconds": sec,
                     "gen_tok_s": gen / sec, "train_tok_s": 0.0})
        trainer = LoraTrainer(llm, "train", cfg, args.seq)
        trainer.step(examples[:gbs])  # warm-up
        job = CoJob(trainer, examples, args.train_steps)
        _, sec = timed(lambda: CoTrainer([job]).finish())
        rows.append({"run": "finetuning alone", "policy": llm.last_policy.describe(), "seconds": sec,
                     "gen_tok_s": 0.0, "train_tok_s": args.train_steps * gbs * args.seq / sec})
        for limit in [None] + ([args.max_slowdown] if args.max_slowdown else []):
            job = CoJob(trainer, examples, 10**6)  # more steps than the blocks carry: only carried ones count
            bound = SlowdownBound(limit) if limit else None
            rider = CoTrainer([job], args.train_batches, bound)
            co, sec = timed(lambda: llm.generate(prompts, policy=policy, rider=rider))
            trained = len(job.losses) * gbs * args.seq
            same = sum(a.token_ids == b.token_ids for a, b in zip(alone.completions, co.completions))
            rows.append({"run": "co-served" + (f", bound {limit:g}" if limit else ""), "policy": policy.describe(),
                         "seconds": sec, "gen_tok_s": co.stats.generated_tokens / sec, "train_tok_s": trained / sec,
                         "steps_carried": len(job.losses), "same_tokens_as_alone": same / len(prompts),
                         "bound_estimate": bound.slowdown if bound else None})
    env = environment()
    for r in rows:
        r.update(model=args.model, prompts=args.prompts, prompt_len=args.prompt_len, gen_len=args.gen_len,
                 seq=args.seq, rank=args.rank, **env)
    for r in rows[2:]:
        r["inference_kept"] = r["gen_tok_s"] / rows[0]["gen_tok_s"]
        r["finetuning_kept"] = r["train_tok_s"] / rows[1]["train_tok_s"]
    print(table(rows, ["run", "policy", "seconds", "gen_tok_s", "train_tok_s", "inference_kept", "finetuning_kept",
                       "same_tokens_as_alone"]))
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
