"""What the daemon counts for ``hold report`` and ``hold metrics``.

* Counters per class since the daemon started (grants, expiries, waits in
  line and their seconds): for metrics.
* Per live lease: when its request arrived, whether it expired, why it
  ended, and how long it was *held*; written to the history
  (:mod:`hold.daemon.history`) when it ends.
* Stray sightings: a process outside any lease that a scan of the daemon
  found holding a device node (before a grant, or left over at a lease's
  end), recorded once per process and device.

Held: while a lease lives, a sampler thread looks at the lease's device nodes
every ``report.sample`` (30 s by default): the kernel's count of their open
files where it is exact, else the scan the daemon makes before a grant
(:mod:`hold.daemon.occupancy`). Each scan that finds a process holding
one of them adds the time since the previous scan of that lease (or since
the grant); a scan that finds none adds nothing. So held is at most the
leased time, exact to within one period at each end, and 0 for a lease
shorter than a period. A class without nodes is never scanned: held is
None (unknown).

Resource figures: the same thread reads each live lease's CPU time and
memory (:mod:`hold.daemon.figures`) every ``FIGURES_EVERY`` seconds (or
``report.sample``, if shorter); the most seen go into the lease's history line
(``cpu_s``, ``peak_bytes``; None where never read: a lease shorter than the
period that nobody asked ``status`` about, or one without a tree).

Most of it is fed by the daemon's own log events (:meth:`Usage.on_event`,
from :meth:`hold.daemon.state.DaemonState.log_for`), so the parts that
grant and end leases need only the grant's hook.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from hold.daemon import occupancy
from hold.daemon.figures import Figures
from hold.daemon.history import History
from hold.daemon.ledger import HOLDER_ENDED, SessionRec
from hold.devices.classes import node_key
from hold.documents import HistoryLease, HistoryStray, LeaseEnd, LeaseState

if TYPE_CHECKING:
    from hold.daemon.state import DaemonState

SAMPLE = 30.0  # seconds between the held-time scans of live leases
FIGURES_EVERY = 5.0  # seconds between the sampler's readings of the leases' figures
SEEN_KEPT = 4096  # stray sightings remembered (each is recorded once)

# How a session's end reason (hold.daemon.sessions.Endings.end) is written in the history.
ENDS = {
    HOLDER_ENDED: "ended",
    "lifeline": "lifeline",
    "owner exited while detached": "owner_exited",
    "owner died while the daemon was down": "recovered",
    "expired, not stopped by the client": "expired",
}


class Usage:
    """Counters, per-lease facts and the held-time sampler of one daemon."""

    def __init__(self, history: History, st: DaemonState) -> None:
        self.history = history
        self.st = st  # its sessions and classes, read by the sampler's thread too
        self.started = time.time()
        self.counters: dict[str, dict[str, float]] = {}  # class -> name -> value
        self.requested: dict[str, float] = {}  # lease id -> when its request arrived
        self.expired: set[str] = set()
        self.why: dict[str, str] = {}  # lease id -> its end reason
        self.seen: dict[tuple[int, int, str, int], None] = {}  # strays recorded (ordered)
        self.sample = SAMPLE
        self._lock = threading.Lock()
        self._held: dict[str, float] = {}  # lease id -> seconds seen held
        self._last: dict[str, float] = {}  # lease id -> its last scan (or grant)
        self._wake: threading.Event | None = None
        self.figures = Figures()
        self._scanned_at = 0.0  # the sampler's last held-time scan (monotonic)

    def count(self, cls: str, name: str, by: float = 1.0) -> None:
        c = self.counters.setdefault(
            cls, {"grants": 0, "expiries": 0, "waits": 0, "wait_seconds": 0.0}
        )
        c[name] = c.get(name, 0) + by

    # ------------------------------------------------------------ the hooks

    def granted(self, s: SessionRec, arrived: float) -> None:
        """(hold.daemon.grants) ``s`` was granted its lease; its request arrived at ``arrived``."""
        assert s.lease is not None
        cls, lid = s.lease.cls, s.lease.lease_id
        waited = max(0.0, s.lease.granted - arrived)
        self.count(cls, "grants")
        self.count(cls, "waits")
        self.count(cls, "wait_seconds", waited)
        self.requested[lid] = arrived
        if self.st.scanned.get(cls):  # else no node to scan: held stays unknown
            with self._lock:
                self._last[lid] = s.lease.granted
        if self._wake is None:  # the first lease: the sampler starts
            self._wake = threading.Event()
            threading.Thread(target=self._sampler, name="held", daemon=True).start()

    def on_event(self, event: str, s: SessionRec, kw: dict[str, Any]) -> None:
        """A log event of the daemon: the ones that say how a lease ends, or who strays."""
        lid = s.lease.lease_id if s.lease is not None else None
        if event == "expired" and lid is not None and s.lease is not None:
            self.expired.add(lid)
            self.count(s.lease.cls, "expiries")
        elif event == "session_ending" and lid is not None:
            self.why.setdefault(lid, str(kw.get("reason", "")))
            # The last look, where its leaves are still there (never a walk: per grant).
            self.figures.read(s, leaves_only=True)
        elif event == "grant_blocked" and isinstance(kw.get("holders"), dict):
            # Said to the waiting session, which has no lease yet: the class from the node.
            for index, holders in kw["holders"].items():
                for h in holders:
                    cls = self._class_of(str(h.get("node")), int(index))
                    if cls is not None:
                        self._stray(cls, int(index), h)
        elif event == "device_still_held" and s.lease is not None:
            for h in kw.get("holders") or []:
                self._stray(s.lease.cls, int(kw["device"]), h)
        elif event == "leftover_stopped":
            cls, _, index = str(kw.get("device", "?:0")).rpartition(":")
            h = {
                "pid": kw.get("holder_pid"),
                "uid": kw.get("holder_uid"),
                "user": kw.get("holder_user"),
                "command": kw.get("command"),
                "starttime": 0,
                "memory_bytes": None,
            }
            self._stray(cls, int(index), h, during=lid)

    def ended(self, s: SessionRec, now: float | None = None) -> None:
        """(hold.daemon.records) ``s``'s lease is over: one history line."""
        lease = s.lease
        assert lease is not None
        lid = lease.lease_id
        why = self.why.pop(lid, "")
        end = "expired" if lid in self.expired else ENDS.get(why, "ended")
        by = why.removeprefix("released by ") if why.startswith("released by ") else None
        if by is not None and lid not in self.expired:
            end = "released"
        self.expired.discard(lid)
        with self._lock:
            held = self._held.pop(lid, 0.0) if lid in self._last else None
            self._last.pop(lid, None)
        ended = time.time() if now is None else now
        cpu, peak = self.figures.forget(lid)
        self.history.append(
            HistoryLease(
                lid,
                s.user,
                s.uid,
                lease.cls,
                tuple(lease.devices),
                lease.label,
                lease.private,
                self.requested.pop(lid, None),
                lease.granted,
                ended,
                LeaseEnd(end),
                by,
                None if held is None else round(min(held, ended - lease.granted), 3),
                cpu,
                peak,
            )
        )

    def held(self, lid: str) -> float | None:
        with self._lock:
            return self._held.get(lid, 0.0) if lid in self._last else None

    # ---------------------------------------------------------- strays

    def _class_of(self, node: str, index: int) -> str | None:
        key = node_key(node)
        return next(
            (c for c, keys in self.st.keys.items() if index < len(keys) and keys[index] == key),
            None,
        )

    def _stray(self, cls: str, index: int, h: dict[str, Any], during: str | None = None) -> None:
        pid = h.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return  # a failed scan's placeholder
        key = (pid, int(h.get("starttime") or 0), cls, index)
        if key in self.seen:
            return
        self.seen[key] = None
        while len(self.seen) > SEEN_KEPT:
            del self.seen[next(iter(self.seen))]
        uid, user, memory = h.get("uid"), h.get("user"), h.get("memory_bytes")
        self.history.append(
            HistoryStray(
                cls,
                index,
                pid,
                uid if isinstance(uid, int) else None,
                user if isinstance(user, str) else None,
                str(h.get("command") or "")[:200],
                memory if isinstance(memory, int) else None,
                time.time(),
                during,
            )
        )

    # ---------------------------------------------------------- the sampler

    def _sampler(self) -> None:
        assert self._wake is not None
        self._scanned_at = time.monotonic()
        while True:
            self._wake.wait(min(self.sample, FIGURES_EVERY))
            try:
                self.read_figures()
            except Exception:  # never let a reading kill the sampler: the figures are then old
                pass
            if time.monotonic() - self._scanned_at < self.sample:
                continue
            self._scanned_at = time.monotonic()
            try:
                self.scan_once()
            except Exception:  # never let a scan kill the sampler: held is then low, not wrong
                continue

    def read_figures(self) -> None:
        """Read the figures of every live lease once (the most seen are kept)."""
        for s in list(self.st.sessions.values()):
            if s.lease is not None and s.lease.state != LeaseState.ENDING:
                self.figures.read(s)

    def scan_once(self) -> None:
        """Scan the nodes of every live lease once; credit those found held."""
        leases = [
            (s.lease.lease_id, s.lease.cls, list(s.lease.devices))
            for s in list(self.st.sessions.values())
            if s.lease is not None and s.lease.state != LeaseState.ENDING
        ]
        for lid, cls, devices in leases:
            with self._lock:
                if lid not in self._last:
                    continue
            dc = self.st.classes.get(cls)
            keys = self.st.keys.get(cls, [])
            held = self.st.occupancy.held([keys[i] for i in devices if i < len(keys)])
            if held is not None:  # the kernel's count, where it is exact: no scan
                found = held
            else:
                found = dc is not None and bool(
                    occupancy.holders_of(dc, devices, self.st.scan_cache)
                )
            now = time.time()
            with self._lock:
                if lid in self._last:
                    if found:
                        self._held[lid] = self._held.get(lid, 0.0) + now - self._last[lid]
                    self._last[lid] = now
