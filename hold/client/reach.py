"""Reaching a daemon's socket: the connect, with its deadline, and the errors
of not reaching one (none listens, its backlog is full, it is another user's,
it does not answer in time).

Apart from :mod:`hold.client.connection` so that :mod:`hold.client.autostart`,
which probes the socket while it starts a daemon, needs nothing of the client.
"""

from __future__ import annotations

from hold.client import waits
from hold.errors import HoldError, describe
from hold.statedir import StateDir
from hold.unixsock import Socket, peer_pid, send_timeout, unix_stream
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.safefile import UnsafePath

# How long the daemon has to answer a request it answers from its event loop
# (open, tree, status, check, leases, report...): milliseconds when it is
# well; also the bound of a connect and of a send, and how long a wait that
# may last goes without a word before the daemon is asked whether it still
# reads (Client.ping).
ANSWER_TIMEOUT = waits.DAEMON  # 3 s unless HOLD_ANSWER_WAIT says (hold.client.waits)


class DaemonUnreachable(HoldError):
    """No daemon answered, and none could be started (exit 125)."""


class DaemonSilent(DaemonUnreachable, TimeoutError):
    """The daemon is there (its socket accepts) but did not answer in time:
    stopped, or stalled on a disk or a lock (exit 125: the tool failed).

    Also a :class:`TimeoutError`, as a read past its deadline was before.
    Not retried (a daemon that does not answer is not one that is leaving):
    the caller says so and stops waiting.
    """

    @classmethod
    def of(
        cls, sd: StateDir, sock: Socket | None, timeout: float, what: str = "answer"
    ) -> DaemonSilent:
        """The message: which daemon, where, did not do what, in how long (and
        why, where its process state says: stopped, or waiting on a disk)."""
        pid = daemon_pid(sd, sock)
        return cls(
            f"the ticket daemon (pid {pid}, {sd.path}) did not {what} within {timeout:g} s"
            f"{_state_hint(pid)}"
        )


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


def try_connect(
    path: str, sd: StateDir | None = None, timeout: float = ANSWER_TIMEOUT
) -> Socket | None:
    """Connected to ``path``, None if nothing listens there; the connect, and
    every later send, bounded by ``timeout`` (:class:`DaemonSilent` naming
    ``sd``'s daemon: its backlog full, it accepts nothing)."""
    sock = unix_stream()
    send_timeout(sock, timeout)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BlockingIOError:
        sock.close()
        if sd is None:
            raise DaemonUnreachable(
                f"nothing accepted a connection on {path} within {timeout:g} s"
            ) from None
        raise DaemonSilent.of(sd, None, timeout, "accept a connection") from None
    except PermissionError:
        sock.close()
        raise DaemonUnreachable(
            f"may not connect to {path} (permission denied): it is another user's daemon"
        ) from None
    except OSError as e:
        sock.close()
        raise DaemonUnreachable(f"cannot connect to {path}: {describe(e)}") from None
    return sock


def daemon_pid(sd: StateDir, sock: Socket | None) -> str:
    """Who serves ``sd``, for a message: the peer of our connection (the kernel
    says), else the pid in the daemon's lock file; ``?`` if neither says."""
    pid = peer_pid(sock) if sock is not None else None
    if pid is None:
        pid = sd.daemon_pid()
    return str(pid) if pid is not None else "?"


def _state_hint(pid: str) -> str:
    """Why a daemon may not answer, where its process state says so."""
    from hold_supervisor.proc.scan import stall_hint  # only once it did not answer

    return stall_hint(int(pid)) if pid.isdigit() else ""
