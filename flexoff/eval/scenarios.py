"""Scenarios and instances, as HELM has them.

Knows: an Instance (input, references tagged `correct`, split, id), the Scenario
interface, the registry of scenarios by name, and the scenarios that read local
data: JSONL/CSV generation tasks and multiple-choice tasks (MMLU-style files),
plus `synthetic_efficiency` (prompts of exactly N tokens cut from a text file).
The procedural reasoning scenarios live in synthetic.py.
Does not know: prompts, models, metrics.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from flexoff import validate
from flexoff.errors import InputError

CORRECT = "correct"
TRAIN, TEST = "train", "test"
DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Reference:
    output: str
    tags: tuple[str, ...] = ()

    @property
    def is_correct(self) -> bool:
        return CORRECT in self.tags

    def to_json(self) -> dict[str, Any]:
        return {"output": {"text": self.output}, "tags": list(self.tags)}


@dataclass(frozen=True)
class Instance:
    input: str
    references: tuple[Reference, ...]
    split: str
    id: str
    choices: tuple[str, ...] = ()  # multiple choice: the options, in order

    def to_json(self) -> dict[str, Any]:
        d = {"input": {"text": self.input}, "references": [r.to_json() for r in self.references],
             "split": self.split, "id": self.id}
        return d

    @property
    def correct(self) -> list[str]:
        return [r.output for r in self.references if r.is_correct]


@dataclass
class Scenario:
    """Named, parameterized source of instances."""

    name: str
    args: dict[str, str] = field(default_factory=dict)
    description: str = ""
    tags: tuple[str, ...] = ()
    ARGS: ClassVar[tuple[str, ...]] = ()  # the run-entry keys this scenario takes

    def instances(self) -> list[Instance]:  # pragma: no cover - interface
        raise NotImplementedError


SCENARIOS: dict[str, Callable[[dict[str, str]], Scenario]] = {}


def register(name: str) -> Callable:
    def deco(cls: Callable) -> Callable:
        SCENARIOS[name] = cls
        return cls
    return deco


def make_scenario(name: str, args: dict[str, str]) -> Scenario:
    if name not in SCENARIOS:
        raise InputError(f"unknown scenario {name!r}; known: {', '.join(sorted(SCENARIOS))}")
    known = getattr(SCENARIOS[name], "ARGS", ())
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise InputError(f"{name} takes no argument {unknown[0]!r}; it takes {', '.join(known) or 'none'} "
                         "and the adapter's fields")
    return SCENARIOS[name](args)


def _int(args: dict[str, str], key: str, default: int) -> int:
    try:
        return int(args.get(key, default))
    except ValueError:
        raise InputError(f"{key} must be an integer, got {args[key]!r}") from None


def _read_rows(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    try:
        if p.suffix == ".csv":
            with open(p, newline="", encoding="utf-8") as f:
                return list(csv.DictReader(f))
        return [row for _, row in validate.read_jsonl(p.read_text(encoding="utf-8"), path)]
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None


def _split(row: dict[str, Any], n: int, train_every: int) -> str:
    if "split" in row:
        return str(row["split"])
    return TRAIN if train_every and n % train_every == 0 else TEST


@register("generation")
class GenerationFile(Scenario):
    """A local file of generation tasks. JSONL lines (or CSV rows) with `input` and either
    `references` (a list, all correct) or `output` (neither, for language modeling); optional
    `id` and `split` (train rows are the few-shot pool; without a split column every
    `train_every`-th row is train)."""

    ARGS = ("path", "train_every")

    def __init__(self, args: dict[str, str]):
        super().__init__("generation", args, "generation tasks from a local file")
        if "path" not in args:
            raise InputError("generation needs path=FILE (JSONL or CSV with input and output columns)")

    def instances(self) -> list[Instance]:
        out, every = [], _int(self.args, "train_every", 0)
        for n, row in enumerate(_read_rows(self.args["path"])):
            if "input" not in row:
                raise InputError(f"{self.args['path']} row {n + 1}: needs an input")
            refs = row.get("references") or ([row["output"]] if "output" in row else [])
            refs = refs if isinstance(refs, list) else [refs]
            out.append(Instance(str(row["input"]), tuple(Reference(str(r), (CORRECT,)) for r in refs),
                                _split(row, n, every), str(row.get("id", f"id{n}"))))
        return out


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@register("multiple_choice")
class MultipleChoiceFile(Scenario):
    """A local multiple-choice file (MMLU-style). JSONL: `question`, `choices` (list), `answer`
    (index or letter). CSV: question, A, B, C, D, ..., answer."""

    ARGS = ("path", "train_every")

    def __init__(self, args: dict[str, str]):
        super().__init__("multiple_choice", args, "multiple-choice questions from a local file")
        if "path" not in args:
            raise InputError("multiple_choice needs path=FILE (JSONL or CSV)")

    def instances(self) -> list[Instance]:
        out, every = [], _int(self.args, "train_every", 0)
        for n, row in enumerate(_read_rows(self.args["path"])):
            choices = row.get("choices") or [row[c] for c in LETTERS if c in row and row[c] not in (None, "")]
            ans = row.get("answer")
            if "question" not in row or not choices or ans is None:
                raise InputError(f"{self.args['path']} row {n + 1}: needs question, choices and answer")
            idx = int(ans) if str(ans).isdigit() else LETTERS.find(str(ans).strip().upper())
            if not 0 <= idx < len(choices):
                raise InputError(f"{self.args['path']} row {n + 1}: answer {ans!r} is not one of the choices")
            refs = tuple(Reference(str(c), (CORRECT,) if i == idx else ()) for i, c in enumerate(choices))
            out.append(Instance(str(row["question"]), refs, _split(row, n, every), str(row.get("id", f"id{n}")),
                                tuple(str(c) for c in choices)))
        return out


@register("synthetic_efficiency")
class SyntheticEfficiency(Scenario):
    """Prompts of exactly num_prompt_tokens tokens cut from a text file (default: an English text
    shipped with flexoff), for measuring efficiency; references are empty. The cutting needs the
    tokenizer, so the runner calls `cut`."""

    ARGS = ("num_prompt_tokens", "num_instances", "path")

    def __init__(self, args: dict[str, str]):
        super().__init__("synthetic_efficiency", args, "exact-length prompts from a local text")
        self.num_prompt_tokens = _int(args, "num_prompt_tokens", 256)
        self.num_instances = _int(args, "num_instances", 10)
        self.path = args.get("path", str(DATA / "efficiency.txt"))

    def instances(self) -> list[Instance]:
        raise InputError("synthetic_efficiency is cut with the model's tokenizer; the runner does that")

    def cut(self, tokenizer: Any) -> list[tuple[Instance, list[int]]]:
        try:
            ids = tokenizer.encode(Path(self.path).read_text(encoding="utf-8"))
        except OSError as e:
            raise InputError(f"cannot read {self.path}: {e.strerror}") from None
        n = self.num_prompt_tokens
        if len(ids) < n:
            raise InputError(f"{self.path} has {len(ids)} tokens; num_prompt_tokens={n} needs more")
        out = []
        for i in range(self.num_instances):
            start = (i * 997) % (len(ids) - n + 1)
            chunk = ids[start:start + n]
            out.append((Instance(tokenizer.decode(chunk), (), TEST, f"id{i}"), chunk))
        return out
