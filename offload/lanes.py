"""Lanes of work and the events that order them.

Knows: CUDA streams and events, worker threads and futures. A lane runs
callables in order after the events they depend on and returns an Event for
each. `Tracked` turns reads and writes of a shared buffer into dependencies.
On a CPU-only machine the copy lanes are worker threads, so the engine's
schedule really runs concurrently there too, and a missing dependency shows
up as a wrong result in CI rather than only on a GPU.
Does not know: what the work is (copies, attention), tiers, models.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import torch


class Event:
    """Completion of some work: a CUDA event, a future, or nothing (already done).

    A future may resolve to another Event (a thread that enqueued GPU work) or
    to any other value (treated as done).
    """

    __slots__ = ("cuda", "fut", "stream")

    def __init__(self, cuda: "torch.cuda.Event | None" = None, fut: Future | None = None,
                 stream: "torch.cuda.Stream | None" = None):
        self.cuda = cuda
        self.fut = fut
        self.stream = stream  # the stream `cuda` was recorded on, where a lane knows it

    @property
    def host_pending(self) -> bool:
        """True while waiting for it would block the host on a thread."""
        return self.fut is not None and not self.fut.done()

    def resolve(self) -> "Event":
        """The innermost event; blocks the host on futures (and re-raises their errors)."""
        ev = self
        while ev.fut is not None:
            inner = ev.fut.result()
            ev = inner if isinstance(inner, Event) else DONE
        return ev

    def result(self) -> Any:
        """The value of a future-backed event (None otherwise)."""
        return self.fut.result() if self.fut is not None else None

    def wait_host(self) -> None:
        ev = self.resolve()
        if ev.cuda is not None:
            ev.cuda.synchronize()

    def wait_stream(self, stream: "torch.cuda.Stream") -> None:
        """Make `stream` wait for this event; nothing where it was recorded on that very stream
        (the stream's own order already puts it first)."""
        ev = self.resolve()
        if ev.cuda is not None and ev.stream is not stream:
            stream.wait_event(ev.cuda)


DONE = Event()
LANE_MARK = "flexoff lane: "
_marked = False  # whether lanes name their tasks for a profiler


def mark_lanes(on: bool) -> None:
    """Name each lane's tasks in profiler traces (benchmarks/timeline.py); off by default."""
    global _marked
    _marked = on


class ThreadLane:
    """Runs callables one at a time on its own worker thread, each after its dependencies."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"flexoff-{name}")
        self._mark = f"{LANE_MARK}{name}"  # names the lane's work in profiler traces
        self.last = DONE

    def run(self, fn: Callable[[], Any], deps: Iterable[Event] = ()) -> Event:
        deps = list(deps)

        def task() -> Any:
            for d in deps:
                d.wait_host()
            # inference mode is per thread: the lane may write into the block's tensors, which
            # the scheduling thread made under it (it changes nothing for other tensors)
            with torch.inference_mode():
                if not _marked:
                    return fn()
                with torch.profiler.record_function(self._mark):
                    return fn()

        self.last = Event(fut=self._pool.submit(task))
        return self.last

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamLane:
    """Enqueues callables on a CUDA stream from the calling thread.

    Dependencies are waited for on the stream, not on the host; if one is a
    future still running on a thread, the enqueue is handed to a helper thread
    so the caller never blocks.
    """

    def __init__(self, name: str, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self._device = self.stream.device  # for the current stream a task's thread restores
        self._helper = ThreadLane(f"{name}-helper")
        self.last = DONE

    def run(self, fn: Callable[[], Any], deps: Iterable[Event] = ()) -> Event:
        deps = list(deps)
        if any(d.host_pending for d in deps):
            self.last = self._helper.run(lambda: self.enqueue(fn, deps))
        else:
            self.last = self.enqueue(fn, deps)
        return self.last

    def enqueue(self, fn: Callable[[], Any], deps: Iterable[Event] = ()) -> Event:
        """Run fn with the lane's stream current, after deps; its event is what fn returns where
        that is a CUDA event recorded last on the stream (a copy's timing mark), else a new one."""
        stream = self.stream
        prev = torch.cuda.current_stream(self._device)
        torch.cuda.set_stream(stream)
        try:
            for d in _distinct(deps):
                d.wait_stream(stream)
            ev = fn()
            if not isinstance(ev, torch.cuda.Event):
                ev = torch.cuda.Event()
                ev.record(stream)
        finally:
            torch.cuda.set_stream(prev)
        return Event(cuda=ev, stream=stream)

    def close(self) -> None:
        self._helper.close()


class ComputeLane:
    """The calling thread and the device's current stream: where model math runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.blocked_s = 0.0  # seconds the calling thread waited here for work still on a thread (CUDA)

    def wait(self, deps: Iterable[Event]) -> None:
        for d in _distinct(deps):
            if self.cuda:
                if d.host_pending:  # the stream can wait only once the thread has enqueued it
                    t0 = time.perf_counter()
                    d.resolve()
                    self.blocked_s += time.perf_counter() - t0
                d.wait_stream(self.stream)
            else:
                d.wait_host()

    def mark(self) -> Event:
        """An event for all compute issued so far."""
        if not self.cuda:
            return DONE
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return Event(cuda=ev, stream=self.stream)


def _distinct(deps: Iterable[Event]) -> list[Event]:
    """deps without repeats (a buffer's reads and writes often name the same event) and without
    DONE."""
    out, seen = [], set()
    for d in deps:
        if d is not DONE and id(d) not in seen:
            seen.add(id(d))
            out.append(d)
    return out


class Lanes:
    """All lanes of one engine: compute, load (toward compute), weights (layers' weights toward
    compute: on CUDA a stream of its own unless copies are paced, so a weight copy waiting for its
    slot's last reader does not hold up the KV cache and activations queued behind it), fetch
    (toward compute too, for a training window's stashed inputs: never queued behind a weight
    copy), store (away from it), disk read, disk write, CPU attention and a lane for its inputs
    (its thread sends its output), and (CUDA, `pace`) the feed that paces large copies onto the
    load stream."""

    def __init__(self, device: torch.device, pace: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.compute = ComputeLane(device)
        self.load: StreamLane | ThreadLane = StreamLane("load", device) if self.cuda else ThreadLane("load")
        self.store: StreamLane | ThreadLane = StreamLane("store", device) if self.cuda else ThreadLane("store")
        self.fetch: StreamLane | ThreadLane = StreamLane("fetch", device) if self.cuda else self.load
        own = self.cuda and not pace and os.environ.get("FLEXOFF_WEIGHTS_STREAM") != "0"  # 0: as before, on load
        self.weights: StreamLane | ThreadLane = StreamLane("weights", device) if own else self.load
        self.disk_read = ThreadLane("disk-read")
        self.disk_write = ThreadLane("disk-write")
        self.cpu = ThreadLane("cpu-attention")
        self.cpu_down = ThreadLane("cpu-attention-in")  # q, k, v to the host for CPU attention
        # paces large host-to-device copies onto the load stream (see Mover); CUDA only
        self.feed: ThreadLane | None = ThreadLane("feed") if self.cuda and pace else None

    def to_host(self, *ts: torch.Tensor) -> list[torch.Tensor]:
        """Host copies of device tensors, made on the store stream; for worker threads (whose
        default stream is the compute stream). Blocks the calling thread until done."""
        if not self.cuda:
            return list(ts)
        with torch.cuda.stream(self.store.stream):
            out = [t.to("cpu") for t in ts]
        return out

    def _all(self) -> list:
        """Every lane once (fetch and weights may be the load lane; feed may be absent)."""
        named = [self.load, self.store, self.disk_read, self.disk_write, self.cpu_down, self.cpu, self.feed,
                 self.fetch, self.weights]
        return list({id(lane): lane for lane in named if lane is not None}.values())

    def sync(self) -> None:
        """Wait for everything issued so far (used at block edges and with overlap off)."""
        for lane in self._all():
            lane.last.wait_host()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        for lane in self._all():
            lane.close()


class Tracked:
    """Ordering for a buffer shared between lanes.

    A reader waits for the writes of the current epoch; a writer that starts a
    new epoch (`claim`) waits for those writes and every read since. Writers of
    one epoch may run in parallel on disjoint parts of the buffer.
    """

    __slots__ = ("writes", "reads", "tag")

    def __init__(self) -> None:
        self.writes: list[Event] = []
        self.reads: list[Event] = []
        self.tag: Any = None  # what the buffer holds now (guards against reading stale data)

    def read_deps(self) -> list[Event]:
        return list(self.writes)

    def claim(self) -> list[Event]:
        """Start a new epoch of writes; returns what the writers must wait for."""
        deps = self.writes + self.reads
        self.writes, self.reads = [], []
        return deps

    def wrote(self, ev: Event) -> None:
        if ev is not DONE:
            self.writes.append(ev)

    def was_read(self, ev: Event) -> None:
        if ev is not DONE:
            self.reads.append(ev)
