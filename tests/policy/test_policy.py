"""The Policy type: validation, JSON form, and the FlexGen-style CLI flags."""

from __future__ import annotations

import json

import pytest

from flexoff.cli import build_policy
from flexoff.errors import PolicyError
from flexoff.policy.policy import PERCENT_FIELDS, Policy


def test_json_round_trip(tmp_path):
    p = Policy(gpu_batch_size=48, num_gpu_batches=3, w_gpu_percent=20, w_cpu_percent=80, cache_gpu_percent=0,
               cache_cpu_percent=100, act_gpu_percent=0, act_cpu_percent=100, cpu_cache_compute=True)
    p.save(tmp_path / "p.json")
    assert Policy.load(tmp_path / "p.json") == p
    assert json.loads((tmp_path / "p.json").read_text())["gpu_batch_size"] == 48
    assert p.block_size == 144 and p.w_disk_percent == 0 and p.percent == (20, 80, 0, 100, 0, 100)


@pytest.mark.parametrize("kw,msg", [
    ({"gpu_batch_size": 0}, "positive integer"),
    ({"num_gpu_batches": 1.5}, "positive integer"),
    ({"w_gpu_percent": -1}, "from 0 to 100"),
    ({"cache_gpu_percent": 70, "cache_cpu_percent": 40}, "over 100"),
    ({"act_cpu_percent": "50"}, "from 0 to 100"),
    ({"quant_bits": 3}, "quant_bits"),
])
def test_invalid_values_are_policy_errors(kw, msg):
    with pytest.raises(PolicyError, match=msg):
        Policy(**kw)


def test_a_described_policy_parses_back():
    """Percentages as describe() prints them (six significant digits) may sum a little over 100:
    the policy a search printed is accepted as written, with nothing on the disk."""
    p = Policy(gpu_batch_size=48, num_gpu_batches=8, w_gpu_percent=39.3, w_cpu_percent=60.7, cache_gpu_percent=0,
               cache_cpu_percent=100, act_gpu_percent=100 / 48, act_cpu_percent=100 - 100 / 48)
    printed = p.describe().split("(")[1].split(")")[0].split(", ")
    assert printed[4:] == ["2.08333", "97.9167"]
    again = Policy(gpu_batch_size=48, num_gpu_batches=8, **dict(zip(PERCENT_FIELDS, map(float, printed))))
    assert again.act_disk_percent == 0 and again.w_disk_percent == 0


def test_unknown_fields_and_bad_files(tmp_path):
    with pytest.raises(PolicyError, match="unknown policy field"):
        Policy.from_dict({"gpu_batch_size": 2, "wg": 10})
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(PolicyError, match="not valid JSON"):
        Policy.load(tmp_path / "bad.json")


def test_flexgen_flags(tmp_path):
    assert build_policy(None, None, None, None, None, None, None, None) is None
    assert build_policy("auto", None, None, None, None, None, None, None) == "auto"
    p = build_policy(None, (20, 80, 0, 100, 0, 100), 48, 3, True, True, None, None)
    assert p == Policy(48, 3, 20, 80, 0, 100, 0, 100, cpu_cache_compute=True, overlap=False)
    base = Policy(gpu_batch_size=8, compress_weight=True)
    base.save(tmp_path / "b.json")
    q = build_policy(str(tmp_path / "b.json"), None, None, 4, None, None, None, True)
    assert q == base.replace(num_gpu_batches=4, compress_cache=True)
