"""What the daemon must not forget: sessions, their leases and their trees.

Written to ``state.json`` (:class:`hold.documents.LedgerState`; atomically: temp
file and rename) *before* the daemon acts on it: before a grant is sent, before
a tree registration is acknowledged. A daemon that is SIGKILLed and started
again reads it back, so no device is granted twice and no registered tree loses
its guardian."""

from __future__ import annotations

from hold.documents import LeaseEntry, LeaseState, LedgerState, SessionEntry, TreeEntry
from hold_supervisor.safefile import write_atomic

HOLDER_ENDED = "ended by its holder"  # why a session ends when its own client says `end`


class TreeRec:
    """A tree registered by a client: found by marker and leaf before its root is known."""

    __slots__ = (
        "below",
        "grace",
        "leaf",
        "pgid",
        "root_pid",
        "root_start",
        "sid",
        "since",
        "tree_id",
    )

    def __init__(self, tree_id: str, leaf: str | None, since: int, grace: float = 10.0) -> None:
        self.tree_id = tree_id
        self.leaf = leaf
        self.since = since  # no member can have started before this (clock ticks)
        self.grace = grace  # the stop's grace that the client asked for
        self.root_pid: int | None = None
        self.root_start: int | None = None
        self.pgid: int | None = None
        self.sid: int | None = None
        # Spawned by the session's holder (not adopted): all of it lives below
        # the holder. Not written down: a restarted daemon walks /proc.
        self.below = False

    def entry(self) -> TreeEntry:
        return TreeEntry(
            self.tree_id,
            self.leaf,
            self.since,
            self.grace,
            self.root_pid,
            self.root_start,
            self.pgid,
            self.sid,
        )

    @classmethod
    def of(cls, e: TreeEntry) -> TreeRec:
        t = cls(e.tree_id, e.leaf, e.since, e.grace)
        t.root_pid, t.root_start, t.pgid, t.sid = e.root_pid, e.root_start, e.pgid, e.sid
        return t


class Lease:
    """Devices granted to one session, until ``expires`` (wall clock, seconds)."""

    __slots__ = (
        "cls",
        "devices",
        "expires",
        "grace",
        "granted",
        "label",
        "lease_id",
        "private",
        "state",
    )

    def __init__(
        self,
        lease_id: str,
        cls: str,
        devices: list[int],
        label: str,
        granted: float,
        expires: float,
        grace: float,
    ) -> None:
        self.lease_id = lease_id
        self.cls = cls
        self.devices = devices
        self.label = label
        self.granted = granted
        self.expires = expires
        self.grace = grace
        self.state = LeaseState.ACTIVE  # -> EXPIRED (client told) -> ENDING (trees stopping)
        self.private = False  # the label is shown to its owner and root only

    def entry(self) -> LeaseEntry:
        return LeaseEntry(
            self.lease_id,
            self.cls,
            tuple(self.devices),
            self.label,
            self.granted,
            self.expires,
            self.grace,
            self.state,
            self.private,
        )

    @classmethod
    def of(cls, e: LeaseEntry) -> Lease:
        lease = cls(e.lease_id, e.cls, list(e.devices), e.label, e.granted, e.expires, e.grace)
        lease.state = e.state
        lease.private = e.private
        return lease


class SessionRec:
    """One client (the owner: pid + start time + uid), its lease and its trees."""

    __slots__ = (
        "lease",
        "owner_cgroup",
        "owner_pid",
        "owner_start",
        "session_id",
        "trees",
        "uid",
        "user",
    )

    def __init__(
        self, session_id: str, owner_pid: int, owner_start: int, uid: int, user: str
    ) -> None:
        self.session_id = session_id
        self.owner_pid = owner_pid
        self.owner_start = owner_start
        self.uid = uid
        self.user = user
        self.lease: Lease | None = None
        self.trees: dict[str, TreeRec] = {}
        # Where the owner's cgroup leaves are made: its own cgroup or above (see
        # hold_supervisor.proc.cgroup.sweep_made_by), read when it opened.
        self.owner_cgroup: str | None = None

    @property
    def persistent(self) -> bool:
        return self.lease is not None or bool(self.trees)

    def entry(self) -> SessionEntry:
        return SessionEntry(
            self.session_id,
            self.owner_pid,
            self.owner_start,
            self.uid,
            self.user,
            None if self.lease is None else self.lease.entry(),
            tuple(t.entry() for t in self.trees.values()),
            self.owner_cgroup,
        )

    @classmethod
    def of(cls, e: SessionEntry) -> SessionRec:
        s = cls(e.session_id, e.owner_pid, e.owner_start, e.uid, e.user)
        s.lease = None if e.lease is None else Lease.of(e.lease)
        s.trees = {t.tree_id: TreeRec.of(t) for t in e.trees}
        s.owner_cgroup = e.owner_cgroup
        return s


def save(path: str, sessions: list[SessionRec]) -> None:
    doc = LedgerState(tuple(s.entry() for s in sessions if s.persistent))
    write_atomic(path, doc.encode(), 0o600)


def load(path: str) -> list[SessionRec]:
    """The sessions on disk; an empty list when there is no state yet.

    :class:`~hold_supervisor.safefile.UnsafePath` if ``path`` is a symlink, not a
    regular file, not ours or hard-linked; :class:`~hold.documents.BadDocument`
    if it is not a ledger of this daemon or an older one: the daemon refuses to
    start on it.
    """
    try:
        doc = LedgerState.read(path)
    except FileNotFoundError:
        return []
    return [SessionRec.of(e) for e in doc.sessions]
