"""The lean decode path: blocks whose weights, KV cache and activations all sit on the
compute device.

Knows: when a policy puts everything a decode step reads on the compute device (no loads,
no stores, no CPU attention), so that the schedule's per-step bookkeeping (events, lanes,
prefetches) does nothing but cost host time; how to run such a block's decode as one call
per GPU batch and token step (embedding, every layer's op, the head's logits) with fixed
shapes: positions, the new token's cache slot and the attention mask are device tensors in
buffers that outlive blocks, attention spans the engine's whole cache length with the
positions not yet written masked (and zeroed first, for attention that reads masked
positions); on CUDA that call is captured once per engine and batch shape as a CUDA graph
and replayed in every block, so a token step costs a few launches and one host read (the
step before's tokens).
Does not know: layer kinds (each op's `lean` does the math), sampling rules, stop conditions.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Sequence

import torch

from flexoff.offload.block import BatchState, BlockRun, Clock
from flexoff.offload.kvcache import PlainKV
from flexoff.offload.layer_ops import LeanStep

if TYPE_CHECKING:
    from flexoff.offload.engine import Engine

WARMUP = 2  # eager runs before a capture (lazy initialisation, Triton's first compiles)


def graphs_enabled(arg: bool | None) -> bool:
    """CUDA graphs on unless switched off (FLEXOFF_CUDA_GRAPHS=0, or the engine's argument)."""
    if arg is not None:
        return arg
    return os.environ.get("FLEXOFF_CUDA_GRAPHS", "1") != "0"


class _Batch:
    """One GPU batch shape's step over the engine's whole cache length, its inputs in buffers
    that outlive blocks, so that one captured graph serves every block with this batch."""

    def __init__(self, dec: "LeanDecoder", k: int, n: int, T: int, device: torch.device, adapters: bool):
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=device)  # the previous step's tokens
        # each row's LoRA adapter (-1: none), where the block uses adapters
        self.adapters = torch.full((n,), -1, dtype=torch.int32, device=device) if adapters else None
        self.t = torch.zeros(1, dtype=torch.long, device=device)  # the new token's cache position
        self.start = torch.zeros(n, dtype=torch.long, device=device)  # position of cache slot 0 (-padding)
        self.valid = torch.ones(n, T, dtype=torch.bool, device=device)  # False on prompt padding
        self.arange = torch.arange(T, device=device)
        self.k, self.n, self.T, self.dec = k, n, T, dec
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def load(self, st: BatchState, adapters: torch.Tensor | None) -> None:
        """This block's prompt padding, positions and adapters."""
        self.valid.fill_(True)
        self.valid[:, :st.S].copy_(st.valid[:, :st.S])
        self.start.copy_(st.plen - st.S)
        if self.adapters is not None:
            self.adapters.copy_(adapters)

    def step(self) -> torch.Tensor:
        """Embedding, layers and head for the token at position self.t: logits (n, vocab)."""
        pos = (self.start + self.t)[:, None]  # (n, 1)
        mask = (self.valid & (self.arange <= self.t))[:, None, :]  # (n, 1, T)
        ls = LeanStep(self.k, self.n, self.T, self.ids, pos, self.t, mask, self.adapters)
        h = None
        for op in self.dec.engine.ops:
            h = op.lean(ls, h)
        return h

    def capture(self, pool: object | None) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            self.logits = self.step()
        self.graph = g

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.logits


class LeanDecoder:
    def __init__(self, engine: "Engine", graphs: bool):
        self.engine = engine
        self.graphs = graphs and engine.device.type == "cuda"
        self.failed = False  # a capture failed once: this engine decodes eagerly from then on
        self.T = engine.max_prompt + engine.max_gen  # cache positions every step attends over (masked)
        self.batches: dict[tuple[int, int, int | None], _Batch] = {}  # (GPU batch, rows, pool version) -> its step
        self.pool: object | None = None  # the graphs' memory pool

    @staticmethod
    def applies(engine: "Engine") -> bool:
        """Whether a decode step of this engine reads only what is already on the compute device."""
        kv, w = engine.kv, engine.weights
        return (all(s.resident for s in w.splits) and kv.split["gpu"] == sum(kv.split.values())
                and engine.hidden.all_gpu and type(kv.codec) is PlainKV)

    def decode(self, run: BlockRun, gen_len: int, clock: Clock, ks: Sequence[int] | None = None) -> None:
        """Token steps 1 .. gen_len - 1 of a block whose prefill has run (step 0's tokens sampled),
        for its batches `ks` (default: all; a co-served block's training windows decode nothing)."""
        e = self.engine
        ks = range(len(run.states)) if ks is None else ks
        S, T = run.states[0].S, self.T
        for li in range(len(e.spec.attn_layers)):  # positions beyond the prompt: zeros, not stale values
            for k in ks:
                st = run.states[k]
                e.kv.homes[li][k]["gpu"].buf[:T * st.n * e.kv.codec.rec_bytes].view(T, -1)[S:].zero_()
        batches = []
        for k in ks:
            st = run.states[k]
            ada = run.adapters[k].ids if run.adapters[k] else None
            # a batch with adapters has its own graph, reading the pool's buffers of now
            key = (k, st.n, e.adapters.version if ada is not None else None)
            if key not in self.batches:
                self.batches[key] = _Batch(self, k, st.n, T, e.device, ada is not None)
            batches.append(self.batches[key])
            batches[-1].load(st, ada)
        for i in range(1, gen_len):
            for b, k in zip(batches, ks):
                st, task = run.states[k], run.tasks[k]
                b.ids.copy_(st.tokens[i - 1][:, None])
                b.t.fill_(S + i - 1)
                if self.graphs and not self.failed and b.graph is None:
                    self._capture(b)
                task.pick(b() if self.graphs else b.step(), st, i)
            if clock.token_step_done(i):
                break

    def _capture(self, b: _Batch) -> None:
        """Capture b's step (the engine's graphs share one memory pool); on failure warn once and
        decode eagerly from then on. The adapter pool's reader (the next block's adapters, read
        from their files and pinned while this block runs) finishes first: CUDA's global capture
        mode refuses calls such as pinning host memory from other threads during a capture (the
        likely cause of a pin that failed in a 4-block job reading adapters from files, H200)."""
        if self.engine.adapters is not None:
            self.engine.adapters.wait()
        try:
            b.capture(self.pool)
            self.pool = b.graph.pool()
        except RuntimeError as err:  # an op that cannot be captured: still correct, only slower
            self.failed = True
            b.graph = None
            torch.cuda.synchronize()
            warnings.warn(f"CUDA graph capture failed ({str(err).splitlines()[0]}); decoding without graphs",
                          stacklevel=2)

