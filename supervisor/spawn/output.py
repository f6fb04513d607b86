"""Read a child's output line by line without ever blocking past a deadline.

A bare ``readline()`` followed by a time check blocks for as long as the child
stays silent, so a deadline is only checked when the child next speaks --
perhaps never. Here the descriptor is non-blocking and every wait is a
``poll`` bounded by what is left of the deadline.
"""

from __future__ import annotations

import os
import select
import time


class LineReader:
    """Lines from a pipe or pty, each read bounded by a deadline.

    :meth:`readline` returns one line (without the newline); at end of file it
    returns the partial last line if there is one (a child that died
    mid-line), then ``None`` for ever after. A read that reaches its deadline
    raises :class:`TimeoutError` and keeps what it has read for the next call.
    """

    def __init__(self, fd: int, *, max_line: int = 1 << 20) -> None:
        self.fd = fd
        self.max_line = max_line
        self._buf = bytearray()
        self._eof = False
        os.set_blocking(fd, False)
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._buf

    def readline(self, deadline: float) -> str | None:
        """The next line; ``deadline`` is a :func:`time.monotonic` time."""
        while True:
            # A line longer than max_line is cut there whether its newline came
            # in the same read or a later one: the pieces must not depend on
            # how the child's writes happened to arrive.
            nl = self._buf.find(b"\n", 0, self.max_line + 1)
            if nl >= 0 or len(self._buf) > self.max_line:
                end = nl if nl >= 0 else self.max_line
                line = bytes(self._buf[:end])
                del self._buf[: end + (1 if nl >= 0 else 0)]
                return line.decode("utf-8", "replace")
            if self._eof:
                if not self._buf:
                    return None
                line = bytes(self._buf)
                self._buf.clear()
                return line.decode("utf-8", "replace")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete line before the deadline")
            if not self._poller.poll(left * 1000):
                continue  # the loop re-checks the deadline
            self._fill()

    def take(self) -> list[str]:
        """One read of what is there now (never waits) and every line now complete;
        at end of file, the partial last line too. For a caller that polls several
        readers itself (stdout and stderr of one child)."""
        if not self._eof:
            self._fill()
        out: list[str] = []
        while True:
            try:
                line = self.readline(0.0)  # a deadline already past: nothing more is read
            except TimeoutError:
                return out
            if line is None:
                return out
            out.append(line)

    def _fill(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:  # EIO: the other side of a pty is gone
            chunk = b""
        if chunk:
            self._buf += chunk
        else:
            self._eof = True
