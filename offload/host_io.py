"""CPU attention's pinned buffers: how q, k, v reach the host and the output the GPU.

Knows: two sets of pinned buffers used by alternate calls (one call's copies overlap the
previous call's attention), the stream its inputs go down on, and reading the output back
through mapped host memory (or a copy where it cannot be mapped).
Does not know: attention itself, the schedule, the KV cache.
"""

from __future__ import annotations

import torch

from flexoff.models.spec import ModelSpec
from flexoff.offload.lanes import Event, Lanes
from flexoff.offload.memory import HOST_IO_SETS
from flexoff.offload.tiers import Ledger


class _DevicePointer:
    """A registered host buffer as a CUDA array: under unified addressing, registered host memory is
    mapped into the device's address space at the same address, so kernels can read it directly."""

    def __init__(self, t: torch.Tensor):
        self.host = t  # the engine's Ledger keeps the memory itself until the engine closes
        self.__cuda_array_interface__ = {"shape": (t.numel(),), "typestr": "|u1", "data": (t.data_ptr(), False),
                                         "version": 2}


class HostIO:
    """Pinned buffers through which CPU attention receives q, k, v and returns its output. Two sets,
    used by alternate calls, so one call's copies overlap the previous call's attention. Inputs go
    down on a stream of their own. The attention thread stages its output in pinned memory; once
    the call has finished, the scheduling thread has a kernel on the compute stream read it from
    the mapped host buffer. Not a copy: measured on the H200, a host-to-device copy of it, on any
    stream, waited until the weight copy in flight drained (5-15 ms), and the calls behind it with it.
    Where the buffer cannot be mapped it is copied."""

    SETS = HOST_IO_SETS

    def __init__(self, lanes: Lanes, mem: Ledger, rows: int, spec: ModelSpec, dtype: torch.dtype):
        self.cuda, self.device, self.dtype, self.lanes = lanes.cuda, mem.device, dtype, lanes
        self.free: list[list[Event]] = [[] for _ in range(self.SETS)]  # when each set may be refilled
        self.next = 0
        self.fetched = [True] * self.SETS  # whether each set's last output has been read
        self.mapped: list[torch.Tensor] | None = None  # each set's output buffer, as the device sees it
        if self.cuda:
            qn, kvn = rows * spec.num_heads * spec.head_dim, rows * spec.num_kv_heads * spec.head_dim
            raw = [[mem.alloc("cpu", n * dtype.itemsize) for n in (qn, kvn, kvn, qn)] for _ in range(self.SETS)]
            self.bufs = [[b.view(dtype) for b in bs] for bs in raw]
            self.down = torch.cuda.Stream(self.device)
            try:
                self.mapped = [torch.as_tensor(_DevicePointer(bs[3]), device=self.device) for bs in raw]
            except (RuntimeError, TypeError):  # no unified addressing (or no NumPy for the interface)
                self.mapped = None

    def take(self) -> tuple[int, list[Event]]:
        """The buffer set for the next call, and what must finish before it is refilled."""
        s = self.next
        if not self.fetched[s]:
            raise RuntimeError("internal: a CPU attention buffer set was reused before its output was read")
        self.next = (s + 1) % self.SETS
        self.fetched[s] = not self.cuda
        return s, self.free[s]

    def to_host(self, s: int, *ts: torch.Tensor) -> list[torch.Tensor]:
        if not self.cuda:
            return list(ts)
        out = []
        with torch.cuda.stream(self.down):
            for t, buf in zip(ts, self.bufs[s]):
                h = buf[:t.numel()].view(t.shape)
                h.copy_(t, non_blocking=True)
                out.append(h)
            self.down.synchronize()
        return out

    def stage(self, s: int, o: torch.Tensor) -> torch.Tensor:
        """On the attention thread: the output o in set s's pinned buffer."""
        if not self.cuda:
            return o
        h = self.bufs[s][3][:o.numel()].view(o.shape)
        h.copy_(o)
        return h

    def fetch(self, s: int, h: torch.Tensor) -> torch.Tensor:
        """On the scheduling thread, once the call has finished: set s's staged output h on the
        device, read on the compute stream; the set may be refilled once that read is done."""
        if not self.cuda:
            return h
        if self.mapped is None:
            d = h.to(self.device, non_blocking=True)
        else:
            n = h.numel() * h.element_size()
            src = self.mapped[s][:n]
            if n % 4 == 0:  # a word per thread: fewer reads across the link
                src = src.view(torch.int32)
            d = torch.add(src, 0).view(self.dtype).view(h.shape)  # a kernel reads the host buffer
        self.free[s] = self.free[s] + [self.lanes.compute.mark()]
        self.fetched[s] = True
        return d
