"""The adapter pool: LoRA adapters in host memory, the current block's on the compute device, and
their deltas added beside each adapted projection for the rows that use them.

Knows: each adapter as one flat host buffer in the compute dtype (pinned where copies go to a
GPU), laid out layer by layer so a layer's LoRA is one contiguous segment per adapter; for
adapters read from files, a host cache of such buffers, least recently used dropped first,
with room for the policy's `lora_cache_blocks` blocks' adapters (a job's blocks group rows by
adapter, so each is read about once), pinned once as one arena whose runs the buffers take and
give back (`tiers.PinnedArena`), the next block's read by a thread of its own (and READ_THREADS
readers) while the current one runs, as many as the room holds beside the current block's (the
rest read when the next block begins), what that costs counted in `Reads`;
held adapters (made in memory, trained) keep theirs; a block
(the adapters its rows use, in index order); two ways of holding a block on the device:
- resident (the weights are on the device too): a cache of adapters laid out per matmul in one
  buffer: each adapted matmul has as many rank lanes as a block of the job needs there, the A's
  of a layer's matmuls side by side (in the model's order, so q, k and v stack), then their B's
  transposed, each adapter's lanes of a matmul one run; each lane's owner (its adapter's index
  in the block, -1 for none) and scale sit in device tables, so a decode step shrinks onto
  every lane with one dense matmul (`kernels.lora.Dense`). Adapters are copied once and kept
  while every matmul has lanes to spare (emptied when a block's adapters do not fit beside
  them), so blocks that share adapters copy nothing. A job of several blocks also has a staging
  buffer: while a block runs, the next block's adapters are copied into it (one copy each, on
  a copy stream of their own), and when that block begins they move into their lanes in one
  launch (`kernels.copies`);
- paged (the weights stream from CPU or disk): the block's segments of one layer copied into
  the staging slot that layer's weights go to, on the same copy lane, when the weights are
  prefetched (one copy per adapter and layer, in one lane task), so adapters ride each weight
  load and never need room for more than the slots' layers;
and per adapted matmul a LoraPack (kernels.lora) whose offsets, ranks and scales for the
block's adapters sit in device tensors of fixed size (a CUDA graph captured once reads any
later block's adapters); weight objects whose `linear` adds the rows' deltas to the base
projection (so model files, which call `linear`, never mention adapters).
Does not know: PEFT's files (flexoff.adapters), the schedule, which rows go in which block.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from flexoff.adapters.peft import Adapter
from flexoff.kernels.copies import copy_runs
from flexoff.kernels.lora import Dense, LoraPack, lora_delta, lora_linears
from flexoff.offload.tiers import PinnedArena
from flexoff.policy.policy import CACHE_BLOCKS
from flexoff.models.base import linear, materialize, stacked_with_bias

if TYPE_CHECKING:
    from flexoff.offload.lanes import Event
    from flexoff.offload.mover import Mover
    from flexoff.offload.weights import WeightStore

Key = tuple[int, str]  # (engine layer, matmul tensor name)


class LoraLinear:
    """A base weight (a tensor or a weight object) and the LoRA of its batch's rows."""

    def __init__(self, base: Any, ids: torch.Tensor, pack: LoraPack, host_ids: tuple[int, ...] | None = None):
        self.base, self.ids, self.pack = base, ids, pack
        self.host_ids = host_ids  # the same adapter indices on the host, where known

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.base, torch.Tensor):
            return lora_linears(x, self.base, b, [self.base.shape[0]], self.ids, [self.pack], self.host_ids)[0]
        return lora_delta(x, linear(x, self.base, b), self.ids, self.pack, self.host_ids)

    def linears(self, x: torch.Tensor, ws: Sequence[Any], bs: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
        """x's projections by this and the other weights (q, k, v; gate, up) at once, where all
        adapt plain matrices that lie stacked in memory for the same rows: one base matmul, each
        projection's deltas in its own columns (None where they cannot go together)."""
        if not all(isinstance(w, LoraLinear) and w.ids is self.ids for w in ws):
            return None
        wb = stacked_with_bias([t.base for t in ws], bs)
        if wb is None:
            return None
        return lora_linears(x, *wb, [t.base.shape[0] for t in ws], self.ids, [t.pack for t in ws], self.host_ids)

    def dense(self) -> torch.Tensor:
        return materialize(self.base)


@dataclass(frozen=True)
class Slot:
    """Where one matmul of an adapter lies in the adapter's flat buffer (elements)."""
    a_off: int
    b_off: int
    rank: int
    scale: float


def pins(device: torch.device) -> bool:
    """Whether host copies of adapters are pinned (they are copied to a GPU)."""
    return device.type == "cuda"


Alloc = Callable[[int, torch.dtype, object], tuple[torch.Tensor, Any]]
WRITE_CHUNK = 32 << 20  # bytes of an adapter converted and copied to its host buffer at a time
READ_THREADS = 1  # adapters the reader reads from their files at once


@dataclass
class Reads:
    """What reading adapters from their files cost: adapters and bytes read, seconds the reads
    took (ahead of their blocks, or when a block began), and seconds the blocks waited for them."""
    adapters: int = 0
    bytes: int = 0
    read_s: float = 0.0
    waited_s: float = 0.0

    def add(self, adapters: int, nbytes: int, seconds: float) -> None:
        self.adapters, self.bytes, self.read_s = self.adapters + adapters, self.bytes + nbytes, self.read_s + seconds


class HostAdapter:
    """One adapter in one flat host buffer: per layer, per adapted matmul (sorted by name), A
    (rank, in) then B transposed (rank, out)."""

    def __init__(self, a: Adapter, dtype: torch.dtype, alloc: Alloc | None = None):
        """`alloc`: the buffer's pinned memory and its lease, given its elements, dtype and owner
        (None: not pinned)."""
        self.name = a.name
        self.slots: dict[Key, Slot] = {}
        self.segments: dict[int, tuple[int, int]] = {}  # layer -> [first, end) elements
        at = 0
        shapes = a.shapes
        for key in sorted(shapes):
            sh = shapes[key]
            lo = self.segments.get(key[0], (at, at))[0]
            self.slots[key] = Slot(at, at + sh.rank * sh.fan_in, sh.rank, sh.scaling)
            at += sh.numel
            self.segments[key[0]] = (lo, at)
        self.numel = at
        self.lease: Any = None  # the buffer's run of the arena, to give back when the copy is dropped
        if alloc is not None:
            self.flat, self.lease = alloc(at, dtype, self)
        else:
            self.flat = torch.empty(at, dtype=dtype)
        self.write(a.modules)  # an adapter not held: read from its file, once
        if a.held:
            self._share(a)

    def _share(self, a: Adapter) -> None:
        """Where the adapter's tensors are frozen host tensors of the buffer's dtype, make them
        views of the buffer: one host copy of each adapter instead of two (1000 adapters of a
        30B model take hundreds of GB)."""
        tensors = [t for m in a.modules.values() for t in (m.A, m.B)]
        if any(t.device.type != "cpu" or t.dtype != self.flat.dtype or t.requires_grad for t in tensors):
            return
        for key, s in self.slots.items():
            m = a.modules[key]
            r, fout = m.B.shape[1], m.B.shape[0]
            m.A = self.flat[s.a_off:s.a_off + m.A.numel()].view_as(m.A)
            m.B = self.flat[s.b_off:s.b_off + r * fout].view(r, fout).t()

    def write(self, modules: Mapping[Key, Any]) -> None:
        """Copy the adapter's values (its modules) in (again, after an optimizer step changed
        them): converted to the buffer's dtype where they are, WRITE_CHUNK bytes at a
        time, each chunk brought over in one copy (a synchronous copy per tensor, 566 for
        OPT-30B's adapter on the GPU, took 105 ms of each training step)."""
        keys, at = list(self.slots), 0
        while at < len(keys):
            lo, hi, pairs = self.slots[keys[at]].a_off, 0, []
            while at < len(keys) and (not pairs or hi - lo <= WRITE_CHUNK // self.flat.element_size()):
                s, m = self.slots[keys[at]], modules[keys[at]]
                hi = s.b_off + m.B.numel()
                pairs += [(s.a_off, m.A.shape, m.A), (s.b_off, (m.B.shape[1], m.B.shape[0]), m.B.t())]
                at += 1
            src = [t.detach() for _, _, t in pairs]
            if all(t.device.type == "cpu" for t in src):  # converted straight into the buffer
                torch._foreach_copy_([self.flat[o:o + t.numel()].view(shape) for o, shape, t in pairs], src)
                continue
            tmp = torch.empty(hi - lo, dtype=self.flat.dtype, device=pairs[0][2].device)
            torch._foreach_copy_([tmp[o - lo:o - lo + t.numel()].view(shape) for o, shape, t in pairs], src)
            self.flat[lo:hi].copy_(tmp)


@dataclass(frozen=True)
class Need:
    """What a job's blocks need on the device: the most adapters one block uses, the most
    elements of LoRA one block uses, the most one block uses in one layer, per adapted matmul
    the most rank lanes one block uses in it, the elements of the resident layout with those
    lanes (0: as many as `elements`), and of the staging buffer a job of several blocks copies
    the next block's adapters into (resident); and the elements of the largest adapter a block
    uses (the host cache's room has one more)."""
    adapters: int = 0
    elements: int = 0
    layer: int = 0
    lanes: tuple[tuple[Key, int], ...] = ()
    resident: int = 0
    staging: int = 0
    largest: int = 0

    def gpu_bytes(self, paged: bool, slots: int, itemsize: int) -> int:
        return (slots * self.layer if paged else max(self.elements, self.resident) + self.staging) * itemsize

    def covers(self, other: "Need") -> bool:
        """Whether room made for this need holds blocks of `other` too."""
        mine = dict(self.lanes)
        return self.adapters >= other.adapters and self.elements >= other.elements and self.layer >= other.layer \
            and self.resident >= other.resident and self.staging >= other.staging and self.largest >= other.largest \
            and all(mine.get(k, 0) >= n for k, n in other.lanes)


def layer_numel(a: Adapter) -> dict[int, int]:
    out: dict[int, int] = {}
    for (j, _), sh in a.shapes.items():
        out[j] = out.get(j, 0) + sh.numel
    return out


class AdapterPool:
    """Loaded adapters (host copies made on first use) and the current block's on the device."""

    def __init__(self, adapters: Sequence[Adapter], device: torch.device, dtype: torch.dtype, spec: Any = None):
        """`spec` (the model's) orders each layer's matmuls as the model does, so that stacked
        ones (q, k, v) lie side by side in the resident layout; without it, by name."""
        self.adapters = {a.name: a for a in adapters}
        self.device, self.dtype = device, dtype
        self.arena = PinnedArena() if pins(device) else None
        self.max_rank = max((sh.rank for a in adapters for sh in a.shapes.values()), default=1)
        order = {(j, t.name): i for j, lay in enumerate(spec.layers) for i, t in enumerate(lay.tensors)} if spec else {}
        self.keys = sorted({key for a in adapters for key in a.shapes}, key=lambda k: (k[0], order.get(k, 0), k[1]))
        self._fans = {key: (sh.fan_in, sh.fan_out) for a in adapters for key, sh in a.shapes.items()}
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()  # least recently used first
        self.cache_elements: int | None = None  # room for the host copies of adapters read from files
        self._lock = threading.Lock()  # the cache, shared with the thread that reads the next block's
        self._reading: tuple[threading.Thread, list[BaseException]] | None = None  # that thread, its error
        self.reads = Reads()
        self._readers_of: tuple[int, ThreadPoolExecutor] | None = None  # (threads, the pool of them)
        self._fence: Any = None  # (number, CUDA event) after the work of the blocks before the current one
        self.upcoming: list[str | None] = []  # the next block's adapters, read once this block has begun
        self._stale: set[str] = set()  # adapters whose host copy is older than their values
        self._layer_numel = {a.name: layer_numel(a) for a in adapters}
        self.block: list[str] = []  # the current block's adapters, by index
        self.index: dict[str, int] = {}
        self.packs: dict[Key, LoraPack] = {}
        self.version = 0  # changes whenever device buffers are made anew (graphs read them)
        self.paged = False
        self._cap: Need | None = None
        self._buf: torch.Tensor | None = None  # resident: the cache; paged: unused
        self._slots: list[torch.Tensor] = []  # paged: one buffer per weight slot
        self._lanes: dict[Key, int] = {}  # resident: each matmul's rank lanes
        self._regions: dict[Key, tuple[int, int, int]] = {}  # resident: where its A and B lanes start, its first
        # lane in the lane tables
        self._cached: dict[str, dict[Key, int]] = {}  # resident: adapter -> its first lane in each matmul
        self._tops: dict[Key, int] = {}  # resident: each matmul's first free lane
        self._stage: torch.Tensor | None = None  # resident, several blocks: the next block's adapters, flat
        self._staged: dict[str, int] = {}  # adapter -> its first element in _stage
        self._stage_hosts: list[HostAdapter] = []  # their host copies, kept until the copies are done
        self._stage_done: Any = None  # a CUDA event after the staging copies
        self._copier: Any = None  # the CUDA stream they run on
        self._copies: dict[int, list[tuple[torch.Tensor, int, int]]] = {}  # paged: layer -> (src, at, n)
        self._page_at: dict[int, list[int]] = {}  # paged: layer -> each block adapter's place in a slot
        self._offs = self._ranks = self._scales = torch.zeros(0)  # device tables (made by _reserve)
        self._owner = self._lane_scale = torch.zeros(0)  # resident: each lane's adapter and scale, matmul by matmul

    # ---- sizes -------------------------------------------------------------------------------
    def need(self, blocks: Iterable[Iterable[str | None]]) -> Need:
        """The device room a job's blocks (each the adapter names of its rows) need."""
        adapters = elements = layer = count = largest = 0
        lanes: dict[Key, int] = {}
        for names in blocks:
            count += 1
            used = {n for n in names if n is not None}
            adapters = max(adapters, len(used))
            sizes = [self.adapters[n].numel for n in used]
            elements, largest = max(elements, sum(sizes)), max([largest, *sizes])
            per: dict[int, int] = {}
            ranks: dict[Key, int] = {}
            for n in used:
                for j, c in self._layer_numel[n].items():
                    per[j] = per.get(j, 0) + c
                for key, sh in self.adapters[n].shapes.items():
                    ranks[key] = ranks.get(key, 0) + sh.rank
            layer = max([layer, *per.values()])
            for key, r in ranks.items():
                lanes[key] = max(lanes.get(key, 0), r)
        resident = sum(r * sum(self._fans[k]) for k, r in lanes.items())
        return Need(adapters, elements, layer, tuple(sorted(lanes.items())), resident, elements if count > 1 else 0,
                    largest)

    def host_bytes(self, need: Need | None = None, blocks: int = CACHE_BLOCKS) -> int:
        """Host memory the adapters' flat copies take: every held adapter's, and of those read
        from files, all of them or (for a job whose blocks need `need`) `blocks` blocks' worth."""
        held = sum(a.numel for a in self.adapters.values() if a.held)
        return (held + self._file_room(need, blocks)) * self.dtype.itemsize

    def _file_room(self, need: Need | None, blocks: int) -> int:
        """Elements the host copies of adapters read from files take: all of them, or (for a job
        whose blocks need `need`) at most `blocks` blocks' worth and its largest adapter's (the
        arena's runs, taken and given back in the blocks' order, go round it as a ring: what is
        live at once fits with one adapter's room more, whatever the rounds leave at the end)."""
        files = sum(a.numel for a in self.adapters.values() if not a.held)
        return files if need is None else min(files, blocks * need.elements + need.largest)

    def keep_for(self, need: Need, blocks: int = CACHE_BLOCKS) -> int:
        """Size the host cache for a job whose blocks need `need`, with room for `blocks` blocks'
        adapters read from files; the host bytes that counts."""
        self.wait()
        self.cache_elements = blocks * need.elements
        files = self._file_room(need, blocks)
        slack = 0
        if self.arena is not None and files:  # the cache's room pinned once (and each run's alignment)
            slack = (blocks + 1) * need.adapters * PinnedArena.ALIGN
            self.arena.reserve(files * self.dtype.itemsize + slack)
        self._new_fence()
        self._evict(set(self.block))
        return self.host_bytes(need, blocks) + slack

    def _evict(self, keep: set[str], incoming: int = 0) -> None:
        """Drop the least recently used host copies of adapters read from files (none in `keep`)
        until those left and `incoming` elements more fit the cache's room."""
        if self.cache_elements is None:
            return
        with self._lock:
            files = [n for n in self._host if not self.adapters[n].held]
            kept = sum(self._host[n].numel for n in files) + incoming
            for n in files:
                if kept <= self.cache_elements:
                    break
                if n not in keep:
                    kept -= self._drop(n)

    def _alloc(self, name: str, keep: set[str]) -> Alloc | None:
        """Where the host copy of adapter `name` gets its pinned memory: read from its file, a
        run of the arena, made room for by dropping the least recently used copies (none in
        `keep`) while none fits (a job sorted by adapter seldom uses one again in a later
        block), else pinned on its own; held (never dropped), pinned on its own."""
        arena = self.arena
        if arena is None:
            return None
        if self.adapters[name].held:
            return arena.alone

        def alloc(numel: int, dtype: torch.dtype, owner: object) -> tuple[torch.Tensor, Any]:
            while True:
                got = arena.take(numel, dtype, owner, alone=False)
                if got is not None:
                    return got
                with self._lock:
                    drop = next((n for n in self._host if not self.adapters[n].held and n not in keep), None)
                    if drop is None:
                        break
                    self._drop(drop)
            got = arena.take(numel, dtype, owner)
            assert got is not None
            return got
        return alloc

    def _new_fence(self) -> None:
        """Record the fence that host copies dropped from now on wait for before their pinned
        memory is written again: after every copy out of them queued so far."""
        if self.arena is not None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._fence = ((self._fence[0] + 1) if self._fence else 0, event)

    def _keep(self, h: HostAdapter) -> HostAdapter:
        """Cache a host copy just read; one read meanwhile by another thread wins (this one's run
        of the arena is given back)."""
        with self._lock:
            kept = self._host.setdefault(h.name, h)
        if kept is not h:
            PinnedArena.give(h.lease)
        return kept

    def _drop(self, name: str) -> int:
        """Forget an adapter's host copy (the lock held), its pinned buffer given back for the
        next copy; its elements."""
        h = self._host.pop(name)
        PinnedArena.give(h.lease, self._fence)
        return h.numel

    def drop_host_cache(self, keep: Iterable[str] = ()) -> None:
        """Forget the host copies of adapters read from files, but those in `keep` (their next
        use reads the files again)."""
        self.wait()
        self._new_fence()
        kept = set(keep)
        with self._lock:
            for n in [n for n in self._host if not self.adapters[n].held and n not in kept]:
                self._drop(n)

    def prefetch(self, names: Iterable[str | None], main: Any = None) -> None:
        """Start reading these adapters (the next block's) from their files into the host cache,
        as many as its room holds beside the current block's (which stay), in a thread of its
        own, while the current block runs, and (given the CUDA stream `main` that computes)
        staging them on the device after; the next begin() waits for it (and reads the rest)."""
        want = [n for n in dict.fromkeys(names) if n is not None and not self.adapters[n].held]
        with self._lock:
            want = [n for n in want if n not in self._host]
            if self.cache_elements is not None:
                room = self.cache_elements - sum(self._host[n].numel for n in self.block
                                                 if n in self._host and not self.adapters[n].held)
                fit = list(itertools.accumulate(self.adapters[n].numel for n in want))
                want = [n for n, total in zip(want, fit) if total <= room]
        if not want:
            return
        self.wait()
        keep, failed = set(self.block) | set(want), []  # the current block's and the next one's

        def read() -> None:
            try:
                self._read_all(want, keep)
                if main is not None:
                    with torch.inference_mode():  # thread-local: the staging buffer may be an inference tensor
                        self._stage_next(want, main)
            except BaseException as e:  # raised by wait(), in the thread that runs the blocks
                failed.append(e)

        thread = threading.Thread(target=read, name="flexoff-adapters", daemon=True)
        thread.start()
        self._reading = (thread, failed)

    def _read(self, name: str, keep: set[str]) -> HostAdapter:
        """Make an adapter's host copy in the cache, read from its file (making room by dropping
        copies of adapters not in `keep`) or, held, from its values."""
        return self._keep(HostAdapter(self.adapters[name], self.dtype, self._alloc(name, keep)))

    def _read_now(self, names: Sequence[str]) -> None:
        """Read the host copies of these adapters (a block's) that the cache lacks from their
        files now, while the block waits: those a read-ahead left for want of room."""
        with self._lock:
            want = [n for n in names if not self.adapters[n].held and n not in self._host]
        if want:
            self.reads.waited_s += self._read_all(want, set(names))

    def _read_all(self, want: Sequence[str], keep: set[str]) -> float:
        """Read these adapters' host copies from their files into the cache, room made first
        (dropping none in `keep`): READ_THREADS at once, or one in the calling thread (the file
        reads and conversions release the GIL); counted in `reads`; the seconds they took."""
        t0, numel = time.perf_counter(), sum(self.adapters[n].numel for n in want)
        self._evict(keep, numel)
        if READ_THREADS > 1:
            list(self._readers().map(lambda n: self._read(n, keep), want))
        else:
            for n in want:
                self._read(n, keep)
        took = time.perf_counter() - t0
        self.reads.add(len(want), numel * self.dtype.itemsize, took)
        return took

    def _readers(self) -> ThreadPoolExecutor:
        """READ_THREADS threads that read adapter files (more than one was slower on the H200:
        their reads slowed the blocks running beside them more than they gained)."""
        if self._readers_of is None or self._readers_of[0] != READ_THREADS:
            if self._readers_of is not None:  # READ_THREADS changed: the old pool's threads end, idle
                self._readers_of[1].shutdown(wait=False)
            pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="flexoff-adapters-read")
            self._readers_of = (READ_THREADS, pool)
        return self._readers_of[1]

    def wait(self) -> None:
        """Let a prefetch finish (its errors, such as an unreadable file, are raised here)."""
        reading, self._reading = self._reading, None
        if reading is not None:
            t0 = time.perf_counter()
            reading[0].join()
            self.reads.waited_s += time.perf_counter() - t0
            if reading[1]:
                raise reading[1][0]

    def host(self, name: str, fresh: bool = True, keep: Iterable[str] = ()) -> HostAdapter:
        """An adapter's host copy (its layout; its values are current unless `fresh` is off),
        read from its file if the cache does not hold it (dropping others but `keep` where
        its pinned memory needs their room)."""
        with self._lock:
            h = self._host.get(name)
            if h is not None:
                self._host.move_to_end(name)
        if h is None:
            h = self._read(name, {name, *keep})
        elif fresh and name in self._stale:
            h.write(self.adapters[name].modules)
        if fresh:
            self._stale.discard(name)
        return h

    def refresh(self, name: str) -> None:
        """An adapter's values changed (an optimizer step). Held in the device cache, it is
        rewritten there from its values (wherever they live) and its host copy when next
        needed; otherwise the next block copies it anew."""
        self.wait()
        self._stale.add(name)
        self._staged.pop(name, None)
        lanes = self._cached.get(name)
        if lanes is None or self._buf is None:
            self._cached.pop(name, None)
            return
        a = self.adapters[name]
        dst, src = [], []
        for key, lane in lanes.items():
            m = a.modules[key]
            A, Bt = self._lane_views(key, lane, m.A.shape[0])
            dst += [A, Bt]
            src += [m.A.detach(), m.B.detach().t()]
        with torch.no_grad():
            torch._foreach_copy_(dst, src)  # as few kernels as the dtypes and devices allow

    def drop_cache(self) -> None:
        """Forget the adapters the device holds (resident): the next block copies its own again."""
        self.wait()
        self._cached, self._tops, self._staged = {}, {}, {}

    # ---- blocks ------------------------------------------------------------------------------
    def begin(self, names: Sequence[str | None], cap: Need, weights: "WeightStore") -> None:
        """Make the block whose rows use `names` current: indices, packs and (resident) the
        adapters on the device. `cap` is what the engine planned room for."""
        used = list(dict.fromkeys(n for n in names if n is not None))
        self.wait()  # the block's adapters read ahead, if they were
        self._new_fence()
        if len(used) > cap.adapters:
            raise RuntimeError(f"internal: a block of {len(used)} adapters in room planned for {cap.adapters}")
        paged = not all(s.resident for s in weights.splits)
        self._reserve(cap, paged, len(weights.slots))
        self.block, self.index = used, {n: i for i, n in enumerate(used)}
        self._read_now(used)
        hosts = [self.host(n, fresh=paged, keep=used) for n in used]  # resident: only copies made fresh
        self._evict(set(used))
        if paged:
            self._plan_pages(hosts)
            weights.forget()  # the slots hold no layer with this block's adapters yet
        else:
            self._place(hosts)
        for key, p in self.packs.items():
            slots = [h.slots.get(key) for h in hosts]
            if paged:
                lo = [h.segments.get(key[0], (0, 0))[0] for h in hosts]
                at = self._page_at.get(key[0], lo)  # no adapter of the block adapts this layer
                a_offs = [at[i] + s.a_off - lo[i] if s else 0 for i, s in enumerate(slots)]
                b_offs = [at[i] + s.b_off - lo[i] if s else 0 for i, s in enumerate(slots)]
            else:
                at = [self._lane_at(key, self._cached[h.name][key]) if s else (0, 0) for h, s in zip(hosts, slots)]
                a_offs, b_offs = [a for a, _ in at], [b for _, b in at]
            ranks = [s.rank if s else 0 for s in slots]
            scales = [s.scale if s else 0.0 for s in slots]
            p.ranks, p.a_offs, p.b_offs, p.scales = tuple(ranks), tuple(a_offs), tuple(b_offs), tuple(scales)
        # every pack's offsets, ranks and scales reach the device in one copy per table
        for table, rows in ((self._offs, [o for p in self.packs.values() for o in (p.a_offs, p.b_offs)]),
                            (self._ranks, [p.ranks for p in self.packs.values()]),
                            (self._scales, [p.scales for p in self.packs.values()])):
            host = torch.zeros(table.shape, dtype=table.dtype)
            for i, vals in enumerate(rows):
                host[i, :len(vals)] = torch.tensor(vals, dtype=table.dtype)
            table.copy_(host)
        upcoming, self.upcoming = self.upcoming, []
        main = torch.cuda.current_stream(self.device) if self._stage is not None and self.device.type == "cuda" \
            else None
        if not paged:
            self._own(hosts)
            self._stage_next(upcoming, main)
        self.prefetch(upcoming, main)

    def device_bytes(self) -> int:
        """Bytes of the adapters' device buffers (the cache or the pages, and their tables)."""
        held = [t for t in (self._buf, self._stage) if t is not None] + self._slots + [
            self._offs, self._ranks, self._scales, self._owner, self._lane_scale]
        return sum(t.numel() * t.element_size() for t in held)

    def release(self) -> None:
        """Give back the device buffers (the engine they were planned for closed); the host
        copies stay, and the next block reserves again."""
        self._cap, self._buf, self._slots, self._cached, self._tops = None, None, [], {}, {}
        self._stage, self._staged = None, {}
        self.packs, self.block, self.index = {}, [], {}
        self._offs = self._ranks = self._scales = self._owner = self._lane_scale = torch.zeros(0)
        self.version += 1

    def _reserve(self, cap: Need, paged: bool, slots: int) -> None:
        """Device buffers for this room (kept while the room and the way of holding stay)."""
        if self._cap == cap and self.paged == paged and (not paged or len(self._slots) == slots):
            return
        self._cap, self.paged = cap, paged
        self._buf, self._slots, self._cached, self._tops = None, [], {}, {}
        self._stage, self._staged = None, {}
        dev = self.device
        n, m = max(1, cap.adapters), len(self.keys)
        given = dict(cap.lanes)  # a need made by hand: room for its adapters at the largest rank
        self._lanes = {} if paged else {k: given.get(k, 0) if cap.lanes else self.max_rank * n for k in self.keys}
        self._regions, at = self._layout(self._lanes)
        if paged:
            self._slots = [torch.empty(max(1, cap.layer), dtype=self.dtype, device=dev) for _ in range(slots)]
        else:  # zeros: lanes no adapter holds yet meet the dense matmuls as finite values (their scale: 0)
            self._buf = torch.zeros(max(1, at), dtype=self.dtype, device=dev)
            if cap.staging:
                self._stage = torch.empty(cap.staging, dtype=self.dtype, device=dev)
        buf = self._buf if self._buf is not None else (self._slots[0] if self._slots else None)
        total = sum(self._lanes.values())
        # one device table per field, a row per pack: A's and B's offsets, ranks, scales
        self._offs = torch.zeros(2 * m, n, dtype=torch.int64, device=dev)
        self._ranks = torch.zeros(m, n, dtype=torch.int32, device=dev)
        self._scales = torch.zeros(m, n, dtype=torch.float32, device=dev)
        self._owner = torch.full((total,), -1, dtype=torch.int32, device=dev)
        self._lane_scale = torch.zeros(total, dtype=torch.float32, device=dev)
        self.packs = {}
        for i, key in enumerate(self.keys):
            fan_in, fan_out = self._fans[key]
            dense = None
            if self._buf is not None:
                (a0, b0, l0), lanes = self._regions[key], self._lanes[key]
                dense = Dense(self._buf[a0:a0 + lanes * fan_in].view(lanes, fan_in),
                              self._buf[b0:b0 + lanes * fan_out].view(lanes, fan_out),
                              self._owner[l0:l0 + lanes], self._lane_scale[l0:l0 + lanes])
            self.packs[key] = LoraPack(buf, self._offs[2 * i], self._offs[2 * i + 1], self._ranks[i], self._scales[i],
                                       fan_in, fan_out, self.max_rank, dense=dense)
        self.version += 1

    def _layout(self, lanes: Mapping[Key, int]) -> tuple[dict[Key, tuple[int, int, int]], int]:
        """Resident, for these lanes per matmul: where each matmul's A lanes and B lanes start in
        the buffer (layer by layer, the layer's A's side by side in key order, then its B's) and
        its first lane in the lane tables (key order); and the buffer's elements."""
        out: dict[Key, tuple[int, int, int]] = {}
        at = first = 0
        for j in dict.fromkeys(k[0] for k in self.keys):
            keys = [k for k in self.keys if k[0] == j and k in lanes]
            starts = []
            for k in keys:
                starts.append(at)
                at += lanes[k] * self._fans[k][0]
            for k, a0 in zip(keys, starts):
                out[k] = (a0, at, first)
                at += lanes[k] * self._fans[k][1]
                first += lanes[k]
        return out, at

    def _lane_at(self, key: Key, lane: int) -> tuple[int, int]:
        """Resident: where lane `lane` of matmul `key` has its A row and its B row in the buffer."""
        (a0, b0, _), (fan_in, fan_out) = self._regions[key], self._fans[key]
        return a0 + lane * fan_in, b0 + lane * fan_out

    def _lane_views(self, key: Key, lane: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Resident: the A (rank, in) and B transposed (rank, out) of the adapter whose lanes in
        matmul `key` begin at `lane`."""
        assert self._buf is not None
        (a0, b0), (fan_in, fan_out) = self._lane_at(key, lane), self._fans[key]
        return (self._buf[a0:a0 + rank * fan_in].view(rank, fan_in),
                self._buf[b0:b0 + rank * fan_out].view(rank, fan_out))

    def _place(self, hosts: list[HostAdapter]) -> None:
        """Resident: every adapter of the block in the cache (copied if not there already: each
        matmul's A and B onto its next free lanes); the cache is emptied first when the missing
        ones do not fit in some matmul after what it holds."""
        missing = [h for h in hosts if h.name not in self._cached]
        want: dict[Key, int] = {}
        for h in missing:
            for key, s in h.slots.items():
                want[key] = want.get(key, 0) + s.rank
        if any(self._tops.get(k, 0) + r > self._lanes.get(k, 0) for k, r in want.items()):
            self._cached, self._tops = {}, {}
            missing = hosts
            for key in {k for h in hosts for k in h.slots}:
                if sum(h.slots[key].rank for h in hosts if key in h.slots) > self._lanes.get(key, 0):
                    raise RuntimeError(f"internal: a block's adapters in {key} exceed the lanes planned for it")
        staged = self._staging(missing)
        assert self._buf is not None
        moves: list[tuple[int, int, int]] = []  # (source, destination, elements) from the staging buffer
        for h in missing:
            lanes, mine = {}, []  # each matmul's A and B: (where in the adapter, where in the cache, elements)
            for key, s in h.slots.items():
                lane = lanes[key] = self._tops.get(key, 0)
                self._tops[key] = lane + s.rank
                (a0, b0), (fan_in, fan_out) = self._lane_at(key, lane), self._fans[key]
                mine += [(s.a_off, a0, s.rank * fan_in), (s.b_off, b0, s.rank * fan_out)]
            self._cached[h.name] = lanes
            if h.name in staged:
                moves += [(staged[h.name] + src, dst, n) for src, dst, n in mine]
                continue
            flat = self.host(h.name).flat  # no staging buffer (a job of one block), or no room left in it
            for src, dst, n in mine:
                self._buf[dst:dst + n].copy_(flat[src:src + n], non_blocking=True)
        if moves:  # in one launch
            copy_runs(self._stage, self._buf, moves)

    def _staging(self, missing: list[HostAdapter]) -> dict[str, int]:
        """Resident with a staging buffer: the missing adapters in it (those staged while the block
        before ran, once their copies are done; the others copied in now, one copy each, while
        they fit), by where each begins; the staged set is then spent."""
        if self._stage is None:
            return {}
        if self._stage_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._stage_done)
            self._stage_done.synchronize()  # long done (a block ran since): the host copies may go
            self._stage_done = None
        self._stage_hosts = []
        staged, self._staged = self._staged, {}
        out = {h.name: staged[h.name] for h in missing if h.name in staged}
        top = self._stage_end(staged)
        for h in missing:
            if h.name not in out and top + h.numel <= self._stage.numel():
                self._stage[top:top + h.numel].copy_(self.host(h.name).flat, non_blocking=True)
                out[h.name], top = top, top + h.numel
        return out

    def _stage_end(self, staged: Mapping[str, int]) -> int:
        """The first element of the staging buffer after these staged adapters."""
        return max((at + self.adapters[n].numel for n, at in staged.items()), default=0)

    def _stage_next(self, names: Iterable[str | None], main: Any) -> None:
        """Resident with a staging buffer on CUDA (`main`: the stream that computes): start copying
        the next block's adapters that the cache lacks and whose host copies are at hand (made
        already, or just read) into the staging buffer after those staged before, on a copy
        stream of their own, once this block's moves out of it are done."""
        if self._stage is None or main is None:
            return
        with self._lock:
            hosts = [self._host[n] for n in dict.fromkeys(names) if n is not None and n not in self._cached
                     and n not in self._staged and n in self._host and n not in self._stale]
        if not hosts:
            return
        if self._copier is None:
            self._copier = torch.cuda.Stream(self.device)
        self._copier.wait_stream(main)
        top = self._stage_end(self._staged)
        with torch.cuda.stream(self._copier):
            for h in hosts:
                if top + h.numel > self._stage.numel():
                    break
                self._stage[top:top + h.numel].copy_(h.flat, non_blocking=True)
                self._staged[h.name], top = top, top + h.numel
                self._stage_hosts.append(h)
            self._stage_done = torch.cuda.Event()
            self._stage_done.record()

    def _own(self, hosts: list[HostAdapter]) -> None:
        """Resident: each matmul's lanes marked with the block's adapter that holds them (its index
        and scale; lanes of cached adapters the block does not use, and free ones: -1 and 0),
        one copy per table."""
        owner = np.full(self._owner.numel(), -1, dtype=np.int32)
        scale = np.zeros(self._lane_scale.numel(), dtype=np.float32)
        for a, h in enumerate(hosts):
            for key, lane in self._cached[h.name].items():
                s, at = h.slots[key], self._regions[key][2] + lane
                owner[at:at + s.rank] = a
                scale[at:at + s.rank] = s.scale
        self._owner.copy_(torch.from_numpy(owner))
        self._lane_scale.copy_(torch.from_numpy(scale))

    def _plan_pages(self, hosts: list[HostAdapter]) -> None:
        """Paged: per layer, where each adapter's segment goes in a slot and what to copy."""
        self._copies, self._page_at = {}, {}
        layers = {j for h in hosts for j in h.segments}
        for j in layers:
            at, copies, pos = 0, [], []
            for h in hosts:
                lo, hi = h.segments.get(j, (0, 0))
                pos.append(at)
                if hi > lo:
                    copies.append((h.flat[lo:hi], at, hi - lo))
                    at += hi - lo
            self._copies[j], self._page_at[j] = copies, pos

    def stage(self, j: int, slot: int, deps: list["Event"], mover: "Mover") -> list["Event"]:
        """Paged: start copying layer j's segments of the block's adapters into weight slot
        `slot` (called as the layer's weights are prefetched into it)."""
        copies = self._copies.get(j) if self.paged else None
        if not copies:
            return []
        dst = self._slots[slot]
        return [mover.copy_many([(dst[at:at + n], src) for src, at, n in copies], deps)]

    # ---- rows --------------------------------------------------------------------------------
    def ids(self, names: Sequence[str | None]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """A batch's adapter per row as block indices (-1: the base model), on the device and
        on the host."""
        host = tuple(self.index[n] if n is not None else -1 for n in names)
        return torch.tensor(host, dtype=torch.int32, device=self.device), host

    def adapt(self, j: int, w: Mapping[str, Any], ids: torch.Tensor, present: Iterable[int] | None,
              slot: int | None = None, host_ids: tuple[int, ...] | None = None) -> Mapping[str, Any]:
        """Layer j's weights, its matmuls that an adapter of the batch (`present`; None: any
        adapter of the pool) adapts wrapped; paged, the LoRA is read from weight slot `slot`.
        `host_ids`: ids on the host, where known (the reference path then never reads them back)."""
        out = None
        present = list(present) if present is not None else None
        for name in w:
            p = self.packs.get((j, name))
            if p is None or (present is not None and not any(p.ranks[a] for a in present)):
                continue
            if self.paged:
                p = replace(p, buf=self._slots[slot])
            out = out if out is not None else dict(w)
            out[name] = LoraLinear(w[name], ids, p, host_ids)
        return out if out is not None else w
