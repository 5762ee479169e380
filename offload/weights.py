"""The weight store: every layer's weights on their tiers, staged through GPU slots.

Knows: each layer's flat buffer split by bytes across GPU, CPU and disk; two
GPU slots that the non-resident part of a layer is copied into (the next
layer's copy overlaps the current layer's compute); which events a slot's
next writer must wait for. Weights are stored in a WeightFormat (plain or
compressed) and rebuilt into compute-ready weights by it.
Does not know: model math, KV cache, scheduling order (the engine calls
prefetch and get).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from flexoff.models.base import LayerSpec
from flexoff.offload.lanes import Event, Lanes, Tracked
from flexoff.offload.layout import Layout, WeightFormat
from flexoff.offload.mover import Mover, Span
from flexoff.offload.placement import ByteSplit, byte_split
from flexoff.offload.tiers import Tiers
from flexoff.policy.policy import Policy


def plan_weights(layouts: list[Layout], policy: Policy) -> list[ByteSplit]:
    out = []
    for lay in layouts:
        a, b = byte_split(lay.nbytes, policy.w_gpu_percent, policy.w_cpu_percent)
        stage = lay.first_field_ending_after(a) if a < lay.nbytes else lay.nbytes
        out.append(ByteSplit(a, b, lay.nbytes, stage))
    return out


def weight_bytes(splits: list[ByteSplit]) -> dict[str, int]:
    """Bytes each tier holds for weights, GPU slots included."""
    slot = max((s.n - s.stage for s in splits), default=0)
    return {"gpu": sum(s.a for s in splits) + 2 * slot,
            "cpu": sum(s.bytes_on("cpu") for s in splits),
            "disk": sum(s.bytes_on("disk") for s in splits)}


class _Slot:
    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.track = Tracked()  # tag: the layer it holds


class WeightStore:
    def __init__(self, layers: list[LayerSpec], fmt: WeightFormat, policy: Policy,
                 tiers: Tiers, lanes: Lanes, mover: Mover):
        self.layers, self.fmt, self.tiers, self.lanes, self.mover = layers, fmt, tiers, lanes, mover
        self.layouts = [Layout(fmt.fields(l)) for l in layers]
        self.splits = plan_weights(self.layouts, policy)
        self.homes: list[dict[str, Any]] = []
        for s in self.splits:
            self.homes.append({t: tiers.get(t).alloc(s.bytes_on(t)) for t in ("gpu", "cpu", "disk")
                               if s.bytes_on(t) > 0})
        slot_bytes = max((s.n - s.stage for s in self.splits), default=0)
        self.slots = [_Slot(tiers.gpu.alloc(slot_bytes)) for _ in range(2)] if slot_bytes else []
        self._next_slot = 0
        self._in_slot: dict[int, int] = {}  # layer -> slot holding it
        self._views: dict[tuple[int, int], dict[str, Any]] = {}

    # ---- loading -------------------------------------------------------
    def fill(self, j: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store layer j's logical tensors (any device) on its tiers; synchronous."""
        s, lay = self.splits[j], self.layouts[j]
        enc = self.fmt.encode(self.layers[j], tensors)
        dev = next(iter(enc.values())).device
        flat = torch.empty(s.n, dtype=torch.uint8, device=dev)
        lay.pack(enc, flat)
        home = self.homes[j]
        if s.a:
            home["gpu"][:s.a].copy_(flat[:s.a])
        if s.b > s.a:
            home["cpu"][:s.b - s.a].copy_(flat[s.a:s.b])
        if s.n > s.b:
            home["disk"].write_from(0, flat[s.b:].cpu())

    # ---- staging -------------------------------------------------------
    def prefetch(self, j: int) -> None:
        """Start copying layer j's non-resident bytes into a GPU slot."""
        s = self.splits[j]
        if s.resident or j in self._in_slot:
            return
        idx = self._next_slot
        self._next_slot = 1 - idx
        slot = self.slots[idx]
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
                ev = self.mover.copy(Span(slot.buf, lo - s.stage, hi - lo), src, deps, lane="load")
                slot.track.wrote(ev)

    def get(self, j: int) -> tuple[dict[str, Any], list[Event]]:
        """Compute-ready weights of layer j and the events the compute must wait for."""
        s = self.splits[j]
        if s.resident:
            key, deps = (j, -1), []
        else:
            if j not in self._in_slot:
                self.prefetch(j)
            idx = self._in_slot[j]
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
        return weight_bytes(self.splits)
