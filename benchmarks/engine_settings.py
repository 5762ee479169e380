"""Policies under several engine settings, in one process on the same resident weights: where
an offloaded decode spends its time as a setting changes.

    python benchmarks/engine_settings.py --model dummy:opt-30b --layers 12 --prompt-len 512 --gen-len 32 \\
        --gpu-mem 16GiB --cpu-mem 100GiB --policy "24x3:0,100,16.67,79.17,25,75:a" \\
        --set FLEXOFF_CPU_THREADS=8 --set FLEXOFF_CPU_THREADS=12 --set FLEXOFF_CPU_THREADS=16

A setting is NAME=VALUE[,NAME=VALUE...] of environment variables the engine reads when it is
built (FLEXOFF_CPU_THREADS, FLEXOFF_CUDA_GRAPHS, FLEXOFF_FUSED_KERNELS, FLEXOFF_PACE,
FLEXOFF_CACHE_AHEAD, FLEXOFF_CPU_KERNEL, FLEXOFF_HOST_AHEAD, FLEXOFF_HOLD_STORES,
FLEXOFF_JOIN_ON_COMPUTE, FLEXOFF_KEEP_STEPS, FLEXOFF_LOAD_SLOTS, FLEXOFF_STEP_SLOTS,
FLEXOFF_WEIGHT_SLOTS, FLEXOFF_WEIGHTS_STREAM); `--set default` changes nothing. Every (policy,
setting) pair runs `--repeat` times, settings interleaved, after one warm-up run. `--layers`
cuts the model to its first blocks (a layer's rates do not depend on how many follow it). Prints
a table and appends records to OUT/engine-settings.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import table, write_jsonl
from memcheck import cut_model
from throughput import Bench, parse_policy

COLUMNS = ["policy", "setting", "prefill_s", "decode_s", "gen_tok_s", "measured/predicted", "decode/bound",
           "link_busy", "link_GBps", "cpu_attn_GBps", "cpu_attn_busy", "wait_cpu_s", "disk_GBps", "alloc_retries",
           "peak_alloc_GiB", "peak_active_GiB", "peak_reserved_GiB", "hold_waits"]


def apply(setting: str) -> None:
    """Set the environment variables of one setting."""
    for part in filter(None, "" if setting == "default" else setting.split(",")):
        name, _, value = part.partition("=")
        os.environ[name.strip()] = value.strip()


def summary(rec: dict[str, Any], setting: str) -> dict[str, Any]:
    """The columns of one run: link and CPU-attention rates in decode, from the engine's counters."""
    td, dec = rec["traffic_decode"], rec["decode_s"]
    cpu_s = td.get("cpu_attention_compute_s", 0.0)
    return {"policy": rec["policy"].split(" [")[0], "setting": setting, "prefill_s": rec["prefill_s"],
            "decode_s": dec, "gen_tok_s": rec["gen_tok_s"], "measured/predicted": rec["measured/predicted"],
            "decode/bound": rec["decode/bound"], "alloc_retries": rec.get("alloc_retries"),
            "link_busy": rec.get("decode_link_busy"), "link_GBps": rec.get("decode_link_GBps"),
            "cpu_attn_GBps": td.get("cpu_attention", 0) / cpu_s / 1e9 if cpu_s else None,
            "cpu_attn_busy": cpu_s / dec if dec else None, "wait_cpu_s": td.get("wait_cpu_attention_s"),
            "disk_GBps": td.get("disk_read", 0) / dec / 1e9 if dec else None,
            "peak_alloc_GiB": rec.get("peak_allocated_GiB"), "peak_active_GiB": rec.get("peak_active_GiB"),
            "peak_reserved_GiB": rec.get("peak_reserved_GiB"),
            "hold_waits": rec["traffic_prefill"].get("store_hold_waits", 0) + td.get("store_hold_waits", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:opt-30b")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to its first LAYERS blocks")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--policy", action="append", required=True)
    ap.add_argument("--set", action="append", default=None, dest="settings", metavar="NAME=VALUE,...")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--hardware", default=None)
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    from flexoff.cli import parse_size

    settings = args.settings or ["default"]
    names = {p.partition("=")[0].strip() for s in settings if s != "default" for p in filter(None, s.split(","))}
    base = {n: os.environ.get(n) for n in names}
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = cut_model(args.model, args.layers, Path(tmp)) if args.layers else args.model
        bench = Bench(model, parse_size(args.gpu_mem), parse_size(args.cpu_mem), None, args.hardware, "auto",
                      "auto", args.offload_dir)
        try:
            for text in args.policy:
                policy = bench.resolve(parse_policy(text), args.prompt_len, args.gen_len, None)
                bench._measure("warm-up", policy, args.prompt_len, args.gen_len, None, "warm-up")
                for r in range(args.repeat):
                    for setting in settings:
                        for n, v in base.items():  # back to the process's own values, then this setting's
                            if v is None:
                                os.environ.pop(n, None)
                            else:
                                os.environ[n] = v
                        apply(setting)
                        bench.llm.drop_engine()  # settings are read when an engine is built
                        rec = bench._measure(f"{text} {setting}", policy, args.prompt_len, args.gen_len, None,
                                             "setting")
                        row = summary(rec, setting)
                        rows.append(row)
                        write_jsonl(args.out / "engine-settings.jsonl",
                                    [{**rec, "setting": setting, "repeat": r, "layers": args.layers, **row}])
                        print(table([row], COLUMNS), flush=True)
        finally:
            bench.close()
    print(table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
