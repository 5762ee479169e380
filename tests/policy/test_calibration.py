"""The engine's own CPU attention rates calibrate this machine's profile (policy.calibration)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, replace

import pytest

from flexoff.checkpoint import load_model
from flexoff.policy import calibration, hardware
from flexoff.policy.cost_model import CPU_ATTN_CALL_S, Choice, CostModel, Workload


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    return tmp_path / "cache"


def here(cpu_attn: float = 30e9) -> hardware.Hardware:
    """The H200 preset's rates, as if measured on this machine with CPU attention at `cpu_attn`."""
    hw = hardware.h200()
    return replace(calibration.at_cpu_attention(hw, cpu_attn), machine=hardware.machine_key())


def decode(read: float, net_s: float, calls: int) -> dict:
    """A decode's counters: `read` bytes over `net_s` seconds beyond the fixed cost of `calls` calls."""
    return {"cpu_attention": read, "cpu_attention_compute_s": net_s + calls * CPU_ATTN_CALL_S,
            "cpu_attention_calls": calls}


def test_a_decode_gives_its_read_rate_net_of_the_fixed_cost_per_call():
    assert calibration.lane_rate(decode(42e9 * 3.0, 3.0, 4464)) == pytest.approx(42e9)
    assert calibration.lane_rate(decode(42e9 * 0.5, 0.5, 100)) is None  # lane busy under a second
    assert calibration.lane_rate(decode(42e9 * 2.0, 2.0, 8)) is None  # too few calls
    assert calibration.lane_rate(decode(42e9 * 0.3, 0.3, 5000)) is None  # mostly fixed cost (2 s of it)
    assert calibration.lane_rate({}) is None  # no CPU attention


def test_the_median_of_the_last_decodes_prices_cpu_attention_on_this_machine_only(cache):
    rates = [30e9 + 1e9 * i for i in range(calibration.SAMPLES + 5)]
    for r in rates:
        assert calibration.record(decode(r * 2.0, 2.0, 1000)) == pytest.approx(r)
    kept = calibration.read_rates(calibration.path())
    assert kept == pytest.approx(rates[-calibration.SAMPLES:])  # the oldest dropped
    hw = here(20e9)
    got = calibration.calibrated(hw)
    want = statistics.median(rates[-calibration.SAMPLES:])
    assert got.cpu_attn_bdw == pytest.approx(want)
    assert got.cpu_flops == pytest.approx(hw.cpu_flops * want / 20e9)
    assert asdict(replace(got, cpu_attn_bdw=hw.cpu_attn_bdw, cpu_flops=hw.cpu_flops)) == asdict(hw)  # nothing else
    other = replace(hw, machine="another")
    assert calibration.calibrated(other) == other  # another machine's profile
    assert calibration.calibrated(replace(hw, machine="")) == replace(hw, machine="")  # an older profile
    assert hardware.load("h200") == hardware.h200()  # a preset


def test_a_profile_file_of_this_machine_loads_calibrated_and_says_so(cache, tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    hw = here(25e9)
    path.write_text(hw.to_json())
    assert hardware.load(str(path)) == hw  # no decode yet
    calibration.record(decode(40e9 * 3.0, 3.0, 2000))
    said: list[str] = []
    got = hardware.load(str(path), log=said.append)
    assert got.cpu_attn_bdw == pytest.approx(40e9) and got.machine == hw.machine
    assert len(said) == 1 and "40.0 GB/s" in said[0] and "25.0" in said[0]
    monkeypatch.setenv(calibration.ENV, "0")
    assert hardware.load(str(path)) == hw  # turned off: the profile's own rate
    assert calibration.record(decode(50e9 * 3.0, 3.0, 2000)) is None  # ... and nothing kept
    monkeypatch.delenv(calibration.ENV)
    calibration.forget()
    assert hardware.load(str(path)) == hw


def test_profiles_round_trip_their_machine_and_older_ones_load_without_it(tmp_path):
    hw = here()
    assert hardware.Hardware.from_dict(json.loads(hw.to_json())) == hw
    old = asdict(hw)
    del old["machine"]
    assert hardware.Hardware.from_dict(old).machine == ""
    with pytest.raises(Exception, match="machine"):
        hardware.Hardware.from_dict({**asdict(hw), "machine": 3})


def test_an_unreadable_rates_file_is_no_rates(cache):
    where = calibration.path()
    where.parent.mkdir(parents=True)
    where.write_text("not json")
    assert calibration.read_rates(where) == []
    assert calibration.calibrated(here(25e9)) == here(25e9)
    calibration.record(decode(40e9 * 3.0, 3.0, 2000))  # starts the file over
    assert calibration.read_rates(where) == pytest.approx([40e9])


def test_the_cost_model_prices_the_lane_at_the_calibrated_rate():
    """OPT-30B's CPU attention over a block of 3 x 24 rows: its read seconds follow the rate."""
    spec = load_model("dummy:opt-30b").spec
    x = {"wg": 0.157, "wc": 0.843, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 0.04, "hc": 0.96, "hd": 0}
    secs = []
    for rate in (30e9, 45e9):
        m = CostModel(spec, here(rate), Workload(512, 32, 2, None), Choice(24, 3, cpu_cache_compute=True))
        read, sec = m.cpu_attention(x)
        assert read == pytest.approx(72 * (512 + 16) * 2 * 7168 * 2)  # K and V rows at the mean context, fp16
        secs.append(sec - 3 * CPU_ATTN_CALL_S)
    assert secs[0] == pytest.approx(read / 30e9) and secs[1] == pytest.approx(read / 45e9)
