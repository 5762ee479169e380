"""Metrics, as HELM defines them, and HELM's Stat aggregate.

Knows: exact_match, quasi_exact_match (after normalization: lower case, no punctuation or
articles, single spaces), prefix_exact_match, f1_score (token overlap), ROUGE-L (longest common
subsequence F-measure, own implementation); each the max over the correct references; for
language modeling, log-likelihood, perplexity and bits per byte; Stat (count, sum, sum of
squares, min, max, mean, variance, stddev).
Does not know: models or files.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    text = ARTICLES.sub(" ", text.lower().translate(PUNCT))
    return " ".join(text.split())


def exact_match(pred: str, ref: str) -> float:
    return float(pred.strip() == ref.strip())


def quasi_exact_match(pred: str, ref: str) -> float:
    return float(normalize(pred) == normalize(ref))


def prefix_exact_match(pred: str, ref: str) -> float:
    return float(pred.strip().startswith(ref.strip()))


def f1_score(pred: str, ref: str) -> float:
    p, r = normalize(pred).split(), normalize(ref).split()
    if not p or not r:
        return float(p == r)
    overlap, counts = 0, {}
    for w in r:
        counts[w] = counts.get(w, 0) + 1
    for w in p:
        if counts.get(w, 0) > 0:
            overlap += 1
            counts[w] -= 1
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(p), overlap / len(r)
    return 2 * precision * recall / (precision + recall)


def lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F-measure over lower-cased whitespace tokens."""
    p, r = pred.lower().split(), ref.lower().split()
    if not p or not r:
        return float(p == r)
    n = lcs(p, r)
    if n == 0:
        return 0.0
    precision, recall = n / len(p), n / len(r)
    return 2 * precision * recall / (precision + recall)


REFERENCE_METRICS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match, "quasi_exact_match": quasi_exact_match,
    "prefix_exact_match": prefix_exact_match, "f1_score": f1_score, "rouge_l": rouge_l,
}


def best_over_references(pred: str, refs: Iterable[str]) -> dict[str, float]:
    refs = list(refs)
    return {name: max((fn(pred, r) for r in refs), default=0.0) for name, fn in REFERENCE_METRICS.items()}


@dataclass
class Stat:
    """HELM's Stat: an aggregate of values of one named metric on one split."""

    name: str
    split: str = "test"
    count: int = 0
    sum: float = 0.0
    sum_squared: float = 0.0
    min: float | None = None
    max: float | None = None
    values: list[float] = field(default_factory=list, repr=False)

    def add(self, x: float) -> "Stat":
        self.count += 1
        self.sum += x
        self.sum_squared += x * x
        self.min = x if self.min is None else min(self.min, x)
        self.max = x if self.max is None else max(self.max, x)
        return self

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def to_json(self) -> dict[str, Any]:
        mean = self.mean
        var = max(0.0, self.sum_squared / self.count - mean * mean) if self.count else None
        return {"name": {"name": self.name, "split": self.split}, "count": self.count, "sum": self.sum,
                "sum_squared": self.sum_squared, "min": self.min, "max": self.max, "mean": mean,
                "variance": var, "stddev": math.sqrt(var) if var is not None else None}


def language_modeling(logprobs: list[float], text: str) -> dict[str, float]:
    """Per-instance log-likelihood stats; perplexity and bits per byte come from their sums."""
    return {"logprob": sum(logprobs), "num_perplexity_tokens": float(len(logprobs)),
            "num_bytes": float(len(text.encode("utf-8")))}


def derived(stats: dict[str, Stat]) -> list[Stat]:
    """Run-level metrics computed from sums: perplexity and bits per byte."""
    out = []
    if "logprob" in stats and stats["num_perplexity_tokens"].sum > 0:
        lp, n, nb = stats["logprob"].sum, stats["num_perplexity_tokens"].sum, stats["num_bytes"].sum
        out.append(Stat("perplexity").add(math.exp(-lp / n)))
        out.append(Stat("bits_per_byte").add(-lp / math.log(2) / nb))
        out.append(Stat("logprob_per_token").add(lp / n))
    return out
