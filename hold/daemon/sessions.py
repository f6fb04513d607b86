"""How a session ends, and how sessions come back after a restart.

Every way out (``end``, ``release``, the lifeline, an expired lease not stopped
by its client, a detached owner's exit, an owner that died while the daemon
was down) goes through :meth:`Endings.end`: the session's trees are stopped in
a worker thread (a stop can take a grace period), then whoever is left on its
devices; only when that is reported back are its tokens removed and its
devices handed to the next in line.
"""

from __future__ import annotations

import os
import queue
import selectors
import time
from typing import Any

from hold.daemon import ledger, occupancy
from hold.daemon.conn import Conn
from hold.daemon.grants import Grants
from hold.daemon.ledger import HOLDER_ENDED, SessionRec, TreeRec
from hold.daemon.listener import pidfd_exited
from hold.daemon.state import DaemonState
from hold.documents import LeaseState
from hold.protocol import Ev
from hold_supervisor.proc import scan
from hold_supervisor.proc.cgroup import Leaf, leaves_made_by, sweep_made_by
from hold_supervisor.proc.identity import ProcessId
from hold_supervisor.proc.stop import StopReport, stop_tree
from hold_supervisor.proc.tree import Tree

# What a stop worker reports: the session, its stops, the devices still held
# (by whom), and those its scan found empty (see hold.daemon.occupancy).
Stopped = tuple[str, list[StopReport], dict[int, Any], frozenset[int]]


LIFELINE = "lifeline"  # a session's end: its owner's connection ended
OWNER_DIED = "owner died while the daemon was down"
OWNER_EXIT_WAIT = 5.0  # seconds a session's end waits for its owner's exit, to sweep its leaves
# Seconds between the machine-wide searches for the markers of trees that were
# ended by a look below their holder (see Endings.sweep_markers): one read of
# every process for all the trees ended meanwhile, never one per lease.
MARKER_SWEEP = 10.0


class Endings:
    """The sessions being ended, who waits for their end, and the owners watched while detached."""

    def __init__(self, st: DaemonState, grants: Grants) -> None:
        self.st = st
        self.grants = grants
        self.ending: set[str] = set()  # sessions whose trees are being stopped
        # Who waits for a session's end: (connection, the event to send it).
        self.release_waiters: dict[str, list[tuple[Conn, Ev]]] = {}
        self.kill_at: dict[str, float] = {}  # session id -> monotonic deadline
        self.watch: dict[int, str] = {}  # pidfd of a detached owner -> session id
        self.done: queue.SimpleQueue[Stopped] = queue.SimpleQueue()
        # Trees ended by a look below their holder: (the tree, as found by its
        # marker alone, and its grace), until the next sweep; when it is due.
        self.unswept: list[tuple[Tree, float]] = []
        self.sweep_at: float | None = None

    def end(self, s: SessionRec, reason: str) -> None:
        """Stop the session's trees in a worker; the lease ends when they are stopped."""
        if s.session_id in self.ending:
            return
        self.ending.add(s.session_id)
        self.kill_at.pop(s.session_id, None)
        if s.lease is not None:
            s.lease.state = LeaseState.ENDING
        self.st.save()
        self.st.log_for("session_ending", s, reason=reason)
        if reason in (LIFELINE, OWNER_DIED):
            self.sweep_leaves(s)
        # A lease's grace, else the longest its trees asked for (hold run).
        # Each tree with its own grace (a stack's units each asked for theirs);
        # the lease's for whoever is left on its devices.
        grace = s.lease.grace if s.lease else max((t.grace for t in s.trees.values()), default=10.0)
        # At the holder's own end its trees without a leaf are looked for below
        # it (it is alive, waiting for "ended"), not in a listing of /proc: the
        # machine-wide search for their markers comes later (sweep_markers).
        below = reason == HOLDER_ENDED
        trees = [(_tree_of(s, t, below=below), t.grace) for t in s.trees.values()]
        for tree, g in trees:
            if tree.below_only:
                self._unswept(tree, g)
        if reason == HOLDER_ENDED:
            # The holder stopped its trees itself (the same stop_tree, survivor
            # check and all) before it said "end". A tree in a leaf that is now
            # empty or gone is over -- the leaf is the tree, and a leaf cannot be
            # removed while anyone is in it -- so it is not walked again here
            # (twice more through /proc per handoff, issue 13). Whoever still
            # holds the lease's devices, in the leaf or not, is the leftover
            # scan's below; a holder that lied only lied about its own tree.
            trees = [(t, g) for t, g in trees if not t.leaf_emptied()]
        devices = (
            (s.lease.cls, s.lease.devices, s.lease.granted)
            if s.lease and self.st.scanned[s.lease.cls]
            else None
        )
        uid = limit_uid(s.uid)
        if devices is not None and not trees:
            keys = [self.st.keys[devices[0]][i] for i in devices[1]]
            if self.st.occupancy.known_empty(keys):
                devices = None  # the kernel's count is back at zero: nobody to look for
        if not trees and devices is None:
            # Nothing to stop or scan: end it in this turn of the loop (a
            # worker's turn would be most of the handoff's latency).
            self.done.put((s.session_id, [], {}, frozenset()))
            return
        sid = s.session_id
        self.st.workers.submit(lambda: self._stop_worker(sid, trees, grace, devices, uid))

    def _unswept(self, tree: Tree, grace: float) -> None:
        marker_only = Tree(tree.tree_id, None, None, None, since=tree.since, uid=tree.uid)
        self.unswept.append((marker_only, grace))
        if self.sweep_at is None:
            self.sweep_at = time.monotonic() + MARKER_SWEEP

    def sweep_markers(self) -> None:
        """Search the whole machine, once, for the markers of the trees ended by a
        look below their holder since the last sweep (in a worker): what one of
        them asked another daemon to start (``at``, ``systemd-run``) is below no
        holder, and only its marker names it. Each found is stopped (its tree
        by every means, the survivor check and all) and logged: after its lease
        has changed hands, so it slows no grant and no run."""
        trees, self.unswept, self.sweep_at = self.unswept, [], None
        if not trees:
            return
        log = self.st.log

        def work() -> None:
            oldest = min(t.since for t, _ in trees)
            wanted = {t.marker: (t, g) for t, g in trees}
            found: dict[bytes, list[int]] = {}
            for st in scan.snapshot().values():
                if st.starttime < oldest or st.is_dead:
                    continue
                try:
                    env = scan.environ(st.pid)
                except OSError:
                    continue  # not ours to read: nor could a marker we set be there
                for entry in (env or b"").split(b"\0"):
                    if entry in wanted and st.starttime >= wanted[entry][0].since:
                        found.setdefault(entry, []).append(st.pid)
            for marker, pids in found.items():
                tree, grace = wanted[marker]
                try:
                    report = stop_tree(tree, grace=grace)
                except Exception as e:  # never let a stop kill the daemon silently
                    if log is not None:
                        log.error("stop_failed", tree=tree.tree_id, error=repr(e))
                    continue
                if log is not None:
                    log.warning(
                        "marker_survivors_stopped",
                        tree=tree.tree_id,
                        pids=pids,
                        outcome=report.outcome,
                        survivors=[sv._asdict() for sv in report.survivors],
                    )

        self.st.workers.submit(work)

    def sweep_leaves(self, s: SessionRec) -> None:
        """Empty cgroup leaves a dead owner made and never gave to anyone (killed
        between the ``mkdir`` and the tree's registration): nobody else knows them."""
        cgroup, mount = s.owner_cgroup, self.st.cg_mount
        if cgroup is None or mount is None:
            return
        owner = (s.owner_pid, s.owner_start)
        if not leaves_made_by(cgroup, mount, owner):
            return  # the usual end: it left none (a few directory reads, no worker)
        log = self.st.log

        def work() -> None:
            # Its connection ends while it exits (the files close first): wait
            # for the exit itself, briefly; an owner alive after that keeps its leaves.
            if not ProcessId(*owner).wait_gone(OWNER_EXIT_WAIT):
                return
            removed = sweep_made_by(cgroup, mount, owner, s.uid)
            if removed and log is not None:
                log.info("stale_leaves_removed", session=s.session_id, leaves=removed)

        self.st.workers.submit(work)

    def _stop_worker(
        self,
        sid: str,
        trees: list[tuple[Tree, float]],
        grace: float,
        devices: tuple[str, list[int], float] | None,
        uid: int | None,
    ) -> None:
        reports = []
        left: dict[int, Any] = {}
        empty: frozenset[int] = frozenset()
        for tree, tree_grace in trees:
            try:
                report = stop_tree(tree, grace=tree_grace)
                reports.append(report)
                if report.ok:
                    # The client normally removes its leaf; if it died, we do.
                    tree.remove_leaf()
            except Exception as e:  # never let a stop kill the daemon silently
                assert self.st.log is not None
                self.st.log.error("stop_failed", session=sid, tree=tree.tree_id, error=repr(e))
        if devices is not None:
            # Whoever still holds the lease's devices is a survivor of the
            # lease (started inside it, or slipped in during it): stopped
            # before anyone else is granted them. Where the kernel's count is
            # back at zero nobody does, and nothing is scanned.
            cls, indices, granted = devices
            keys = [self.st.keys[cls][i] for i in indices]
            try:
                if self.st.occupancy.known_empty(keys):
                    more: list[StopReport] = []
                else:
                    self._log_scan(sid, cls, indices, keys)
                    more, left = occupancy.stop_leftovers(
                        self.st.classes[cls],
                        indices,
                        uid=uid,
                        grace=grace,
                        granted=granted,
                        occ=self.st.occupancy,
                        keys=keys,
                        unreadable=self.st.unreadable,
                    )
                reports += more
                # Scanned after every tree of the lease was stopped: the
                # next grant of these devices needs no scan of its own --
                # unless this daemon cannot prove a device empty (it may not
                # read every process): then the next grant's scan decides.
                if self.st.unreadable == "ignore" or os.geteuid() == 0:
                    empty = frozenset(devices[1]) - set(left)
            except Exception as e:
                assert self.st.log is not None
                self.st.log.error("leftover_scan_failed", session=sid, error=repr(e))
        self.done.put((sid, reports, left, empty))
        self.st.wake(b"d")

    def _log_scan(self, sid: str, cls: str, indices: list[int], keys: list[str]) -> None:
        """Why a lease's end scans its devices (the kernel's count could not say)."""
        if self.st.log is not None:
            occ = self.st.occupancy
            why = {str(i): occ.why_not(k) for i, k in zip(indices, keys, strict=True)}
            self.st.log.info(
                "scan_needed", cls=cls, devices=indices, why=why, at="lease end", session=sid
            )

    def finish(self) -> None:
        """The sessions whose stops are done: their devices handed on, their waiters answered."""
        while True:
            try:
                sid, reports, left, empty = self.done.get_nowait()
            except queue.Empty:
                return
            s = self.st.sessions.pop(sid, None)
            self.ending.discard(sid)
            if s is not None:
                self._finish_one(s, reports, left, empty)

    def _finish_one(
        self, s: SessionRec, reports: list[StopReport], left: dict[int, Any], empty: frozenset[int]
    ) -> None:
        survivors = [sv._asdict() for r in reports for sv in r.survivors]
        self._log_stops(s, reports, survivors)
        cls = s.lease.cls if s.lease else None
        if s.lease is not None:
            self._free_devices(s, left)
        self.st.log_for("session_ended", s)
        owner = self.st.attached.pop(s.session_id, None)
        if owner is not None:
            owner.session = None
        saves = self.st.saves
        if cls is not None:
            self.grants.schedule_sharing(cls, empty)
        if self.st.saves == saves:
            # One write of the state per handoff: a grant just made wrote this
            # session's end with it (a crash before either write only means
            # this end is done again after the restart: its trees are gone).
            self.st.save()
        for waiter, ev in self.release_waiters.pop(s.session_id, []):
            waiter.send({"ev": ev, "survivors": survivors})
        if cls is not None:
            self.st.records.remember(s)  # after the next grant: it is not on the handoff's path
        self.grants.release_idle_locks()

    def _log_stops(
        self, s: SessionRec, reports: list[StopReport], survivors: list[dict[str, Any]]
    ) -> None:
        for r in reports:
            if isinstance(r, occupancy.LeftoverStop):
                # Someone used the lease's device without a ticket: whose it was.
                h = r.holder
                self.st.log_for(
                    "leftover_stopped",
                    s,
                    holder_pid=h["pid"],
                    holder_user=h["user"],
                    holder_uid=h["uid"],
                    command=h["command"],
                    node=h["node"],
                    device=f"{h['class']}:{h['device']}",
                    tree=r.tree_id,
                    outcome=r.outcome,
                    ok=r.ok,
                )
            self.st.log_for(
                "tree_stopped",
                s,
                tree=r.tree_id,
                outcome=r.outcome,
                stopped=len(r.stopped),
                killed=len(r.killed),
                duration_ms=round(r.duration * 1000, 1),
                survivors=survivors,
                holders_after=[h._asdict() for h in r.holders_after],
            )

    def _free_devices(self, s: SessionRec, left: dict[int, Any]) -> None:
        """The lease's tokens removed and its devices out of ``held``; those still held blocked."""
        assert s.lease is not None
        self.st.records.remove_tokens(s)
        for i in s.lease.devices:
            self.grants.held.pop((s.lease.cls, i), None)
        for i, holders in left.items():
            # Could not be stopped (another user's, unkillable, or older
            # than the lease): out of reach until they are gone -- unless
            # busy devices are granted with a warning anyway.
            if self.st.grant_busy == "wait":
                self.grants.block(s.lease.cls, i, holders)
            self.st.log_for("device_still_held", s, device=i, holders=holders)

    # ------------------------------------------------------- detached owners

    def watch_owner(self, fd: int, s: SessionRec) -> None:
        """While detached, the owner's exit (its pidfd) ends the session."""
        self.watch[fd] = s.session_id
        self.st.sel.register(fd, selectors.EVENT_READ, ("owner", None))

    def unwatch_owner(self, sid: str) -> None:
        for fd, wsid in list(self.watch.items()):
            if wsid == sid:
                self.st.sel.unregister(fd)
                os.close(fd)
                del self.watch[fd]

    def on_owner_exit(self, fd: int) -> None:
        sid = self.watch.pop(fd, None)
        self.st.sel.unregister(fd)
        os.close(fd)
        if sid is not None and sid in self.st.sessions:
            self.end(self.st.sessions[sid], "owner exited while detached")


def recover(st: DaemonState, grants: Grants, endings: Endings) -> None:
    """Re-read the state: live owners may re-attach; dead owners' trees are stopped."""
    for s in ledger.load(st.sd.state):
        if s.lease is not None and s.lease.cls not in st.classes:
            # Its class is gone from the configuration: its devices cannot
            # be named any more, but its trees are still stopped.
            st.log_for("recovered_unknown_class", s, cls=s.lease.cls)
            s.lease = None
        st.sessions[s.session_id] = s
        if s.lease is not None:
            for i in s.lease.devices:
                grants.held[(s.lease.cls, i)] = s.session_id
                # Ours again if the holder died with the old daemon; else
                # the holder hands its descriptor back when it re-attaches.
                st.locks.take_if_free(st.keys[s.lease.cls][i])
        fd = _live_owner(s)
        if fd is None:
            st.log_for("recovered_dead_owner", s)
            endings.end(s, OWNER_DIED)
            continue
        endings.watch_owner(fd, s)
        st.log_for("recovered_live_owner", s)


def _live_owner(s: SessionRec) -> int | None:
    """A pidfd of the session's owner if it is still the process that opened it, else None."""
    owner = ProcessId(s.owner_pid, s.owner_start)
    fd: int | None = None
    try:
        fd = os.pidfd_open(s.owner_pid)
    except OSError:
        pass
    if fd is None or not owner.is_running() or pidfd_exited(fd):
        if fd is not None:
            os.close(fd)
        return None
    return fd


def _tree_of(s: SessionRec, t: TreeRec, *, below: bool = False) -> Tree:
    """The tree ``t`` of session ``s``; ``below``: one without a leaf whose root was
    spawned below the holder is looked for below the holder only
    (:attr:`Tree.subtree_of`)."""
    root = ProcessId(t.root_pid, t.root_start) if t.root_pid and t.root_start else None
    # (A tree with a leaf is looked for in its leaf: Tree.below_only.)
    under = below and t.below
    return Tree(
        t.tree_id,
        root,
        t.pgid,
        t.sid,
        leaf=Leaf(t.leaf) if t.leaf else None,
        since=t.since,
        # Running as root for another user: no further than that user could go.
        uid=limit_uid(s.uid),
        subtree_of=ProcessId(s.owner_pid, s.owner_start) if under else None,
    )


def limit_uid(uid: int) -> int | None:
    """How far the daemon may go stopping a tree of ``uid``: no further than that user could.

    None (no limit) when the daemon runs as that user anyway, or for root's trees.
    """
    return None if uid == 0 or uid == os.geteuid() else uid
