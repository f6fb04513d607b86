"""A task call's pipes: our ends, closed exactly once; its output, bounded.

A call's thread owns three pipes (the task's stdin, stdout, stderr). Its
arguments are written without ever blocking (what the pipe cannot take now
is written as the task reads), and its output is read to the end -- kept up
to a limit, the rest read and dropped so that the task never blocks on a
full pipe.
"""

from __future__ import annotations

import os
import select
import time


class Sink:
    """Output of one pipe: the first ``limit`` bytes, or the last ones (``keep_tail``)."""

    __slots__ = ("data", "keep_tail", "limit", "total", "truncated")

    def __init__(self, limit: int, *, keep_tail: bool) -> None:
        self.data = bytearray()
        self.limit = limit
        self.keep_tail = keep_tail
        self.total = 0
        self.truncated = False

    def read(self, fd: int) -> bool:
        """Take what the pipe has; False at end of file."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        self.total += len(chunk)
        if self.keep_tail:
            self.data += chunk
            if len(self.data) > self.limit:
                del self.data[: len(self.data) - self.limit]
                self.truncated = True
        else:
            room = self.limit - len(self.data)
            if len(chunk) > room:
                self.truncated = True
            # Past the limit the task's output is read and dropped, so that it
            # never blocks on a full pipe.
            self.data += chunk[: max(0, room)]
        return True


class Pipes:
    """The call's pipe ends, each closed exactly once (early, or at the end)."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def make(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        self.fds += [r, w]
        return r, w

    def close(self, fd: int) -> None:
        if fd in self.fds:
            self.fds.remove(fd)
            os.close(fd)

    def close_all(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def write_some(fd: int, data: bytes | memoryview) -> int:
    """Write what a non-blocking ``fd`` takes now; how many bytes (0 if none)."""
    if not data:
        return 0
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


def drain(readers: dict[int, Sink], deadline: float) -> None:
    """Read the pipes to their end once the tree is stopped (its writers are gone);
    bounded, since a survivor could keep one open."""
    poller = select.poll()
    for fd in readers:
        poller.register(fd, select.POLLIN)
    left_fds = dict(readers)
    while left_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for fd, _ev in poller.poll(left * 1000):
            if fd in left_fds and not left_fds[fd].read(fd):
                poller.unregister(fd)
                del left_fds[fd]
