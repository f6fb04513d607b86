"""The client's Unix socket, through ``_socket``.

The ``socket`` module turns its constants into enum classes when imported:
about 2 ms of every ``npu-hold`` and ``hold run`` start-up (issue 13), for a
client that needs a stream socket, ``connect``, ``sendall`` and descriptors
passed both ways. ``_socket`` is the C module under it, with the same
methods; these helpers are the two that ``socket`` adds on top
(``send_fds``/``recv_fds``, as it writes them).
"""

from __future__ import annotations

import _socket
import array

MSG_DONTWAIT = _socket.MSG_DONTWAIT
Socket = _socket.socket


def unix_stream() -> Socket:
    """A new, unconnected ``AF_UNIX`` stream socket, closed on exec."""
    return _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)


def send_fds(sock: Socket, data: bytes, fds: list[int]) -> int:
    """Send ``data`` with ``fds`` (``SCM_RIGHTS``); the bytes sent."""
    rights = array.array("i", fds).tobytes()
    return sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])


def recv_fds(sock: Socket, size: int, max_fds: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """Up to ``size`` bytes, and the descriptors that came with them (``SCM_RIGHTS``)."""
    fds = array.array("i")
    data, anc, _flags, _addr = sock.recvmsg(size, _socket.CMSG_LEN(max_fds * fds.itemsize), flags)
    for level, kind, payload in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    return data, list(fds)


def send_timeout(sock: Socket, seconds: float) -> None:
    """Bound ``connect`` and every send on ``sock`` (``SO_SNDTIMEO``): a blocking
    call that waits longer fails with ``EAGAIN`` (:class:`BlockingIOError`).

    The socket stays blocking (no ``settimeout``: that polls before each
    ``recv``, and ``MSG_DONTWAIT`` reads must not wait); ``connect`` of a Unix
    socket waits on a full backlog for this long, then fails.
    """
    whole = int(seconds)
    tv = array.array("l", [whole, int((seconds - whole) * 1e6)])  # struct timeval (Linux)
    sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, tv.tobytes())


def peer_pid(sock: Socket) -> int | None:
    """The pid of the process at the other end (``SO_PEERCRED``: the daemon that
    listens), None if the kernel does not say."""
    ucred = array.array("i")  # struct ucred: pid, uid, gid
    try:
        ucred.frombytes(
            sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 3 * ucred.itemsize)
        )
    except (OSError, ValueError):
        return None
    return ucred[0] if ucred and ucred[0] > 0 else None
