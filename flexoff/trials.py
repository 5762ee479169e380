"""`--policy auto`'s trials: where the cost model cannot tell the searched plans apart, time them.

Knows: which plans are worth timing (the search's best at the CPU-attention rate it priced, and at
that rate LANE_SPREAD lower and higher: the rate that profiles and the engine's own calibration
read least reliably, and the one that moves the GPU's room between weights and cache rows), when
trials pay for themselves (a GPU, no pipeline, no adapters, and a job predicted to run at least
1 / TRIAL_SHARE times their cost, their blocks and an engine set-up per plan, or of unknown
length: a benchmark's block standing for a long job), what a trial runs (one block of the job's
longest prompt, TRIAL_TOKENS tokens per row, end of sequence ignored, on an engine sized for the
whole generation, so that the job reuses the last one's where it won), and how a trial's time
becomes a block's (its prefill, plus its decode steps' mean time for each of the block's steps).
`FLEXOFF_TRIALS=0` turns trials off.
Does not know: the cost model's terms (policy/) or the schedule (offload/).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flexoff.dummy import random_prompts
from flexoff.errors import GpuOutOfMemoryError
from flexoff.policy.policy import Policy
from flexoff.policy.search import Candidate
from flexoff.sampling import SamplingParams

ENV = "FLEXOFF_TRIALS"
LANE_SPREAD = 0.15  # CPU attention's rate, searched this much lower and higher than priced
TRIAL_TOKENS = 9  # tokens per row: the prefill's and 8 decode steps (enough for calibration to keep)
TRIAL_SHARE = 0.05  # trials may cost at most this share of the job's predicted time
SETUP_S = 30.0  # an engine's set-up for a plan's trial: 2-30 s for OPT-30B plans on an H100 (RESULTS.md, 2026-11-28)


@dataclass
class Trial:
    policy: Policy
    predicted_tok_s: float  # the search's, at the rate it was searched with
    tok_s: float | None  # a full block's generated tokens over its time estimated from the trial
    seconds: float  # the trial's wall time, the engine's set-up included

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.describe(), "predicted_tok_s": self.predicted_tok_s,
                "tok_s": self.tok_s, "seconds": self.seconds}


def enabled() -> bool:
    """Trials are on unless FLEXOFF_TRIALS=0."""
    return os.environ.get(ENV, "1") != "0"


def applies(llm: Any, stages: int, hw: Any) -> bool:
    """Whether `--policy auto` may time its candidates for this LLM: trials on, a GPU, one stage,
    no adapters (a trial's prompts carry none), and a profile that prices CPU attention."""
    return enabled() and llm.device.type == "cuda" and stages == 1 and not llm.lora_ranks() and hw.cpu_attn_bdw > 0


def distinct(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates with their policies' repeats left out, in order."""
    seen: set[Policy] = set()
    out = []
    for c in cands:
        if c.policy not in seen:
            seen.add(c.policy)
            out.append(c)
    return out


def block_seconds(prefill_s: float, decode_s: float, steps: int, gen_len: int) -> float:
    """A block's time from a trial's: its prefill, and `steps` decode steps' mean time for each of
    the block's gen_len - 1."""
    return prefill_s + decode_s / steps * (gen_len - 1)


def worth_trying(cands: Sequence[Candidate], gen_len: int, num_prompts: int | None) -> bool:
    """Whether timing these (distinct) candidates costs at most TRIAL_SHARE of the job as the best
    of them is predicted to run it (a job of unknown length is taken as long). A trial costs its
    block's predicted time and, once per plan, an engine's set-up (SETUP_S)."""
    if len(cands) < 2:
        return False
    if num_prompts is None:
        return True
    best = cands[0]
    job = math.ceil(num_prompts / best.policy.block_size) * best.prediction.latency
    share = min(1.0, (TRIAL_TOKENS - 1) / max(1, gen_len - 1))
    cost = sum(c.prediction.prefill_s + share * c.prediction.decode_s for c in [cands[0], *cands])  # first twice
    cost += SETUP_S * len(cands)
    return cost <= TRIAL_SHARE * job


def measure(llm: Any, policy: Policy, prompt_len: int, gen_len: int) -> float:
    """A block's generated tokens per second under `policy`, estimated from one trial block of
    random prompts of `prompt_len` tokens. The engine is sized for `gen_len` tokens, so that the
    run after reuses it when this policy wins and ran last."""
    tokens = min(TRIAL_TOKENS, gen_len)
    prompts = random_prompts(policy.block_size, prompt_len, llm.model.spec.vocab_size, prompt_len, "trial-")
    # quietly, and as a given policy: running out of GPU memory fails the trial, not search again
    shown, asked = llm.progress, llm.policy_arg
    llm.progress, llm.policy_arg = False, policy
    try:
        llm.engine_for(policy, prompt_len, gen_len)
        st = llm.generate(prompts, SamplingParams(max_new_tokens=tokens, ignore_eos=True), policy=policy).stats
    finally:
        llm.progress, llm.policy_arg = shown, asked
    steps = tokens - 1
    t = block_seconds(st.prefill_s, st.decode_s, steps, gen_len) if steps else st.prefill_s
    return policy.block_size * gen_len / t


def choose(llm: Any, cands: Sequence[Candidate], prompt_len: int, gen_len: int,
           log: Callable[[str], None] = lambda s: None) -> tuple[Policy, list[Trial]]:
    """The candidate whose trial ran fastest, and every trial (best searched first; a candidate
    that runs out of GPU memory is left out). The first candidate is timed twice, back to back on
    one engine (the first time warms the process), and its better time kept; the last timed
    keeps its engine for the job."""
    order = [cands[0]] + list(cands)
    trials: dict[Policy, Trial] = {}
    for i, c in enumerate(order):
        t0 = time.perf_counter()
        try:
            rate = measure(llm, c.policy, prompt_len, gen_len)
        except (torch.OutOfMemoryError, GpuOutOfMemoryError):
            llm.drop_engine()
            rate = None
        seconds = time.perf_counter() - t0
        t = trials.setdefault(c.policy, Trial(c.policy, c.prediction.throughput, None, 0.0))
        t.seconds += seconds
        if rate is not None and (t.tok_s is None or rate > t.tok_s):
            t.tok_s = rate
        log(f"trial {i + 1}/{len(order)}: {c.policy.describe()}: "
            + (f"{rate:.1f} tok/s" if rate is not None else "out of GPU memory")
            + f" (searched: {c.prediction.throughput:.1f}), {seconds:.0f} s")
    timed = [t for t in trials.values() if t.tok_s is not None]
    if not timed:
        return cands[0].policy, list(trials.values())
    return max(timed, key=lambda t: t.tok_s).policy, list(trials.values())
