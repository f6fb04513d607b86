"""A unit's log file: written by the stack, rotated by size, read (and followed) by anyone.

Rotation renames ``UNIT.log`` to ``UNIT.log.1`` (and ``.1`` to ``.2``, ...)
once it passes ``max_bytes``, keeping ``keep`` old files, as logrotate would.
A follower notices the rename (the inode at the path changes, or the file
shrinks) and continues with the new file.

Opened through :mod:`supervisor.safefile`: a log that is a symlink, a hard
link or someone else's file is refused (:class:`UnsafePath`) when it is
opened, and after a rotation what is written is dropped rather than written
through a link planted meanwhile (:attr:`RotatingLog.refused` says why).
Readers do not follow a link at the log's name either.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from supervisor.safefile import UnsafePath, open_for_append, open_for_read

MAX_BYTES = 10 * 1024 * 1024
KEEP = 3


class RotatingLog:
    """Append-only lines, rotated by size. One writer (the unit's reader thread)."""

    def __init__(self, path: str, *, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.refused: str | None = None  # why lines are dropped (reopening was refused)
        self._fd = open_for_append(self.path)  # UnsafePath: refused
        self._size = os.fstat(self._fd).st_size

    def write(self, line: str) -> None:
        if self._fd < 0:
            return  # closed, or the reopening after a rotation was refused
        data = line.encode("utf-8", "replace") + b"\n"
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


def follow(
    path: str, ino: int, offset: int, *, keep_going: Callable[[], bool], interval: float = 0.2
) -> Iterator[str]:
    """Lines appended to ``path`` after ``offset``, across rotations, while ``keep_going()``.

    After ``keep_going()`` turns False, what is already written is still returned.
    """
    buf = b""
    while True:
        going = keep_going()
        try:
            st = os.lstat(path)  # a link at the name is refused by the open below
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_ino != ino or st.st_size < offset):
            ino, offset = st.st_ino, 0  # rotated: the new file, from its start
        if st is not None and st.st_size > offset:
            with open(open_for_read(path, owned=False), "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            buf += chunk
            *whole, buf = buf.split(b"\n")
            for line in whole:
                yield line.decode("utf-8", "replace")
        if not going:
            if buf:
                yield buf.decode("utf-8", "replace")
            return
        time.sleep(interval)
