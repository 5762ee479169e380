"""Pipeline stages and data-parallel replicas: real processes on gloo (torchrun), against one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexoff import LLM, Policy, SamplingParams
from flexoff.dummy import CONFIGS
from flexoff.offload.pipeline import batch_groups, split_blocks, stage_layers, stage_spec
from flexoff.offload.schedule import block_plan, forward_sweeps
from flexoff.models.spec import ModelSpec

HERE = Path(__file__).parent
PROMPTS = [[5, 9, 13], [7], [3, 4, 5, 6, 7, 8], [11, 2], [9, 9, 9, 9], [1, 30, 2, 8, 5], [42, 17], [6, 6, 1]]
POLICIES = [  # placement, batch shape, overlap, CPU attention, compression
    dict(gpu_batch_size=2, num_gpu_batches=2),
    dict(gpu_batch_size=1, num_gpu_batches=3, w_gpu_percent=0, w_cpu_percent=50, cache_gpu_percent=0,
         cache_cpu_percent=100, act_gpu_percent=0, act_cpu_percent=100, cpu_cache_compute=True),
    dict(gpu_batch_size=3, num_gpu_batches=1, w_gpu_percent=30, w_cpu_percent=40, cache_gpu_percent=0,
         cache_cpu_percent=0, act_gpu_percent=0, act_cpu_percent=0, overlap=False),
    dict(gpu_batch_size=2, num_gpu_batches=2, compress_weight=True, compress_cache=True),
]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny OPT and LLaMA (grouped-query) of five blocks, as dummy:CONFIG.json models."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in ("opt-tiny", "llama-tiny"):
        path = root / f"{name}.json"
        path.write_text(json.dumps({**CONFIGS[name], "num_hidden_layers": 5}))
        out[name] = f"dummy:{path}"
    return out


def test_stages_split_the_layers_once():
    spec = ModelSpec.from_config("x", {**CONFIGS["llama-tiny"], "num_hidden_layers": 7})
    for stages in (1, 2, 3, 7):
        layers = [stage_layers(spec, s, stages) for s in range(stages)]
        real = [j for ls in layers for j in ls if j is not None]
        assert real == list(range(len(spec.layers)))  # every layer once, in order
        for s, ls in enumerate(layers):
            kinds = [l.kind for l in stage_spec(spec, s, stages).layers]
            assert kinds[0] == ("embed" if s == 0 else "recv") and kinds[-1] == ("head" if s == stages - 1 else "send")
            assert len(ls) == len(kinds)
    assert [len(r) for r in split_blocks(7, 3)] == [3, 2, 2]
    assert batch_groups(5, 2) == [(0, 1, 2), (3, 4)] and batch_groups(1, 3) == [(0,)]


def test_grouped_sweeps_run_every_square_once():
    groups = batch_groups(5, 3)
    plans = list(block_plan(forward_sweeps(3, groups), 4, 5, ahead=2, at=1))
    squares = [(p.step.i, p.step.j, p.step.k) for p in plans]
    assert sorted(squares) == [(i, j, k) for i in range(3) for j in range(4) for k in range(5)]
    ends = [(p.step.i, p.step.j, p.step.k) for p in plans if p.ends]
    assert ends == [(i, 3, 4) for i in range(3)]  # a token step ends with its last group's last batch
    for i in range(3):  # groups follow each other: all of group g's squares before group g + 1's
        order = [k for (ii, _, k) in squares if ii == i]
        assert [next(g for g, ks in enumerate(groups) if k in ks) for k in order] == sorted(
            next(g for g, ks in enumerate(groups) if k in ks) for k in order)


def one_process(model: str, policy: dict, sampling: dict) -> list[list]:
    llm = LLM(model, policy=Policy(**policy), device="cpu")
    try:
        out = llm.generate(PROMPTS, SamplingParams(**sampling))
    finally:
        llm.close()
    return [[c.token_ids, c.logprobs.chosen if c.logprobs else None] for c in out.completions]


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_equals_one_process(models, tmp_path, stages):
    greedy = dict(max_new_tokens=7, ignore_eos=True)
    sampled = dict(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3, logprobs=2, ignore_eos=True)
    cases = [dict(model=m, policy=p, prompts=PROMPTS, sampling=greedy) for m in models.values() for p in POLICIES]
    cases.append(dict(model=models["llama-tiny"], policy=POLICIES[0], prompts=PROMPTS, sampling=sampled))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run(torchrun(stages, str(HERE / "worker.py"), str(tmp_path / "cases.json"),
                                   str(tmp_path / "out.json")), env=env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["stages"] == stages and max(got["stage_layers"]) < 2 * 5 + 2  # the first stage: part of the model
    for case, result in zip(cases, got["results"]):
        want = one_process(case["model"], case["policy"], case["sampling"])
        assert [r[0] for r in result] == [w[0] for w in want], (case["model"], case["policy"])
        if case["sampling"].get("logprobs") is not None:
            for r, w in zip(result, want):
                assert r[1] == pytest.approx(w[1], abs=1e-5)


def prompts_file(path: Path, n: int, gen: int) -> Path:
    rows = [{"id": f"q{i}", "prompt_ids": PROMPTS[i % len(PROMPTS)] + [i % 50 + 1], "max_new_tokens": gen}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path: Path) -> dict[str, dict]:
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    recs = {r["id"]: r for r in lines}
    assert len(recs) == len(lines), "an id answered twice"
    return recs


def flexoff(*args: str) -> list[str]:
    return [sys.executable, "-m", "flexoff", "run", "-q", "--device", "cpu", *args]


def test_cli_pipeline_resumes_and_equals_one_process(models, tmp_path):
    inp = prompts_file(tmp_path / "p.jsonl", 10, 6)
    one, piped = tmp_path / "one.jsonl", tmp_path / "piped.jsonl"
    common = ["--model", models["opt-tiny"], "--input", str(inp), "--gpu-batch-size", "2"]
    assert subprocess.run(flexoff(*common, "--output", str(one)), env=env(), capture_output=True).returncode == 0
    ref = records(one)
    piped.write_text("".join(json.dumps(ref[k]) + "\n" for k in ("q3", "q7")))  # answered before
    done = subprocess.run(flexoff(*common[:-2], "--output", str(piped), "--pipeline-parallel", "2", "--policy", "auto",
                                  "--hardware", "flexgen-t4", "--cpu-mem", "1GiB"), env=env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed: 2 of 10" in done.stderr and "2 pipeline stages: policy:" in done.stderr
    assert records(piped) == ref  # a searched policy, split in stages: the same tokens


def test_cli_pipeline_bad_input_is_one_line(models, tmp_path):
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": "x"}\n')
    done = subprocess.run(flexoff("--model", models["opt-tiny"], "--input", str(inp), "--output",
                                  str(tmp_path / "o.jsonl"), "--pipeline-parallel", "2"),
                          env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "line 2" in done.stderr and not (tmp_path / "o.jsonl").exists()


def worker_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of this global rank (a child of the launcher)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if f"RANK={rank}".encode() in (d / "environ").read_bytes().split(b"\0"):
                return int(d.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker through /proc")
def test_data_parallel_answers_each_id_once_and_survives_a_killed_replica(models, tmp_path):
    n = 24
    inp = prompts_file(tmp_path / "p.jsonl", n, 40)
    one, dp = tmp_path / "one.jsonl", tmp_path / "dp.jsonl"
    common = ["--model", models["llama-tiny"], "--input", str(inp), "--gpu-batch-size", "1"]
    assert subprocess.run(flexoff(*common, "--output", str(one)), env=env(), capture_output=True).returncode == 0
    ref = records(one)
    cmd = torchrun(2, "-m", "flexoff", "run", "-q", "--device", "cpu", *common, "--output", str(dp),
                   "--pipeline-parallel", "1")
    first = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    shard = Path(f"{dp}.replica-1-of-2")
    deadline = time.time() + 120
    while time.time() < deadline and not (shard.exists() and shard.read_text().count("\n") >= 1):
        time.sleep(0.02)
    pid = worker_pid(first.pid, 1)
    assert pid is not None and shard.exists()
    os.kill(pid, signal.SIGKILL)  # replica 1 dies mid-shard; torchrun stops replica 0
    first.communicate(timeout=120)
    assert first.returncode != 0
    before = shard.read_text().count("\n")
    assert 1 <= before < n  # it was killed with work left
    again = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed:" in again.stderr
    assert records(dp) == ref  # every id exactly once, as one process answers it
    assert not list(tmp_path.glob("dp.jsonl.replica-*"))  # merged


def test_pipeline_stages_refuse_lora_in_one_line():
    from flexoff.errors import InputError
    from flexoff.offload.pipeline import PipeLink
    from flexoff.parallel import World

    link = PipeLink(0, 2, (0, 1), None, None, None)
    world = World(rank=0, size=2, local_rank=0, local_size=2, stages=2, link=link)
    with pytest.raises(InputError, match="not served by pipeline stages"):
        LLM("dummy:opt-tiny", lora={"a": "/nowhere"}, world=world, device="cpu")
    assert World(3, 4, 1, 2, 2, None).replica == 1 and World(3, 4, 1, 2, 2, None).share(10) == 5
