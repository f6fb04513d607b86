"""What the stack benchmark's three unit programs share (standard library only).

Each process of a unit appends one line to the file named by
``$BENCH_ANNOUNCE``: ``ROLE PID STARTTIME MONOTONIC``, the time (CLOCK_MONOTONIC,
one clock for the whole machine) at which it was up. The benchmark reads it
to know, independently of the supervisor under test, when the units were
really up and which processes (by pid *and* start time) must be gone after
a stop. A line this short is written by one ``write`` to an ``O_APPEND``
file, so lines of concurrent writers do not mix.
"""

from __future__ import annotations

import os
import signal
import time


def announce(role: str) -> None:
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        starttime = f.read().rpartition(b")")[2].split()[19].decode()
    line = f"{role} {os.getpid()} {starttime} {time.monotonic():.6f}\n".encode()
    fd = os.open(os.environ["BENCH_ANNOUNCE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def ready(role: str) -> None:
    """Announce, then print READY (what a ``ready: {log: READY}`` probe waits for)."""
    announce(role)
    print("READY", flush=True)


def sleep_forever() -> None:
    """Wait for signals only: no CPU, so the benchmark times the supervisors."""
    while True:
        signal.pause()
