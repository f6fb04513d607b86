"""The daemon's socket, and who is on the other end of each connection.

Who is asking comes from the socket (``SO_PEERCRED``, and ``SO_PEERPIDFD``
where the kernel has it), never from a message.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import stat
import struct
from collections.abc import Callable

from hold.daemon.conn import Conn
from hold.daemon.tokens import UnsafePath
from hold.errors import HoldError
from hold_supervisor.proc.identity import ProcessId, read_stat

SO_PEERPIDFD = 77  # Linux 6.5; not yet in Python's socket module


def listen(path: str, shared: bool) -> socket.socket:
    """The listening socket at ``path``: for everyone (``shared``) or for its user only."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        # We hold the daemon lock, so a socket here is a dead daemon's.
        if not stat.S_ISSOCK(st.st_mode):
            raise UnsafePath(f"{path} exists and is not a socket; refusing to replace it")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o111 if shared else 0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class OutOfDescriptors(HoldError):
    """No descriptor left for the next client (``EMFILE``, ``ENFILE``): it waits in
    the backlog until one is given back."""


def accept(listener: socket.socket, want_write: Callable[[Conn, bool], None]) -> Conn | None:
    """The next client, identified by the kernel; None if none waits or it is gone already.
    Raises :class:`OutOfDescriptors` where this process has none left for it."""
    try:
        sock, _ = listener.accept()
    except BlockingIOError:
        return None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            raise OutOfDescriptors(e.strerror) from None
        raise
    pid, uid, _gid = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    pidfd: int | None
    try:
        pidfd = struct.unpack("i", sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4))[0]
    except OSError:
        pidfd = None
    try:
        start = read_stat(pid).starttime
    except Exception:
        sock.close()
        if pidfd is not None:
            os.close(pidfd)
        return None
    # With a pidfd, the peer is still the process that connected if the
    # pidfd has not signalled its exit (a live process keeps its pid).
    if pidfd is not None and pidfd_exited(pidfd):
        sock.close()
        os.close(pidfd)
        return None
    sock.setblocking(False)
    return Conn(sock, ProcessId(pid, start), uid, pidfd, want_write)


def pidfd_exited(fd: int) -> bool:
    """Whether the process of pidfd ``fd`` has exited (without waiting)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))
