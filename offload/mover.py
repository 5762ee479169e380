"""Moving bytes between tiers on the right lane.

Knows: how a byte range gets from one buffer to another: device and host
memory through `copy_` on the load or store lane (CUDA streams on a GPU), disk
through its own worker threads and two pinned bounce buffers per direction, in
chunks, so a disk read overlaps the host-to-device copy of the chunk before it.
Every copy returns an Event. Device memory a copy reads on another stream stays alive until the
copy is done: stored compute outputs held here (up to a byte budget), the rest by the CUDA
allocator (`record_stream`).
Does not know: what the bytes are or why they move.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Literal

import torch

from flexoff.offload.lanes import DONE, Event, Lanes
from flexoff.offload.tiers import DiskFile, Ledger

CHUNK = 32 << 20  # bytes per disk transfer chunk
SPILLING = 2  # disk writes of transient tensors that may wait at once (Mover.copy)
LINK_CHUNK = 32 << 20  # bytes per host-device copy call
IN_FLIGHT = 2  # paced copies keep this many chunks queued on the link


def holds_stores() -> bool:
    """Whether device-to-host stores of compute outputs keep their source alive in the mover
    until copied (bounded by the memory plan's in-flight bytes; the host waits for the oldest
    beyond that) instead of handing it to the CUDA allocator with `record_stream`: a block freed
    so is reusable only once the allocator sees the copy done, and at the memory cap the
    allocator synchronized the device and released its whole cache to find room (each a
    "retry"). `FLEXOFF_HOLD_STORES=0` hands them to the allocator, as before."""
    return os.environ.get("FLEXOFF_HOLD_STORES", "1") != "0"


@dataclass(frozen=True)
class Span:
    """A byte range of a buffer: a uint8 tensor (any device) or a disk file."""

    buf: "torch.Tensor | DiskFile"
    offset: int
    nbytes: int

    @property
    def on_disk(self) -> bool:
        return isinstance(self.buf, DiskFile)

    def mem(self) -> torch.Tensor:
        return self.buf[self.offset:self.offset + self.nbytes]


def span_of(t: torch.Tensor) -> Span:
    """The bytes of a contiguous tensor."""
    assert t.is_contiguous()
    u8 = t.reshape(-1).view(torch.uint8)
    return Span(u8, 0, u8.numel())


class Mover:
    """Copies byte spans between tiers; one per engine."""

    def __init__(self, lanes: Lanes, mem: Ledger, chunk: int = CHUNK, hold_bytes: int = 0):
        """`hold_bytes`: device bytes of stored compute outputs kept alive here until copied (0:
        none, every source goes to the allocator with record_stream); see holds_stores."""
        self.lanes, self.mem, self.chunk = lanes, mem, chunk
        self.hold_bytes = hold_bytes
        self._held: deque[tuple[torch.Tensor, torch.cuda.Event, int]] = deque()  # (output, copied, bytes), oldest first
        self._held_n = 0  # bytes in _held
        self._held_lock = threading.Lock()  # a store lane may run copies on its helper thread
        self.hold_waits, self.hold_wait_s = 0, 0.0  # the host waited for the oldest held store
        self.traffic: dict[str, int] = {k: 0 for k in ("h2d", "d2h", "d2d", "host", "disk_read", "disk_write")}
        self._bounce: dict[str, list[torch.Tensor]] = {}  # pinned, allocated on first disk use
        self._bounce_ev: dict[str, list] = {"read": [None, None], "write": [None, None]}
        self.link_s = 0.0  # seconds the link spent on host-to-device copies (CUDA), once measured
        self.disk_read_s = 0.0  # seconds the disk-read thread spent reading files
        self._timed: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._ref: torch.cuda.Event | None = None  # the first timed copy's start
        self._busy_to = 0.0  # ms after _ref up to which the link's busy time is counted
        self._spilling: deque[Event] = deque()  # disk writes of transient tensors, oldest first

    def copy(self, dst: Span, src: Span, deps: Iterable[Event] = (),
             lane: Literal["load", "weights", "fetch", "store"] = "load", transient: bool = False) -> Event:
        """Copy src's bytes to dst after `deps`. `transient`: src is a compute output that lives
        only until copied (held here until then, where hold_bytes allows); a disk write of one is
        started only while fewer than SPILLING others are unwritten (the host waits), so a disk
        slower than compute does not pile them up in device memory (the memory plan counts two
        layer-batches of them)."""
        assert dst.nbytes == src.nbytes, (dst.nbytes, src.nbytes)
        assert not (dst.on_disk and src.on_disk)
        if src.nbytes == 0:
            return DONE
        self._count(dst, src)
        if src.on_disk:
            return self.lanes.disk_read.run(lambda: self._read(dst, src), deps)
        if dst.on_disk:
            ev = self.lanes.disk_write.run(lambda: self._write(dst, src), deps)
            if transient:
                while len(self._spilling) >= SPILLING:
                    self._spilling.popleft().wait_host()
                self._spilling.append(ev)
            return ev

        deps = list(deps)
        if lane in ("load", "weights") and self.lanes.feed is not None and dst.buf.is_cuda and not src.buf.is_cuda \
                and src.nbytes > IN_FLIGHT * LINK_CHUNK and not any(d.host_pending for d in deps):
            return self.lanes.feed.run(lambda: self._paced(dst, src, deps))

        runner = getattr(self.lanes, lane)  # the lane of that name
        stream = getattr(runner, "stream", None)

        def fn() -> torch.cuda.Event | None:
            """The copy; on CUDA, a host-to-device copy returns its timing mark at the end, which
            the lane keeps as the copy's event."""
            d, s = dst.mem(), src.mem()
            start = self._mark(stream) if stream is not None and d.is_cuda and not s.is_cuda else None
            if d.numel() <= LINK_CHUNK:
                d.copy_(s, non_blocking=True)
            else:
                for off in range(0, d.numel(), LINK_CHUNK):
                    d[off:off + LINK_CHUNK].copy_(s[off:off + LINK_CHUNK], non_blocking=True)
            if stream is not None:  # keep transient device tensors alive for this stream
                held = transient and self.hold_bytes > 0 and s.is_cuda and not d.is_cuda
                for t in (d, s):
                    if t.is_cuda and not (held and t is s):
                        t.record_stream(stream)
                if held:
                    copied = torch.cuda.Event()
                    copied.record(stream)
                    self._hold(s, copied)
            if start is None:
                return None
            end = self._mark(stream)
            self._timed.append((start, end))
            return end

        return runner.run(fn, deps)

    def compute_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src now, on the compute lane: contiguous tensors on the compute device that only
        compute uses (no other stream reads src, so its memory needs no record of this use)."""
        self._count(span_of(dst), span_of(src))
        with torch.cuda.stream(self.lanes.compute.stream):  # None (no CUDA): the current thread
            dst.copy_(src)

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], deps: Iterable[Event] = ()) -> Event:
        """Many small memory-to-memory copies (dst, src tensors of equal size) in one task on the
        weights lane: a layer's LoRA pages, one per adapter, beside the layer's weights."""
        for d, s in pairs:
            self._count(span_of(d), span_of(s))

        def fn() -> None:
            for d, s in pairs:  # into buffers that live as long as the pool: nothing to record
                d.copy_(s, non_blocking=True)

        return self.lanes.weights.run(fn, deps)

    def _paced(self, dst: Span, src: Span, deps: Iterable[Event]) -> Event:
        """A large host-to-device copy enqueued chunk by chunk, never more than IN_FLIGHT chunks
        ahead of the link (on the feed thread), so the small copies CPU attention makes on streams
        of its own are not queued behind whole layers of weights (measured on the H200: 9.4 ms of
        copies per call with two layers queued, 5.9 ms paced)."""
        stream = self.lanes.load.stream
        d, s = dst.mem(), src.mem()
        queued: deque[torch.cuda.Event] = deque()
        with torch.cuda.stream(stream):
            for dep in deps:
                dep.wait_stream(stream)
            start = self._mark(stream)
            for off in range(0, d.numel(), LINK_CHUNK):
                if len(queued) >= IN_FLIGHT:
                    queued.popleft().synchronize()
                d[off:off + LINK_CHUNK].copy_(s[off:off + LINK_CHUNK], non_blocking=True)
                queued.append(self._mark(stream, blocking=True))
            d.record_stream(stream)
        self._timed.append((start, queued[-1]))
        return Event(cuda=queued[-1], stream=stream)

    def _hold(self, t: torch.Tensor, copied: torch.cuda.Event) -> None:
        """Keep a stored output's memory until `copied`: drop those whose copy is done, then
        wait on the host for the oldest while more than hold_bytes are held."""
        with self._held_lock:
            n = t.numel() * t.element_size()
            self._held.append((t, copied, n))
            self._held_n += n
            self._drop_done()
            while self._held_n > self.hold_bytes and len(self._held) > 1:
                t0 = time.perf_counter()
                self._held[0][1].synchronize()
                self.hold_wait_s += time.perf_counter() - t0
                self.hold_waits += 1
                self._drop_done()

    def _drop_done(self) -> None:
        """Forget held outputs whose copies are done (a stream's copies end in order)."""
        while self._held and self._held[0][1].query():
            self._held_n -= self._held.popleft()[2]

    def settle(self) -> None:
        """After a device synchronization: every held output's copy is done; forget them."""
        with self._held_lock:
            self._drop_done()

    @staticmethod
    def _mark(stream: torch.cuda.Stream | None = None, blocking: bool = False) -> torch.cuda.Event:
        """A timing event recorded on `stream` (the current stream if None)."""
        ev = torch.cuda.Event(enable_timing=True, blocking=blocking)
        ev.record(stream)
        return ev

    def link_seconds(self) -> float:
        """Seconds host-to-device copies have kept the link busy so far (copies still in flight
        are counted once they end; time when copies of two streams overlap, once). Zero without
        CUDA."""
        done = []
        while self._timed and self._timed[0][1].query():  # in the order they were queued
            done.append(self._timed.popleft())
        if done and self._ref is None:
            self._ref = done[0][0]
        ref = self._ref
        for a, b in sorted((ref.elapsed_time(start), ref.elapsed_time(end)) for start, end in done):
            self.link_s += max(0.0, b - max(a, self._busy_to)) / 1e3
            self._busy_to = max(self._busy_to, b)
        return self.link_s

    def _count(self, dst: Span, src: Span) -> None:
        """Bytes by path; disk traffic to or from the GPU also crosses the PCIe link."""
        if src.on_disk:
            self.traffic["disk_read"] += src.nbytes
            if dst.buf.is_cuda:
                self.traffic["h2d"] += src.nbytes
        elif dst.on_disk:
            self.traffic["disk_write"] += src.nbytes
            if src.buf.is_cuda:
                self.traffic["d2h"] += src.nbytes
        else:
            key = {(False, True): "h2d", (True, False): "d2h", (True, True): "d2d"}.get(
                (src.buf.is_cuda, dst.buf.is_cuda), "host")
            self.traffic[key] += src.nbytes

    def _buffers(self, which: str) -> list[torch.Tensor]:
        if which not in self._bounce:
            self._bounce[which] = [self.mem.alloc("cpu", self.chunk) for _ in range(2)]
        return self._bounce[which]

    def _read(self, dst: Span, src: Span) -> Event | None:
        """Disk -> memory, on the disk-read thread (timed: disk_read_s)."""
        t0 = time.perf_counter()
        try:
            return self._read_spans(dst, src)
        finally:
            self.disk_read_s += time.perf_counter() - t0

    def _read_spans(self, dst: Span, src: Span) -> Event | None:
        m = dst.mem()
        if not m.is_cuda:
            src.buf.read_into(src.offset, m)
            return None
        stream, bounce, evs = self.lanes.load.stream, self._buffers("read"), self._bounce_ev["read"]
        m.record_stream(stream)
        ev = None
        for n, off in enumerate(range(0, src.nbytes, self.chunk)):
            i, size = n % 2, min(self.chunk, src.nbytes - off)
            if evs[i] is not None:
                evs[i].synchronize()  # the bounce buffer's previous copy has left it
            b = bounce[i][:size]
            src.buf.read_into(src.offset + off, b)
            with torch.cuda.stream(stream):
                m[off:off + size].copy_(b, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            evs[i] = ev
        return Event(cuda=ev)

    def _write(self, dst: Span, src: Span) -> None:
        """Memory -> disk, on the disk-write thread."""
        m = src.mem()
        if not m.is_cuda:
            dst.buf.write_from(dst.offset, m)
            return
        stream, bounce = self.lanes.store.stream, self._buffers("write")
        m.record_stream(stream)
        offs = list(range(0, src.nbytes, self.chunk))

        def start(n: int) -> torch.cuda.Event:
            off = offs[n]
            size = min(self.chunk, src.nbytes - off)
            with torch.cuda.stream(stream):
                bounce[n % 2][:size].copy_(m[off:off + size], non_blocking=True)
                e = torch.cuda.Event()
                e.record(stream)
            return e

        pending = start(0)
        for n, off in enumerate(offs):
            nxt = start(n + 1) if n + 1 < len(offs) else None
            pending.synchronize()
            size = min(self.chunk, src.nbytes - off)
            dst.buf.write_from(dst.offset + off, bounce[n % 2][:size])
            pending = nxt
