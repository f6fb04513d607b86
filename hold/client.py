"""Talking to the daemon: connect (starting it if none answers), ask, re-attach.

Autostart: a client that finds no daemon takes ``start.lock`` (so only one
client starts one), starts ``hold daemon --detach`` and waits for the socket
to answer, with a deadline. The daemon refuses to run twice for one state
directory, so a race past the lock still leaves exactly one.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from hold.errors import HoldError
from hold.protocol import LineBuffer, Message, ProtocolError, encode
from hold.statedir import StateDir
from supervisor.exitcodes import USAGE
from supervisor.safefile import UnsafePath, check_file, open_for_append, open_for_read

START_TIMEOUT = 10.0
T = TypeVar("T")


class DaemonUnreachable(HoldError):
    """No daemon answered, and none could be started (exit 125)."""


class ConfigMismatch(HoldError):
    """Our daemon reads another configuration and cannot be replaced now (exit 2)."""

    exit_code = USAGE


class UnsafeStateFile(UnsafePath, ConfigMismatch, DaemonUnreachable):
    """A file the daemon would write or read in its directory is not one it made
    (a symlink, a hard link, not ours): no daemon is started.

    Raised by the autostart before it spawns one. Caught as an
    :class:`UnsafePath` (exit 2, the message names the path), and where a
    client first connects as a :class:`ConfigMismatch` is (refused: exit 2,
    nothing started); later, while a command runs, as a
    :class:`DaemonUnreachable` (the daemon is lost, its command still stopped).
    """


class Client:
    """One connection to the daemon; its lifetime is the lifeline of any lease it holds."""

    def __init__(self, sd: StateDir, sock: socket.socket) -> None:
        self.sd = sd
        self.sock = sock
        self.buf = LineBuffer()
        self.pending: list[Message] = []
        self.session: str | None = None
        self.info: Message = {}  # what the daemon said when the session opened
        # The kernel locks of our lease's devices, shared with the daemon (see
        # hold.devlock): kept until the lease is over, handed back to a
        # restarted daemon when we re-attach.
        self.lock_fds: list[int] = []

    @classmethod
    def connect(cls, sd: StateDir, *, autostart: bool = True,
                timeout: float = START_TIMEOUT) -> Client:  # fmt: skip
        sock = _try_connect(sd.socket)
        if sock is None and autostart:
            if not os.access(sd.path, os.W_OK):
                raise DaemonUnreachable(
                    f"no ticket daemon serves {sd.path}, and only its owner may start one "
                    "there; if it is the system daemon, it is down (an administrator: "
                    "`systemctl start hold-daemon`)"
                )
            start_daemon(sd, timeout)
            sock = _try_connect(sd.socket)
        if sock is None:
            raise DaemonUnreachable(f"no daemon answers on {sd.socket}")
        return cls(sd, sock)

    @classmethod
    def with_session(
        cls, sd: StateDir, *, timeout: float = START_TIMEOUT, config: str | None = None
    ) -> Client:
        """A connection with an open session; retried through a daemon that
        is just leaving (an autostarted one exits when idle) or dying.

        ``config``: the fingerprint of our configuration (hold.config.fingerprint).
        A daemon of ours that reads another one is replaced if it is idle;
        :class:`ConfigMismatch` if it is busy. The system daemon's is the
        machine's, whatever ours says.
        """
        client = cls.connect(sd, timeout=timeout)
        try:
            client.open_session()
        except (DaemonUnreachable, OSError, ProtocolError):
            client.reopen(timeout)
        arbiter = client.info.get("arbiter") or {}
        if config is None or arbiter.get("kind") == "system":
            return client
        theirs = arbiter.get("config_digest")
        if theirs is None or theirs == config:
            return client
        ans = client.request({"op": "retire"})
        if ans.get("ev") != "retiring":
            client.close()
            raise ConfigMismatch(
                f"the ticket daemon for {sd.path} (pid {arbiter.get('pid')}) reads another "
                f"configuration ({arbiter.get('config') or 'the defaults'}) and cannot be "
                f"replaced now: {ans.get('error')}. Wait for its leases to end, or run "
                "`hold daemon --reload` if you changed the file it reads"
            )
        client.close()
        _wait_gone(int(ans["pid"]), timeout)
        return cls.with_session(sd, timeout=timeout)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, *msgs: Message) -> None:
        self.sock.sendall(b"".join(encode(m) for m in msgs))

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
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, 8, flags)
        except (ConnectionResetError, BrokenPipeError):
            return b""
        self.lock_fds.extend(fds)
        return data

    def read_available(self) -> list[Message] | None:
        """Messages that have arrived (without blocking); None once the daemon is gone."""
        data: bytes | None
        try:
            data = self._recv(socket.MSG_DONTWAIT)
        except BlockingIOError:
            data = None
        except OSError:
            data = b""
        if data == b"":
            out, self.pending = self.pending, []
            return out or None
        if data:
            self.pending.extend(self.buf.feed(data))
        out, self.pending = self.pending, []
        return out

    def request(self, msg: Message, timeout: float = 10.0) -> Message:
        """Send one message and return the first answer."""
        self.send(msg)
        ans = self.recv(time.monotonic() + timeout)
        if ans is None:
            raise DaemonUnreachable("the daemon closed the connection")
        return ans

    def request_renewing(self, msg: Message, timeout: float = 10.0) -> Message:
        """:meth:`request`, asked again of a restarted daemon if ours went away
        meanwhile (our session re-attached where it was kept, else opened anew)."""
        try:
            return self.request(msg, timeout)
        except (DaemonUnreachable, OSError, ProtocolError, TimeoutError):
            self.renew_session()
            return self.request(msg, timeout)

    def renew_session(self, timeout: float = START_TIMEOUT) -> None:
        """After the daemon went away: our session back (re-attached), or a new one."""
        if self.session is not None:
            ans = self.reattach(timeout)
            if ans.get("ev") == "attached":
                return
        self.reopen(timeout)

    def open_session(self) -> str:
        ans = self.request({"op": "open"})
        if ans.get("ev") != "session":
            raise ProtocolError(f"unexpected answer {ans}")
        self.session = str(ans["session"])
        self.info = ans
        return self.session

    def end(self, timeout: float = 60.0) -> Message | None:
        """End our session and wait until the daemon says it is over: trees
        stopped, tokens removed, devices free for the next. None if the daemon
        went away meanwhile (its successor ends the lease: we are gone by then)."""
        try:
            self.send({"op": "end"})
            deadline = time.monotonic() + timeout
            while True:
                ans = self.recv(deadline)
                if ans is None or ans.get("ev") in ("ended", "error"):
                    return ans
        except (OSError, TimeoutError, ProtocolError):
            return None

    def reattach(self, timeout: float = START_TIMEOUT) -> Message:
        """After the daemon went away: connect again (starting one) and re-attach."""
        assert self.session is not None
        session = self.session

        def attach() -> Message:
            # Our lease's locks go back with the request: a restarted daemon
            # holds them again with us (checked there, not believed).
            msg = encode({"op": "attach", "session": session})
            if self.lock_fds:
                socket.send_fds(self.sock, [msg], self.lock_fds)
            else:
                self.sock.sendall(msg)
            ans = self.recv(time.monotonic() + 10.0)
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


def _try_connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except PermissionError:
        sock.close()
        raise DaemonUnreachable(f"may not connect to {path} (permission denied): it is "
                                "another user's daemon") from None  # fmt: skip
    return sock


def start_daemon(sd: StateDir, timeout: float) -> None:
    """Start a daemon for ``sd`` unless one answers; wait until it does (or raise)."""
    import filelock  # off the hot path: only when no daemon answered

    deadline = time.monotonic() + timeout
    try:
        with filelock.FileLock(sd.start_lock, timeout=timeout):
            probe = _try_connect(sd.socket)
            if probe is not None:
                probe.close()
                return
            _check_state_files(sd)
            started = _spawn_daemon(sd, timeout)
            while time.monotonic() < deadline:
                probe = _try_connect(sd.socket)
                if probe is not None:
                    probe.close()
                    return
                if not started:
                    break  # it said it failed: no point waiting out the deadline
                time.sleep(0.01)
        if not started:
            raise DaemonUnreachable(f"the ticket daemon for {sd.path} failed to start: "
                                    f"{_last_line(sd.log)}")  # fmt: skip
    except filelock.Timeout:
        pass
    raise DaemonUnreachable(f"started a daemon for {sd.path}, but it did not answer within "
                            f"{timeout:g}s (see {sd.log})")  # fmt: skip


def _check_state_files(sd: StateDir) -> None:
    """Refuse (before a daemon is spawned, so that the user hears why) the files a
    daemon would write through or read: its log (our descriptor becomes its
    stderr), its lock (emptied and written) and its state (read at start)."""
    try:
        check_file(sd.log)
        check_file(sd.lock)
        check_file(sd.state, "read")
    except UnsafePath as e:
        raise UnsafeStateFile(f"no ticket daemon started: {e}", e.path) from None


def _last_line(path: str) -> str:
    try:
        fd = open_for_read(path, owned=False)
    except (OSError, UnsafePath):
        return "(no log)"
    with os.fdopen(fd, "rb") as f:
        f.seek(max(0, os.fstat(fd).st_size - 2000))
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(nothing in its log)"


def _spawn_daemon(sd: StateDir, timeout: float) -> bool:
    """Start ``hold daemon --detach``; True once it says it serves, False if it failed."""
    # Not through supervisor.spawn: the daemon must carry no HOLD_TREE marker
    # (it would be stopped with the tree of whoever started it), and it keeps
    # the variables that locate its state and configuration.
    # Nor the caller's NOTIFY_SOCKET: under systemd, `hold up` is the service
    # that says READY=1, not a daemon it happened to start.
    env = {k: v for k, v in os.environ.items() if k not in ("HOLD_TREE", "NOTIFY_SOCKET")}
    env["HOLD_STATE_DIR"] = sd.path
    try:
        log = open_for_append(sd.log)  # the daemon's stderr: never through a planted link
    except UnsafePath as e:
        raise UnsafeStateFile(f"no ticket daemon started: {e}", e.path) from None
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    # A client that re-attaches while it runs a command without a cgroup is a
    # child subreaper: the daemon, orphaned by --detach, would be re-parented
    # to it, taken for an adopted orphan of the command's tree, and stopped
    # with it. So it is no subreaper until the daemon has left (an orphan of
    # the tree in that instant is still found by its marker).
    from supervisor.reaper import become_subreaper, is_subreaper
    from supervisor.spawn import close_actions

    was_subreaper = is_subreaper()
    if was_subreaper:
        become_subreaper(False)
    try:
        pid = os.posix_spawn(
            sys.executable,
            [sys.executable, "-m", "hold", "daemon", "--detach"],
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, devnull, 1),
                (os.POSIX_SPAWN_DUP2, log, 2),
                # Nothing else of ours: the daemon outlives us, and a pipe of
                # ours held open by it would never see its end of file.
                *close_actions({log, devnull}),
            ],
            setsid=True,
        )
        # The first process forks the daemon, waits until it serves (or
        # fails, or `timeout` passes), says which by its exit status, and is
        # reaped here; the daemon itself is orphaned and nobody's zombie.
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) in (0, 3)  # 3: another one serves
    finally:
        os.close(log)
        os.close(devnull)
        if was_subreaper:
            become_subreaper(True)
