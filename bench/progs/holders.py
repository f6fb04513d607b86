"""A crowd of processes, some of which hold one "device" node, for the audit benchmark.

Usage: holders.py NODE TOTAL BY_FD BY_MAP READY_FD LIFELINE_FD

Forks TOTAL processes (all children of this one, in its process group):

* BY_FD hold NODE by descriptor: open it (inheritable), then exec ``sleep``;
* BY_MAP hold it by a mapping only: map it through libc and close the
  descriptor (Python's ``mmap`` module would keep a duplicate descriptor of
  its own before 3.13), then wait in ``pause()`` -- they stay Python, since
  an exec would drop the mapping;
* the rest exec ``sleep`` holding nothing.

Each child writes ``KIND PID`` (``fd``, ``mmap`` or ``none``) to READY_FD once
in place (the descriptor is close-on-exec, so a line is written before the
exec). Every child has ``PR_SET_PDEATHSIG`` = SIGKILL, so none outlives this
process; this process in turn ends, killing its children first, when
LIFELINE_FD reaches end of file (the benchmark closed it or died) or on
SIGTERM. Nothing started here can outlive the benchmark.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys

PR_SET_PDEATHSIG = 1
PROT_READ, MAP_SHARED = 1, 1

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
SLEEP = next(p for p in ("/usr/bin/sleep", "/bin/sleep") if os.path.exists(p))


def child(kind: str, node: str, ready: int, parent: int) -> None:
    """Runs in the forked child; never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(1)
        if kind == "fd":
            fd = os.open(node, os.O_RDONLY)
            os.set_inheritable(fd, True)
        elif kind == "mmap":
            fd = os.open(node, os.O_RDONLY)
            addr = libc.mmap(None, 4096, PROT_READ, MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                os._exit(2)
            os.close(fd)
        os.write(ready, f"{kind} {os.getpid()}\n".encode())
        if kind == "mmap":
            os.close(ready)
            while True:
                signal.pause()
        os.execv(SLEEP, [SLEEP, "3600"])
    finally:
        os._exit(3)


def main() -> None:
    node, total, by_fd, by_map = sys.argv[1], *map(int, sys.argv[2:5])
    ready, lifeline = int(sys.argv[5]), int(sys.argv[6])
    if by_fd + by_map > total:
        raise SystemExit("holders.py: BY_FD + BY_MAP > TOTAL")
    kids: list[int] = []

    def end(*_: object) -> None:
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    me = os.getpid()
    kinds = ["fd"] * by_fd + ["mmap"] * by_map + ["none"] * (total - by_fd - by_map)
    for kind in kinds:
        pid = os.fork()
        if pid == 0:
            os.close(lifeline)
            child(kind, node, ready, me)
        kids.append(pid)
    os.close(ready)
    poller = select.poll()
    poller.register(lifeline, select.POLLIN | select.POLLHUP)
    while True:
        poller.poll()
        try:
            if not os.read(lifeline, 64):
                end()
        except OSError:
            end()


if __name__ == "__main__":
    main()
