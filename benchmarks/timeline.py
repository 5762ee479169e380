"""Where decode time goes: a run under torch.profiler, summarized per CUDA stream and CPU thread.

    python benchmarks/timeline.py --model dummy:opt-30b --prompt-len 512 --gen-len 4 --gpu-mem 16GiB \\
        --cpu-mem 100GiB --policy "24x2:0,100,0,100,100,0:a" [--hardware FILE] [--out benchmarks/out]

The policy runs once to set up (weights placed, buffers pinned), then once more under the profiler.
Over the decode window (from the end of the prefill's token step to the last event; with `--window
prefill`, up to it) it reports how busy each direction of the host-device link, each GPU stream and
each CPU thread was, the longest gaps in host-to-device copies (with the copy that ended each, how
long it had been queued, and the GPU's kernel time in the gap), how long each stream's copies
waited to start, the CUDA runtime calls that took the host the most time, the kernels that took
the most GPU time, and kernels per engine step (a layer of a GPU batch). `--layers N` cuts the
model to its first N blocks. Writes OUT/trace-summary.json and, when small enough, OUT/trace.json.gz,
else the device side alone as OUT/trace-device.json.gz (open it in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from common import AllocatorWatch, environment, table, write_jsonl
from memcheck import cut_model
from throughput import Bench, parse_policy

from flexoff.offload.lanes import LANE_MARK, mark_lanes

MAX_TRACE = 15 << 20  # bytes of compressed trace worth keeping


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def busy(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(spans))


def summarize(trace: dict[str, Any], window: str = "decode") -> dict[str, Any]:
    """Busy fractions per link direction, GPU stream and CPU thread over the window (decode: from
    the end of the prefill's token step to the last event; prefill: up to that end), the longest
    host-to-device idle gaps (h2d_gaps) and the GPU kernels that took the most time in it."""
    events = trace.get("traceEvents", [])
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    for e in spans:  # a worker thread is named by the engine lane whose work it runs
        if str(e.get("name", "")).startswith(LANE_MARK):
            names[e.get("tid")] = str(e["name"])[len(LANE_MARK):]
    marks = sorted(e["ts"] + e["dur"] for e in spans if str(e.get("name", "")).startswith("flexoff: token step 0"))
    if not spans:
        return {"error": "no events recorded"}
    first, last = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    lo, hi = (first, marks[0] if marks else last) if window == "prefill" else (marks[0] if marks else first, last)
    width = max(hi - lo, 1e-9)
    groups: dict[str, list[tuple[float, float]]] = {}
    for e in spans:
        cat, name = e.get("cat", ""), str(e.get("name", ""))
        if cat == "gpu_memcpy":
            key = "link " + ("host to device" if "HtoD" in name else "device to host" if "DtoH" in name else "on device")
        elif cat == "kernel":
            key = f"GPU stream {e.get('args', {}).get('stream', e.get('tid'))}"
        elif cat == "cpu_op":
            key = f"CPU thread {names.get(e.get('tid'), e.get('tid'))}"
        elif name.startswith(LANE_MARK):  # a lane's tasks, Python and GIL waits included
            key = f"lane {name[len(LANE_MARK):]}"
        else:
            continue
        groups.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"]))
    rows = [{"what": k, "busy": busy(clip(v, lo, hi)) / width, "events": len(clip(v, lo, hi))}
            for k, v in sorted(groups.items())]
    gaps = h2d_gaps(spans, events, lo, hi)
    kernels: dict[str, float] = {}
    launched = 0
    for e in spans:
        if e.get("cat") == "kernel" and lo <= e["ts"] < hi:
            name = str(e.get("name", ""))[:80]
            kernels[name] = kernels.get(name, 0.0) + e["dur"]
            launched += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"window": window, "window_us": width, "rows": rows, "runtime_calls": runtime_calls(spans, lo, hi),
            "kernels": launched, "kernel_us": sum(kernels.values()),
            "h2d_gaps_us": gaps,
            "copy_waits_us": copy_waits(events, lo, hi),
            "kernels_us": [{"kernel": k, "us": v, "share": v / width} for k, v in top]}


def h2d_gaps(spans: list[dict[str, Any]], events: list[dict[str, Any]], lo: float, hi: float,
             top: int = 10) -> list[dict[str, Any]]:
    """The longest idle stretches of host-to-device copies in the window, longest first: how long
    (`gap`) and when (`at`, from the window's start), the copy that ended it (its stream and
    bytes, and how long it had been queued: from the host's call to its start, where the trace
    matches them), and the GPU's kernel time within the gap. A copy queued long before shows a
    copy held up on its stream or by an event; one just queued, a host that was not ahead."""
    copies = sorted((e for e in spans if e.get("cat") == "gpu_memcpy" and "HtoD" in str(e.get("name", ""))
                     and e["ts"] + e["dur"] > lo and e["ts"] < hi), key=lambda e: e["ts"])
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "kernel"]
    out, end = [], None
    for e in copies:
        if end is not None and e["ts"] > end:
            args = e.get("args", {})
            call = calls.get(args.get("correlation"))
            out.append({"gap": e["ts"] - end, "at": end - lo, "next_stream": args.get("stream", e.get("tid")),
                        "next_bytes": args.get("bytes"),
                        "next_queued": e["ts"] - (call["ts"] + call["dur"]) if call else None,
                        "kernel_us": busy(clip(kernels, end, e["ts"]))})
        end = max(end if end is not None else e["ts"], e["ts"] + e["dur"])
    return sorted(out, key=lambda g: -g["gap"])[:top]


def runtime_calls(spans: list[dict[str, Any]], lo: float, hi: float, top: int = 12) -> list[dict[str, Any]]:
    """The CUDA runtime calls that took the most host time in the window, per name: how many and
    how long in all (cudaMalloc, cudaFree and synchronizations stall the thread that calls them)."""
    calls: dict[str, list[float]] = {}
    for e in spans:
        if e.get("cat") == "cuda_runtime" and lo <= e["ts"] < hi:
            calls.setdefault(str(e.get("name", "")), []).append(e["dur"])
    rows = [{"call": k, "count": len(v), "total_us": sum(v), "max_us": max(v)} for k, v in calls.items()]
    return sorted(rows, key=lambda r: -r["total_us"])[:top]


def slim(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace's device side only: kernels, copies and memsets, thread names, lane and token-step
    marks (a whole model's decode records far more host ops than a trace file can keep)."""
    keep = ("kernel", "gpu_memcpy", "gpu_memset")
    return {"traceEvents": [e for e in trace.get("traceEvents", [])
                            if e.get("cat") in keep or e.get("ph") == "M"
                            or str(e.get("name", "")).startswith((LANE_MARK, "flexoff: token step"))]}


def per_step(summary: dict[str, Any], steps: int) -> dict[str, Any]:
    """Kernels and their device time per engine step (a layer of a GPU batch) in the window."""
    if steps <= 0 or "kernels" not in summary:
        return {}
    return {"steps": steps, "kernels_per_step": summary["kernels"] / steps,
            "kernel_us_per_step": summary["kernel_us"] / steps}


def copy_waits(events: list[dict[str, Any]], lo: float, hi: float) -> list[dict[str, Any]]:
    """Per stream and direction, how long copies started in the window waited between the host
    call that queued them and their start on the GPU (matched by correlation id): a small copy
    queued behind another stream's copies shows here (CPU attention's output did, 5-15 ms)."""
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    waits: dict[tuple[Any, str], list[float]] = {}
    for e in events:
        c = calls.get(e.get("args", {}).get("correlation")) if e.get("cat") == "gpu_memcpy" else None
        if c is None or not lo <= e["ts"] < hi:
            continue
        kind = "HtoD" if "HtoD" in e["name"] else "DtoH" if "DtoH" in e["name"] else "other"
        waits.setdefault((e.get("tid"), kind), []).append(max(0.0, e["ts"] - (c["ts"] + c["dur"])))
    return [{"stream": sid, "copy": kind, "copies": len(w), "median": sorted(w)[len(w) // 2],
             "mean": sum(w) / len(w), "max": max(w)} for (sid, kind), w in sorted(waits.items(), key=str)]


def all_threads() -> Any:
    """Kineto's setting that records ops on every thread (the engine's lanes are threads started
    before profiling, which it otherwise leaves out), where this torch has it."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:opt-30b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=4)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--hardware", default=None)
    ap.add_argument("--layers", type=int, default=None, help="cut the model to its first LAYERS blocks")
    ap.add_argument("--window", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from flexoff.cli import parse_size

    cut = tempfile.TemporaryDirectory()
    model = cut_model(args.model, args.layers, Path(cut.name)) if args.layers else args.model
    bench = Bench(model, parse_size(args.gpu_mem), parse_size(args.cpu_mem), None, args.hardware, "auto",
                  "auto", None)
    try:
        policy = bench.resolve(parse_policy(args.policy), args.prompt_len, args.gen_len, None)
        spec = bench.llm.model.spec
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_ids": torch.randint(3, spec.vocab_size, (args.prompt_len,), generator=g).tolist()}
                   for _ in range(policy.block_size)]
        bench.llm.policy_arg = policy
        bench.llm.generate(prompts, max_new_tokens=args.gen_len)  # set-up run
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        mark_lanes(True)
        watch = AllocatorWatch()
        with profile(activities=acts, experimental_config=all_threads()) as prof:
            bench.llm.generate(prompts, max_new_tokens=args.gen_len)
        mark_lanes(False)
        allocator = watch.stats()
    finally:
        bench.close()
        cut.cleanup()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
    trace = json.loads(raw)
    summary = summarize(trace, args.window)
    token_steps = args.gen_len - 1 if args.window == "decode" else 1
    summary.update(per_step(summary, token_steps * len(spec.layers) * policy.num_gpu_batches))
    args.out.mkdir(parents=True, exist_ok=True)
    packed = gzip.compress(raw)
    if len(packed) <= MAX_TRACE:
        (args.out / "trace.json.gz").write_bytes(packed)
    else:  # too large whole: the device side alone, where that fits
        packed = gzip.compress(json.dumps(slim(trace)).encode())
        if len(packed) <= MAX_TRACE:
            (args.out / "trace-device.json.gz").write_bytes(packed)
    record = {**environment(), "policy": policy.describe(), "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "layers": args.layers, **allocator, **summary}
    write_jsonl(args.out / "trace-summary.jsonl", [record])
    print(f"{policy.describe()}: {args.window} window {summary.get('window_us', 0) / 1e3:.1f} ms,",
          f"{summary.get('kernels_per_step', 0):.1f} kernels and {summary.get('kernel_us_per_step', 0):.0f} us of",
          "them per engine step;", ", ".join(f"{k} {v:.3g}" for k, v in allocator.items()))
    print(table(summary.get("rows", []), ["what", "busy", "events"]))
    print(table(summary.get("h2d_gaps_us", []), ["gap", "at", "next_stream", "next_bytes", "next_queued", "kernel_us"]))
    print(table(summary.get("runtime_calls", []), ["call", "count", "total_us", "max_us"]))
    print(table(summary.get("copy_waits_us", []), ["stream", "copy", "copies", "median", "mean", "max"]))
    print(table(summary.get("kernels_us", []), ["kernel", "us", "share"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
