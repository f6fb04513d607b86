"""What the daemon must not forget: sessions, their leases and their trees.

Written to ``state.json`` (atomically: temp file and rename) *before* the daemon acts on
it: before a grant is sent, before a tree registration is acknowledged. A
daemon that is SIGKILLed and started again reads it back, so no device is
granted twice and no registered tree loses its guardian.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from typing import Any

from hold_supervisor.safefile import open_for_read, write_atomic

HOLDER_ENDED = "ended by its holder"  # why a session ends when its own client says `end`

VERSION = 1


class TreeRec:
    """A tree registered by a client: found by marker and leaf before its root is known."""

    __slots__ = ("grace", "leaf", "pgid", "root_pid", "root_start", "sid", "since", "tree_id")

    def __init__(self, tree_id: str, leaf: str | None, since: int, grace: float = 10.0) -> None:
        self.tree_id = tree_id
        self.leaf = leaf
        self.since = since  # no member can have started before this (clock ticks)
        self.grace = grace  # the stop's grace that the client asked for
        self.root_pid: int | None = None
        self.root_start: int | None = None
        self.pgid: int | None = None
        self.sid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TreeRec:
        t = cls(d["tree_id"], d["leaf"], d["since"], float(d.get("grace", 10.0)))
        for k in ("root_pid", "root_start", "pgid", "sid"):
            setattr(t, k, d.get(k))
        return t


class LeaseState(StrEnum):
    """Where a lease stands; saved in ``state.json`` and shown as its string."""

    ACTIVE = "active"  # granted, within its time limit
    EXPIRED = "expired"  # past its time limit, the client told: it stops within the grace
    ENDING = "ending"  # its trees are being stopped; its devices are not handed on yet


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

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Lease:
        lease = cls(
            d["lease_id"],
            d["cls"],
            list(d["devices"]),
            d["label"],
            d["granted"],
            d["expires"],
            d["grace"],
        )
        lease.state = LeaseState(d.get("state", LeaseState.ACTIVE))
        lease.private = bool(d.get("private", False))
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

    def to_json(self) -> dict[str, Any]:
        doc = {
            "session_id": self.session_id,
            "owner_pid": self.owner_pid,
            "owner_start": self.owner_start,
            "uid": self.uid,
            "user": self.user,
            "lease": self.lease.to_json() if self.lease else None,
            "trees": [t.to_json() for t in self.trees.values()],
        }
        if (
            self.owner_cgroup is not None
        ):  # absent as before it was known: a file read back the same
            doc["owner_cgroup"] = self.owner_cgroup
        return doc

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SessionRec:
        s = cls(d["session_id"], d["owner_pid"], d["owner_start"], d["uid"], d["user"])
        s.lease = Lease.from_json(d["lease"]) if d.get("lease") else None
        s.trees = {t["tree_id"]: TreeRec.from_json(t) for t in d.get("trees", [])}
        cg = d.get("owner_cgroup")
        s.owner_cgroup = cg if isinstance(cg, str) else None
        return s


def save(path: str, sessions: list[SessionRec]) -> None:
    doc = {"version": VERSION, "sessions": [s.to_json() for s in sessions if s.persistent]}
    write_atomic(path, json.dumps(doc, sort_keys=True).encode(), 0o600)


def load(path: str) -> list[SessionRec]:
    """The sessions on disk; an empty list when there is no state yet.

    :class:`~hold_supervisor.safefile.UnsafePath` if ``path`` is a symlink, not a
    regular file, not ours or hard-linked: the daemon refuses to start on it.
    """
    try:
        fd = open_for_read(path)
    except FileNotFoundError:
        return []
    with os.fdopen(fd, "rb") as f:
        doc = json.loads(f.read())
    if doc.get("version") != VERSION:
        raise ValueError(f"{path}: state version {doc.get('version')!r}, expected {VERSION}")
    return [SessionRec.from_json(d) for d in doc["sessions"]]
