"""Signals as bytes on a pipe: the one way a loop here waits for signals.

A ``poll`` loop cannot be woken by a Python signal handler (it runs only between
bytecodes of the main thread), but ``signal.set_wakeup_fd`` writes each
signal's number to a descriptor the loop polls. :func:`signals_to_pipe` is that
as a scope: the handlers are taken over (a no-op handler must exist for the
wakeup byte to be written), and the caller's handlers and wakeup descriptor are
put back on the way out, however it is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

# What signal.getsignal returns (None: a handler not installed from Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@contextlib.contextmanager
def signals_to_pipe(signums: Iterable[int], *, ignore: Iterable[int] = ()) -> Iterator[int]:
    """``signums`` written to a fresh non-blocking pipe whose read end is yielded
    (read it with :func:`drain`); ``ignore`` set to SIG_IGN meanwhile."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old: dict[int, Handler] = {}
    try:
        # Written down before it is replaced: every handler is put back even if
        # taking a later one fails (a bad number, or a signal not yet taken
        # coming in between, whose handler raises -- hold run's, until here).
        taken: list[tuple[int, Handler]] = [(n, _noop) for n in signums]
        for num, handler in [*taken, *((n, signal.SIG_IGN) for n in ignore)]:
            old.setdefault(num, signal.getsignal(num))
            signal.signal(num, handler)
        old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        try:
            yield wake_r
        finally:
            signal.set_wakeup_fd(old_wakeup)
    finally:
        for num, was in old.items():
            if was is not None:  # None: not set from Python; left as it is
                signal.signal(num, was)
        os.close(wake_r)
        os.close(wake_w)


def drain(fd: int) -> list[int]:
    """Empty a non-blocking wakeup pipe; the bytes read (signal numbers for a signal pipe)."""
    out: list[int] = []
    while True:
        try:
            data = os.read(fd, 4096)
        except (BlockingIOError, OSError):
            return out
        if not data:
            return out
        out.extend(data)


def _noop(signum: int, frame: object) -> None:
    """Signals are read from the wakeup descriptor; the handler only has to exist."""
