"""One writer per output: an exclusive lock held for the life of a job.

Knows: advisory locks (flock) on a small file beside what is written (`.NAME.lock` next to an
output file, `.lock` inside an output folder) holding the holder's pid, taken without waiting:
a second job on the same output is refused at once with the holder named. The kernel drops the
lock when its process dies, so a killed job never blocks its rerun; the lock file itself is
removed when a job ends normally.
Does not know: what is written.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from flexoff.errors import InputError


def lock_path(target: str) -> Path:
    p = Path(target)
    return p / ".lock" if p.is_dir() else p.with_name(f".{p.name}.lock")


class OutputLock:
    """`with OutputLock(path):` holds path's lock (nothing for '-', standard output)."""

    def __init__(self, target: str):
        self.target, self.fd = target, -1

    def __enter__(self) -> "OutputLock":
        if self.target == "-":
            return self
        path = lock_path(self.target)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise InputError(f"{self.target} is being written by another flexoff job (pid {holder}); "
                                 "wait for it to finish or choose another output") from None
            try:  # the file a job that just ended removed is no lock: take the one at the path now
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd < 0:
            return
        try:
            os.unlink(lock_path(self.target))
        except OSError:
            pass
        os.close(self.fd)  # releases the lock
        self.fd = -1
