"""Activations kept between steps: the live hidden state of each GPU batch, and the stash.

Knows: a tensor split along rows across tiers (rows on the GPU stay where compute left them;
CPU and disk rows are stored after they are produced and loaded back, one step ahead, before
they are needed; the GPU rows join them on the compute stream when compute takes the input),
keyed by what holds them and tagged with what they are (the hidden store: one per batch, tagged
by the layer whose output it is; the stash: one per (layer, window batch), the layer's input in
a training window's forward sweep, for its reverse sweep); which events order them.
Does not know: model math, the schedule.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Literal, Sequence

import torch

from flexoff.models.spec import ModelSpec
from flexoff.offload.lanes import Event, Lanes, Tracked
from flexoff.offload.mover import Mover, Span, span_of
from flexoff.offload.placement import TIERS, row_segments, row_split
from flexoff.offload.tiers import Ledger
from flexoff.policy.policy import Policy, act_load_slots, keeps_token_steps, step_load_slots
from flexoff.policy.train_cost import graph_token_elems


def act_bytes(spec: ModelSpec, elem_bytes: int, policy: Policy, max_prompt: int) -> dict[str, int]:
    """The hidden store's homes on each tier (GPU rows: compute's tensors, kept between layers)
    and its rings of GPU buffers that other rows load back into (whole sequences, token steps;
    the token steps' ring, or the token outputs kept whole on the GPU in its place)."""
    n = policy.gpu_batch_size
    split = row_split(n, policy.act_gpu_percent, policy.act_cpu_percent)
    token = spec.hidden_size * elem_bytes
    out = {t: split[t] * max_prompt * token * policy.num_gpu_batches for t in TIERS}
    all_gpu = split["gpu"] == n
    out["gpu"] += (act_load_slots(all_gpu) * max_prompt + step_load_slots(all_gpu, policy.num_gpu_batches)) * n * token
    return out


def stash_bytes(spec: ModelSpec, elem_bytes: int, policy: Policy, max_tokens: int) -> dict[str, int]:
    """The stash of one training window: every layer's input but the embedding's, per batch."""
    split = row_split(policy.gpu_batch_size, policy.stash_gpu_percent, policy.stash_cpu_percent)
    per_row = max_tokens * spec.hidden_size * elem_bytes * policy.num_gpu_batches * (len(spec.layers) - 1)
    return {t: split[t] * per_row for t in TIERS}


def keeps_graphs(resident: bool, policy: Policy) -> bool:
    """Whether training windows keep each layer's autograd graph from the forward sweep for the
    reverse sweep (no recompute): where the weights and the whole stash are on the compute
    device, the graph's saved tensors stay valid and room for them is planned. Elsewhere the
    reverse sweep recomputes each layer from its stashed input (a slot's weights are gone)."""
    return resident and policy.stash_gpu_percent >= 100


def graph_bytes(spec: ModelSpec, elem_bytes: int, policy: Policy, max_tokens: int) -> int:
    """What kept graphs hold on the compute device for a block's windows: per token and layer,
    attention's projections and scores (two per head and key) and the MLP's activations."""
    return policy.block_size * max_tokens * sum(graph_token_elems(spec, max_tokens)) * elem_bytes


def backward_bytes(spec: ModelSpec, elem_bytes: int, policy: Policy, max_tokens: int) -> int:
    """What the reverse sweep's step holds beyond the stash: the graph of the largest layer of
    one GPU batch (recomputed from its input, or the gradients through a kept one)."""
    return policy.gpu_batch_size * max_tokens * max(graph_token_elems(spec, max_tokens)) * elem_bytes


@dataclass
class _Stored:
    tag: Any  # what this is (the layer whose output, the window)
    shape: tuple[int, ...]
    gpu: torch.Tensor | None  # rows kept on the compute device
    ev: Event  # compute that produced it
    homes: dict[str, Any] = field(default_factory=dict)
    whole: bool = False  # every row kept on the compute device (`gpu`): never stored, never loaded


@dataclass
class _Slot:
    """A device buffer of the load ring: what has written and read it, and the key whose load
    it holds from its prefetch until compute has read it (`RowStore.read`)."""

    buf: torch.Tensor
    track: Tracked = field(default_factory=Tracked)
    key: Hashable | None = None


@dataclass
class _Ring:
    """Device buffers of `elems` elements each that loads of that size at most go into, in turn;
    made on first use."""

    count: int
    elems: int
    slots: list[_Slot] = field(default_factory=list)
    next: int = 0


class RowStore:
    """Tensors (n, s, hidden) keyed by their holder, rows split across tiers, loaded back on the
    lane `lane` names ("load", or "fetch": a stream of its own, not behind weight copies), into
    a ring of `slots` device buffers, or those of at most `step_row_bytes` a row into a ring of
    `step_slots` smaller ones (none: a fresh tensor for each load); with `keep_steps`, those are
    kept whole on the compute device instead, never stored or loaded."""

    lane: Literal["load", "fetch"] = "load"

    def __init__(self, keys: Iterable[Hashable], split: dict[str, int], row_bytes: int, dtype: torch.dtype,
                 mem: Ledger, lanes: Lanes, mover: Mover, slots: int = 0, step_slots: int = 0,
                 step_row_bytes: int = 0, keep_steps: bool = False):
        self.dtype, self.lanes, self.mover, self.device = dtype, lanes, mover, mem.device
        self.keep_row_elems = step_row_bytes // dtype.itemsize if keep_steps else 0
        self.split = split
        # rows kept on the GPU join a loaded input on compute when taken (`take`); 0: on the lane
        self.join_on_compute = os.environ.get("FLEXOFF_JOIN_ON_COMPUTE", "1") != "0"
        self.homes = {key: {t: (mem.alloc(t, n * row_bytes), Tracked())
                            for t, n in split.items() if n > 0 and t != "gpu"} for key in keys}
        self._stored: dict[Hashable, _Stored] = {}
        # key -> (tag, target, its loads' events, its ring slot, rows to copy in from the GPU)
        self._loaded: dict[Hashable, tuple[Any, torch.Tensor, list[Event], _Slot | None, tuple[int, int] | None]] = {}
        rows = sum(split.values())  # (a store all on the GPU never loads: no ring)
        self._rings = [r for r in (_Ring(step_slots, rows * step_row_bytes // dtype.itemsize),
                                   _Ring(slots, rows * row_bytes // dtype.itemsize)) if r.count > 0]
        self._taken: dict[Hashable, _Slot] = {}  # slots compute has taken, by key, until `read`
        self.unslotted = 0  # loads that found every slot holding a load not yet taken

    @property
    def all_gpu(self) -> bool:
        return self.split["gpu"] == sum(self.split.values())

    def put(self, key: Hashable, h: torch.Tensor, tag: Any, ev: Event) -> None:
        """Keep h, which compute produced by `ev`, under key; compute has read what it took under
        key by then (a holder's next output follows its last input), so that slot is free after."""
        h, ev = self._own(h, ev)
        self.read(key, ev)
        whole = self.all_gpu or (h.shape[0] > 0 and h[0].numel() <= self.keep_row_elems)  # or a token step's
        st = _Stored(tag, tuple(h.shape), h if whole else None, ev, whole=whole)
        for tier, r0, r1 in () if whole else row_segments(h.shape[0], self.split):
            if tier == "gpu":
                st.gpu = h[r0:r1] if r1 - r0 < h.shape[0] else h
                continue
            buf, track = self.homes[key][tier]
            part = span_of(h[r0:r1])
            cp = self.mover.copy(Span(buf, 0, part.nbytes), part, [ev] + track.claim(), lane="store",
                                 transient=True)
            track.wrote(cp)
            track.tag = tag
        self._stored[key] = st
        self._release(key)

    def _release(self, key: Hashable) -> None:
        """Forget a load under key that compute never took; its slot is free again (a next load
        into it waits for this one's copies)."""
        dropped = self._loaded.pop(key, None)
        if dropped is not None and dropped[3] is not None:
            dropped[3].key = None

    def lends(self, h: torch.Tensor) -> bool:
        """Whether h is a ring slot's memory, which a later load writes over once compute has read
        it: what keeps h longer (or reads it on another lane) must keep a copy."""
        return any(h.untyped_storage().data_ptr() == s.buf.untyped_storage().data_ptr()
                   for r in self._rings for s in r.slots)

    def owned(self, h: torch.Tensor) -> torch.Tensor:
        """h, or a copy of it (made on compute) where it is a ring slot's memory: for what keeps h
        past the slot's next load."""
        return h.clone() if self.lends(h) else h

    def _own(self, h: torch.Tensor, ev: Event) -> tuple[torch.Tensor, Event]:
        """owned(h), and the event that made it (an input returned as it was is copied now)."""
        kept = self.owned(h)
        return (h, ev) if kept is h else (kept, self.lanes.compute.mark())

    def read(self, key: Hashable, ev: Event) -> None:
        """Compute is done with what it took under key by `ev` (every reader of it issued, some
        perhaps deferred, like CPU attention's residual): its ring slot may be loaded again after
        that. Until then the slot stays held; a store with a ring must be told."""
        slot = self._taken.pop(key, None)
        if slot is not None:
            slot.track.was_read(ev)
            slot.key = None

    def holds(self, key: Hashable, tag: Any) -> bool:
        st = self._stored.get(key)
        return st is not None and st.tag == tag

    def prefetch(self, key: Hashable, tag: Any) -> None:
        """Start assembling the tensor under key, which must be `tag`, on the compute device."""
        st = self._stored[key]
        assert st.tag == tag, f"{key}: holds {st.tag}, {tag} was asked for"
        if key in self._loaded or st.whole:
            return
        out, slot = self._load_target(key, st.shape)
        free = slot.track.claim() if slot is not None else []  # the slot's last load and reads
        segments = row_segments(st.shape[0], self.split)
        # the rows kept on the GPU join the loaded ones on compute when taken (`take`): on the load
        # stream their copy queued behind weight copies while the allocator kept the whole output
        # it read from; copied here where no other rows load (a small batch) or the setting says
        join = self.join_on_compute and any(tier != "gpu" for tier, _, _ in segments)
        evs, gpu_rows = [], None
        for tier, r0, r1 in segments:
            if tier == "gpu" and join:
                gpu_rows = (r0, r1)
                continue
            dst = span_of(out[r0:r1])
            if tier == "gpu":
                ev = self.mover.copy(dst, span_of(st.gpu), [st.ev] + free, lane=self.lane)
            else:
                buf, track = self.homes[key][tier]
                assert track.tag == tag
                ev = self.mover.copy(dst, Span(buf, 0, dst.nbytes), track.read_deps() + free, lane=self.lane)
                track.was_read(ev)
            if slot is not None:
                slot.track.wrote(ev)
            evs.append(ev)
        self._loaded[key] = (tag, out, evs, slot, gpu_rows)

    def _load_target(self, key: Hashable, shape: tuple[int, ...]) -> tuple[torch.Tensor, _Slot | None]:
        """A device tensor for the loading stream to fill: the next slot that holds no load
        waiting to be taken of the first ring whose slots are large enough, or (no ring, or every
        slot waiting) a fresh tensor made in the loading stream's memory pool: memory freed in the
        compute stream's pool may still be used by compute kernels queued behind the host, and a
        copy on another stream would race them (`take` records compute's use)."""
        size = math.prod(shape)
        for ring in self._rings:
            if size > ring.elems:
                continue
            if not ring.slots:  # made once; its first loads wait for compute queued now
                ring.slots = [_Slot(torch.empty(ring.elems, dtype=self.dtype, device=self.device))
                              for _ in range(ring.count)]
                for s in ring.slots:
                    s.track.was_read(self.lanes.compute.mark())
            for n in range(ring.count):
                slot = ring.slots[(ring.next + n) % ring.count]
                if slot.key is None:
                    ring.next = (ring.next + n + 1) % ring.count
                    slot.key = key
                    return slot.buf[:size].view(shape), slot
        self.unslotted += bool(self._rings)
        stream = getattr(getattr(self.lanes, self.lane), "stream", None)
        if stream is None:
            return torch.empty(shape, dtype=self.dtype, device=self.device), None
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=self.dtype, device=self.device), None

    def take(self, key: Hashable, tag: Any) -> tuple[torch.Tensor, list[Event]]:
        """The tensor under key (which must be `tag`) and the events compute must wait for."""
        st = self._stored[key]
        if st.whole:
            assert st.tag == tag, f"{key}: holds {st.tag}, {tag} was asked for"
            return st.gpu, []  # made on the compute stream, which reads it
        RowStore.prefetch(self, key, tag)  # the keyed form, not a subclass's
        got, out, evs, slot, gpu_rows = self._loaded.pop(key)
        assert got == tag
        if gpu_rows is not None:  # the rows kept on the GPU join the loaded ones, on compute
            self.lanes.compute.wait(evs)
            evs = []
            self.mover.compute_copy(out[gpu_rows[0]:gpu_rows[1]], st.gpu)
        if slot is not None:
            self._taken[key] = slot
        elif self.lanes.compute.stream is not None:  # its memory goes back to the load stream's pool
            out.record_stream(self.lanes.compute.stream)  # only once compute is done with it
        return out, evs

    def clear(self) -> None:
        """Drop what the last block left (its device tensors); the ring stays, its slots free
        once the compute issued until now is done."""
        for key in list(self._taken):
            self.read(key, self.lanes.compute.mark())
        self._stored.clear()
        self._loaded.clear()
        for ring in self._rings:
            for slot in ring.slots:
                slot.key = None


class HiddenStore(RowStore):
    """Each GPU batch's hidden state between layers: the output of layer j, input of j + 1."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, policy: Policy, mem: Ledger,
                 lanes: Lanes, mover: Mover, max_prompt: int):
        split = row_split(policy.gpu_batch_size, policy.act_gpu_percent, policy.act_cpu_percent)
        token, all_gpu = spec.hidden_size * dtype.itemsize, split["gpu"] == policy.gpu_batch_size
        keep = keeps_token_steps()
        super().__init__(range(policy.num_gpu_batches), split, max_prompt * token, dtype, mem, lanes, mover,
                         act_load_slots(all_gpu), 0 if keep else step_load_slots(all_gpu, policy.num_gpu_batches),
                         token, keep)

    def put(self, kb: int, j: int, h: torch.Tensor, ev: Event) -> None:  # type: ignore[override]
        """Keep the output h (n, s, hidden) of layer j for batch kb until layer j + 1; compute
        made it by `ev`."""
        super().put(kb, h, j, ev)

    def holds(self, kb: int, j: int) -> bool:  # type: ignore[override]
        """Whether batch kb's stored hidden state is layer j's output."""
        return super().holds(kb, j)

    def prefetch(self, kb: int, j: int) -> None:  # type: ignore[override]
        """Start assembling the input of layer j for batch kb on the compute device."""
        super().prefetch(kb, j - 1)

    def take(self, kb: int, j: int) -> tuple[torch.Tensor, list[Event]]:  # type: ignore[override]
        """The input of layer j for batch kb and the events compute must wait for."""
        return super().take(kb, j - 1)


class Stash(RowStore):
    """A training window's layer inputs, per (layer, window), placed as the policy's stash split
    says, kept from the layer's forward step to its backward step; loaded back on the fetch lane
    (the reverse sweep's next batch then does not wait for the next layer's weight copy). Homes
    for `windows` batches (None: every batch of a block); `begin` says which batches of a block
    train, each then keyed by its place among them."""

    lane = "fetch"

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, policy: Policy, mem: Ledger,
                 lanes: Lanes, mover: Mover, max_tokens: int, windows: int | None = None):
        split = row_split(policy.gpu_batch_size, policy.stash_gpu_percent, policy.stash_cpu_percent)
        self.windows = policy.num_gpu_batches if windows is None else min(windows, policy.num_gpu_batches)
        keys = [(j, w) for j in range(1, len(spec.layers)) for w in range(self.windows)]
        super().__init__(keys, split, max_tokens * spec.hidden_size * dtype.itemsize, dtype, mem, lanes, mover)
        self._slot: dict[int, int] = {}

    def begin(self, batches: Sequence[int]) -> None:
        """The block's training batches, in order (by default batch k is window k)."""
        assert len(batches) <= self.windows, (batches, self.windows)
        self._slot = {k: w for w, k in enumerate(batches)}

    def _key(self, key: tuple[int, int]) -> tuple[int, int]:
        j, k = key
        return j, self._slot.get(k, k)

    def put(self, key: Hashable, h: torch.Tensor, tag: Any, ev: Event) -> None:  # type: ignore[override]
        super().put(self._key(key), h, tag, ev)

    def holds(self, key: Hashable, tag: Any) -> bool:  # type: ignore[override]
        return super().holds(self._key(key), tag)

    def prefetch(self, key: Hashable, tag: Any) -> None:  # type: ignore[override]
        super().prefetch(self._key(key), tag)

    def take(self, key: Hashable, tag: Any) -> tuple[torch.Tensor, list[Event]]:  # type: ignore[override]
        return super().take(self._key(key), tag)

    def clear(self) -> None:
        super().clear()
        self._slot = {}
