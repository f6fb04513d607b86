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
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def signals_to_pipe(signums: Iterable[int], *, ignore: Iterable[int] = ()) -> Iterator[int]:
    """``signums`` written to a fresh non-blocking pipe whose read end is yielded
    (read it with :func:`drain`); ``ignore`` set to SIG_IGN meanwhile."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old: dict[int, object] = {num: signal.signal(num, _noop) for num in signums}
    for num in ignore:
        old[num] = signal.signal(num, signal.SIG_IGN)
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        yield wake_r
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for num, handler in old.items():
            if handler is not None:
                signal.signal(num, handler)  # type: ignore[arg-type]
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
