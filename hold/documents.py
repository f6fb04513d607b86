"""The files ``hold`` writes, each a typed, versioned document.

The mechanism -- a frozen dataclass with its ``KIND`` and ``VERSION`` written
into the file, ``encode()`` and a strict ``decode(data, where)`` -- is
:mod:`hold_supervisor.documents`, with the supervisor's own documents
(``stack.json``, a task unit's records). These are ``hold``'s, in one module
beside it because they are made of ``hold``'s types (a
:class:`hold.leases.LeaseRecord`, a lease's :class:`LeaseState`), which the
supervisor may not import:

=================  ==========================================  =======  ==========
document           file                                        kind     legacy
=================  ==========================================  =======  ==========
:class:`TokenFile`  ``STATE/CLASS-N.token``                    token    0
:class:`LockRecord` ``/run/lock/hold-dev-KEY.UID.record``       lock     0
:class:`EndedLeases` ``STATE/ended.json``                      ended    0
:class:`HistoryLease`, ``STATE/history.jsonl``, a line each    lease,   0
:class:`HistoryStray`                                          stray
:class:`LedgerState` ``STATE/state.json``                      state    1
:class:`UpHandOver`, ``hold up --detach``'s pipes              up,      none
:class:`UpStatus`                                              up-status
=================  ==========================================  =======  ==========

"legacy": the version a file of the code before these documents is read as
(it has no ``kind`` or no ``version``): each of these files can outlive an
upgrade -- a running older daemon's token files and lock records, its ledger
and history, a running stack's ``stack.json``. The pipes of ``hold up
--detach`` join two processes of one installation and accept no legacy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Self

from hold.leases import LeaseRecord
from hold_supervisor import jsonlines
from hold_supervisor.documents import BadDocument, Document, Fields

__all__ = [
    "BadDocument",
    "EndedLease",
    "EndedLeases",
    "HistoryLease",
    "HistoryStray",
    "LeaseEnd",
    "LeaseEntry",
    "LeaseState",
    "LedgerState",
    "LockRecord",
    "SessionEntry",
    "TokenFile",
    "TreeEntry",
    "UpHandOver",
    "UpStatus",
    "lease_record",
]

TEXT_SHOWN = 200  # characters of a hostile file's text kept for display


def lease_record(f: Fields) -> LeaseRecord:
    """A :class:`LeaseRecord` among a document's fields; :class:`BadDocument` naming the file."""
    try:
        return LeaseRecord.from_json(f.whole())
    except ValueError as e:
        raise BadDocument(f"{f.where}: {e}") from None


# ---------------------------------------------------------------------- token files


@dataclass(frozen=True, slots=True)
class TokenFile(Document):
    """A token file: ``line``, the first line people and old scripts read
    (``npu-hold LABEL pid PID DATE``, :func:`hold.daemon.tokens.token_line`), then
    the lease's record as one JSON line (the same shape as on the socket)."""

    KIND = "token"
    VERSION = 1
    LEGACY = 0  # a running older daemon's token files

    line: str
    record: LeaseRecord

    def body(self) -> dict[str, Any]:
        return self.record.to_json()

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls("", lease_record(f))

    def encode(self) -> bytes:
        return self.line.encode("utf-8", "replace") + b"\n" + jsonlines.dumps_line(self.to_json())

    @classmethod
    def decode(cls, data: bytes, where: str) -> Self:
        line, nl, rest = data.partition(b"\n")
        if not nl:
            raise BadDocument(f"{where}: no record after the first line ({cls.accepted()})")
        doc = cls.from_value(cls.parse(rest, where), where)
        return replace(doc, line=line.decode("utf-8", "replace"))


# ---------------------------------------------------------------------- lock records


LAST_EPOCH = 253402300800.0  # 10000-01-01T00:00:00Z: the last time a clock shows is before it


@dataclass(frozen=True, slots=True)
class LockRecord(Document):
    """Whose lease holds a machine-wide device lock (:mod:`hold.daemon.devlock`).

    Any user may make a file at that name (the directory is everyone's): a
    record is believed only from its own user's file
    (:func:`hold.daemon.devlock.owner_of`), authorises nothing, and is decoded
    within :data:`MAX_SIZE` bytes; a number beyond 64 bits, or a time before
    1970 or after the year 9999, is refused and each text is kept to
    :data:`TEXT_SHOWN` characters."""

    KIND = "lock"
    VERSION = 1
    LEGACY = 0  # a running older daemon's records
    MAX_SIZE = 4096
    MAX_DEPTH = 2

    uid: int
    user: str
    pid: int  # the lease's holder
    start: int  # its start time (clock ticks)
    since: float
    until: float
    lease: str
    cls: str
    arbiter: str  # the granting daemon's state directory
    daemon_pid: int
    label: str | None = None  # absent where the lease is private

    def body(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "uid": self.uid,
            "user": self.user,
            "pid": self.pid,
            "start": self.start,
            "since": self.since,
            "until": self.until,
            "lease": self.lease,
            "cls": self.cls,
            "arbiter": self.arbiter,
            "daemon_pid": self.daemon_pid,
        }
        if self.label is not None:
            doc["label"] = self.label
        return doc

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        def int64(name: str) -> int:
            v = f.integer(name)
            if not -(2**63) <= v < 2**63:
                raise BadDocument(f"{f.where}: field {name!r} is beyond 64 bits")
            return v

        def epoch(name: str) -> float:
            # A time a daemon writes: from 1970 to the year 9999. Anything else
            # (finite, within 64 bits) breaks every clock that shows it.
            v = f.number(name)
            if not 0 <= v < LAST_EPOCH:
                raise BadDocument(f"{f.where}: field {name!r} is no time a daemon writes")
            return v

        def text(name: str) -> str:
            return f.text(name)[:TEXT_SHOWN]

        label = f.opt_text("label")
        return cls(
            int64("uid"),
            text("user"),
            int64("pid"),
            int64("start"),
            epoch("since"),
            epoch("until"),
            text("lease"),
            text("cls"),
            text("arbiter"),
            int64("daemon_pid"),
            None if label is None else label[:TEXT_SHOWN],
        )


# ---------------------------------------------------------------------- ended leases


@dataclass(frozen=True, slots=True)
class EndedLease:
    """A lease that ended, and when: what ``hold audit`` says a stray outlived."""

    record: LeaseRecord
    ended: float

    def to_json(self) -> dict[str, Any]:
        return {**self.record.to_json(), "ended": self.ended}


@dataclass(frozen=True, slots=True)
class EndedLeases(Document):
    """``ended.json``: the last leases that ended, the oldest first."""

    KIND = "ended"
    VERSION = 1
    LEGACY = 0  # an older daemon's file: the bare list of leases
    MAX_SIZE = 4 * 1024 * 1024  # 200 leases of a few hundred bytes, and room

    leases: tuple[EndedLease, ...]

    def body(self) -> dict[str, Any]:
        return {"leases": [e.to_json() for e in self.leases]}

    @classmethod
    def legacy(cls, value: Any) -> dict[str, Any] | None:
        return {"leases": value} if isinstance(value, list) else None

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(
            tuple(EndedLease(lease_record(e), e.number("ended")) for e in f.objects("leases"))
        )


# ---------------------------------------------------------------------- the history


class LeaseEnd(StrEnum):
    """How a lease ended, as the history says it (``end``)."""

    ENDED = "ended"  # its holder ended it
    EXPIRED = "expired"  # its time limit did
    RELEASED = "released"  # hold release (``by`` whom)
    LIFELINE = "lifeline"  # its client's connection dropped
    OWNER_EXITED = "owner_exited"  # its detached owner exited
    RECOVERED = "recovered"  # its owner died while the daemon was down
    ACTIVE = "active"  # not ended: a live lease in a report (never written)


@dataclass(frozen=True, slots=True)
class HistoryLease(Document):
    """A line of ``history.jsonl``: a lease that ended (see :mod:`hold.daemon.history`)."""

    KIND = "lease"
    VERSION = 1
    LEGACY = 0  # an older daemon's lines: the kind, no version
    MAX_SIZE = 4096

    lease: str
    user: str
    uid: int
    cls: str
    devices: tuple[int, ...]
    label: str | None
    private: bool
    requested: float | None  # when its request arrived; None after a daemon restart
    granted: float
    ended: float
    end: LeaseEnd
    by: str | None  # who released it
    held: float | None  # seconds a scan saw its nodes held; None: nothing scanned
    cpu_s: float | None = None  # absent in lines of older daemons
    peak_bytes: int | None = None

    def body(self) -> dict[str, Any]:
        return {
            "lease": self.lease,
            "user": self.user,
            "uid": self.uid,
            "cls": self.cls,
            "devices": list(self.devices),
            "label": self.label,
            "private": self.private,
            "requested": self.requested,
            "granted": self.granted,
            "ended": self.ended,
            "end": self.end.value,
            "by": self.by,
            "held": self.held,
            "cpu_s": self.cpu_s,
            "peak_bytes": self.peak_bytes,
        }

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(
            f.text("lease"),
            f.text("user"),
            f.integer("uid"),
            f.text("cls"),
            f.integers("devices"),
            f.opt_text("label"),
            f.flag("private", False),
            f.opt_number("requested"),
            f.number("granted"),
            f.number("ended"),
            f.choice("end", LeaseEnd),
            f.opt_text("by"),
            f.opt_number("held"),
            f.opt_number("cpu_s"),
            f.opt_integer("peak_bytes"),
        )


@dataclass(frozen=True, slots=True)
class HistoryStray(Document):
    """A line of ``history.jsonl``: a process outside any lease seen holding a device."""

    KIND = "stray"
    VERSION = 1
    LEGACY = 0
    MAX_SIZE = 4096

    cls: str
    device: int
    pid: int
    uid: int | None
    user: str | None
    command: str
    memory_bytes: int | None
    seen: float
    lease: str | None = None  # the lease that held the device then, if one did

    def body(self) -> dict[str, Any]:
        return {
            "cls": self.cls,
            "device": self.device,
            "pid": self.pid,
            "uid": self.uid,
            "user": self.user,
            "command": self.command,
            "memory_bytes": self.memory_bytes,
            "seen": self.seen,
            "lease": self.lease,
        }

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(
            f.text("cls"),
            f.integer("device"),
            f.integer("pid"),
            f.opt_integer("uid"),
            f.opt_text("user"),
            f.text("command"),
            f.opt_integer("memory_bytes"),
            f.number("seen"),
            f.opt_text("lease"),
        )


# ---------------------------------------------------------------------- the ledger


class LeaseState(StrEnum):
    """Where a lease stands; saved in ``state.json`` and shown as its string."""

    ACTIVE = "active"  # granted, within its time limit
    EXPIRED = "expired"  # past its time limit, the client told: it stops within the grace
    ENDING = "ending"  # its trees are being stopped; its devices are not handed on yet


@dataclass(frozen=True, slots=True)
class TreeEntry:
    """A registered tree as ``state.json`` keeps it (:class:`hold.daemon.ledger.TreeRec`)."""

    tree_id: str
    leaf: str | None
    since: int
    grace: float
    root_pid: int | None
    root_start: int | None
    pgid: int | None
    sid: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "tree_id": self.tree_id,
            "leaf": self.leaf,
            "since": self.since,
            "grace": self.grace,
            "root_pid": self.root_pid,
            "root_start": self.root_start,
            "pgid": self.pgid,
            "sid": self.sid,
        }

    @classmethod
    def read(cls, f: Fields) -> TreeEntry:
        return cls(
            f.text("tree_id"),
            f.opt_text("leaf"),
            f.integer("since"),
            f.number("grace") if f.has("grace") else 10.0,
            f.opt_integer("root_pid"),
            f.opt_integer("root_start"),
            f.opt_integer("pgid"),
            f.opt_integer("sid"),
        )


@dataclass(frozen=True, slots=True)
class LeaseEntry:
    """A lease as ``state.json`` keeps it (:class:`hold.daemon.ledger.Lease`)."""

    lease_id: str
    cls: str
    devices: tuple[int, ...]
    label: str
    granted: float
    expires: float
    grace: float
    state: LeaseState
    private: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "cls": self.cls,
            "devices": list(self.devices),
            "label": self.label,
            "granted": self.granted,
            "expires": self.expires,
            "grace": self.grace,
            "state": self.state.value,
            "private": self.private,
        }

    @classmethod
    def read(cls, f: Fields) -> LeaseEntry:
        return cls(
            f.text("lease_id"),
            f.text("cls"),
            f.integers("devices"),
            f.text("label"),
            f.number("granted"),
            f.number("expires"),
            f.number("grace"),
            f.choice("state", LeaseState) if f.has("state") else LeaseState.ACTIVE,
            f.flag("private", False),
        )


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """A session as ``state.json`` keeps it (:class:`hold.daemon.ledger.SessionRec`)."""

    session_id: str
    owner_pid: int
    owner_start: int
    uid: int
    user: str
    lease: LeaseEntry | None
    trees: tuple[TreeEntry, ...]
    owner_cgroup: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "session_id": self.session_id,
            "owner_pid": self.owner_pid,
            "owner_start": self.owner_start,
            "uid": self.uid,
            "user": self.user,
            "lease": None if self.lease is None else self.lease.to_json(),
            "trees": [t.to_json() for t in self.trees],
        }
        if self.owner_cgroup is not None:
            doc["owner_cgroup"] = self.owner_cgroup
        return doc

    @classmethod
    def read(cls, f: Fields) -> SessionEntry:
        lease = f.nested("lease")
        return cls(
            f.text("session_id"),
            f.integer("owner_pid"),
            f.integer("owner_start"),
            f.integer("uid"),
            f.text("user"),
            None if lease is None else LeaseEntry.read(lease),
            tuple(TreeEntry.read(t) for t in f.objects("trees")) if f.has("trees") else (),
            f.opt_text("owner_cgroup"),
        )


@dataclass(frozen=True, slots=True)
class LedgerState(Document):
    """``state.json``: what the daemon must not forget (:mod:`hold.daemon.ledger`)."""

    KIND = "state"
    VERSION = 2
    OLDEST = 2
    LEGACY = 1  # an older daemon's file: {"version": 1, "sessions": [...]}, no kind
    MAX_SIZE = 64 * 1024 * 1024  # every live session of a large machine

    sessions: tuple[SessionEntry, ...]

    def body(self) -> dict[str, Any]:
        return {"sessions": [s.to_json() for s in self.sessions]}

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(tuple(SessionEntry.read(s) for s in f.objects("sessions")))


# ---------------------------------------------------------------------- hold up --detach


@dataclass(frozen=True, slots=True)
class UpHandOver(Document):
    """What ``hold up --detach`` hands its background supervisor (:mod:`hold.cli.upchild`):
    the resolved stack (:func:`hold_supervisor.stackfile.spec.to_json`), the
    settings of :class:`hold.cli.stackrun.UpSettings` and ``--for``'s seconds."""

    KIND = "up"
    VERSION = 1
    MAX_SIZE = 64 * 1024 * 1024

    spec: dict[str, Any]
    cgroups: str
    digest: str | None
    device: tuple[str, tuple[int, ...] | None] | None
    run_for: float | None

    def body(self) -> dict[str, Any]:
        device = (
            None
            if self.device is None
            else {"cls": self.device[0], "indices": _list_or_none(self.device[1])}
        )
        return {
            "spec": self.spec,
            "cgroups": self.cgroups,
            "digest": self.digest,
            "device": device,
            "run_for": self.run_for,
        }

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        dev = f.nested("device")
        device = None
        if dev is not None:
            device = (
                dev.text("cls"),
                dev.integers("indices") if dev.whole().get("indices") is not None else None,
            )
        return cls(
            f.obj("spec"), f.text("cgroups"), f.opt_text("digest"), device, f.opt_number("run_for")
        )


def _list_or_none(v: tuple[int, ...] | None) -> list[int] | None:
    return None if v is None else list(v)


@dataclass(frozen=True, slots=True)
class UpStatus(Document):
    """A line on ``hold up --detach``'s status pipe: something to say, or that the stack is up."""

    KIND = "up-status"
    VERSION = 1

    line: str | None = None
    ready: bool = False

    def body(self) -> dict[str, Any]:
        return {"line": self.line, "ready": self.ready}

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(f.opt_text("line"), f.flag("ready", False))
