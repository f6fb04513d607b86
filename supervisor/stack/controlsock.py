"""The control channel of a running stack: a Unix socket in its run directory, JSON lines.

``hold ps``, ``hold down`` and ``hold restart`` talk to it from any terminal of
the same user. A request is one JSON object with an ``op``; the answer is one
or more JSON objects, the last with ``"done": true`` (``down`` first says
``stopping``, then ``stopped`` with the exit status once everything is
stopped). Only the stack's own user (or root) may connect: the directory is
0700, and the peer's uid is checked again from ``SO_PEERCRED``. Lines are
read strictly (:mod:`hold_supervisor.jsonlines`): a request that is not one JSON
object, within the limits, with no key twice, is answered with an error and
its connection closed.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import EXPIRED
from hold_supervisor.jsonlines import BadJSON, LineBuffer, dumps_line
from hold_supervisor.stack.wire import StackEv
from hold_supervisor.stackfile.name import (
    STACK_NAME as STACK_NAME,  # the name's rule, for its callers
)
from hold_supervisor.stackfile.name import check_stack_name as check_stack_name

Message = dict[str, Any]
# A request: room for a call's arguments (at most 64 KiB as JSON, checked by the
# stack) in either of their forms. An answer: a call's stdout (1 MiB) in base64.
MAX_LINE = 256 * 1024
MAX_ANSWER = 16 << 20


class Reply:
    """Where the answers to one request go; usable from any thread, until closed."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.closed = False

    def send(self, msg: Message, *, done: bool = False) -> None:
        data = dumps_line({**msg, **({"done": True} if done else {})})
        with self._lock:
            if self.closed:
                return
            try:
                self._sock.sendall(data)
            except OSError:
                self.closed = True
                return
            if done:
                self._close()

    def fileno(self) -> int:
        """The connection, to poll for what the client sends next (or its going
        away) while a long request runs; -1 once closed."""
        with self._lock:
            return -1 if self.closed else self._sock.fileno()

    def recv(self) -> bytes:
        """What the client sent, without waiting long; ``b""`` when it is gone."""
        try:
            return self._sock.recv(4096)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return b"-"  # nothing after all (the poll said readable): not an end
        except OSError:
            return b""

    def _close(self) -> None:
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self._close()


Handler = Callable[[Message, Reply], None]


class ControlServer:
    """Accepts connections on ``path`` and hands each request to ``handler`` (in a
    connection thread). :meth:`close` ends every thread it started."""

    def __init__(self, path: str, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._threads: list[threading.Thread] = []
        self._replies: list[Reply] = []
        self._lock = threading.Lock()
        try:
            os.unlink(path)  # a dead stack's; we hold the stack's lock
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._listening = True
        self._sock.listen(16)
        self._sock.setblocking(False)
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="stack-control", daemon=True
        )
        self._threads.append(self._acceptor)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            _pid, uid, _gid = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            )
            if uid not in (os.geteuid(), 0):
                conn.close()
                continue
            conn.setblocking(True)
            conn.settimeout(5.0)  # a client that stops reading cannot hold a sender for long
            t = threading.Thread(
                target=self._serve, args=(conn,), name="stack-control-conn", daemon=True
            )
            with self._lock:
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        reply = Reply(conn)
        with self._lock:
            self._replies.append(reply)
        lines = LineBuffer(MAX_LINE)
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while not reply.closed:
            ready = {fd for fd, _ in poller.poll(1000)}
            if self._stop_r in ready or reply.closed:
                break
            if not ready:
                continue
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            lines.push(data)
            while not reply.closed:
                try:
                    msg = lines.next()
                except BadJSON as e:
                    reply.send(
                        {"ev": StackEv.ERROR, "code": 2, "error": f"bad request: {e}"}, done=True
                    )
                    break
                if msg is None:
                    break
                self.handler(msg, reply)
        # A reply kept for later (down) stays open; others are closed by their handler.

    def stop_listening(self) -> None:
        """No new connection from now on, and the socket's path gone; the open ones
        (a ``hold down`` waiting for its answer) stay until :meth:`close`. Before the
        stack lets go of its name: a new run of it binds the path anew, and must not
        lose it to this one."""
        if not self._listening:
            return
        self._listening = False
        try:
            os.write(self._stop_w, b"x")  # the accept loop ends
        except OSError:
            pass
        self._acceptor.join(timeout=2.0)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.stop_listening()
        for t in list(self._threads):
            t.join(timeout=2.0)
        with self._lock:
            for r in self._replies:
                r.close()
        os.close(self._stop_r)
        os.close(self._stop_w)


class NoAnswer(SupervisorError, TimeoutError):
    """The stack did not answer ``op`` within ``waited`` seconds: its supervisor is
    stuck (stopped, or its threads not getting on). ``heard``: the last message it
    did send for this request (``down``'s ``stopping``), if any. Exit 124: a time
    limit ran out."""

    exit_code = EXPIRED

    def __init__(self, op: str, waited: float, heard: Message | None) -> None:
        super().__init__(f"the stack did not answer {op!r} in {waited:g} s")
        self.op = op
        self.waited = waited
        self.heard = heard


def connect(path: str, timeout: float, op: str) -> socket.socket:
    """A connection to the stack at ``path``, its sends bounded by ``timeout``.

    A stuck stack's backlog fills up, and a connect to it then fails at once
    (``EAGAIN``: a Unix socket's connect does not wait for room once it has a
    timeout) or would block: tried again until ``timeout``, then :class:`NoAnswer`.
    ``OSError`` (``FileNotFoundError``, ``ConnectionRefusedError``) where no
    stack listens."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            s.connect(path)
        except (BlockingIOError, TimeoutError):
            s.close()
            if time.monotonic() >= deadline:
                raise NoAnswer(op, timeout, None) from None
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            continue
        except BaseException:
            s.close()
            raise
        s.settimeout(timeout)
        return s


def request(
    path: str,
    msg: Message,
    *,
    timeout: float = 10.0,
    on_message: Callable[[Message], float | None] | None = None,
) -> Message:
    """Send ``msg`` to the stack at ``path``; the final answer (``done``).

    Every step has a deadline: the connection and the request (a stuck stack's
    full backlog would hold a connect), and each answer, ``timeout`` seconds
    after the last message. ``on_message`` sees the answers before the final
    one; what it returns, if not None, is the wait for the next (``down``'s
    ``stopping`` says how long the stop may take). Raises ``OSError`` if no
    stack answers there, :class:`NoAnswer` (a ``TimeoutError``) past a deadline.
    """
    op = str(msg.get("op"))
    wait = timeout
    heard: Message | None = None
    with connect(path, timeout, op) as s:
        try:
            s.sendall(dumps_line(msg))
        except TimeoutError:
            raise NoAnswer(op, timeout, None) from None
        lines = LineBuffer(MAX_ANSWER)
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoAnswer(op, wait, heard)
            if not select.select([s], [], [], left)[0]:
                continue
            data = s.recv(65536)
            if not data:
                raise ConnectionResetError("the stack closed the connection without an answer")
            lines.push(data)
            while (ans := lines.next()) is not None:
                if ans.get("done"):
                    return ans
                heard = ans
                if on_message is not None:
                    more = on_message(ans)
                    if more is not None:
                        wait = more
                deadline = time.monotonic() + wait
