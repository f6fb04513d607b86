"""One connected client of the daemon (identified by the kernel, its output
queued so that it never blocks the daemon), and the request it waits in line with."""

from __future__ import annotations

import array
import collections
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from hold.daemon.ledger import SessionRec, TreeRec
from hold.protocol import LineBuffer, Message, encode
from hold_supervisor.proc.identity import ProcessId

MAX_UNSENT = 1 << 20  # bytes a client may leave unread before its connection is closed


class Request:
    """A client waiting in line for devices of one class."""

    __slots__ = (
        "allowed",
        "arrived",
        "checking",
        "conn",
        "count",
        "grace",
        "indices",
        "label",
        "private",
        "seq",
        "tree",
        "ttl",
        "wait",
    )

    def __init__(
        self,
        conn: Conn,
        seq: int,
        count: int,
        indices: tuple[int, ...] | None,
        label: str,
        ttl: float,
        grace: float,
        tree: TreeRec | None,
    ) -> None:
        self.conn = conn
        self.seq = seq
        self.count = count
        self.indices = indices
        self.label = label
        self.ttl = ttl
        self.grace = grace
        self.tree = tree
        self.checking: list[int] | None = None  # devices being checked empty for it
        self.wait = True  # False: --no-wait, answered "busy" rather than queued
        self.private = False  # the label is shown to its owner and root only
        self.allowed: frozenset[int] | None = None  # the devices the client can use
        self.arrived = time.time()  # when it joined the line (hold report's waits)


class Conn:
    """One connected client, identified by the kernel."""

    __slots__ = (
        "buf",
        "closed",
        "fds",
        "last_note",
        "out",
        "overflow",
        "peer",
        "pidfd",
        "request",
        "session",
        "sock",
        "uid",
        "unhandled",
        "want_write",
    )

    def __init__(
        self,
        sock: socket.socket,
        peer: ProcessId,
        uid: int,
        pidfd: int | None,
        want_write: Callable[[Conn, bool], None],
    ) -> None:
        self.sock = sock  # non-blocking: a client that stops reading blocks nobody
        self.peer = peer
        self.uid = uid
        self.pidfd = pidfd
        self.buf = LineBuffer()
        # Requests read but not yet handled: a client that sends many at once
        # has them handled a few a turn (the daemon's PER_TURN), between others'.
        self.unhandled: collections.deque[Message] = collections.deque()
        self.session: SessionRec | None = None
        self.request: Request | None = None
        self.last_note: Any = None
        self.fds: list[int] = []  # descriptors that came with the message being handled
        # Unsent output, in order: (bytes, descriptors to go with their first byte).
        self.out: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.overflow = False  # more unread output than MAX_UNSENT: to be closed
        self.closed = False
        self.want_write = want_write

    def send(self, msg: Message, fds: list[int] | None = None) -> None:
        """Queue ``msg`` (with ``fds``, duplicated: they stay valid until sent) and
        send what the socket takes now; the rest when it is writable again."""
        if self.closed or self.overflow:
            return
        self.out.append((encode(msg), [os.dup(fd) for fd in fds or ()]))
        was_waiting = len(self.out) > 1
        self.flush()
        if self.out and not was_waiting:
            self.want_write(self, True)
        if sum(len(d) for d, _ in self.out) > MAX_UNSENT:
            self.overflow = True
            self.want_write(self, True)  # the daemon notes it (and closes it after this turn)

    def flush(self) -> None:
        """Send queued output until the socket would block."""
        while self.out:
            data, fds = self.out[0]
            try:
                if fds:
                    # The descriptors travel with the message's first bytes.
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    sent = self.sock.sendmsg([data], anc)
                else:
                    sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.drop_output()  # the client is gone; its close event follows
                return
            for fd in fds:
                os.close(fd)
            if sent < len(data):
                self.out[0] = (data[sent:], [])
                return
            self.out.popleft()
        self.want_write(self, False)

    def drop_output(self) -> None:
        for _, fds in self.out:
            for fd in fds:
                os.close(fd)
        self.out.clear()

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
