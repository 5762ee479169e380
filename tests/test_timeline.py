"""The timeline summary of benchmarks/timeline.py on a hand-made trace."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from timeline import per_step, slim, summarize  # noqa: E402


def test_summary_counts_busy_time_and_gaps_in_the_decode_window():
    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "main"}},
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 50),  # prefill: outside the window
        x("cpu_op", "flexoff: token step 0 issued", 90, 10),  # the window opens at 100
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100, 30),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 120, 30),  # overlaps: 100..150
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 170, 10),  # gap 20
        x("cuda_runtime", "cudaMemcpyAsync", 140, 5, correlation=4),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 240, 60, stream=13, bytes=512, correlation=4),  # gap 60
        # (the window ends at 300)
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 150, 20),
        x("kernel", "gemm", 110, 40, tid=7, stream=7),
        x("kernel", "attn", 190, 30, tid=7, stream=7),  # inside the gap of 60
        x("user_annotation", "flexoff lane: cpu-attention", 120, 100, tid=3),
        x("cpu_op", "aten::bmm", 130, 50, tid=3),
    ]}
    s = summarize(trace)
    rows = {r["what"]: r for r in s["rows"]}
    assert s["window_us"] == pytest.approx(200)
    assert rows["link host to device"]["busy"] == pytest.approx((50 + 10 + 60) / 200)
    assert rows["link device to host"]["busy"] == pytest.approx(20 / 200)
    assert rows["GPU stream 7"]["busy"] == pytest.approx(70 / 200)
    assert rows["lane cpu-attention"]["busy"] == pytest.approx(100 / 200)
    assert rows["CPU thread cpu-attention"]["busy"] == pytest.approx(50 / 200)  # named by its lane
    assert [g["gap"] for g in s["h2d_gaps_us"]] == [60, 20]
    assert s["h2d_gaps_us"][0]["at"] == pytest.approx(80)
    # the copy that ended the gap: its stream, bytes, and 95 us queued after its host call; a kernel ran in it
    assert {k: s["h2d_gaps_us"][0][k] for k in ("next_stream", "next_bytes", "next_queued", "kernel_us")} == \
        {"next_stream": 13, "next_bytes": 512, "next_queued": 95, "kernel_us": 30}
    assert s["h2d_gaps_us"][1]["next_queued"] is None and s["h2d_gaps_us"][1]["kernel_us"] == 0
    assert s["kernels_us"] == [{"kernel": "gemm", "us": 40, "share": pytest.approx(40 / 200)},
                               {"kernel": "attn", "us": 30, "share": pytest.approx(30 / 200)}]
    assert per_step(s, 4) == {"steps": 4, "kernels_per_step": 0.5, "kernel_us_per_step": 17.5}
    kept = slim(trace)["traceEvents"]  # the device side, names and marks; no host ops
    assert [e["name"] for e in kept if e.get("cat") == "cpu_op"] == ["flexoff: token step 0 issued"]
    assert sum(e.get("cat") == "gpu_memcpy" for e in kept) == 6 and any(e.get("cat") == "kernel" for e in kept)
    assert any(e["name"] == "flexoff lane: cpu-attention" for e in kept) and kept[0]["ph"] == "M"
    pre = summarize(trace, "prefill")  # from the first event to the prefill's token step: 0..100
    rows = {r["what"]: r for r in pre["rows"]}
    assert pre["window_us"] == pytest.approx(100)
    assert rows["link host to device"]["busy"] == pytest.approx(50 / 100)
    assert pre["kernels_us"] == []


def test_copy_waits_match_copies_to_the_calls_that_queued_them():
    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    trace = {"traceEvents": [
        x("cpu_op", "flexoff: token step 0 issued", 90, 10),
        x("cuda_runtime", "cudaMemcpyAsync", 100, 5, correlation=1),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 125, 10, tid=61, correlation=1),  # waited 20
        x("cuda_runtime", "cudaMemcpyAsync", 140, 5, correlation=2),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 205, 10, tid=61, correlation=2),  # waited 60
        x("cuda_runtime", "cudaMemcpyAsync", 150, 2, correlation=3),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 153, 4, tid=57, correlation=3),  # waited 1
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 160, 4, tid=49, correlation=9),  # no call: left out
    ]}
    waits = {(w["stream"], w["copy"]): w for w in summarize(trace)["copy_waits_us"]}
    assert set(waits) == {(61, "HtoD"), (57, "DtoH")}
    assert waits[(61, "HtoD")]["copies"] == 2 and waits[(61, "HtoD")]["max"] == pytest.approx(60)
    assert waits[(61, "HtoD")]["mean"] == pytest.approx(40)
    assert waits[(57, "DtoH")]["median"] == pytest.approx(1)
    calls = summarize(trace)["runtime_calls"]  # host time in the runtime, per call name
    assert calls == [{"call": "cudaMemcpyAsync", "count": 3, "total_us": 12, "max_us": 5}]
