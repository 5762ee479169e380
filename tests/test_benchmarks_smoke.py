"""The benchmark suite's smoke mode runs on the CPU and writes well-formed records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = {"kind", "label", "model", "prompt_len", "gen_len", "policy", "policy_json", "prefill_s", "decode_s",
            "gen_tok_s", "decode_tok_s", "peak_bytes", "device", "torch", "commit", "predicted_tok_s",
            "predicted_prefill_s", "predicted_decode_s", "measured/predicted", "decode_bound_s", "pcie_bound_s",
            "gpu_mem", "cpu_mem", "disk_mem", "traffic_decode"}


def test_smoke_suite_writes_valid_records(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / "throughput.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in recs}
    assert kinds == {"run", "ablation", "frontier", "baseline"}
    for r in recs:
        if r["kind"] == "baseline":
            assert r["generation_throughput"] > 0 and r["flexoff/accelerate"] > 0
            continue
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        assert r["prefill_s"] > 0 and r["decode_s"] > 0 and r["gen_tok_s"] > 0 and r["predicted_tok_s"] > 0
        assert r["gen_len"] == 8 and r["prompt_len"] == 48
    # the engine's timing of its disk-read thread, where the decode read the disk
    traffic = [r["traffic_decode"] for r in recs if r["kind"] != "baseline"]
    assert all({"disk_read_s", "compute_blocked_s"} <= set(t) for t in traffic)
    read = [t for t in traffic if t["disk_read"] > 0]
    assert read and all(t["disk_read_s"] > 0 for t in read)
    assert all(t["disk_read_s"] == 0 for t in traffic if t["disk_read"] == 0)
    labels = [r["label"] for r in recs if r["kind"] == "ablation"]
    assert labels[0] == "all optimizations" and set(labels) == {
        "all optimizations", "no policy search", "no overlap", "no CPU attention", "no compression", "no disk"}
    assert all(r["ratio_to_full"] > 0 for r in recs if r["kind"] == "ablation")
    front = [r for r in recs if r["kind"] == "frontier"]
    assert any(r["pareto"] for r in front) and all(r["latency_s"] > 0 for r in front)
    # the frontier redrawn from the recorded runs: each policy once, the same Pareto points
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--replot",
                            str(tmp_path / "runs.jsonl"), "--out", str(tmp_path / "replot")],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    policies = {r["policy"] for r in recs if r["kind"] in ("run", "ablation", "frontier")}
    listed = [line for line in again.stdout.splitlines()[2:] if line.strip()]
    assert len(listed) == len(policies)


def test_pipeline_smoke_runs_one_and_two_stages(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / "pipeline.jsonl").read_text().splitlines()]
    assert [(r["gpus"], r["stage"]) for r in recs] == [(1, 0), (2, 0), (2, 1)]
    assert all(r["decode_s"] > 0 and r["rows"] > 0 for r in recs)
    assert recs[1]["sent_MB"] > 0 and recs[2]["same_tokens_as_1_gpu"] is True and recs[2]["vs_1_gpu"] > 0


def test_finetune_curve_writes_both_bases(tmp_path):
    """The 16-bit and 4-bit loss curves of benchmarks/finetune_curve.py on a dummy model."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune_curve.py"), "--model", "dummy:llama-tiny",
                           "--steps", "3", "--save-every", "3", "--batch", "2", "--targets", "q_proj,v_proj",
                           "--out", str(tmp_path / "c.jsonl")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [r["base"] for r in recs] == ["16-bit", "4-bit"]
    for r in recs:
        assert len(r["losses"]) == 3 and list(r["eval"]) == ["3"] and r["eval"]["3"] > 0
    assert recs[0]["losses"][0] != recs[1]["losses"][0]  # the bases differ


def test_coserve_concurrent_trains_beside_inference_without_changing_its_tokens(tmp_path):
    """benchmarks/coserve.py --concurrent on a tiny model: training steps in a thread while the
    prompts generate, the prompts' tokens those of the run alone (`--train-sms` is CUDA's only)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "coserve.py"), "--model", "dummy:llama-tiny",
                           "--device", "cpu", "--concurrent", "--prompts", "8", "--prompt-len", "16", "--gen-len", "4",
                           "--seq", "32", "--examples", "16", "--gpu-batch-size", "2", "--infer-batches", "2",
                           "--train-steps", "2", "--train-sms", "4", "--out", str(tmp_path / "c.jsonl")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = {r["run"]: r for r in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines())}
    assert list(recs) == ["inference alone", "finetuning alone", "both at once"]
    both = recs["both at once"]
    assert both["same_tokens_as_alone"] == 1.0 and "training_failed" not in both
    assert both["gen_tok_s"] > 0 and recs["finetuning alone"]["train_tok_s"] > 0


def test_host_step_measures_a_policy_at_a_models_depth(tmp_path):
    """benchmarks/host_step.py --policy: the policy as given, at the depth of the model named (the
    tiny model's 2 blocks here: 6 engine layers), one record per policy."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_step.py"), "--policy",
                           "4x2:0,100,50,50,0,100:wk", "--policy", "2x3:100,0,100,0,100,0", "--depth-of",
                           "dummy:opt-tiny", "--gen-len", "3", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / "host-step.jsonl").read_text().splitlines()]
    assert [r["policy"].split()[0] for r in recs] == ["4x2", "2x3"]
    assert "compress_weight" in recs[0]["policy"] and "compress" not in recs[1]["policy"]
    for r, nb in zip(recs, (2, 3)):
        assert len(r["runs_ms"]) == 1 and r["median_ms"] > 0
        assert r["token_step_host_ms"] == pytest.approx(r["median_ms"] * 6 * nb)


@pytest.mark.slow  # a measuring tool's own check (about a minute on two cores)
def test_host_rates_measures_fresh_and_after_the_rest_of_the_profile(tmp_path):
    """benchmarks/host_rates.py --quick: a round per phase (fresh, after the machine's other rates,
    after the engine probes), each rate the median call's, each call timed; the probes' fields as
    the profile takes them."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_rates.py"), "--quick", "--rounds", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / "host-rates.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in recs] == ["fresh", "after the GPU's rates", "after engine probes"]
    kv_bytes = 2 * 4 * 8 * 128 * 64 * 4  # quick shapes' K and V on the CPU, float32
    for r in recs:
        calls = sorted(r["cpu_attn_call_ms"])
        assert len(calls) == 11 and all(t > 0 for t in calls)
        assert r["cpu_attn_GBps"] == pytest.approx(kv_bytes / (calls[5] / 1e3) / 1e9, rel=0.01)  # ms rounded to 0.1 us
        assert r["cpu_mem_GBps"] > 0
        assert set(r["probes"]) == {"host_step_s", "lora_host_step_s", "packed_host_step_s", "decode_ctog_bdw"}
        assert r["probes"]["host_step_s"] > 0 and r["probes"]["decode_ctog_bdw"] == 0  # no link probe when quick


def test_cpu_attn_layouts_measures_each_layout_each_round(tmp_path):
    """benchmarks/cpu_attn_layouts.py on the CPU: the pageable layouts (the registered ones need
    CUDA), each round in turn, rates ordered as their calls (median no faster than the quartile,
    no faster than the best)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attn_layouts.py"), "--rounds", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / "cpu-attn-layouts.jsonl").read_text().splitlines()]
    assert [(r["round"], r["layout"]) for r in recs] == [(0, "randn"), (0, "one-thread"), (1, "randn"),
                                                        (1, "one-thread")]
    for r in recs:
        assert r["calls"] == 11 and 0 < r["median_GBps"] <= r["quartile_GBps"] <= r["best_GBps"]
        assert r["joint_cpu_GBps"] is None  # no link to stream beside it
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attn_layouts.py"), "--rounds", "0",
                          "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "--rounds" in bad.stderr and not (tmp_path / "x").exists()


def test_gpu_only_benchmarks_say_so_without_cuda(tmp_path):
    """Without CUDA a GPU benchmark exits 2 with one line saying why, and writes nothing."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_gemm.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and not list(tmp_path.iterdir())


def test_cpu_lane_runs_each_batch_size_and_fits_the_lane(tmp_path, monkeypatch):
    """benchmarks/cpu_lane.py on a tiny OPT cut to two blocks: one run per (GPU batch size, weights
    placement), calls per pair = GPU batches, each call's bytes those of its rows' keys and values
    over the decode's average context; and its fit recovers a known line."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_lane.py"), "--model", "dummy:opt-125m",
                           "--layers", "2", "--block", "4", "--gbs", "2,4", "--prompt-len", "32", "--gen-len", "4",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "cpu-lane.jsonl").read_text().splitlines()]
    assert sorted((r["rows"], r["weights"]) for r in rows) == [(2, "cpu"), (2, "gpu"), (4, "cpu"), (4, "gpu")]
    contexts = [32 + t for t in range(1, 4)]  # the three decode steps' keys and values, float32 on the CPU
    for r in rows:
        assert r["calls_per_pair"] == pytest.approx(4 / r["rows"])
        assert r["MB_per_call"] * 1e6 == pytest.approx(r["rows"] * 768 * 2 * 4 * sum(contexts) / 3, rel=1e-6)
        assert r["lane_ms_per_call"] > 0 and r["record"]["decode_s"] > 0
    assert set(json.loads((tmp_path / "cpu-lane-fit.json").read_text())) == {"cpu", "gpu"}

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from cpu_lane import fit

    line = [{"MB_per_call": mb, "lane_ms_per_call": 0.4 + mb * 1e6 / 50e9 * 1e3} for mb in (60, 120, 360)]
    got = fit(line)
    assert got["fixed_ms"] == pytest.approx(0.4) and got["rate_GBps"] == pytest.approx(50)
    assert fit(line[:1]) is None


def test_repredict_prices_records_as_if_a_profile_had_read_a_rate(tmp_path, monkeypatch):
    """benchmarks/repredict.py --set FIELD=VALUE: a recorded CPU-attention run priced with the
    profile's CPU attention rate replaced is priced as the cost model prices that profile, slower
    than with the profile's own rate; a name that is not a rate of a profile exits 2."""
    from dataclasses import replace

    from flexoff.checkpoint import load_model
    from flexoff.policy.cost_model import Workload
    from flexoff.policy.hardware import h200
    from flexoff.policy.policy import Policy

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import repredict
    from throughput import predict

    p = Policy(8, 2, 0, 100, 0, 100, 100, 0, cpu_cache_compute=True)
    record = {"label": "8x2", "model": "dummy:opt-1.3b", "policy_json": p.to_dict(), "prompt_len": 64, "gen_len": 8,
              "num_prompts": 16, "decode_s": 1.0, "predicted_decode_s": 1.0, "measured/predicted": 1.0,
              "gen_tok_s": 100.0}
    runs, rows = tmp_path / "runs.jsonl", tmp_path / "rows.jsonl"
    runs.write_text(json.dumps(record) + "\n")
    assert repredict.main([str(runs), "--hardware", "h200", "--set", "cpu_attn_bdw=1e9", "--out", str(rows)]) == 0
    got = json.loads(rows.read_text())["predicted_decode_s_now"]
    spec, work = load_model("dummy:opt-1.3b").spec, Workload(64, 8, 2, 16)
    assert got == pytest.approx(predict(spec, replace(h200(), cpu_attn_bdw=1e9), p, work).decode_s)
    assert got > predict(spec, h200(), p, work).decode_s
    assert repredict.main([str(runs), "--hardware", "h200", "--set", "speed=1"]) == 2
    assert repredict.main([str(runs), "--hardware", "h200", "--set", "cpu_attn_bdw=fast"]) == 2


@settings(max_examples=60, deadline=None)
@given(link_gb=st.floats(0.0, 60.0), lane_gb=st.floats(0.0, 60.0), beside=st.floats(0.5, 1.2),
       joint=st.floats(40.0, 200.0))
def test_decode_bound_is_the_best_time_sharing_of_the_link_and_the_lane(link_gb, lane_gb, beside, joint):
    """throughput.decode_bounds: a decode's bound is the shortest schedule, found by brute force
    over how long the link copies beside CPU attention (at cpu_attn_ctog_bdw, the lane at
    cpu_attn_bdw), each running alone for the rest (the link at ctog_bdw), and no shorter than
    host memory serving both bytes at its read rate; the link's alone where the profile did not
    measure the rate beside CPU attention."""
    from dataclasses import replace

    from flexoff.policy.hardware import h200

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import decode_bounds

    hw = replace(h200(), ctog_bdw=50e9, cpu_attn_bdw=40e9, cpu_attn_ctog_bdw=50e9 * beside, host_read_bdw=joint * 1e9)
    x, y = link_gb * 1e9, lane_gb * 1e9
    c_j = min(hw.cpu_attn_ctog_bdw, hw.ctog_bdw)
    joint_s = [y / hw.cpu_attn_bdw * i / 2000 for i in range(2001)] + [min(x / c_j, y / hw.cpu_attn_bdw)]
    best = min(t + max(0.0, x - c_j * t) / hw.ctog_bdw + max(0.0, y - hw.cpu_attn_bdw * t) / hw.cpu_attn_bdw
               for t in joint_s)
    got = decode_bounds(x, y, hw)
    assert got["bound"] == pytest.approx(max(best, (x + y) / hw.host_read_bdw), rel=1e-9, abs=1e-12)
    assert got["link"] == pytest.approx(x / hw.ctog_bdw, abs=1e-12)
    unmeasured = decode_bounds(x, y, replace(hw, cpu_attn_ctog_bdw=0.0, host_read_bdw=1e15))
    assert unmeasured["bound"] == pytest.approx(max(x / hw.ctog_bdw, y / hw.cpu_attn_bdw), rel=1e-9, abs=1e-12)


def test_alloc_retries_names_the_allocation_after_each_release_of_segments(monkeypatch):
    """benchmarks/alloc_retries.py: in the CUDA allocator's memory history, an allocation that
    follows a release of cached segments is a retry, counted once by flexoff call site and size;
    allocations with no release before them are not."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from alloc_retries import retried

    site = [{"filename": "/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/repo/offload/kvcache.py", "line": 223, "name": "store_prompt"}]
    trace = [{"action": "alloc", "size": 1 << 20, "frames": site},
             {"action": "segment_unmap", "size": 0}, {"action": "segment_unmap", "size": 0},
             {"action": "alloc", "size": 672 << 20, "frames": site},
             {"action": "alloc", "size": 5 << 20, "frames": site},
             {"action": "segment_free", "size": 0},
             {"action": "alloc", "size": 672 << 20, "frames": site}]
    sites, sizes = retried(trace)
    assert sites == {"kvcache.py:223:store_prompt": 2} and sizes == {672: 2}
