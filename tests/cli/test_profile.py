"""`flexoff profile`: what it says while it measures, and what it saves (the slow measurements
stood in for; tests/policy covers the measurements themselves)."""

from __future__ import annotations

import json

import torch

from flexoff import profiler
from flexoff.cli import main
from flexoff.policy import hardware


def test_profile_reports_each_stage_and_saves_the_engine_probes_beside_the_machine_rates(tmp_path, monkeypatch,
                                                                                            capsys):
    monkeypatch.setenv("FLEXOFF_CACHE", str(tmp_path / "cache"))
    machine = hardware.h200()
    order: list[str] = []

    def rates(offload_dir=None, quick=False):
        order.append("rates")
        return machine

    def step(dev, offload_dir=None, lora=False, packed=False, **_):
        order.append("step")
        return 2e-3 if lora else 1.5e-3 if packed else 1e-3

    monkeypatch.setattr(hardware, "measure", rates)
    monkeypatch.setattr(profiler, "host_step", step)
    monkeypatch.setattr(profiler, "decode_link_rate", lambda dev, offload_dir=None: 4.2e10 if dev.type == "cuda" else 0.0)
    out = tmp_path / "hw.json"
    assert main(["profile", "--output", str(out)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("profile ")]
    stages = ["profile 1/3: host, link, disk and GPU rates", "profile 2/3: the engine's host step (plain, with LoRA, 4-bit)"]
    if torch.cuda.is_available():
        stages.append("profile 3/3: the engine's decode link rate")
    assert err == stages
    assert order == ["rates", "step", "step", "step"]  # the machine's rates before any engine runs
    saved = json.loads(out.read_text())
    assert saved["host_step_s"] == 1e-3 and saved["packed_host_step_s"] == 1.5e-3
    assert abs(saved["lora_host_step_s"] - 1e-3) < 1e-12  # what LoRA adds to the plain step
    assert saved["cpu_attn_bdw"] == machine.cpu_attn_bdw and saved["ctog_bdw"] == machine.ctog_bdw
    assert json.loads(hardware.cache_path().read_text()) == saved  # cached for later runs too
