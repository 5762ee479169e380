"""Pipeline stages on several GPUs against one GPU: one block each, per-stage link and NCCL traffic.

    python benchmarks/pipeline.py --model dummy:opt-66b --prompt-len 512 --gen-len 32 --gpus 1,2 \\
        --gpu-mem 16GiB --cpu-mem 200GiB --policy auto --hardware benchmarks/data/h200-measured.json
    python benchmarks/pipeline.py --smoke     # 1 and 2 stages of a tiny model on the CPU (gloo)

Each GPU count runs in its own processes (torchrun for several), one after the other, with the same
per-GPU budget (--gpu-mem) and the same host budget (--cpu-mem, shared by the host's stages). Each
runs one block of its policy (a pipeline's block holds one group per stage) after choosing the
policy for a job of --prompts prompts. Per stage: its decode time, the bytes it copied to its GPU
in decode and its link time bound (those bytes over the profile's host-to-device bandwidth), the
bytes it sent to other stages. Records go to OUT/pipeline.jsonl; a table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import environment, table, write_jsonl

COLUMNS = ["gpus", "stage", "layers", "policy", "rows", "prefill_s", "decode_s", "decode_tok_s", "vs_1_gpu",
           "h2d_GB", "link_bound_s", "decode/bound", "link_busy", "sent_MB", "peak_gpu_GiB", "peak_cpu_GiB"]


def worker(args: argparse.Namespace) -> None:
    """One configuration: every process (one per stage) runs the block; rank 0 writes the stages' records."""
    import torch

    from flexoff import LLM, SamplingParams
    from flexoff.generation import run_block
    from flexoff.parallel import in_torchrun, init
    from throughput import parse_policy

    rank, t0 = int(os.environ.get("RANK", "0")), time.perf_counter()

    def say(what: str) -> None:  # progress, on stderr (kept in OUT/pipeline-N.err if the run fails)
        print(f"rank {rank}: {what} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    world = init(None) if in_torchrun() else None
    llm = LLM(args.model, policy=parse_policy(args.policy), gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem,
              hardware=args.hardware, dtype=args.dtype, device=args.device, world=world)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (args.prompts, args.prompt_len), generator=gen).tolist()
    reqs = llm.make_requests([{"prompt_ids": p} for p in ids],
                             SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True))
    say("model loaded")
    policy = llm.choose_policy(reqs)
    say(f"policy {policy.describe()}")
    block = reqs[:llm.stage_policy(policy).block_size]
    engine = llm.engine_for(policy, args.prompt_len, args.gen_len)
    say("engine built, weights placed")
    if args.memory_history:  # where the GPU's bytes went, written if the block fails
        torch.cuda.memory._record_memory_history(max_entries=200000)
    try:
        comps, st = run_block(engine, llm.tokenizer, block, 0)
    except torch.OutOfMemoryError:
        if args.memory_history:
            memory_report(Path(args.memory_history), rank)
        raise
    say(f"block done: prefill {st.prefill_s:.1f} s, decode {st.decode_s:.1f} s")
    link = engine.pipe
    rec = {"stage": world.stage if world else 0, "layers": len(engine.spec.layers), "policy": policy.describe(),
           "rows": len(block), "prefill_s": st.prefill_s, "decode_s": st.decode_s,
           "traffic_decode": st.traffic_decode, "peaks": engine.peaks(),
           "sent_bytes": link.sent if link else 0, "tokens": [c.token_ids for c in comps[:4]]}
    recs = [rec]
    if world is not None and world.size > 1:
        import torch.distributed as dist

        recs = [None] * world.size
        dist.all_gather_object(recs, rec, group=world.everyone)
    llm.close()
    if world is None or world.rank == 0:
        Path(args.result).write_text(json.dumps(recs))
    if world is not None:
        world.close()


def memory_report(out: Path, rank: int) -> None:
    """The live GPU blocks at the failure, summed by the innermost flexoff/offload frame that made them."""
    import torch

    snap = torch.cuda.memory._snapshot()
    by: dict[str, int] = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('/work/main/')[-1]}:{f['line']} {f['name']}"
                      for f in b.get("frames", []) if "/work/main/" in f["filename"]]
            key = " < ".join(frames[:3]) or "?"
            by[key] = by.get(key, 0) + b["size"]
    lines = [f"{n / 2**30:8.3f} GiB  {k}" for k, n in sorted(by.items(), key=lambda kv: -kv[1])]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"memory-rank{rank}.txt").write_text("\n".join(lines) + "\n")


def run_config(args: argparse.Namespace, gpus: int, out: Path) -> list[dict[str, Any]]:
    here = Path(__file__).resolve()
    result = out / f"pipeline-{gpus}.json"
    result.unlink(missing_ok=True)
    flags = ["--worker", "--result", str(result), "--model", args.model, "--prompt-len", str(args.prompt_len),
             "--gen-len", str(args.gen_len), "--prompts", str(args.prompts), "--policy", args.policy,
             "--dtype", args.dtype, "--device", args.device]
    if args.memory_history:
        flags += ["--memory-history", args.memory_history]
    for name in ("gpu_mem", "cpu_mem", "hardware"):
        if getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // gpus)))}
    if gpus == 1:
        cmd = [sys.executable, str(here), *flags]
        if args.device != "cpu":
            env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(here), *flags]
    t0 = time.perf_counter()
    err = out / f"pipeline-{gpus}.err"  # the processes' stderr, kept whatever happens
    with err.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too
            proc.wait()
            return [{"gpus": gpus, "error": f"timed out after {args.timeout} s (stderr in {err.name})"}]
    if code != 0 or not result.exists():
        lines = err.read_text().splitlines()
        why = [l for l in lines if "Error" in l or "error:" in l][-1:] or ["no result"]
        return [{"gpus": gpus, "error": why[0][-300:]}]
    err.unlink()
    recs = json.loads(result.read_text())
    for r in recs:
        r.update(gpus=gpus, wall_s=time.perf_counter() - t0)
    return recs


def rows_of(recs: list[dict[str, Any]], bandwidth: float | None, base: float | None) -> list[dict[str, Any]]:
    """Table rows of a configuration's stage records; vs_1_gpu where `base` (1 GPU's tokens/s) is given."""
    out = []
    for r in recs:
        if "error" in r:
            out.append({"gpus": r["gpus"], "policy": f"failed: {r['error']}"})
            continue
        td, gen = r["traffic_decode"], r["gen_len"]
        tok_s = r["rows"] * (gen - 1) / r["decode_s"] if r["decode_s"] else 0.0
        bound = td.get("h2d", 0) / bandwidth if bandwidth else None
        out.append({"gpus": r["gpus"], "stage": r["stage"], "layers": r["layers"], "policy": r["policy"],
                    "rows": r["rows"], "prefill_s": round(r["prefill_s"], 2), "decode_s": round(r["decode_s"], 2),
                    "decode_tok_s": round(tok_s, 1), "vs_1_gpu": round(tok_s / base, 2) if base else None,
                    "h2d_GB": round(td.get("h2d", 0) / 1e9, 1),
                    "link_bound_s": round(bound, 2) if bound is not None else None,
                    "decode/bound": round(r["decode_s"] / bound, 2) if bound else None,
                    "link_busy": round(td["h2d_busy_s"] / r["decode_s"], 2) if td.get("h2d_busy_s") else None,
                    "sent_MB": round(r["sent_bytes"] / 1e6, 1),
                    "peak_gpu_GiB": round(r["peaks"].get("gpu", 0) / 2**30, 2),
                    "peak_cpu_GiB": round(r["peaks"].get("cpu", 0) / 2**30, 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:opt-66b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=1024, help="The job the policy is chosen for.")
    ap.add_argument("--gpus", default="1,2", help="GPU counts (pipeline stages) to run, one after the other.")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--gpu-mem", default="16GiB", help="Per GPU.")
    ap.add_argument("--cpu-mem", default=None, help="Per host (its stages share it).")
    ap.add_argument("--hardware", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--memory-history", default=None,
                    help="On running out of GPU memory, write each rank's live blocks by source line here.")
    ap.add_argument("--smoke", action="store_true", help="1 and 2 stages of a tiny model on the CPU.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.model, args.prompt_len, args.gen_len, args.prompts = "dummy:opt-125m", 16, 4, 8
        args.policy, args.gpu_mem, args.device, args.timeout = "2x1:100,0,100,0,100,0", None, "cpu", 300
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = None
    if args.hardware:
        from flexoff.policy.hardware import load

        bandwidth = load(args.hardware).ctog_bdw
    records = []
    for g in (int(x) for x in args.gpus.split(",")):
        recs = run_config(args, g, out)
        for r in recs:
            r.update(gen_len=args.gen_len, model=args.model, prompt_len=args.prompt_len, **environment())
        print(table(rows_of(recs, bandwidth, None), COLUMNS), flush=True)
        records += recs
    # a pipeline's throughput is its last stage's: its decode starts after every prefill, ends last
    last = {r["gpus"]: r for r in records if "stage" in r and r["stage"] == r["gpus"] - 1}
    base = rows_of([last[1]], bandwidth, None)[0]["decode_tok_s"] if 1 in last else None
    for r in records:
        r.update(rows_of([r], bandwidth, base if r is last.get(r["gpus"]) else None)[0])
        if 1 in last and r is last.get(r["gpus"]):  # the same prompts, the same tokens (first rows)
            n = min(len(r["tokens"]), len(last[1]["tokens"]))
            r["same_tokens_as_1_gpu"] = r["tokens"][:n] == last[1]["tokens"][:n]
    write_jsonl(out / "pipeline.jsonl", records)
    print(table([r for r in records if "stage" in r], COLUMNS + ["same_tokens_as_1_gpu"]))
    print(f"records in {out / 'pipeline.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
