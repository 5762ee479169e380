"""Co-serving through LLM.generate: two finetuning jobs whose windows ride on inference blocks
reach the adapters (and losses) of the same jobs run standalone in the same data order, and the
inference rows still get transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.errors import InputError
from flexoff.finetune import LoraTrainer, TrainConfig, to_example
from flexoff.finetune.coserve import CoJob, CoTrainer
from reference import PROMPTS

peft = pytest.importorskip("peft")

TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a b c d e f g", "hello world, hello",
         "lorem ipsum dolor", "sit amet consectetur"]
JOBS = {"one": (["q_proj", "v_proj", "down_proj"], 0), "two": (["o_proj", "up_proj"], 1)}


def _init(path, folder, targets, seed) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
                   ).save_pretrained(folder)
    return str(folder)


def _jobs(llm: LLM, cfg: TrainConfig, steps: int) -> list[CoJob]:
    ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
    return [CoJob(LoraTrainer(llm, name, cfg, max(len(e.ids) for e in ex)), ex, steps, seed=s)
            for name, (_, s) in JOBS.items()]


def _adapters(jobs: list[CoJob]) -> dict[str, list[torch.Tensor]]:
    return {j.name: [t.detach().clone() for ab in j.trainer.params.values() for t in ab] for j in jobs}


@pytest.mark.parametrize("stash", [{}, {"stash_gpu_percent": 0, "stash_cpu_percent": 100}])
def test_coserved_jobs_reach_their_standalone_adapters_and_inference_its_tokens(tiny, tiny_refs, tmp_path, stash):
    """With the stash in CPU memory too: its homes are for the block's windows only, and the last
    block (one inference batch) has its windows at other batch indices than the first. The KV
    cache has homes for the inference batches only; inference under the same policy afterwards
    (every batch generating) gets an engine with homes for all."""
    path = tiny["llama"].path
    lora = {name: _init(path, tmp_path / name, targets, seed) for name, (targets, seed) in JOBS.items()}
    cfg = TrainConfig(lr=3e-2, batch_size=3, max_grad_norm=0.5)
    steps = 6
    with LLM(str(path), policy=Policy(gpu_batch_size=3), lora=lora) as llm:  # standalone, one job after the other
        alone = _jobs(llm, cfg, steps)
        CoTrainer(alone).finish()
        want = _adapters(alone)
    with LLM(str(path), policy=Policy(gpu_batch_size=2, num_gpu_batches=4, **stash), lora=lora) as llm:
        jobs = _jobs(llm, cfg, steps)
        rider = CoTrainer(jobs, batches=2)
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8, rider=rider)
        carried = {j.name: len(j.losses) for j in jobs}  # steps taken on inference blocks
        assert len(llm.engine.kv.homes[0]) == 2
        again = llm.generate([{"prompt_ids": p} for p in PROMPTS * 2], max_new_tokens=8)
        rider.finish()
        got = _adapters(jobs)
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["llama"]]
    assert [c.token_ids for c in again.completions] == [r for r, _ in tiny_refs["llama"]] * 2
    assert all(n >= 1 for n in carried.values()), carried
    for a, b in zip(alone, jobs):
        assert len(b.losses) == steps
        for x, y in zip(a.losses, b.losses):
            assert abs(x - y) < 1e-4 * abs(x), (a.losses, b.losses)
        for x, y in zip(want[a.name], got[b.name]):
            assert float((x - y).norm()) <= 1e-3 * float(x.norm()) + 1e-6
    assert min(a.losses[-2:]) < a.losses[0] - 0.05, a.losses  # it learns


def test_coserving_needs_a_spare_gpu_batch(tiny, tmp_path):
    path = tiny["llama"].path
    lora = {"one": _init(path, tmp_path / "one", ["q_proj"], 0)}
    with LLM(str(path), policy=Policy(gpu_batch_size=2, num_gpu_batches=1), lora=lora) as llm:
        ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in TEXTS]
        rider = CoTrainer([CoJob(LoraTrainer(llm, "one", TrainConfig(batch_size=2)), ex, 1)])
        with pytest.raises(InputError, match="raise --num-gpu-batches"):
            llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=2, rider=rider)


def _files(tmp_path):
    """Seven training lines and six prompts of four new tokens, as JSONL files."""
    import json

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}: " + "ab" * (i % 4 + 2)}) + "\n" for i in range(7)))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "hello " * (i + 1), "max_new_tokens": 4}) + "\n"
                               for i in range(6)))
    return data, prompts


def _answers(path) -> dict:
    """A flexoff run output's records by prompt id."""
    import json

    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _standalone_adapter(tmp_path, data, steps: int) -> dict:
    """The adapter `flexoff finetune` trains with the co-served jobs' settings, in tmp_path/alone."""
    from safetensors.torch import load_file

    from flexoff.cli import main

    assert main(["finetune", "--model", "dummy:llama-tiny", "--data", str(data), "--output", str(tmp_path / "alone"),
                 "--steps", str(steps), "--batch-size", "2", "--lr", "0.01", "--lora-r", "4", "--seed", "3",
                 "--dtype", "float32", "-q"]) == 0
    return load_file(str(tmp_path / "alone" / "adapter_model.safetensors"))


def _assert_same_adapter(folder, want: dict) -> None:
    from safetensors.torch import load_file

    got = load_file(str(folder / "adapter_model.safetensors"))
    assert got.keys() == want.keys()
    for k in got:
        assert float((got[k] - want[k]).norm()) <= 1e-4 * float(want[k].norm()) + 1e-6, k


def test_flexoff_run_with_finetune_jobs_answers_every_prompt_and_trains_the_standalone_adapter(tmp_path, capsys):
    """`flexoff run --finetune JOB.yaml`: every prompt answered with the tokens of a run without
    the job, the job's adapter (and metrics) as `flexoff finetune` trains it on the same data."""
    import json

    from flexoff.cli import main

    data, prompts = _files(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(f"data: {data}\noutput: {tmp_path / 'co'}\nsteps: 5\nbatch_size: 2\nlr: 0.01\nlora_r: 4\n"
                   "save_every: 2\nseed: 3\n")
    common = ["--model", "dummy:llama-tiny", "--input", str(prompts), "--dtype", "float32", "-q",
              "--gpu-batch-size", "2", "--num-gpu-batches", "3"]
    assert main(["run", *common, "--output", str(tmp_path / "co.jsonl"), "--finetune", str(job)]) == 0
    err = capsys.readouterr().err
    assert "finetuning job: 5 steps" in err
    assert main(["run", *common, "--output", str(tmp_path / "plain.jsonl")]) == 0
    alone = _standalone_adapter(tmp_path, data, 5)
    co, plain = _answers(tmp_path / "co.jsonl"), _answers(tmp_path / "plain.jsonl")
    assert co.keys() == plain.keys() == {f"q{i}" for i in range(6)}
    assert all(co[k]["completion"] == plain[k]["completion"] for k in co)
    _assert_same_adapter(tmp_path / "co", alone)
    steps = [json.loads(line)["step"] for line in (tmp_path / "co" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    # under a slowdown bound the blocks carry what it leaves room for; the answers and the adapter
    # are the same whichever blocks carried the steps
    job.write_text(job.read_text().replace(str(tmp_path / "co"), str(tmp_path / "bounded")))
    assert main(["run", *common, "--output", str(tmp_path / "bounded.jsonl"), "--finetune", str(job),
                 "--max-inference-slowdown", "50%"]) == 0
    err = capsys.readouterr().err
    assert "co-serving: training windows added" in err and "(bound 50%)" in err, err
    bounded = _answers(tmp_path / "bounded.jsonl")
    assert all(bounded[k]["completion"] == plain[k]["completion"] for k in plain)
    _assert_same_adapter(tmp_path / "bounded", alone)
    for bad in (["--max-inference-slowdown", "fast", "--finetune", str(job)], ["--max-inference-slowdown", "0%",
                "--finetune", str(job)], ["--max-inference-slowdown", "10%"]):
        assert main(["run", *common, "--output", str(tmp_path / "x.jsonl"), *bad]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("limit,first,each", [(0.1, 0.25, 0.1), (0.02, 0.4, 0.2), (0.5, 0.05, 0.05)])
def test_the_slowdown_bound_holds_over_a_job_and_spends_its_room(limit, first, each):
    """Blocks of about a second (varying by 20%), whose windows cost `first` seconds for the
    first of a block (its reverse sweep) and `each` for every other: the time windows added, summed
    from the simulated blocks themselves, stays within the bound (plus one block's windows) and
    uses most of it (or of the blocks' room for windows, where that is less)."""
    import random

    from flexoff.finetune.coserve import SlowdownBound

    rng = random.Random(0)
    bound, inference, extra, windows = SlowdownBound(limit), 0.0, 0.0, 0
    for _ in range(400):
        base = 1.0 + 0.2 * rng.random()
        k = bound.allow(4)
        assert 0 <= k <= 4
        added = first + each * (k - 1) if k else 0.0
        bound.record(base + added, k)
        inference, extra, windows = inference + base, extra + added, windows + k
    worst = first + 3 * each  # a block's four windows
    assert extra <= limit * inference + worst, (extra, inference)
    room = min(limit * inference, 400 * worst)  # what the bound, or the blocks' room, allows
    assert extra >= 0.75 * room - 2 * worst, (extra, inference)
    assert windows > 0 and abs(bound.slowdown - extra / inference) < 0.05


@pytest.mark.parametrize("text,why", [("data: x.jsonl\n", "'output' is required"),
                                      ("data: x\noutput: y\nlr: fast\n", "lr must be"),
                                      ("data: x\noutput: y\nwarp: 9\n", "unknown field 'warp'"),
                                      ("[1, 2]\n", "one mapping")])
def test_a_bad_job_file_is_one_line_and_exit_2(tmp_path, capsys, text, why):
    from flexoff.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(text)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    code = main(["run", "--model", "dummy:llama-tiny", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                 "--finetune", str(job)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and why in err and len(err.splitlines()) == 1, err


def test_a_killed_coserved_run_resumes_prompts_once_and_the_adapter(tmp_path):
    """A real `flexoff run --finetune` process killed with SIGKILL mid-run and started again:
    every prompt answered exactly once, and the adapter of an uninterrupted run (the same data
    order from the last checkpoint; co-served steps split over blocks differently, so equal
    within float32 error)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i}: " + "ab" * (i % 5 + 3)}) + "\n" for i in range(9)))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "word " * (i % 7 + 1), "max_new_tokens": 6})
                               + "\n" for i in range(60)))

    def cmd(name: str) -> list[str]:
        job = tmp_path / f"{name}.yaml"
        job.write_text(f"data: {data}\noutput: {tmp_path / name}\nsteps: 30\nbatch_size: 3\nlr: 0.01\nlora_r: 4\n"
                       "save_every: 3\nseed: 5\nname: job\n")
        return [sys.executable, "-m", "flexoff.cli", "run", "--model", "dummy:llama-tiny", "--input", str(prompts),
                "--output", str(tmp_path / f"{name}.jsonl"), "--finetune", str(job), "--gpu-batch-size", "2",
                "--num-gpu-batches", "2", "--dtype", "float32", "-q"]

    subprocess.run(cmd("whole"), check=True, cwd=tmp_path)
    proc = subprocess.Popen(cmd("killed"), cwd=tmp_path)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 7):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "adapter_model.safetensors").exists()  # it really stopped mid-run
    subprocess.run(cmd("killed"), check=True, cwd=tmp_path)
    ids = [json.loads(line)["id"] for line in (tmp_path / "killed.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(f"q{i}" for i in range(60))  # each exactly once
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("whole", "killed"))
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).norm()) <= 1e-4 * float(a[k].norm()) + 1e-6, k


def test_flexoff_run_finetune_under_policy_auto_plans_the_block_and_trains_the_standalone_adapter(tmp_path, capsys):
    """`--policy auto --finetune`: the co-served plan is searched (and said), every prompt gets the
    tokens of a plain run, and the job's adapter is the one `flexoff finetune` trains."""
    from flexoff.cli import main
    from flexoff.policy.hardware import h200, save

    hw = h200()
    profile = tmp_path / "hw.json"
    save(hw.__class__(**{**hw.__dict__, "device": "cpu", "name": "test"}), profile)
    data, prompts = _files(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(f"data: {data}\noutput: {tmp_path / 'co'}\nsteps: 4\nbatch_size: 2\nlr: 0.01\nlora_r: 4\nseed: 3\n")
    common = ["--model", "dummy:llama-tiny", "--input", str(prompts), "--dtype", "float32", "-q"]
    assert main(["run", *common, "--output", str(tmp_path / "co.jsonl"), "--finetune", str(job), "--policy", "auto",
                 "--hardware", str(profile), "--finetune-batches", "2", "--max-inference-slowdown", "30%"]) == 0
    err = capsys.readouterr().err
    assert "co-serving plan: " in err and "windows take" in err and "training tok/s" in err, err
    assert main(["run", *common, "--output", str(tmp_path / "plain.jsonl")]) == 0
    alone = _standalone_adapter(tmp_path, data, 4)
    co, plain = _answers(tmp_path / "co.jsonl"), _answers(tmp_path / "plain.jsonl")
    assert co.keys() == plain.keys() and all(co[k]["completion"] == plain[k]["completion"] for k in co)
    _assert_same_adapter(tmp_path / "co", alone)
