"""The generation driver: requests in, completions out, block by block.

Knows: requests and completions, grouping prompts of similar length into
blocks of gpu_batch_size x num_gpu_batches, left padding with masks (outputs
do not depend on batch mates), stop conditions (EOS, stop strings,
max_new_tokens) checked as tokens arrive, and the run's totals (tokens,
prefill and decode time, padded vs actual tokens).
Does not know: placement or the schedule (the engine's), model math.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from flexoff.offload.engine import BatchInput, BlockResult, Engine, TrainResult
from flexoff.policy import calibration
from flexoff.sampling import BlockSampler, SamplingParams, TokenLogprobs, row_seed
from flexoff.tokenizer import Tokenizer


@dataclass
class Request:
    id: str
    prompt: Any  # what the user sent (text, messages or ids), echoed in the output
    prompt_ids: list[int]
    params: SamplingParams
    sample: int = 0  # which of the request's n samples this row computes
    adapter: str | None = None  # the LoRA adapter it uses (None: the base model)

    @property
    def key(self) -> str:
        """The row's name: the id, and the sample where there are several."""
        return self.id if self.params.n == 1 else f"{self.id}#{self.sample}"


@dataclass
class Completion:
    id: str
    prompt: Any
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    prompt_logprobs: list[float] | None = None  # log p(token | previous), for prompt tokens 1..n-1
    index: int = 0  # which of the request's samples
    logprobs: TokenLogprobs | None = None  # per token of token_ids, where asked for

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> dict[str, Any]:
        d = {"id": self.id, "prompt": self.prompt, "completion": self.text,
             "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
             "finish_reason": self.finish_reason}
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = self.prompt_logprobs
        if self.logprobs is not None:
            d["logprobs"] = logprobs_json(self.token_ids, self.logprobs)
        return d


def logprobs_json(token_ids: list[int], lp: TokenLogprobs) -> list[dict[str, Any]]:
    """Per generated token: its id, log-probability and the top alternatives."""
    return [{"token_id": t, "logprob": c, "top": [{"token_id": i, "logprob": v} for i, v in top]}
            for t, c, top in zip(token_ids, lp.chosen, lp.top)]


def group_json(comps: list[Completion]) -> dict[str, Any]:
    """One output line for a request: its first sample's fields, and every sample under
    `choices` when there are several."""
    d = comps[0].to_json()
    if len(comps) > 1:
        d["choices"] = [{"index": c.index, "completion": c.text, "completion_tokens": c.completion_tokens,
                         "finish_reason": c.finish_reason,
                         **({"logprobs": logprobs_json(c.token_ids, c.logprobs)} if c.logprobs else {})}
                        for c in comps]
    return d


@dataclass
class RunStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    padded_prompt_tokens: int = 0  # prompt tokens including padding
    padded_generated_tokens: int = 0  # token steps run times rows, finished rows included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    blocks: int = 0
    peak_bytes: dict[str, int] = field(default_factory=dict)
    traffic_prefill: dict[str, int] = field(default_factory=dict)  # bytes by copy path (engine's counters)
    traffic_decode: dict[str, int] = field(default_factory=dict)

    @property
    def generation_throughput(self) -> float:
        """Generated tokens / (prefill + decode time), as FlexGen reports it."""
        t = self.prefill_s + self.decode_s
        return self.generated_tokens / t if t > 0 else 0.0

    @property
    def decode_throughput(self) -> float:
        return self.padded_generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def add(self, other: "RunStats") -> None:
        for f in ("prompt_tokens", "generated_tokens", "padded_prompt_tokens", "padded_generated_tokens",
                  "prefill_s", "decode_s", "blocks"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.peak_bytes.items():
            self.peak_bytes[k] = max(self.peak_bytes.get(k, 0), v)
        for mine, theirs in ((self.traffic_prefill, other.traffic_prefill), (self.traffic_decode, other.traffic_decode)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["generation_throughput"] = self.generation_throughput
        d["decode_throughput"] = self.decode_throughput
        return d

    def summary(self) -> str:
        return (f"prompt tokens {self.prompt_tokens}, generated tokens {self.generated_tokens}, "
                f"prefill {self.prefill_s:.2f} s, decode {self.decode_s:.2f} s, "
                f"generation throughput {self.generation_throughput:.2f} tok/s")


# A job of this many LoRA adapters or more groups rows by adapter across prompt lengths within
# LENGTH_STEP of each other: a block then reads and pages in a few adapters instead of one per
# row, for at most 12.5% more prompt padding.
MANY_ADAPTERS = 8
LENGTH_STEP = 1.125


def plan_blocks(requests: Sequence[Request], block_size: int) -> list[list[Request]]:
    """Blocks of similar prompt length (less padding), longest last; rows of one LoRA adapter
    together among equal lengths, or (MANY_ADAPTERS or more in the job) among lengths in one
    LENGTH_STEP band (a block then uses fewer adapters)."""
    banded = len({r.adapter for r in requests} - {None}) >= MANY_ADAPTERS

    def key(r: Request) -> tuple[Any, ...]:
        n = len(r.prompt_ids)
        band = math.floor(math.log(max(1, n)) / math.log(LENGTH_STEP)) if banded else n
        return (band, r.params.max_new_tokens, r.adapter or "", n)

    order = sorted(requests, key=key)
    return [order[i:i + block_size] for i in range(0, len(order), block_size)]


def pad_left(rows: Sequence[list[int]], length: int) -> BatchInput:
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    valid = torch.zeros(len(rows), length, dtype=torch.bool)
    for r, p in enumerate(rows):
        ids[r, length - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[r, length - len(p):] = True
    return BatchInput(ids, valid)


class _Row:
    """Stop-condition bookkeeping for one request."""

    def __init__(self, req: Request, tokenizer: Tokenizer):
        self.req, self.tok = req, tokenizer
        self.ids: list[int] = []
        self.text: str | None = None
        self.reason = "length" if req.params.max_new_tokens == 0 else ""

    @property
    def done(self) -> bool:
        return bool(self.reason)

    def push(self, token: int) -> None:
        p = self.req.params
        if (token in self.tok.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self.reason = "stop"
            return
        self.ids.append(token)
        if p.stop:
            text = self.tok.decode(self.ids)
            cut = min((text.find(s) for s in p.stop if s in text), default=-1)
            if cut >= 0:
                self.text, self.reason = text[:cut], "stop"
                return
        if len(self.ids) >= p.max_new_tokens:
            self.reason = "length"

    def completion(self, prompt_lp: list[float] | None, lp: TokenLogprobs | None) -> Completion:
        text = self.text if self.text is not None else self.tok.decode(self.ids)
        if lp is not None:  # the tokens kept (not an end or stop token, nor what came after)
            lp = TokenLogprobs(lp.chosen[:len(self.ids)], lp.top[:len(self.ids)])
        return Completion(self.req.id, self.req.prompt, text, self.ids, self.reason or "length",
                          len(self.req.prompt_ids), prompt_lp, self.req.sample, lp)


class Rider(Protocol):
    """Training windows that ride on inference blocks (co-serving, flexoff.finetune.coserve)."""

    def window_len(self) -> int: ...  # the tokens its next windows need (0: none are waiting)
    def windows(self, length: int, room: int, gbs: int) -> list[BatchInput]: ...  # up to room batches
    def done(self, result: TrainResult) -> None: ...  # the block's loss and gradients of its windows
    def block(self, seconds: float, windows: int) -> None: ...  # every block's seconds, its window batches


def keep_lane_counters(engine: Any, res: BlockResult) -> None:
    """Beside a GPU, a block's decode with CPU attention over 16-bit cache rows keeps how its
    lane read, for the plans after it (policy.calibration; it decides whether the decode counts)."""
    if engine.device.type == "cuda" and not engine.policy.compress_cache:
        calibration.record(res.traffic_decode, res.steps - 1)


def run_block(engine: Engine, tokenizer: Tokenizer, block: list[Request], job_seed: int,
              prompt_logprobs: bool = False,
              on_logits: Callable[[int, list[str], torch.Tensor], None] | None = None,
              rider: Rider | None = None) -> tuple[list[Completion], RunStats]:
    """Generate the completions of one block of requests; a rider's training windows fill the
    block's spare GPU batches (every batch padded to the longer of the prompts and windows)."""
    gbs = engine.policy.gpu_batch_size
    batches = [block[i:i + gbs] for i in range(0, len(block), gbs)]
    S = max(len(r.prompt_ids) for r in block)
    room = engine.policy.num_gpu_batches - len(batches)
    if rider is not None and room > 0:
        S = max(S, min(rider.window_len(), engine.max_prompt))
    gen_len = max(1, max(r.params.max_new_tokens for r in block))
    rows = [[_Row(r, tokenizer) for r in b] for b in batches]
    chooser = BlockSampler([[r.params for r in b] for b in batches],
                           [[row_seed(job_seed, r.id, r.params, r.sample) for r in b] for b in batches], engine.device,
                           [[r.prompt_ids for r in b] for b in batches], tokenizer.eos_ids)

    def watched(logits: torch.Tensor, k: int, i: int) -> torch.Tensor:
        on_logits(i, [r.key for r in batches[k]], logits)  # (step, row names, (n, vocab))
        return chooser(logits, k, i)

    sampler = chooser if on_logits is None else watched

    def on_tokens(step: int, tokens: list[torch.Tensor]) -> bool:
        for brows, toks in zip(rows, tokens):
            for row, t in zip(brows, toks.tolist()):
                if not row.done:
                    row.push(t)
        return all(r.done for b in rows for r in b)

    inputs = [pad_left([r.prompt_ids for r in b], S) for b in batches]
    for inp, b in zip(inputs, batches):
        inp.adapters = [r.adapter for r in b] if any(r.adapter for r in b) else None
    windows = rider.windows(S, room, gbs) if rider is not None and room > 0 else []
    t0 = time.perf_counter()
    res = engine.run_block(inputs + windows, gen_len, sampler, on_tokens, prompt_logprobs)
    keep_lane_counters(engine, res)
    if windows:
        assert rider is not None and res.train is not None
        rider.done(res.train)
    if rider is not None and room > 0:  # the block's time, the windows' optimizer steps included
        rider.block(time.perf_counter() - t0, len(windows))
    out = []
    for k, brows in enumerate(rows):
        lp = res.prompt_logprobs[k] if prompt_logprobs else None
        for r, (row, glp) in enumerate(zip(brows, chooser.logprobs(k))):
            n = len(row.req.prompt_ids)
            out.append(row.completion(lp[r, S - n:].tolist() if lp is not None else None, glp))
    stats = RunStats(prompt_tokens=sum(len(r.prompt_ids) for r in block),
                     generated_tokens=sum(c.completion_tokens for c in out),
                     padded_prompt_tokens=S * len(block), padded_generated_tokens=res.steps * len(block),
                     prefill_s=res.prefill_s, decode_s=res.decode_s, blocks=1,
                     traffic_prefill=res.traffic_prefill, traffic_decode=res.traffic_decode)
    return out, stats
