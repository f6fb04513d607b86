"""The ticket daemon: exclusive device leases, and the guardian of registered trees.

One thread runs the event loop (a ``selectors`` loop over the listening
socket, the clients, the pidfds of detached owners and a wakeup pipe), with
the next lease expiry as its only timeout: an idle daemon never wakes up.
Stopping a tree can take a grace period, so each stop runs in a worker
thread and reports back through the wakeup pipe; the devices of a lease stay
held until its trees are stopped and its tokens removed.

The lifeline: a lease lives as long as its client's connection. When the
connection drops, the lease's trees are stopped (with the survivor check),
its tokens removed, and only then is the device granted to the next in line.

Who is asking comes from the socket (``SO_PEERCRED``, and ``SO_PEERPIDFD``
where the kernel has it), never from a message. The daemon stops only trees a
client could have stopped itself: registered by a client of the same uid (or
root), rooted in a descendant of the client, and limited to processes that
uid may signal.

This module is the loop, its connections and its timers; the parts it owns:
:mod:`hold.daemon.grants` (lines, locks, scans, grants), :mod:`hold.daemon.sessions` (ending
and recovery), :mod:`hold.daemon.ops` (the handlers), over :mod:`hold.daemon.state`.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Any

from hold.daemon import listener
from hold.daemon.conn import Conn
from hold.daemon.grants import Grants
from hold.daemon.ops import Ops
from hold.daemon.records import Log
from hold.daemon.sessions import LIFELINE, Endings, recover
from hold.daemon.state import DaemonState, refuse
from hold.daemon.status import status
from hold.devices.classes import DeviceClass
from hold.documents import LeaseState
from hold.errors import HoldError, describe
from hold.protocol import Ev, ProtocolError
from hold.statedir import StateDir
from hold_supervisor.exitcodes import TOOL, USAGE
from hold_supervisor.proc.identity import user_name
from hold_supervisor.safefile import UnsafePath, open_for_update
from hold_supervisor.sigwake import drain
from hold_supervisor.stack.notify import tell_systemd

STOP_JOIN = 60.0  # seconds a stopping daemon waits for a stop in flight
NODE_EVENTS_PAUSE = 0.25  # seconds the loop looks away from the node events after a read
ACCEPT_PAUSE = 0.05  # seconds the loop stops listening when it has no descriptor left
PER_TURN = 32  # requests of one client handled in a turn of the loop, before the others' turn


class DaemonStartFailed(HoldError):
    """The daemon could not start serving (its socket, lock or log): why, in one line."""


class Daemon:
    def __init__(
        self,
        sd: StateDir,
        classes: dict[str, DeviceClass],
        *,
        shared: bool = False,
        home_tokens: bool = False,
        grant_busy: str = "wait",
        unreadable: str = "refuse",
        limits: tuple[int, int] = (256, 256),
        idle_exit: float | None = None,
        system: bool = False,
        config_path: str | None = None,
    ) -> None:
        self.st = DaemonState(
            sd,
            classes,
            shared=shared,
            home_tokens=home_tokens,
            grant_busy=grant_busy,
            unreadable=unreadable,
            limits=limits,
            idle_exit=idle_exit,
            system=system,
            config_path=config_path,
        )
        self.grants = Grants(self.st)
        self.endings = Endings(self.st, self.grants)
        self.ops = Ops(self.st, self.grants, self.endings)
        self.reload_asked = False  # SIGHUP
        self.idle_since: float | None = None
        self.lock_fd: int | None = None  # the state directory's daemon lock, held for life
        self.nodes_resume_at: float | None = None  # when the node events are read again
        self.listen_resume_at: float | None = None  # when new clients are taken again
        self.sock: socket.socket | None = None  # the listening socket, once it serves
        self.behind: set[Conn] = set()  # connections with requests read and not yet handled

    # ------------------------------------------------------------------ life

    def serve(self, ready_fd: int | None = None) -> int:
        """Run until SIGTERM/SIGINT. Returns the exit status (2: another daemon runs).

        ``ready_fd`` gets one byte once the socket serves ("1"), or when another
        daemon holds the lock ("2"); nothing if this one fails.
        """
        st = self.st
        try:
            if not self._lock_state_dir(ready_fd):
                return 2
            st.log = Log(st.sd.log)
            st.occupancy.log = st.log
            sock = listener.listen(st.sd.socket, st.shared)
            wake_r = self._start(sock, ready_fd)
        except OSError as e:
            # One line in the log (our stderr) that autostart's client repeats:
            # what failed, not a traceback ending in a repr.
            raise DaemonStartFailed(
                f"the ticket daemon could not start serving {st.sd.path}: {describe(e)}"
            ) from None
        try:
            while not st.stopping:
                self._turn(sock, wake_r)
        except Exception:
            # Outside a request (which ends only its own connection), an
            # exception is a bug that may have left a change half done, and a
            # loop that went on could grant a device twice. So the daemon ends:
            # leases and trees stay on disk, the next daemon (systemd's
            # Restart=always, or the next client's autostart) recovers them
            # from the ledger, and their holders re-attach.
            st.log.error("daemon_failed", error=traceback.format_exc(limit=12)[-4000:])
            raise
        finally:
            self._shut_down(sock)
        return 0

    def _lock_state_dir(self, ready_fd: int | None) -> bool:
        """Take the state directory's daemon lock; False if another daemon holds it."""
        # Never through a planted link (a symlink, or a hard link to a victim
        # we would truncate below): UnsafePath, exit 2.
        lock_fd = open_for_update(self.st.sd.lock)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(lock_fd, 32, 0).decode(errors="replace").strip()
            print(
                f"hold daemon: another daemon (pid {other or '?'}) already serves "
                f"{self.st.sd.path}",
                file=sys.stderr,
            )
            if ready_fd is not None:
                os.write(ready_fd, b"2")  # not a failure for whoever wants one to serve
            return False
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_fd = lock_fd
        return True

    def _start(self, sock: socket.socket, ready_fd: int | None) -> int:
        """Wire up the loop, recover the ledger, say we serve; the wakeup pipe's read end."""
        st = self.st
        assert st.log is not None
        wake_r, st.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.sock = sock
        st.sel.register(sock, selectors.EVENT_READ, ("listen", None))
        st.sel.register(wake_r, selectors.EVENT_READ, ("wake", None))
        self._listen_to_nodes()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        recover(st, self.grants, self.endings)
        st.log.info(
            "daemon_started",
            pid=os.getpid(),
            state_dir=st.sd.path,
            classes={k: st.sizes[k] for k in st.classes},
            config=st.config_path,
            arbiter="system" if st.system else "per-user",
        )
        tell_systemd("READY=1")
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
        self._note_idle()  # nobody may come at all: the idle clock starts now
        return wake_r

    def _turn(self, sock: socket.socket, wake_r: int) -> None:
        """One turn of the loop: the events, then what workers and timers left to do."""
        events = self.st.sel.select(self._next_timeout())
        # Leases whose time is up expire before anything that came meanwhile is
        # read. A holder's client ends its command at the limit by its own clock
        # and says it is done; a daemon run late (a loaded machine) read that
        # first and wrote the lease down as ended where it had expired.
        self._expire_leases(time.time(), time.monotonic())
        for key, mask in events:
            kind, obj = key.data
            if kind == "listen":
                self._accept(sock)
            elif kind == "conn":
                if mask & selectors.EVENT_WRITE and not obj.closed:
                    obj.flush()
                if mask & selectors.EVENT_READ and not obj.closed and not obj.unhandled:
                    self._on_readable(obj)
            elif kind == "wake":
                drain(wake_r)
            elif kind == "owner":
                self.endings.on_owner_exit(key.fd)
            elif kind == "blocker":
                self.grants.on_blocker_exit(key.fd)
            elif kind == "nodes":
                self._on_node_events()
        for conn in list(self.behind):
            self._handle_some(conn)
        self.grants.finish_locks()
        self.grants.finish_checks()
        self.endings.finish()
        self._run_timers()
        self._close_overflowed()
        if self.reload_asked:
            self.reload_asked = False
            self.ops.reload()
        self._note_idle()

    def _shut_down(self, sock: socket.socket) -> None:
        # Leases and trees stay on disk: a restarted daemon re-attaches them.
        # A stop in flight is finished first, not cut off half-way (bounded
        # by the longest grace it may wait, and the kill after it).
        self.st.workers.join(STOP_JOIN)
        self.endings.finish()
        assert self.st.log is not None
        self.st.log.info("daemon_stopping", sessions=len(self.st.sessions))
        sock.close()
        try:
            os.unlink(self.st.sd.socket)
        except OSError:
            pass

    def _listen_to_nodes(self) -> None:
        self.nodes_resume_at = None
        fd = self.st.occupancy.fileno()
        if fd is not None:
            self.st.sel.register(fd, selectors.EVENT_READ, ("nodes", None))

    def _on_node_events(self) -> None:
        """The kernel's opens and closes of the device nodes (see :mod:`hold.daemon.occupancy`).

        Read here so that the queue never fills; a grant reads it again before
        it believes a count. The watch of a node's directory sees every file
        opened there (``/dev/null`` beside ``/dev/nvidia0``), so after a read
        the loop looks away for :data:`NODE_EVENTS_PAUSE`: an idle daemon on a
        busy machine wakes at most a few times a second for them.
        """
        moved = self.st.occupancy.drain()
        self.grants.on_node_events(moved)
        fd = self.st.occupancy.fileno()
        if fd is not None:
            self.st.sel.unregister(fd)
            self.nodes_resume_at = time.monotonic() + NODE_EVENTS_PAUSE

    def _on_signal(self, signum: int, frame: object) -> None:
        self.st.stopping = True
        self.st.wake(b"s")

    def _on_hup(self, signum: int, frame: object) -> None:
        self.reload_asked = True
        self.st.wake(b"h")

    def status(self, viewer: int) -> dict[str, Any]:
        """Every device and its holder as ``viewer`` (a uid) may see it."""
        return status(self.st, self.grants, viewer)

    # ---------------------------------------------------------- connections

    def _accept(self, sock: socket.socket) -> None:
        try:
            conn = listener.accept(sock, self._want_write)
        except listener.OutOfDescriptors:
            # Every descriptor taken (a flood of connections, a low limit): the
            # client waits in the backlog. Not listening for a moment, or the
            # loop would spin on a socket it cannot accept from; a connection
            # that closes gives a descriptor back before then (issue 24's flood).
            self.st.sel.unregister(sock)
            self.listen_resume_at = time.monotonic() + ACCEPT_PAUSE
            return
        if conn is None:
            return
        st = self.st
        have = st.conns_of.get(conn.uid, 0)
        if conn.uid != 0 and have >= st.limits[0]:
            # Over this user's limit: told why, and closed at once (never kept,
            # never read): one user cannot take the daemon from the others.
            conn.send(
                {
                    "ev": Ev.ERROR,
                    "code": TOOL,
                    "error": f"user {user_name(conn.uid)} has {have} connections open to "
                    f"the ticket daemon, its limit (limits: {{connections: {st.limits[0]}}} "
                    f"in {st.config_path or 'the configuration'}); close some and ask again",
                }
            )
            conn.closed = True
            conn.drop_output()
            conn.sock.close()
            if conn.pidfd is not None:
                os.close(conn.pidfd)
            st.refused[conn.uid] = st.refused.get(conn.uid, 0) + 1
            if st.log is not None and st.refused[conn.uid] in (1, 10, 100, 1000, 10000):
                st.log.error("connections_over_limit", uid=conn.uid, refused=st.refused[conn.uid])
            return
        st.conns_of[conn.uid] = have + 1
        st.sel.register(conn.sock, selectors.EVENT_READ, ("conn", conn))

    def _want_write(self, conn: Conn, want: bool) -> None:
        if conn.overflow:
            self.st.overflowed.add(conn)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
        try:
            self.st.sel.modify(conn.sock, events, ("conn", conn))
        except (KeyError, ValueError):
            pass  # closed meanwhile

    def _close_overflowed(self) -> None:
        # Only those flagged (Conn.send): a look at every connection each turn
        # was most of the daemon's CPU with thousands open.
        while self.st.overflowed:
            conn = self.st.overflowed.pop()
            if not conn.closed:
                assert self.st.log is not None
                self.st.log.error(
                    "client_not_reading",
                    pid=conn.peer.pid,
                    uid=conn.uid,
                    unsent=sum(len(d) for d, _ in conn.out),
                )
                self._on_close(conn)

    def _on_readable(self, conn: Conn) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn.sock, 65536, 8)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        conn.close_fds()
        conn.fds = list(fds)
        if not data:
            conn.close_fds()
            self._on_close(conn)
            return
        try:
            conn.unhandled.extend(conn.buf.feed(data))
        except Exception as e:
            self._on_bad_request(conn, e)
            return
        if conn.unhandled:
            self.behind.add(conn)

    def _handle_some(self, conn: Conn) -> None:
        """Handle up to :data:`PER_TURN` of ``conn``'s requests; the rest wait for
        the next turn. A client that sends thousands at once (and never reads
        the answers) had them all handled in one turn: about a second of the
        daemon's CPU while everyone else waited (2.4 s for one status, beside
        busy loops). Its socket is not read again until they are all handled."""
        try:
            for _ in range(PER_TURN):
                if not conn.unhandled or conn.closed or conn.overflow:
                    break
                self.ops.dispatch(conn, conn.unhandled.popleft())
                conn.close_fds()  # only the message they came with may take them
        except Exception as e:
            # Whatever one client sends ends that client's connection, never
            # the daemon: other users' leases and trees depend on it.
            self._on_bad_request(conn, e)
        if not conn.unhandled or conn.closed or conn.overflow:
            self.behind.discard(conn)

    def _on_bad_request(self, conn: Conn, e: Exception) -> None:
        conn.close_fds()
        # The client's fault (a malformed message or field) or ours (a file of
        # the state directory, the lock directory, a bug): said as such, never
        # as the exception's repr (issue 24).
        ours = isinstance(e, (OSError, UnsafePath)) or not isinstance(
            e, (ProtocolError, KeyError, TypeError, ValueError)
        )
        code = TOOL if ours else USAGE
        if ours:
            what = (
                f"the ticket daemon failed on this request: {describe(e)} "
                f"(pid {os.getpid()}; its log {self.st.sd.log} has the details)"
            )
        elif isinstance(e, ProtocolError):
            what = str(e)
        elif isinstance(e, KeyError):
            what = f"bad request: no field {e.args[0] if e.args else '?'}"
        else:
            what = f"bad request: {e}"
        what = what[:600]
        if self.st.log is not None and ours:
            self.st.log.error(
                "request_failed",
                pid=conn.peer.pid,
                uid=conn.uid,
                error=traceback.format_exc(limit=8)[-2000:],
            )
        refuse(conn, what, code)
        self._on_close(conn)

    def _on_close(self, conn: Conn) -> None:
        try:
            self.st.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            return  # already closed (a bad message ends its connection once)
        conn.closed = True
        conn.unhandled.clear()
        self.behind.discard(conn)
        left = self.st.conns_of.get(conn.uid, 0) - 1
        if left > 0:
            self.st.conns_of[conn.uid] = left
        else:
            self.st.conns_of.pop(conn.uid, None)
        conn.flush()  # a last answer (an error) goes out if the socket takes it
        conn.drop_output()
        conn.sock.close()
        if conn.pidfd is not None:
            os.close(conn.pidfd)
        if conn.request is not None:
            self.grants.drop_request(conn.request)
        s = conn.session
        if s is not None and self.st.attached.get(s.session_id) is conn:
            del self.st.attached[s.session_id]
            if s.persistent:
                self.endings.end(s, LIFELINE)
            else:
                self.st.sessions.pop(s.session_id, None)
                self.endings.sweep_leaves(s)  # a leaf made, its tree not yet registered

    # ----------------------------------------------------------------- timers

    def _next_timeout(self) -> float | None:
        if self.behind:
            return 0.0  # requests read and not yet handled: the next turn is now
        now_wall, now_mono = time.time(), time.monotonic()
        deadlines = [
            s.lease.expires - now_wall
            for s in self.st.sessions.values()
            if s.lease is not None and s.lease.state == LeaseState.ACTIVE
        ]
        deadlines += [t - now_mono for t in self.endings.kill_at.values()]
        if self.grants.recheck_at is not None:
            deadlines.append(self.grants.recheck_at - now_mono)
        if self.endings.sweep_at is not None:
            deadlines.append(self.endings.sweep_at - now_mono)
        if self.nodes_resume_at is not None:
            deadlines.append(self.nodes_resume_at - now_mono)
        if self.listen_resume_at is not None:
            deadlines.append(self.listen_resume_at - now_mono)
        if self.st.idle_exit is not None and self.idle_since is not None:
            deadlines.append(self.idle_since + self.st.idle_exit - now_mono)
        return max(0.0, min(deadlines)) if deadlines else None

    def _note_idle(self) -> None:
        busy = (
            self.st.sessions
            or self.endings.ending
            or self.grants.verifying
            or self.grants.blocked
            or self.endings.unswept
            or any(k.data[0] == "conn" for k in self.st.sel.get_map().values())
        )
        if busy:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()

    def _run_timers(self) -> None:
        now_mono = time.monotonic()
        st = self.st
        if (
            st.idle_exit is not None
            and self.idle_since is not None
            and now_mono >= self.idle_since + st.idle_exit
        ):
            assert st.log is not None
            st.log.info("idle_exit", idle_s=round(now_mono - self.idle_since, 1))
            st.stopping = True
        if self.grants.recheck_at is not None and self.grants.recheck_at <= now_mono:
            self._recheck()
        if self.endings.sweep_at is not None and self.endings.sweep_at <= now_mono:
            self.endings.sweep_markers()
        if self.nodes_resume_at is not None and self.nodes_resume_at <= now_mono:
            self._listen_to_nodes()
        if self.listen_resume_at is not None and self.listen_resume_at <= now_mono:
            self.listen_resume_at = None
            assert self.sock is not None
            self.st.sel.register(self.sock, selectors.EVENT_READ, ("listen", None))
        # (Leases are expired at the start of each turn: see _turn.)
        for sid, t in list(self.endings.kill_at.items()):
            if t <= now_mono and sid in st.sessions:
                self.endings.end(st.sessions[sid], "expired, not stopped by the client")

    def _recheck(self) -> None:
        # Look again at what no kernel event will tell us about: a holder
        # outside any lease that closed the node without exiting, a lock
        # file we could not open (schedule tries those again). Scheduling
        # sets the timer again if needed.
        self.grants.recheck_at = None
        for key in list(self.grants.blocked):
            self.grants.unblock(key)
        for cls in self.st.classes:
            self.grants.schedule(cls)

    def _expire_leases(self, now_wall: float, now_mono: float) -> None:
        for s in list(self.st.sessions.values()):
            lease = s.lease
            if lease is not None and lease.state == LeaseState.ACTIVE and lease.expires <= now_wall:
                lease.state = LeaseState.EXPIRED
                self.st.save()
                self.st.log_for("expired", s)
                conn = self.st.attached.get(s.session_id)
                if conn is not None:
                    conn.send({"ev": Ev.EXPIRED, "grace": lease.grace})
                # The client stops its command within the grace; after that
                # (and a margin for the survivor check), the daemon does.
                self.endings.kill_at[s.session_id] = now_mono + lease.grace + 2.0
