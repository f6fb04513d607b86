"""A process that tries to hold a "device" node without the kernel's count seeing it.

Usage: slipper.py HOW PATH

HOW:

* ``twice``: open the node twice in a row, close the first (inotify merges
  two identical events still unread: the count would see one open, one close);
* ``fork``: open it, fork a child that keeps the inherited descriptor, exit
  (the child holds the open file: no close event);
* ``mmap``: map it through libc (Python's ``mmap`` keeps a duplicate
  descriptor) and close the descriptor (only the mapping holds the file);
* ``pass``: open it, pass the descriptor over a Unix socket to a child that
  was started before (it never opened anything), close it and exit.

Prints ``holding PID`` (the process that holds the node in the end) once
done; that process then sleeps until killed, or for two minutes at most.
"""

import ctypes
import os
import socket
import sys
import time

LIFETIME = 120.0
how, path = sys.argv[1:3]


def hold_on(pid: int, say: bool = True) -> None:
    if say:
        print(f"holding {pid}", flush=True)
    # Let go of the caller's pipe: whoever reads it waits for its end only.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    deadline = time.monotonic() + LIFETIME
    while time.monotonic() < deadline:
        time.sleep(0.5)
    os._exit(0)


if how == "twice":
    first = os.open(path, os.O_RDONLY)
    second = os.open(path, os.O_RDONLY)
    os.close(first)
    hold_on(os.getpid())
elif how == "fork":
    fd = os.open(path, os.O_RDONLY)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)
        os.write(w, b"x")
        hold_on(os.getpid(), say=False)
    os.close(w)
    os.read(r, 1)
    print(f"holding {child}", flush=True)
    os._exit(0)  # the child, an orphan now, keeps the open file
elif how == "mmap":
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
    fd = os.open(path, os.O_RDONLY)
    addr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value):
        sys.exit(f"mmap failed: {os.strerror(ctypes.get_errno())}")
    os.close(fd)
    hold_on(os.getpid())
elif how == "pass":
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = os.fork()
    if child == 0:
        mine.close()
        _msg, fds, _flags, _addr = socket.recv_fds(theirs, 1, 1)
        assert len(fds) == 1
        theirs.close()
        hold_on(os.getpid(), say=False)
    theirs.close()
    fd = os.open(path, os.O_RDONLY)
    socket.send_fds(mine, [b"x"], [fd])
    os.close(fd)
    mine.close()
    print(f"holding {child}", flush=True)
    os._exit(0)
else:
    sys.exit(f"unknown HOW {how!r}")
