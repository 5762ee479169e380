"""The lean decode path: blocks whose weights, KV cache and activations all sit on the
compute device.

Knows: when a policy puts everything a decode step reads on the compute device (no loads,
no stores, no CPU attention), so that the schedule's per-step bookkeeping (events, lanes,
prefetches) does nothing but cost host time; how to run such a block's decode as one call
per GPU batch and token step (embedding, every layer's op, the head's logits) with fixed
shapes: positions, the new token's cache slot and the attention mask are device tensors,
attention reads the block's whole cache length with later positions masked (their cache is
zeroed first); on CUDA that call is captured once per batch and block as a CUDA graph and
replayed, so a token step costs a few launches and one host read (the step before's tokens).
Does not know: layer kinds (each op's `lean` does the math), sampling rules, stop conditions.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch

from flexoff.offload.block import BlockRun, Clock
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
    """One GPU batch's fixed inputs, and its step as a callable (a graph's replay, or eager)."""

    def __init__(self, dec: "LeanDecoder", run: BlockRun, k: int, T: int):
        st = run.states[k]
        dev = st.ids.device
        self.ids = torch.zeros(st.n, 1, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.S, self.plen, self.valid = st.S, st.plen, st.valid[:, :T]
        self.arange = torch.arange(T, device=dev)
        self.k, self.n, self.T, self.dec = k, st.n, T, dec
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def step(self) -> torch.Tensor:
        """Embedding, layers and head for the token at position self.t: logits (n, vocab)."""
        pos = self.plen[:, None] + (self.t - self.S)  # (n, 1)
        mask = (self.valid & (self.arange <= self.t))[:, None, :]  # (n, 1, T)
        ls = LeanStep(self.k, self.n, self.T, self.ids, pos, self.t, mask)
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

    @staticmethod
    def applies(engine: "Engine") -> bool:
        """Whether a decode step of this engine reads only what is already on the compute device."""
        kv, w = engine.kv, engine.weights
        return (all(s.resident for s in w.splits) and kv.split["gpu"] == sum(kv.split.values())
                and engine.hidden.all_gpu and type(kv.codec) is PlainKV)

    def decode(self, run: BlockRun, gen_len: int, clock: Clock) -> None:
        """Token steps 1 .. gen_len - 1 of a block whose prefill has run (step 0's tokens sampled)."""
        e = self.engine
        S = run.states[0].S
        T = S + gen_len
        for li in range(len(e.spec.attn_layers)):  # positions beyond the prompt: zeros, not stale values
            for k, st in enumerate(run.states):
                e.kv.homes[li][k]["gpu"].buf[:T * st.n * e.kv.codec.rec_bytes].view(T, -1)[S:].zero_()
        batches = [_Batch(self, run, k, T) for k in range(len(run.states))]
        capture = self.graphs and not self.failed
        pool = None
        for i in range(1, gen_len):
            for b, st, task in zip(batches, run.states, run.tasks):
                b.ids.copy_(st.tokens[i - 1][:, None])
                b.t.fill_(S + i - 1)
                if capture and b.graph is None:
                    capture = self._capture(b, pool)
                    pool = b.graph.pool() if b.graph is not None else None
                task.pick(b(), st, i)
            if clock.token_step_done(i):
                break

    def _capture(self, b: _Batch, pool: object | None) -> bool:
        """Capture b's step; on failure warn once and decode eagerly from then on."""
        try:
            b.capture(pool)
            return True
        except RuntimeError as err:  # an op that cannot be captured: still correct, only slower
            self.failed = True
            b.graph = None
            torch.cuda.synchronize()
            warnings.warn(f"CUDA graph capture failed ({str(err).splitlines()[0]}); decoding without graphs",
                          stacklevel=2)
            return False

