"""LoRA finetuning throughput on the GPU: flexoff's trainer against PEFT + transformers training on
the same dummy weights, in one run.

Knows: a fresh LoRA adapter (rank r on every linear layer, as PEFT's LoraConfig with all
linear target modules), batches of `batch` random sequences of `seq` tokens with the loss on
every token, AdamW; flexoff steps through its engine (a forward sweep that stashes each
layer's input, a reverse sweep of vector-Jacobian products through the frozen base) under a
policy (default: everything on the GPU); PEFT steps through `loss.backward()` on the same
model weights placed on the GPU (`--peft-gpu-mem` caps the GPU as Accelerate's device_map
does, for models that do not fit). Training tokens per second over `steps` timed steps after
`warmup` steps; the loss of every step is written beside them, and flexoff's step beside the
cost model's prediction for the policy it ran (`--policy auto`: the one the search picked).
With `--accum G` an optimizer step takes G micro-batches of `batch` sequences: PEFT accumulates
their gradients (the loss of each over G, as one mean); flexoff's trainer takes them with
`grad_accum=G`, and under `--policy auto` plans its block for the whole step (each weight load
serving all of them, where the budget holds them).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, table, write_jsonl  # noqa: E402


def batches(vocab: int, batch: int, seq: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (batch, seq), generator=g) for _ in range(count)]


def timed_steps(args: argparse.Namespace, vocab: int, step: Any) -> tuple[list[float], float]:
    """Each batch's loss from step(ids), and the seconds of the steps after the warm-up ones."""
    losses, t0 = [], 0.0
    for i, ids in enumerate(batches(vocab, per_step(args), args.seq, args.warmup + args.steps, args.seed)):
        if i == args.warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        losses.append(step(ids))
    torch.cuda.synchronize()
    return losses, time.perf_counter() - t0


def per_step(args: argparse.Namespace) -> int:
    """Sequences per optimizer step."""
    return args.batch * args.accum


def predict_training(spec: Any, hw: Any, p: Any, seq: int, batch: int, rank: float) -> Any:
    """The cost model's prediction of a training step for a policy as the engine places it
    (whole rows of the stash and hidden states; graphs kept where weights and stash are all on
    the GPU), with throughput over a micro-batch of `batch` sequences."""
    from flexoff.policy.train_cost import TrainChoice, TrainCostModel
    from throughput import fractions

    frac = fractions(p, stash=True)
    keep = frac["wg"] >= 1 and frac["sg"] >= 1
    choice = TrainChoice(p.gpu_batch_size, p.num_gpu_batches, p.compress_weight, overlap=p.overlap,
                         quant_bits=p.quant_bits, quant_group=p.quant_group, keep_graphs=keep)
    pred = TrainCostModel(spec, hw, seq, choice, rank).evaluate(frac)
    blocks = -(-batch // p.block_size)
    pred.throughput = batch * seq / (blocks * pred.latency)
    return pred


def flexoff_run(args: argparse.Namespace) -> dict[str, Any]:
    from flexoff import LLM, Policy, profiler
    from flexoff.finetune.data import Example
    from flexoff.finetune.run import LoraSpec, linear_targets, new_adapter
    from flexoff.finetune.trainer import LoraTrainer, TrainConfig
    from throughput import parse_policy

    policy = parse_policy(args.policy) if args.policy else Policy(gpu_batch_size=args.batch)
    if args.compress_weight and policy != "auto":
        policy = replace(policy, compress_weight=True)
    with LLM(args.model, policy=policy, device="cuda", dtype=torch.float16, gpu_mem=args.gpu_mem,
             cpu_mem=args.cpu_mem, hardware=args.hardware,
             compression=("on" if args.compress_weight else "off", "off")) as llm:
        spec = llm.model.spec
        folder = Path(args.work) / "fresh"
        new_adapter(spec, LoraSpec(args.rank, 2 * args.rank, linear_targets(spec)), folder, 0)
        llm.load_lora("train", str(folder))
        cfg = TrainConfig(lr=1e-4, batch_size=args.batch, grad_accum=args.accum)
        trainer = LoraTrainer(llm, "train", cfg, args.seq)
        def step(ids: torch.Tensor) -> float:
            return trainer.step([Example(row.tolist(), [False] + [True] * (args.seq - 1)) for row in ids])

        losses, sec = timed_steps(args, spec.vocab_size, step)
        link = link_use(llm, step, batches(spec.vocab_size, per_step(args), args.seq, 1, args.seed + 2)[0])
        if args.profile:
            profile(args, step, batches(spec.vocab_size, per_step(args), args.seq, 1, args.seed + 1)[0])
        used = llm.last_policy
        hw = profiler.load(args.hardware, None)
        pred = predict_training(spec, hw, used, args.seq, per_step(args), llm.adapter_rank("train"))
        step_s, planned = sec / args.steps, per_step(args) * args.seq / pred.throughput  # a micro-batch's blocks
        return {"system": "flexoff", "policy": used.describe(), "auto": policy == "auto",
                "step_s": step_s, "train_tokens_per_s": args.steps * per_step(args) * args.seq / sec,
                "predicted_step_s": planned, "predicted_forward_s": pred.prefill_s,
                "predicted_reverse_s": pred.decode_s, "predicted_bottleneck": pred.bottleneck, "hardware": hw.name,
                "step/predicted": step_s / planned,
                "losses": losses, "peak_gpu_bytes": torch.cuda.max_memory_allocated(), **link}


def link_use(llm: Any, step: Any, ids: torch.Tensor) -> dict[str, Any]:
    """One more step with the engine's copy counters read around it: bytes moved by path, and how
    long host-to-device copies kept the link busy (CUDA events around every copy)."""
    before = dict(llm.engine.traffic())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(ids)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    after = llm.engine.traffic()
    moved = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    busy = moved.get("h2d_busy_s", 0.0)
    return {"traffic_step": moved, "link_step_s": sec, "link_busy": busy / sec if sec else None,
            "h2d_GBps_while_busy": moved.get("h2d", 0) / busy / 1e9 if busy else None}


def profile(args: argparse.Namespace, step: Any, ids: torch.Tensor) -> None:
    """One more step under torch.profiler: the operators by device time and by host time, and
    beside them (PROFILE.trace.json.gz, when small enough) the trace, every thread's work named
    by its engine lane, for benchmarks/timeline.py's summary or chrome://tracing."""
    from torch.profiler import ProfilerActivity, profile as prof

    from flexoff.offload.lanes import mark_lanes
    from timeline import MAX_TRACE, all_threads

    mark_lanes(True)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], experimental_config=all_threads()) as p:
        step(ids)
        torch.cuda.synchronize()
    mark_lanes(False)
    ka = p.key_averages()
    text = "\n\n".join(ka.table(sort_by=key, row_limit=30) for key in ("self_cuda_time_total", "self_cpu_time_total"))
    out = Path(args.profile)
    out.write_text(text)
    with tempfile.TemporaryDirectory() as tmp:
        p.export_chrome_trace(str(Path(tmp) / "trace.json"))
        packed = gzip.compress((Path(tmp) / "trace.json").read_bytes())
    if len(packed) <= MAX_TRACE:
        out.with_name(out.name + ".trace.json.gz").write_bytes(packed)


PEFT_PREFIX = "base_model.model."  # where PEFT's wrapper puts the transformers model's modules


def peft_offload_map(pm: Any, device_map: dict[str, Any]) -> dict[str, Any]:
    """The device map of a PEFT-wrapped model: the base model's entries under PEFT's prefix, each
    offloaded one split into its modules that hold tensors, the LoRA ones (trained: real tensors
    that outlive a forward) on the GPU and the frozen ones offloaded as Accelerate placed them."""
    from baseline import module_device

    if "cpu" not in device_map.values():  # the whole model ("") is the wrapper's base model, without the dot
        return {(PEFT_PREFIX + k if k else PEFT_PREFIX[:-1]): v for k, v in device_map.items()}
    out: dict[str, Any] = {}
    for name, mod in pm.named_modules():
        holds = next(mod.parameters(recurse=False), None) is not None or next(mod.buffers(recurse=False), None) is not None
        if name.startswith(PEFT_PREFIX) and holds:
            where = module_device(device_map, name[len(PEFT_PREFIX):])
            out[name] = 0 if where == "cpu" and ".lora_" in name else where
    return out


def peft_run(args: argparse.Namespace) -> dict[str, Any]:
    """PEFT + transformers training. Where Accelerate offloads layers to CPU memory (a GPU cap),
    PEFT wraps the placed model before the dispatch (LoRA weights on the GPU, frozen weights
    offloaded) and the decoder layers are checkpointed: recomputed in the backward, so the
    offloaded weights are copied in again there instead of held on the GPU by the graph."""
    from peft import LoraConfig, get_peft_model

    from baseline import hf_model
    from flexoff.checkpoint import load_model
    from flexoff.finetune.run import linear_targets

    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=linear_targets(load_model(args.model).spec))

    def wrap(model: Any, device_map: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        pm = get_peft_model(model, config)
        for p in pm.parameters():  # trainable LoRA weights in float32, as the trainer keeps them
            if p.requires_grad:
                p.data = p.data.float()
        return pm, peft_offload_map(pm, device_map)

    pm, device_map, _, spec = hf_model(args.model, args.seq, 0, args.batch, args.peft_gpu_mem, None,
                                       torch.float16, prepare=wrap)
    offloaded = "cpu" in device_map.values()
    if offloaded:
        pm.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step(ids: torch.Tensor) -> float:
        total = 0.0
        for micro in ids.cuda().split(args.batch):  # equal lengths, every token labelled: the mean of means
            with torch.autocast("cuda", dtype=torch.float16):
                loss = pm(input_ids=micro, labels=micro).loss / args.accum
            loss.backward()
            total += float(loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    losses, sec = timed_steps(args, spec.vocab_size, step)
    frozen = [k for k, v in device_map.items() if ".lora_" not in k]
    on_gpu = sum(1 for k in frozen if device_map[k] == 0)
    return {"system": "peft", "policy": f"{on_gpu} of {len(frozen)} frozen modules on the GPU"
                                        + (", the rest offloaded, checkpointed layers" if offloaded else ""),
            "step_s": sec / args.steps, "train_tokens_per_s": args.steps * per_step(args) * args.seq / sec,
            "losses": losses, "peak_gpu_bytes": torch.cuda.max_memory_allocated()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-7b")
    ap.add_argument("--policy", default=None,
                    help="flexoff's policy string, or auto (default: everything on the GPU)")
    ap.add_argument("--hardware", default="benchmarks/data/h200-measured.json",
                    help="hardware profile of the cost model (auto's search and the prediction)")
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--peft-gpu-mem", default=None, help="GPU budget for PEFT's Accelerate placement")
    ap.add_argument("--compress-weight", action="store_true", help="flexoff: 4-bit base weights")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of one more flexoff step here")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--systems", default="flexoff,peft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/flexoff-finetune-bench")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/finetune.jsonl"))
    args = ap.parse_args(argv)
    if cuda_missing("finetune.py"):
        return 2
    from flexoff.validate import size

    args.peft_gpu_mem = size(args.peft_gpu_mem)
    env = environment()
    rows = []
    for system in args.systems.split(","):
        torch.cuda.reset_peak_memory_stats()
        try:
            rows.append({"flexoff": flexoff_run, "peft": peft_run}[system](args))
        except Exception as e:  # a baseline that cannot run this is a result too
            print(f"{system} failed: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
            rows.append({"system": system, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        gc.collect()
        torch.cuda.empty_cache()
    peft = next((r for r in rows if r["system"] == "peft" and "error" not in r), None)
    for r in rows:
        r.update(model=args.model, rank=args.rank, batch=args.batch, accum=args.accum, seq=args.seq, steps=args.steps,
                 compress_weight=args.compress_weight and r["system"] == "flexoff", **env)
        r["vs_peft"] = r["train_tokens_per_s"] / peft["train_tokens_per_s"] if peft and "error" not in r else None
    print(table(rows, ["system", "policy", "step_s", "predicted_step_s", "train_tokens_per_s", "link_busy",
                       "h2d_GBps_while_busy", "vs_peft"]))
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
