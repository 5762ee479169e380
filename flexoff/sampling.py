"""Generation settings and next-token selection.

Knows: per-request settings (max_new_tokens, temperature, top-p, top-k, seed, stop strings
and token ids, n samples, logprobs, min_tokens, ignore_eos, repetition, presence and
frequency penalties), their validation, and how to pick the next token of each row of a batch
on the compute device: penalties from the row's own history (repetition over its prompt and
output, as Hugging Face's; presence and frequency over its output, as OpenAI's and vLLM's),
end-of-sequence and stop ids barred until min_tokens, then greedy argmax or a draw from the
filtered distribution with the row's own generator (so a row's tokens never depend on its
batch mates); and the log-probabilities of the raw distribution (the chosen token's and the
top ones) where asked.
Does not know: models, engines, tokenizers.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import InitVar, dataclass, field
from typing import Sequence

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
    n: int = 1  # samples per prompt (sample j draws from seed + j)
    logprobs: int | None = None  # top log-probabilities per generated token (0: the chosen token's only)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # stop on these (not included)
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    min_tokens: int = 0  # no end-of-sequence or stop id before this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (HF's)
    presence_penalty: float = 0.0  # subtracted from tokens the output holds (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (OpenAI's)
    max_tokens: InitVar[int | None] = None  # vLLM's and OpenAI's name for max_new_tokens

    def __post_init__(self, max_tokens: int | None) -> None:
        if max_tokens is not None:
            object.__setattr__(self, "max_new_tokens", max_tokens)
        for name in ("stop", "stop_token_ids"):  # a string or a list, as JSON gives them
            v = getattr(self, name)
            if isinstance(v, (str, int)) and not isinstance(v, bool):
                v = (v,)
            if not isinstance(v, (list, tuple)):
                raise InputError(f"{name} must be a list, got {v!r}")
            object.__setattr__(self, name, tuple(v))

        def bad(what: str) -> InputError:
            return InputError(what)

        def integer(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not integer(self.max_new_tokens) or not 0 <= self.max_new_tokens <= 10**7:
            raise bad(f"max_new_tokens must be an integer from 0, got {self.max_new_tokens!r}")
        if not number(self.temperature) or not 0 <= self.temperature <= 1e4:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or not 0 <= self.top_k <= 2**31:
            raise bad(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer from 0 to 2**63 - 1, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of them")
        if not integer(self.n) or not 1 <= self.n <= 1024:
            raise bad(f"n must be an integer from 1 to 1024, got {self.n!r}")
        if self.logprobs is not None and (not integer(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be an integer from 0 to 20, got {self.logprobs!r}")
        if not all(integer(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not integer(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if not number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(f"{name} must be a number from -2 to 2, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs", "stop_token_ids",
          "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty")


def row_seed(job_seed: int, request_id: str, params: SamplingParams, sample: int = 0) -> int:
    """The seed of one sample's generator: the request's seed (plus the sample's index), or one
    derived from the job's seed, the request id and the sample."""
    if params.seed is not None:
        return (params.seed + sample) % 2**63
    key = f"{job_seed}:{request_id}" + (f"#{sample}" if sample else "")
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


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


@dataclass
class TokenLogprobs:
    """Per generated token of one row: the chosen token's log-probability, and the top ones."""
    chosen: list[float]
    top: list[list[tuple[int, float]]]


class _BatchState:
    """One GPU batch's sampling state on the device."""

    def __init__(self, params: list[SamplingParams], seeds: list[int], prompts: list[list[int]] | None,
                 stop_ids: list[tuple[int, ...]], device: torch.device):
        self.params = params
        self.gens: list[torch.Generator | None] = []
        for p, s in zip(params, seeds):
            g = None
            if not p.greedy:
                g = torch.Generator(device=device)
                g.manual_seed(s)
            self.gens.append(g)
        n = len(params)
        self.penalized = any(p.penalized for p in params)
        self.counts: torch.Tensor | None = None  # (n, vocab) occurrences in the output, made at the first step
        self.seen: torch.Tensor | None = None  # (n, vocab) in the prompt or output
        self.prompts = prompts
        self.rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        self.pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        self.freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        self.min_tokens = [p.min_tokens for p in params]
        self.stop_ids = stop_ids  # per row: ids barred before min_tokens
        self.top = max((p.logprobs or 0) for p in params)
        self.want_lp = any(p.logprobs is not None for p in params)
        self.lp_chosen: list[torch.Tensor] = []  # per step (n,)
        self.lp_top: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step (n, top) values, ids
        self.n = n

    def _history(self, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(self.n, vocab, device=device)
        self.seen = torch.zeros(self.n, vocab, dtype=torch.bool, device=device)
        for r, ids in enumerate(self.prompts or []):
            if ids:
                self.seen[r, torch.tensor(ids, device=device)] = True


class BlockSampler:
    """Next-token choice for every row of a block of GPU batches."""

    def __init__(self, params: list[list[SamplingParams]], seeds: list[list[int]], device: torch.device,
                 prompts: list[list[list[int]]] | None = None, eos_ids: Sequence[int] = ()):
        self.params = params
        self.batches = [_BatchState(ps, ss, prompts[k] if prompts else None,
                                    [tuple(eos_ids) + p.stop_token_ids for p in ps], device)
                        for k, (ps, ss) in enumerate(zip(params, seeds))]

    def __call__(self, logits: torch.Tensor, k: int, i: int) -> torch.Tensor:
        b = self.batches[k]
        raw = logits.float()
        x = raw
        if b.penalized:
            if b.counts is None:
                b._history(raw.shape[-1], raw.device)
            x = torch.where(b.seen, torch.where(x < 0, x * b.rep, x / b.rep), x)
            x = x - b.pres * (b.counts > 0) - b.freq * b.counts
        barred = [r for r, m in enumerate(b.min_tokens) if i < m and b.stop_ids[r]]
        if barred:
            x = x.clone() if x is raw else x
            for r in barred:
                x[r, list(b.stop_ids[r])] = float("-inf")
        ids = x.argmax(-1)
        for r, (p, g) in enumerate(zip(b.params, b.gens)):
            if g is None:
                continue
            row = filter_logits(x[r] / p.temperature, p.top_k, p.top_p)
            ids[r] = torch.multinomial(row.softmax(-1), 1, generator=g)[0]
        if b.penalized:
            b.counts.scatter_add_(1, ids[:, None], torch.ones_like(ids[:, None], dtype=b.counts.dtype))
            b.seen.scatter_(1, ids[:, None], True)
        if b.want_lp:
            lp = raw.log_softmax(-1)
            b.lp_chosen.append(lp.gather(1, ids[:, None])[:, 0])
            if b.top:
                vals, idx = lp.topk(b.top, dim=-1)
                b.lp_top.append((vals, idx))
        return ids

    def logprobs(self, k: int) -> list[TokenLogprobs | None]:
        """Batch k's log-probabilities per row (None for rows that did not ask), read to the host."""
        b = self.batches[k]
        if not b.want_lp:
            return [None] * b.n
        chosen = torch.stack(b.lp_chosen, 1).tolist() if b.lp_chosen else [[] for _ in range(b.n)]
        tops = [(v.tolist(), i.tolist()) for v, i in b.lp_top]
        out: list[TokenLogprobs | None] = []
        for r, p in enumerate(b.params):
            if p.logprobs is None:
                out.append(None)
                continue
            top = [[(i[r][c], v[r][c]) for c in range(p.logprobs)] for v, i in tops] if p.logprobs else \
                [[] for _ in chosen[r]]
            out.append(TokenLogprobs(chosen[r], top))
        return out
