"""Pipeline stages: a model's layers split across processes, hidden states passed between them.

Knows: how a model's layers split into stages (transformer blocks as evenly as they go, the
embedding with the first stage, the head with the last), each stage's own list of layers (a
`recv` layer where the stage's input arrives, a `send` layer where its output leaves), how a
block's GPU batches split into groups that follow each other through the stages (FlexGen §5:
while stage s runs group g, stage s + 1 runs group g - 1), and the point-to-point traffic of a
block through torch.distributed: hidden states forward from stage to stage, sampled tokens
from the last stage back to the first, each direction in its own process group, so that on
NCCL a send never waits behind a receive that goes the other way.
Does not know: launching processes, prompts, sharding among replicas (flexoff.parallel), layer
math (the layer ops call send and receive).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from flexoff.models.base import LayerSpec
from flexoff.models.spec import ModelSpec

INFLIGHT = 2  # sends a stage keeps in progress (copies of hidden states held on its device)
POLL = 1e-4  # seconds between looks at a send the stage waits for
RECV = LayerSpec("recv", -1, ())  # the stage's input arrives: hidden states of the stage before
SEND = LayerSpec("send", -1, ())  # the stage's output leaves for the stage after


def split_blocks(num_blocks: int, stages: int) -> list[range]:
    """Transformer blocks per stage, as even as they go (the first stages take one more)."""
    base, extra = divmod(num_blocks, stages)
    out, b0 = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(b0, b0 + n))
        b0 += n
    return out


def stage_layers(spec: ModelSpec, stage: int, stages: int) -> tuple[int | None, ...]:
    """The full model's layer index of each layer of the stage, None for its recv and send."""
    blocks = split_blocks(spec.num_layers, stages)[stage]
    mine = [j for j, l in enumerate(spec.layers) if l.block in blocks]
    head = [j for j, l in enumerate(spec.layers) if l.kind == "head"]
    embed = [j for j, l in enumerate(spec.layers) if l.kind == "embed"]
    first = embed if stage == 0 else [None]
    last = head if stage == stages - 1 else [None]
    return tuple(first + mine + last)


def stage_spec(spec: ModelSpec, stage: int, stages: int) -> ModelSpec:
    """The stage's model: its own layers, a recv layer first and a send layer last where needed."""
    if stages == 1:
        return spec
    layers = stage_layers(spec, stage, stages)
    own = tuple(spec.layers[j] if j is not None else (RECV if n == 0 else SEND) for n, j in enumerate(layers))
    blocks = len(split_blocks(spec.num_layers, stages)[stage])
    return replace(spec, name=f"{spec.name} (stage {stage + 1} of {stages})", num_layers=blocks, layers=own)


def link_bytes(spec: ModelSpec, rows: int, tokens: int, elem_bytes: int) -> int:
    """Compute-device bytes a stage's transfers hold beyond its stores: INFLIGHT sent copies and
    one received batch of hidden states (rows x tokens each); 0 for a whole model."""
    ends = sum(l.kind in ("recv", "send") for l in spec.layers)
    return (INFLIGHT + 1) * rows * tokens * spec.hidden_size * elem_bytes if ends else 0


def heaviest_stage(spec: ModelSpec, stages: int) -> int:
    """The stage with the most weight bytes (a policy that fits it fits the others)."""
    sizes = [sum(spec.layer_bytes(j) for j in stage_layers(spec, s, stages) if j is not None) for s in range(stages)]
    return max(range(stages), key=lambda s: sizes[s])


def batch_groups(num_batches: int, stages: int) -> list[tuple[int, ...]]:
    """A block's GPU batches in groups that follow each other through the stages: as many groups
    as stages (fewer if there are fewer batches), contiguous, the first ones one batch larger."""
    return [tuple(r) for r in split_blocks(num_batches, min(stages, num_batches))]


@dataclass
class PipeLink:
    """One stage's connections: to the stage before and after it (hidden states), and between
    the last stage and the first (tokens). Ranks are global; groups are this pipeline's."""

    stage: int
    stages: int
    ranks: tuple[int, ...]  # the global rank of each stage of this pipeline
    forward: Any  # process group for hidden states (stage s -> s + 1)
    back: Any  # process group for tokens (last -> first)
    control: Any  # a gloo group of the pipeline, for Python objects (results, requests)
    sent: int = 0  # bytes this stage has sent (hidden states, tokens)
    _sending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # tokens
    _held: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # hidden states

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def send_hidden(self, h: torch.Tensor) -> None:
        """Send a batch's hidden states to the next stage (a copy: the stores reuse their buffers)."""
        self._send(h.contiguous().clone(), self.ranks[self.stage + 1], self.forward, bounded=True)

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A batch's hidden states from the stage before (on NCCL the compute stream waits for
        them; the host goes on)."""
        out = torch.empty(shape, dtype=dtype, device=device)
        self._recv(out, self.ranks[self.stage - 1], self.forward)
        return out

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """The last stage sends a batch's sampled tokens (n,) to the first."""
        self._send(tokens.clone(), self.ranks[0], self.back)

    def recv_tokens(self, out: torch.Tensor) -> None:
        """The first stage receives a batch's tokens (n,) into `out` (contiguous)."""
        self._recv(out, self.ranks[-1], self.back)

    def _send(self, t: torch.Tensor, dst: int, group: Any, bounded: bool = False) -> None:
        """Send t without waiting for it. A bounded send (hidden states) first waits until fewer
        than INFLIGHT bounded sends are in progress: each holds its copy on the device until the
        next stage has it, and the memory plan counts that many. Tokens are never held back: the
        last stage waiting on the first while the first waits on the second would close a cycle."""
        import torch.distributed as dist

        if bounded:
            while len(self._held) >= INFLIGHT:  # the next stage is behind: wait for the oldest
                _finish(*self._held.pop(0))
        work = (dist.isend(t, dst, group=group), t)
        (self._held if bounded else self._sending).append(work)
        self.sent += t.nbytes

    @staticmethod
    def _recv(t: torch.Tensor, src: int, group: Any) -> None:
        import torch.distributed as dist

        dist.irecv(t, src, group=group).wait()

    def drain(self) -> None:
        """Wait until every send has been received (the end of a block)."""
        for w, t in self._held + self._sending:
            _finish(w, t)
        self._held.clear()
        self._sending.clear()

    def results(self, value: Any) -> Any:
        """The last stage's value (a block's completions) at the first stage; others keep theirs."""
        import torch.distributed as dist

        if self.stages == 1 or not (self.first or self.last):
            return value
        box = [value if self.last else None]
        if self.last:
            dist.send_object_list(box, self.ranks[0], group=self.control)
        else:
            dist.recv_object_list(box, self.ranks[-1], group=self.control)
        return box[0]


def _finish(work: Any, t: torch.Tensor) -> None:
    """Wait on the host until a send is done: a gloo send's wait blocks until then; an NCCL
    send's wait only orders the current stream after it, so its completion is polled."""
    if not t.is_cuda:
        work.wait()
        return
    while not work.is_completed():
        time.sleep(POLL)
