"""One guarded run's conversation with the ticket daemon, from its session to its end.

``hold run``/``npu-hold`` (:mod:`hold.cli.run`), ``--adopt`` (:mod:`hold.cli.adopt`)
and ``hold up`` (:mod:`hold.cli.up`) each run something under a lease: the same
session, the same wait in line, trees registered with the daemon (its
guardian, should this process die), what the daemon says while it runs, and
the lease's end. They differ only in what they run; this is the part they share.

Lifetime: :meth:`LeaseSession.open` connects (starting a daemon if none
answers) and opens the session; :meth:`~LeaseSession.end` ends the lease once
(whoever calls it first: a stack's stop, the run's way out, a signal), and
returns when the daemon has ended it, so the device is grantable when the
command returns; :meth:`~LeaseSession.close` closes the connection (the
daemon's lifeline: a session whose connection closes is ended by the daemon).

On the hot path of ``npu-hold``: nothing heavy is imported here at module level.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hold.client.connection import (
    Client,
    ConfigMismatch,
    DaemonSilent,
    DaemonUnreachable,
    WireMismatch,
)
from hold.client.lease import Granted, acquire_lease, daemon_event
from hold.errors import HoldError
from hold.protocol import Op, ProtocolError
from hold_supervisor.cause import Cause
from hold_supervisor.exitcodes import TOOL, USAGE

if TYPE_CHECKING:
    from hold.protocol import Message
    from hold.statedir import StateDir


class DaemonLost(HoldError):
    """The daemon went away (or stopped answering) during a request of this session."""

    exit_code = TOOL


class LeaseSession:
    """A session with the ticket daemon, at most one lease in it, and its end.

    ``client`` is None for a run without a guardian: no lease was needed and no
    daemon could be reached (the run is then stopped only while this process
    lives, which :meth:`open` has said).
    """

    def __init__(self, sd: StateDir, say: Callable[[str], None], client: Client | None) -> None:
        self.sd = sd
        self.say = say
        self.client = client
        self.granted: Granted | None = None
        self._ended = False
        self._send_lock = threading.Lock()  # a stack's start threads tell roots at once

    @classmethod
    def open(
        cls,
        sd: StateDir,
        say: Callable[[str], None],
        *,
        digest: str | None,
        needs_lease: bool,
        unguarded: tuple[str, str] = ("this command", "it is"),
        silent: Exception | None = None,
        client: Client | None = None,
    ) -> LeaseSession | int:
        """A session with the daemon that reads our configuration (``digest``); an
        exit status where none can be had and it matters.

        ``client``: a session opened already (``hold run``'s probe). ``silent``:
        that probe found the daemon silent; it is not asked twice. Where a lease
        is needed, an unreachable or silent daemon is fatal (125: nothing could
        be granted); where not, a warning, and the run goes on without a
        guardian. ``unguarded`` words that warning: what runs, and what is then
        stopped only while this process lives (``("this stack", "its units
        are")``).
        """
        if client is not None:
            return cls(sd, say, client)
        what, stopped = unguarded
        try:
            if silent is not None:
                raise silent
            return cls(sd, say, Client.with_session(sd, config=digest))
        except ConfigMismatch as e:
            say(str(e))
            return USAGE
        except WireMismatch as e:  # another release's daemon, busy: its leases stand
            say(str(e))
            return TOOL
        except DaemonSilent as e:
            if needs_lease:
                say(f"{e}; nothing was granted")
                return TOOL
            say(
                f"warning: {e}; {what} runs without a guardian: {stopped} stopped only "
                "while this process lives"
            )
        except (DaemonUnreachable, OSError, TimeoutError) as e:
            if needs_lease:
                say(f"cannot reach the ticket daemon: {e}")
                return TOOL
            say(
                f"warning: no guardian for {what} ({e}); {stopped} stopped only while "
                "this process lives"
            )
        return cls(sd, say, None)

    @property
    def guarded(self) -> bool:
        """Whether a daemon guards this run (it stops the run's trees if we die)."""
        return self.client is not None

    def fileno(self) -> int:
        """The connection, for a poll loop: readable when the daemon says something."""
        assert self.client is not None
        return self.client.fileno()

    def acquire(self, **how: Any) -> int | None:
        """Wait in line (:func:`~hold.client.lease.acquire_lease`, ``how`` its keywords);
        None once granted (:attr:`granted`, the environment filled in), else an
        exit status."""
        if self.client is None:
            return TOOL
        got = acquire_lease(self.client, self.sd, self.say, **how)
        if isinstance(got, int):
            return got
        self.granted = got
        return None

    def register(self, tree: dict[str, object]) -> Message:
        """The tree made known to the daemon (op ``tree``); its answer.

        :class:`DaemonLost` if the daemon does not answer or is gone (a restarted
        daemon is re-attached to first, see ``request_renewing``)."""
        assert self.client is not None
        try:
            return self.client.request_renewing({"op": Op.TREE, **tree})
        except (OSError, TimeoutError, DaemonUnreachable, ProtocolError) as e:
            raise DaemonLost(str(e)) from None

    def tell_root(self, tree_id: str, pid: int) -> None:
        """The pid of a tree's root, once it runs (no answer awaited; any thread)."""
        if self.client is None:
            return
        with self._send_lock:
            try:
                self.client.send({"op": Op.ROOT, "tree_id": tree_id, "pid": pid})
            except OSError:
                pass  # the daemon is gone: the poll loop hears it (event())

    def pending(self) -> bool:
        """Whether the daemon said something already read but not yet heard by
        :meth:`event` (no byte will wake a poll for it)."""
        return self.client is not None and bool(self.client.events)

    def event(self) -> Cause | None:
        """What the daemon said means for the run: a :class:`Cause` (``expired``,
        ``released``, ``lost``), or None (nothing to do)."""
        assert self.client is not None
        ev = daemon_event(self.client, self.say)
        return Cause(ev[0], detail=ev[1]) if ev is not None else None

    @property
    def holds_lease(self) -> bool:
        """Whether a lease was granted: by :meth:`acquire`'s return, or already by
        the daemon's message (its lock descriptors came with it) when a signal
        interrupts the wait in between."""
        return self.client is not None and (self.granted is not None or bool(self.client.lock_fds))

    def end(self, timeout: float = 60.0) -> None:
        """The lease ended, once; returns when the daemon has ended it (token gone,
        device grantable). Nothing to do without a lease, or the second time."""
        if self._ended or not self.holds_lease or self.client is None:
            return
        self._ended = True
        self.client.end(timeout=timeout)
        if self.client.silent is not None:
            self.say(
                f"warning: {self.client.silent} to end the lease; it ends it once it "
                "reads again (this connection is closed)"
            )

    def close(self) -> None:
        """The connection closed (for the daemon, the session's end if :meth:`end` was not)."""
        if self.client is not None:
            self.client.close()
