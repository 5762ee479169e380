"""`local_data`: a HELM scenario over the user's own file, and its run-spec function.

Knows: the file formats (JSONL or CSV; `input` plus `output` or a `references` list, an optional
`split` of train/valid/test, test by default, and `id`), the run spec HELM builds for it (HELM's
generation adapter with its few-shot selection from the file's train rows, and HELM's
exact match, F1 and ROUGE-L), and a run name that names the file without its folder
(a hash of the path keeps two files apart), so no path part leaves --output-path.
Importing this module registers `local_data` with HELM's run-spec functions.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from helm.benchmark.adaptation.common_adapter_specs import get_generation_adapter_spec
from helm.benchmark.metrics.common_metric_specs import get_basic_metric_specs
from helm.benchmark.run_spec import RunSpec, run_spec_function
from helm.benchmark.scenarios.scenario import (CORRECT_TAG, TEST_SPLIT, TRAIN_SPLIT, VALID_SPLIT, Input, Instance,
                                               Output, Reference, Scenario, ScenarioSpec)

from flexoff.errors import InputError

# HELM's open-ended generation metrics but BLEU (which needs nltk's punkt data, a download)
METRICS = ["exact_match", "quasi_exact_match", "f1_score", "rouge_l"]
SPLITS = {"train": TRAIN_SPLIT, "valid": VALID_SPLIT, "test": TEST_SPLIT}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The file's rows: JSONL (one object per line) or CSV (a header row)."""
    if not path.is_file():
        raise InputError(f"local_data: {path}: no such file")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".csv":
        return list(csv.DictReader(text.splitlines()))
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"local_data: {path} line {n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"local_data: {path} line {n}: expected an object")
            rows.append(row)
    return rows


def instance(row: dict[str, Any], where: str) -> Instance:
    if not isinstance(row.get("input"), str):
        raise InputError(f"{where}: needs a string 'input'")
    refs = row.get("references", row.get("output"))
    refs = [refs] if isinstance(refs, str) else refs
    if not refs or not all(isinstance(r, str) for r in refs):
        raise InputError(f"{where}: needs 'output' (a string) or 'references' (a list of strings)")
    split = str(row.get("split") or "test")
    if split not in SPLITS:
        raise InputError(f"{where}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    return Instance(Input(text=row["input"]), [Reference(Output(text=r), tags=[CORRECT_TAG]) for r in refs],
                    split=SPLITS[split], id=str(row["id"]) if row.get("id") is not None else None)


class LocalDataScenario(Scenario):
    """Instances from a local JSONL or CSV file."""

    name = "local_data"
    description = "Instances from a local file (input and reference outputs)"
    tags = ["local_data"]

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def get_instances(self, output_path: str) -> list[Instance]:
        p = Path(self.path)
        return [instance(r, f"local_data: {p} row {n}") for n, r in enumerate(read_rows(p), 1)]


@run_spec_function("local_data")
def get_local_data_spec(path: str, max_tokens: str = "100", max_train_instances: str = "5",
                        instructions: str = "", stop: str = "newline") -> RunSpec:
    """`local_data:path=FILE[,max_tokens=N,max_train_instances=K,stop=newline|none]`."""
    full = str(Path(path).expanduser().resolve())
    tag = hashlib.sha256(full.encode()).hexdigest()[:8]
    adapter = get_generation_adapter_spec(instructions=instructions, input_noun="Input", output_noun="Output",
                                          max_tokens=int(max_tokens), max_train_instances=int(max_train_instances),
                                          stop_sequences=["\n"] if stop == "newline" else [])
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(full).stem)
    return RunSpec(name=f"local_data:file={stem}-{tag}",
                   scenario_spec=ScenarioSpec(class_name=f"{__name__}.LocalDataScenario", args={"path": full}),
                   adapter_spec=adapter, metric_specs=get_basic_metric_specs(METRICS), groups=["local_data"])
