"""Generation settings and next-token selection.

Knows: per-request settings (max_new_tokens, temperature, top-p, top-k, seed,
stop strings), their validation, and how to pick the next token of each row of
a batch: greedy argmax, or a draw from the filtered distribution with the
row's own generator, so a row's tokens never depend on its batch mates.
Does not know: models, engines, tokenizers.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

from flexoff.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens with this much probability
    top_k: int = 0  # 0 keeps all tokens
    seed: int | None = None  # None: derived from the job's seed and the request id
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (not included in the output)

    def __post_init__(self) -> None:
        def bad(what: str) -> InputError:
            return InputError(what)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise bad(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer from 0 to 2**63 - 1, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_seed(job_seed: int, request_id: str, params: SamplingParams) -> int:
    if params.seed is not None:
        return params.seed
    return zlib.crc32(f"{job_seed}:{request_id}".encode()) & 0x7FFFFFFF


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (with -inf) tokens outside the top-k and outside the top-p nucleus of a 1-D row."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is full
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


class BlockSampler:
    """Next-token choice for every row of a block of GPU batches."""

    def __init__(self, params: list[list[SamplingParams]], seeds: list[list[int]], device: torch.device):
        self.params = params
        self.gens: list[list[torch.Generator | None]] = []
        for ps, ss in zip(params, seeds):
            row = []
            for p, s in zip(ps, ss):
                g = None
                if not p.greedy:
                    g = torch.Generator(device=device)
                    g.manual_seed(s)
                row.append(g)
            self.gens.append(row)

    def __call__(self, logits: torch.Tensor, k: int, i: int) -> torch.Tensor:
        ids = logits.argmax(-1)
        for r, (p, g) in enumerate(zip(self.params[k], self.gens[k])):
            if g is None:
                continue
            row = filter_logits(logits[r].float() / p.temperature, p.top_k, p.top_p)
            ids[r] = torch.multinomial(row.softmax(-1), 1, generator=g)[0]
        return ids
