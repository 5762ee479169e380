"""Perplexity of a model on a text, for measuring what compression costs.

Knows: cutting a text's tokens into non-overlapping windows of the model's
context or 512 tokens (whichever is smaller), scoring each window's tokens
given the ones before them in the window (the engine's prompt log-probs,
through whatever policy the LLM runs, compression included), and the total.
Does not know: how log-probs are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flexoff.errors import InputError

MAX_WINDOW = 512


@dataclass
class Perplexity:
    tokens: int  # tokens scored (each window's first token is context only)
    windows: int
    window: int
    nll: float  # total negative log-likelihood, nats

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.tokens)


def perplexity(llm: Any, text: str, max_tokens: int | None = None) -> Perplexity:
    ids = llm.tokenizer.encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    window = min(llm.model.spec.max_positions, MAX_WINDOW)
    chunks = [ids[i:i + window] for i in range(0, len(ids), window)]
    chunks = [c for c in chunks if len(c) >= 2]
    if not chunks:
        raise InputError("the text has fewer than two tokens; nothing to score")
    out = llm.generate([{"prompt_ids": c, "id": str(n)} for n, c in enumerate(chunks)],
                       max_new_tokens=0, prompt_logprobs=True)
    nll = -sum(sum(c.prompt_logprobs) for c in out.completions)
    return Perplexity(sum(len(c) - 1 for c in chunks), len(chunks), window, nll)
