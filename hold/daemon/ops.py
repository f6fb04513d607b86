"""What a client may ask of the daemon: one handler per ``op`` of the wire.

Every field is checked here, before anything changes; who is asking comes
from the connection (the kernel's word), never from the message. A wrong
request is refused (:func:`hold.daemon.state.refuse`); a malformed one ends
its connection (the event loop catches what the field readers raise).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from hold.config import fingerprint, load
from hold.daemon.adoptrules import adopt_into
from hold.daemon.conn import Conn, Request
from hold.daemon.grants import Grants
from hold.daemon.ledger import HOLDER_ENDED, SessionRec, TreeRec
from hold.daemon.report import answer as report_answer
from hold.daemon.sessions import Endings
from hold.daemon.state import DaemonState, refuse
from hold.daemon.status import status
from hold.devices.classes import classes_from_config
from hold.documents import LeaseState
from hold.leases import judge
from hold.protocol import (
    WIRE,
    Ev,
    Message,
    Op,
    check_label,
    flag_field,
    ints_field,
    number_field,
    text_field,
    wire_of,
)
from hold_supervisor.exitcodes import BUSY, TOOL
from hold_supervisor.parse import BadValue
from hold_supervisor.proc import scan
from hold_supervisor.proc.cgroup import cgroup_dir, leaf_named
from hold_supervisor.proc.identity import ProcessId, read_stat, user_name
from hold_supervisor.proc.tree import signalable_by

_TREE_ID = re.compile(r"[0-9a-f]{8,32}")
# How many devices, which ones (None: any), and those the client can use (None: all).
Wanted = tuple[int, tuple[int, ...] | None, frozenset[int] | None]
Handler = Callable[[Conn, Message], None]


class Ops:
    """The handlers, over the daemon's shared state and its parts."""

    def __init__(self, st: DaemonState, grants: Grants, endings: Endings) -> None:
        self.st = st
        self.grants = grants
        self.endings = endings
        # One handler per operation (tests/test_wire_enums.py: none is missing).
        self.handlers: dict[Op, Handler] = {
            Op.OPEN: lambda conn, _msg: self._open(conn),
            Op.ATTACH: lambda conn, msg: self._attach(conn, text_field(msg, "session")),
            Op.ACQUIRE: self._acquire,
            Op.TREE: self._register_tree,
            Op.ROOT: self._register_root,
            Op.STATUS: self._status,
            Op.RELEASE: lambda conn, msg: self._release(conn, text_field(msg, "lease")),
            Op.END: lambda conn, _msg: self._end(conn),
            Op.LEASES: lambda conn, _msg: self._leases(conn),
            Op.CHECK: lambda conn, msg: self._check(conn, text_field(msg, "cls")),
            Op.RETIRE: lambda conn, _msg: self._retire(conn),
            Op.RELOAD: lambda conn, _msg: self._reload_op(conn),
            Op.REPORT: self._report,
        }

    def dispatch(self, conn: Conn, msg: Message) -> None:
        op = msg.get("op")
        if not isinstance(op, str) or op not in self.handlers:  # a member equals its string
            refuse(conn, f"unknown op {op!r}")
            return
        spoken = wire_of(msg)
        if (spoken != WIRE or isinstance(spoken, bool)) and op != Op.RETIRE:
            # Read as ours, a request of another version could mean something
            # else: refused, with both versions, so its client can replace us.
            refuse(
                conn,
                f"this ticket daemon (pid {os.getpid()}) speaks wire version {WIRE}, and the "
                f'request came in version {spoken!r} (its "v"): the client and the daemon '
                "are of different releases of hold",
                TOOL,
                wire=WIRE,
            )
            return
        self.handlers[Op(op)](conn, msg)

    def _status(self, conn: Conn, _msg: Message) -> None:
        conn.send({"ev": Ev.STATUS, **status(self.st, self.grants, conn.uid)})

    def _report(self, conn: Conn, msg: Message) -> None:
        """For hold report (hold/daemon/report.py)."""
        conn.send({"ev": Ev.REPORT, **report_answer(self.st, conn.uid, msg)})

    # -------------------------------------------------------------- sessions

    def _open(self, conn: Conn) -> None:
        if conn.session is not None:
            refuse(conn, "session already open")
            return
        sid = os.urandom(8).hex()
        s = SessionRec(sid, conn.peer.pid, conn.peer.starttime, conn.uid, user_name(conn.uid))
        s.owner_cgroup = cgroup_dir(conn.peer.pid, self.st.cg_mount)
        self.st.sessions[sid] = s
        self.st.attached[sid] = conn
        conn.session = s
        defs = {
            name: {
                "nodes": list(c.nodes),
                "shared_nodes": list(c.shared_nodes),
                "visible_env": list(c.visible_env),
                "allowed_holders": list(c.allowed_holders),
            }
            for name, c in self.st.classes.items()
        }
        conn.send(
            {
                "ev": Ev.SESSION,
                "session": sid,
                "arbiter": self.st.arbiter(),
                "classes": dict(self.st.sizes),
                "class_defs": defs,
            }
        )

    def _attach(self, conn: Conn, sid: str) -> None:
        """A detached owner comes back (after a daemon restart): its session, and the
        lock descriptors it kept (sent with the message) handed back to us."""
        s = self.st.sessions.get(sid)
        if (
            s is None
            or sid in self.endings.ending
            or not _owned_by(s, conn)
            or sid in self.st.attached
        ):
            refuse(conn, f"no session {sid} to re-attach", TOOL)
            return
        self.endings.unwatch_owner(sid)
        self.st.attached[sid] = conn
        conn.session = s
        lease = s.lease
        if lease is not None:
            for i in lease.devices:
                self.st.locks.take_back(self.st.keys[lease.cls][i], conn.fds)
        conn.send({"ev": Ev.ATTACHED, "lease": lease.entry().to_json() if lease else None})
        if lease is not None and lease.state == LeaseState.EXPIRED:
            conn.send({"ev": Ev.EXPIRED, "grace": lease.grace})
        self.st.log_for("session_attached", s)

    def _release(self, conn: Conn, lease_id: str) -> None:
        target = next(
            (s for s in self.st.sessions.values() if s.lease and s.lease.lease_id == lease_id), None
        )
        if target is None:
            refuse(conn, f"no live lease {lease_id}")
            return
        if conn.uid not in (0, target.uid):
            refuse(
                conn,
                f"lease {lease_id} belongs to {target.user}; only that user or root may release it",
            )
            return
        self.endings.release_waiters.setdefault(target.session_id, []).append((conn, Ev.RELEASED))
        holder = self.st.attached.get(target.session_id)
        if holder is not None:
            holder.send({"ev": Ev.RELEASED, "by": user_name(conn.uid)})
        self.endings.end(target, f"released by {user_name(conn.uid)}")

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
            self.st.sessions.pop(s.session_id, None)
            self.st.attached.pop(s.session_id, None)
            conn.session = None
            conn.send({"ev": Ev.ENDED})
            return
        self.endings.release_waiters.setdefault(s.session_id, []).append((conn, Ev.ENDED))
        self.endings.end(s, HOLDER_ENDED)

    # --------------------------------------------------------------- acquire

    def _acquire(self, conn: Conn, msg: Message) -> None:
        s = conn.session
        if s is None or s.lease is not None or conn.request is not None:
            refuse(conn, "acquire needs an open session without a lease")
            return
        cls = text_field(msg, "cls")
        if cls not in self.st.classes:
            known = ", ".join(sorted(self.st.classes))
            refuse(conn, f"unknown device class {cls!r} (known: {known})")
            return
        req = self._request_from(conn, msg, cls)
        if req is None:
            return
        limit = self.st.limits[1]
        waiting = self.grants.queued_of(conn.uid)
        if conn.uid != 0 and waiting >= limit:
            # One user's line of requests cannot keep everyone else's waiting (issue 24).
            refuse(
                conn,
                f"user {user_name(conn.uid)} has {waiting} requests waiting in line, its "
                f"limit (limits: {{queued: {limit}}} in "
                f"{self.st.config_path or 'the configuration'}); not queued",
                BUSY,
            )
            return
        self.grants.enqueue(cls, req)
        if conn.request is req and not req.wait and req.checking is None:
            # Not grantable now, and not being checked: busy. (One being
            # checked is answered when its scan is done: a free device with
            # nodes is granted to --no-wait too.)
            note = self.grants.holders_note(cls, req)  # as it stands, before the line moves on
            self.grants.drop_request(req)
            conn.send({"ev": Ev.BUSY, **note, "position": 0})

    def _request_from(self, conn: Conn, msg: Message, cls: str) -> Request | None:
        """The request ``msg`` makes for ``cls``, every field checked; None: refused."""
        wanted = self._devices_wanted(conn, msg, cls)
        if wanted is None:
            return None
        count, indices, usable = wanted
        label = text_field(msg, "label")
        why = check_label(label)
        ttl = number_field(msg, "ttl", float)
        grace = number_field(msg, "grace", float, 10.0)
        if why is None and not (0 < ttl <= 366 * 86400 and 0 <= grace <= 3600):
            why = f"time limit {ttl} s or grace {grace} s out of range"
        tree = self._tree_from(conn, msg["tree"]) if msg.get("tree") else None
        if why is not None or isinstance(tree, str):
            refuse(conn, why or str(tree))
            return None
        self.grants.seq += 1
        req = Request(conn, self.grants.seq, count, indices, label, ttl, grace, tree)
        req.wait = flag_field(msg, "wait", True)
        req.private = flag_field(msg, "private", False)
        req.allowed = usable
        if tree is not None and tree.root_pid is not None:
            self.grants.unblock_adopted(cls, tree)
        return req

    def _devices_wanted(self, conn: Conn, msg: Message, cls: str) -> Wanted | None:
        """How many devices (or which), and the ones the client can use; None: refused."""
        size = self.st.sizes[cls]
        indices = ints_field(msg, "indices") or None
        allowed = ints_field(msg, "allowed")
        count = len(indices) if indices else number_field(msg, "count", int, 1)
        if count < 1 or count > size or (indices and any(i < 0 or i >= size for i in indices)):
            refuse(conn, f"{cls} has {size} device(s) here; cannot grant {indices or count}")
            return None
        usable = None if allowed is None else frozenset(i for i in allowed if 0 <= i < size)
        if usable is not None and (len(usable) < count or (indices and not set(indices) <= usable)):
            refuse(
                conn,
                f"only {cls}:"
                f"{','.join(map(str, sorted(usable))) or '(none)'} can be used from "
                f"here; cannot grant {indices or count}",
            )
            return None
        return count, indices, usable

    # ----------------------------------------------------------------- trees

    def _tree_from(self, conn: Conn, d: Any) -> TreeRec | str:
        """A tree registration, checked: a well-formed id, and a leaf the client owns;
        an adoption (``adopt``: a running process, see hold.daemon.adoptrules). Else why not."""
        bad = "bad tree registration"
        if not isinstance(d, dict) or not _TREE_ID.fullmatch(str(d.get("tree_id", ""))):
            return bad
        tree_id = str(d["tree_id"])
        grace = number_field(d, "grace", float, 10.0)
        if not 0 <= grace <= 3600:
            return bad
        # An id is one tree: a client cannot take over another's by naming it
        # (the daemon would stop that tree when this client's connection ends).
        if any(
            tree_id in other.trees
            for other in self.st.sessions.values()
            if other is not conn.session
        ):
            return bad
        leaf = d.get("leaf")
        if leaf is not None:
            leaf = str(leaf)
            if not self._leaf_of(conn, leaf, tree_id):
                return bad
        tree = TreeRec(tree_id, leaf, conn.peer.starttime, grace)
        # Registered before its spawn, by the client that spawns it: it will live
        # below that client (its root is believed only there, _register_root),
        # also when the root has exited before it could be registered. Not an
        # adopted job: that one runs wherever it was started.
        tree.below = d.get("adopt") is None
        if d.get("adopt") is not None:
            why = adopt_into(
                tree, d["adopt"], conn.uid, conn.peer.pid, self.st.sessions.values(), conn.session
            )
            if why is not None:
                return why
        return tree

    def _leaf_of(self, conn: Conn, leaf: str, tree_id: str) -> bool:
        """Whether ``leaf`` is the tree's own cgroup leaf, and the client's (or root asks)."""
        if (
            self.st.cg_mount is None
            or not os.path.realpath(leaf).startswith(self.st.cg_mount + "/")
            or not leaf_named(os.path.basename(leaf), tree_id)
            or os.path.islink(leaf)
        ):
            return False
        try:
            st = os.stat(leaf)
        except OSError:
            return False
        return conn.uid == 0 or st.st_uid == conn.uid

    def _register_tree(self, conn: Conn, msg: Message) -> None:
        s = conn.session
        tree = self._tree_from(conn, msg) if s is not None else "bad tree registration"
        if s is None or isinstance(tree, str):
            refuse(conn, str(tree))
            return
        s.trees[tree.tree_id] = tree
        self.st.save()
        self.st.log_for("tree_registered", s, tree=tree.tree_id, leaf=tree.leaf)
        conn.send({"ev": Ev.OK, "tree": tree.tree_id})

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
        chain = {a.pid for a in scan.ancestors(pid)}
        if conn.peer.pid not in chain or not signalable_by(pid, conn.uid):
            if not ProcessId(pid, st.starttime).matches():
                return  # reaped while we looked (a command that exits at once): no claim left
            self.st.log_for(
                "tree_root_refused",
                s,
                tree=tree.tree_id,
                claimed_pid=pid,
                peer_pid=conn.peer.pid,
                peer_uid=conn.uid,
            )
            return
        tree.root_pid, tree.root_start, tree.pgid = pid, st.starttime, st.pgrp
        tree.sid = st.session if st.session == pid else None
        self.st.save()
        if s.lease is not None:
            self.st.records.write_tokens(s)

    # ------------------------------------------------------- what is leased

    def _check(self, conn: Conn, cls: str) -> None:
        """``hold check``, answered for the asking process (the kernel says who it is)."""
        if cls not in self.st.classes:
            refuse(conn, "a device class: " + ", ".join(sorted(self.st.classes)))
            return
        records = [
            self.st.records.record(s)
            for s in self.st.sessions.values()
            if s.lease is not None and s.lease.state != LeaseState.ENDING
        ]
        covered, why = judge(conn.peer, cls, records)
        conn.send({"ev": Ev.CHECK, "covered": covered, "why": why, "arbiter": self.st.arbiter()})

    def _leases(self, conn: Conn) -> None:
        """Every live lease, as the asker may see it (``hold audit`` believes only this)."""
        out = [
            self.st.records.record(s).seen_by(conn.uid, s.lease.private).to_json()
            for s in self.st.sessions.values()
            if s.lease is not None
        ]
        conn.send({"ev": Ev.LEASES, "leases": out})

    # --------------------------------------------------------- the daemon

    def _retire(self, conn: Conn) -> None:
        """Leave now, for a client of ours that reads another configuration
        (it starts a daemon with its own). Only an autostarted daemon, asked by
        its own user, with nothing to keep: no lease, tree or waiter of anyone."""
        st = self.st
        others = [s for s in st.sessions.values() if s is not conn.session and s.persistent]
        waiting = sum(len(q) for q in self.grants.queues.values())
        if st.system or st.idle_exit is None or conn.uid != os.geteuid():
            why = "this daemon was not started by a client of yours; it stays"
        elif others or waiting or self.endings.ending:
            leases = [
                f"{s.lease.cls} lease {s.lease.lease_id} of {s.user} (pid {s.owner_pid})"
                for s in others
                if s.lease is not None
            ]
            why = (
                f"busy: {', '.join(leases) or f'{len(others)} guarded tree(s)'}"
                f"{f', {waiting} waiting' if waiting else ''}"
            )
        else:
            assert st.log is not None
            st.log.info("retiring", asked_by=conn.peer.pid, config=st.config_path)
            conn.send({"ev": Ev.RETIRING, "pid": os.getpid()})
            st.stopping = True
            return
        refuse(conn, why)

    def _reload_op(self, conn: Conn) -> None:
        if conn.uid not in (0, os.geteuid()):
            refuse(conn, "only root or the daemon's own user may reload its configuration")
            return
        why = self.reload()
        if why is not None:
            refuse(conn, why)
        else:
            conn.send(
                {"ev": Ev.RELOADED, "config": self.st.config_path, "classes": dict(self.st.sizes)}
            )

    def reload(self) -> str | None:
        """Read the configuration again (SIGHUP, ``hold daemon --reload``); why not, or None.

        Refused, keeping the old one whole, when a class that has live leases
        or waiters would be dropped or would name other devices.
        """
        st = self.st
        assert st.log is not None
        try:
            cfg = load()
            classes = classes_from_config(cfg.devices, cfg.path)
        except BadValue as e:
            st.log.error("reload_refused", error=str(e))
            return str(e)
        keys = {name: c.device_keys() for name, c in classes.items()}
        for cls in sorted(self._live_classes()):
            if cls not in classes or keys[cls] != st.keys[cls]:
                how = "dropped" if cls not in classes else "changed"
                why = (
                    f"class {cls} has live leases or waiters and would be {how} by "
                    f"{cfg.path or 'the defaults'}; nothing was changed"
                )
                st.log.error("reload_refused", error=why)
                return why
        st.set_classes(classes, keys)
        self.grants.queues = {name: self.grants.queues.get(name, []) for name in classes}
        st.grant_busy, st.records.home_tokens = cfg.busy_devices, cfg.home_tokens
        st.unreadable = cfg.unreadable_processes
        st.limits = (cfg.limit_connections, cfg.limit_queued)
        st.config_path, st.config_digest = cfg.path, fingerprint(cfg.path)
        st.cgroups = cfg.cgroups
        st.log.info("config_reloaded", config=cfg.path, classes=dict(st.sizes))
        return None

    def _live_classes(self) -> set[str]:
        """The classes a reload must keep as they are: leases, waiters, scans, blocks."""
        g = self.grants
        live = {s.lease.cls for s in self.st.sessions.values() if s.lease is not None}
        live |= {cls for cls, q in g.queues.items() if q}
        live |= {c for c, _ in (*g.verifying, *g.blocked, *g.elsewhere)}
        return live


def _owned_by(s: SessionRec, conn: Conn) -> bool:
    """Whether the peer of ``conn`` may take session ``s`` back: its owner, or the
    owner's own child of the same user. The second is a launcher that went on
    below its keeper (``hold_supervisor.spawn.keeper``): it opened the session
    before the split, so the session names the keeper, the process the shell
    started, which is alive as long as the launcher is."""
    peer = conn.peer
    if (s.owner_pid, s.owner_start) == (peer.pid, peer.starttime):
        return True
    if conn.uid != s.uid:
        return False
    child = scan.stat_of(peer.pid)
    owner = scan.stat_of(s.owner_pid)
    return (
        child is not None
        and owner is not None
        and child.starttime == peer.starttime
        and child.ppid == s.owner_pid
        and owner.starttime == s.owner_start
        and not owner.is_dead
    )
