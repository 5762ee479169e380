"""The weight store: every layer's weights on their tiers, staged through GPU slots.

Knows: each layer's flat buffer split by bytes across GPU, CPU and disk; GPU
slots (two, or four with CPU attention) that the non-resident part of a layer
is copied into (the next layers' copies overlap the current layer's compute); which events a slot's
next writer must wait for. Weights are stored in a WeightFormat (plain or
compressed) and rebuilt into compute-ready weights by it.
Does not know: model math, KV cache, scheduling order (the engine calls
prefetch and get).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from flexoff.models.base import LayerSpec, materialize
from flexoff.offload.lanes import Event, Lanes, Tracked

if TYPE_CHECKING:
    from flexoff.offload.adapters import AdapterPool
from flexoff.offload.layout import Layout, WeightFormat
from flexoff.offload.mover import Mover, Span
from flexoff.offload.placement import TIERS, ByteSplit, byte_split
from flexoff.offload.tiers import Ledger, Tiers
from flexoff.policy.policy import Policy, weight_slots


def plan_weights(layouts: list[Layout], policy: Policy) -> list[ByteSplit]:
    out = []
    for lay in layouts:
        a, b = byte_split(lay.nbytes, policy.w_gpu_percent, policy.w_cpu_percent)
        stage = lay.first_field_ending_after(a) if a < lay.nbytes else lay.nbytes
        out.append(ByteSplit(a, b, lay.nbytes, stage))
    return out


def weight_bytes(splits: list[ByteSplit], slots: int = 2) -> dict[str, int]:
    """Bytes each tier holds for weights, GPU slots included."""
    slot = max((s.n - s.stage for s in splits), default=0)
    return {"gpu": sum(s.a for s in splits) + slots * slot,
            "cpu": sum(s.bytes_on("cpu") for s in splits),
            "disk": sum(s.bytes_on("disk") for s in splits)}


def move_overhead(old: list[ByteSplit], new: list[ByteSplit]) -> dict[str, int]:
    """Bytes on each tier above the new store's layers while layers move to it one by one from an
    old store (layer j's old buffers are given back before its new ones are made): the old copy
    is still there for the layers not yet moved."""
    out = {}
    for t in TIERS:
        held = peak = sum(s.bytes_on(t) for s in old)  # before layer 0 moves
        for o, n in zip(old, new):
            held += n.bytes_on(t) - o.bytes_on(t)
            peak = max(peak, held)
        out[t] = max(0, peak - held)  # held: the new layers alone, once all have moved
    return out


class _Slot:
    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.track = Tracked()  # tag: the layer it holds
        # (whether staged and not yet read, when last staged or read): the smallest is refilled
        self.used: tuple[int, int] = (0, -1)


class WeightStore:
    """Owns its buffers (through its own Ledger) so it can outlive the engine that made it: a
    new engine with the same weight placement reuses it as it is."""

    def __init__(self, layers: list[LayerSpec], fmt: WeightFormat, policy: Policy, tiers: Tiers):
        self.layers, self.fmt = layers, fmt
        self.mem = Ledger(tiers)
        self.layouts = [Layout(fmt.fields(l)) for l in layers]
        self.splits = plan_weights(self.layouts, policy)
        self.homes: list[dict[str, Any]] = [{} for _ in layers]  # allocated as each layer is filled
        slot_bytes = max((s.n - s.stage for s in self.splits), default=0)
        self.slots = [_Slot(self.mem.alloc("gpu", slot_bytes)) for _ in range(weight_slots(policy.cpu_cache_compute))] if slot_bytes else []
        self._clock = 0  # counts slot uses
        self._in_slot: dict[int, int] = {}  # layer -> slot holding it
        self._views: dict[tuple[int, int], dict[str, Any]] = {}
        self.lanes: Lanes | None = None
        self.mover: Mover | None = None
        self.adapters: AdapterPool | None = None  # LoRA pages that ride each layer's staging (set per block)

    def bind(self, lanes: Lanes, mover: Mover) -> None:
        """Copy through this engine's lanes from now on."""
        self.lanes, self.mover = lanes, mover
        for slot in self.slots:
            slot.track = Tracked()
            slot.used = (0, -1)
        self._in_slot.clear()

    def matches(self, fmt: WeightFormat, policy: Policy) -> bool:
        """Whether a policy would place these weights exactly as they are."""
        return (self.fmt.key == fmt.key and plan_weights(self.layouts, policy) == self.splits
                and weight_slots(policy.cpu_cache_compute) == len(self.slots))

    # ---- loading -------------------------------------------------------
    def fill(self, j: int, tensors: Mapping[str, torch.Tensor], encoded: bool = False) -> None:
        """Store layer j's logical tensors (or its stored fields, if encoded) on its tiers."""
        s, lay = self.splits[j], self.layouts[j]
        enc = tensors if encoded else self.fmt.encode(self.layers[j], tensors)
        dev = next(iter(enc.values())).device if enc else torch.device("cpu")  # a stage's recv or send: none
        flat = torch.empty(s.n, dtype=torch.uint8, device=dev)
        lay.pack(enc, flat)
        home = self.homes[j] = {t: self.mem.alloc(t, s.bytes_on(t)) for t in ("gpu", "cpu", "disk")
                                if s.bytes_on(t) > 0}
        if s.a:
            home["gpu"][:s.a].copy_(flat[:s.a])
        if s.b > s.a:
            home["cpu"][:s.b - s.a].copy_(flat[s.a:s.b])
        if s.n > s.b:
            home["disk"].write_from(0, flat[s.b:].cpu())

    def take(self, j: int, encoded: bool, device: torch.device) -> dict[str, torch.Tensor]:
        """Layer j's stored fields (encoded) or dense logical tensors, on device; its buffers
        are given back, so moving weights to a new placement never holds two copies."""
        s, home = self.splits[j], self.homes[j]
        flat = torch.empty(s.n, dtype=torch.uint8, device=device)
        if s.a:
            flat[:s.a].copy_(home["gpu"][:s.a])
        if s.b > s.a:
            flat[s.a:s.b].copy_(home["cpu"][:s.b - s.a])
        if s.n > s.b:
            part = torch.empty(s.n - s.b, dtype=torch.uint8)
            home["disk"].read_into(0, part)
            flat[s.b:].copy_(part)
        for buf in home.values():
            self.mem.free(buf)
        self.homes[j] = {}
        views = self.layouts[j].views([(0, flat)])
        if encoded:
            return views
        return {k: materialize(v) for k, v in self.fmt.assemble(self.layers[j], views).items()}

    def release(self) -> None:
        self.mem.release()
        self.homes = [{} for _ in self.layers]
        self.slots = []
        self._views.clear()

    def release_slots(self) -> None:
        """Give back the GPU staging slots (before the layers move to a new store, which has
        its own): moving needs only the layers' homes."""
        for slot in self.slots:
            self.mem.free(slot.buf)
        self.slots = []
        self._in_slot.clear()
        self._views.clear()

    # ---- staging -------------------------------------------------------
    def prefetch(self, j: int) -> None:
        """Start copying layer j's non-resident bytes into a GPU slot."""
        s = self.splits[j]
        if s.resident:
            return
        if j in self._in_slot:  # asked for again: needed now, kept
            self._touch(self._in_slot[j], staged=True)
            return
        idx = self._victim()
        slot = self.slots[idx]
        self._touch(idx, staged=True)
        if slot.track.tag is not None:
            self._in_slot.pop(slot.track.tag, None)
        deps = slot.track.claim()
        slot.track.tag = j
        self._in_slot[j] = idx
        home = self.homes[j]
        parts = [("gpu", s.stage, s.a, 0), ("cpu", max(s.a, s.stage), s.b, s.a), ("disk", s.b, s.n, s.b)]
        for tier, lo, hi, base in parts:
            if hi > lo:
                src = Span(home[tier], lo - base, hi - lo)
                ev = self.mover.copy(Span(slot.buf, lo - s.stage, hi - lo), src, deps, lane="weights")
                slot.track.wrote(ev)
        if self.adapters is not None:  # the block's LoRA of this layer goes along, into the slot's pages
            for ev in self.adapters.stage(j, idx, deps, self.mover):
                slot.track.wrote(ev)

    def forget(self) -> None:
        """Slots keep their bytes but count as holding no layer (a new block's adapter pages must
        be staged with each layer again); readers still in flight are still waited for."""
        for slot in self.slots:
            slot.track.tag = None
            slot.used = (0, -1)
        self._in_slot.clear()

    def slot_of(self, j: int) -> int | None:
        """The slot staging layer j (None: resident or not staged)."""
        return self._in_slot.get(j)

    def _victim(self) -> int:
        """The slot a new layer goes into: of the slots read since they were filled, the one read
        longest ago (in a sweep up or down the layers, the layer furthest behind it); a layer
        staged and not yet read is needed soon and goes last."""
        return min(range(len(self.slots)), key=lambda n: self.slots[n].used)

    def _touch(self, idx: int, staged: bool = False) -> None:
        self._clock += 1
        self.slots[idx].used = (int(staged), self._clock)

    def reuses(self, j: int) -> int | None:
        """The layer whose slot prefetch(j) would take now (None if it takes none, or an empty one)."""
        if self.splits[j].resident or j in self._in_slot or not self.slots:
            return None
        return self.slots[self._victim()].track.tag

    def get(self, j: int) -> tuple[dict[str, Any], list[Event]]:
        """Compute-ready weights of layer j and the events the compute must wait for."""
        s = self.splits[j]
        if s.resident:
            key, deps = (j, -1), []
        else:
            if j not in self._in_slot:
                self.prefetch(j)
            idx = self._in_slot[j]
            self._touch(idx)
            key, deps = (j, idx), self.slots[idx].track.read_deps()
        if key not in self._views:
            segs = []
            if s.a:
                segs.append((0, self.homes[j]["gpu"][:s.a]))
            if not s.resident:
                segs.append((s.stage, self.slots[key[1]].buf[:s.n - s.stage]))
            raw = self.layouts[j].views(segs)
            self._views[key] = self.fmt.assemble(self.layers[j], raw)
        return self._views[key], deps

    def was_read(self, j: int, ev: Event) -> None:
        """Record that compute read layer j's slot until `ev`."""
        if not self.splits[j].resident:
            self.slots[self._in_slot[j]].track.was_read(ev)

    def bytes_per_tier(self) -> dict[str, int]:
        return weight_bytes(self.splits, len(self.slots))
