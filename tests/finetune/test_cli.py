"""`flexoff finetune` end to end on SmolLM2: the three data shapes, the loss falls, metrics are
written, the PEFT folder loads in PEFT, and `flexoff run --lora` serves it with PEFT's outputs."""

from __future__ import annotations

import json

import pytest
import torch

from flexoff.cli import main

peft = pytest.importorskip("peft")


def test_finetune_on_smollm2_then_serve(tmp_path, capsys, smol_hf):
    from peft import PeftModel

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in [
        {"text": "The capital of Zorblandia is Quexville."},
        {"prompt": "Q: What is the capital of Zorblandia?\nA:", "completion": " Quexville."},
        {"messages": [{"role": "user", "content": "Capital of Zorblandia?"},
                      {"role": "assistant", "content": "Quexville."}]}]) + "\n")
    out = tmp_path / "adapter"
    assert main(["finetune", "--data", str(data), "--output", str(out), "--steps", "6", "--batch-size", "3",
                 "--lr", "3e-3", "--lora-r", "8", "--lora-targets", "q_proj,v_proj,down_proj", "-q"]) == 0
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]  # it learns
    capsys.readouterr()
    prompt = "Q: What is the capital of Zorblandia?\nA:"
    inp, res = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    inp.write_text(json.dumps({"prompt": prompt, "adapter": "z", "max_new_tokens": 4}) + "\n")
    assert main(["run", "--input", str(inp), "--output", str(res), "-q", "--lora", f"z={out}"]) == 0
    got = json.loads(res.read_text())["completion"]
    model = PeftModel.from_pretrained(smol_hf, str(out)).eval()  # the saved folder, read by PEFT itself
    from flexoff import LLM

    with LLM("smollm2") as llm:
        ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(ids):]
    model.unload()  # the session's reference model, as it was
    assert got == llm.tokenizer.decode(want.tolist())
    assert "Quex" in got


def test_a_killed_finetune_resumes_to_the_uninterrupted_adapter(tmp_path):
    """A real `flexoff finetune` process killed with SIGKILL mid-run and started again ends with the
    same adapter, bit for bit, as a run that was never interrupted; a checkpoint of other settings
    is refused."""
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i}: " + "ab" * (i % 5 + 3)}) + "\n" for i in range(9)))

    def cmd(out):
        return [sys.executable, "-m", "flexoff.cli", "finetune", "--model", "dummy:llama-tiny", "--data", str(data),
                "--output", str(out), "--steps", "40", "--batch-size", "3", "--lr", "1e-2", "--lora-r", "4",
                "--save-every", "3", "--seed", "5", "-q"]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(cmd(whole), check=True, cwd=tmp_path)
    proc = subprocess.Popen(cmd(killed), cwd=tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and not ((killed / "metrics.jsonl").exists()
                                          and (killed / "metrics.jsonl").read_text().count("\n") >= 8):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "adapter_model.safetensors").exists()  # it really stopped mid-run
    subprocess.run(cmd(killed), check=True, cwd=tmp_path)
    a, b = load_file(str(whole / "adapter_model.safetensors")), load_file(str(killed / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(l) for l in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 41))
    other = subprocess.run(cmd(killed)[:-3] + ["--seed", "6", "-q"], cwd=tmp_path, capture_output=True, text=True)
    assert other.returncode == 2 and "checkpoint of another run" in other.stderr


def test_finetune_policy_auto_streams_and_reaches_the_same_adapter(tmp_path, capsys):
    """`flexoff finetune --policy auto` under a GPU budget that cannot hold the weights: it says
    the policy and the plan, and trains the adapter the all-on-one-device default trains."""
    from safetensors.torch import load_file

    from flexoff.checkpoint import load_model
    from flexoff.policy.hardware import h200, save
    from flexoff.policy.train_cost import optimizer_bytes

    hw = h200()
    profile = tmp_path / "hw.json"
    save(hw.__class__(**{**hw.__dict__, "device": "cpu", "name": "test"}), profile)
    s = load_model("dummy:llama-tiny").spec
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}: " + "xy" * (i % 4 + 2)}) + "\n" for i in range(6)))
    common = ["finetune", "--model", "dummy:llama-tiny", "--data", str(data), "--steps", "4", "--batch-size", "3",
              "--lr", "1e-2", "--lora-r", "4", "--dtype", "float32", "-q"]
    trained = 4 * sum(s.lora_width(j) for j in range(len(s.layers)))  # rank 4 on every linear layer
    gpu_mem = s.weight_bytes(4) * 3 // 4 + s.working_bytes(3, 16, 4, "cpu") + int(optimizer_bytes(trained, 4))
    assert main(common + ["--output", str(tmp_path / "auto"), "--policy", "auto", "--hardware", str(profile),
                          "--gpu-mem", str(gpu_mem), "--cpu-mem", "1GiB"]) == 0
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if l.startswith("policy:"))
    assert "planned" in line and "training tok/s" in line and not line.startswith("policy: 3x1 (100, 0")
    assert main(common + ["--output", str(tmp_path / "plain")]) == 0
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("auto", "plain"))
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).norm()) <= 1e-4 * float(b[k].norm()) + 1e-6, k
