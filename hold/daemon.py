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
"""

from __future__ import annotations

import fcntl
import os
import queue
import re
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
from typing import Any

from hold import devlock, ledger, occupancy
from hold.config import fingerprint
from hold.conn import Conn, Request
from hold.devices import DeviceClass
from hold.guard import judge
from hold.ledger import Lease, SessionRec, TreeRec
from hold.protocol import (
    Message,
    ProtocolError,
    check_label,
    flag_field,
    ints_field,
    number_field,
    text_field,
)
from hold.records import Log, Records
from hold.schedule import plan
from hold.statedir import StateDir
from hold.tokens import UnsafePath, remove_owned
from supervisor import procscan
from supervisor.cgroup import Leaf, v2_mount
from supervisor.exitcodes import TOOL, USAGE
from supervisor.identity import ProcessId, read_stat, user_name
from supervisor.stop import StopReport, stop_tree
from supervisor.tree import Tree, signalable_by

SO_PEERPIDFD = 77  # Linux 6.5; not yet in Python's socket module
RECHECK_BLOCKED = 30.0  # seconds between scans of a device held outside any lease
STOP_JOIN = 60.0  # seconds a stopping daemon waits for a stop in flight
_TREE_ID = re.compile(r"[0-9a-f]{8,32}")


class Daemon:
    def __init__(self, sd: StateDir, classes: dict[str, DeviceClass], *, shared: bool = False,
                 home_tokens: bool = False, grant_busy: str = "wait",
                 idle_exit: float | None = None, system: bool = False,
                 config_path: str | None = None) -> None:  # fmt: skip
        self.sd = sd
        self.config_path = config_path
        self.config_digest = fingerprint(config_path)
        self.reload_asked = False  # SIGHUP
        self.classes = classes
        # A device is its machine-wide identity (the node's device number):
        # the name of its kernel lock, shared with every other arbiter here.
        self.keys = {name: c.device_keys() for name, c in classes.items()}
        self.sizes = {name: len(keys) for name, keys in self.keys.items()}
        self.locks = devlock.Locks(devlock.lock_dir(), self._wake)
        # Devices whose kernel lock another arbiter holds: what its record says.
        self.elsewhere: dict[tuple[str, int], dict[str, Any]] = {}
        self.system = system
        self.shared = shared or system
        self.records = Records(sd, home_tokens, self._log)
        self.sel = selectors.DefaultSelector()
        self.sessions: dict[str, SessionRec] = {}
        self.attached: dict[str, Conn] = {}  # session id -> its connection
        self.queues: dict[str, list[Request]] = {name: [] for name in classes}
        self.held: dict[tuple[str, int], str] = {}  # (class, index) -> session id
        self.ending: set[str] = set()  # sessions whose trees are being stopped
        # Who waits for a session's end: (connection, the event to send it).
        self.release_waiters: dict[str, list[tuple[Conn, str]]] = {}
        self.kill_at: dict[str, float] = {}  # session id -> monotonic deadline
        self.watch: dict[int, str] = {}  # pidfd of a detached owner -> session id
        self.done: queue.SimpleQueue[tuple[str, list[StopReport], dict[int, Any]]] = (
            queue.SimpleQueue()
        )
        self.seq = 0
        self.stopping = False
        self.log: Log | None = None
        self.cg_mount = v2_mount()
        # Occupancy (see hold.occupancy): a device is scanned before each
        # grant; one held outside any lease is "blocked" until its holders
        # exit (their pidfds wake us) or a slow re-check finds it empty.
        self.grant_busy = grant_busy  # "wait" (the default) or "warn"
        self.scanned = {name: occupancy.has_nodes(c) for name, c in classes.items()}
        self.verifying: dict[tuple[str, int], Request] = {}
        self.blocked: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self.blocker_fds: dict[int, tuple[str, int]] = {}
        self.recheck_at: float | None = None
        self.stoppers: list[threading.Thread] = []  # stops in flight
        # An autostarted daemon leaves after this long with nothing to do (no
        # client, session, queue or stop); one run by systemd stays.
        self.idle_exit = idle_exit
        self.idle_since: float | None = None
        self.checks: queue.SimpleQueue[tuple[Request, str, list[int], dict[int, Any]]] = (
            queue.SimpleQueue()
        )

    # ------------------------------------------------------------------ life

    def serve(self, ready_fd: int | None = None) -> int:
        """Run until SIGTERM/SIGINT. Returns the exit status (2: another daemon runs).

        ``ready_fd`` gets one byte once the socket serves ("1"), or when another
        daemon holds the lock ("2"); nothing if this one fails.
        """
        from supervisor.safefile import open_for_update

        # Never through a planted link (a symlink, or a hard link to a victim
        # we would truncate below): UnsafePath, exit 2.
        lock_fd = open_for_update(self.sd.lock)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(lock_fd, 32, 0).decode(errors="replace").strip()
            print(f"hold daemon: another daemon (pid {other or '?'}) already serves "
                  f"{self.sd.path}", file=sys.stderr)  # fmt: skip
            if ready_fd is not None:
                os.write(ready_fd, b"2")  # not a failure for whoever wants one to serve
            return 2
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        self.log = Log(self.sd.log)

        listener = self._listen()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_w = wake_w
        self.sel.register(listener, selectors.EVENT_READ, ("listen", None))
        self.sel.register(wake_r, selectors.EVENT_READ, ("wake", None))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        self._recover()
        self.log.info("daemon_started", pid=os.getpid(), state_dir=self.sd.path,
                      classes={k: self.sizes[k] for k in self.classes}, config=self.config_path,
                      arbiter="system" if self.system else "per-user")  # fmt: skip
        _sd_notify("READY=1")
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
        self._note_idle()  # nobody may come at all: the idle clock starts now
        try:
            while not self.stopping:
                for key, mask in self.sel.select(self._next_timeout()):
                    kind, obj = key.data
                    if kind == "listen":
                        self._accept(listener)
                    elif kind == "conn":
                        if mask & selectors.EVENT_WRITE and not obj.closed:
                            obj.flush()
                        if mask & selectors.EVENT_READ and not obj.closed:
                            self._on_readable(obj)
                    elif kind == "wake":
                        _drain(wake_r)
                    elif kind == "owner":
                        self._on_owner_exit(key.fd)
                    elif kind == "blocker":
                        self._on_blocker_exit(key.fd)
                self._finish_locks()
                self._finish_checks()
                self._finish_stops()
                self._run_timers()
                self._close_overflowed()
                if self.reload_asked:
                    self.reload_asked = False
                    self._reload()
                self._note_idle()
        finally:
            # Leases and trees stay on disk: a restarted daemon re-attaches them.
            # A stop in flight is finished first, not cut off half-way (bounded
            # by the longest grace it may wait, and the kill after it).
            for worker in self.stoppers:
                worker.join(timeout=STOP_JOIN)
            self._finish_stops()
            self.log.info("daemon_stopping", sessions=len(self.sessions))
            listener.close()
            try:
                os.unlink(self.sd.socket)
            except OSError:
                pass
        return 0

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True
        os.write(self._wake_w, b"s")

    def _wake(self) -> None:
        """(Any thread) make the loop look at what a worker left for it."""
        os.write(self._wake_w, b"w")

    def _on_hup(self, signum: int, frame: object) -> None:
        self.reload_asked = True
        os.write(self._wake_w, b"h")

    def _reload(self) -> str | None:
        """Read the configuration again (SIGHUP, ``hold daemon --reload``); why not, or None.

        Refused, keeping the old one whole, when a class that has live leases
        or waiters would be dropped or would name other devices.
        """
        from hold.config import load
        from hold.devices import classes_from_config
        from supervisor.parse import BadValue

        assert self.log is not None
        try:
            cfg = load()
            classes = classes_from_config(cfg.devices, cfg.path)
        except BadValue as e:
            self.log.error("reload_refused", error=str(e))
            return str(e)
        keys = {name: c.device_keys() for name, c in classes.items()}
        live = {s.lease.cls for s in self.sessions.values() if s.lease is not None}
        live |= {cls for cls, q in self.queues.items() if q}
        live |= {c for c, _ in (*self.verifying, *self.blocked, *self.elsewhere)}
        for cls in sorted(live):
            if cls not in classes or keys[cls] != self.keys[cls]:
                how = "dropped" if cls not in classes else "changed"
                why = (f"class {cls} has live leases or waiters and would be {how} by "
                       f"{cfg.path or 'the defaults'}; nothing was changed")  # fmt: skip
                self.log.error("reload_refused", error=why)
                return why
        self.classes, self.keys = classes, keys
        self.sizes = {name: len(k) for name, k in keys.items()}
        self.queues = {name: self.queues.get(name, []) for name in classes}
        self.scanned = {name: occupancy.has_nodes(c) for name, c in classes.items()}
        self.grant_busy, self.records.home_tokens = cfg.busy_devices, cfg.home_tokens
        self.config_path, self.config_digest = cfg.path, fingerprint(cfg.path)
        self.log.info("config_reloaded", config=cfg.path, classes=dict(self.sizes))
        return None

    def _listen(self) -> socket.socket:
        path = self.sd.socket
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
        old = os.umask(0o111 if self.shared else 0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    # ---------------------------------------------------------- connections

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))  # fmt: skip
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
            return
        # With a pidfd, the peer is still the process that connected if the
        # pidfd has not signalled its exit (a live process keeps its pid).
        if pidfd is not None and _pidfd_exited(pidfd):
            sock.close()
            os.close(pidfd)
            return
        sock.setblocking(False)
        conn = Conn(sock, ProcessId(pid, start), uid, pidfd, self._want_write)
        self.sel.register(sock, selectors.EVENT_READ, ("conn", conn))

    def _want_write(self, conn: Conn, want: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
        try:
            self.sel.modify(conn.sock, events, ("conn", conn))
        except (KeyError, ValueError):
            pass  # closed meanwhile

    def _close_overflowed(self) -> None:
        for key in list(self.sel.get_map().values()):
            kind, conn = key.data
            if kind == "conn" and conn.overflow:
                assert self.log is not None
                self.log.error("client_not_reading", pid=conn.peer.pid, uid=conn.uid,
                               unsent=sum(len(d) for d, _ in conn.out))  # fmt: skip
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
            msgs = conn.buf.feed(data)
            for msg in msgs:
                if conn.closed or conn.overflow:
                    break
                self._dispatch(conn, msg)
                conn.close_fds()  # only the message they came with may take them
        except Exception as e:
            # Whatever one client sends ends that client's connection, never
            # the daemon: other users' leases and trees depend on it.
            conn.close_fds()
            what = str(e) if isinstance(e, ProtocolError) else f"bad request: {e!r}"[:300]
            if self.log is not None and not isinstance(e, (ProtocolError, KeyError, TypeError,
                                                           ValueError)):  # fmt: skip
                import traceback

                self.log.error("request_failed", pid=conn.peer.pid, uid=conn.uid,
                               error=traceback.format_exc(limit=8)[-2000:])  # fmt: skip
            refuse(conn, what)
            self._on_close(conn)

    def _on_close(self, conn: Conn) -> None:
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            return  # already closed (a bad message ends its connection once)
        conn.closed = True
        conn.flush()  # a last answer (an error) goes out if the socket takes it
        conn.drop_output()
        conn.sock.close()
        if conn.pidfd is not None:
            os.close(conn.pidfd)
        if conn.request is not None:
            self._drop_request(conn.request)
        s = conn.session
        if s is not None and self.attached.get(s.session_id) is conn:
            del self.attached[s.session_id]
            if s.persistent:
                self._end_session(s, "lifeline")
            else:
                self.sessions.pop(s.session_id, None)

    # ------------------------------------------------------------- requests

    def _dispatch(self, conn: Conn, msg: Message) -> None:
        op = msg.get("op")
        if op == "open":
            self._open(conn)
        elif op == "attach":
            self._attach(conn, text_field(msg, "session"))
        elif op == "acquire":
            self._acquire(conn, msg)
        elif op == "tree":
            self._register_tree(conn, msg)
        elif op == "root":
            self._register_root(conn, msg)
        elif op == "status":
            conn.send({"ev": "status", **self.status(conn.uid)})
        elif op == "release":
            self._release(conn, text_field(msg, "lease"))
        elif op == "end":
            self._end(conn)
        elif op == "leases":
            self._leases(conn)
        elif op == "check":
            self._check(conn, text_field(msg, "cls"))
        elif op == "retire":
            self._retire(conn)
        elif op == "reload":
            self._reload_op(conn)
        else:
            refuse(conn, f"unknown op {op!r}")

    def _open(self, conn: Conn) -> None:
        if conn.session is not None:
            refuse(conn, "session already open")
            return
        sid = os.urandom(8).hex()
        s = SessionRec(sid, conn.peer.pid, conn.peer.starttime, conn.uid, user_name(conn.uid))
        self.sessions[sid] = s
        self.attached[sid] = conn
        conn.session = s
        defs = {name: {"nodes": list(c.nodes), "shared_nodes": list(c.shared_nodes),
                       "visible_env": list(c.visible_env),
                       "allowed_holders": list(c.allowed_holders)}
                for name, c in self.classes.items()}  # fmt: skip
        conn.send({"ev": "session", "session": sid, "arbiter": self._arbiter(),
                   "classes": dict(self.sizes), "class_defs": defs})  # fmt: skip

    def _retire(self, conn: Conn) -> None:
        """Leave now, for a client of ours that reads another configuration
        (it starts a daemon with its own). Only an autostarted daemon, asked by
        its own user, with nothing to keep: no lease, tree or waiter of anyone."""
        others = [s for s in self.sessions.values() if s is not conn.session and s.persistent]
        waiting = sum(len(q) for q in self.queues.values())
        if self.system or self.idle_exit is None or conn.uid != os.geteuid():
            why = "this daemon was not started by a client of yours; it stays"
        elif others or waiting or self.ending:
            leases = [f"{s.lease.cls} lease {s.lease.lease_id} of {s.user} (pid {s.owner_pid})"
                      for s in others if s.lease is not None]  # fmt: skip
            why = (f"busy: {', '.join(leases) or f'{len(others)} guarded tree(s)'}"
                   f"{f', {waiting} waiting' if waiting else ''}")  # fmt: skip
        else:
            assert self.log is not None
            self.log.info("retiring", asked_by=conn.peer.pid, config=self.config_path)
            conn.send({"ev": "retiring", "pid": os.getpid()})
            self.stopping = True
            return
        refuse(conn, why)

    def _reload_op(self, conn: Conn) -> None:
        if conn.uid not in (0, os.geteuid()):
            refuse(conn, "only root or the daemon's own user "
                       "may reload its configuration")  # fmt: skip
            return
        why = self._reload()
        if why is not None:
            refuse(conn, why)
        else:
            conn.send({"ev": "reloaded", "config": self.config_path, "classes": dict(self.sizes)})

    def _attach(self, conn: Conn, sid: str) -> None:
        s = self.sessions.get(sid)
        if (
            s is None
            or sid in self.ending
            or (s.owner_pid, s.owner_start) != (conn.peer.pid, conn.peer.starttime)
            or sid in self.attached
        ):
            refuse(conn, f"no session {sid} to re-attach", TOOL)
            return
        for fd, wsid in list(self.watch.items()):
            if wsid == sid:
                self.sel.unregister(fd)
                os.close(fd)
                del self.watch[fd]
        self.attached[sid] = conn
        conn.session = s
        lease = s.lease
        if lease is not None:
            for i in lease.devices:
                self.locks.take_back(self.keys[lease.cls][i], conn.fds)
        conn.send({"ev": "attached", "lease": lease.to_json() if lease else None})
        if lease is not None and lease.state == "expired":
            conn.send({"ev": "expired", "grace": lease.grace})
        self._log("session_attached", s)

    def _acquire(self, conn: Conn, msg: Message) -> None:
        s = conn.session
        if s is None or s.lease is not None or conn.request is not None:
            refuse(conn, "acquire needs an open session "
                       "without a lease")  # fmt: skip
            return
        cls = text_field(msg, "cls")
        if cls not in self.classes:
            known = ", ".join(sorted(self.classes))
            refuse(conn, f"unknown device class {cls!r} (known: {known})")
            return
        size = self.sizes[cls]
        indices = ints_field(msg, "indices") or None
        allowed = ints_field(msg, "allowed")
        count = len(indices) if indices else number_field(msg, "count", int, 1)
        if count < 1 or count > size or (indices and any(i < 0 or i >= size for i in indices)):
            refuse(conn, f"{cls} has {size} device(s) here; "
                       f"cannot grant {indices or count}")  # fmt: skip
            return
        usable = None if allowed is None else frozenset(i for i in allowed if 0 <= i < size)
        if usable is not None and (len(usable) < count or (indices and not set(indices) <= usable)):
            refuse(conn, f"only {cls}:"
                       f"{','.join(map(str, sorted(usable))) or '(none)'} can be used from "
                       f"here; cannot grant {indices or count}")  # fmt: skip
            return
        label = text_field(msg, "label")
        why = check_label(label)
        ttl = number_field(msg, "ttl", float)
        grace = number_field(msg, "grace", float, 10.0)
        if why is None and not (0 < ttl <= 366 * 86400 and 0 <= grace <= 3600):
            why = f"time limit {ttl} s or grace {grace} s out of range"
        tree = self._tree_from(conn, msg.get("tree")) if msg.get("tree") else None
        if why is not None or (msg.get("tree") and tree is None):
            refuse(conn, why or "bad tree registration")
            return
        self.seq += 1
        req = Request(conn, self.seq, count, indices, label, ttl, grace, tree)
        req.wait = flag_field(msg, "wait", True)
        req.private = flag_field(msg, "private", False)
        req.allowed = usable
        conn.request = req
        self.queues[cls].append(req)
        self._schedule(cls)
        if conn.request is req and not req.wait and req.checking is None:
            # Not grantable now, and not being checked: busy. (One being
            # checked is answered when its scan is done: a free device with
            # nodes is granted to --no-wait too.)
            note = self._holders_note(cls, req)  # as it stands, before the line moves on
            self._drop_request(req)
            conn.send({"ev": "busy", **note, "position": 0})

    def _tree_from(self, conn: Conn, d: Any) -> TreeRec | None:
        """A tree registration, checked: a well-formed id, and a leaf the client owns."""
        if not isinstance(d, dict) or not _TREE_ID.fullmatch(str(d.get("tree_id", ""))):
            return None
        tree_id = str(d["tree_id"])
        grace = number_field(d, "grace", float, 10.0)
        if not 0 <= grace <= 3600:
            return None
        # An id is one tree: a client cannot take over another's by naming it
        # (the daemon would stop that tree when this client's connection ends).
        if any(tree_id in other.trees for other in self.sessions.values()
               if other is not conn.session):  # fmt: skip
            return None
        leaf = d.get("leaf")
        if leaf is not None:
            leaf = str(leaf)
            if (
                self.cg_mount is None
                or not os.path.realpath(leaf).startswith(self.cg_mount + "/")
                or os.path.basename(leaf) != f"hold-{tree_id}"
                or os.path.islink(leaf)
            ):
                return None
            try:
                st = os.stat(leaf)
            except OSError:
                return None
            if conn.uid != 0 and st.st_uid != conn.uid:
                return None
        return TreeRec(tree_id, leaf, conn.peer.starttime, grace)

    def _register_tree(self, conn: Conn, msg: Message) -> None:
        s = conn.session
        tree = self._tree_from(conn, msg) if s is not None else None
        if s is None or tree is None:
            refuse(conn, "bad tree registration")
            return
        s.trees[tree.tree_id] = tree
        self._save()
        self._log("tree_registered", s, tree=tree.tree_id, leaf=tree.leaf)
        conn.send({"ev": "ok", "tree": tree.tree_id})

    def _register_root(self, conn: Conn, msg: Message) -> None:
        """The spawned root of a registered tree: believed only if it descends from the client."""
        s = conn.session
        tree = s.trees.get(text_field(msg, "tree_id")) if s is not None else None
        pid = number_field(msg, "pid", int)
        if s is None or tree is None:
            return
        try:
            st = read_stat(pid)
        except Exception:
            return  # already gone: marker and leaf still find what it left
        chain = {a.pid for a in procscan.ancestors(pid)}
        if conn.peer.pid not in chain or not signalable_by(pid, conn.uid):
            self._log("tree_root_refused", s, tree=tree.tree_id, claimed_pid=pid,
                      peer_pid=conn.peer.pid, peer_uid=conn.uid)  # fmt: skip
            return
        tree.root_pid, tree.root_start, tree.pgid = pid, st.starttime, st.pgrp
        tree.sid = st.session if st.session == pid else None
        self._save()
        if s.lease is not None:
            self.records.write_tokens(s)

    def _release(self, conn: Conn, lease_id: str) -> None:
        target = next((s for s in self.sessions.values()
                       if s.lease and s.lease.lease_id == lease_id), None)  # fmt: skip
        if target is None:
            refuse(conn, f"no live lease {lease_id}")
            return
        if conn.uid not in (0, target.uid):
            refuse(conn, f"lease {lease_id} belongs to "
                       f"{target.user}; only that user or root may release it")  # fmt: skip
            return
        self.release_waiters.setdefault(target.session_id, []).append((conn, "released"))
        holder = self.attached.get(target.session_id)
        if holder is not None:
            holder.send({"ev": "released", "by": user_name(conn.uid)})
        self._end_session(target, f"released by {user_name(conn.uid)}")

    def _end(self, conn: Conn) -> None:
        """The holder is done: stop its trees, free its devices, then answer "ended".

        A client waits for this before it exits, so that when ``npu-hold``
        returns the lease is over: token gone, device grantable.
        """
        s = conn.session
        if s is None:
            refuse(conn, "no session to end")
            return
        if not s.persistent:
            self.sessions.pop(s.session_id, None)
            self.attached.pop(s.session_id, None)
            conn.session = None
            conn.send({"ev": "ended"})
            return
        self.release_waiters.setdefault(s.session_id, []).append((conn, "ended"))
        self._end_session(s, "ended by its holder")

    def _check(self, conn: Conn, cls: str) -> None:
        """``hold check``, answered for the asking process (the kernel says who it is)."""
        if cls not in self.classes:
            refuse(conn, "a device class: "
                       + ", ".join(sorted(self.classes)))  # fmt: skip
            return
        records = [self.records.record(s) for s in self.sessions.values()
                   if s.lease is not None and s.lease.state != "ending"]  # fmt: skip
        covered, why = judge(conn.peer, cls, records)
        conn.send({"ev": "check", "covered": covered, "why": why, "arbiter": self._arbiter()})

    def _leases(self, conn: Conn) -> None:
        """Every live lease, as the asker may see it (``hold audit`` believes only this)."""
        out = [self.records.record(s).seen_by(conn.uid, s.lease.private).to_json()
               for s in self.sessions.values() if s.lease is not None]  # fmt: skip
        conn.send({"ev": "leases", "leases": out})

    # ------------------------------------------------------------ scheduling

    def _drop_request(self, req: Request) -> None:
        req.conn.request = None
        for cls, q in self.queues.items():
            if req in q:
                q.remove(req)
                # Its reservation is gone: someone behind it may go now.
                self._schedule(cls)
                return

    def _schedule(self, cls: str) -> None:
        q = self.queues[cls]
        waiting = [r for r in q if r.checking is None]
        # A lock file we could not open is tried again now (no event says it
        # was fixed); one that another arbiter holds has its waiter thread.
        for dev in [d for d, rec in self.elsewhere.items() if d[0] == cls and "error" in rec]:
            del self.elsewhere[dev]
        while True:
            # A device is busy by its key: another class may name the same node.
            busy = {self._key(k) for k in (*self.held, *self.verifying, *self.blocked)}
            free = [i for i, key in enumerate(self.keys[cls])
                    if key not in busy and (cls, i) not in self.elsewhere]  # fmt: skip
            grants = plan(free, waiting)
            # Each device to grant (or check) needs its machine-wide lock first;
            # one that another arbiter holds is out of the plan: plan again.
            if all(self._lock(cls, i) for _, devices in grants for i in devices):
                break
        for pos, devices in reversed(grants):
            req = waiting[pos]
            if self.scanned[cls]:
                self._verify(cls, req, devices)
            else:
                q.remove(req)
                self._grant(cls, req, devices)
        self._release_idle_locks()
        self._notify_queue(cls)

    # ---------------------------------------------------------- kernel locks

    def _key(self, device: tuple[str, int]) -> str:
        return self.keys[device[0]][device[1]]

    def _lock(self, cls: str, index: int) -> bool:
        """Hold ``cls:index``'s machine-wide lock (True), or note who does (False)."""
        who = self.locks.take(self.keys[cls][index])
        if who is None:
            return True
        self.elsewhere[(cls, index)] = who
        if "error" in who:  # nothing to wait on: looked at again by the re-check
            self.recheck_at = time.monotonic() + RECHECK_BLOCKED
        return False

    def _finish_locks(self) -> None:
        """Locks another arbiter let go of (now ours): the lines waiting for them move."""
        done = self.locks.collect()
        if not done:
            return
        classes = {c for (c, i) in self.elsewhere if self.keys[c][i] in done}
        for dev in [d for d in self.elsewhere if self._key(d) in done]:
            del self.elsewhere[dev]
        for c in classes:
            self._schedule(c)
        self._release_idle_locks()

    def _release_idle_locks(self) -> None:
        """Let go of every lock no lease of ours holds and no grant is being checked for."""
        self.locks.release_unused({self._key(k) for k in (*self.held, *self.verifying)})

    # ------------------------------------------------------------ occupancy

    def _verify(self, cls: str, req: Request, devices: list[int]) -> None:
        """Scan ``devices`` in a worker before granting them to ``req``."""
        req.checking = devices
        for i in devices:
            self.verifying[(cls, i)] = req

        def work() -> None:
            try:
                found = occupancy.holders_of(self.classes[cls], devices)
            except Exception as e:  # a failed scan must not grant a device blindly
                found = {devices[0]: [{"pid": 0, "user": "?", "command": f"scan failed: {e!r}",
                                       "starttime": 0, "memory_bytes": None}]}  # fmt: skip
            self.checks.put((req, cls, devices, found))
            os.write(self._wake_w, b"c")

        threading.Thread(target=work, daemon=True).start()

    def _finish_checks(self) -> None:
        while True:
            try:
                req, cls, devices, found = self.checks.get_nowait()
            except queue.Empty:
                return
            for i in devices:
                self.verifying.pop((cls, i), None)
            req.checking = None
            q = self.queues[cls]
            if req not in q:  # the client left meanwhile
                self._schedule(cls)
                continue
            if found and self.grant_busy == "wait":
                for i, holders in found.items():
                    self._block(cls, i, holders)
                if req.conn.session is not None:
                    self._log("grant_blocked", req.conn.session, devices=devices,
                              holders={str(i): h for i, h in found.items()})  # fmt: skip
                if not req.wait:
                    q.remove(req)
                    req.conn.request = None
                    req.conn.send({"ev": "busy", **self._holders_note(cls, req)})
                self._schedule(cls)
                continue
            if found:
                busy = [{"index": i, "holders": h} for i, h in found.items()]
                req.conn.send({"ev": "warning", "cls": cls, "blocked": busy})
            q.remove(req)
            self._grant(cls, req, devices)
            self._schedule(cls)

    def _block(self, cls: str, index: int, holders: list[dict[str, Any]]) -> None:
        """Keep ``cls:index`` from being granted until its holders are gone."""
        self.blocked[(cls, index)] = holders
        for h in holders:
            try:
                fd = os.pidfd_open(int(h["pid"]))
            except OSError:
                continue  # gone already: the re-check below will see it
            self.blocker_fds[fd] = (cls, index)
            self.sel.register(fd, selectors.EVENT_READ, ("blocker", None))
        # A holder may close the node without exiting; look again now and then.
        self.recheck_at = time.monotonic() + RECHECK_BLOCKED

    def _unblock(self, key: tuple[str, int]) -> None:
        self.blocked.pop(key, None)
        for fd, k in list(self.blocker_fds.items()):
            if k == key:
                self.sel.unregister(fd)
                os.close(fd)
                del self.blocker_fds[fd]
        if not self.blocked:
            self.recheck_at = None

    def _on_blocker_exit(self, fd: int) -> None:
        key = self.blocker_fds.get(fd)
        if key is not None:
            self._unblock(key)  # the next grant scans it again
            self._schedule(key[0])

    def _grant(self, cls: str, req: Request, devices: list[int]) -> None:
        conn = req.conn
        conn.request = None
        s = conn.session
        assert s is not None
        now = time.time()
        lease = Lease(os.urandom(4).hex(), cls, devices, req.label, now, now + req.ttl, req.grace)
        s.lease = lease
        if req.tree is not None:
            s.trees[req.tree.tree_id] = req.tree
        for i in devices:
            self.held[(cls, i)] = s.session_id
        lease.private = req.private
        # On disk before anyone is told: a restarted daemon must know.
        self._save()
        try:
            self.records.write_tokens(s)
            owner = self._lock_record(s)
            for i in devices:
                devlock.write_owner(self.locks.fds[self.keys[cls][i]], owner)
        except (UnsafePath, OSError, ValueError) as e:
            self._log("grant_refused", s, error=str(e))
            refuse(conn, f"cannot record the lease: {e}", TOOL)
            s.lease = None
            for i in devices:
                del self.held[(cls, i)]
                try:
                    remove_owned(self.sd.token(cls, i), self.sd.path)
                except (UnsafePath, OSError):
                    pass  # the symlink we refused to write through stays as it was
            self._save()
            self._schedule(cls)
            return
        self._log("granted", s, label=req.label, devices=devices, expires=lease.expires)
        # The client holds the locks with us (one open file description each):
        # neither one's death alone lets another arbiter grant the devices.
        conn.send({"ev": "granted", "lease": lease.lease_id, "cls": cls, "devices": devices,
                   "expires": lease.expires, "granted": now},
                  fds=[self.locks.fds[self.keys[cls][i]] for i in devices])  # fmt: skip

    def _lock_record(self, s: SessionRec) -> dict[str, Any]:
        """What a lock file says of its lease, for waiters served by other arbiters."""
        assert s.lease is not None
        rec = {"uid": s.uid, "user": s.user, "pid": s.owner_pid, "start": s.owner_start,
               "since": s.lease.granted, "until": s.lease.expires, "lease": s.lease.lease_id,
               "cls": s.lease.cls, "arbiter": self.sd.path, "daemon_pid": os.getpid()}  # fmt: skip
        if not s.lease.private:
            rec["label"] = s.lease.label
        return rec

    def _holders_note(self, cls: str, req: Request) -> dict[str, Any]:
        q = self.queues[cls]
        position = q.index(req) + 1 if req in q else 0
        blocked = [{"index": i, "holders": h} for (c, i), h in sorted(self.blocked.items())
                   if c == cls]  # fmt: skip
        elsewhere = [{"index": i, **rec} for (c, i), rec in sorted(self.elsewhere.items())
                     if c == cls]  # fmt: skip
        viewer = req.conn.uid
        return {"cls": cls, "position": position, "holders": self._holders(cls, viewer),
                "blocked": blocked, "elsewhere": elsewhere}  # fmt: skip

    def _holders(self, cls: str, viewer: int) -> list[dict[str, Any]]:
        out = []
        seen: set[str] = set()
        for (c, _i), sid in sorted(self.held.items()):
            s = self.sessions.get(sid)
            if c != cls or sid in seen or s is None or s.lease is None:
                continue
            seen.add(sid)
            out.append({"lease": s.lease.lease_id, "label": _label_for(s, viewer),
                        "pid": s.owner_pid,
                        "user": s.user, "since": s.lease.granted, "expires": s.lease.expires,
                        "devices": s.lease.devices, "state": s.lease.state})  # fmt: skip
        return out

    def _notify_queue(self, cls: str) -> None:
        """Tell each waiter where it stands, only when that has changed."""
        for req in self.queues.get(cls, []):
            note = self._holders_note(cls, req)
            if note != req.conn.last_note:
                req.conn.last_note = note
                req.conn.send({"ev": "queued", **note})

    # ------------------------------------------------------- ending sessions

    def _end_session(self, s: SessionRec, reason: str) -> None:
        """Stop the session's trees in a worker; the lease ends when they are stopped."""
        if s.session_id in self.ending:
            return
        self.ending.add(s.session_id)
        self.kill_at.pop(s.session_id, None)
        if s.lease is not None:
            s.lease.state = "ending"
        self._save()
        self._log("session_ending", s, reason=reason)
        # A lease's grace, else the longest its trees asked for (hold run).
        # Each tree with its own grace (a stack's units each asked for theirs);
        # the lease's for whoever is left on its devices.
        grace = s.lease.grace if s.lease else max((t.grace for t in s.trees.values()), default=10.0)
        trees = [(self._tree_of(s, t), t.grace) for t in s.trees.values()]
        devices = (
            (s.lease.cls, s.lease.devices, s.lease.granted)
            if s.lease and self.scanned[s.lease.cls]
            else None
        )
        uid = _limit_uid(s.uid)
        if not trees and devices is None:
            # Nothing to stop or scan: end it in this turn of the loop (a
            # thread's start-up would be most of the handoff's latency).
            self.done.put((s.session_id, [], {}))
            return
        args = (s.session_id, trees, grace, devices, uid)
        worker = threading.Thread(target=self._stop_worker, args=args, daemon=True)
        self.stoppers = [t for t in self.stoppers if t.is_alive()]
        self.stoppers.append(worker)
        worker.start()

    def _tree_of(self, s: SessionRec, t: TreeRec) -> Tree:
        root = ProcessId(t.root_pid, t.root_start) if t.root_pid and t.root_start else None
        return Tree(
            t.tree_id, root, t.pgid, t.sid,
            leaf=Leaf(t.leaf) if t.leaf else None,
            since=t.since,
            # Running as root for another user: no further than that user could go.
            uid=_limit_uid(s.uid),
        )  # fmt: skip

    def _stop_worker(self, sid: str, trees: list[tuple[Tree, float]], grace: float,
                     devices: tuple[str, list[int], float] | None,
                     uid: int | None) -> None:  # fmt: skip
        reports = []
        left: dict[int, Any] = {}
        for tree, tree_grace in trees:
            try:
                report = stop_tree(tree, grace=tree_grace)
                reports.append(report)
                if tree.leaf is not None and report.ok:
                    # The client normally removes its leaf; if it died, we do.
                    tree.leaf.remove(os.path.dirname(tree.leaf.path))
            except Exception as e:  # never let a stop kill the daemon silently
                assert self.log is not None
                self.log.error("stop_failed", session=sid, tree=tree.tree_id, error=repr(e))
        if devices is not None:
            # Whoever still holds the lease's devices is a survivor of the
            # lease (started inside it, or slipped in during it): stopped
            # before anyone else is granted them.
            try:
                more, left = occupancy.stop_leftovers(self.classes[devices[0]], devices[1],
                                                      uid=uid, grace=grace,
                                                      granted=devices[2])  # fmt: skip
                reports += more
            except Exception as e:
                assert self.log is not None
                self.log.error("leftover_scan_failed", session=sid, error=repr(e))
        self.done.put((sid, reports, left))
        os.write(self._wake_w, b"d")

    def _finish_stops(self) -> None:
        while True:
            try:
                sid, reports, left = self.done.get_nowait()
            except queue.Empty:
                return
            s = self.sessions.pop(sid, None)
            self.ending.discard(sid)
            if s is None:
                continue
            survivors = [sv._asdict() for r in reports for sv in r.survivors]
            for r in reports:
                if isinstance(r, occupancy.LeftoverStop):
                    # Someone used the lease's device without a ticket: whose it was.
                    h = r.holder
                    self._log("leftover_stopped", s, holder_pid=h["pid"], holder_user=h["user"],
                              holder_uid=h["uid"], command=h["command"], node=h["node"],
                              device=f"{h['class']}:{h['device']}", tree=r.tree_id,
                              outcome=r.outcome, ok=r.ok)  # fmt: skip
                self._log("tree_stopped", s, tree=r.tree_id, outcome=r.outcome,
                          stopped=len(r.stopped), killed=len(r.killed),
                          duration_ms=round(r.duration * 1000, 1), survivors=survivors,
                          holders_after=[h._asdict() for h in r.holders_after])  # fmt: skip
            cls = s.lease.cls if s.lease else None
            if s.lease is not None:
                self.records.remove_tokens(s)
                for i in s.lease.devices:
                    self.held.pop((s.lease.cls, i), None)
                for i, holders in left.items():
                    # Could not be stopped (another user's, unkillable, or older
                    # than the lease): out of reach until they are gone -- unless
                    # busy devices are granted with a warning anyway.
                    if self.grant_busy == "wait":
                        self._block(s.lease.cls, i, holders)
                    self._log("device_still_held", s, device=i, holders=holders)
            self._save()
            self._log("session_ended", s)
            owner = self.attached.pop(sid, None)
            if owner is not None:
                owner.session = None
            for waiter, ev in self.release_waiters.pop(sid, []):
                waiter.send({"ev": ev, "survivors": survivors})
            if cls is not None:
                self._schedule(cls)
                self.records.remember(s)  # after the next grant: it is not on the handoff's path
            self._release_idle_locks()

    # ----------------------------------------------------------------- timers

    def _next_timeout(self) -> float | None:
        now_wall, now_mono = time.time(), time.monotonic()
        deadlines = [
            s.lease.expires - now_wall
            for s in self.sessions.values()
            if s.lease is not None and s.lease.state == "active"
        ]
        deadlines += [t - now_mono for t in self.kill_at.values()]
        if self.recheck_at is not None:
            deadlines.append(self.recheck_at - now_mono)
        if self.idle_exit is not None and self.idle_since is not None:
            deadlines.append(self.idle_since + self.idle_exit - now_mono)
        return max(0.0, min(deadlines)) if deadlines else None

    def _note_idle(self) -> None:
        busy = (
            self.sessions or self.ending or self.verifying or self.blocked
            or any(k.data[0] == "conn" for k in self.sel.get_map().values())
        )  # fmt: skip
        if busy:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()

    def _run_timers(self) -> None:
        now_wall, now_mono = time.time(), time.monotonic()
        if (
            self.idle_exit is not None
            and self.idle_since is not None
            and now_mono >= self.idle_since + self.idle_exit
        ):
            assert self.log is not None
            self.log.info("idle_exit", idle_s=round(now_mono - self.idle_since, 1))
            self.stopping = True
        if self.recheck_at is not None and self.recheck_at <= now_mono:
            # Look again at what no kernel event will tell us about: a holder
            # outside any lease that closed the node without exiting, a lock
            # file we could not open (_schedule tries those again). Scheduling
            # sets the timer again if needed.
            self.recheck_at = None
            for key in list(self.blocked):
                self._unblock(key)
            for cls in self.classes:
                self._schedule(cls)
        for s in list(self.sessions.values()):
            lease = s.lease
            if lease is not None and lease.state == "active" and lease.expires <= now_wall:
                lease.state = "expired"
                self._save()
                self._log("expired", s)
                conn = self.attached.get(s.session_id)
                if conn is not None:
                    conn.send({"ev": "expired", "grace": lease.grace})
                # The client stops its command within the grace; after that
                # (and a margin for the survivor check), the daemon does.
                self.kill_at[s.session_id] = now_mono + lease.grace + 2.0
        for sid, t in list(self.kill_at.items()):
            if t <= now_mono and sid in self.sessions:
                self._end_session(self.sessions[sid], "expired, not stopped by the client")

    # --------------------------------------------------------------- recovery

    def _recover(self) -> None:
        """Re-read the state: live owners may re-attach; dead owners' trees are stopped."""
        for s in ledger.load(self.sd.state):
            if s.lease is not None and s.lease.cls not in self.classes:
                # Its class is gone from the configuration: its devices cannot
                # be named any more, but its trees are still stopped.
                self._log("recovered_unknown_class", s, cls=s.lease.cls)
                s.lease = None
            self.sessions[s.session_id] = s
            if s.lease is not None:
                for i in s.lease.devices:
                    self.held[(s.lease.cls, i)] = s.session_id
                    # Ours again if the holder died with the old daemon; else
                    # the holder hands its descriptor back when it re-attaches.
                    self.locks.take_if_free(self.keys[s.lease.cls][i])
            owner = ProcessId(s.owner_pid, s.owner_start)
            fd: int | None = None
            try:
                fd = os.pidfd_open(s.owner_pid)
            except OSError:
                pass
            if fd is None or not owner.is_running() or _pidfd_exited(fd):
                if fd is not None:
                    os.close(fd)
                self._log("recovered_dead_owner", s)
                self._end_session(s, "owner died while the daemon was down")
                continue
            self.watch[fd] = s.session_id
            self.sel.register(fd, selectors.EVENT_READ, ("owner", None))
            self._log("recovered_live_owner", s)

    def _on_owner_exit(self, fd: int) -> None:
        sid = self.watch.pop(fd, None)
        self.sel.unregister(fd)
        os.close(fd)
        if sid is not None and sid in self.sessions:
            self._end_session(self.sessions[sid], "owner exited while detached")

    # ---------------------------------------------------------------- records

    def _save(self) -> None:
        ledger.save(self.sd.state, list(self.sessions.values()))

    def _log(self, event: str, s: SessionRec, **kw: Any) -> None:
        if self.log is not None:
            lease = s.lease.lease_id if s.lease else None
            self.log.info(event, session=s.session_id, lease=lease, pid=s.owner_pid,
                          user=s.user, **kw)  # fmt: skip

    def _arbiter(self) -> dict[str, Any]:
        """Which arbiter this is: the machine's system daemon, or one user's own."""
        return {"kind": "system" if self.system else "per-user", "state_dir": self.sd.path,
                "pid": os.getpid(), "user": user_name(os.geteuid()),
                "config": self.config_path, "config_digest": self.config_digest,
                "autostarted": self.idle_exit is not None}  # fmt: skip

    def status(self, viewer: int) -> dict[str, Any]:
        """Every device and its holder as ``viewer`` (a uid) may see it: labels of
        private leases only for their owner and root. Devices leased through
        another arbiter (another user's daemon) are shown from their lock's record."""
        locked = devlock.locked_inodes()
        classes = {}
        for cls in self.classes:
            devices = []
            for i in range(self.sizes[cls]):
                sid = self.held.get((cls, i))
                s = self.sessions.get(sid) if sid else None
                holder = None
                if s is not None and s.lease is not None:
                    holder = {"lease": s.lease.lease_id, "label": _label_for(s, viewer),
                              "pid": s.owner_pid, "user": s.user, "since": s.lease.granted,
                              "expires": s.lease.expires, "state": s.lease.state}  # fmt: skip
                elif (rec := self.locks.held_elsewhere(self.keys[cls][i], locked)) is not None:
                    holder = {"lease": rec.get("lease", "?"), "label": rec.get("label"),
                              "pid": rec.get("pid"), "user": rec.get("user", "?"),
                              "since": rec.get("since"), "expires": rec.get("until"),
                              "state": "elsewhere", "arbiter": rec.get("arbiter")}  # fmt: skip
                devices.append({"index": i, "holder": holder})
            waiting = [{"label": r.label if viewer in (0, r.conn.uid) or not r.private
                        else None, "pid": r.conn.peer.pid, "user": user_name(r.conn.uid),
                        "count": r.count, "indices": r.indices}
                       for r in self.queues[cls]]  # fmt: skip
            classes[cls] = {"devices": devices, "queue": waiting}
        return {"classes": classes, "arbiter": self._arbiter()}


def _label_for(s: SessionRec, viewer: int) -> str | None:
    assert s.lease is not None
    return s.lease.label if viewer in (0, s.uid) or not s.lease.private else None


def _limit_uid(uid: int) -> int | None:
    """How far the daemon may go stopping a tree of ``uid``: no further than that user could.

    None (no limit) when the daemon runs as that user anyway, or for root's trees.
    """
    return None if uid == 0 or uid == os.geteuid() else uid


def refuse(conn: Conn, why: str, code: int = USAGE) -> None:
    """Answer a request with an error (USAGE: the request itself was wrong)."""
    conn.send({"ev": "error", "code": code, "error": why})


def _pidfd_exited(fd: int) -> bool:
    import select

    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _sd_notify(state: str) -> None:
    """systemd's notify protocol (Type=notify), if we were started that way."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(state.encode(), addr)
        except OSError:
            pass
