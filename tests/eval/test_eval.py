"""`flexoff eval` on HELM's own code: files HELM's loaders read, HELM's instances, helm-summarize's
tables, completions equal to flexoff's own generation, resumption, path confinement, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from flexoff.cli import main

helm = pytest.importorskip("helm.benchmark.runner", reason="the eval extra (crfm-helm) is not installed")

ENTRY = "synthetic_reasoning:mode=pattern_match"


def run(tmp_path: Path, *extra: str, entry: str = ENTRY, suite: str = "s1", model: str = "smollm2",
        out: str = "out") -> int:
    return main(["eval", "run", "-r", entry, "--model", model, "--max-eval-instances", "6", "--suite", suite,
                 "-o", str(tmp_path / out), "--local-path", str(tmp_path / "prod_env"), "-q", *extra])


def run_folder(tmp_path: Path, suite: str = "s1", out: str = "out") -> Path:
    [folder] = [p for p in (tmp_path / out / "runs" / suite).iterdir() if p.is_dir() and p.name != "eval_cache"
                and p.name != "groups"]
    return folder


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    assert run(tmp, "--gpu-batch-size", "2", "--num-gpu-batches", "1") == 0
    return tmp


def test_every_file_loads_with_helms_codec(smol_run):
    from helm.benchmark.adaptation.scenario_state import ScenarioState
    from helm.benchmark.metrics.metric import PerInstanceStats
    from helm.benchmark.metrics.statistic import Stat
    from helm.benchmark.run_spec import RunSpec
    from helm.common.codec import from_json

    folder = run_folder(smol_run)
    spec = from_json((folder / "run_spec.json").read_text(), RunSpec)
    assert spec.adapter_spec.model == "flexoff/smollm2" and spec.groups and spec.metric_specs
    state = from_json((folder / "scenario_state.json").read_text(), ScenarioState)
    stats = from_json((folder / "stats.json").read_text(), List[Stat])
    per = from_json((folder / "per_instance_stats.json").read_text(), List[PerInstanceStats])
    assert len(state.request_states) == 6 and all(s.result.success for s in state.request_states)
    names = {s.name.name for s in stats}
    assert {"exact_match", "quasi_exact_match", "quasi_prefix_exact_match", "num_instances",
            "padded_throughput", "actual_throughput"} <= names
    assert {p.instance_id for p in per} == {s.instance.id for s in state.request_states}
    for s in state.request_states:  # HELM's shapes: tokens with text and logprob, finish_reason a dict
        c = s.result.completions[0]
        assert c.finish_reason["reason"] in ("stop", "length")
        assert "".join(t.text for t in c.tokens).strip() == c.text.strip() or c.finish_reason["reason"] == "stop"
        assert c.logprob == pytest.approx(sum(t.logprob for t in c.tokens))


def test_instances_are_helms_own(smol_run):
    """The run's instances are those HELM's scenario makes, downsampled by HELM's own function."""
    from helm.benchmark.adaptation.scenario_state import ScenarioState
    from helm.benchmark.runner import downsample_eval_instances
    from helm.benchmark.scenarios.scenario import with_instance_ids
    from helm.benchmark.scenarios.synthetic_reasoning_scenario import SyntheticReasoningScenario
    from helm.common.codec import from_json

    state = from_json((run_folder(smol_run) / "scenario_state.json").read_text(), ScenarioState)
    direct = with_instance_ids(SyntheticReasoningScenario(mode="pattern_match").get_instances(str(smol_run / "x")))
    want = [i for i in downsample_eval_instances(direct, 6, ["valid", "test"]) if i.split in ("valid", "test")]
    assert len(want) == 6 and sorted((i.id, i.input.text) for i in want) == \
        sorted((s.instance.id, s.instance.input.text) for s in state.request_states)
    assert all(s.request.prompt.endswith(s.instance.input.text + "\nTarget:")
               or s.instance.input.text in s.request.prompt for s in state.request_states)


def test_completions_equal_flexoffs_own_generation(smol_run, smol):
    """Each HELM request, sent to flexoff directly with the same settings, gives the same text."""
    from helm.benchmark.adaptation.scenario_state import ScenarioState
    from helm.common.codec import from_json

    state = from_json((run_folder(smol_run) / "scenario_state.json").read_text(), ScenarioState)
    r0 = state.request_states[0].request
    out = smol.generate([s.request.prompt for s in state.request_states], max_new_tokens=r0.max_tokens,
                        temperature=r0.temperature, stop=r0.stop_sequences)
    assert [c.text for c in out.completions] == [s.result.completions[0].text for s in state.request_states]


def test_helm_summarize_writes_the_group_table_naming_the_model(smol_run):
    out = smol_run / "out"
    done = subprocess.run([sys.executable, "-m", "helm.benchmark.presentation.summarize", "--suite", "s1",
                           "-o", str(out), "--local-path", str(smol_run / "prod_env")],
                          capture_output=True, text=True, cwd=smol_run)
    assert done.returncode == 0, done.stderr[-2000:]
    tables = json.loads((out / "runs" / "s1" / "groups" / "synthetic_reasoning.json").read_text())
    header = [h["value"] for h in tables[0]["header"]]
    [row] = tables[0]["rows"]
    assert row[0]["value"] == "smollm2 (flexoff)"
    assert row[header.index("# eval")]["value"] == 3  # HELM keeps 6 instances over valid and test
    assert main(["eval", "summarize", "--suite", "s1", "-o", str(out), "--local-path",
                 str(smol_run / "prod_env")]) == 0


def test_interrupted_eval_resumes_with_identical_results(tmp_path, monkeypatch, capsys):
    args = ("--gpu-batch-size", "2", "--num-gpu-batches", "1")
    model = "dummy:llama-tiny"
    assert run(tmp_path, *args, model=model, out="full") == 0
    from flexoff.eval import executor

    calls = {"n": 0}
    real = executor.request_result

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # in the second block
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(executor, "request_result", crash)
    assert run(tmp_path, *args, model=model, out="part") == 130
    monkeypatch.setattr(executor, "request_result", real)
    from flexoff.api import LLM

    generated = {"n": 0}
    gen = LLM.generate

    def count(self, prompts, **kw):
        generated["n"] += len(kw.get("requests") or [])
        return gen(self, prompts, **kw)

    monkeypatch.setattr(LLM, "generate", count)
    capsys.readouterr()
    assert run(tmp_path, *args, model=model, out="part") == 0
    assert generated["n"] == 4 and "2 requests reused" in capsys.readouterr().err
    a, b = (json.loads((run_folder(tmp_path, out=o) / "scenario_state.json").read_text()) for o in ("full", "part"))
    assert [s["result"]["completions"] for s in a["request_states"]] == \
        [s["result"]["completions"] for s in b["request_states"]]
    pa, pb = (json.loads((run_folder(tmp_path, out=o) / "per_instance_stats.json").read_text()) for o in ("full", "part"))
    timed = {"inference_runtime", "inference_denoised_runtime"}  # wall-clock: differ run to run

    def untimed(p):
        return [[s for s in i["stats"] if s["name"]["name"] not in timed] for i in p]
    assert untimed(pa) == untimed(pb) and len(untimed(pa)) == 6


@pytest.mark.parametrize("argv, msg", [
    (["--suite", "../up"], "--suite '../up'"),
    (["--suite", "/abs"], "--suite '/abs'"),
    (["-r", "synthetic_reasoning:mode=../x"], "mode="),
    (["-r", "synthetic_reasoning:mode=a/b"], "mode="),
    (["-r", "synthetic_reasoning:mode=pattern_match,model=other/model"], "is not the loaded model"),
    (["-r", "no_such_scenario:x=1"], "no_such_scenario"),
    (["--conf-paths", "missing.conf"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, msg):
    base = ["eval", "run", "--model", "dummy:opt-tiny", "-o", str(tmp_path / "o"), "--local-path",
            str(tmp_path / "p"), "-q"]
    if "-r" not in argv and "--conf-paths" not in argv:
        base += ["-r", ENTRY]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err
    assert not (tmp_path / "o" / "runs").exists() or not any((tmp_path / "o" / "runs").rglob("stats.json"))


def test_conf_files_as_helm_writes_them(tmp_path):
    conf = tmp_path / "entries.conf"
    conf.write_text('entries: [\n  {description: "synthetic_reasoning:mode=induction,model=dummy:opt-tiny", '
                    'priority: 1}\n]\n')
    assert main(["eval", "run", "--conf-paths", str(conf), "--model", "dummy:opt-tiny", "--max-eval-instances",
                 "2", "-o", str(tmp_path / "o"), "--local-path", str(tmp_path / "p"), "-q"]) == 0
    [folder] = [p for p in (tmp_path / "o" / "runs" / "default").iterdir() if p.name.startswith("synthetic")]
    assert folder.name == "synthetic_reasoning:mode=induction,model=flexoff_dummy-opt-tiny"


def test_without_helm_the_error_says_how_to_install(tmp_path):
    code = ("import sys; sys.modules['helm'] = None; from flexoff.cli import main; "
            f"sys.exit(main(['eval', 'run', '-r', '{ENTRY}', '-o', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2 and "pip install -e '.[eval]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_local_data_is_a_helm_scenario_over_the_users_file(tmp_path, capsys):
    rows = [{"input": "2+2", "output": "4", "split": "train"}, {"input": "3+3", "output": "6", "id": "six"},
            {"input": "capital of France", "references": ["Paris", "paris"]}]
    data = tmp_path / "my data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "run", "-r", f"local_data:path={data},max_tokens=4", "--model", "dummy:opt-tiny",
                 "-o", str(tmp_path / "o"), "--local-path", str(tmp_path / "p"), "-q"]) == 0
    [folder] = [p for p in (tmp_path / "o" / "runs" / "default").iterdir() if p.name.startswith("local_data")]
    assert folder.name.startswith("local_data:file=my_data-") and "/" not in folder.name
    state = json.loads((folder / "scenario_state.json").read_text())["request_states"]
    assert [s["instance"]["input"]["text"] for s in state] == ["3+3", "capital of France"]
    assert all(s["request"]["prompt"].startswith("Input: 2+2\nOutput: 4\n\nInput: ") for s in state)
    from helm.benchmark.metrics.evaluate_reference_metrics import exact_match

    per = json.loads((folder / "per_instance_stats.json").read_text())
    for s, p in zip(state, per):  # HELM's own exact_match, best over the references
        em = max(exact_match(r["output"]["text"], s["result"]["completions"][0]["text"])
                 for r in s["instance"]["references"])
        [got] = [x["mean"] for x in p["stats"] if x["name"]["name"] == "exact_match"]
        assert got == em
    data.write_text('{"input": "x"}\n')
    capsys.readouterr()
    assert main(["eval", "run", "-r", f"local_data:path={data}", "--model", "dummy:opt-tiny", "-o",
                 str(tmp_path / "o2"), "--local-path", str(tmp_path / "p"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 'output'" in err[0]


def test_a_journal_line_cut_by_a_crash_is_dropped_and_appending_goes_on(tmp_path):
    from helm.common.general import asdict_without_nones
    from helm.common.request import GeneratedOutput, RequestResult, Token

    from flexoff.eval.executor import JOURNAL, FlexoffExecutor

    res = RequestResult(success=True, embedding=[], cached=False, completions=[
        GeneratedOutput(text=" 4", logprob=-0.5, tokens=[Token(" 4", -0.5)], finish_reason={"reason": "stop"})])
    line = json.dumps({"id": "k1", "result": asdict_without_nones(res)})
    (tmp_path / JOURNAL).write_text(line + "\n" + line[:40])
    ex = FlexoffExecutor(None, None, None)
    ex.folder = tmp_path
    assert ex.journal() == {"k1": res}
    assert (tmp_path / JOURNAL).read_text() == line + "\n"
    (tmp_path / JOURNAL).write_text(line + "\nnot json\n" + line + "\n")
    with pytest.raises(Exception, match="line 2 is not a flexoff eval journal record"):
        ex.journal()
