"""The evaluation harness: scenarios, prompts, metrics, resumption, and an end-to-end run."""

from __future__ import annotations

import json
import math
import re
import string

import pytest
import torch

from flexoff import LLM
from flexoff.cli import main
from flexoff.errors import InputError
from flexoff.eval.adapter import AdapterSpec, build_prompt, train_examples
from flexoff.eval.metrics import exact_match, f1_score, prefix_exact_match, quasi_exact_match, rouge_l
from flexoff.eval.runspec import parse_entry
from flexoff.eval.scenarios import CORRECT, Instance, Reference, make_scenario
from flexoff.eval.synthetic import VARIABLES
from flexoff.tokenizer import ByteTokenizer


# ---- scenarios -----------------------------------------------------------------
def _matches(rule: list[str], words: list[str]) -> list[dict[str, str]]:
    """Every substitution (variable -> 1 or 2 words) that turns rule into words: brute force."""
    out = []

    def go(i: int, j: int, sub: dict[str, str]) -> None:
        if i == len(rule):
            if j == len(words):
                out.append(dict(sub))
            return
        tok = rule[i]
        if tok not in VARIABLES:
            if j < len(words) and words[j] == tok:
                go(i + 1, j + 1, sub)
            return
        for n in (1, 2):
            val = " ".join(words[j:j + n])
            if j + n > len(words) or (tok in sub and sub[tok] != val):
                continue
            fresh = tok not in sub
            sub[tok] = val
            go(i + 1, j + n, sub)
            if fresh:
                del sub[tok]

    go(0, 0, {})
    return out


@pytest.mark.parametrize("mode", ["pattern_match", "variable_substitution", "induction"])
def test_synthetic_reasoning_is_deterministic_and_correct(mode):
    a = make_scenario("synthetic_reasoning", {"mode": mode, "num_train": 5, "num_test": 40}).instances()
    b = make_scenario("synthetic_reasoning", {"mode": mode, "num_train": 5, "num_test": 40}).instances()
    c = make_scenario("synthetic_reasoning", {"mode": mode, "seed": "7", "num_train": 5, "num_test": 40}).instances()
    assert a == b and a != c
    assert [i.split for i in a].count("train") == 5 and len({i.id for i in a}) == 45
    for inst in a:
        d = inst.to_json()
        assert set(d) == {"input", "references", "split", "id"} and d["references"][0]["tags"] == [CORRECT]
        (answer,) = inst.correct
        lines = dict(l.split(": ", 1) for l in inst.input.splitlines() if ": " in l)
        if mode == "variable_substitution":
            sub = dict(p.split(" = ") for p in lines["Substitutions"].split(", "))
            assert " ".join(sub.get(t, t) for t in lines["Rule"].split()) == answer
        elif mode == "induction":
            sub = dict(p.split(" = ") for p in lines["Substitutions"].split(", "))
            assert " ".join(sub.get(t, t) for t in answer.split()) == lines["Result"]
        else:  # exactly one listed rule can produce the result
            rules = inst.input.split("Rules:\n")[1].split("\nResult:")[0].splitlines()
            words = lines["Result"].split()
            assert [r for r in rules if _matches(r.split(), words)] == [answer]


def _solve_natural(text: str) -> set[str]:
    """Forward-chain the rules from the fact; the values of the asked category that follow."""
    rules = re.findall(r"If \w+ \w+ is (.+?), then \w+ \w+ is (\w+)\.", text)
    known = set(re.search(r"Fact: \w+ \w+ is (.+)\.", text).group(1).split(" and "))
    changed = True
    while changed:
        changed = False
        for cond, value in rules:
            if set(cond.split(" and ")) <= known and value not in known:
                known.add(value)
                changed = True
    category = re.search(r"Question: What (\w+) is", text).group(1)
    from flexoff.eval.synthetic import ATTRIBUTES

    return known & set(ATTRIBUTES[category])


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_synthetic_reasoning_natural_answers_follow_from_the_rules(difficulty):
    insts = make_scenario("synthetic_reasoning_natural", {"difficulty": difficulty, "num_test": 60}).instances()
    assert insts == make_scenario("synthetic_reasoning_natural", {"difficulty": difficulty, "num_test": 60}).instances()
    counts = [inst.input.count("If ") for inst in insts]
    assert len(set(counts)) == 1  # the difficulty sets the number of rules
    for inst in insts:
        assert _solve_natural(inst.input) == set(inst.correct)


def test_local_files_and_efficiency(tmp_path):
    gen = tmp_path / "g.jsonl"
    gen.write_text('{"input": "2+2", "output": "4"}\n{"input": "3+3", "references": ["6", "six"], "split": "test"}\n')
    insts = make_scenario("generation", {"path": str(gen)}).instances()
    assert insts[1].correct == ["6", "six"] and insts[0].split == "test"
    mc = tmp_path / "m.csv"
    mc.write_text("question,A,B,C,D,answer\nSky?,red,blue,green,black,B\nGrass?,red,blue,green,black,2\n")
    insts = make_scenario("multiple_choice", {"path": str(mc)}).instances()
    assert [i.correct for i in insts] == [["blue"], ["green"]] and insts[0].choices[0] == "red"
    with pytest.raises(InputError, match="not one of the choices"):
        mc.write_text("question,A,B,answer\nQ,x,y,E\n")
        make_scenario("multiple_choice", {"path": str(mc)}).instances()
    tok = ByteTokenizer(300)
    cut = make_scenario("synthetic_efficiency", {"num_prompt_tokens": "40", "num_instances": "3"}).cut(tok)
    assert [len(ids) for _, ids in cut] == [40, 40, 40]
    with pytest.raises(InputError, match="unknown scenario"):
        make_scenario("mmlu", {})


# ---- prompts -------------------------------------------------------------------
def _inst(i: int, split: str = "test") -> Instance:
    return Instance(f"q{i}", (Reference(f"a{i}", (CORRECT,)),), split, f"id{i}")


def test_prompt_construction_matches_the_expected_string():
    spec = AdapterSpec(instructions="Solve.", input_prefix="Q: ", output_prefix="A: ", max_train_instances=2, seed=1)
    pool = [_inst(i, "train") for i in range(5)]
    train = train_examples(spec, pool)
    assert train == train_examples(spec, pool) and len(train) == 2
    p = build_prompt(spec, _inst(9), train, ByteTokenizer(300), 4096)
    a, b = train
    assert p.text == f"Solve.\n\nQ: {a.input}\nA: {a.correct[0]}\n\nQ: {b.input}\nA: {b.correct[0]}\n\nQ: q9\nA:"
    assert p.num_train == 2 and not p.truncated
    mc = Instance("Sky?", (Reference("red"), Reference("blue", (CORRECT,))), "test", "m", ("red", "blue"))
    spec = AdapterSpec(method="multiple_choice_joint", input_prefix="Question: ", max_train_instances=0)
    p = build_prompt(spec, mc, [], ByteTokenizer(300), 4096)
    assert p.text == "Question: Sky?\nA. red\nB. blue\nAnswer:" and p.output_mapping == {"A": "red", "B": "blue"}


def test_few_shot_examples_are_dropped_from_the_end_to_fit_the_context():
    tok = ByteTokenizer(300)
    spec = AdapterSpec(max_train_instances=4, max_tokens=10)
    train = [_inst(i, "train") for i in range(4)]
    full = build_prompt(spec, _inst(9), train, tok, 4096)
    assert full.num_train == 4
    for keep in (3, 1, 0):
        ctx = len(build_prompt(spec, _inst(9), train[:keep], tok, 4096).ids) + spec.max_tokens
        p = build_prompt(spec, _inst(9), train, tok, ctx)
        assert p.num_train == keep and p.text.startswith("".join(f"q{i}\n" for i in range(min(keep, 1))))
        assert len(p.ids) + spec.max_tokens <= ctx
    p = build_prompt(spec, Instance("x" * 100, (), "test", "long"), [], tok, 40)
    assert p.truncated and len(p.ids) == 30


# ---- metrics -------------------------------------------------------------------
def test_metrics_on_hand_computed_cases():
    assert exact_match(" Paris ", "Paris") == 1 and exact_match("paris", "Paris") == 0
    assert quasi_exact_match("The Paris!", "paris") == 1
    assert prefix_exact_match("Paris, France", "Paris") == 1 and prefix_exact_match("in Paris", "Paris") == 0
    assert f1_score("the cat sat on mat", "a cat sat") == pytest.approx(2 * (2 / 4) * (2 / 2) / (2 / 4 + 2 / 2))
    assert f1_score("", "") == 1 and f1_score("x", "y") == 0
    # LCS("a b c d e", "a c e f") = 3: precision 3/5, recall 3/4
    assert rouge_l("a b c d e", "a c e f") == pytest.approx(2 * 0.6 * 0.75 / 1.35)


# ---- runs ----------------------------------------------------------------------
def _norm(t: str) -> str:  # the test's own normalization, to recompute quasi exact match
    t = re.sub(r"\b(a|an|the)\b", " ", t.lower().translate(str.maketrans("", "", string.punctuation)))
    return " ".join(t.split())


def test_end_to_end_on_smollm2_writes_helm_files_whose_stats_recompute(smol, tmp_path):
    run = parse_entry("synthetic_reasoning_natural:difficulty=easy", "smollm2")
    from flexoff.eval.runner import evaluate

    smol.policy_arg = None
    res = evaluate(smol, run, str(tmp_path), "s", max_eval_instances=5)
    files = {p.name for p in res.folder.iterdir()}
    assert {"run_spec.json", "scenario_state.json", "per_instance_stats.json", "stats.json"} <= files
    state = json.loads((res.folder / "scenario_state.json").read_text())
    stats = {s["name"]["name"]: s for s in json.loads((res.folder / "stats.json").read_text())}
    rs = state["request_states"]
    assert len(rs) == 5 and stats["exact_match"]["count"] == 5
    em = [max(float(r["result"]["completions"][0]["text"].strip() == ref["output"]["text"].strip())
              for ref in r["instance"]["references"]) for r in rs]
    qem = [max(float(_norm(r["result"]["completions"][0]["text"]) == _norm(ref["output"]["text"]))
               for ref in r["instance"]["references"]) for r in rs]
    assert stats["exact_match"]["mean"] == pytest.approx(sum(em) / 5)
    assert stats["quasi_exact_match"]["mean"] == pytest.approx(sum(qem) / 5)
    ntok = [len(r["result"]["completions"][0]["tokens"]) for r in rs]
    assert stats["num_output_tokens"]["sum"] == sum(ntok)
    assert stats["actual_throughput"]["mean"] <= stats["padded_throughput"]["mean"]
    assert json.loads((res.folder / "run_spec.json").read_text())["adapter_spec"]["max_tokens"] == 20
    blocks = [json.loads(line) for line in (res.folder / "efficiency.jsonl").read_text().splitlines()]
    assert sum(b["instances"] for b in blocks) == 5 and all(b["policy"] == smol.last_policy.describe() for b in blocks)


def test_language_modeling_perplexity_equals_transformers(tiny, tmp_path):
    docs = ["the quick brown fox jumps over the lazy dog", "a journey of a thousand miles", "hello world"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"input": d}) + "\n" for d in docs))
    m = tiny["llama"]
    from flexoff.eval.runner import evaluate

    with LLM(str(m.path)) as llm:
        res = evaluate(llm, parse_entry(f"generation:path={path},method=language_modeling", "t"), str(tmp_path), "s")
        ids = [llm.tokenizer.encode(d) for d in docs]
    nll, n = 0.0, 0
    with torch.no_grad():
        for x in ids:
            lp = m.hf(torch.tensor([x])).logits[0, :-1].double().log_softmax(-1)
            nll -= float(lp.gather(-1, torch.tensor(x[1:])[:, None]).sum())
            n += len(x) - 1
    assert res.stats["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert res.stats["bits_per_byte"] == pytest.approx(nll / math.log(2) / sum(len(d.encode()) for d in docs), rel=1e-4)


def test_interrupted_eval_resumes_without_recomputing(tmp_path, monkeypatch, capsys):
    args = ["eval", "run", "--run-entries", "synthetic_reasoning:mode=induction,max_tokens=6", "--model",
            "dummy:llama-tiny", "--max-eval-instances", "12", "--suite", "r", "--gpu-batch-size", "4", "-q"]
    assert main(args + ["--output-path", str(tmp_path / "full")]) == 0
    from flexoff import jobs

    calls = {"n": 0}
    original = jobs.ResultWriter.write

    def crash(self, records):
        if self.path.endswith("completions.jsonl"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
        original(self, records)

    monkeypatch.setattr(jobs.ResultWriter, "write", crash)
    part = str(tmp_path / "part")
    assert main(args + ["--output-path", part]) == 130
    monkeypatch.setattr(jobs.ResultWriter, "write", original)
    generated = {"n": 0}
    from flexoff.api import LLM as _LLM

    real = _LLM.generate

    def count(self, prompts, **kw):
        generated["n"] += len(kw.get("requests") or [])
        return real(self, prompts, **kw)

    monkeypatch.setattr(_LLM, "generate", count)
    assert main(args + ["--output-path", part]) == 0
    assert generated["n"] == 8  # the 4 finished instances were not recomputed
    assert "resumed" in capsys.readouterr().err
    name = next((tmp_path / "full" / "runs" / "r").iterdir()).name
    done = [json.loads(l)["id"] for l in open(tmp_path / "part" / "runs" / "r" / name / "completions.jsonl")]
    assert sorted(done) == sorted(set(done)) and len(done) == 12
    full = json.loads((tmp_path / "full" / "runs" / "r" / name / "per_instance_stats.json").read_text())
    again = json.loads((tmp_path / "part" / "runs" / "r" / name / "per_instance_stats.json").read_text())
    assert sorted(full, key=lambda r: r["instance_id"]) == sorted(again, key=lambda r: r["instance_id"])


def test_summarize_and_cli_errors(tmp_path, capsys):
    assert main(["eval", "run", "--run-entries", "synthetic_reasoning:mode=pattern_match,max_tokens=4",
                 "--model", "dummy:opt-tiny", "--max-eval-instances", "3", "--suite", "x",
                 "--output-path", str(tmp_path), "-q"]) == 0
    assert main(["eval", "summarize", "--suite", "x", "--output-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| run |" in out and "synthetic_reasoning:mode=pattern_match" in out
    assert json.loads((tmp_path / "runs" / "x" / "summary.json").read_text())[0]["instances"] == 3
    for entry, msg in [("nope:x=1", "unknown scenario"), ("synthetic_reasoning:mode=bogus", "mode must be"),
                       ("synthetic_reasoning:mode", "is not key=value")]:
        assert main(["eval", "run", "--run-entries", entry, "--model", "dummy:opt-tiny",
                     "--output-path", str(tmp_path)]) == 2
        assert msg in capsys.readouterr().err
