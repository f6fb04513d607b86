"""A unit's log file: written by the stack, rotated by size, read (and followed) by anyone.

Each line is stamped and tagged with where it came from::

    2026-12-01T17:05:03.123Z out | listening on :8080
    2026-12-01T17:05:03.124Z err | warning: no GPU visible
    2026-12-01T17:05:03.120Z --- | api: start (pid 4250), stack demo run by hold up pid 4242

The time is UTC with milliseconds (it sorts as text, so logs merge by a string
compare), then the stream: ``out`` (stdout), ``err`` (stderr) or ``---`` (a
line of the stack's own: a run of the stack begins, a unit starts or
restarts, and which restart). ``grep ' err | '`` finds a unit's stderr,
``grep ' --- | '`` its runs and restarts. A task unit's log holds JSON lines
instead (one per call, and one per run of the stack), see
:mod:`hold_supervisor.task.calls`.

Rotation renames ``UNIT.log`` to ``UNIT.log.1`` (and ``.1`` to ``.2``, ...)
once it passes ``max_bytes``, keeping ``keep`` old files, as logrotate would.
A follower notices the rename (the inode at the path changes, or the file
shrinks) and continues with the new file.

Opened through :mod:`hold_supervisor.safefile`: a log that is a symlink, a hard
link or someone else's file is refused (:class:`UnsafePath`) when it is
opened, and after a rotation what is written is dropped rather than written
through a link planted meanwhile (:attr:`RotatingLog.refused` says why).
Readers do not follow a link at the log's name either.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

from hold_supervisor.safefile import UnsafePath, open_for_append, open_for_read

MAX_BYTES = 10 * 1024 * 1024
KEEP = 3
STREAMS = ("out", "err", "---")
STAMP_LEN = len("2026-12-01T17:05:03.123Z")


def stamp(t: float | None = None) -> str:
    """``t`` (default: now) as the log's time: ``2026-12-01T17:05:03.123Z``."""
    t = time.time() if t is None else t
    ms = round(t * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def log_line(stream: str, text: str, t: float | None = None) -> str:
    """One line of a unit's log: ``STAMP STREAM | TEXT``."""
    return f"{stamp(t)} {stream} | {text}"


class RotatingLog:
    """Append-only lines, rotated by size. Written by the unit's reader thread, and
    by its job for the lines of the stack's own (a lock keeps lines whole)."""

    def __init__(self, path: str, *, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.refused: str | None = None  # why lines are dropped (reopening was refused)
        self._lock = threading.Lock()
        self._fd = open_for_append(self.path)  # UnsafePath: refused
        self._size = os.fstat(self._fd).st_size

    def write(self, line: str) -> None:
        data = line.encode("utf-8", "replace") + b"\n"
        with self._lock:
            if self._fd < 0:
                return  # closed, or the reopening after a rotation was refused
            if self._size and self._size + len(data) > self.max_bytes:
                self.rotate()
                if self._fd < 0:
                    return
            os.write(self._fd, data)
            self._size += len(data)

    def rotate(self) -> None:
        os.close(self._fd)
        self._fd = -1
        for i in range(self.keep - 1, 0, -1):
            try:
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            except FileNotFoundError:
                pass
        if self.keep > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)
        self._size = 0
        try:
            self._fd = open_for_append(self.path)
        except UnsafePath as e:  # planted in the instant between the rename and the open
            self._fd = -1
            self.refused = str(e)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def tail_lines(path: str, n: int | None) -> tuple[list[str], int, int]:
    """The last ``n`` lines (all if None) of ``path``, its inode, and the offset read to."""
    with open(open_for_read(path, owned=False), "rb") as f:
        st = os.fstat(f.fileno())
        data = f.read()
    lines = data.decode("utf-8", "replace").splitlines()
    if n is not None:
        lines = lines[-n:] if n > 0 else []
    return lines, st.st_ino, len(data)


class Follower:
    """Lines appended to ``path`` after ``offset`` (of the file with inode ``ino``),
    across rotations: each :meth:`poll` returns what came since the last one."""

    def __init__(self, path: str, ino: int, offset: int) -> None:
        self.path = path
        self.ino = ino
        self.offset = offset
        self._buf = b""

    def poll(self) -> list[str]:
        try:
            st = os.lstat(self.path)  # a link at the name is refused by the open below
        except FileNotFoundError:
            return []
        if st.st_ino != self.ino or st.st_size < self.offset:
            self.ino, self.offset = st.st_ino, 0  # rotated: the new file, from its start
        if st.st_size <= self.offset:
            return []
        with open(open_for_read(self.path, owned=False), "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *whole, self._buf = (self._buf + chunk).split(b"\n")
        return [line.decode("utf-8", "replace") for line in whole]

    def rest(self) -> list[str]:
        """A last line that never got its newline."""
        buf, self._buf = self._buf, b""
        return [buf.decode("utf-8", "replace")] if buf else []


def follow(
    path: str, ino: int, offset: int, *, keep_going: Callable[[], bool], interval: float = 0.2
) -> Iterator[str]:
    """Lines appended to ``path`` after ``offset``, across rotations, while ``keep_going()``.

    After ``keep_going()`` turns False, what is already written is still returned.
    """
    f = Follower(path, ino, offset)
    while True:
        going = keep_going()
        yield from f.poll()
        if not going:
            yield from f.rest()
            return
        time.sleep(interval)
