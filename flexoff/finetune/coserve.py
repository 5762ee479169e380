"""Co-serving: LoRA finetuning jobs whose training windows ride on inference blocks.

Knows: one or more jobs (each a LoraTrainer on its own adapter, its examples and its data
order: epochs shuffled by its seed, as `flexoff finetune` orders them), a job's optimizer step
gathered over the blocks that carried its examples (each block's gradients weighted so the step
is the mean over all of the step's labelled tokens, as a standalone step), the windows a block
takes (whole GPU batches of one job each, in turn, examples no longer than the block's padded
length; with a SlowdownBound, as many as the inference time so far leaves room for), and
finishing the steps the inference blocks left over with standalone steps.
Does not know: which requests are in a block (flexoff.generation), the engine's sweeps
(offload.engine.run_block co-serves a block's windows).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from flexoff.finetune.data import Example
from flexoff.finetune.trainer import LoraTrainer, batch_input, labelled
from flexoff.offload.block import BatchInput, TrainResult


@dataclass
class CoJob:
    """One finetuning job: its trainer (adapter, optimizer), examples, steps and data order."""
    trainer: LoraTrainer
    examples: Sequence[Example]
    steps: int
    seed: int = 0
    # called after each optimizer step with the job and the step's examples (metrics, checkpoints)
    on_step: Callable[["CoJob", Sequence[Example]], None] | None = None
    losses: list[float] = field(default_factory=list)  # each finished step's loss
    order: list[int] = field(default_factory=list)  # example indices not yet drawn
    drawn: list[Example] = field(default_factory=list)  # the current step's examples
    todo: list[Example] = field(default_factory=list)  # ... not yet sent
    tokens: int = 0  # the current step's labelled tokens

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def name(self) -> str:
        return self.trainer.name

    @property
    def finished(self) -> bool:
        return len(self.losses) >= self.steps

    def draw(self) -> None:
        """The next step's examples (epochs of the data, each in a new shuffled order)."""
        per = self.trainer.cfg.per_step
        while len(self.order) < per:
            epoch = list(range(len(self.examples)))
            self.rng.shuffle(epoch)
            self.order += epoch
        self.drawn = [self.examples[i] for i in self.order[:per]]
        self.todo = list(self.drawn)
        del self.order[:per]
        self.tokens = labelled(self.todo)

    def step_done(self) -> None:
        """Every example of the step is gathered: the optimizer step, then the next step's draw."""
        self.losses.append(self.trainer.apply())
        if self.on_step is not None:
            self.on_step(self, self.drawn)
        if not self.finished:
            self.draw()

    def state(self) -> dict[str, Any]:
        """The data order and losses at a step boundary (a checkpoint's part beside the trainer's)."""
        return {"rng": self.rng.getstate(), "order": list(self.order), "losses": list(self.losses)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])
        self.order, self.losses = list(state["order"]), list(state["losses"])


@dataclass
class SlowdownBound:
    """Inference comes first: a block takes training windows only while the time windows added
    stays within `limit` (0.1: 10%) of the inference time so far.

    Knows: a block's seconds without windows (the mean over the blocks that ran without: the
    first, and at least one in PLAIN_SHARE, to follow drift), the seconds a window batch added
    in the last block that had some, and the sums of both over the job. The credit is limit x
    the inference seconds (the coming block's included) less the seconds windows took; a block
    takes as many windows as the credit pays for at the last rate (the first window is a probe,
    taken once the credit is positive). An estimate that was low is paid back by the next
    blocks: over the job the bound holds to within about one block's windows."""
    limit: float
    per_window: float | None = None  # seconds one window batch added, as last measured
    inference_s: float = 0.0  # the blocks' inference seconds (measured, or the base where windows rode)
    extra_s: float = 0.0  # seconds the windows added
    plain_s: float = 0.0  # seconds of the blocks without windows ...
    plain: int = 0  # ... and how many
    blocks: int = 0  # every block so far
    PLAIN_SHARE = 8  # at least one block in this many runs without windows, to measure the base

    @property
    def base(self) -> float | None:
        """A block's seconds without windows: the mean over those that ran (the last alone would
        follow its noise, and a high one would last longest: credit runs out later under it)."""
        return self.plain_s / self.plain if self.plain else None

    def allow(self, room: int) -> int:
        """How many of `room` window batches the next block may take."""
        if self.base is None or self.plain * self.PLAIN_SHARE <= self.blocks:
            return 0
        credit = self.limit * (self.inference_s + self.base) - self.extra_s
        if credit <= 0:
            return 0
        if not self.per_window:
            return 1
        return max(0, min(room, int(credit / self.per_window)))

    def record(self, seconds: float, windows: int) -> None:
        """A block ran in `seconds` with `windows` window batches."""
        base = self.base
        self.blocks += 1
        if windows == 0 or base is None:
            if windows == 0:
                self.plain_s, self.plain = self.plain_s + seconds, self.plain + 1
            self.inference_s += seconds
            return
        extra = max(0.0, seconds - base)
        self.inference_s += base
        self.extra_s += extra
        self.per_window = extra / windows

    @property
    def slowdown(self) -> float:
        """The time windows added so far, over the inference time."""
        return self.extra_s / self.inference_s if self.inference_s else 0.0


class CoTrainer:
    """The rider of LLM.generate: hands blocks training windows and gathers their gradients."""

    def __init__(self, jobs: Sequence[CoJob], batches: int = 1, bound: SlowdownBound | None = None):
        """batches: GPU batches of every inference block given to training windows (at most, where
        `bound` decides how many each block takes)."""
        self.jobs, self.batches, self.bound = list(jobs), batches, bound
        for job in self.jobs:
            if not job.finished:
                job.draw()
        self._turn = 0
        self._inflight: list[tuple[CoJob, int]] = []  # per window batch of the running block: job, examples

    @property
    def adapters(self) -> list[str]:
        return [j.name for j in self.jobs]

    @property
    def max_len(self) -> int:
        """The longest example of any job: blocks must have room for it."""
        return max((len(e.ids) for j in self.jobs for e in j.examples), default=0)

    def window_len(self) -> int:
        return max((len(e.ids) for j in self.jobs if not j.finished for e in j.todo), default=0)

    def windows(self, length: int, room: int, gbs: int) -> list[BatchInput]:
        """Up to `room` GPU batches of the jobs' waiting examples that fit `length` tokens, one job
        per batch, jobs in turn."""
        out: list[BatchInput] = []
        self._inflight = []
        if self.bound is not None:
            room = self.bound.allow(room)
        for _ in range(len(self.jobs) * room):
            if len(out) >= room:
                break
            job = self.jobs[self._turn % len(self.jobs)]
            self._turn += 1
            if job.finished:
                continue
            fit = [e for e in job.todo if len(e.ids) <= length][:gbs]
            if not fit:
                continue
            for e in fit:
                job.todo.remove(e)
            out.append(batch_input(fit, job.name, length))
            self._inflight.append((job, len(fit)))
        return out

    def block(self, seconds: float, windows: int) -> None:
        """A block ran: its seconds and how many window batches it carried."""
        if self.bound is not None:
            self.bound.record(seconds, windows)

    def done(self, result: TrainResult) -> None:
        """The block's windows ran: each job gathers its part (the block's losses were averaged
        over all its windows' tokens; a job's step averages over its own), and takes its
        optimizer step once all of its step's examples are in."""
        mine: dict[str, float] = {}
        for (job, _), part in zip(self._inflight, result.batch_losses):
            mine[job.name] = mine.get(job.name, 0.0) + part
        for job in {j.name: j for j, _ in self._inflight}.values():
            job.trainer.accumulate(result.lora_grads, mine[job.name], result.tokens / job.tokens)
            if not job.todo:
                job.step_done()
        self._inflight = []

    def finish(self) -> None:
        """The steps no inference block carried, standalone, in the same data order (a step that
        blocks began gathers its remaining examples alone, as parts of the same mean)."""
        for job in self.jobs:
            while not job.finished:
                job.trainer.gather(job.todo, job.tokens)
                job.todo = []
                job.step_done()
