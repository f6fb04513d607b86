"""Who gets which device: the line of requests of each class, each device's
machine-wide lock, the scan of a device before it is granted, and the grant.

A device is free when no lease of ours holds it, no grant is being checked
for it, no holder outside any lease keeps it ("blocked", see
:mod:`hold.daemon.occupancy`) and no other arbiter holds its lock ("elsewhere").
"""

from __future__ import annotations

import os
import queue
import selectors
import time
from typing import Any

from hold.daemon import devlock, occupancy
from hold.daemon.adoptrules import descends_from, without_tree
from hold.daemon.conn import Request
from hold.daemon.ledger import Lease, SessionRec, TreeRec
from hold.daemon.schedule import plan
from hold.daemon.state import DaemonState, label_for, refuse
from hold.daemon.tokens import UnsafePath, remove_owned
from hold.documents import LockRecord
from hold.errors import describe
from hold.protocol import Ev
from hold_supervisor.exitcodes import TOOL, USAGE
from hold_supervisor.proc.identity import ProcessId

RECHECK_BLOCKED = 30.0  # seconds between scans of a device held outside any lease
RECHECK_MOVED = 2.0  # seconds from an open or close of a blocked device's node to its scan
LOOK_EVERY = 10.0  # seconds between two scans that hold status starts (look_unknown)

Device = tuple[str, int]  # (class, index)
Holders = list[dict[str, Any]]


class Grants:
    """The lines, the devices they wait for, and the grants, for one daemon."""

    def __init__(self, st: DaemonState) -> None:
        self.st = st
        self.queues: dict[str, list[Request]] = {name: [] for name in st.classes}
        self.held: dict[Device, str] = {}  # -> the session id of its lease
        # Devices whose kernel lock another arbiter holds: what its record says.
        self.elsewhere: dict[Device, dict[str, Any]] = {}
        # Occupancy: a device is scanned before each grant; one held outside
        # any lease is blocked until its holders exit (their pidfds wake us)
        # or a slow re-check finds it empty.
        self.verifying: dict[Device, Request] = {}
        self.blocked: dict[Device, Holders] = {}
        self.blocker_fds: dict[int, Device] = {}
        self.recheck_at: float | None = None
        # What each scan for a grant found: (request, class, devices, holders, why
        # the devices cannot be proven empty or None).
        self.checks: queue.SimpleQueue[
            tuple[Request, str, list[int], dict[int, Holders], str | None]
        ] = queue.SimpleQueue()
        self.seq = 0  # arrival order of requests
        # hold status's scans of devices whose state is unknown: when the last
        # one started (None: none yet), whether it runs, what it found.
        self.looked_at: float | None = None
        self.looking = False
        self.looks: queue.SimpleQueue[tuple[str, dict[int, Holders]]] = queue.SimpleQueue()

    # ------------------------------------------------------------ the lines

    def enqueue(self, cls: str, req: Request) -> None:
        req.conn.request = req
        self.queues[cls].append(req)
        self.schedule(cls)

    def queued_of(self, uid: int) -> int:
        """How many requests of ``uid`` wait in line (every class): its limit's use."""
        return sum(1 for q in self.queues.values() for r in q if r.conn.uid == uid)

    def drop_request(self, req: Request) -> None:
        req.conn.request = None
        for cls, q in self.queues.items():
            if req in q:
                q.remove(req)
                # Its reservation is gone: someone behind it may go now.
                self.schedule_sharing(cls)
                return

    def sharing(self, cls: str) -> list[str]:
        """The other classes that name a device of ``cls`` (one node in two classes,
        a hard link, a second path: one device, one key, whichever class names it)."""
        mine = set(self.st.keys[cls])
        return [c for c, keys in self.st.keys.items() if c != cls and mine & set(keys)]

    def schedule_sharing(self, cls: str, empty: frozenset[int] = frozenset()) -> None:
        """:meth:`schedule` ``cls``, then every class that names one of its devices.

        For what may free a device or a place in line (a lease's end, a check's
        end, a stray's exit, a request gone): the device is one, whichever class
        named it, and a waiter of another class waited at "being checked" for
        ever when only the class at hand moved (issue 24)."""
        self.schedule(cls, empty)
        for other in self.sharing(cls):
            self.schedule(other)

    def schedule(self, cls: str, empty: frozenset[int] = frozenset()) -> None:
        """Grant (or scan, then grant) what the line of ``cls`` can have now.

        ``empty``: devices a scan found empty in this turn of the loop, after
        the trees of the lease that held them were stopped, with their kernel
        locks held since: granted now without a scan of their own (one scan
        per handoff, not two). Used in this call only, never kept.
        """
        q = self.queues[cls]
        waiting = [r for r in q if r.checking is None]
        # A lock file we could not open is tried again now (no event says it
        # was fixed); one that another arbiter holds has its waiter thread.
        for dev in [d for d, rec in self.elsewhere.items() if d[0] == cls and "error" in rec]:
            del self.elsewhere[dev]
        while True:
            # A device is busy by its key: another class may name the same node.
            busy = {self.key(k) for k in (*self.held, *self.verifying, *self.blocked)}
            free = [
                i
                for i, key in enumerate(self.st.keys[cls])
                if key not in busy and (cls, i) not in self.elsewhere
            ]
            grants = plan(free, waiting)
            # Each device to grant (or check) needs its machine-wide lock first;
            # one that another arbiter holds is out of the plan: plan again.
            if all(self._lock(cls, i) for _, devices in grants for i in devices):
                break
        for pos, devices in reversed(grants):
            req = waiting[pos]
            if not self.st.scanned[cls]:
                check = "none"  # a logical device: nothing to hold
            elif set(devices) <= empty:
                check = "handoff"  # the end's scan found them empty (see above)
            elif self.st.occupancy.known_empty([self.key((cls, i)) for i in devices]):
                check = "count"  # the kernel's count: see hold.daemon.occupancy
            else:
                self._verify(cls, req, devices)
                continue
            q.remove(req)
            self._grant(cls, req, devices, check)
        self.release_idle_locks()
        self._notify_queue(cls)

    # ---------------------------------------------------------- kernel locks

    def key(self, device: Device) -> str:
        return self.st.keys[device[0]][device[1]]

    def _lock(self, cls: str, index: int) -> bool:
        """Hold ``cls:index``'s machine-wide lock (True), or note who does (False)."""
        who = self.st.locks.take(self.st.keys[cls][index])
        if who is None:
            return True
        self.elsewhere[(cls, index)] = who
        if "error" in who:  # nothing to wait on: looked at again by the re-check
            self.recheck_at = time.monotonic() + RECHECK_BLOCKED
        return False

    def finish_locks(self) -> None:
        """Locks another arbiter let go of (now ours): the lines waiting for them move."""
        done = self.st.locks.collect()
        if not done:
            return
        classes = {c for (c, i) in self.elsewhere if self.st.keys[c][i] in done}
        for dev in [d for d in self.elsewhere if self.key(d) in done]:
            del self.elsewhere[dev]
        for c in classes:
            self.schedule(c)
        self.release_idle_locks()

    def release_idle_locks(self) -> None:
        """Let go of every lock no lease of ours holds and no grant is being checked for."""
        self.st.locks.release_unused({self.key(k) for k in (*self.held, *self.verifying)})

    # ------------------------------------------------------------ occupancy

    def _verify(self, cls: str, req: Request, devices: list[int]) -> None:
        """Scan ``devices`` in a worker before granting them to ``req``."""
        req.checking = devices
        for i in devices:
            self.verifying[(cls, i)] = req

        keys = [self.key((cls, i)) for i in devices]
        if self.st.log is not None:
            # Why the kernel's count could not answer (the benchmark counts these).
            why = {str(i): self.st.occupancy.why_not(k) for i, k in zip(devices, keys, strict=True)}
            self.st.log.info("scan_needed", cls=cls, devices=devices, why=why, at="grant")

        def work() -> None:
            unproven: str | None = None  # why the devices cannot be proven empty
            try:
                occ = self.st.occupancy
                seen = occupancy.checked_look(
                    occ, self.st.classes[cls], devices, keys, self.st.unreadable
                )
                found = without_tree(seen.found, req.tree, req.conn.uid)  # an adopted job's own
                if not found and seen.unproven:
                    unproven = seen.why_unproven(cls)
            except Exception as e:  # a failed scan must not grant a device blindly
                found = {
                    devices[0]: [
                        {
                            "pid": 0,
                            "user": "?",
                            "command": f"scan failed: {describe(e)}",
                            "starttime": 0,
                            "memory_bytes": None,
                        }
                    ]
                }
            self.checks.put((req, cls, devices, found, unproven))
            self.st.wake(b"c")

        self.st.workers.submit(work)

    def look_unknown(self, devices: dict[str, list[int]]) -> bool:
        """Scan ``devices`` (class -> indices) in a worker: for ``hold status``, which
        found them unknown (no scan since their count started, or opened since).
        Each scan found empty starts its count; a holder found blocks the device
        (and is named) as a grant's scan would. At most one every
        :data:`LOOK_EVERY` seconds; True where one runs now."""
        now = time.monotonic()
        if self.looking:
            return True
        if self.looked_at is not None and now - self.looked_at < LOOK_EVERY:
            return False
        self.looking, self.looked_at = True, now

        def work() -> None:
            try:
                for cls, indices in devices.items():
                    keys = [self.key((cls, i)) for i in indices]
                    seen = occupancy.checked_look(
                        self.st.occupancy, self.st.classes[cls], indices, keys, self.st.unreadable
                    )
                    self.looks.put((cls, seen.found))
            finally:
                self.looks.put(("", {}))  # the end of this look
                self.st.wake(b"c")

        self.st.workers.submit(work)
        return True

    def finish_looks(self) -> None:
        """What :meth:`look_unknown` found: holders outside any lease block their device."""
        while True:
            try:
                cls, found = self.looks.get_nowait()
            except queue.Empty:
                return
            if not cls:
                self.looking = False
                continue
            for i, holders in found.items():
                dev = (cls, i)
                if dev in self.held or dev in self.verifying or dev in self.blocked:
                    continue  # granted or being checked meanwhile: that check decides
                self.block(cls, i, holders)

    def finish_checks(self) -> None:
        self.finish_looks()
        while True:
            try:
                req, cls, devices, found, unproven = self.checks.get_nowait()
            except queue.Empty:
                return
            for i in devices:
                self.verifying.pop((cls, i), None)
            req.checking = None
            if req not in self.queues[cls]:  # the client left meanwhile
                self.schedule_sharing(cls)
                continue
            if unproven is not None:
                # Waiting cannot change it (issue 24): refused, saying why and what to do.
                self.queues[cls].remove(req)
                req.conn.request = None
                if req.conn.session is not None:
                    self.st.log_for("grant_unproven", req.conn.session, devices=devices)
                refuse(req.conn, unproven, USAGE)
            elif found and self.st.grant_busy == "wait":
                self._hold_back(cls, req, devices, found)
            else:
                self._grant_checked(cls, req, devices, found)
            self.schedule_sharing(cls)

    def _hold_back(
        self, cls: str, req: Request, devices: list[int], found: dict[int, Holders]
    ) -> None:
        """Devices found in use outside any lease: blocked; a --no-wait request is answered busy."""
        for i, holders in found.items():
            self.block(cls, i, holders)
        if req.conn.session is not None:
            self.st.log_for(
                "grant_blocked",
                req.conn.session,
                devices=devices,
                holders={str(i): h for i, h in found.items()},
            )
        if not req.wait:
            self.queues[cls].remove(req)
            req.conn.request = None
            req.conn.send({"ev": Ev.BUSY, **self.holders_note(cls, req)})

    def _grant_checked(
        self, cls: str, req: Request, devices: list[int], found: dict[int, Holders]
    ) -> None:
        """Granted after the scan; with a warning naming whoever holds them anyway ("warn")."""
        if found:
            busy = [{"index": i, "holders": h} for i, h in found.items()]
            req.conn.send({"ev": Ev.WARNING, "cls": cls, "blocked": busy})
        self.queues[cls].remove(req)
        self._grant(cls, req, devices, "scan")

    def block(self, cls: str, index: int, holders: Holders) -> None:
        """Keep ``cls:index`` from being granted until its holders are gone."""
        self.blocked[(cls, index)] = holders
        for h in holders:
            try:
                fd = os.pidfd_open(int(h["pid"]))
            except OSError:
                continue  # gone already: the re-check below will see it
            self.blocker_fds[fd] = (cls, index)
            self.st.sel.register(fd, selectors.EVENT_READ, ("blocker", None))
        # A holder may close the node without exiting; look again now and then.
        self.recheck_at = time.monotonic() + RECHECK_BLOCKED

    def unblock_adopted(self, cls: str, t: TreeRec) -> None:
        """Devices of ``cls`` blocked only by the job ``t`` adopts: free for its request
        (whose scan leaves the job out), not held back until the job ends."""
        assert t.root_pid is not None and t.root_start is not None
        root = ProcessId(t.root_pid, t.root_start)
        for (c, i), holders in list(self.blocked.items()):
            if c == cls and holders and all(descends_from(int(h["pid"]), root) for h in holders):
                self.unblock((c, i))

    def unblock(self, key: Device) -> None:
        self.blocked.pop(key, None)
        for fd, k in list(self.blocker_fds.items()):
            if k == key:
                self.st.sel.unregister(fd)
                os.close(fd)
                del self.blocker_fds[fd]
        if not self.blocked:
            self.recheck_at = None

    def on_node_events(self, moved: set[str]) -> None:
        """Opens or closes of the nodes of ``moved`` (device keys): a blocked one is
        looked at again soon (its holder may have closed it without exiting)."""
        if any(self.key(d) in moved for d in self.blocked):
            soon = time.monotonic() + RECHECK_MOVED
            self.recheck_at = soon if self.recheck_at is None else min(self.recheck_at, soon)

    def on_blocker_exit(self, fd: int) -> None:
        key = self.blocker_fds.get(fd)
        if key is not None:
            self.unblock(key)  # the next grant scans it again
            self.schedule_sharing(key[0])

    # ---------------------------------------------------------------- grants

    def _grant(self, cls: str, req: Request, devices: list[int], check: str) -> None:
        """Hand ``devices`` to ``req``; ``check``: what proved them empty (the log says:
        ``count``, ``scan``, ``handoff`` or ``none``)."""
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
        try:
            # On disk before anyone is told: a restarted daemon must know. A
            # ledger that cannot be written refuses this grant, not the daemon
            # (it ended every user's daemon, issue 24).
            self.st.save(must=True)
            self.st.records.write_tokens(s)
        except (UnsafePath, OSError, ValueError) as e:
            self._undo_grant(cls, req, devices, e)
            return
        owner = self._lock_record(s)
        for i in devices:
            lock = self.st.locks.path(self.st.keys[cls][i])
            try:
                devlock.write_record(lock, owner)
            except (devlock.LockUnusable, OSError) as e:
                # It only informs other arbiters' waiters: they are told the lock's
                # holder without its lease. Another user can cause this (a file
                # made at our record's name), so it refuses nothing.
                self.st.log_for("lock_record_unwritten", s, error=describe(e))
        self.st.log_for(
            "granted", s, label=req.label, devices=devices, expires=lease.expires, check=check
        )
        self.st.usage.granted(s, req.arrived)  # hook for hold report / metrics: counters, waits
        # The client holds the locks with us (one open file description each):
        # neither one's death alone lets another arbiter grant the devices.
        conn.send(
            {
                "ev": Ev.GRANTED,
                "lease": lease.lease_id,
                "cls": cls,
                "devices": devices,
                "expires": lease.expires,
                "granted": now,
            },
            fds=[self.st.locks.fds[self.st.keys[cls][i]] for i in devices],
        )

    def _undo_grant(self, cls: str, req: Request, devices: list[int], e: Exception) -> None:
        """The lease could not be recorded: refused, its devices free again."""
        s = req.conn.session
        assert s is not None
        self.st.log_for("grant_refused", s, error=describe(e))
        refuse(
            req.conn,
            f"the ticket daemon cannot record the lease: {describe(e)} "
            f"(pid {os.getpid()}; its log {self.st.sd.log})",
            TOOL,
        )
        s.lease = None
        for i in devices:
            del self.held[(cls, i)]
            try:
                remove_owned(self.st.sd.token(cls, i), self.st.sd.path)
            except (UnsafePath, OSError):
                pass  # the symlink we refused to write through stays as it was
        self.st.save()
        self.schedule_sharing(cls)

    def _lock_record(self, s: SessionRec) -> LockRecord:
        """What a lock file says of its lease, for waiters served by other arbiters."""
        assert s.lease is not None
        return LockRecord(
            s.uid,
            s.user,
            s.owner_pid,
            s.owner_start,
            s.lease.granted,
            s.lease.expires,
            s.lease.lease_id,
            s.lease.cls,
            self.st.sd.path,
            os.getpid(),
            None if s.lease.private else s.lease.label,
        )

    # ------------------------------------------------------ what waiters see

    def holders_note(self, cls: str, req: Request) -> dict[str, Any]:
        q = self.queues[cls]
        position = q.index(req) + 1 if req in q else 0
        blocked = [
            {"index": i, "holders": h} for (c, i), h in sorted(self.blocked.items()) if c == cls
        ]
        elsewhere = [
            {"index": i, **rec} for (c, i), rec in sorted(self.elsewhere.items()) if c == cls
        ]
        viewer = req.conn.uid
        return {
            "cls": cls,
            "position": position,
            "holders": self._holders(cls, viewer),
            "blocked": blocked,
            "elsewhere": elsewhere,
        }

    def _holders(self, cls: str, viewer: int) -> list[dict[str, Any]]:
        out = []
        seen: set[str] = set()
        for (c, _i), sid in sorted(self.held.items()):
            s = self.st.sessions.get(sid)
            if c != cls or sid in seen or s is None or s.lease is None:
                continue
            seen.add(sid)
            out.append(
                {
                    "lease": s.lease.lease_id,
                    "label": label_for(s, viewer),
                    "pid": s.owner_pid,
                    "user": s.user,
                    "since": s.lease.granted,
                    "expires": s.lease.expires,
                    "devices": s.lease.devices,
                    "state": s.lease.state,
                }
            )
        return out

    def _notify_queue(self, cls: str) -> None:
        """Tell each waiter where it stands, only when that has changed."""
        for req in self.queues.get(cls, []):
            note = self.holders_note(cls, req)
            if note != req.conn.last_note:
                req.conn.last_note = note
                req.conn.send({"ev": Ev.QUEUED, **note})
