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
    """The H200 preset's rates, as if measured on this machine with CPU attention at `cpu_attn` (and
    host memory serving reads at 100 GB/s)."""
    hw = hardware.h200()
    return replace(calibration.at_cpu_attention(hw, cpu_attn), machine=hardware.machine_key(), host_read_bdw=100e9)


def decode(read: float, net_s: float, calls: int, disk: float = 0.0, hw: hardware.Hardware | None = None) -> dict:
    """A decode's counters: `read` bytes over `net_s` seconds beyond the fixed cost of `calls` calls
    and the page-cache copies of `disk` bytes read from disk (at `hw`'s host memory rate)."""
    copy = 2 * disk / (hw or here()).host_read_bdw
    return {"cpu_attention": read, "cpu_attention_compute_s": net_s + calls * CPU_ATTN_CALL_S + copy,
            "cpu_attention_calls": calls, "disk_read": disk, "h2d": 7e12}


def test_a_decode_gives_its_read_rate_net_of_the_fixed_cost_per_call_and_its_disk_copies():
    hw = here()
    assert hw.host_read_bdw > 0
    assert calibration.lane_rate(decode(42e9 * 3.0, 3.0, 4464), hw) == pytest.approx(42e9)
    with_disk = decode(42e9 * 3.0, 3.0, 4464, disk=20e9, hw=hw)  # 0.4 s of host memory copying 20 GB
    assert with_disk["cpu_attention_compute_s"] == pytest.approx(3.0 + 4464 * CPU_ATTN_CALL_S + 40e9 / hw.host_read_bdw)
    assert calibration.lane_rate(with_disk, hw) == pytest.approx(42e9)
    assert calibration.lane_rate({**with_disk, "disk_read": 0}, hw) < 0.9 * 42e9  # the copies counted as reading
    assert calibration.lane_rate(decode(42e9 * 0.5, 0.5, 100), hw) is None  # lane busy under a second
    assert calibration.lane_rate(decode(42e9 * 2.0, 2.0, 8), hw) is None  # too few calls
    assert calibration.lane_rate(decode(42e9 * 0.3, 0.3, 5000), hw) is None  # mostly fixed cost (2 s of it)
    assert calibration.lane_rate({}, hw) is None  # no CPU attention
    assert calibration.lane_rate({**with_disk, "cpu_attention_calls": "many"}, hw) is None


def test_calibration_reads_back_the_rate_the_cost_model_priced_the_lane_at():
    """A decode whose lane took exactly the cost model's seconds, cache rows and weights on disk
    included, gives back the rate the model priced it at."""
    spec = load_model("dummy:opt-30b").spec
    x = {"wg": 0.1, "wc": 0.8, "wd": 0.1, "cg": 0.04, "cc": 0.92, "cd": 0.04, "hg": 0.04, "hc": 0.96, "hd": 0}
    hw = here(44e9)
    m = CostModel(spec, hw, Workload(512, 32, 2, None), Choice(24, 3, cpu_cache_compute=True))
    read, sec = m.cpu_attention(x)
    pairs = 48 * 31
    traffic = {"cpu_attention": read * pairs, "cpu_attention_compute_s": sec * pairs,
               "cpu_attention_calls": 3 * pairs, "disk_read": m.pair_disk_bytes(x) * pairs}
    assert traffic["disk_read"] > 0
    assert calibration.lane_rate(traffic, hw) == pytest.approx(44e9)


def test_the_median_of_the_last_long_decodes_prices_cpu_attention_on_this_machine_only(cache):
    rates = [30e9 + 1e9 * i for i in range(calibration.SAMPLES + 5)]
    for i, r in enumerate(rates):
        disk = 5e9 * (i % 3)  # some read the disk, at the host memory rate of the profile they price
        assert calibration.record(decode(r * 2.0, 2.0, 1000, disk=disk), steps=31) is not None
    assert calibration.record(decode(90e9 * 2.0, 2.0, 1000), steps=calibration.MIN_STEPS - 1) is None  # a warm-up
    kept = calibration.read_decodes(calibration.path())
    assert len(kept) == calibration.SAMPLES  # the oldest dropped
    hw = here(20e9)
    assert [calibration.lane_rate(d, hw) for d in kept] == pytest.approx(rates[-calibration.SAMPLES:])
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
    calibration.record(decode(40e9 * 3.0, 3.0, 2000), steps=31)
    said: list[str] = []
    got = hardware.load(str(path), log=said.append)
    assert got.cpu_attn_bdw == pytest.approx(40e9) and got.machine == hw.machine
    assert len(said) == 1 and "40.0 GB/s" in said[0] and "25.0" in said[0]
    monkeypatch.setenv(calibration.ENV, "0")
    assert hardware.load(str(path)) == hw  # turned off: the profile's own rate
    assert calibration.record(decode(50e9 * 3.0, 3.0, 2000), steps=31) is None  # ... and nothing kept
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


def test_an_unreadable_or_foreign_file_keeps_no_decodes(cache):
    where = calibration.path()
    where.parent.mkdir(parents=True)
    for text in ("not json", '{"cpu_attn_bdw": [4e10]}', '{"decodes": 3}', '{"decodes": [{"cpu_attention": "x"}]}'):
        where.write_text(text)
        assert calibration.read_decodes(where) == []
        assert calibration.calibrated(here(25e9)) == here(25e9)
    calibration.record(decode(40e9 * 3.0, 3.0, 2000), steps=31)  # starts the file over
    assert calibration.lane_rate(calibration.read_decodes(where)[0], here()) == pytest.approx(40e9)


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


def test_disk_reads_beside_cpu_attention_take_host_memory_from_the_lane():
    """Cache rows on disk: their copies out of the page cache (each byte read and written) add
    to the lane's seconds and to host memory's term of the pair."""
    spec = load_model("dummy:opt-30b").spec
    hw = here(45e9)
    base = {"wg": 0.157, "wc": 0.843, "wd": 0, "cg": 0, "cc": 0.9, "cd": 0.1, "hg": 0.04, "hc": 0.96, "hd": 0}
    m = CostModel(spec, hw, Workload(512, 32, 2, None), Choice(24, 3, cpu_cache_compute=True))
    rows = 0.1 * 72 * (512 + 16) * 2 * 7168 * 2  # the pair's cache rows on disk, fp16
    assert m.pair_disk_bytes(base) == pytest.approx(rows)
    read, sec = m.cpu_attention(base)
    assert sec == pytest.approx(read / 45e9 + 3 * CPU_ATTN_CALL_S + 2 * rows / hw.host_read_bdw)
    on_cpu = {**base, "cc": 1.0, "cd": 0.0}
    (pool, terms), (pool_cpu, terms_cpu) = ((m.cache_pool(x, t), t) for x in (base, on_cpu) for t in [m.terms(x)])
    rate = hw.decode_link_bdw(True)
    layers = sum(terms[("g", k)]["ctog"] - terms_cpu[("g", k)]["ctog"] for k in ("attn", "mlp")) * rate
    staged, unread, copied = rows, rows, 2 * rows  # to the GPU; by CPU attention; by the page-cache copies
    assert pool["cpu_mem"] - pool_cpu["cpu_mem"] == pytest.approx((layers + staged - unread + copied) / hw.host_read_bdw)


def test_a_gpu_blocks_decode_over_a_16_bit_cache_is_kept_and_others_are_not(cache):
    """The engine's hook (flexoff.generation.keep_lane_counters): a block on a GPU with a 16-bit
    cache keeps its decode's counters; a warm-up's few token steps, a 4-bit cache (its lane also
    dequantizes) and a CPU device keep nothing."""
    from types import SimpleNamespace

    import torch

    from flexoff.generation import keep_lane_counters
    from flexoff.offload.engine import BlockResult

    def engine(device: str, compress_cache: bool = False) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), policy=SimpleNamespace(compress_cache=compress_cache))

    traffic = decode(40e9 * 3.0, 3.0, 2000, disk=5e9)
    for eng, steps in ((engine("cuda"), 4), (engine("cuda", True), 32), (engine("cpu"), 32)):
        keep_lane_counters(eng, BlockResult(1.0, 30.0, steps, traffic_decode=traffic))
        assert calibration.read_decodes(calibration.path()) == []
    keep_lane_counters(engine("cuda"), BlockResult(1.0, 30.0, 32, traffic_decode=traffic))
    kept = calibration.read_decodes(calibration.path())
    assert len(kept) == 1 and calibration.lane_rate(kept[0], here()) == pytest.approx(40e9)
