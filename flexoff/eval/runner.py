"""Running one evaluation: instances to requests to completions to stats, resumable.

Knows: which instances an eval uses (the test split, at most max_eval_instances), building the
requests, running them through the LLM (which groups prompts by length, so padding stays
small), appending completions and per-block efficiency to the run folder as blocks finish (a
rerun skips what is there), computing per-instance and aggregate stats, and writing HELM's
files: run_spec.json, scenario_state.json, per_instance_stats.json, stats.json.
Does not know: metric definitions (metrics.py), prompt building (adapter.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flexoff import validate
from flexoff.eval.adapter import Prompt, build_prompt, train_examples
from flexoff.eval.metrics import Stat, best_over_references, derived, language_modeling
from flexoff.eval.runspec import RunSpec
from flexoff.eval.scenarios import TEST, SyntheticEfficiency
from flexoff.jobs import ResultWriter, answered_ids
from flexoff.lock import OutputLock

COMPLETIONS = "completions.jsonl"
EFFICIENCY = "efficiency.jsonl"


@dataclass
class EvalResult:
    run: RunSpec
    folder: Path
    stats: dict[str, Any]  # metric name -> mean
    instances: int
    resumed: int


def run_folder(output_path: str, suite: str, run: RunSpec) -> Path:
    return Path(output_path) / "runs" / suite / run.name


def prompts_for(run: RunSpec, llm: Any, max_eval_instances: int | None) -> list[Prompt]:
    scenario = run.make_scenario()
    ctx = llm.model.spec.max_positions
    if isinstance(scenario, SyntheticEfficiency):
        cut = scenario.cut(llm.tokenizer)[:max_eval_instances]
        return [Prompt(inst, inst.input, ids, 0, False) for inst, ids in cut]
    instances = scenario.instances()
    test = [i for i in instances if i.split == TEST][:max_eval_instances]
    train = train_examples(run.adapter_spec, instances)
    return [build_prompt(run.adapter_spec, inst, train, llm.tokenizer, ctx) for inst in test]


def evaluate(llm: Any, run: RunSpec, output_path: str, suite: str, max_eval_instances: int | None = None,
             on_progress: Callable[[int], None] | None = None) -> EvalResult:
    folder = run_folder(output_path, suite, run)
    folder.mkdir(parents=True, exist_ok=True)
    with OutputLock(str(folder)):  # one writer per run folder
        return _evaluate(llm, run, folder, max_eval_instances, on_progress)


def _evaluate(llm: Any, run: RunSpec, folder: Path, max_eval_instances: int | None,
              on_progress: Callable[[int], None] | None) -> EvalResult:
    (folder / "run_spec.json").write_text(json.dumps(run.to_json(), indent=2))
    prompts = prompts_for(run, llm, max_eval_instances)
    spec = run.adapter_spec
    lm = spec.method == "language_modeling"
    done = answered_ids(str(folder / COMPLETIONS))
    todo = [p for p in prompts if p.instance.id not in done]
    if on_progress:
        on_progress(len(prompts) - len(todo))
    reqs = [{"id": p.instance.id, "prompt_ids": p.ids, "max_new_tokens": 0 if lm else spec.max_tokens,
             "temperature": spec.temperature, "stop": list(spec.stop_sequences),
             **({"adapter": run.lora} if run.lora else {})} for p in todo]
    completions, efficiency = ResultWriter(str(folder / COMPLETIONS)), ResultWriter(str(folder / EFFICIENCY))

    def on_block(comps: list, st: Any) -> None:
        completions.write([{**c.to_json(), "token_ids": c.token_ids} for c in comps])
        policy = llm.last_policy.describe() if getattr(llm, "last_policy", None) is not None else None
        efficiency.write([{"instances": len(comps), "policy": policy, **{k: getattr(st, k) for k in (
            "prompt_tokens", "generated_tokens", "padded_prompt_tokens", "padded_generated_tokens",
            "prefill_s", "decode_s")}}])
        if on_progress:
            on_progress(len(comps))

    try:
        if reqs:
            llm.generate([], requests=llm.make_requests(reqs, _defaults()), on_block=on_block, prompt_logprobs=lm)
    finally:
        completions.close()
        efficiency.close()
    stats = write_results(run, folder, prompts, llm.model.name)
    return EvalResult(run, folder, stats, len(prompts), len(prompts) - len(todo))


def _defaults() -> Any:
    from flexoff.sampling import SamplingParams

    return SamplingParams()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [row for _, row in validate.read_jsonl(path.read_text(encoding="utf-8"), str(path))]


def instance_stats(run: RunSpec, p: Prompt, c: dict[str, Any]) -> dict[str, float]:
    """Per-instance metric values."""
    spec = run.adapter_spec
    out = {"num_prompt_tokens": float(c["prompt_tokens"]), "num_output_tokens": float(c["completion_tokens"]),
           "num_train_instances": float(p.num_train), "prompt_truncated": float(p.truncated)}
    if spec.method == "language_modeling":
        out.update(language_modeling(c.get("prompt_logprobs") or [], p.text))
        return out
    pred = c["completion"]
    if spec.method == "multiple_choice_joint":
        letter = pred.strip()[:1].upper()
        correct = [k for k, v in p.output_mapping.items() if v in p.instance.correct]
        out.update({"exact_match": float(letter in correct), "quasi_exact_match": float(letter in correct)})
        return out
    if p.instance.references:
        out.update(best_over_references(pred, p.instance.correct))
    return out


def efficiency_stats(blocks: list[dict[str, Any]]) -> dict[str, float]:
    """FlexGen's Table 25: padded and actual throughput over the eval, and how much is padding."""
    t = sum(b["prefill_s"] + b["decode_s"] for b in blocks)
    if not blocks or t <= 0:
        return {}
    actual = sum(b["prompt_tokens"] + b["generated_tokens"] for b in blocks)
    padded = sum(b["padded_prompt_tokens"] + b["padded_generated_tokens"] for b in blocks)
    gen = sum(b["generated_tokens"] for b in blocks)
    return {"inference_runtime": t, "padded_throughput": padded / t, "actual_throughput": actual / t,
            "padding_efficiency": actual / padded if padded else 1.0, "generation_throughput": gen / t}


def write_results(run: RunSpec, folder: Path, prompts: list[Prompt], model: str) -> dict[str, Any]:
    comps = {c["id"]: c for c in _read_jsonl(folder / COMPLETIONS)}
    spec = run.adapter_spec
    states, per_instance = [], []
    agg: dict[str, Stat] = {}
    for p in prompts:
        c = comps.get(p.instance.id)
        if c is None:
            continue
        values = instance_stats(run, p, c)
        for k, v in values.items():
            agg.setdefault(k, Stat(k)).add(v)
        per_instance.append({"instance_id": p.instance.id, "train_trial_index": 0,
                             "stats": [Stat(k).add(v).to_json() for k, v in values.items()]})
        states.append({
            "instance": p.instance.to_json(), "train_trial_index": 0, "num_train_instances": p.num_train,
            "prompt_truncated": p.truncated, "output_mapping": p.output_mapping or None,
            "request": {"model": model, "prompt": p.text, "temperature": spec.temperature,
                        "max_tokens": spec.max_tokens, "stop_sequences": list(spec.stop_sequences),
                        "num_completions": 1},
            "result": {"success": True, "completions": [{"text": c["completion"], "tokens": c["token_ids"],
                                                          "finish_reason": c["finish_reason"]}],
                       "prompt_tokens": c["prompt_tokens"], "prompt_logprobs": c.get("prompt_logprobs")},
        })
    stats = [s.to_json() for s in agg.values()] + [s.to_json() for s in derived(agg)]
    eff = efficiency_stats(_read_jsonl(folder / EFFICIENCY))
    stats += [Stat(k).add(v).to_json() for k, v in eff.items()]
    _write(folder / "scenario_state.json", {"adapter_spec": spec.to_json(), "request_states": states})
    _write(folder / "per_instance_stats.json", per_instance)
    _write(folder / "stats.json", stats)
    return {s["name"]["name"]: s["mean"] for s in stats}


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
