"""Memory tiers: the compute device ("gpu"), host memory ("cpu") and disk.

Knows: allocating and freeing byte buffers on each tier, pinning host memory
that crosses the PCIe link, byte budgets and peak accounting, and the private
offload folder (created 0700, files 0600, removed at exit, on errors and on
Ctrl-C). Tiers know nothing of attention or MLPs.
Does not know: what the bytes mean, or when they move (see mover and engine).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from flexoff.errors import MemoryBudgetError

GiB = 1 << 30
PAGE = 4096


class MemTier:
    """Byte buffers in GPU or host memory, with accounting.

    Pinned host buffers are expensive to make (every page is touched and locked), so freed ones
    wait in a pool for the next engine: a request reuses a pooled buffer of about its size, and a
    request that none fits empties the pool first, so the pool never adds to the peak."""

    REUSE = 1.25  # a pooled buffer serves requests down to 1 / REUSE of its size

    def __init__(self, name: str, device: torch.device, pin: bool = False):
        self.name, self.device, self.pin = name, device, pin
        self.used = 0
        self.peak = 0
        self._pinned: dict[int, torch.Tensor] = {}  # registered host buffers in use, by address
        self._pool: list[torch.Tensor] = []  # registered host buffers free for reuse

    @property
    def pooled(self) -> int:
        return sum(t.numel() for t in self._pool)

    def alloc(self, nbytes: int) -> torch.Tensor:
        if self.pin and nbytes > 0:
            t = self._reuse(nbytes)
            if t is None:
                self.trim()
                t = _registered(nbytes)
            self._pinned[t.data_ptr()] = t
            t = t[:nbytes]
        else:
            t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return t

    def _reuse(self, nbytes: int) -> torch.Tensor | None:
        fits = [t for t in self._pool if nbytes <= t.numel() <= nbytes * self.REUSE]
        if not fits:
            return None
        best = min(fits, key=lambda t: t.numel())
        del self._pool[next(i for i, t in enumerate(self._pool) if t is best)]  # by identity
        return best

    def free(self, t: torch.Tensor, nbytes: int) -> None:
        """Give a buffer back (the caller drops its last reference); pinned ones are pooled."""
        pinned = self._pinned.pop(t.data_ptr(), None)
        if pinned is not None:
            self._pool.append(pinned)
        self.used -= nbytes

    def trim(self) -> None:
        """Unpin and release the pooled buffers."""
        for t in self._pool:
            _host_unregister(t)
        self._pool.clear()

    def close(self) -> None:
        """Unpin everything (before the memory goes back to the allocator, which may reuse it)."""
        self.trim()
        for t in self._pinned.values():
            _host_unregister(t)
        self._pinned.clear()


def pinned_empty(numel: int, dtype: torch.dtype, owner: object) -> torch.Tensor:
    """Page-locked host memory of exactly this size (torch's pinned allocator rounds a request up
    to a power of two: 70 adapters of 347 MB took 36 GB), unpinned when `owner` is collected."""
    t = _registered(max(1, numel) * dtype.itemsize)
    weakref.finalize(owner, _host_unregister, t)
    return t.view(dtype)[:numel]


class PinnedArena:
    """Page-locked host memory for a cache whose entries come and go (the adapter pool's host
    copies of adapters read from files), pinned once: pinning touches and locks every page, and
    pinning and unpinning each adapter as it was read and dropped took about as long as reading
    it, beside the blocks' kernel launches. Entries take runs of one region (next fit: the
    search starts where the last run taken ends, so entries that come and go in order, as a
    job's blocks' adapters do, use it as a ring, and a region of what is live at once and one
    entry more always fits them; freed runs merged with their neighbours); where no run fits,
    the cache may drop entries and try again, or have the entry pinned on its own (counted in
    `pinned`; so is any entry before reserve()). A freed run waits for its fence (a CUDA event
    recorded after the last work that could copy out of it) before it is written again."""

    ALIGN = 256  # bytes: where runs begin

    def __init__(self) -> None:
        self.region: _Region | None = None
        self.pinned = self.taken = 0  # entries pinned on their own, and given runs of the region

    def reserve(self, nbytes: int) -> None:
        """A region of at least nbytes (a smaller one is left to the entries still in it)."""
        if nbytes > 0 and (self.region is None or self.region.nbytes < nbytes):
            self.region = _Region(nbytes)

    def take(self, numel: int, dtype: torch.dtype, owner: object, alone: bool = True
             ) -> tuple[torch.Tensor, Any] | None:
        """`numel` elements of pinned memory for `owner`, and the lease to hand back to give()
        (None: pinned on its own, unpinned when the owner is collected); where no run of the
        region fits: pinned on its own, or (`alone` off) None."""
        nbytes = max(1, numel) * dtype.itemsize
        got = self.region.take(nbytes) if self.region is not None else None
        if got is None:
            if not alone and self.region is not None:
                return None
            return self.alone(numel, dtype, owner)
        self.taken += 1
        t, lease = got
        return t.view(dtype)[:numel], lease

    def alone(self, numel: int, dtype: torch.dtype, owner: object) -> tuple[torch.Tensor, None]:
        """`numel` elements pinned on their own for `owner` (unpinned when it is collected)."""
        self.pinned += 1
        return pinned_empty(numel, dtype, owner), None

    @staticmethod
    def give(lease: Any, fence: Any = None) -> None:
        """Hand a run back; `fence`: (its number, a CUDA event), numbered in the order recorded."""
        if lease is not None:
            lease[0].give(lease[1], lease[2], fence)


class _Region:
    """One pinned buffer and its free runs [(start, bytes, fence)], by start."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.buf = _registered(nbytes)
        weakref.finalize(self, _host_unregister, self.buf)
        self.free: list[tuple[int, int, Any]] = [(0, nbytes, None)]
        self.cursor = 0  # where the last run taken ends: the next search starts there
        self.lock = threading.Lock()  # readers take runs from several threads

    def take(self, nbytes: int) -> tuple[torch.Tensor, tuple["_Region", int, int]] | None:
        size = -(-nbytes // PinnedArena.ALIGN) * PinnedArena.ALIGN
        with self.lock:
            free = self.free
            k = next((i for i, (a, _, _) in enumerate(free) if a >= self.cursor), len(free))
            i = next((i for i in itertools.chain(range(k, len(free)), range(k)) if free[i][1] >= size), None)
            if i is None:
                return None
            at, n, fence = free[i]
            if n > size:
                free[i] = (at + size, n - size, fence)
            else:
                del free[i]
            self.cursor = at + size
        if fence is not None:
            fence[1].synchronize()  # copies out of it, queued before it was freed, are done
        return self.buf[at:at + nbytes], (self, at, size)

    def give(self, at: int, size: int, fence: Any) -> None:
        with self.lock:
            free = self.free
            i = next((i for i, (a, _, _) in enumerate(free) if a > at), len(free))
            free.insert(i, (at, size, fence))
            for k in (i, i - 1):  # merge with the next run, then the previous one with this
                if 0 <= k < len(free) - 1 and free[k][0] + free[k][1] == free[k + 1][0]:
                    (a, n, f), (_, m, g) = free[k], free[k + 1]
                    free[k:k + 2] = [(a, n + m, _later(f, g))]


def _later(f: Any, g: Any) -> Any:
    """The later of two fences (None: nothing to wait for)."""
    return f if g is None or (f is not None and f[0] >= g[0]) else g


def _registered(nbytes: int) -> torch.Tensor:
    """nbytes of page-aligned host memory, pinned in place."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % PAGE
    t = raw[off:off + nbytes]
    _host_register(t)
    return t


def _host_register(t: torch.Tensor) -> None:
    """Pin existing host memory (no power-of-two rounding, unlike torch's pinned allocator)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise MemoryBudgetError(f"could not pin {t.numel() / GiB:.2f} GiB of host memory (CUDA error {code}); "
                                "lower --cpu-mem or the batch size")


def _host_unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class DiskFile:
    """One buffer on disk: a file read and written at byte offsets (GIL released)."""

    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, nbytes)

    def read_into(self, offset: int, dst: torch.Tensor) -> None:
        """Fill the CPU uint8 tensor dst with bytes [offset, offset + dst.numel())."""
        view, done = memoryview(dst.numpy()), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read from offload file {self.path}")
            done += n

    def write_from(self, offset: int, src: torch.Tensor) -> None:
        view, done = memoryview(src.numpy()), 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DiskTier:
    """Files in a private folder under `root` (or the system temp folder)."""

    def __init__(self, root: str | None = None):
        if root is not None:
            os.makedirs(root, exist_ok=True)
        remove_stale(root or tempfile.gettempdir())
        self.dir = tempfile.mkdtemp(prefix=PREFIX, dir=root)  # created 0700
        fd = os.open(os.path.join(self.dir, OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"{os.getpid()}\n".encode())  # whose it is, for remove_stale
        os.close(fd)
        self.name = "disk"
        self.used = 0
        self.peak = 0
        self._count = 0
        self._files: list[DiskFile] = []
        # runs on close(), on garbage collection and at interpreter exit
        self._finalizer = weakref.finalize(self, _remove_dir, self.dir, self._files)

    def alloc(self, nbytes: int) -> DiskFile:
        self._count += 1
        f = DiskFile(os.path.join(self.dir, f"buf{self._count}.bin"), nbytes)
        self._files.append(f)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return f

    def free(self, f: DiskFile, nbytes: int) -> None:
        f.close()
        os.unlink(f.path)
        self._files.remove(f)
        self.used -= nbytes

    def close(self) -> None:
        self._finalizer()


PREFIX, OWNER = "flexoff-", "owner.pid"


def remove_stale(root: str) -> None:
    """Remove the offload folders under root that processes now dead left behind (killed with
    SIGKILL, or by a crash of the machine): ours (same user) with an owner pid no longer running."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for e in entries:
        if not e.name.startswith(PREFIX) or not e.is_dir(follow_symlinks=False):
            continue
        try:
            if e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            pid = int(open(os.path.join(e.path, OWNER)).read().strip())
        except (OSError, ValueError):
            continue  # not one of ours, or being set up right now
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(e.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dir(path: str, files: list[DiskFile]) -> None:
    for f in files:
        f.close()
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Budgets:
    """Bytes each tier may hold; None means what the machine has."""

    gpu: int | None = None
    cpu: int | None = None
    disk: int | None = None


class Tiers:
    """The three tiers of one engine. On a CPU-only machine "gpu" is host memory too."""

    def __init__(self, device: torch.device, offload_dir: str | None = None):
        self.device = device
        self.gpu = MemTier("gpu", device)
        self.cpu = MemTier("cpu", torch.device("cpu"), pin=device.type == "cuda")
        self._offload_dir = offload_dir
        self._disk: DiskTier | None = None

    @property
    def disk(self) -> DiskTier:
        if self._disk is None:  # the folder exists only while something lives on disk
            self._disk = DiskTier(self._offload_dir)
        return self._disk

    def get(self, name: str):
        return self.disk if name == "disk" else {"gpu": self.gpu, "cpu": self.cpu}[name]  # disk only if asked

    def alloc(self, tier: str, nbytes: int):
        return self.get(tier).alloc(nbytes)

    def free(self, tier: str, buf, nbytes: int) -> None:
        self.get(tier).free(buf, nbytes)

    def used(self) -> dict[str, int]:
        return {"gpu": self.gpu.used, "cpu": self.cpu.used, "disk": self._disk.used if self._disk else 0}

    def peaks(self) -> dict[str, int]:
        return {"gpu": self.gpu.peak, "cpu": self.cpu.peak, "disk": self._disk.peak if self._disk else 0}

    def close(self) -> None:
        self.cpu.close()
        if self._disk is not None:
            self._disk.close()


class Ledger:
    """The buffers one owner (an engine, a weight store) took from the tiers, so it can give
    them all back; tiers outlive engines, so weights can stay resident between jobs."""

    def __init__(self, tiers: Tiers):
        self.tiers = tiers
        self.device = tiers.device
        self._items: list[tuple[str, object, int]] = []

    def alloc(self, tier: str, nbytes: int):
        buf = self.tiers.alloc(tier, nbytes)
        self._items.append((tier, buf, nbytes))
        return buf

    def free(self, buf: object) -> None:
        for n, (tier, b, nbytes) in enumerate(self._items):
            if b is buf:
                del self._items[n]
                self.tiers.free(tier, b, nbytes)
                return
        raise AssertionError("buffer not in this ledger")

    def release(self) -> None:
        while self._items:
            tier, buf, nbytes = self._items.pop()
            self.tiers.free(tier, buf, nbytes)

    def held(self) -> dict[str, int]:
        out = {"gpu": 0, "cpu": 0, "disk": 0}
        for tier, _, nbytes in self._items:
            out[tier] += nbytes
        return out
