"""`flexoff run`: the JSONL job, its errors and resumption."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexoff.cli import main
from reference import PROMPTS


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_out(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def test_run_writes_completions_equal_to_transformers(tiny, tiny_refs, tmp_path, capsys):
    inp = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in PROMPTS])
    out = tmp_path / "o.jsonl"
    code, err = run(capsys, "run", "--model", str(tiny["opt"].path), "--input", str(inp), "--output", str(out),
                    "--max-new-tokens", "8", "--gpu-batch-size", "2", "--num-gpu-batches", "2", "-q")
    assert code == 0, err
    recs = {r["id"]: r for r in read_out(out)}
    assert sorted(recs) == [str(i) for i in range(1, len(PROMPTS) + 1)]  # ids default to line numbers
    for i, (ref, _) in enumerate(tiny_refs["opt"], 1):
        r = recs[str(i)]
        assert r["completion_tokens"] == 8 and r["finish_reason"] == "length"
        assert r["prompt_tokens"] == len(PROMPTS[i - 1])
    last = err.strip().splitlines()[-1]
    assert "generated tokens 40" in last and "prefill" in last and "decode" in last and "throughput" in last


def test_default_model_answers(tmp_path, capsys):
    inp = write_prompts(tmp_path / "p.jsonl", [{"prompt": "What is the capital of France?", "id": "q"}])
    out = tmp_path / "o.jsonl"
    code, err = run(capsys, "run", "--input", str(inp), "--output", str(out), "--chat", "-q")
    assert code == 0, err
    assert "Paris" in read_out(out)[0]["completion"]


BAD_FLAGS = [
    (["--percent", "120", "0", "100", "0", "100", "0"], "w_gpu_percent must be a number from 0 to 100"),
    (["--percent", "60", "60", "100", "0", "100", "0"], "over 100"),
    (["--gpu-batch-size", "0"], "gpu_batch_size must be a positive integer"),
    (["--temperature", "-1"], "temperature"),
    (["--gpu-mem", "lots"], "is not a size"),
    (["--model", "no-such-model"], "unknown model"),
    (["--policy", "missing.json"], "cannot read policy file"),
    (["--policy", "auto", "--gpu-batch-size", "4"], "drop the explicit policy flags"),
    (["--device", "tpu"], "device"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flags_exit_2_with_one_line(tiny, tmp_path, capsys, flags, message):
    inp = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6]}])
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "old"}\n')
    args = ["run", "--model", str(tiny["opt"].path), "--input", str(inp), "--output", str(out), "-q"]
    code, err = run(capsys, *(args + flags))
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out.read_text() == '{"id": "old"}\n'


BAD_INPUTS = [
    ('{"prompt_ids": [5]}\n{"prompt_ids": [6]\n', "line 2: not valid JSON"),
    ('{"prompt": "   "}\n', "line 1: the prompt is empty"),
    ('{"text": "no prompt key"}\n', "line 1: unknown field 'text'"),
    ('{"id": "no prompt"}\n', "line 1: give exactly one of 'prompt', 'messages' or 'prompt_ids'"),
    ('[1, 2]\n', "line 1: expected a JSON object"),
    ('{"prompt_ids": [5]}\n{"prompt_ids": [' + ",".join(["5"] * 300) + "]}\n", "line 2: the prompt of 300 tokens"),
    ('{"prompt_ids": [5], "id": 1}\n{"prompt_ids": [6], "id": "1"}\n', "duplicate id"),
    ('{"prompt_ids": [5], "top_k": -2}\n', "line 1: top_k"),
    ("", "holds no prompts"),
]


@pytest.mark.parametrize("text,message", BAD_INPUTS)
def test_bad_input_files_exit_2_and_leave_output_alone(tiny, tmp_path, capsys, text, message):
    inp = tmp_path / "p.jsonl"
    inp.write_text(text)
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "old"}\n')
    code, err = run(capsys, "run", "--model", str(tiny["opt"].path), "--input", str(inp), "--output", str(out), "-q")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert out.read_text() == '{"id": "old"}\n'


def test_missing_and_corrupt_files(tiny, tmp_path, capsys):
    inp = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6]}])
    out = tmp_path / "o.jsonl"
    code, err = run(capsys, "run", "--model", str(tiny["opt"].path), "--input", str(tmp_path / "nope.jsonl"),
                    "--output", str(out))
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(Path(tiny["opt"].path / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    code, err = run(capsys, "run", "--model", str(bad), "--input", str(inp), "--output", str(out))
    assert code == 2 and "cannot read" in err and not out.exists()
    (bad / "config.json").write_text("{broken")
    code, err = run(capsys, "run", "--model", str(bad), "--input", str(inp), "--output", str(out))
    assert code == 2 and "config.json is not valid JSON" in err
    code, err = run(capsys, "run", "--model", str(tmp_path / "x.gguf"), "--input", str(inp), "--output", str(out))
    assert code == 2 and "does not exist" in err
    out.write_text('{"id": "1"}\nthis is not json\n{"id": "2"}\n')
    code, err = run(capsys, "run", "--model", str(tiny["opt"].path), "--input", str(inp), "--output", str(out))
    assert code == 2 and "line 2 is not a flexoff result" in err


def test_pickled_weights_need_allow_pickle(tiny, tiny_refs, tmp_path, capsys):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((tiny["llama"].path / "config.json").read_text())
    torch.save(tiny["llama"].hf.state_dict(), folder / "pytorch_model.bin")
    inp = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": PROMPTS[0]}])
    out = tmp_path / "o.jsonl"
    code, err = run(capsys, "run", "--model", str(folder), "--input", str(inp), "--output", str(out), "-q")
    assert code == 2 and "--allow-pickle" in err and not out.exists()
    code, err = run(capsys, "run", "--model", str(folder), "--input", str(inp), "--output", str(out), "-q",
                    "--allow-pickle", "--max-new-tokens", "8")
    assert code == 0, err
    assert read_out(out)[0]["completion_tokens"] == 8


def test_sharded_safetensors(tiny, tiny_refs, tmp_path):
    from flexoff import LLM

    folder = tmp_path / "sharded"
    tiny["qwen2"].hf.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").exists()
    with LLM(str(folder)) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["qwen2"]]


def _job(tmp_path: Path, n: int = 24) -> Path:
    rows = [{"prompt": f"prompt number {i} " + "x" * (i % 7), "id": f"r{i}"} for i in range(n)]
    return write_prompts(tmp_path / "p.jsonl", rows)


JOB_ARGS = ["--model", "dummy:opt-tiny", "--max-new-tokens", "6", "--gpu-batch-size", "2",
            "--num-gpu-batches", "2", "-q"]


def test_interrupted_job_resumes_without_loss_or_duplicates(tmp_path, capsys, monkeypatch):
    inp = _job(tmp_path)
    full = tmp_path / "full.jsonl"
    assert main(["run", "--input", str(inp), "--output", str(full)] + JOB_ARGS) == 0
    part = tmp_path / "part.jsonl"
    from flexoff import jobs

    writes = {"n": 0}
    original = jobs.ResultWriter.write

    def crash_after_two(self, records):
        if writes["n"] == 2:
            raise KeyboardInterrupt
        writes["n"] += 1
        original(self, records)

    monkeypatch.setattr(jobs.ResultWriter, "write", crash_after_two)
    assert main(["run", "--input", str(inp), "--output", str(part)] + JOB_ARGS) == 130
    assert len(read_out(part)) == 8  # two blocks of four
    monkeypatch.setattr(jobs.ResultWriter, "write", original)
    with open(part, "a") as f:  # a line cut short by the crash
        f.write('{"id": "r9", "prompt": "pro')
    assert main(["run", "--input", str(inp), "--output", str(part)] + JOB_ARGS) == 0
    assert "resumed: 8 of 24" in capsys.readouterr().err
    got = read_out(part)
    assert sorted(r["id"] for r in got) == sorted(f"r{i}" for i in range(24))
    assert {r["id"]: r for r in got} == {r["id"]: r for r in read_out(full)}


def test_killed_process_resumes(tmp_path):
    """A real SIGKILL between blocks: the rerun completes every id exactly once."""
    inp = _job(tmp_path, 64)
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "flexoff.cli", "run", "--input", str(inp), "--output", str(out)] + JOB_ARGS
    cmd[cmd.index("6")] = "40"  # longer generations: time to kill mid-job
    proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(out.read_text().splitlines())
    assert 4 <= before < 64
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in read_out(out)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(64)) and len(ids) == 64


def test_console_script_errors_have_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "flexoff.cli", "run", "--model", "dummy:nope"],
                          capture_output=True, text=True, cwd=tmp_path, input="")
    assert done.returncode == 2
    assert done.stderr.startswith("flexoff: error: unknown dummy model") and "Traceback" not in done.stderr
