"""HELM's procedural reasoning scenarios, generated deterministically by our own code.

Knows: `synthetic_reasoning` (from the LIME tasks: pattern_match asks which of several rules
produced a result; variable_substitution applies a substitution to a rule; induction recovers
the rule from a result and its substitution) and `synthetic_reasoning_natural` (if-then rules
over objects and attributes in English; a fact; a question answered by chaining the rules;
easy, medium and hard differ in the number of rules, conjunctions and chain length). Every
instance is a function of (seed, index), so the same seed gives the same instances.
Does not know: prompts or models.
"""

from __future__ import annotations

import random

from flexoff.errors import InputError
from flexoff.eval.scenarios import CORRECT, TEST, TRAIN, Instance, Reference, Scenario, _int, register

VARIABLES = "ABCDEFGH"
OPERATORS = ["+", "-", "*", "=", "|"]
WORDS = ["apple", "river", "stone", "cloud", "lamp", "violin", "tiger", "pencil", "garden", "mirror", "rocket",
         "candle", "forest", "window", "anchor", "bridge", "falcon", "harbor", "island", "jacket"]


def _rule(rng: random.Random) -> list[str]:
    """A pattern: 3 to 5 variables joined by operators, some repeated (e.g. A + B = B + A)."""
    n = rng.randint(2, 3)
    names = VARIABLES[:n]
    length = rng.randint(3, 5)
    toks = [rng.choice(names) for _ in range(length)]
    for v in names:  # every variable appears
        if v not in toks:
            toks[rng.randrange(length)] = v
    out = []
    for i, t in enumerate(toks):
        if i:
            out.append(rng.choice(OPERATORS))
        out.append(t)
    return out


def _substitution(rng: random.Random, rule: list[str]) -> dict[str, str]:
    names = sorted({t for t in rule if t in VARIABLES})
    return {v: " ".join(rng.sample(WORDS, rng.randint(1, 2))) for v in names}


def _apply(rule: list[str], sub: dict[str, str]) -> str:
    return " ".join(sub.get(t, t) for t in rule)


class _Procedural(Scenario):
    """Instances made one by one from (seed, index): the first num_train are the train split."""

    num_train: int
    num_test: int

    def make(self, i: int) -> tuple[str, str]:  # pragma: no cover - interface
        raise NotImplementedError

    def instances(self) -> list[Instance]:
        out = []
        for i in range(self.num_train + self.num_test):
            text, answer = self.make(i)
            split = TRAIN if i < self.num_train else TEST
            out.append(Instance(text, (Reference(answer, (CORRECT,)),), split, f"id{i}"))
        return out


@register("synthetic_reasoning")
class SyntheticReasoning(_Procedural):
    MODES = ("pattern_match", "variable_substitution", "induction")
    ARGS = ("mode", "seed", "num_train", "num_test")

    def __init__(self, args: dict[str, str]):
        super().__init__("synthetic_reasoning", args, "LIME-style symbolic reasoning", ("reasoning",))
        self.mode = args.get("mode", "pattern_match")
        if self.mode not in self.MODES:
            raise InputError(f"synthetic_reasoning mode must be one of {', '.join(self.MODES)}, got {self.mode!r}")
        self.seed = _int(args, "seed", 42)
        self.num_train, self.num_test = _int(args, "num_train", 100), _int(args, "num_test", 1000)

    def make(self, i: int) -> tuple[str, str]:
        rng = random.Random(f"{self.seed}:{self.mode}:{i}")
        rule = _rule(rng)
        sub = _substitution(rng, rule)
        result = _apply(rule, sub)
        subs = ", ".join(f"{k} = {v}" for k, v in sub.items())
        if self.mode == "variable_substitution":
            return f"Rule: {' '.join(rule)}\nSubstitutions: {subs}", result
        if self.mode == "induction":
            return f"Result: {result}\nSubstitutions: {subs}", " ".join(rule)
        rules = [rule]
        while len(rules) < 3:  # distinct distractors that do not also match the result
            other = _rule(rng)
            if other not in rules and len(other) != len(rule):
                rules.append(other)
        rng.shuffle(rules)
        listing = "\n".join(" ".join(r) for r in rules)
        return f"Rules:\n{listing}\nResult: {result}", " ".join(rule)



SUBJECTS = ["the dog", "the cat", "the bear", "the rabbit", "the mouse", "the lion", "the cow", "the squirrel"]
ATTRIBUTES = {
    "color": ["red", "blue", "green", "yellow", "purple", "white"],
    "size": ["big", "small", "tiny", "huge"],
    "mood": ["happy", "sad", "calm", "angry"],
    "temperature": ["hot", "cold", "warm"],
}
DIFFICULTY = {"easy": (2, 1, 1), "medium": (4, 2, 2), "hard": (6, 2, 3)}  # rules, conditions per rule, chain


@register("synthetic_reasoning_natural")
class SyntheticReasoningNatural(_Procedural):
    ARGS = ("difficulty", "seed", "num_train", "num_test")

    def __init__(self, args: dict[str, str]):
        super().__init__("synthetic_reasoning_natural", args, "if-then reasoning in English", ("reasoning",))
        self.difficulty = args.get("difficulty", "easy")
        if self.difficulty not in DIFFICULTY:
            raise InputError(f"difficulty must be easy, medium or hard, got {self.difficulty!r}")
        self.seed = _int(args, "seed", 42)
        self.num_train, self.num_test = _int(args, "num_train", 100), _int(args, "num_test", 1000)

    def make(self, i: int) -> tuple[str, str]:
        rng = random.Random(f"{self.seed}:{self.difficulty}:{i}")
        n_rules, n_cond, chain = DIFFICULTY[self.difficulty]
        subject = rng.choice(SUBJECTS)
        cats = list(ATTRIBUTES)
        rng.shuffle(cats)
        target, others = cats[n_cond], [c for c in cats if c != cats[n_cond]]
        values = {c: rng.sample(ATTRIBUTES[c], len(ATTRIBUTES[c])) for c in cats}
        # a chain from the facts to the answer; only its last step concludes a value of the target
        facts = [values[c].pop() for c in cats[:n_cond]]
        known, rules = list(facts), []
        for step in range(chain):
            cat = target if step == chain - 1 else rng.choice([c for c in others if values[c]])
            value = values[cat].pop()
            rules.append((rng.sample(known, min(n_cond, len(known))), value))
            known.append(value)
        answer = known[-1]
        while len(rules) < n_rules:  # distractors: one condition never holds, so they never fire
            missing = rng.choice([v for c in cats for v in ATTRIBUTES[c] if v not in known])
            cond = rng.sample(known, max(0, n_cond - 1)) + [missing]
            rules.append((cond, rng.choice([v for v in ATTRIBUTES[target] if v != answer])))
        rng.shuffle(rules)
        lines = [f"If {subject} is {' and '.join(c)}, then {subject} is {v}." for c, v in rules]
        fact = f"Fact: {subject.capitalize()} is {' and '.join(facts)}."
        question = f"Question: What {target} is {subject}?"
        return "Rules:\n" + "\n".join(lines) + f"\n{fact}\n{question}", answer

