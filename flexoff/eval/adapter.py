"""Adapter specs: how instances become prompts (HELM's adaptation).

Knows: the three methods (`generation`, `multiple_choice_joint`, `language_modeling`), the
prompt pieces (instructions, input/output prefixes and suffixes, the separator between
examples), few-shot examples sampled once with a fixed seed from the train split, dropped from
the end while the prompt plus max_tokens exceeds the model's context (then the input itself is
cut from the left), max_tokens, temperature and stop sequences.
Does not know: models (it gets a tokenizer and a context length), metrics.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Sequence

from flexoff.errors import InputError
from flexoff.eval.scenarios import LETTERS, TRAIN, Instance

METHODS = ("generation", "multiple_choice_joint", "language_modeling")


@dataclass(frozen=True)
class AdapterSpec:
    method: str = "generation"
    instructions: str = ""
    input_prefix: str = ""
    input_suffix: str = "\n"
    output_prefix: str = "Answer: "
    output_suffix: str = "\n"
    instance_prefix: str = "\n"  # between examples
    max_train_instances: int = 5
    max_tokens: int = 100
    temperature: float = 0.0
    stop_sequences: tuple[str, ...] = ("\n",)
    seed: int = 0  # few-shot sampling

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_sequences"] = list(self.stop_sequences)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AdapterSpec":
        known = {f.name: f for f in fields(cls)}
        out = {}
        for k, v in d.items():
            if k not in known:
                raise InputError(f"unknown adapter field {k!r}; known: {', '.join(known)}")
            out[k] = tuple(v) if k == "stop_sequences" else v
        return cls(**out)

    def with_overrides(self, args: dict[str, str]) -> "AdapterSpec":
        """Run-entry keys that name adapter fields (max_tokens=10, method=...) override them."""
        changes: dict[str, Any] = {}
        for f in fields(self):
            if f.name in args:
                v = args[f.name]
                try:
                    changes[f.name] = (int(v) if f.type in ("int",) else float(v) if f.type == "float"
                                       else tuple(v.split("|")) if f.name == "stop_sequences" else v)
                except ValueError:
                    raise InputError(f"{f.name} must be a number, got {v!r}") from None
        return replace(self, **changes)


@dataclass
class Prompt:
    """One request to make for an eval instance."""

    instance: Instance
    text: str
    ids: list[int]
    num_train: int  # few-shot examples that fit
    truncated: bool  # the instance's own input was cut to fit
    output_mapping: dict[str, str] = field(default_factory=dict)  # multiple choice: letter -> choice


def _choices_block(inst: Instance) -> str:
    return "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(inst.choices))


def _example(spec: AdapterSpec, inst: Instance, answer: str | None) -> str:
    body = inst.input
    if spec.method == "multiple_choice_joint":
        body = body + "\n" + _choices_block(inst).rstrip("\n")
    text = spec.input_prefix + body + spec.input_suffix + spec.output_prefix
    if answer is None:
        return text.rstrip(" ") if spec.output_prefix.endswith(" ") else text
    return text + answer + spec.output_suffix


def _answer(spec: AdapterSpec, inst: Instance) -> str:
    if spec.method == "multiple_choice_joint":
        return next(LETTERS[i] for i, r in enumerate(inst.references) if r.is_correct)
    return inst.correct[0] if inst.correct else ""


def train_examples(spec: AdapterSpec, instances: Sequence[Instance]) -> list[Instance]:
    """The few-shot examples, sampled once (HELM's train trial 0) with the spec's seed."""
    pool = [i for i in instances if i.split == TRAIN]
    k = min(spec.max_train_instances, len(pool))
    return random.Random(spec.seed).sample(pool, k) if k else []


def build_prompt(spec: AdapterSpec, inst: Instance, train: Sequence[Instance], tokenizer: Any,
                 context: int) -> Prompt:
    """The prompt for one instance; few-shot examples dropped from the end until it fits."""
    head = spec.instructions + "\n\n" if spec.instructions else ""
    mapping = {LETTERS[i]: c for i, c in enumerate(inst.choices)} if spec.method == "multiple_choice_joint" else {}
    if spec.method == "language_modeling":
        ids = tokenizer.encode(inst.input)
        cut = len(ids) > context
        return Prompt(inst, inst.input, ids[:context], 0, cut)
    budget = context - spec.max_tokens
    for k in range(len(train), -1, -1):
        shots = "".join(_example(spec, t, _answer(spec, t)) + spec.instance_prefix for t in train[:k])
        text = head + shots + _example(spec, inst, None)
        ids = tokenizer.encode(text)
        if len(ids) <= budget:
            return Prompt(inst, text, ids, k, False, mapping)
    if budget < 1:
        raise InputError(f"max_tokens {spec.max_tokens} leaves no room for a prompt in a context of {context}")
    return Prompt(inst, tokenizer.decode(ids[-budget:]), ids[-budget:], 0, True, mapping)
