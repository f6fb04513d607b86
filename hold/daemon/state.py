"""What every part of the daemon shares: the configuration's device classes,
the sessions and their connections, the ledger, the log and the records, the
kernel locks, and the wakeup of the event loop.

The parts (:mod:`hold.daemon.grants`, :mod:`hold.daemon.sessions`, :mod:`hold.daemon.ops`) each
own their own tables and read these; only the event loop (:mod:`hold.daemon.server`)
and a reload change the configuration here.
"""

from __future__ import annotations

import os
import selectors
from typing import Any

from hold.config import Config, fingerprint, parse_file
from hold.daemon import devlock, ledger, occupancy
from hold.daemon.conn import Conn
from hold.daemon.history import History
from hold.daemon.ledger import SessionRec
from hold.daemon.records import Log, Records
from hold.daemon.usage import Usage
from hold.daemon.workers import Workers
from hold.devices.classes import DeviceClass
from hold.devices.scancache import ScanCache
from hold.errors import describe
from hold.protocol import WIRE, Ev
from hold.statedir import StateDir
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.parse import BadValue
from hold_supervisor.proc.cgroup import v2_mount
from hold_supervisor.proc.identity import user_name
from hold_supervisor.safefile import UnsafePath


class DaemonState:
    def __init__(
        self,
        sd: StateDir,
        classes: dict[str, DeviceClass],
        *,
        shared: bool,
        home_tokens: bool,
        grant_busy: str,
        unreadable: str = "refuse",
        limits: tuple[int, int] = (256, 256),
        idle_exit: float | None,
        system: bool,
        config_path: str | None,
    ) -> None:
        self.sd = sd
        self.config_path = config_path
        self.config_digest = fingerprint(config_path)
        # What a client whose file has this digest would read for `cgroups:`,
        # sent with the session: such a client need not parse YAML itself.
        self.cgroups = cgroups_mode(config_path)
        if fingerprint(config_path) != self.config_digest:
            self.cgroups = None  # changed while read: no promise about it
        self.system = system
        self.shared = shared or system
        # An autostarted daemon leaves after this long with nothing to do (no
        # client, session, queue or stop); one run by systemd stays.
        self.idle_exit = idle_exit
        self.classes: dict[str, DeviceClass] = {}
        self.keys: dict[str, list[str]] = {}
        self.sizes: dict[str, int] = {}
        self.scanned: dict[str, bool] = {}
        # The kernel's count of each device's open files (grants without a scan).
        self.occupancy = occupancy.Occupancy()
        self.set_classes(classes, {name: c.device_keys() for name, c in classes.items()})
        self.scan_cache = ScanCache()  # what the holder scans read a moment ago
        self.workers = Workers()  # scans before grants, stops at ends
        self.grant_busy = grant_busy  # "wait" (the default) or "warn": see hold.daemon.occupancy
        # "refuse" (the default) or "ignore": a device this daemon cannot prove
        # empty, for processes it may not read (see hold.daemon.occupancy.look)
        self.unreadable = unreadable
        # Per user, root excepted: (open connections, requests waiting in line)
        # at most; and each user's open connections now (issue 24: one user's
        # 11,000 idle connections took the daemon from everyone).
        self.limits = limits
        self.conns_of: dict[int, int] = {}
        self.overflowed: set[Conn] = set()  # connections to close: their client stopped reading
        self.refused: dict[int, int] = {}  # uid -> connections refused over its limit
        self.locks = devlock.Locks(devlock.lock_dir(), self.wake)
        self.records = Records(sd, home_tokens, self.log_for)
        # What hold report and hold metrics read: counters, held time, the history.
        self.usage = Usage(History(sd.path), self)
        self.usage.sample = report_settings(config_path)[1]
        self.records.on_end = self.usage.ended
        self.sel = selectors.DefaultSelector()
        self.sessions: dict[str, SessionRec] = {}
        self.attached: dict[str, Conn] = {}  # session id -> its connection
        self.log: Log | None = None
        self.cg_mount = v2_mount()
        self.stopping = False
        self.saves = 0  # writes of the state so far
        self.wake_w = -1  # the wakeup pipe's write end, once the daemon serves

    def set_classes(self, classes: dict[str, DeviceClass], keys: dict[str, list[str]]) -> None:
        # A device is its machine-wide identity (the node's device number):
        # the name of its kernel lock, shared with every other arbiter here.
        self.classes, self.keys = classes, keys
        self.sizes = {name: len(k) for name, k in keys.items()}
        self.scanned = {name: occupancy.has_nodes(c) for name, c in classes.items()}
        self.occupancy.track(classes, keys)

    def wake(self, why: bytes = b"w") -> None:
        """(Any thread) make the loop look at what a worker left for it."""
        os.write(self.wake_w, why)

    def save(self, *, must: bool = False) -> None:
        """The ledger to disk. A failure (the file replaced, the disk full) is logged
        and the daemon goes on serving; ``must`` (a grant: on disk before anyone is
        told) raises it instead, for that one request to be refused."""
        try:
            ledger.save(self.sd.state, list(self.sessions.values()))
        except (UnsafePath, OSError) as e:
            if must:
                raise
            if self.log is not None:
                self.log.error("ledger_unwritable", path=self.sd.state, error=describe(e))
            return
        self.saves += 1

    def limits_for(self, uid: int, queued: int) -> dict[str, Any]:
        """The limits, and ``uid``'s use of them (``queued``: its requests in line)."""
        return {
            "connections": self.limits[0],
            "queued": self.limits[1],
            "exempt": ["root"],
            "yours": {"connections": self.conns_of.get(uid, 0), "queued": queued},
        }

    def log_for(self, event: str, s: SessionRec, **kw: Any) -> None:
        if self.log is not None:
            lease = s.lease.lease_id if s.lease else None
            self.log.info(
                event, session=s.session_id, lease=lease, pid=s.owner_pid, user=s.user, **kw
            )
        self.usage.on_event(event, s, kw)

    def arbiter(self) -> dict[str, Any]:
        """Which arbiter this is: the machine's system daemon, or one user's own."""
        return {
            # "shared": a daemon other users may use (shared: true), not the system's
            "kind": "system" if self.system else ("shared" if self.shared else "per-user"),
            "state_dir": self.sd.path,
            "pid": os.getpid(),
            "user": user_name(os.geteuid()),
            "config": self.config_path,
            "config_digest": self.config_digest,
            "cgroups": self.cgroups,
            "autostarted": self.idle_exit is not None,
            "wire": WIRE,
        }


def cgroups_mode(path: str | None) -> str | None:
    """The file's ``cgroups:`` setting; None if it cannot be read now (then
    clients read their file themselves)."""
    if path is None:
        return "auto"
    try:
        return parse_file(path).cgroups
    except (BadValue, OSError):
        return None


def report_settings(path: str | None) -> tuple[bool, float]:
    """The file's ``report:`` settings (others' labels shown, sample period); the
    defaults if it cannot be read now."""
    cfg = Config()
    if path is not None:
        try:
            cfg = parse_file(path)
        except (BadValue, OSError):
            pass
    return cfg.report_labels, cfg.report_sample


def label_for(s: SessionRec, viewer: int) -> str | None:
    """A lease's label as ``viewer`` (a uid) may see it: if private, only its owner and root."""
    assert s.lease is not None
    return s.lease.label if viewer in (0, s.uid) or not s.lease.private else None


def refuse(conn: Conn, why: str, code: int = USAGE, **fields: Any) -> None:
    """Answer a request with an error (USAGE: the request itself was wrong), and
    ``fields`` for the client to act on."""
    conn.send({"ev": Ev.ERROR, "code": code, "error": why, **fields})
