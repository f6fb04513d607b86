"""A service's output: two pipes (stdout, stderr) and the reader thread that copies
both to the unit's log, each line stamped and tagged with its stream
(:mod:`hold_supervisor.unitlog`), and feeds the tail, the last line and a log probe.

The reader polls both pipes with a bounded wait, so it can always be told to
stop (even when an escapee keeps a pipe open): told, it takes what is already
in the pipes, then goes. The stack's own lines (a run begins, a unit starts or
restarts) are written with :func:`mark`.
"""

from __future__ import annotations

import fcntl
import os
import select
import sys
import termios
import threading
import time
from typing import TYPE_CHECKING

from hold_supervisor.spawn.output import LineReader
from hold_supervisor.stack import readiness
from hold_supervisor.stack.units import status_text
from hold_supervisor.unitlog import log_line

if TYPE_CHECKING:
    from hold_supervisor.stack.state import StackState
    from hold_supervisor.stack.units import Unit
    from hold_supervisor.unitlog import RotatingLog

DRAIN = 0.5  # told to stop, the reader takes what comes for at most this long


def open_outputs(st: StackState) -> None:
    """Each service's stdout and stderr pipes, with the thread that copies them to
    the log; each log (a service's and a task unit's) says a run of the stack begins."""
    open_pipes(st)
    start_readers(st)


def open_pipes(st: StackState) -> None:
    """:func:`open_outputs` without its threads: the run-begins lines and the pipes
    (a stack spawns its first units before it has a thread: see
    :func:`hold_supervisor.stack.start.spawn_first`)."""
    run = f"==== stack {st.name}: run begins (hold up pid {os.getpid()}, file {st.source}) ===="
    if st.tasks:  # the calls' record format, for task units only (not loaded otherwise)
        from hold_supervisor.task.calls import run_record
    for t in st.tasks.values():
        if t.log is not None:
            _write(t.log, run_record(st.name, os.getpid()))
    for u in st.units.values():
        assert u.log is not None  # opened by prepare()
        _write(u.log, log_line("---", run))
        u.out_r, u.out_w = os.pipe2(os.O_CLOEXEC)
        u.err_r, u.err_w = os.pipe2(os.O_CLOEXEC)
        u.wake_r, u.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)


def start_readers(st: StackState) -> None:
    """The reader thread of each service's pipes (what came before it is in the pipes)."""
    for u in st.units.values():
        u.reader = threading.Thread(
            target=read_output, args=(u,), name=f"out-{u.name}", daemon=True
        )
        u.reader.start()


def mark(u: Unit, text: str) -> None:
    """A line of the stack's own in the unit's log (``---``)."""
    if u.log is not None:
        _write(u.log, log_line("---", f"{u.name}: {text}"))


def start_note(u: Unit, was: str, previous: int | None) -> str:
    """What :func:`mark` says of a spawn: the first start, or which restart and why."""
    pid = u.child.pid if u.child is not None else "?"
    if was == "waiting":
        return f"start, pid {pid}"
    why = "asked by hold restart" if was == "restarting" else "restart policy"
    after = f", after {status_text(previous)}" if previous is not None else ""
    return f"restart {u.total_restarts} ({why}{after}), pid {pid}"


def close_outputs(u: Unit) -> None:
    """After the reader has stopped: the unit's pipes closed."""
    for fd in (u.out_r, u.out_w, u.err_r, u.err_w, u.wake_r, u.wake_w):
        if fd >= 0:
            os.close(fd)
    u.out_r = u.out_w = u.err_r = u.err_w = u.wake_r = u.wake_w = -1


def read_output(u: Unit) -> None:
    """Reader thread: lines of both pipes to the log, the tail, the log probe; until
    told to stop (then what is already in the pipes, and no more)."""
    readers = {u.out_r: ("out", LineReader(u.out_r)), u.err_r: ("err", LineReader(u.err_r))}
    poller = select.poll()
    for fd in readers:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    until: float | None = None  # told to stop: what is in the pipes, until then
    while readers:
        if until is None and u.reader_stop.is_set():
            until = time.monotonic() + DRAIN
        ready = poller.poll(50 if until is not None else 250)
        if until is not None and (not ready or time.monotonic() > until):
            return
        for fd, _ev in ready:
            stream, reader = readers[fd]
            with u.reading:
                lines = reader.take()
                if lines:
                    _emit(u, stream, lines)
            if reader.at_eof:
                poller.unregister(fd)
                del readers[fd]


def catch_up(u: Unit, timeout: float = DRAIN) -> None:
    """Until what the unit wrote before now is in its tail and log, for at most
    ``timeout``: a unit that printed why it failed and exited has its lines in
    the pipes, and the reader thread, on a loaded machine, may not have taken
    them yet when its exit is seen. No event says "the pipe was read": the
    bytes left in each pipe (``FIONREAD``) are polled, then the reader's lock
    waited for (lines taken but not yet in the tail)."""
    reader = u.reader
    if reader is None or not reader.is_alive() or reader is threading.current_thread():
        return
    deadline = time.monotonic() + timeout
    while any(_unread(fd) for fd in (u.out_r, u.err_r)):
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)
    if u.reading.acquire(timeout=max(0.0, deadline - time.monotonic())):
        u.reading.release()


def _unread(fd: int) -> int:
    """Bytes in pipe ``fd`` not yet read (0 for a closed one)."""
    if fd < 0:
        return 0
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, sys.byteorder)  # a C int


def _emit(u: Unit, stream: str, lines: list[str]) -> None:
    log = u.log
    probe = u.probe if isinstance(u.probe, readiness.LogProbe) else None
    for line in lines:
        if log is not None:
            _write(log, log_line(stream, line))
        u.tail.append(line)
        u.last_line = line
        if probe is not None:
            probe.feed(line)
    u.wake()


def _write(log: RotatingLog, line: str) -> None:
    try:
        log.write(line)
    except (OSError, ValueError):
        pass  # a full disk must not stop the reader (the unit would block on its pipe)
