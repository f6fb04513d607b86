"""Talking to the daemon: connect (starting it if none answers, see
:mod:`hold.client.autostart`), ask, re-attach.

Deadlines (docs/DESIGN.md, "Deadlines"): no call here waits on the daemon
without one. The connect and every send are bounded by the socket's
``SO_SNDTIMEO`` (a stopped daemon whose backlog is full makes ``connect``
wait; one that reads nothing fills its receive buffer), every read by a
``select`` deadline. A request the daemon answers from its event loop gets
:data:`ANSWER_TIMEOUT`; a wait that may last (the wait in line, ``release``,
``end``: the daemon answers once a tree is stopped) checks every
:data:`ANSWER_TIMEOUT` of silence that the daemon still reads (:meth:`Client.ping`).
A daemon that does not answer in time is :class:`DaemonSilent` (exit 125:
the tool failed; never a traceback, and its message names the daemon, its
state directory and how long it was given).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import TypeVar

from hold.client.reach import ANSWER_TIMEOUT as ANSWER_TIMEOUT
from hold.client.reach import ConfigMismatch as ConfigMismatch
from hold.client.reach import DaemonSilent as DaemonSilent
from hold.client.reach import DaemonUnreachable as DaemonUnreachable
from hold.client.reach import UnsafeStateFile as UnsafeStateFile
from hold.client.reach import daemon_pid, try_connect
from hold.protocol import UNVERSIONED, WIRE, Ev, LineBuffer, Message, Op, ProtocolError, encode
from hold.statedir import StateDir
from hold.unixsock import (
    MSG_DONTWAIT,
    Socket,
    recv_fds,
    send_fds,
)
from hold_supervisor.exitcodes import TOOL

START_TIMEOUT = 10.0
T = TypeVar("T")


class DaemonRefused(DaemonUnreachable):
    """The daemon answered with an error (over this user's limits, say): its
    words, and its exit status."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.exit_code = code


class WireMismatch(DaemonRefused):
    """The daemon speaks another version of the wire (another release of
    hold): ``theirs``. Nothing was asked of it but the session."""

    def __init__(self, msg: str, theirs: object) -> None:
        super().__init__(msg, TOOL)
        self.theirs = theirs


class Client:
    """One connection to the daemon; its lifetime is the lifeline of any lease it holds."""

    def __init__(self, sd: StateDir, sock: Socket) -> None:
        self.sd = sd
        self.sock = sock
        self.buf = LineBuffer()
        self.pending: list[Message] = []
        self.events: list[Message] = []  # about our lease, come while a request waited
        self.session: str | None = None
        self.info: Message = {}  # what the daemon said when the session opened
        # The kernel locks of our lease's devices, shared with the daemon (see
        # hold.daemon.devlock): kept until the lease is over, handed back to a
        # restarted daemon when we re-attach.
        self.lock_fds: list[int] = []
        # Set where end() gave up on a daemon that did not answer (it ends
        # the lease itself once it reads again: our connection is closed).
        self.silent: DaemonSilent | None = None

    @classmethod
    def connect(
        cls,
        sd: StateDir,
        *,
        autostart: bool = True,
        timeout: float = START_TIMEOUT,
        answer: float = ANSWER_TIMEOUT,
    ) -> Client:
        """Connected to the daemon serving ``sd`` (started if none answers and
        ``autostart``, within ``timeout``); the connect and every send bounded
        by ``answer`` (:class:`DaemonSilent` past it)."""
        sock = try_connect(sd.socket, sd, answer)
        if sock is None and autostart:
            if not os.access(sd.path, os.W_OK):
                raise DaemonUnreachable(
                    f"no ticket daemon serves {sd.path}, and only its owner may start one "
                    "there; if it is the system daemon, it is down (an administrator: "
                    "`systemctl start hold-daemon`)"
                )
            from hold.client.autostart import start_daemon  # off the hot path: a daemon serves

            start_daemon(sd, timeout)
            sock = try_connect(sd.socket, sd, answer)
        if sock is None:
            raise DaemonUnreachable(f"no daemon answers on {sd.socket}")
        return cls(sd, sock)

    @classmethod
    def probe(cls, sd: StateDir) -> Client | None:
        """A session with a daemon that serves ``sd`` already; None if none
        answers (none is started: the caller decides, once it knows its
        configuration is good). :class:`DaemonSilent` if one is there but does
        not answer: asking it again would only wait as long again."""
        try:
            sock = try_connect(sd.socket, sd)
        except DaemonSilent:
            raise
        except DaemonUnreachable:
            return None
        if sock is None:
            return None
        client = cls(sd, sock)
        try:
            client.open_session()
        except WireMismatch:
            client.close()
            return None  # Client.with_session replaces it, where it may
        except (DaemonSilent, DaemonRefused):
            client.close()
            raise
        except (DaemonUnreachable, OSError, ProtocolError):
            client.close()
            return None
        return client

    @classmethod
    def with_session(
        cls, sd: StateDir, *, timeout: float = START_TIMEOUT, config: str | None = None
    ) -> Client:
        """A connection with an open session; retried through a daemon that
        is just leaving (an autostarted one exits when idle) or dying.

        ``config``: the fingerprint of our configuration (hold.config.fingerprint).
        A daemon of ours that reads another one is replaced if it is idle;
        :class:`ConfigMismatch` if it is busy. The system daemon's is the
        machine's, whatever ours says. A daemon of another release (another
        wire version) is replaced the same way; :class:`WireMismatch` where it
        stays (busy, or the system daemon).
        """
        client = cls.connect(sd, timeout=timeout)
        try:
            client.open_session()
        except WireMismatch as e:
            theirs = e.theirs
            return cls._replaced(
                client,
                timeout,
                f"speaks wire version {theirs!r} of hold (this client speaks {WIRE})",
                "Wait for its leases to end (a daemon of yours is then replaced; an "
                "administrator restarts the system daemon: `systemctl restart "
                "hold-daemon`), or use the release of hold that started it",
                lambda msg: WireMismatch(msg, theirs),
            )
        except DaemonSilent:
            client.close()
            raise
        except (DaemonUnreachable, OSError, ProtocolError):
            client.reopen(timeout)
        arbiter = client.info.get("arbiter") or {}
        if config is None or arbiter.get("kind") == "system":
            return client
        theirs = arbiter.get("config_digest")
        if theirs is None or theirs == config:
            return client
        # lazy: rare; hold.config is no part of a stack supervisor's memory
        from hold.config import config_path

        theirs_path, ours_path = arbiter.get("config"), config_path()
        if theirs_path is not None and theirs_path == ours_path:
            what = f"read {theirs_path} before the file changed"
            hint = "run `hold daemon --reload` to make it read the file again"
        else:
            what = (
                f"reads another configuration ({theirs_path or 'the defaults'}; this "
                f"command reads {ours_path or 'the defaults'})"
            )
            hint = "`hold daemon --reload` makes it read its file again"
        advice = f"Wait for its leases to end, or {hint}"
        return cls._replaced(client, timeout, what, advice, ConfigMismatch)

    @classmethod
    def _replaced(
        cls,
        client: Client,
        timeout: float,
        what: str,
        advice: str,
        error: Callable[[str], Exception],
    ) -> Client:
        """A session with a daemon started in place of ``client``'s, which
        ``what`` (reads another configuration, speaks another wire): asked to
        retire (an idle daemon of ours does), then waited out. Where it stays,
        ``error`` of a message naming the daemon, why it stays and ``advice``."""
        sd = client.sd
        pid = daemon_pid(sd, client.sock)
        ans = client.request({"op": Op.RETIRE})
        client.close()
        if ans.get("ev") != Ev.RETIRING:
            raise error(
                f"the ticket daemon for {sd.path} (pid {pid}) {what}, and cannot be "
                f"replaced now: {ans.get('error')}. {advice}"
            )
        _wait_gone(int(ans["pid"]), timeout)
        return cls.with_session(sd, timeout=timeout)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, *msgs: Message) -> None:
        """Send, bounded by the socket's send timeout (:class:`DaemonSilent` past it)."""
        try:
            self.sock.sendall(b"".join(encode({**m, "v": WIRE}) for m in msgs))
        except BlockingIOError:  # SO_SNDTIMEO: the daemon reads nothing
            raise DaemonSilent.of(self.sd, self.sock, ANSWER_TIMEOUT, "read") from None

    def recv(self, deadline: float | None = None) -> Message | None:
        """The next message; None at end of file. TimeoutError past ``deadline`` (monotonic)."""
        while not self.pending:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the daemon did not answer in time")
                if not select.select([self.sock], [], [], left)[0]:
                    continue
            data = self._recv(0)
            if not data:
                return None
            self.pending.extend(self.buf.feed(data))
        return self.pending.pop(0)

    def _recv(self, flags: int) -> bytes:
        """Bytes from the daemon, keeping any descriptors it sent with them (lock fds)."""
        try:
            data, fds = recv_fds(self.sock, 65536, 8, flags)
        except (ConnectionResetError, BrokenPipeError):
            return b""
        self.lock_fds.extend(fds)
        return data

    def read_available(self) -> list[Message] | None:
        """Messages that have arrived (without blocking); None once the daemon is gone."""
        data: bytes | None
        try:
            data = self._recv(MSG_DONTWAIT)
        except BlockingIOError:
            data = None
        except OSError:
            data = b""
        if data == b"":
            out, self.pending, self.events = self.events + self.pending, [], []
            return out or None
        if data:
            self.pending.extend(self.buf.feed(data))
        out, self.pending, self.events = self.events + self.pending, [], []
        return out

    def request(self, msg: Message, timeout: float = ANSWER_TIMEOUT) -> Message:
        """Send one message and return its answer; :class:`DaemonSilent` if none
        came within ``timeout``.

        What the daemon says of our lease meanwhile (expired, released: it
        may come before the answer) is not the answer: it is kept for
        :meth:`read_available`, where the lease's holder looks for it.

        A daemon that refused us and closed before we asked (over this user's
        limits) left its reason unread: that is the answer.
        """
        try:
            self.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            said = self._last_words()
            if said is None:
                raise
            return said
        deadline = time.monotonic() + timeout
        while True:
            try:
                ans = self.recv(deadline)
            except TimeoutError:
                raise DaemonSilent.of(self.sd, self.sock, timeout) from None
            if ans is None:
                raise DaemonUnreachable("the daemon closed the connection")
            if not _about_our_lease(ans):
                return ans
            self.events.append(ans)

    def _last_words(self) -> Message | None:
        """The error a daemon sent before it closed our connection, if it did."""
        try:
            said = self.recv(time.monotonic() + 0.5)
        except (TimeoutError, OSError, ProtocolError):
            return None
        return said if said is not None and said.get("ev") == Ev.ERROR else None

    def ping(self, timeout: float = ANSWER_TIMEOUT) -> None:
        """Does the daemon still read? Asked on this connection (``leases``: it
        changes nothing, and the daemon answers it from its event loop, even
        while it stops a tree or checks a device for us). Messages that came
        meanwhile are kept for the next :meth:`recv`, in order.
        :class:`DaemonSilent` if no answer within ``timeout``; None at once
        if the daemon closed the connection (the next read says so).
        """
        try:
            self.send({"op": Op.LEASES})
        except (BrokenPipeError, ConnectionResetError):
            return  # gone: the next read says so
        deadline = time.monotonic() + timeout
        kept: list[Message] = []
        try:
            while True:
                try:
                    msg = self.recv(deadline)
                except TimeoutError:
                    raise DaemonSilent.of(self.sd, self.sock, timeout) from None
                if msg is None or msg.get("ev") == Ev.LEASES:
                    return
                kept.append(msg)
        finally:
            self.pending[:0] = kept

    def recv_alive(self, deadline: float | None = None) -> Message | None:
        """:meth:`recv` for an answer that may take long (a tree stopped first),
        asking every :data:`ANSWER_TIMEOUT` of silence whether the daemon still
        reads (:meth:`ping`): :class:`DaemonSilent` if it does not, TimeoutError
        past ``deadline``."""
        while True:
            wake = time.monotonic() + ANSWER_TIMEOUT
            try:
                return self.recv(wake if deadline is None else min(wake, deadline))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            if not self.pending:
                self.ping()

    def request_renewing(self, msg: Message, timeout: float = ANSWER_TIMEOUT) -> Message:
        """:meth:`request`, asked again of a restarted daemon if ours went away
        meanwhile (our session re-attached where it was kept, else opened anew).
        Not of one that is there and does not answer: :class:`DaemonSilent`."""
        try:
            return self.request(msg, timeout)
        except DaemonSilent:
            raise
        except (DaemonUnreachable, OSError, ProtocolError):
            self.renew_session()
            return self.request(msg, timeout)

    def renew_session(self, timeout: float = START_TIMEOUT) -> None:
        """After the daemon went away: our session back (re-attached), or a new one."""
        if self.session is not None:
            ans = self.reattach(timeout)
            if ans.get("ev") == Ev.ATTACHED:
                return
        self.reopen(timeout)

    def ask(self, msg: Message, want: str, timeout: float = ANSWER_TIMEOUT) -> Message:
        """:meth:`request`, its answer of kind ``want``; :class:`DaemonRefused`
        with the daemon's words for an error (:class:`WireMismatch` where it
        refused our wire's version), never a typed answer's KeyError."""
        ans = self.request(msg, timeout)
        if ans.get("ev") == Ev.ERROR and "wire" in ans:
            raise WireMismatch(str(ans.get("error")), ans["wire"])
        if ans.get("ev") == Ev.ERROR:
            raise DaemonRefused(str(ans.get("error")), _code(ans))
        if ans.get("ev") != want:
            raise ProtocolError(f"unexpected answer to {msg.get('op')}: {ans.get('ev')!r}")
        return ans

    def open_session(self) -> str:
        """A session opened; :class:`WireMismatch` with a daemon of another
        wire (it refused us, or, older than versions, said its own)."""
        ans = self.ask({"op": Op.OPEN}, Ev.SESSION)
        theirs = (ans.get("arbiter") or {}).get("wire", UNVERSIONED)
        if theirs != WIRE:
            raise WireMismatch(
                f"the ticket daemon speaks wire version {theirs!r}; this client speaks {WIRE}",
                theirs,
            )
        self.session = str(ans["session"])
        self.info = ans
        return self.session

    def end(self, timeout: float = 60.0) -> Message | None:
        """End our session and wait until the daemon says it is over: trees
        stopped, tokens removed, devices free for the next. None if the daemon
        went away meanwhile (its successor ends the lease: we are gone by then),
        or if it stopped answering (:attr:`silent` says so; it ends the lease
        itself once it reads again, our connection closed): never longer
        than ``timeout``, nor :data:`ANSWER_TIMEOUT` without a word from it."""
        try:
            self.send({"op": Op.END})
            deadline = time.monotonic() + timeout
            while True:
                ans = self.recv_alive(deadline)
                if ans is None or ans.get("ev") in (Ev.ENDED, Ev.ERROR):
                    return ans
        except DaemonSilent as e:
            self.silent = e
            return None
        except (OSError, TimeoutError, ProtocolError):
            return None

    def reattach(self, timeout: float = START_TIMEOUT) -> Message:
        """After the daemon went away: connect again (starting one) and re-attach."""
        assert self.session is not None
        session = self.session

        def attach() -> Message:
            # Our lease's locks go back with the request: a restarted daemon
            # holds them again with us (checked there, not believed).
            msg = encode({"op": Op.ATTACH, "session": session, "v": WIRE})
            if self.lock_fds:
                send_fds(self.sock, msg, self.lock_fds)
            else:
                self.sock.sendall(msg)
            try:
                ans = self.recv(time.monotonic() + ANSWER_TIMEOUT)
            except TimeoutError:
                raise DaemonSilent.of(self.sd, self.sock, ANSWER_TIMEOUT) from None
            if ans is None:
                raise DaemonUnreachable("the daemon closed the connection")
            return ans

        return self._renew(attach, timeout)

    def reopen(self, timeout: float = START_TIMEOUT) -> None:
        """After the daemon went away before granting anything: a new connection
        and session (there is nothing to re-attach: a waiting request is not kept)."""
        self._renew(self.open_session, timeout)

    def _renew(self, first: Callable[[], T], timeout: float) -> T:
        """Connect again (starting a daemon if none answers), keeping our
        descriptor number, and make ``first`` the first exchange; retried
        until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                fresh = Client.connect(self.sd, timeout=max(0.5, deadline - time.monotonic()))
            except DaemonSilent:
                raise  # there, and not answering: not a daemon that is leaving
            except DaemonUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            # Keep our descriptor number: whoever polls it (the foreground
            # loop) now watches the new connection without being told.
            os.dup2(fresh.sock.fileno(), self.sock.fileno())
            fresh.sock.close()
            self.buf, self.pending = fresh.buf, []
            try:
                return first()
            except DaemonSilent:
                raise
            except (DaemonUnreachable, OSError, ProtocolError):
                # A SIGKILLed daemon's listener can outlive its connections by
                # an instant (the kernel releases them in turn), so the connect
                # above may have reached the dying daemon: try again.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        """Close the connection, then let go of the locks (the daemon has its own)."""
        self.sock.close()
        for fd in self.lock_fds:
            os.close(fd)
        self.lock_fds = []


def _code(ans: Message) -> int:
    """The exit status an error answer carries (the tool's failure if none)."""
    code = ans.get("code")
    return code if isinstance(code, int) and 0 < code < 256 else TOOL


def _wait_gone(pid: int, timeout: float) -> None:
    """Until ``pid`` has exited (a daemon that said it is leaving), at most ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone already
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def _about_our_lease(msg: Message) -> bool:
    """Is ``msg`` the daemon telling a holder of its lease, unasked (not an answer)?

    ``released`` is also the answer to ``hold release``; told to the holder,
    it names who released (``by``).
    """
    ev = msg.get("ev")
    return ev == Ev.EXPIRED or (ev == Ev.RELEASED and "by" in msg)
