"""Reliability: bad input refused up front as one line with exit 2, one writer per output,
JSONL as the format defines it, nothing left in the temporary folder. Each numbered test is a
finding of issue 19 (it failed on 46c8e58)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexoff.cli import main
from flexoff.offload import tiers
from flexoff.validate import REQUEST_KEYS, jsonl_lines, read_jsonl

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def one_line_exit_2(code: int, err: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a model starts loading: errors must come before."""
    import flexoff.api

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the input was refused")

    monkeypatch.setattr(flexoff.api, "load_model", refuse)


def job(tmp_path: Path, lines: list[str], out_text: str = '{"id": "old"}\n') -> tuple[Path, Path]:
    inp, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    inp.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    out.write_text(out_text)
    return inp, out


# ---- 1. two writers on one output ---------------------------------------------------------
def test_1_a_second_job_on_the_same_output_is_refused_naming_the_first(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": "r{i}", "prompt": "p{i}"}}\n' for i in range(300)))
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "flexoff.cli", "run", "--model", "dummy:opt-tiny", "-q", "--input", str(prompts),
           "--output", str(out), "--max-new-tokens", "16", "--gpu-batch-size", "2"]
    first = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 1):
        time.sleep(0.05)
    second = subprocess.run(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True, timeout=120)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert second.returncode == 2 and f"pid {first.pid}" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    ids = [json.loads(l)["id"] for l in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(300))  # every id exactly once
    assert not (tmp_path / ".o.jsonl.lock").exists()


# ---- 2. output errors before the model loads -------------------------------------------------
def test_2_bad_output_paths_are_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    inp, out = job(tmp_path, ['{"prompt": "hi"}'])
    (tmp_path / "ro.jsonl").write_text("")
    (tmp_path / "ro.jsonl").chmod(0o444)
    for target, says in ((tmp_path / "missing" / "o.jsonl", "does not exist"), (tmp_path, "is a folder"),
                         (tmp_path / "ro.jsonl", "not writable")):
        if says == "not writable" and os.access(target, os.W_OK):  # root ignores file modes
            continue
        code, err = cli(capsys, "run", "--input", str(inp), "--output", str(target), "-q")
        one_line_exit_2(code, err)
        assert says in err
    code, err = cli(capsys, "policy", "search", "--model", "dummy:opt-tiny", "--prompt-len", "8", "--gen-len", "4",
                    "--hardware", "h200", "--json", str(tmp_path / "missing" / "p.json"))
    one_line_exit_2(code, err)
    code, err = cli(capsys, "profile", "--output", str(tmp_path))
    one_line_exit_2(code, err)
    code, err = cli(capsys, "eval", "run", "--run-entries", "synthetic_reasoning:mode=pattern_match",
                    "--output-path", str(inp))
    one_line_exit_2(code, err)


def test_2_a_full_disk_is_one_line_and_keeps_what_was_written(tmp_path, capsys, monkeypatch):
    inp, out = job(tmp_path, [json.dumps({"id": f"r{i}", "prompt_ids": [5, 6, i + 7]}) for i in range(6)], "")
    real, calls = os.fsync, []

    def full(fd):  # the second block's write finds the disk full
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    code, err = cli(capsys, "run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), "-q",
                    "--gpu-batch-size", "2", "--max-new-tokens", "2")
    one_line_exit_2(code, err)
    assert "No space left" in err
    monkeypatch.setattr(os, "fsync", real)
    code, err = cli(capsys, "run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), "-q",
                    "--gpu-batch-size", "2", "--max-new-tokens", "2")
    assert code == 0, err
    ids = [json.loads(l)["id"] for l in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(6))


# ---- 3. values that passed validation and crashed mid-job --------------------------------------
BAD_VALUES = ['"temperature": NaN', '"temperature": Infinity', '"temperature": 1e999', '"max_new_tokens": "5"',
              '"max_new_tokens": 1.5', '"seed": 1.5', '"seed": 100000000000000000000000', '"stop": [1]',
              '"top_p": 0', '"top_k": true', '"id": [1]', '"stop": ""', '"seed": -1']


@pytest.mark.parametrize("value", BAD_VALUES)
def test_3_bad_values_are_refused_before_the_model_loads(tmp_path, capsys, no_model_load, value):
    inp, out = job(tmp_path, ['{"prompt": "hi"}', '{"prompt": "ho", ' + value + "}"])
    code, err = cli(capsys, "run", "--input", str(inp), "--output", str(out), "-q")
    one_line_exit_2(code, err)
    assert "line 2" in err and out.read_text() == '{"id": "old"}\n'


def test_3_nan_temperature_flag_is_refused(tmp_path, capsys, no_model_load):
    inp, out = job(tmp_path, ['{"prompt": "hi"}'])
    code, err = cli(capsys, "run", "--input", str(inp), "--output", str(out), "--temperature", "nan", "-q")
    one_line_exit_2(code, err)


# ---- 4. JSONL lines end at "\n" only ------------------------------------------------------------
def test_4_unicode_line_separators_inside_strings_are_text(tmp_path, capsys):
    rows = [{"id": "a", "prompt": "one\u2028two"}, {"id": "b", "prompt": "x\u2029y\u0085z"}]
    inp = tmp_path / "p.jsonl"
    inp.write_text("\ufeff" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n", encoding="utf-8")
    out = tmp_path / "o.jsonl"
    code, err = cli(capsys, "run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), "-q",
                    "--max-new-tokens", "2")
    assert code == 0, err
    got = {json.loads(l)["id"]: json.loads(l)["prompt"] for l in out.read_text(encoding="utf-8").split("\n") if l}
    assert got == {"a": "one\u2028two", "b": "x\u2029y\u0085z"}
    # the eval harness reads its completions through the same reader
    text = "".join(json.dumps({"id": str(i), "completion": "a\u2028b\u0085"}, ensure_ascii=False) + "\n" for i in range(3))
    assert [v["completion"] for _, v in read_jsonl(text, "c.jsonl")] == ["a\u2028b\u0085"] * 3
    assert [l for _, l in jsonl_lines("a\r\nb\n")] == ["a", "b", ""]


# ---- 5. output equal to input ----------------------------------------------------------------------
def test_5_output_equal_to_input_is_refused(tmp_path, capsys, no_model_load):
    inp, _ = job(tmp_path, ['{"prompt": "hi"}'])
    before = inp.read_bytes()
    code, err = cli(capsys, "run", "--input", str(inp), "--output", str(inp), "-q")
    one_line_exit_2(code, err)
    assert "is the input file" in err and inp.read_bytes() == before


# ---- 6. offload folders (SIGHUP: tests/offload/test_tiers_memory.py) -----------------------------
def test_6_no_offload_folder_when_nothing_goes_to_disk(tmp_path, monkeypatch):
    from flexoff import LLM, Policy

    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(k) or real(*a, **k))
    with LLM("dummy:opt-tiny", policy=Policy(gpu_batch_size=2, w_gpu_percent=50, w_cpu_percent=50,
                                             cache_gpu_percent=0, cache_cpu_percent=100), offload_dir=str(tmp_path)) as llm:
        llm.generate(["hello"], max_new_tokens=2)
    assert not [k for k in made if str(k.get("prefix", "")).startswith("flexoff-")]
    assert list(tmp_path.iterdir()) == []


def test_6_stale_folders_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale, live, other = tmp_path / "flexoff-stale", tmp_path / "flexoff-live", tmp_path / "flexoff-other"
    for d, pid in ((stale, dead_pid), (live, os.getppid())):
        d.mkdir()
        (d / tiers.OWNER).write_text(f"{pid}\n")
        (d / "buf1.bin").write_bytes(b"x")
    other.mkdir()  # no owner file: not ours to remove
    disk = tiers.DiskTier(str(tmp_path))
    try:
        assert not stale.exists() and live.exists() and other.exists()
    finally:
        disk.close()
    shutil.rmtree(live)


# ---- 7. contradictions -----------------------------------------------------------------------------
def test_7_contradictions_are_refused(tmp_path, capsys, no_model_load):
    for line, says in (('{"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}', "exactly one of"),
                       ('{"messages": []}', "non-empty list"),
                       ('{"prompt": "hi", "max_tokens": 3, "max_new_tokens": 4}', "not both")):
        inp, out = job(tmp_path, [line])
        code, err = cli(capsys, "run", "--input", str(inp), "--output", str(out), "-q")
        one_line_exit_2(code, err)
        assert says in err
    pol = tmp_path / "policy.json"
    pol.write_text('{"overlap": "no"}')
    inp, out = job(tmp_path, ['{"prompt": "hi"}'])
    code, err = cli(capsys, "run", "--input", str(inp), "--output", str(out), "--policy", str(pol), "-q")
    one_line_exit_2(code, err)
    assert "overlap must be true or false" in err
    code, err = cli(capsys, "eval", "run", "--run-entries", "synthetic_reasoning:mode=pattern_match,bogus=1",
                    "--output-path", str(tmp_path / "ev"))
    one_line_exit_2(code, err)
    assert "'bogus'" in err


def test_7_model_configs_with_impossible_sizes_are_refused(tiny, tmp_path, capsys):
    for field, value in (("num_hidden_layers", -1), ("hidden_size", 0), ("num_attention_heads", 3.5)):
        model = tmp_path / f"m-{field}"
        shutil.copytree(tiny["llama"].path, model)
        cfg = json.loads((model / "config.json").read_text())
        cfg[field] = value
        (model / "config.json").write_text(json.dumps(cfg))
        inp, out = job(tmp_path, ['{"prompt_ids": [1, 2]}'])
        code, err = cli(capsys, "run", "--model", str(model), "--input", str(inp), "--output", str(out), "-q")
        one_line_exit_2(code, err)
        assert field in err


# ---- every subcommand: bad values are one line and exit 2 ---------------------------------------
def test_every_subcommand_refuses_bad_values_in_one_line(tmp_path, capsys):
    inp, out = job(tmp_path, ['{"prompt": "hi"}'])
    cases = [
        ["run", "--input", str(inp), "--output", str(out), "--gpu-mem", "lots"],
        ["run", "--input", str(inp), "--output", str(out), "--percent", "50", "60", "0", "0", "0", "0"],
        ["run", "--input", str(tmp_path / "nope.jsonl"), "--output", str(out)],
        ["run", "--model", "no-such-model", "--input", str(inp), "--output", str(out)],
        ["ppl", "--text", str(tmp_path / "nope.txt")],
        ["ppl", "--text", str(inp), "--max-tokens", "1"],
        ["profile", "--output", str(tmp_path)],
        ["policy", "search", "--model", "dummy:opt-tiny", "--prompt-len", "-3", "--gen-len", "4"],
        ["policy", "search", "--model", "dummy:opt-tiny", "--prompt-len", "8", "--gen-len", "4", "--hardware",
         str(tmp_path / "nope.json")],
        ["eval", "run", "--run-entries", "no_such_scenario"],
        ["eval", "run", "--conf-paths", str(tmp_path / "nope.yaml")],
        ["eval", "summarize", "--suite", "none", "--output-path", str(tmp_path / "nothing")],
    ]
    for args in cases:
        code, err = cli(capsys, *args)
        one_line_exit_2(code, err)
    assert out.read_text() == '{"id": "old"}\n'


# ---- properties ------------------------------------------------------------------------------------
bad_setting = st.one_of(
    st.tuples(st.just("temperature"),
              st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not 0 <= v <= 1e4),
                        st.text(max_size=3), st.booleans(), st.none(), st.lists(st.integers(), max_size=2))),
    st.tuples(st.just("top_p"),
              st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not 0 < v <= 1),
                        st.text(max_size=3), st.booleans(), st.none())),
    st.tuples(st.sampled_from(["max_new_tokens", "top_k"]),
              st.one_of(st.integers(max_value=-1), st.floats(allow_nan=True), st.text(max_size=3), st.booleans())),
    st.tuples(st.just("seed"), st.one_of(st.integers(min_value=2**63), st.integers(max_value=-1), st.floats(),
                                         st.text(max_size=3))),
    st.tuples(st.just("stop"), st.one_of(st.integers(), st.just(""), st.lists(st.integers(), min_size=1))),
    st.tuples(st.text(min_size=1, max_size=8).filter(lambda k: k not in REQUEST_KEYS and not k.startswith("_")),
              st.integers()),
    st.tuples(st.sampled_from(["prompt", "messages", "prompt_ids"]),
              st.one_of(st.integers(), st.just(""), st.just([]), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                                   max_size=2))),
)


@FAST
@given(bad=bad_setting)
def test_property_malformed_request_lines_exit_2_and_keep_the_output(tmp_path_factory, capsys, bad):
    key, value = bad
    tmp = tmp_path_factory.mktemp("p")
    line = {"prompt": "hi", key: value} if key != "prompt" else {"prompt": value}
    inp, out = job(tmp, ['{"prompt": "fine"}', json.dumps(line, allow_nan=True)])
    code, err = cli(capsys, "run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), "-q")
    one_line_exit_2(code, err)
    assert "line 2" in err and out.read_text() == '{"id": "old"}\n'


@FAST
@given(policy=st.dictionaries(st.sampled_from(["gpu_batch_size", "num_gpu_batches", "w_gpu_percent", "overlap",
                                               "compress_cache", "quant_bits", "stash_cpu_percent", "nonsense"]),
                              st.one_of(st.integers(min_value=-5, max_value=500), st.floats(allow_nan=True),
                                        st.text(max_size=3), st.booleans(), st.none()), min_size=1))
def test_property_malformed_policy_files_exit_2(tmp_path_factory, capsys, policy):
    from flexoff.errors import PolicyError
    from flexoff.policy.policy import Policy

    try:
        Policy.from_dict(policy)
        return  # a valid policy (the property is about the invalid ones)
    except PolicyError:
        pass
    tmp = tmp_path_factory.mktemp("q")
    pol = tmp / "policy.json"
    pol.write_text(json.dumps(policy, allow_nan=True))
    inp, out = job(tmp, ['{"prompt": "hi"}'])
    code, err = cli(capsys, "run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), "--policy",
                    str(pol), "-q")
    one_line_exit_2(code, err)
    assert out.read_text() == '{"id": "old"}\n'


@FAST
@given(flag=st.sampled_from(["--gpu-mem", "--cpu-mem", "--temperature", "--top-p", "--max-new-tokens",
                             "--gpu-batch-size"]),
       value=st.one_of(st.text(min_size=1, max_size=6).filter(lambda v: not v.startswith("-")),
                       st.sampled_from(["nan", "-1", "inf", "0", "1e400", "-0.5"])))
def test_property_bad_flag_values_exit_2(tmp_path_factory, capsys, flag, value):
    tmp = tmp_path_factory.mktemp("f")
    inp, out = job(tmp, ['{"prompt": "hi"}'])
    code, err = cli(capsys, "run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), flag, value,
                    "--max-new-tokens", "1", "-q") if flag != "--max-new-tokens" else \
        cli(capsys, "run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), flag, value, "-q")
    if code == 0:  # a value that is valid for the flag ran the job: it appended its one line
        assert out.read_text().startswith('{"id": "old"}\n') and out.read_text().count("\n") == 2
        return
    one_line_exit_2(code, err)
    assert out.read_text() == '{"id": "old"}\n'


def test_3_config_files_of_the_wrong_shape_are_one_line(tiny, tmp_path, capsys):
    inp, out = job(tmp_path, ['{"prompt": "hi"}'])
    model = tmp_path / "m"
    shutil.copytree(tiny["llama"].path, model)
    (model / "config.json").write_text("[1, 2]")
    hw_list, hw_type, conf, pol = (tmp_path / n for n in ("hw1.json", "hw2.json", "conf.json", "pol.json"))
    hw_list.write_text("[1]")
    from flexoff.policy.hardware import h200

    hw_type.write_text(json.dumps({**json.loads(h200().to_json()), "ctog_bdw": "fast"}))
    conf.write_text("42")
    pol.write_text("[]")
    cases = [["run", "--model", str(model), "--input", str(inp), "--output", str(out)],
             ["policy", "search", "--model", "dummy:opt-tiny", "--prompt-len", "8", "--gen-len", "2", "--hardware",
              str(hw_list)],
             ["policy", "search", "--model", "dummy:opt-tiny", "--prompt-len", "8", "--gen-len", "2", "--hardware",
              str(hw_type)],
             ["eval", "run", "--conf-paths", str(conf)],
             ["run", "--input", str(inp), "--output", str(out), "--policy", str(pol)]]
    for args in cases:
        one_line_exit_2(*cli(capsys, *args))
    assert out.read_text() == '{"id": "old"}\n'
