"""The engine's CPU attention lane per call, against the rows (and bytes) a call reads: a fit of
the lane's seconds per call to a fixed cost plus the call's bytes over a rate.

    python benchmarks/cpu_lane.py --model dummy:opt-30b --layers 8 --block 48 --gbs 4,8,12,16,24,48 \\
        --gpu-mem 16GiB --cpu-mem 100GiB [--hardware FILE] [--out benchmarks/out]
    python benchmarks/cpu_lane.py --fit RECORDS.jsonl     # the fit alone, from earlier runs

Each run is a full decode (`throughput.py`'s, the model cut to its first `--layers` blocks) of one
block of `--block` rows split into GPU batches of each size in `--gbs`, with the KV cache all in
CPU memory and CPU attention, the hidden states on the GPU, and the weights all on the GPU
(`--weights gpu`: the link idle) or all in CPU memory (`cpu`: the link busy through the decode, as
offloaded policies run). Per run: calls per (attention, MLP) pair, the lane's milliseconds per
call, the megabytes a call reads, the rate over the lane's busy time, and the link's busy share.
Per weights placement, the least-squares line lane seconds per call = fixed + bytes / rate: the
cost model's CPU_ATTN_CALL_S (the fixed part beside the link busy) and what the profile's
`cpu_attn_bdw` should read. Writes OUT/cpu-lane.jsonl (the runs) and OUT/cpu-lane-fit.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from common import table, write_jsonl

WEIGHTS = {"gpu": "100,0", "cpu": "0,100"}  # weights' (GPU, CPU) percent


def lane_row(rec: dict[str, Any], layers: int) -> dict[str, Any]:
    """One run's CPU attention lane per call, from its record's decode traffic."""
    td = rec["traffic_decode"]
    calls, busy, read = td["cpu_attention_calls"], td["cpu_attention_compute_s"], td["cpu_attention"]
    steps = rec["gen_len"] - 1
    return {"policy": rec["policy"], "weights": "gpu" if rec["policy_json"]["w_gpu_percent"] == 100 else "cpu",
            "rows": rec["policy_json"]["gpu_batch_size"], "calls_per_pair": calls / (layers * steps),
            "lane_ms_per_call": 1e3 * busy / calls, "MB_per_call": read / calls / 1e6,
            "lane_GBps": read / busy / 1e9, "link_busy": td.get("h2d_busy_s", 0) / rec["decode_s"],
            "pair_ms": 1e3 * rec["decode_s"] / (layers * steps)}


def fit(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Least squares of lane seconds per call on bytes per call: the fixed seconds a call and the
    rate (bytes/s); None with fewer than two distinct call sizes."""
    xs = [r["MB_per_call"] * 1e6 for r in rows]
    ys = [r["lane_ms_per_call"] / 1e3 for r in rows]
    if len(set(xs)) < 2:
        return None
    slope, fixed = statistics.linear_regression(xs, ys)
    resid = [1e3 * (y - fixed - slope * x) for x, y in zip(xs, ys)]
    return {"fixed_ms": 1e3 * fixed, "rate_GBps": 1 / slope / 1e9 if slope > 0 else None,
            "runs": len(xs), "max_abs_residual_ms": max(abs(r) for r in resid)}


def report(rows: Sequence[dict[str, Any]], out: Path | None) -> dict[str, Any]:
    """Print the runs and the fit per weights placement; write them under out."""
    print(table(rows, ["policy", "rows", "calls_per_pair", "lane_ms_per_call", "MB_per_call", "lane_GBps",
                       "link_busy", "pair_ms"]), flush=True)
    fits = {w: fit([r for r in rows if r["weights"] == w]) for w in sorted({r["weights"] for r in rows})}
    for w, f in fits.items():
        where = "link busy (weights in CPU memory)" if w == "cpu" else "link idle (weights on the GPU)"
        print(f"{where}: " + ("too few call sizes to fit" if f is None else
                              f"{f['fixed_ms']:.3f} ms a call + bytes at "
                              + (f"{f['rate_GBps']:.1f} GB/s " if f["rate_GBps"] else "no positive rate ")
                              + f"({f['runs']} runs, largest residual {f['max_abs_residual_ms']:.2f} ms)"))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_jsonl(out / "cpu-lane.jsonl", rows)
        (out / "cpu-lane-fit.json").write_text(json.dumps(fits, indent=1) + "\n")
    return fits


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:opt-30b")
    ap.add_argument("--layers", type=int, default=8, help="cut the model to its first LAYERS blocks")
    ap.add_argument("--block", type=int, default=48, help="rows of the block (every GPU batch size divides it)")
    ap.add_argument("--gbs", default="4,8,12,16,24,48", help="GPU batch sizes, comma-separated")
    ap.add_argument("--weights", default="gpu,cpu", help="where the weights go: gpu, cpu or both")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--hardware", default=None, help="profile file or preset (the records' predictions only)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds after which no new run starts")
    ap.add_argument("--fit", type=Path, default=None, metavar="RECORDS", help="fit throughput.py records instead")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args(argv)
    if args.fit is not None:
        recs = [json.loads(line) for line in args.fit.read_text().splitlines() if line.strip()]
        report([lane_row(r, args.layers) for r in recs if r.get("traffic_decode", {}).get("cpu_attention_calls")],
               args.out)
        return 0

    from flexoff.cli import parse_size
    from memcheck import cut_model
    from throughput import Bench, parse_policy

    sizes = [int(g) for g in args.gbs.split(",")]
    if bad := [g for g in sizes if g <= 0 or args.block % g]:
        raise SystemExit(f"--gbs: {bad} do not divide --block {args.block}")
    places = args.weights.split(",")
    if unknown := set(places) - set(WEIGHTS):
        raise SystemExit(f"--weights: unknown {sorted(unknown)}; choose from gpu, cpu")
    deadline = time.time() + args.time_budget if args.time_budget else float("inf")
    rows = []
    with tempfile.TemporaryDirectory() as cut:
        bench = Bench(cut_model(args.model, args.layers, Path(cut)), parse_size(args.gpu_mem),
                      parse_size(args.cpu_mem), None, args.hardware, "auto", args.device, None,
                      None, deadline)
        bench.warmup = "first"
        try:
            for g in sizes:
                for w in places:
                    text = f"{g}x{args.block // g}:{WEIGHTS[w]},0,100,100,0:a"
                    rec = bench.run(text, parse_policy(text), args.prompt_len, args.gen_len)
                    if rec is not None:
                        rows.append(dict(lane_row(rec, args.layers), record={
                            k: v for k, v in rec.items() if k != "policy_obj"}))
        finally:
            bench.close()
    if not rows:
        print("no run finished", file=sys.stderr)
        return 1
    report(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
