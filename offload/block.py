"""One block's state while the engine runs it, apart from the long-lived engine.

Knows: each GPU batch's inputs (ids, masks, positions, tokens so far), the head task of
each batch (sample the next token, score the prompt, or a training loss), the CPU
attention calls still pending, activation gradients of a reverse sweep, and the
token-step clock (tokens reach the host one step behind, the stop callback, the
prefill/decode split of time and traffic).
Does not know: the schedule, placement, model math beyond calling a family's head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import torch
import torch.nn.functional as F

from flexoff.models.attention import positions, prefill_mask
from flexoff.models.base import Family, Weights, materialize
from flexoff.offload.lanes import Event

if TYPE_CHECKING:
    from flexoff.offload.engine import Engine

Sampler = Callable[[torch.Tensor, int, int], torch.Tensor]  # (logits (n, V), batch, step) -> ids (n,)
OnTokens = Callable[[int, list[torch.Tensor]], bool]  # (step, host ids per batch) -> stop?
IGNORE = -100  # label of a token that carries no loss (as torch's cross_entropy)


@dataclass
class BatchInput:
    ids: torch.Tensor  # (n, s) int64 prompt ids, left-padded
    valid: torch.Tensor  # (n, s) bool, False on padding
    labels: torch.Tensor | None = None  # (n, s) int64 next-token targets for training, IGNORE where none
    adapters: list[str | None] | None = None  # per row: the LoRA adapter it uses (None: the base model)


@dataclass
class TrainResult:
    loss: float  # the step's loss: summed over labelled tokens, divided by their count
    tokens: int  # labelled tokens
    input_grads: list[torch.Tensor]  # per batch: d loss / d (the embedding's output), (n, s, hidden)
    # per adapted (layer, matmul), per adapter: d loss / d (its A, and its B transposed)
    lora_grads: dict[tuple[int, str], dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    batch_losses: list[float] = field(default_factory=list)  # each batch's part of `loss`


@dataclass
class BlockResult:
    prefill_s: float  # the first sweep (with co-served training windows, their forward too)
    decode_s: float  # the rest (with training windows, their reverse sweep first)
    steps: int  # token steps run (the first is the prefill)
    prompt_logprobs: list[torch.Tensor | None] = field(default_factory=list)  # per batch (n, s-1)
    traffic_prefill: dict[str, int] = field(default_factory=dict)  # bytes moved by path, and read by CPU attention
    traffic_decode: dict[str, int] = field(default_factory=dict)
    train: TrainResult | None = None  # the block's training windows (co-served), if any


class BatchAdapters(NamedTuple):
    """A GPU batch's LoRA adapters: each row's block index (-1: none) on the device and on the
    host, and which indices are present."""
    ids: torch.Tensor
    host: tuple[int, ...]
    present: frozenset[int]


class BatchState:
    """Per-block state of one GPU batch."""

    def __init__(self, inp: BatchInput, gen_len: int, device: torch.device, pin: bool):
        self.n, self.S = inp.ids.shape
        valid = torch.ones(self.n, self.S + gen_len, dtype=torch.bool)
        valid[:, :self.S] = inp.valid
        self.valid_host = valid
        self.valid = valid.to(device)
        self.ids = inp.ids.to(device)
        self.pos0 = positions(self.valid[:, :self.S])  # (n, S)
        self.plen = self.valid[:, :self.S].sum(1)  # real prompt tokens per row
        self.mask0 = prefill_mask(self.valid[:, :self.S])  # (n, S, S)
        self.tokens = torch.zeros(gen_len, self.n, dtype=torch.long, device=device)
        self.tokens_host = torch.zeros(gen_len, self.n, dtype=torch.long, pin_memory=pin)
        self.logprobs: torch.Tensor | None = None

    def inputs(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions fed to the embedding at step i."""
        if i == 0:
            return self.ids, self.pos0
        return self.tokens[i - 1][:, None], (self.plen + (i - 1))[:, None]


# ---- head tasks: what the last layer does with its batch --------------------------------------
class HeadTask(Protocol):
    def forward(self, fam: Family, w: Weights, h: torch.Tensor, st: BatchState, i: int) -> None: ...
    def pick(self, logits: torch.Tensor, st: BatchState, i: int) -> None: ...
    def backward(self, fam: Family, w: Weights, h: torch.Tensor, st: BatchState) -> torch.Tensor: ...


class SampleTask:
    """Inference: the next token of every row (and, at the prefill, the prompt's log-probabilities)."""

    def __init__(self, sampler: Sampler, k: int, prompt_logprobs: bool):
        self.sampler, self.k, self.want_lp = sampler, k, prompt_logprobs

    def forward(self, fam: Family, w: Weights, h: torch.Tensor, st: BatchState, i: int) -> None:
        if i == 0 and self.want_lp:
            st.logprobs = prompt_logprobs(fam, w, h, st.ids)
        self.pick(fam.head(w, h[:, -1:])[:, 0], st, i)

    def pick(self, logits: torch.Tensor, st: BatchState, i: int) -> None:
        """Step i's tokens from the last position's logits (n, vocab)."""
        st.tokens[i] = self.sampler(logits, self.k, i)

    def backward(self, fam: Family, w: Weights, h: torch.Tensor, st: BatchState) -> torch.Tensor:
        raise RuntimeError("internal: inference batches have no backward")


class LossTask:
    """Training: cross-entropy of the batch's labels, summed and multiplied by `scale` (one over
    the tokens of the whole step, so the batches' gradients add up to the mean's)."""

    def __init__(self, labels: torch.Tensor, scale: float):
        self.labels, self.scale = labels, scale
        self.loss: torch.Tensor | None = None  # the scaled loss, a device scalar, after forward

    def _loss(self, fam: Family, w: Weights, h: torch.Tensor) -> torch.Tensor:
        logits = fam.head(w, h)  # (n, s, vocab), at least float32
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), self.labels.flatten(), ignore_index=IGNORE,
                               reduction="sum") * self.scale

    def forward(self, fam: Family, w: Weights, h: torch.Tensor, st: BatchState, i: int) -> None:
        self.loss = self._loss(fam, w, h)

    def pick(self, logits: torch.Tensor, st: BatchState, i: int) -> None:
        raise RuntimeError("internal: training batches sample no tokens")

    def backward(self, fam: Family, w: Weights, h: torch.Tensor, st: BatchState) -> torch.Tensor:
        return vjp(lambda x: self._loss(fam, w, x), h, None)[0]


def vjp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor | None,
        params: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gradient of <fn(x), g> (of fn(x) if it is a scalar and g is None) with respect to x and
    to `params` (leaves fn reads, such as LoRA weights), recomputing fn inside: nothing of the
    forward is kept between sweeps but x itself."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        y = fn(xg)
        grads = torch.autograd.grad(y, [xg, *params], g)
    return grads[0], list(grads[1:])


def prompt_logprobs(fam: Family, w: Weights, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each prompt token given the ones before it: (n, S-1)."""
    n, S, _ = h.shape
    out = torch.zeros(n, max(S - 1, 0), dtype=torch.float32, device=h.device)
    chunk = max(1, (1 << 24) // max(1, n * fam.vocab_size))
    for c0 in range(0, S - 1, chunk):
        c1 = min(S - 1, c0 + chunk)
        logits = fam.head(w, h[:, c0:c1]).float()
        out[:, c0:c1] = logits.log_softmax(-1).gather(-1, ids[:, c0 + 1:c1 + 1, None])[..., 0]
    return out


# ---- the block run ----------------------------------------------------------------------------
@dataclass
class Pending:
    """A CPU attention call of batch k at layer j, through buffer set `buffers`; finish() waits
    for it and issues the rest of the layer (its output read onto the device, the projection)."""
    k: int
    j: int
    buffers: int
    finish: Callable[[], None]


class BlockRun:
    """What one block carries from step to step: its batches, their head tasks, pending CPU
    attention calls, and (training) each batch's activation gradient in the reverse sweep."""

    def __init__(self, engine: "Engine", batches: list[BatchInput], gen_len: int, tasks: list[HeadTask]):
        self.engine, self.gen_len = engine, gen_len
        pin = engine.device.type == "cuda"
        self.states = [BatchState(b, gen_len, engine.device, pin) for b in batches]
        self.tasks = tasks
        self.trains = [b.labels is not None for b in batches]  # per batch: a training window
        self.training = any(self.trains)
        pool = engine.adapters if any(b.adapters for b in batches) else None
        engine.weights.adapters = None
        if pool is not None:  # the block's adapters on the device (resident) or paged with the weights
            pool.begin([a for b in batches for a in (b.adapters or ())], engine.adapter_need, engine.weights)
            engine.weights.adapters = pool if pool.paged else None
        # per batch: the adapter of each row (block indices), and which are present
        self.adapters = [BatchAdapters(*pool.ids(b.adapters),
                                       frozenset(pool.index[a] for a in b.adapters if a is not None))
                         if pool is not None and b.adapters else None for b in batches]
        self.pending: list[Pending] = []
        self.cpu_free_at: float | None = None  # when the CPU attention lane last finished a call
        self.grads: list[torch.Tensor | None] = [None] * len(batches)  # d loss / d (current layer's output)
        # per adapted matmul, per adapter: d loss / d (its A and B transposed), summed over batches
        self.lora_grads: dict[tuple[int, str], dict[str, list[torch.Tensor]]] = {}
        # (layer, batch) -> a kept graph: the layer's output, its input leaf, its LoRA leaves
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list[Any]]] = {}
        # (sweep, layer) -> that layer's weights with compressed ones dequantized, for its GPU batches
        self._dense: tuple[tuple[int, int], dict[str, Any]] | None = None

    def dequantized(self, key: tuple[int, int], w: Mapping[str, Any]) -> dict[str, Any]:
        """Layer weights `w` with compressed ones dequantized, made once per (sweep, layer) `key`
        and kept for the sweep's GPU batches until another layer's replace them: one layer's at
        a time (what the memory plan counts), on the compute stream that reads them."""
        if self._dense is None or self._dense[0] != key:
            self._dense = None  # the last layer's are freed before these are made
            self._dense = (key, {n: materialize(v) for n, v in w.items()})
        return self._dense[1]

    def finish_where(self, which: Callable[[Pending], bool]) -> None:
        """Finish the pending CPU attention calls `which` picks, oldest first: wait for each and
        issue its layer's remaining compute."""
        timing = self.engine.timing
        for c in [c for c in self.pending if which(c)]:
            self.pending.remove(c)
            t0 = time.perf_counter()
            c.finish()
            timing["wait_cpu_attention_s"] += time.perf_counter() - t0


class Clock:
    """Token-step bookkeeping of one block: tokens copied to the host one step behind, the stop
    callback, the prefill/decode split of time and traffic."""

    def __init__(self, engine: "Engine", states: list[BatchState], on_tokens: OnTokens, t0: float | None = None):
        self.engine, self.states, self.on_tokens = engine, states, on_tokens
        self.events: list[Event] = []
        self.delivered, self.steps, self.stop = -1, 0, False
        self.start = self.after_prefill = engine.traffic()
        self.t0 = time.perf_counter() if t0 is None else t0  # the block's start
        self.prefill_s = 0.0

    def _deliver(self, d: int) -> None:
        self.events[d].wait_host()
        self.stop = self.on_tokens(d, [st.tokens_host[d] for st in self.states])
        self.delivered = d

    def token_step_done(self, i: int) -> bool:
        """Step i's tokens are sampled; returns whether every sequence has stopped."""
        e = self.engine
        self.steps = i + 1
        with torch.profiler.record_function(f"flexoff: token step {i} issued"):  # a mark for traces
            pass
        for st in self.states:
            st.tokens_host[i].copy_(st.tokens[i], non_blocking=True)
        self.events.append(e.lanes.compute.mark())
        if i == 0:  # the prefill's end: measured, and its tokens checked at once
            e.sync()
            self.prefill_s = time.perf_counter() - self.t0
            self.after_prefill = e.traffic()
            self._deliver(0)
        elif i - 1 > self.delivered:  # the previous step's tokens, already on the host
            self._deliver(i - 1)
        return self.stop

    def finish(self) -> BlockResult:
        e = self.engine
        e.sync()
        end = time.perf_counter()
        for d in range(self.delivered + 1, self.steps):
            if not self.stop:
                self._deliver(d)
        lps = [st.logprobs.cpu() if st.logprobs is not None else None for st in self.states]
        done, start, mid = e.traffic(), self.start, self.after_prefill
        return BlockResult(self.prefill_s, end - self.t0 - self.prefill_s, self.steps, lps,
                           {k: mid[k] - start[k] for k in start}, {k: done[k] - mid[k] for k in start})

