"""The sd_notify protocol, both ways.

* :func:`tell_systemd`: ``hold up`` run as a ``Type=notify`` service says
  ``READY=1`` when every unit is ready and ``STOPPING=1`` when it stops (to
  ``$NOTIFY_SOCKET``; nothing when it is not set).
* :class:`NotifySocket` and :class:`NotifyProbe`: a unit with
  ``ready: {notify: true}`` gets its own ``NOTIFY_SOCKET`` (a datagram socket
  in the stack's run directory) and is ready when it sends ``READY=1``. As for
  the other probes, the answer is believed only from the unit's own tree: the
  kernel stamps each datagram with the sender's pid (``SO_PASSCRED``), and a
  ``READY=1`` from a pid outside the tree is ignored and named. The sender
  must still be alive when it is checked (as with systemd's
  ``NotifyAccess=all``): send from the unit itself, not from a helper that
  exits at once.
"""

from __future__ import annotations

import os
import select
import socket
import struct

from hold_supervisor.proc.tree import Tree
from hold_supervisor.stack.readiness import Answer, Probe

MAX_DATAGRAM = 4096
_UCRED = struct.Struct("3i")  # pid, uid, gid


def tell_systemd(*lines: str) -> bool:
    """Send ``lines`` (``READY=1``, ``STOPPING=1``) to ``$NOTIFY_SOCKET``; False if unset."""
    where = os.environ.get("NOTIFY_SOCKET", "")
    if not where or where[0] not in "/@":
        return False
    address = "\0" + where[1:] if where[0] == "@" else where
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto("\n".join(lines).encode(), address)
        except OSError:
            return False  # systemd went away; nothing else to tell
    return True


class NotifySocket:
    """A unit's ``NOTIFY_SOCKET``: bound at ``path`` (mode 0600), each datagram
    read with its sender's pid."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            old = os.umask(0o077)
            try:
                self.sock.bind(path)
            finally:
                os.umask(old)
        except BaseException:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[tuple[int, dict[str, str]]]:
        """Every datagram waiting now: (sender pid, its ``KEY=value`` lines)."""
        out: list[tuple[int, dict[str, str]]] = []
        while True:
            try:
                data, anc, _flags, _addr = self.sock.recvmsg(
                    MAX_DATAGRAM, socket.CMSG_SPACE(_UCRED.size)
                )
            except (BlockingIOError, InterruptedError):
                return out
            pid = 0
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack(payload[: _UCRED.size])[0]
            out.append((pid, _fields(data)))

    def close(self) -> None:
        """Closed, and its file removed; an abstract name (``\\0...``: a run
        directory too long for a socket's path) has none, and goes with it."""
        self.sock.close()
        if self.path.startswith("\0"):
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _fields(data: bytes) -> dict[str, str]:
    text = data.decode("utf-8", "replace")
    return dict(line.split("=", 1) for line in text.split("\n") if "=" in line)


class NotifyProbe(Probe):
    """Ready once a process of the unit's tree sent ``READY=1``."""

    kind = "notify"

    def __init__(self, sock: NotifySocket) -> None:
        self.sock = sock
        self._ready = False
        self._ignored: list[int] = []
        self.status = ""

    def reset(self) -> None:
        """Forget a READY=1 (before a restart: the new process must say it again)."""
        self._ready = False
        self.sock.receive()

    def check(self, tree: Tree, limit: float) -> Answer:
        if not self._ready:
            select.select([self.sock], [], [], max(0.0, min(limit, 0.5)))
            self._take(tree)
        if self._ready:
            return Answer(True, "sent READY=1")
        if self._ignored:
            return Answer(
                False,
                "READY=1 ignored from pid "
                + ", ".join(map(str, self._ignored[-3:]))
                + " (not a process of this unit)",
            )
        return Answer(False, "no READY=1 on $NOTIFY_SOCKET yet" + self._status())

    def _take(self, tree: Tree) -> None:
        messages = self.sock.receive()
        if not messages:
            return
        members = set(tree.members())
        for pid, fields in messages:
            if pid not in members:
                if fields.get("READY") == "1":
                    self._ignored.append(pid)
                continue
            if "STATUS" in fields:
                self.status = fields["STATUS"][:200]
            if fields.get("READY") == "1":
                self._ready = True

    def _status(self) -> str:
        return f" (STATUS={self.status})" if self.status else ""
