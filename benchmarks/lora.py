"""Batched LoRA on the GPU: many adapters of mixed ranks against the same run without LoRA, PEFT's
mixed-adapter generation, and the kernels' memory bandwidth.

Knows: three parts, each comparison measured in one run:
- `population`: flexoff on a model (GPU-resident llama-7b by default, or any policy) generating
  for prompts that each draw an adapter uniformly at random from a population (1000 adapters,
  ranks drawn from 8/16/32/64, on every linear layer), against the same prompts without LoRA;
  "warm" runs find the adapters already on the device (a job whose blocks reuse them), "cold"
  runs copy every adapter of the block first (a block of adapters not seen before); over several
  blocks (`--prompts`), a run's first block copies its adapters and each later one finds them
  staged while the block before it ran, whichever the variant. Only the
  adapters the prompts draw are made (random values, made on the device, kept in host memory,
  or with `--adapter-dir` written as PEFT folders and read from their files as blocks use them:
  before each timed run the host cache then holds only the first block's (read then if the run
  before left others), as a long job's would have read them during the block before, so every
  later block reads its own; none, where
  the policy keeps one block's adapters in host memory, and each block reads its own as it begins).
  `--job-prompts N` draws the adapters for a job of N prompts and runs a stretch of it (the
  first `--prompts` in adapter order, as that job's blocks group them): a long job's blocks,
  each using few adapters, without running all of it.
- `peft`: Hugging Face PEFT's `generate(..., adapter_names=...)` and flexoff on the same dummy
  weights, batch 32, with no adapter, one adapter for every row, and a distinct rank-8 adapter
  per row on all linear layers: each system's ratios to its own no-LoRA run and the speedup.
- `kernel`: the shrink/expand kernels at decode shapes (one token per row) and prefill shapes
  (rows of prompt-len tokens), every row its own adapter, in each tiling of CONFIGS: bytes they
  must move (the rows' adapters, x, y twice) over their time, against the copy bandwidth; and
  a projection with its deltas (in place after the matmul, or written first) against the
  matmul alone.
Throughput is generated tokens over the whole run (prefill included); the decode step is the
time for gen_len tokens less the time for one, over gen_len - 1. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, gpu_seconds, table, write_jsonl  # noqa: E402
from flexoff.profiler import random_adapter  # noqa: E402

RANKS = (8, 16, 32, 64)
# tilings the kernel part compares (changes to kernels.lora.DECODE for rows of one token, PREFILL for tiles)
CONFIGS = {"decode": [{}, {"lane_k": 2048}], "prefill": [{}]}
SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096))  # LLaMA-7B's attention, up and down projections


def timed(llm: Any, prompts: list[dict], gen_len: int, adapters: Sequence[str | None] | None,
          before: Any = None, policy: Any = None) -> tuple[float, float]:
    """Seconds for one token and for gen_len tokens (each run after `before()`, if given; both
    under `policy` where given)."""
    out = []
    for n in (1, gen_len):
        if before is not None:
            before()
        torch.cuda.synchronize()
        st = llm.generate(prompts, max_new_tokens=n, adapters=adapters, policy=policy).stats
        out.append(st.prefill_s + st.decode_s)
        print(f"  {'lora' if adapters else 'no lora'}, {n} tokens, {llm.last_policy.describe()}: "
              f"prefill {st.prefill_s:.2f} s, decode {st.decode_s:.2f} s", file=sys.stderr, flush=True)
    return out[0], out[1]


def kernel_times(fn: Any) -> dict[str, tuple[int, float]]:
    """fn() under torch's profiler: each kernel's (calls, GPU ms), kernels launched by CUDA graphs included."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:90]: (e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA}  # kernels and copies only: ops and launches carry their time too


def profiled(label: str, fn: Any, top: int = 25, less: Any = None, per: int = 1) -> list[dict[str, Any]]:
    """fn()'s kernels by GPU time (printed, and returned as records), less those of less() where
    given, over `per` (a decode step's: a run of n tokens less a run of one, per n - 1)."""
    got, base = kernel_times(fn), kernel_times(less) if less is not None else {}
    rows = []
    for k, (c, ms) in got.items():
        c0, ms0 = base.get(k, (0, 0.0))
        rows.append({"profile": label, "kernel": k, "calls": (c - c0) / per, "gpu_ms": (ms - ms0) / per})
    rows.sort(key=lambda r: -r["gpu_ms"])
    total = sum(r["gpu_ms"] for r in rows)
    print(f"  profile {label}: {total:.1f} ms of GPU time", file=sys.stderr)
    for r in rows[:top]:
        print(f"    {r['gpu_ms']:9.2f} ms {r['calls']:7.1f}x {r['kernel']}", file=sys.stderr, flush=True)
    return [{**r, "gpu_ms_total": total} for r in rows[:top]]


def decode_profile(label: str, m: Any, prompts: list[dict], adapters: Sequence[str | None] | None, policy: Any,
                   gen_len: int) -> list[dict[str, Any]]:
    """A decode step's kernels: a run of gen_len tokens less a run of one, per step."""
    def run(n: int) -> Any:
        return lambda: m.generate(prompts, max_new_tokens=n, adapters=adapters, policy=policy)
    return profiled(f"{label} decode step", run(gen_len), less=run(1), per=gen_len - 1)


def record(system: str, variant: str, rows: int, gen_len: int, one: float, full: float, **extra: Any) -> dict:
    return {"system": system, "variant": variant, "batch": rows, "total_s": full,
            "decode_step_ms": 1e3 * (full - one) / (gen_len - 1), "generation_throughput": rows * gen_len / full,
            **extra}


def only_read(pool: Any, names: set[str]) -> None:
    """Leave only these adapters' host copies in the pool's cache, reading those it lacks (the
    run before left others)."""
    pool.drop_host_cache(names)
    for n in names:
        pool.host(n, keep=names)


def population(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The run without LoRA, then with the population's adapters, each in an LLM of its own (one
    engine each: under --policy auto the two plans differ, and an LLM that changed engines would
    hold both plans' host buffers for a while)."""
    from flexoff import LLM, Policy
    from flexoff.api import SamplingParams
    from flexoff.adapters import write_folder
    from flexoff.checkpoint import load_model
    from flexoff.finetune.run import linear_targets
    from flexoff.kernels import lora as L
    from flexoff.offload import adapters as A
    from throughput import parse_policy

    if args.deltas is not None:
        L.WRITE_FIRST = args.deltas == "first"
    L.SIDE_STREAM = args.side_stream == "on"
    L.DENSE = args.dense == "on"
    L.STACKED = args.stacked == "on"
    L.TILES_STACKED = args.stacked_prefill == "on"
    L.DECODE.update(json.loads(args.decode_tiling))
    L.PREFILL.update(json.loads(args.prefill_tiling))

    g = torch.Generator().manual_seed(args.seed)
    auto = args.policy == "auto"
    if auto and not args.prompts:
        raise SystemExit("--policy auto needs --prompts (the job the search plans for)")
    policy = "auto" if auto else parse_policy(args.policy) if args.policy else Policy(gpu_batch_size=args.batch)
    rows = args.prompts or policy.block_size
    spec = load_model(args.model).spec
    prompts = [{"id": str(r), "prompt_ids": torch.randint(3, spec.vocab_size, (args.prompt_len,),
                                                          generator=g).tolist()} for r in range(rows)]
    job = max(rows, args.job_prompts or rows)
    draw = torch.randint(0, args.adapters, (job,), generator=g).tolist()
    if job > rows:  # a stretch of a longer job: its first rows in adapter order, as its blocks group them
        draw = sorted(draw)[:rows]
    rank_of = torch.randint(0, len(RANKS), (args.adapters,), generator=g).tolist()
    names = [f"a{d}" for d in draw]
    used = sorted(set(draw))
    mean_rank = sum(RANKS[rank_of[d]] for d in used) / len(used)

    def llm() -> Any:
        made = LLM(args.model, policy=policy, device="cuda", dtype=torch.float16, gpu_mem=args.gpu_mem,
                   cpu_mem=args.cpu_mem, hardware=args.hardware)
        made.model.tokenizer.eos_ids = ()
        return made

    def plan(m: Any, adapters: Sequence[str | None] | None) -> Any:
        """auto: the policy the search picks for the whole job (with or without its adapters),
        kept for its one-token run too; otherwise the one given."""
        if not auto:
            return None
        job = [{**p, "adapter": a} for p, a in zip(prompts, adapters or [None] * rows)]
        return m.choose_policy(m.make_requests(job, SamplingParams(max_new_tokens=args.gen_len)))

    with llm() as m:
        without = plan(m, None)
        # engine made at the timed runs' size, graphs captured (a shorter warm-up left both to the timed run)
        m.generate(prompts[:args.warmup_prompts], max_new_tokens=args.gen_len, policy=without)
        out = [record("flexoff", "no-lora", rows, args.gen_len, *timed(m, prompts, args.gen_len, None, policy=without),
                      policy=m.last_policy.describe())]
        if args.profile:  # its prefill (a one-token run), to set beside the LoRA engine's
            out[0]["profile"] = profiled("no-lora prefill",
                                         lambda: m.generate(prompts, max_new_tokens=1, policy=without))
        if args.profile_decode:
            out[0]["profile_decode"] = decode_profile("no-lora", m, prompts, None, without, args.gen_len)
    gc.collect()
    torch.cuda.empty_cache()  # the first engine's memory back to the device, for the second's budget
    with llm() as m:
        t0 = time.perf_counter()
        for d in used:
            rank = RANKS[rank_of[d]]
            a = random_adapter(f"a{d}", spec, rank, d, torch.device("cuda"), torch.float16)
            if args.adapter_dir is None:
                m.add_adapter(a)
                continue
            folder = args.adapter_dir / a.name  # a PEFT folder, read from its file when a block uses it
            write_folder(folder, spec, a.modules, {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank,
                                                   "target_modules": linear_targets(spec)})
            m.load_lora(a.name, str(folder))
        made = time.perf_counter() - t0
        with_lora = plan(m, names)
        m.generate(prompts[:args.warmup_prompts], max_new_tokens=args.gen_len,
                   adapters=names[:args.warmup_prompts], policy=with_lora)
        before = None
        if args.adapter_dir is not None:  # as in a long job: only the first block's adapters were read before,
            # where the host cache keeps two blocks' (with room for one, a block reads its own when it begins)
            pool, p = m.adapter_pool(), m.last_policy
            first = set(sorted(names)[:p.block_size]) if p.lora_cache_blocks > 1 else set()
            before = lambda: only_read(pool, first)  # noqa: E731
        modes = args.segments.split(",") if args.segments else [None]  # None: the library's own settings
        segments = L.SEGMENTS
        threads = [int(t) for t in args.read_threads.split(",")] if args.read_threads else [A.READ_THREADS]
        runs, reads = [], {}
        for mode in modes:  # each way of the prefill's segments in turn, in this one engine
            for n in threads:  # and each number of threads reading adapter files
                if mode is not None:  # "fused": the library's segments with the fused matmul in front
                    L.SEGMENTS, L.FUSED = (segments, True) if mode == "fused" else (mode, False)
                A.READ_THREADS = n
                label = "warm" + (f"-segments-{mode}" if len(modes) > 1 else "") + \
                    (f"-read-threads-{n}" if len(threads) > 1 else "")
                m.adapter_pool().reads = A.Reads()
                runs.append((label, timed(m, prompts, args.gen_len, names, before, policy=with_lora)))
                ar = m.adapter_pool().arena  # host copies pinned on their own and in the arena, so far
                reads[label] = {**dataclasses.asdict(m.adapter_pool().reads),
                                **({"pinned": ar.pinned, "in_arena": ar.taken} if ar is not None else {})}
                if args.adapter_dir is not None:
                    print(f"  reading adapters: {reads[label]}", file=sys.stderr, flush=True)
        prof = profiled("lora prefill", lambda: m.generate(prompts, max_new_tokens=1, adapters=names,
                                                           policy=with_lora)) if args.profile else None
        prof_decode = decode_profile("lora", m, prompts, names, with_lora, args.gen_len) if args.profile_decode \
            else None
        if not args.skip_cold:  # every adapter copied again
            runs.append(("cold", timed(m, prompts, args.gen_len, names, m.adapter_pool().drop_cache, policy=with_lora)))
        extra = {"adapters": args.adapters, "used_adapters": len(used), "mean_rank": mean_rank,
                 "deltas": "first" if L.WRITE_FIRST else "after",
                 "decode_tiling": args.decode_tiling, "prefill_tiling": args.prefill_tiling,
                 "side_stream": args.side_stream, "dense": args.dense, "stacked": args.stacked,
                 "stacked_prefill": args.stacked_prefill,
                 "segments": args.segments or segments + ("+fused" if L.FUSED else ""),
                 "policy": m.last_policy.describe(), "auto": auto, "setup_adapters_s": made, "job_prompts": job,
                 "adapters_from": "files" if args.adapter_dir else "memory",
                 # what the plan counts
                 "adapter_host_bytes": m.adapter_host_bytes(m.engine.adapter_need, m.last_policy.lora_cache_blocks),
                 **({"profile": prof} if prof else {}), **({"profile_decode": prof_decode} if prof_decode else {})}
    for v, (one, full) in runs:
        r = record("flexoff", f"lora-{v}", rows, args.gen_len, one, full, **extra,
                   **({"reads": reads[v]} if args.adapter_dir is not None and v in reads else {}))
        r["vs_no_lora"] = r["generation_throughput"] / out[0]["generation_throughput"]
        out.append(r)
    return out


def peft_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    """PEFT and flexoff, batch args.peft_batch, no adapter / one / one per row (rank 8, all linears)."""
    from peft import LoraConfig, get_peft_model

    from baseline import hf_model
    from flexoff import LLM, Policy

    batch, s, n = args.peft_batch, args.prompt_len, args.gen_len
    g = torch.Generator().manual_seed(args.seed)
    out = []
    model, _, _, spec = hf_model(args.peft_model, s, n, batch, None, None, torch.float16)
    ids = torch.randint(3, spec.vocab_size, (batch, s), generator=g)
    from flexoff.finetune.run import linear_targets

    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=linear_targets(spec), init_lora_weights=False)
    pm = get_peft_model(model, cfg, adapter_name="a0")
    for i in range(1, batch):
        pm.add_adapter(f"a{i}", cfg)
    pm.eval()
    dev_ids = ids.cuda()

    def hf(variant: str, tokens: int) -> float:
        """no-lora: PEFT's adapters disabled; one-adapter: a0 active; distinct: a mixed batch."""
        kw = {"adapter_names": [f"a{i}" for i in range(batch)]} if variant == "distinct" else {}
        pm.set_adapter("a0")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            if variant == "no-lora":
                with pm.disable_adapter():
                    pm.generate(dev_ids, attention_mask=torch.ones_like(dev_ids), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            else:
                pm.generate(dev_ids, attention_mask=torch.ones_like(dev_ids), max_new_tokens=tokens,
                            min_new_tokens=tokens, do_sample=False, pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    hf("distinct", 2)  # warm
    for v in ("no-lora", "one-adapter", "distinct"):
        out.append(record("peft", v, batch, n, hf(v, 1), hf(v, n)))
    del pm, model
    gc.collect()
    torch.cuda.empty_cache()
    with LLM(args.peft_model, policy=Policy(gpu_batch_size=batch), device="cuda", dtype=torch.float16) as llm:
        llm.model.tokenizer.eos_ids = ()
        for i in range(batch):
            llm.add_adapter(random_adapter(f"a{i}", llm.model.spec, 8, i, torch.device("cuda"), torch.float16))
        prompts = [{"id": str(r), "prompt_ids": ids[r].tolist()} for r in range(batch)]
        fl = {"no-lora": None, "one-adapter": ["a0"] * batch, "distinct": [f"a{i}" for i in range(batch)]}
        for names in fl.values():  # graphs captured before anything is timed
            llm.generate(prompts, max_new_tokens=n, adapters=names)
        for v, names in fl.items():
            out.append(record("flexoff", v, batch, n, *timed(llm, prompts, n, names)))
    for r in out:
        base = next(b for b in out if b["system"] == r["system"] and b["variant"] == "no-lora")
        r["vs_no_lora"] = r["generation_throughput"] / base["generation_throughput"]
        peft = next(b for b in out if b["system"] == "peft" and b["variant"] == r["variant"])
        r["vs_peft"] = r["generation_throughput"] / peft["generation_throughput"]
    return out


def kernel_part(args: argparse.Namespace, bw: float) -> list[dict[str, Any]]:
    """The kernels at decode shapes (one token per row) and prefill shapes (--prefill-rows rows
    of --prompt-len tokens), every row its own adapter, of one rank or of ranks drawn from
    RANKS: the in-place delta in each tiling of CONFIGS (bytes: the rows' adapters, x, and y read
    and written), at prefill shapes also the shrink, the expand writing y (bytes: y once) and
    the projection with its deltas written first in each tiling; then the shrink alone, and what
    a projection costs: the base matmul alone, then the in-place delta, and the delta written
    first with the matmul added onto it."""
    from flexoff.kernels import lora as L
    from flexoff.kernels.lora import LoraPack, lora_delta_triton, lora_expand, lora_linears, lora_shrink

    g = torch.Generator().manual_seed(args.seed)
    configs = {**CONFIGS, **({"decode": json.loads(args.decode_configs)} if args.decode_configs else {}),
               **({"prefill": json.loads(args.prefill_configs)} if args.prefill_configs else {})}
    out, saved = [], (dict(L.DECODE), dict(L.PREFILL), L.WRITE_FIRST, L.SIDE_STREAM)
    cases = [(int(n), 1, shape, rk) for n in str(args.rows).split(",") if n for shape in SHAPES
             for rk in ("16", "64", "mixed")]
    cases += [(args.prefill_rows, args.prompt_len, shape, "mixed") for shape in SHAPES]
    for n, s, (fin, fout), rk in cases:
        ranks = [int(rk)] * n if rk != "mixed" else [RANKS[i] for i in torch.randint(0, len(RANKS), (n,), generator=g)]
        sizes = [r * (fin + fout) for r in ranks]
        a_host = [sum(sizes[:i]) for i in range(n)]
        buf = torch.randn(sum(sizes), dtype=torch.float16, device="cuda") * 0.01
        a_off = torch.tensor(a_host, device="cuda")
        b_off = a_off + torch.tensor(ranks, device="cuda") * fin
        pack = LoraPack(buf, a_off, b_off, torch.tensor(ranks, dtype=torch.int32, device="cuda"),
                        torch.ones(n, device="cuda"), fin, fout, 64, tuple(ranks), tuple(a_host),
                        tuple(b_off.tolist()), (1.0,) * n)  # a pool whose largest rank is 64
        x = torch.randn(n, s, fin, dtype=torch.float16, device="cuda")
        y = torch.zeros(n, s, fout, dtype=torch.float16, device="cuda")
        w = torch.randn(fout, fin, dtype=torch.float16, device="cuda") * 0.01
        ids = torch.arange(n, dtype=torch.int32, device="cuda")
        nbytes = buf.numel() * 2 + x.numel() * 2 + 2 * y.numel() * 2
        shrunk = buf.numel() * fin // (fin + fout) * 2 + x.numel() * 2  # what the shrink reads: the rows' A, x
        kind = "decode" if s == 1 else "prefill"
        calls = 10 if s == 1 else 3
        table = L.DECODE if s == 1 else L.PREFILL
        shape = f"{kind} {fin}x{fout} r{rk}"

        def row(variant: str, sec: float, moved: int = nbytes) -> dict[str, Any]:
            return {"system": "kernel", "variant": f"{shape} {variant}", "batch": n, "tokens_per_row": s,
                    "us": 1e6 * sec, "GBps": moved / sec / 1e9, "of_copy_bandwidth": moved / sec / bw}

        base = gpu_seconds(lambda: torch.nn.functional.linear(x, w), calls)
        xf, yf = x.view(-1, fin), y.view(-1, fout)
        for cfg in configs[kind]:
            table.update({**saved[s > 1], **cfg})
            tiles = ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"
            out.append(row(tiles, gpu_seconds(lambda: lora_delta_triton(x, y, ids, pack), calls)))
            if s > 1:  # the shrink; the expand as the engine runs it, written first (bytes: y once); under the matmul
                out.append(row(f"{tiles}, shrink", gpu_seconds(lambda: lora_shrink(xf, ids, pack, s, True), calls),
                               shrunk))
                v = lora_shrink(xf, ids, pack, s, True)
                out.append(row(f"{tiles}, expand written first", gpu_seconds(
                    lambda: lora_expand(v, yf, ids, pack, s, add=False), calls), y.numel() * 2))
                L.WRITE_FIRST = True
                sec = gpu_seconds(lambda: lora_linears(x, w, None, [fout], ids, [pack], kernels=True), calls)
                out.append({**row(f"{tiles}, delta first, matmul onto it", sec), "vs_base_matmul": sec / base})
                L.WRITE_FIRST = saved[2]
        table.update(saved[s > 1])
        out.append(row("shrink", gpu_seconds(lambda: lora_shrink(xf, ids, pack, s, s > 1), calls), shrunk))
        out.append({**row("base matmul", base), "vs_base_matmul": 1.0})
        modes = [("matmul + delta", False, False), ("delta first, matmul onto it", True, False)]
        modes += [("delta beside on a stream of its own", True, True)] if s == 1 else []
        for name, first, side in modes:
            L.WRITE_FIRST, L.SIDE_STREAM = first, side
            sec = gpu_seconds(lambda: lora_linears(x, w, None, [fout], ids, [pack], kernels=True), calls)
            out.append({**row(name, sec), "vs_base_matmul": sec / base})
        L.WRITE_FIRST, L.SIDE_STREAM = saved[2], saved[3]
        del buf, x, y, w
    L.DECODE.update(saved[0])
    L.PREFILL.update(saved[1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="population,peft,kernel")
    ap.add_argument("--model", default="dummy:llama-7b")
    ap.add_argument("--policy", default=None,
                    help="a policy string, or auto with --prompts (default: everything on the GPU)")
    ap.add_argument("--hardware", default="benchmarks/data/h200-measured.json",
                    help="hardware profile of --policy auto's cost model")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--skip-cold", action="store_true",
                    help="population: no cold run (streamed weights page every adapter in per layer anyway)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts in the job (default: one block)")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--job-prompts", type=int, default=None,
                    help="population: adapters drawn for a job of this many prompts, of which the run takes the "
                         "first --prompts (or one block) in adapter order, as the job's blocks group them")
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="population: the warm-up run's prompts, the first of the job's (default: all)")
    ap.add_argument("--adapter-dir", type=Path, default=None,
                    help="population: write the adapters here as PEFT folders and load them from their files "
                         "(default: made in memory and held there)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--peft-model", default="dummy:llama-7b")
    ap.add_argument("--peft-batch", type=int, default=32)
    ap.add_argument("--rows", default="8,128",
                    help="kernel part: decode rows (a list, empty for none), each with its own adapter")
    ap.add_argument("--prefill-rows", type=int, default=128, help="kernel part: prefill rows of --prompt-len tokens")
    ap.add_argument("--deltas", choices=("first", "after"), default=None,
                    help="population, prefill: LoRA deltas written before the base matmul adds itself, or added "
                         "after it (default: the kernels' WRITE_FIRST)")
    ap.add_argument("--side-stream", choices=("on", "off"), default="on",
                    help="population: decode deltas on a stream of their own beside the base matmul, or not")
    ap.add_argument("--dense", choices=("on", "off"), default="on",
                    help="population: decode deltas of resident adapters through dense matmuls over the pool's "
                         "rank lanes (kernels.lora.DENSE), or the token-by-token passes")
    ap.add_argument("--stacked", choices=("on", "off"), default="on",
                    help="population: stacked projections' decode deltas (q, k, v; gate, up) in one launch, "
                         "or one each")
    ap.add_argument("--read-threads", default=None,
                    help="population with --adapter-dir: threads reading the next block's adapter files "
                         "(offload.adapters.READ_THREADS, its default if not given); a comma list times each in one "
                         "engine")
    ap.add_argument("--segments", default=None,
                    help="population: prefill deltas by segments of rows of one adapter through cuBLAS "
                         "(kernels.lora.SEGMENTS: expand, both or off; the fused matmul, kernels.lora.FUSED, off), "
                         "or 'fused' (the fused matmul where it fits, else the default segments); a comma list times "
                         "each in one engine (default: the library's defaults)")
    ap.add_argument("--stacked-prefill", choices=("on", "off"), default="on",
                    help="population: the same for prefill tiles (the shrink reads x once for all)")
    ap.add_argument("--decode-configs", default=None,
                    help="kernel part: JSON list of decode tilings to compare (default: %s)"
                         % json.dumps(CONFIGS["decode"]))
    ap.add_argument("--prefill-configs", default=None,
                    help="kernel part: JSON list of prefill tilings to compare (default: %s)"
                         % json.dumps(CONFIGS["prefill"]))
    ap.add_argument("--prefill-tiling", default="{}",
                    help='population: JSON over the LoRA kernels\' PREFILL tiling, e.g. \'{"blocks": 4}\'')
    ap.add_argument("--decode-tiling", default="{}",
                    help='population: JSON over the LoRA kernels\' DECODE tiling, e.g. \'{"lane_k": 2048}\'')
    ap.add_argument("--profile", action="store_true",
                    help="population: after the timed runs, each engine's prefill under torch's profiler, its "
                         "kernels by GPU time")
    ap.add_argument("--profile-decode", action="store_true",
                    help="population: after the timed runs, each engine's decode step under torch's profiler (a "
                         "run of --gen-len tokens less a run of one, per step), its kernels by GPU time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/lora.jsonl"))
    args = ap.parse_args(argv)
    if os.environ.get("FLEXOFF_STACKS"):  # every thread's stack every N seconds, to see where a slow run is
        faulthandler.dump_traceback_later(float(os.environ["FLEXOFF_STACKS"]), repeat=True)
    if cuda_missing("lora.py"):
        return 2
    from resident import copy_bandwidth

    bw = copy_bandwidth()
    env = environment()
    rows: list[dict[str, Any]] = []
    parts = args.parts.split(",")
    for part in parts:
        got = {"population": lambda: population(args), "peft": lambda: peft_part(args),
               "kernel": lambda: kernel_part(args, bw)}[part]()
        for r in got:
            r.update(part=part, model=args.model if part == "population" else args.peft_model,
                     prompt_len=args.prompt_len, gen_len=args.gen_len, copy_GBps=bw / 1e9, **env)
        rows += got
        cols = ["system", "variant", "batch", "us", "GBps", "of_copy_bandwidth", "vs_base_matmul"] \
            if part == "kernel" else \
            ["system", "variant", "batch", "decode_step_ms", "generation_throughput", "vs_no_lora", "vs_peft",
             "used_adapters", "mean_rank"]
        print(table(got, cols), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
