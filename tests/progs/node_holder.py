"""A process that holds a "device" node, for the audit tests.

Usage: node_holder.py OUT HOW PATH [--escape] [--child]

HOW is ``fd`` (keep an open descriptor of PATH), ``path`` (the same, opened
with ``O_PATH``: a device node without its driver) or ``mmap`` (map PATH, then
close every descriptor of it: only the mapping is left). The mapping is made
through libc, not Python's ``mmap`` module, which keeps a duplicate of the
descriptor for itself (before Python 3.13's ``trackfd=False``), so the
process would still hold the node by descriptor.

``--escape``: the node is held by an escapee (fork, ``setsid``, fork; the
middle process exits), and this process only sleeps. ``--child``: the holder
forks a child that holds nothing (a member of its tree, found by descent).

Each process appends ``ROLE PID`` to OUT in one write (roles: ``main``,
``holder`` -- the main process itself when not ``--escape`` -- and
``child``), the holder only once the node is held. Every process ends by
itself after two minutes, a safety net should a test forget it.
"""

import ctypes
import os
import sys
import time

LIFETIME = 120.0
out, how, path = sys.argv[1:4]
opts = sys.argv[4:]


def note(role: str) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{role} {os.getpid()}\n".encode())
    os.close(fd)


def sleep() -> None:
    deadline = time.monotonic() + LIFETIME
    while time.monotonic() < deadline:
        time.sleep(0.5)
    os._exit(0)


def hold() -> None:
    # ``path``: an O_PATH descriptor, for a node whose driver is not loaded
    # (an open for reading would fail with ENXIO): it still names the node.
    fd = os.open(path, os.O_PATH if how == "path" else os.O_RDONLY)
    if how == "mmap":
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
        prot_read, map_shared = 1, 1
        addr = libc.mmap(None, 4096, prot_read, map_shared, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        os.close(fd)
    elif how not in ("fd", "path"):
        raise SystemExit(f"HOW must be fd, path or mmap, not {how!r}")
    if "--child" in opts and os.fork() == 0:
        if how != "mmap":
            os.close(fd)
        else:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(4096))
        note("child")
        sleep()
    note("holder")
    sleep()


if "--escape" in opts:
    note("main")
    if os.fork() == 0:
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        hold()
    os.wait()
    sleep()
else:
    note("main")
    hold()
