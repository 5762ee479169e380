"""Generation throughput: a matrix of full runs, ablations, a latency-throughput frontier and the
Hugging Face Accelerate baseline, each run a JSON record with its prediction and bounds.

    python benchmarks/throughput.py --model dummy:opt-30b --prompt-len 512 --gen-len 32 \\
        --gpu-mem 16GiB --policy auto --policy "48x2:0,100,0,100,100,0:a" [--ablations] \\
        [--frontier] [--baseline 8] [--hardware FILE] [--out benchmarks/out]
    python benchmarks/throughput.py --smoke      # the whole suite on tiny models, on the CPU

Policies: `auto` (the LP search), `auto+c` (the search, compression allowed), a policy JSON
file, or `GxN:wg,wc,cg,cc,hg,hc[:flags]` with flags a (CPU attention), w (compressed weights),
k (compressed cache), n (no overlap). Every run is a full run of its block (no projection).
Records go to OUT/throughput.jsonl; the frontier plot to OUT/frontier.png.

A run's decode bound is the largest of the link's bytes at the profile's `ctog_bdw`, CPU
attention's reads at its `cpu_attn_bdw`, the host memory's (the bytes the link copies out of it
plus those CPU attention reads, at the cost model's rate for reads: the profile's measured
`host_read_bdw`, else HOST_READ_OVER_MEMCPY times `cpu_mem_bdw`) and the link's beside CPU
attention: for the lane's shortest time the link copies at most at the rate the profile measured
beside it (`cpu_attn_ctog_bdw`), and at `ctog_bdw` after (decode_bounds). Records before
2026-11-27's tenth session took the host memory's at `cpu_mem_bdw` and no CPU attention term;
records before its twelfth have no shared term (`decode/link_bound` is the link's alone).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from common import AllocatorWatch, environment, table, write_jsonl

from flexoff.dummy import random_prompts
from flexoff.errors import GpuOutOfMemoryError

COLUMNS = ["label", "model", "policy", "prefill_s", "decode_s", "gen_tok_s", "decode_tok_s", "predicted_tok_s",
           "measured/predicted", "decode_bound_s", "decode/bound", "decode_link_busy", "decode_link_GBps",
           "peak_gpu_GiB", "peak_cpu_GiB", "decode_alloc_retries"]


def decode_bounds(link_bytes: float, lane_bytes: float, hw: Any) -> dict[str, float]:
    """Lower bounds on a decode's seconds from the bytes its link copied and its CPU attention
    read, at the profile `hw`'s rates: `link` (all copies at ctog_bdw), `lane` (the reads at
    cpu_attn_bdw), `host` (both out of host memory at the cost model's read rate) and `shared`:
    while the lane reads, the link copies no faster than the profile measured beside CPU
    attention (cpu_attn_ctog_bdw), and at ctog_bdw only the rest of the time. With the lane busy
    its shortest time, the link's bytes take at least that time plus what is left over at
    ctog_bdw (or the lane's time where the link finishes inside it); the same as `link` where
    the profile did not measure that rate or nothing ran on the lane. `bound` is the largest."""
    from flexoff.policy.cost_model import host_read_bdw

    link = link_bytes / hw.ctog_bdw
    lane = lane_bytes / hw.cpu_attn_bdw if lane_bytes else 0.0
    shared = lane + max(0.0, link_bytes - hw.ctog_beside_cpu_attention() * lane) / hw.ctog_bdw
    host = (link_bytes + lane_bytes) / host_read_bdw(hw)
    return {"link": link, "lane": lane, "shared": shared, "host": host, "bound": max(link, lane, shared, host)}


SEARCHED = ("auto", "auto+c")  # policies the search picks (auto+c: compression allowed)


def parse_policy(text: str) -> Any:
    from flexoff.policy.policy import Policy

    if text in SEARCHED:
        return text
    if text.endswith(".json"):
        return Policy.load(text)
    shape, pct, *flags = text.split(":")
    gbs, nb = (int(x) for x in shape.lower().split("x"))
    wg, wc, cg, cc, hg, hc = (float(x) for x in pct.split(","))
    f = flags[0] if flags else ""
    return Policy(gbs, nb, wg, wc, cg, cc, hg, hc, compress_weight="w" in f, compress_cache="k" in f,
                  cpu_cache_compute="a" in f, overlap="n" not in f)


class Bench:
    """One model and memory budget: runs policies back to back, weights staying resident. Each
    record is appended to OUT/throughput.jsonl as soon as its run ends; a policy already measured
    in this session (same lengths) is not run again; past `deadline` no new run starts."""

    def __init__(self, model: str, gpu_mem: int | None, cpu_mem: int | None, disk_mem: int | None,
                 hardware: str | None, dtype: str, device: str, offload_dir: str | None,
                 out: Path | None = None, deadline: float = float("inf")):
        from flexoff import LLM
        from flexoff import profiler

        self.llm = LLM(model, gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem, hardware=hardware,
                       dtype=dtype, device=device, offload_dir=offload_dir)
        self.llm.model.tokenizer.eos_ids = ()  # benchmarks generate every token they ask for
        self.hw_source = (hardware, offload_dir)  # loaded again before each run (calibrated by the runs before)
        self.hw = profiler.load(hardware, offload_dir)  # a bad profile stops the benchmark here, not per run
        self.budgets = {"gpu_mem": gpu_mem, "cpu_mem": cpu_mem, "disk_mem": disk_mem}
        self.env = environment()
        self.out, self.deadline = out, deadline
        self.done: dict[tuple, dict[str, Any]] = {}  # (policy, lengths) -> record
        # "each": run each policy once, unrecorded, before the run that is measured; "first": before
        # the first run only, a short one (a fresh machine's first full-size run is slower: see
        # benchmarks/RESULTS.md, 2026-11-27, fifth session)
        self.warmup: str | None = None
        self.warmed = False
        self.searched: dict[Any, Any] = {}  # a searched policy -> how to search it again
        self.round = 0  # which pass over the --policy list (--rounds)
        self.trials: dict[Any, list[dict[str, Any]]] = {}  # a searched policy -> the trials that chose it

    def resolve(self, spec: Any, prompt_len: int, gen_len: int, n: int | None, **search: Any) -> Any:
        from flexoff.autopolicy import auto_policy

        if spec in SEARCHED:
            self.llm.compression = ("auto", "auto") if spec == "auto+c" else ("off", "off")
            p = auto_policy(self.llm, prompt_len, gen_len, n, **search)
            self.searched[p] = lambda: self.resolve(spec, prompt_len, gen_len, n, **search)
            self.trials[p] = [t.as_dict() for t in self.llm.last_trials]
            return p
        return spec

    def run(self, label: str, policy: Any, prompt_len: int, gen_len: int, num_prompts: int | None = None,
            kind: str = "run") -> dict[str, Any] | None:
        """A full run of one block (or num_prompts prompts); None once past the deadline."""
        key = (policy, prompt_len, gen_len, num_prompts)
        if key in self.done and label not in SEARCHED:  # a search's pick runs under its own label
            return dict(self.done[key], label=label, kind=kind, same_run_as=self.done[key]["label"])
        if time.time() > self.deadline:
            print(f"skipped {label}: past the time budget", file=sys.stderr, flush=True)
            return None
        try:
            try:
                rec = self._warm_and_measure(label, policy, prompt_len, gen_len, num_prompts, kind)
            except GpuOutOfMemoryError:
                if policy not in self.searched:
                    raise
                rec = None  # searched again below, once this handler's frames (and buffers) are gone
            if rec is None:
                rec = self._search_again(label, policy, prompt_len, gen_len, num_prompts, kind)
        except Exception as e:  # e.g. a hand-written policy over the budget: recorded, not fatal
            print(f"{label}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if self.out is not None:
                write_jsonl(self.out / "errors.jsonl", [{"label": label, "policy": policy.describe(),
                                                          "error": f"{type(e).__name__}: {e}"}])
            self.llm.drop_engine()  # the next run starts from a clean engine; weights stay resident
            return None
        rec["round"] = self.round
        self.done[key] = rec
        if self.out is not None:
            write_jsonl(self.out / "runs.jsonl", [rec])  # every run as it ends (survives a timeout)
        rec["policy_obj"] = type(policy).from_dict(rec["policy_json"])
        print(table([rec], COLUMNS), flush=True)
        return rec

    def _search_again(self, label: str, policy: Any, prompt_len: int, gen_len: int, num_prompts: int | None,
                      kind: str) -> dict[str, Any]:
        """What `--policy auto` does after running out of GPU memory (the LLM runs searched policies
        as given here, so the search is the benchmark's): search with less of it."""
        from flexoff.api import OOM_RETRIES

        for attempt in range(OOM_RETRIES):
            self.llm.drop_engine()  # the failed run's blocks, now that its frames are gone
            self.llm.leave_more_gpu_memory()
            print(f"{label}: out of GPU memory with {policy.describe()}; searching with "
                  f"{self.llm.gpu_margin / 2**30:.1f} GiB less", file=sys.stderr, flush=True)
            failed, policy = policy.describe(), self.searched[policy]()
            try:
                rec = self._warm_and_measure(label, policy, prompt_len, gen_len, num_prompts, kind)
                return dict(rec, out_of_memory_first=failed, gpu_margin=self.llm.gpu_margin, oom=self.llm.last_oom)
            except GpuOutOfMemoryError:
                if attempt == OOM_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _warm_and_measure(self, label: str, policy: Any, prompt_len: int, gen_len: int, num_prompts: int | None,
                          kind: str) -> dict[str, Any]:
        """The measured run, after the warm-up `--warmup` asks for (of the policy that runs: a
        searched one that ran out of GPU memory warms up its replacement). Predicted and bounded
        with the profile as `--policy auto` plans with it now (calibrated by the runs before)."""
        from flexoff import profiler

        self.hw = profiler.load(*self.hw_source)
        if self.warmup == "each" or (self.warmup == "first" and not self.warmed):
            # kernels compiled and tuned for the policy's shapes, buffers made, memory touched
            short = gen_len if self.warmup == "each" else min(gen_len, WARMUP_TOKENS)
            first = self._measure(f"{label} warm-up", policy, prompt_len, short, num_prompts, "warm-up")
            self.warmed = True
            if self.out is not None:  # recorded apart: how a process's first run differs
                write_jsonl(self.out / "warmups.jsonl", [first])
        return self._measure(label, policy, prompt_len, gen_len, num_prompts, kind)

    def _measure(self, label: str, policy: Any, prompt_len: int, gen_len: int, num_prompts: int | None,
                 kind: str) -> dict[str, Any]:
        from flexoff.policy.cost_model import Workload

        spec = self.llm.model.spec
        n = num_prompts or policy.block_size
        prompts = random_prompts(n, prompt_len, spec.vocab_size, len(label))
        self.llm.policy_arg = policy
        watch = AllocatorWatch()
        t0 = time.perf_counter()
        out = self.llm.generate(prompts, max_new_tokens=gen_len)
        wall = time.perf_counter() - t0
        st = out.stats
        p = policy
        pred = predict(spec, self.hw, p, Workload(prompt_len, gen_len, self.llm.dtype.itemsize, n))
        td = st.traffic_decode
        b = decode_bounds(td.get("h2d", 0), td.get("cpu_attention", 0), self.hw)
        link, bound = b["link"], b["bound"]
        pcie = (st.traffic_prefill.get("h2d", 0) + td.get("h2d", 0)) / self.hw.ctog_bdw
        gib = 2**30
        rec = {"kind": kind, "label": label, "model": self.llm.model.name, "prompt_len": prompt_len,
               "gen_len": gen_len, "num_prompts": n, **self.budgets, "policy": p.describe(), "policy_json": p.to_dict(),
               "prefill_s": st.prefill_s, "decode_s": st.decode_s, "wall_s": wall,
               "gen_tok_s": st.generation_throughput, "decode_tok_s": st.decode_throughput,
               "predicted_prefill_s": pred.prefill_s, "predicted_decode_s": pred.decode_s,
               "predicted_tok_s": pred.throughput, "predicted_bottleneck": pred.bottleneck,
               "measured/predicted": st.generation_throughput / pred.throughput,
               "decode_bound_s": bound, "decode/bound": st.decode_s / bound if bound else None,
               "decode/link_bound": st.decode_s / link if link else None, "decode_host_bound_s": b["host"],
               "decode_cpu_attention_bound_s": b["lane"], "decode_shared_link_bound_s": b["shared"],
               "pcie_bound_s": pcie, **link_use(td, st.decode_s), "decode_alloc_retries": td.get("alloc_retries"),
               "traffic_prefill": st.traffic_prefill, "traffic_decode": td,
               "peak_bytes": st.peak_bytes, "peak_gpu_GiB": st.peak_bytes.get("gpu", 0) / gib,
               "peak_cpu_GiB": st.peak_bytes.get("cpu", 0) / gib, **watch.stats(), "hardware": self.hw.name,
               "priced_cpu_attn_bdw": self.hw.cpu_attn_bdw, **self.env}
        if label in SEARCHED and self.trials.get(policy):  # what choosing it took (not in its times)
            rec["auto_trials"] = self.trials[policy]
            rec["auto_trials_s"] = sum(t["seconds"] for t in self.trials[policy])
        return rec

    def close(self) -> None:
        self.llm.close()


def fractions(p: Any, stash: bool = False) -> dict[str, float]:
    """A policy's placement as the cost model's fractions, as the engine places it: weights by
    bytes, cache, activations (and the training stash) by whole rows of a GPU batch."""
    from flexoff.offload.placement import row_split

    def rows(g: float, c: float, v: str) -> dict[str, float]:
        r = row_split(p.gpu_batch_size, g, c)
        return {f"{v}{t[0]}": r[t] / p.gpu_batch_size for t in ("gpu", "cpu", "disk")}

    out = {"wg": p.w_gpu_percent / 100, "wc": p.w_cpu_percent / 100, "wd": p.w_disk_percent / 100,
           **rows(p.cache_gpu_percent, p.cache_cpu_percent, "c"), **rows(p.act_gpu_percent, p.act_cpu_percent, "h")}
    return {**out, **rows(p.stash_gpu_percent, p.stash_cpu_percent, "s")} if stash else out


def predict(spec: Any, hw: Any, p: Any, work: Any) -> Any:
    """The cost model's prediction for a policy as the engine places it (whole rows)."""
    from flexoff.policy.cost_model import Choice, CostModel

    frac = fractions(p)
    ch = Choice(p.gpu_batch_size, p.num_gpu_batches, p.compress_weight, p.compress_cache,
                p.cpu_cache_compute, p.overlap, p.quant_bits, p.quant_group, p.lora_cache_blocks)
    return CostModel(spec, hw, work, ch).price(frac)


def link_use(traffic: dict[str, Any], seconds: float) -> dict[str, Any]:
    """How busy the engine kept the host-to-device link in decode, and its rate while busy
    (from CUDA events around every copy; absent without CUDA)."""
    busy = traffic.get("h2d_busy_s", 0)
    if not busy or not seconds:
        return {}
    return {"decode_link_busy": busy / seconds, "decode_link_GBps": traffic.get("h2d", 0) / busy / 1e9}


def naive_policies(bench: Bench, prompt_len: int, gen_len: int) -> list[Any]:
    """What a user does without the search: weights in CPU memory, KV cache and activations on the
    GPU, one GPU batch as large as the budget allows (DeepSpeed's and FlexGen's "no policy search");
    the three largest batches the engine's plan accepts, largest first, to step down from if the
    GPU runs out of memory anyway."""
    from flexoff.autopolicy import engine_plan
    from flexoff.errors import MemoryBudgetError
    from flexoff.offload.memory import check
    from flexoff.policy.policy import Policy

    fits = []
    for gbs in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        p = Policy(gbs, 1, 0, 100, 100, 0, 100, 0)
        try:
            check(engine_plan(bench.llm, p, prompt_len, gen_len), bench.llm.options.budgets, bench.llm.device,
                  bench.llm.options.offload_dir)
            fits.append(p)
        except MemoryBudgetError:
            break
    if not fits:
        raise SystemExit("the naive policy does not fit even one sequence")
    return fits[::-1][:3]


WARMUP_TOKENS = 4  # tokens of `--warmup first`'s run: the block's memory is touched whatever the length
ABLATIONS = ("compression", "search", "cpu-attention", "disk", "overlap")  # the slowest (no overlap) last


def ablations(bench: Bench, s: int, n: int, rows: Sequence[str] = ABLATIONS) -> list[dict[str, Any]]:
    """FlexGen's Table 4: the full system, then one optimization off at a time (those of `rows`),
    in one run."""
    def attempt(label: str, make: Any) -> dict[str, Any] | None:
        try:
            p = make()
        except Exception as e:  # a search that finds nothing: logged, and the ablation skipped
            print(f"{label}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return None
        return bench.run(label, p, s, n, kind="ablation")

    full = attempt("all optimizations", lambda: bench.resolve("auto+c", s, n, None))
    if full is None:
        return []
    fp = full["policy_obj"]
    uses_disk = bool(fp.w_disk_percent or fp.cache_disk_percent or fp.act_disk_percent)

    def naive() -> dict[str, Any] | None:
        for p in naive_policies(bench, s, n):  # step down a batch size after running out of memory
            r = bench.run("no policy search", p, s, n, kind="ablation")
            if r is not None or time.time() > bench.deadline:
                return r
        return None

    row = {"compression": lambda: attempt("no compression", lambda: bench.resolve("auto", s, n, None)),
           "search": naive,
           "cpu-attention": lambda: attempt("no CPU attention",
                                            lambda: bench.resolve("auto+c", s, n, None, cpu_attention="off")),
           "disk": lambda: attempt("no disk", lambda: bench.resolve("auto+c", s, n, None, no_disk=True))
           if uses_disk else None,
           "overlap": lambda: attempt("no overlap", lambda: fp.replace(overlap=False))}
    out = [full] + [r for r in (row[k]() for k in ABLATIONS if k in rows) if r is not None]
    for r in out:
        r["ratio_to_full"] = r["gen_tok_s"] / full["gen_tok_s"]
    if "disk" in rows and not uses_disk:
        out.append({**full, "label": "no disk", "same_run_as": "all optimizations",
                    "note": "the full system's policy uses no disk"})
    return out


def frontier(bench: Bench, s: int, n: int, shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The best policy for each block shape, run; latency is the block's prefill + decode."""
    out = []
    for g, b in shapes:
        try:
            p = bench.resolve("auto", s, n, None, shapes=[(g, b)])
        except Exception as e:  # a shape that fits nowhere
            print(f"frontier: {g}x{b} skipped: {e}", file=sys.stderr)
            continue
        r = bench.run(f"block {g}x{b}", p, s, n, kind="frontier")
        if r is not None:
            out.append(r)
    return out


def pareto(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Frontier points: every run of one model and workload, latency = the block's prefill + decode;
    a point is on the Pareto frontier if no faster point has more throughput."""
    out = [dict(r, kind="frontier", latency_s=r["prefill_s"] + r["decode_s"]) for r in runs]
    best = -1.0
    for r in sorted(out, key=lambda r: r["latency_s"]):  # Pareto: no faster point has more throughput
        r["pareto"] = r["gen_tok_s"] > best
        best = max(best, r["gen_tok_s"])
    return out


def short_policy(described: str) -> str:
    """'16x24 (...) [compress_weight, no-overlap]' -> '16x24 4-bit, no overlap'."""
    flags = [f for key, f in (("compress", "4-bit"), ("cpu_cache_compute", "CPU attn"), ("no-overlap", "no overlap"))
             if key in described]
    return described.split(" ")[0] + (" " + ", ".join(flags) if flags else "")


def plot_frontier(points: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: frontier plot skipped (records are in the JSON)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([p["latency_s"] for p in points], [p["gen_tok_s"] for p in points], color="gray", label="runs")
    par = sorted((p for p in points if p["pareto"]), key=lambda p: p["latency_s"])
    ax.plot([p["latency_s"] for p in par], [p["gen_tok_s"] for p in par], "o-", color="C3", label="Pareto frontier")
    for p in points:
        ax.annotate(short_policy(p["policy"]), (p["latency_s"], p["gen_tok_s"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -8))
    ax.set_xlabel("block latency (s)")
    ax.set_ylabel("generation throughput (tokens/s)")
    ax.set_title(f"{points[0]['model']}, {points[0]['prompt_len']}+{points[0]['gen_len']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--prompt-len", type=int, action="append", default=None)
    ap.add_argument("--gen-len", type=int, action="append", default=None)
    ap.add_argument("--policy", action="append", default=None)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--disk-mem", default=None)
    ap.add_argument("--hardware", default=None, help="profile file or preset for predictions (default: this machine)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--ablations", nargs="?", const=",".join(ABLATIONS), default=None, metavar="ROWS",
                    help=f"the full system and each optimization off in turn; ROWS picks some of {','.join(ABLATIONS)}")
    ap.add_argument("--frontier", default=None, help="shapes, e.g. 1x1,8x1,32x1,32x2,48x2")
    ap.add_argument("--baseline", type=int, default=None, metavar="BATCH", help="Accelerate baseline batch size")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, the whole suite")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds after which no new run starts")
    ap.add_argument("--warmup", nargs="?", const="each", choices=("each", "first"), default=None,
                    help="each: run each policy once, unrecorded, before its run; first: a short unrecorded "
                         f"run ({WARMUP_TOKENS} tokens) of the first policy only")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the --policy list this many times over in one process, each run measured "
                         "afresh (a searched policy searched again, with the rates the runs before kept)")
    ap.add_argument("--no-flexoff", action="store_true", help="only the baseline")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--replot", type=Path, nargs="+", default=None, metavar="RECORDS",
                    help="draw the frontier from runs already recorded (JSON lines), running nothing")
    args = ap.parse_args(argv)
    from flexoff.cli import parse_size

    if args.smoke:
        return smoke(args.out)
    if args.replot:
        return replot(args.replot, args.out)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    if args.ablations:
        args.ablations = args.ablations.split(",")
        if unknown := set(args.ablations) - set(ABLATIONS):
            raise SystemExit(f"--ablations: unknown rows {sorted(unknown)}; choose from {','.join(ABLATIONS)}")
    deadline = time.time() + args.time_budget if args.time_budget else float("inf")
    models = args.model or ["dummy:opt-6.7b"]
    records: list[dict[str, Any]] = []
    for model in models:
        if not args.no_flexoff:
            bench = Bench(model, parse_size(args.gpu_mem), parse_size(args.cpu_mem), parse_size(args.disk_mem),
                          args.hardware, args.dtype, args.device, args.offload_dir, args.out, deadline)
            bench.warmup = args.warmup
            try:
                for s in args.prompt_len or [512]:
                    for n in args.gen_len or [32]:
                        records += sweep(bench, args, model, s, n)
            finally:
                bench.close()
        if args.baseline:
            records += baseline(model, args, records)
    finish(records, args.out)
    return 0


def sweep(bench: Bench, args: argparse.Namespace, model: str, s: int, n: int) -> list[dict[str, Any]]:
    """The policies, ablations and frontier shapes asked for, at one workload; the frontier
    is drawn from every run of the workload."""
    out = []
    for round_ in range(args.rounds):
        bench.round = round_
        if round_:
            bench.done.clear()  # measured afresh, not taken from the round before
        for text in args.policy or []:
            if time.time() > bench.deadline:
                print(f"skipped {text}: past the time budget", file=sys.stderr, flush=True)
                continue
            try:
                p = bench.resolve(parse_policy(text), s, n, None)
            except Exception as e:
                print(f"{text}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            r = bench.run(text, p, s, n)
            if r is not None:
                out.append(r)
    if args.ablations:
        out += ablations(bench, s, n, args.ablations)
    if args.frontier:
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.frontier.split(",")]
        frontier(bench, s, n, shapes)
    runs = list({id(r): r for r in bench.done.values() if r["prompt_len"] == s and r["gen_len"] == n}.values())
    if args.frontier and runs:
        pts = pareto(runs)
        out += pts
        plot_frontier(pts, args.out / f"frontier-{model.replace(':', '_')}-{s}-{n}.png")
    return out


def baseline(model: str, args: argparse.Namespace, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from baseline import accelerate_run
    from flexoff.api import pick_device, pick_dtype
    from flexoff.cli import parse_size

    dtype = pick_dtype(args.dtype, pick_device(args.device))
    out = []
    for s in args.prompt_len or [512]:
        for n in args.gen_len or [32]:
            r = accelerate_run(model, s, n, args.baseline, parse_size(args.gpu_mem), parse_size(args.cpu_mem), dtype)
            ours = [x for x in records if x["model"] == model and x["prompt_len"] == s and x["gen_len"] == n]
            best = max(ours, key=lambda x: x["gen_tok_s"]) if ours else None
            out.append({"kind": "baseline", "label": f"accelerate batch {args.baseline}", "model": model,
                        "prompt_len": s, "gen_len": n, "gpu_mem": parse_size(args.gpu_mem), **r,
                        "gen_tok_s": r["generation_throughput"],
                        "flexoff_best_tok_s": best["gen_tok_s"] if best else None,
                        "flexoff_best_policy": best["policy"] if best else None,
                        "flexoff/accelerate": best["gen_tok_s"] / r["generation_throughput"] if best else None,
                        **environment()})
    return out


def finish(records: list[dict[str, Any]], out: Path) -> None:
    records = [{k: v for k, v in r.items() if k != "policy_obj"} for r in records]
    write_jsonl(out / "throughput.jsonl", records)
    runs = [r for r in records if r["kind"] != "baseline"]
    if runs:
        print(table(runs, COLUMNS + ["ratio_to_full"]))
    base = [r for r in records if r["kind"] == "baseline"]
    if base:
        print(table(base, ["label", "model", "gen_tok_s", "flexoff_best_tok_s", "flexoff/accelerate", "placement"]))
    print(f"{len(records)} records appended to {out / 'throughput.jsonl'}")


def replot(files: list[Path], out: Path) -> int:
    """The frontier of recorded runs of one model and workload (each policy once, first record
    kept), drawn and tabled, for runs spread over several device calls."""
    import json

    runs: dict[tuple, dict[str, Any]] = {}
    for f in files:
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") in ("run", "ablation", "frontier") and "gen_tok_s" in r and "same_run_as" not in r:
                runs.setdefault((r["model"], r["prompt_len"], r["gen_len"], r["policy"]), r)
    workloads = {k[:3] for k in runs}
    if len(workloads) != 1:
        raise SystemExit(f"--replot needs runs of one model and workload; found {sorted(workloads)}")
    pts = pareto(list(runs.values()))
    model, s, n = workloads.pop()
    out.mkdir(parents=True, exist_ok=True)
    plot_frontier(pts, out / f"frontier-{model.replace(':', '_')}-{s}-{n}.png")
    print(table(sorted(pts, key=lambda p: p["latency_s"]),
                ["label", "policy", "latency_s", "gen_tok_s", "pareto", "commit"]))
    return 0


def smoke(out: Path) -> int:
    """The whole suite on a tiny model on the CPU: matrix, ablations, frontier, baseline."""
    import tempfile

    from flexoff import profiler
    from flexoff.policy import hardware as hwmod

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="flexoff-smoke-"))
    hw = profiler.measure(str(tmp), quick=True)
    hwmod.save(hw, tmp / "hw.json")
    model, s, n = "dummy:llama-tiny", 48, 8
    kw = dict(gpu_mem=2 << 20, cpu_mem=8 << 20, disk_mem=1 << 30)
    bench = Bench(model, kw["gpu_mem"], kw["cpu_mem"], kw["disk_mem"], str(tmp / "hw.json"), "float32", "cpu", str(tmp),
                  out)
    records = []
    try:
        for text in ("auto", "4x2:0,100,0,100,100,0:a", "2x2:30,40,0,50,0,100:wk"):
            records.append(bench.run(text, bench.resolve(parse_policy(text), s, n, None), s, n))
        records = [r for r in records if r is not None]
        records += ablations(bench, s, n)
        frontier(bench, s, n, [(1, 1), (4, 1), (4, 4)])
        pts = pareto(list(bench.done.values()))
        records += pts
        plot_frontier(pts, out / "frontier-smoke.png")
    finally:
        bench.close()
    from baseline import accelerate_run

    r = accelerate_run(model, s, n, 4, None, None, torch.float32)
    best = max(records, key=lambda x: x["gen_tok_s"])
    records.append({"kind": "baseline", "label": "accelerate batch 4", "model": model, "prompt_len": s, "gen_len": n,
                    **r, "gen_tok_s": r["generation_throughput"], "flexoff_best_tok_s": best["gen_tok_s"],
                    "flexoff/accelerate": best["gen_tok_s"] / r["generation_throughput"], **environment()})
    finish(records, out)
    print(f"smoke suite took {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
