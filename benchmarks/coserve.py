"""Co-serving on the GPU: inference alone, finetuning alone and both in the same blocks, in one run.

Knows four settings, each a table of runs on the same weights in one process:
- hand shapes (default): blocks of `--infer-batches` inference GPU batches and `--train-batches`
  window batches; the prompts alone, the finetuning steps alone (LoraTrainer, micro-batches of one
  GPU batch), and the prompts with the job riding on their blocks, every block and under an
  inference-slowdown bound (`--max-slowdown`).
- `--policy auto` (with `--gpu-mem`, `--cpu-mem`, `--hardware`): the prompts alone and the job alone
  under their searched policies, then for each of `--plan-bounds` the joint co-served plan
  (policy/coserve_cost.py) run with windows in every block, beside the plan's predictions. Rates
  are over the blocks after the first (the first places the weights of a new policy).
- `--concurrent`: GPU-resident, training steps in a thread of their own beside the prompts, sharing
  the GPU by streams (plain, inference at high priority, and training confined to `--train-sms`
  SMs) instead of by blocks.
- `--jobs N`: N finetuning jobs of equal size (each its own adapter and optimizer, steps of one GPU
  batch) riding on the same blocks, against one job given all their data (steps of N GPU batches):
  the aggregate training tokens/s of each.
Prompts are random, `--prompt-len` tokens generating `--gen-len`; training sequences are random,
`--seq` tokens with a loss on every token, for fresh LoRA adapters (rank r on every linear layer).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, table, write_jsonl  # noqa: E402

PLAIN_STREAM = torch.cuda.Stream  # prioritized() swaps torch.cuda.Stream for a while
COLUMNS = ["run", "policy", "seconds", "gen_tok_s", "train_tok_s", "inference_kept", "finetuning_kept",
           "same_tokens_as_alone"]


class Bench:
    """The LLM, the random prompts and training sequences, and the runs' records."""

    def __init__(self, args: argparse.Namespace, llm: Any):
        from flexoff.finetune.data import Example

        self.args, self.llm, self.rows = args, llm, []
        vocab = llm.model.spec.vocab_size
        g = torch.Generator().manual_seed(args.seed)
        self.prompts = [{"prompt_ids": torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist(),
                         "max_new_tokens": args.gen_len, "ignore_eos": True} for _ in range(args.prompts)]
        self.examples = [Example(torch.randint(3, vocab, (args.seq,), generator=g).tolist(),
                                 [False] + [True] * (args.seq - 1)) for _ in range(args.examples)]
        self.alone: Any = None  # the prompts' output alone: co-served runs must give its tokens

    def trainer(self, name: str, grad_accum: int = 1) -> Any:
        """A LoraTrainer of a fresh adapter `name` (steps of grad_accum GPU batches)."""
        from flexoff.finetune.run import LoraSpec, linear_targets, new_adapter
        from flexoff.finetune.trainer import LoraTrainer, TrainConfig

        spec, a = self.llm.model.spec, self.args
        folder = Path(a.work) / name
        new_adapter(spec, LoraSpec(a.rank, 2 * a.rank, linear_targets(spec)), folder, 0)
        self.llm.load_lora(name, str(folder))
        return LoraTrainer(self.llm, name, TrainConfig(lr=1e-4, batch_size=a.gpu_batch_size, grad_accum=grad_accum),
                           a.seq)

    def sync(self) -> None:
        if self.llm.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def train_alone(self, trainer: Any, steps: int, label: str = "finetuning alone") -> dict[str, Any]:
        """`steps` finetuning steps alone (after one warm-up step)."""
        from flexoff.finetune.coserve import CoJob, CoTrainer

        per = trainer.cfg.per_step
        trainer.step(self.examples[:per])
        _, sec = self.timed(lambda: CoTrainer([CoJob(trainer, self.examples, steps)]).finish())
        rec = {"run": label, "policy": self.llm.last_policy.describe(), "seconds": sec,
               "gen_tok_s": 0.0, "train_tok_s": steps * per * self.args.seq / sec}
        self.rows.append(rec)
        return rec

    def generate(self, label: str, rider: Any = None, policy: Any = None, skip_first: bool = False,
                 **extra: Any) -> dict[str, Any]:
        """The prompts, with the rider's windows; rates over every block or those after the first."""
        ends: list[float] = []
        gen: list[int] = []
        trained: list[int] = []  # sequences trained in each block
        if rider is not None:
            done = rider.done

            def counted(result: Any) -> None:  # every window sequence has seq - 1 labelled tokens
                trained.append(result.tokens // (self.args.seq - 1))
                done(result)
            rider.done = counted

        def on_block(comps: Any, st: Any) -> None:
            self.sync()
            ends.append(time.perf_counter())
            gen.append(st.generated_tokens)
            if len(trained) < len(ends):  # a block without windows
                trained.append(0)

        self.sync()
        t0 = time.perf_counter()
        out = self.llm.generate(self.prompts, policy=policy, rider=rider, on_block=on_block)
        if rider is not None:
            rider.done = done
        starts = [t0] + ends[:-1]
        keep = range(1 if skip_first and len(ends) > 1 else 0, len(ends))
        sec = sum(ends[i] - starts[i] for i in keep)
        rec = {"run": label, "policy": (policy or self.llm.last_policy).describe(), "seconds": sec,
               "blocks": len(ends), "blocks_timed": len(keep), "gen_tok_s": sum(gen[i] for i in keep) / sec,
               "train_tok_s": sum(trained[i] for i in keep) * self.args.seq / sec, **extra}
        if rider is not None:
            rec["steps_carried"] = sum(len(j.losses) for j in rider.jobs)
        if self.alone is None:
            self.alone = out
        else:
            same = sum(a.token_ids == b.token_ids for a, b in zip(self.alone.completions, out.completions))
            rec["same_tokens_as_alone"] = same / len(self.prompts)
        self.rows.append(rec)
        return rec

    def ratios(self, gen_alone: dict[str, Any], train_alone: dict[str, Any] | None) -> None:
        for r in self.rows:
            if r is gen_alone or r is train_alone or not r["gen_tok_s"]:
                continue
            r["inference_kept"] = r["gen_tok_s"] / gen_alone["gen_tok_s"]
            if train_alone is not None:
                r["finetuning_kept"] = r["train_tok_s"] / train_alone["train_tok_s"]


def hand(b: Bench) -> None:
    """Hand shapes: alone, alone, co-served in every block and under the slowdown bound."""
    from flexoff import Policy
    from flexoff.finetune.coserve import CoJob, CoTrainer, SlowdownBound

    a = b.args
    gbs = a.gpu_batch_size
    policy = Policy(gpu_batch_size=gbs, num_gpu_batches=a.infer_batches + a.train_batches)
    alone_policy = Policy(gpu_batch_size=gbs, num_gpu_batches=a.infer_batches)
    b.llm.generate(b.prompts[:gbs], max_new_tokens=2, policy=policy)  # warm-up: engine, graphs
    gen_alone = b.generate("inference alone", policy=alone_policy)
    trainer = b.trainer("train")
    train_alone = b.train_alone(trainer, a.train_steps)
    for limit in [None] + ([a.max_slowdown] if a.max_slowdown else []):
        bound = SlowdownBound(limit) if limit else None
        job = CoJob(trainer, b.examples, 10**6)  # more steps than the blocks carry: only carried ones count
        b.generate("co-served" + (f", bound {limit:g}" if limit else ""), CoTrainer([job], a.train_batches, bound),
                   policy, bound_estimate=bound.slowdown if bound else None)
    b.ratios(gen_alone, train_alone)


def auto(b: Bench) -> None:
    """--policy auto: each side alone under its searched policy, then the joint plan of each bound."""
    from flexoff import SamplingParams
    from flexoff.finetune.coserve import CoJob, CoTrainer, SlowdownBound

    a = b.args
    gen_alone = b.generate("inference alone (auto)", skip_first=True)
    trainer = b.trainer("train")
    train_alone = b.train_alone(trainer, a.train_steps, "finetuning alone (auto)")
    reqs = b.llm.make_requests(b.prompts, SamplingParams())
    for limit in a.plan_bounds:
        rider = CoTrainer([CoJob(trainer, b.examples, 10**6)], a.train_batches, SlowdownBound(limit))
        policy = b.llm.choose_coserve_policy(reqs, rider)
        plan = b.llm.coserve_plan
        if plan.share == 0:
            print(f"bound {limit:g}: {plan.describe()}")
            continue
        rider.bound = None  # windows in every block: the plan's block as predicted, not its share
        rows = policy.block_size - plan.windows * policy.gpu_batch_size  # inference rows of a block
        block_s = plan.prediction.latency  # predicted, with windows
        b.generate(f"co-served, joint plan for {limit:g} ({plan.windows} windows)", rider, policy, skip_first=True,
                   plan=plan.describe(), plan_share=plan.share, planned_block_s=block_s,
                   predicted_gen_tok_s=rows * a.gen_len / block_s,
                   predicted_train_tok_s=plan.windows * policy.gpu_batch_size * a.seq / block_s,
                   predicted_alone_gen_tok_s=plan.standalone_tps)
    b.ratios(gen_alone, train_alone)


def jobs(b: Bench) -> None:
    """N jobs of one GPU batch a step against one job of N GPU batches a step, same blocks."""
    from flexoff import Policy
    from flexoff.finetune.coserve import CoJob, CoTrainer

    a, n = b.args, b.args.jobs
    policy = Policy(gpu_batch_size=a.gpu_batch_size, num_gpu_batches=a.infer_batches + n)
    b.llm.generate(b.prompts[:a.gpu_batch_size], max_new_tokens=2, policy=policy)  # warm-up
    one = b.trainer("all", grad_accum=n)
    one.step(b.examples[:one.cfg.per_step])
    runs = [("one job, all the data", [CoJob(one, b.examples, 10**6)])]
    part = len(b.examples) // n
    many = [b.trainer(f"job{i}") for i in range(n)]
    for t in many:
        t.step(b.examples[:t.cfg.per_step])
    runs.append((f"{n} jobs", [CoJob(t, b.examples[i * part:(i + 1) * part], 10**6, seed=i)
                               for i, t in enumerate(many)]))
    for label, js in runs:
        b.generate(label, CoTrainer(js, n), policy)
    base = b.rows[-2]
    for r in b.rows[-2:]:
        r["train_vs_one_job"] = r["train_tok_s"] / base["train_tok_s"]


def concurrent(b: Bench) -> None:
    """GPU-resident: inference alone, finetuning alone, and both at once, the training steps in a
    thread of their own on a second LLM (the same random weights, its own engine and CUDA streams)
    while the first generates: how much of each the GPU keeps when they share it by streams
    instead of by blocks; then again with the inference engine's streams (and the stream its
    graphs replay on) at the highest CUDA priority."""
    from flexoff import LLM, Policy

    a = b.args
    gbs = a.gpu_batch_size
    policy = Policy(gpu_batch_size=gbs, num_gpu_batches=a.infer_batches)
    b.llm.generate(b.prompts[:gbs], max_new_tokens=2, policy=policy)  # warm-up: engine, graphs
    gen_alone = b.generate("inference alone", policy=policy)
    with LLM(a.model, policy=Policy(gpu_batch_size=gbs), device=a.device, dtype=b.llm.dtype) as other:
        main_llm, b.llm = b.llm, other
        trainer = b.trainer("train")
        train_alone = b.train_alone(trainer, a.train_steps)
        b.llm = main_llm
        for high in (False, True) if a.device == "cuda" else (False,):
            if high:  # a new inference engine whose streams are made at the highest priority
                b.llm.drop_engine()
            with prioritized(high):
                b.llm.generate(b.prompts[:gbs], max_new_tokens=2, policy=policy)
                both_at_once(b, trainer, policy, "both at once" + (", inference streams high priority" if high else ""))
        for sms in a.train_sms if a.device == "cuda" else []:
            both_at_once(b, trainer, policy, f"both at once, training on {sms} SMs", train_sms=sms)
    b.ratios(gen_alone, train_alone)


@contextlib.contextmanager
def prioritized(high: bool) -> Any:
    """While inside (if `high`): every CUDA stream made is at the highest priority, and work is
    queued on such a stream."""
    if not high:
        yield
        return
    plain = PLAIN_STREAM
    top = -1  # lower numbers are higher priorities; 0 is the default and the lowest

    class High(plain):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = None, priority: int = 0, **kw: Any) -> Any:
            return plain.__new__(cls, device, priority=top, **kw)

    torch.cuda.Stream = High  # type: ignore[misc]
    try:
        with torch.cuda.stream(High()):
            yield
    finally:
        torch.cuda.Stream = plain  # type: ignore[misc]


@contextlib.contextmanager
def training_place(device: str, sms: int | None) -> Any:
    """Where the training thread's work runs: nowhere special off CUDA; on CUDA a stream of the
    lowest priority, or (`sms`) a CUDA green context of that many SMs, so that training cannot
    take the SMs the inference kernels need (torch's `GreenContext`: a stream of its own where
    torch has `Stream()`, else made current to this thread and used through its default stream)."""
    if device != "cuda":
        yield
        return
    if sms is None:
        with torch.cuda.stream(PLAIN_STREAM(priority=0)):
            yield
        return
    from torch.cuda.green_contexts import GreenContext

    ctx = GreenContext.create(num_sms=sms)
    if hasattr(ctx, "Stream"):
        with torch.cuda.stream(ctx.Stream()):
            yield
        return
    ctx.set_context()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        ctx.pop_context()


def both_at_once(b: Bench, trainer: Any, policy: Any, label: str, train_sms: int | None = None) -> None:
    """Training steps in a thread (`training_place`) for as long as the prompts generate; a
    failure of the thread (say, no green contexts in this torch) is recorded with the run."""
    import threading

    stop, steps, failed = threading.Event(), [], []
    per, a = trainer.cfg.per_step, b.args

    def train() -> None:
        try:
            with training_place(a.device, train_sms):
                while not stop.is_set():
                    k = len(steps) % (len(b.examples) // per)
                    trainer.step(b.examples[k * per:(k + 1) * per])
                    steps.append(time.perf_counter())
        except Exception as e:  # the inference run goes on; its record says why training stopped
            failed.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=train, daemon=True)
    t0 = time.perf_counter()
    worker.start()
    rec = b.generate(label, policy=policy)
    t1 = time.perf_counter()
    stop.set()
    worker.join()
    done = sum(t0 <= s <= t1 for s in steps)
    rec["train_tok_s"] = done * per * a.seq / (t1 - t0)
    rec["train_steps"] = done
    if train_sms is not None:
        rec["train_sms"] = train_sms
    if failed:
        rec["training_failed"] = failed[0]
        print(f"{label}: training stopped: {failed[0]}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-7b")
    ap.add_argument("--policy", choices=["hand", "auto"], default="hand")
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--hardware", default=None, help="profile file or preset for --policy auto")
    ap.add_argument("--plan-bounds", type=lambda s: [float(x) for x in s.split(",")], default=[0.2],
                    help="auto: one co-served run under the joint plan of each of these slowdown bounds")
    ap.add_argument("--jobs", type=int, default=0, help="instead: this many jobs against one with all their data")
    ap.add_argument("--concurrent", action="store_true",
                    help="instead: inference and training steps at once on two streams (GPU-resident)")
    ap.add_argument("--train-sms", type=lambda s: [int(x) for x in s.split(",")], default=[],
                    help="--concurrent: one more run for each of these SM counts given to training (a CUDA green context)")
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--infer-batches", type=int, default=8, help="inference GPU batches per block")
    ap.add_argument("--train-batches", type=int, default=1,
                    help="GPU batches per block given to training windows (auto: at most this many)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--examples", type=int, default=512, help="training sequences")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--train-steps", type=int, default=6, help="finetuning steps of the run alone")
    ap.add_argument("--max-slowdown", type=float, default=0.1,
                    help="hand: one more co-served run under this inference-slowdown bound (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script on a tiny model")
    ap.add_argument("--work", default="/tmp/flexoff-coserve-bench")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/coserve.jsonl"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and cuda_missing("coserve.py"):
        return 2
    from flexoff import LLM, Policy

    auto_mode = args.policy == "auto" and not args.jobs and not args.concurrent
    with LLM(args.model, policy="auto" if auto_mode else Policy(gpu_batch_size=args.gpu_batch_size),
             device=args.device, dtype=torch.float16 if args.device == "cuda" else torch.float32,
             gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, hardware=args.hardware) as llm:
        b = Bench(args, llm)
        jobs(b) if args.jobs else concurrent(b) if args.concurrent else auto(b) if auto_mode else hand(b)
    env = environment()
    for r in b.rows:
        r.update(model=args.model, prompts=args.prompts, prompt_len=args.prompt_len, gen_len=args.gen_len,
                 seq=args.seq, rank=args.rank, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, **env)
    print(table(b.rows, COLUMNS + (["train_vs_one_job"] if args.jobs else [])
                + (["predicted_gen_tok_s", "predicted_train_tok_s"] if auto_mode else [])))
    write_jsonl(args.out, b.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
