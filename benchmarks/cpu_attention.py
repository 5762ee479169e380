"""Decode attention on the CPU over a CPU-resident KV cache: layouts and dtypes against the
machine's memory bandwidth. Decides how flexoff lays out rows that CPU attention reads.

    python benchmarks/cpu_attention.py [--rows 48 --heads 56 --head-dim 128 --tokens 544]
    python benchmarks/cpu_attention.py --contention 4,8,12,16   # with host-to-device copies running

--contention measures, for each CPU-attention thread count, attention alone, and attention and
pinned host-to-device copies (the engine's weight stream) running at the same time: both draw on
host memory bandwidth.

    python benchmarks/cpu_attention.py --rows 19 --tokens 528 --neighbours 8,12   # needs CUDA

--neighbours THREADS runs the engine's own call (`attend_cached` over a HeadMajorKV cache in
registered host memory, a new token written per call; torch's matmuls, and the compiled kernel
of flexoff.kernels.cpu_attention) on each thread count beside what runs next to it in an
offloaded decode: host-to-device copies, and other threads waiting on the GPU, either spinning
(a CUDA event's default synchronize) or sleeping (a blocking event).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from common import environment, table, write_jsonl

from flexoff.kernels import cpu_attention as cpu_kernel
from flexoff.policy.hardware import host_copy_bandwidth


def timed(fn, repeat: int = 5) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def h2d_copies(src: torch.Tensor, dst: torch.Tensor, stream: "torch.cuda.Stream",
               going: Callable[[], bool]) -> float:
    """Pinned src to device dst in 32 MB copies on `stream`, again while `going()`: GB/s."""
    chunk, n, t0 = 32 << 20, 0, time.perf_counter()
    while going():
        with torch.cuda.stream(stream):
            for off in range(0, src.numel(), chunk):
                dst[off:off + chunk].copy_(src[off:off + chunk], non_blocking=True)
        stream.synchronize()
        n += src.numel()
    return n / max(time.perf_counter() - t0, 1e-9) / 1e9


def contention(threads: list[int], b: int, h: int, d: int, t: int, seconds: float = 1.5) -> list[dict]:
    """Attention (head-major fp16) and 32 MB host-to-device copies of a pinned 1 GiB buffer,
    each alone and both at once, per attention thread count."""
    from flexoff.models.attention import attend

    q = torch.randn(b, h, 1, d).half()
    hm = torch.randn(2, b, h, t, d).half()
    mask = torch.ones(b, 1, t, dtype=torch.bool)
    kv_bytes = 2 * b * h * t * d * 2
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def h2d_for(stop: threading.Event | None, until: float) -> float:
        return h2d_copies(src, dst, stream, lambda: time.perf_counter() < until and not (stop and stop.is_set()))

    def attention_for(nthreads: int, until: float, out: list) -> None:
        torch.set_num_threads(nthreads)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() < until:
            attend(q, hm[0], hm[1], mask, d**-0.5)
            n += 1
        out.append(n * kv_bytes / (time.perf_counter() - t0) / 1e9)

    alone_h2d = h2d_for(None, time.perf_counter() + seconds)
    rows = [{"threads": 0, "attention alone GB/s": 0.0, "h2d alone GB/s": alone_h2d}]
    for n in threads:
        res: list = []
        th = threading.Thread(target=attention_for, args=(n, time.perf_counter() + seconds, res))
        th.start()
        th.join()
        alone = res.pop()
        th = threading.Thread(target=attention_for, args=(n, time.perf_counter() + seconds, res))
        th.start()
        both_h2d = h2d_for(None, time.perf_counter() + seconds - 0.1)
        th.join()
        rows.append({"threads": n, "attention alone GB/s": alone, "attention with h2d GB/s": res.pop(),
                     "h2d alone GB/s": alone_h2d, "h2d with attention GB/s": both_h2d})
        rows[-1]["sum GB/s"] = rows[-1]["attention with h2d GB/s"] + both_h2d
    return rows


def _without_kernel(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with flexoff's compiled CPU attention kernel turned off (the torch path)."""
    old = os.environ.get("FLEXOFF_CPU_KERNEL")
    os.environ["FLEXOFF_CPU_KERNEL"] = "0"
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ["FLEXOFF_CPU_KERNEL"]
        else:
            os.environ["FLEXOFF_CPU_KERNEL"] = old


def neighbours(thread_counts: list[int], b: int, h: int, d: int, t: int, waiters: int = 3,
               seconds: float = 1.5) -> list[dict]:
    """The engine's CPU-attention call's KV GB/s beside copies and waiting threads (see the module),
    through torch's matmuls and through the compiled kernel, per thread count."""
    from flexoff.models.attention import attend, attend_cached
    from flexoff.offload.kvcache import HeadMajorKV
    from flexoff.offload.tiers import pinned_empty

    gen = 32
    codec = HeadMajorKV(h, d, torch.float16, t, gen)
    owner = type("Owner", (), {})()
    buf = pinned_empty(b * t * codec.rec_bytes + b * gen * codec.rec_bytes, torch.uint8, owner)
    buf.view(torch.float16).normal_()
    prompt, generated = codec.prompt(buf, b, t), codec.generated(buf, b, b)
    plain = torch.randn(2, b, h, t, d).half()
    q, new = torch.randn(b, h, 1, d).half(), (torch.randn(b, h, 1, d).half(), torch.randn(b, h, 1, d).half())
    mask = torch.ones(b, 1, t + 1, dtype=torch.bool)
    kv_bytes = 2 * b * h * t * d * 2
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    calls = {"attend, plain memory": lambda: attend(q, plain[0], plain[1], mask[..., :t], d**-0.5),
             "attend_cached torch, registered": lambda: _without_kernel(
                 attend_cached, q, prompt, generated, new, 0, mask, d**-0.5)}
    if cpu_kernel.build():
        calls["attend_cached kernel, registered"] = lambda: attend_cached(q, prompt, generated, new, 0, mask,
                                                                          d**-0.5)

    def copies(stop: threading.Event) -> None:
        h2d_copies(src, dst, torch.cuda.Stream(), lambda: not stop.is_set())

    def waiter(blocking: bool) -> Callable[[threading.Event], None]:
        def run(stop: threading.Event) -> None:  # waits on GPU work that takes about 2 ms, again and again
            stream = torch.cuda.Stream()
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(2_000_000)
                    ev = torch.cuda.Event(blocking=blocking)
                    ev.record()
                ev.synchronize()
        return run

    def rate(fn: Callable[[], Any], side: list[Callable[[threading.Event], None]], nthreads: int) -> float:
        stop = threading.Event()
        others = [threading.Thread(target=f, args=(stop,)) for f in side]
        for th in others:
            th.start()
        res: list = []

        def attention() -> None:
            torch.set_num_threads(nthreads)
            fn()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn()
                n += 1
            res.append(n * kv_bytes / (time.perf_counter() - t0) / 1e9)
        th = threading.Thread(target=attention)
        th.start()
        th.join()
        stop.set()
        for o in others:
            o.join()
        return res[0]

    rows = []
    for nthreads in thread_counts:
        for name, fn in calls.items():
            for beside, side in (("nothing", []), ("h2d copies", [copies]),
                                 (f"{waiters} sleeping waiters", [waiter(True)] * waiters),
                                 (f"h2d copies, {waiters} spinning waiters", [copies] + [waiter(False)] * waiters)):
                rows.append({"call": name, "beside": beside, "threads": nthreads, "GB/s": rate(fn, side, nthreads)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=544)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--contention", default=None, metavar="THREADS", help="e.g. 4,8,12,16 (needs CUDA)")
    ap.add_argument("--neighbours", default=None, metavar="THREADS", help="e.g. 8,12 (needs CUDA)")
    ap.add_argument("--waiters", type=int, default=3)
    args = ap.parse_args()
    from flexoff.models.attention import attend

    b, h, d, t = args.rows, args.heads, args.head_dim, args.tokens
    if args.neighbours:
        rows = neighbours([int(x) for x in args.neighbours.split(",")], b, h, d, t, args.waiters)
        print(f"{b} rows x {h} heads x {t} tokens x {d}, fp16")
        print(table(rows, ["call", "beside", "threads", "GB/s"]))
        write_jsonl(args.out / "neighbours.jsonl", [{**environment(), **vars(args), "out": str(args.out), **r}
                                                   for r in rows])
        return 0
    if args.contention:
        rows = contention([int(x) for x in args.contention.split(",")], b, h, d, t)
        cols = ["threads", "attention alone GB/s", "attention with h2d GB/s", "h2d alone GB/s",
                "h2d with attention GB/s", "sum GB/s"]
        print(f"{b} rows x {h} heads x {t} tokens x {d}, fp16 head-major")
        print(table(rows, cols))
        write_jsonl(args.out / "contention.jsonl", [{**environment(), **vars(args), "out": str(args.out), **r}
                                                    for r in rows])
        return 0
    copy_bw, s = host_copy_bandwidth(1 << 30)  # 1 GiB
    copy_bw /= 1e9
    rows = [{"variant": "memcpy (read+write)", "dtype": "", "ms": s * 1e3, "GB/s": copy_bw}]
    mask = torch.ones(b, 1, t, dtype=torch.bool)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q = torch.randn(b, h, 1, d).to(dtype)
        tok = torch.randn(t, b, 2, h, d).to(dtype)  # token-major: the layout that crosses the link
        hm = torch.randn(2, b, h, t, d).to(dtype)  # head-major: flexoff's CPU-attention rows
        kv_bytes = 2 * b * h * t * d * dtype.itemsize
        variants = {
            "token-major strided": lambda: attend(q, tok[:, :, 0].permute(1, 2, 0, 3), tok[:, :, 1].permute(1, 2, 0, 3),
                                                  mask, d**-0.5),
            "head-major": lambda: attend(q, hm[0], hm[1], mask, d**-0.5),
        }
        if cpu_kernel.build():  # the compiled kernel over the same head-major rows, as two areas
            variants["head-major, compiled kernel"] = lambda: cpu_kernel.decode_attention(
                q, (hm[0, :, :, :t - 1], hm[1, :, :, :t - 1]), (hm[0, :, :, t - 1:], hm[1, :, :, t - 1:]), mask,
                d**-0.5)
        for name, fn in variants.items():
            s = timed(fn)
            rows.append({"variant": name, "dtype": str(dtype).replace("torch.", ""), "ms": s * 1e3,
                         "GB/s": kv_bytes / s / 1e9, "of memcpy": kv_bytes / s / 1e9 / copy_bw})
    print(f"threads {torch.get_num_threads()}, {b} rows x {h} heads x {t} tokens x {d}")
    print(table(rows, ["variant", "dtype", "ms", "GB/s", "of memcpy"]))
    env = environment()
    write_jsonl(args.out / "cpu_attention.jsonl", [{**env, **vars(args), "out": str(args.out), **r} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
