"""Hidden states between layers: where each GPU batch's activations wait.

Knows: a batch's hidden state split along rows across tiers (rows on the GPU
stay where compute left them; CPU and disk rows are stored after a layer and
loaded back, one batch ahead, before the next); which events order them.
Does not know: model math, the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flexoff.models.spec import ModelSpec
from flexoff.offload.lanes import Event, Lanes, Tracked
from flexoff.offload.mover import Mover, Span, span_of
from flexoff.offload.placement import TIERS, row_segments, row_split
from flexoff.offload.tiers import Ledger
from flexoff.policy.policy import Policy


def act_bytes(spec: ModelSpec, elem_bytes: int, policy: Policy, max_prompt: int) -> dict[str, int]:
    split = row_split(policy.gpu_batch_size, policy.act_gpu_percent, policy.act_cpu_percent)
    per_row = max_prompt * spec.hidden_size * elem_bytes * policy.num_gpu_batches
    return {t: split[t] * per_row for t in TIERS}  # GPU rows: compute's tensors, kept between layers


@dataclass
class _Stored:
    layer: int  # the layer whose output this is
    shape: tuple[int, ...]
    gpu: torch.Tensor | None  # rows kept on the compute device
    ev: Event  # compute that produced it
    homes: dict[str, Any] = field(default_factory=dict)


class HiddenStore:
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, policy: Policy, mem: Ledger,
                 lanes: Lanes, mover: Mover, max_prompt: int):
        self.dtype, self.lanes, self.mover, self.device = dtype, lanes, mover, mem.device
        self.split = row_split(policy.gpu_batch_size, policy.act_gpu_percent, policy.act_cpu_percent)
        per_row = max_prompt * spec.hidden_size * dtype.itemsize
        self.homes = [{t: (mem.alloc(t, n * per_row), Tracked())
                       for t, n in self.split.items() if n > 0 and t != "gpu"}
                      for _ in range(policy.num_gpu_batches)]
        self._stored: dict[int, _Stored] = {}
        self._loaded: dict[int, tuple[int, torch.Tensor, list[Event]]] = {}

    @property
    def all_gpu(self) -> bool:
        return self.split["gpu"] == sum(self.split.values())

    def put(self, kb: int, j: int, h: torch.Tensor, ev: Event) -> None:
        """Keep the output h (n, s, hidden) of layer j for batch kb until layer j + 1."""
        st = _Stored(j, tuple(h.shape), None, ev)
        for tier, r0, r1 in row_segments(h.shape[0], self.split):
            if tier == "gpu":
                st.gpu = h[r0:r1] if r1 - r0 < h.shape[0] else h
                continue
            buf, track = self.homes[kb][tier]
            part = span_of(h[r0:r1])
            cp = self.mover.copy(Span(buf, 0, part.nbytes), part, [ev] + track.claim(), lane="store")
            track.wrote(cp)
            track.tag = j
        self._stored[kb] = st
        self._loaded.pop(kb, None)

    def holds(self, kb: int, j: int) -> bool:
        """Whether batch kb's stored hidden state is layer j's output."""
        st = self._stored.get(kb)
        return st is not None and st.layer == j

    def prefetch(self, kb: int, j: int) -> None:
        """Start assembling the input of layer j for batch kb on the compute device."""
        st = self._stored[kb]
        assert st.layer == j - 1, f"batch {kb}: holds layer {st.layer}'s output, layer {j} needs {j - 1}'s"
        if kb in self._loaded or self.all_gpu:
            return
        out = torch.empty(st.shape, dtype=self.dtype, device=self.device)
        evs = []
        for tier, r0, r1 in row_segments(st.shape[0], self.split):
            dst = span_of(out[r0:r1])
            if tier == "gpu":
                evs.append(self.mover.copy(dst, span_of(st.gpu), [st.ev], lane="load"))
                continue
            buf, track = self.homes[kb][tier]
            assert track.tag == j - 1
            ev = self.mover.copy(dst, Span(buf, 0, dst.nbytes), track.read_deps(), lane="load")
            track.was_read(ev)
            evs.append(ev)
        self._loaded[kb] = (j, out, evs)

    def take(self, kb: int, j: int) -> tuple[torch.Tensor, list[Event]]:
        """The input of layer j for batch kb and the events compute must wait for."""
        if self.all_gpu:
            st = self._stored[kb]
            assert st.layer == j - 1
            return st.gpu, []
        self.prefetch(kb, j)
        lj, out, evs = self._loaded.pop(kb)
        assert lj == j
        return out, evs

    def clear(self) -> None:
        """Drop what the last block left (its device tensors)."""
        self._stored.clear()
        self._loaded.clear()
