"""Run specs: a scenario, an adapter spec and metrics, from HELM-style strings or files.

Knows: parsing `scenario:key=value,...` run entries (keys naming adapter fields override the
scenario's default adapter spec; the rest are scenario arguments), YAML/JSON files listing
entries, the default adapter spec of each scenario (from HELM's choices for these tasks), and
run names.
Does not know: how runs execute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from flexoff.errors import InputError
from flexoff.eval.adapter import AdapterSpec
from flexoff.eval.scenarios import make_scenario

SOLVE = "Please solve the following problem."
DEFAULT_ADAPTERS = {
    "synthetic_reasoning": AdapterSpec(instructions=SOLVE, output_prefix="Target: ", max_train_instances=3,
                                       max_tokens=50),
    "synthetic_reasoning_natural": AdapterSpec(instructions=SOLVE, output_prefix="Target: ", max_train_instances=3,
                                               max_tokens=20),
    "synthetic_efficiency": AdapterSpec(output_prefix="", input_suffix="", max_train_instances=0, max_tokens=32,
                                        stop_sequences=()),
    "generation": AdapterSpec(),
    "multiple_choice": AdapterSpec(method="multiple_choice_joint", input_prefix="Question: ",
                                   instructions="The following are multiple choice questions (with answers).",
                                   max_tokens=1, stop_sequences=()),
}
METRICS = {"generation": ["exact_match", "quasi_exact_match", "prefix_exact_match", "f1_score", "rouge_l"],
           "multiple_choice_joint": ["exact_match", "quasi_exact_match"],
           "language_modeling": ["perplexity", "bits_per_byte", "logprob"]}


@dataclass(frozen=True)
class RunSpec:
    name: str
    scenario: str
    scenario_args: tuple[tuple[str, str], ...]
    adapter_spec: AdapterSpec
    metrics: tuple[str, ...]
    lora: str | None = None  # the LoRA adapter the run's requests use (adapter=NAME in the entry)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "scenario_spec": {"class_name": self.scenario, "args": dict(self.scenario_args)},
                "adapter_spec": self.adapter_spec.to_json(), "metric_specs": [{"name": m} for m in self.metrics],
                **({"lora_adapter": self.lora} if self.lora else {})}

    def make_scenario(self):
        return make_scenario(self.scenario, dict(self.scenario_args))


def parse_entry(entry: str, model: str) -> RunSpec:
    """'synthetic_reasoning:mode=pattern_match,max_tokens=20' -> RunSpec."""
    name, _, rest = entry.strip().partition(":")
    args: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise InputError(f"run entry {entry!r}: {part!r} is not key=value")
        args[key.strip()] = value.strip()
    base = DEFAULT_ADAPTERS.get(name, AdapterSpec())
    adapter = base.with_overrides(args)
    adapter_keys = {f.name for f in fields(AdapterSpec)} | {"adapter"}  # adapter=NAME: a LoRA adapter
    scenario_args = {k: v for k, v in args.items() if k not in adapter_keys}
    make_scenario(name, scenario_args)  # validates the name and arguments now
    arg_text = ",".join(f"{k}={v}" for k, v in args.items())
    model_name = model.replace("/", "_").replace(":", "_")
    run_name = f"{name}:{arg_text + ',' if arg_text else ''}model={model_name}"
    return RunSpec(run_name, name, tuple(scenario_args.items()), adapter, tuple(METRICS[adapter.method]),
                   args.get("adapter") or None)


def read_entries(path: str) -> list[str]:
    """Run entries from a YAML or JSON file: a list of strings, or HELM's
    {entries: [{description: ...}, ...]}."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise their own types
        raise InputError(f"{path} is not valid {'YAML' if p.suffix != '.json' else 'JSON'}: {e}") from None
    if isinstance(data, dict):
        data = data.get("entries", [])
    shape = f"{path} must list run entries: strings, or {{entries: [{{description: string}}, ...]}}"
    if data is not None and not isinstance(data, list):
        raise InputError(shape)
    out = []
    for e in data or []:
        e = e.get("description") if isinstance(e, dict) else e
        if not isinstance(e, str):
            raise InputError(shape)
        out.append(e)
    if not out:
        raise InputError(f"{path} lists no run entries")
    return out
