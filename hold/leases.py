"""A lease as every part of ``hold`` sees it: its record, and whether a process is inside it.

The daemon writes the record (token files, its answers on the socket);
``hold check``, ``hold audit`` and ``--adopt`` read it. Whether a process is
covered is decided here, by ancestry or cgroup leaf and never by text, for the
daemon's ``check`` operation and for the client that reads the records itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hold_supervisor.proc import scan
from hold_supervisor.proc.cgroup import cgroup_dir, v2_mount, within
from hold_supervisor.proc.identity import ProcessId


class LeaseRecord(NamedTuple):
    """A live lease as the daemon records it: in token files (for people), and
    over its socket to ``hold check`` and ``hold audit`` (which believe only the
    socket). One shape for all of them."""

    lease: str
    cls: str
    devices: tuple[int, ...]
    label: str | None  # None where the owner made it private and the reader is not them
    holder_pid: int
    holder_start: int
    uid: int
    user: str
    granted: float
    expires: float
    command_pid: int | None
    leaves: tuple[str, ...]
    trees: tuple[str, ...]
    # The trees' roots, (pid, start time): an adopted job does not descend from
    # the holder, and with the /proc walk it has no leaf; its root is the proof.
    roots: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = self._asdict()
        for k in ("devices", "leaves", "trees"):
            d[k] = list(d[k])
        d["roots"] = [list(r) for r in self.roots]
        return d

    @classmethod
    def from_json(cls, d: Any) -> LeaseRecord:
        """A record from its JSON form; ValueError for anything else."""
        if not isinstance(d, dict):
            raise ValueError("a lease record must be an object")

        def need(name: str, *kinds: type) -> Any:
            v = d.get(name)
            if not isinstance(v, kinds) or isinstance(v, bool):
                raise ValueError(f"lease record: {name!r} of the wrong type")
            return v

        def seq(name: str, kind: type) -> tuple[Any, ...]:
            v = d.get(name) or []
            if not isinstance(v, list) or not all(isinstance(i, kind) for i in v):
                raise ValueError(f"lease record: {name!r} of the wrong type")
            return tuple(v)

        label = d.get("label")
        command = d.get("command_pid")
        return cls(
            need("lease", str),
            need("cls", str),
            seq("devices", int),
            label if isinstance(label, str) else None,
            need("holder_pid", int),
            need("holder_start", int),
            need("uid", int),
            need("user", str),
            float(need("granted", int, float)),
            float(need("expires", int, float)),
            command if isinstance(command, int) and not isinstance(command, bool) else None,
            seq("leaves", str),
            seq("trees", str),
            _roots(d.get("roots")),
        )

    def seen_by(self, viewer: int, private: bool) -> LeaseRecord:
        """As ``viewer`` (a uid) may see it: a private label only for its owner and root."""
        return self if not private or viewer in (0, self.uid) else self._replace(label=None)


def _roots(v: object) -> tuple[tuple[int, int], ...]:
    """``roots`` of a record: pairs of integers (pid, start time); ValueError otherwise."""
    if v is None:
        return ()
    out: list[tuple[int, int]] = []
    for r in v if isinstance(v, list) else [None]:
        if not (
            isinstance(r, list)
            and len(r) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        ):
            raise ValueError("lease record: 'roots' of the wrong type")
        out.append((r[0], r[1]))
    return tuple(out)


def judge(asker: ProcessId, cls: str, records: list[LeaseRecord]) -> tuple[bool, str]:
    """``hold check``'s answer for the process ``asker``: ``(covered, why)``."""
    covered, why, _lease = judge_lease(asker, cls, records)
    return covered, why


def judge_lease(
    asker: ProcessId, cls: str, records: list[LeaseRecord]
) -> tuple[bool, str, LeaseRecord | None]:
    """``hold check``'s answer for the process ``asker`` against live lease records.

    Proven by ancestry, never by text: an ancestor of the asker (or the asker
    itself), matched by pid *and* start time, must be the holder of a lease
    of ``cls``, or the asker must live in the cgroup leaf of that lease's
    tree (which covers a descendant that daemonised and lost its ancestry).
    """
    me = scan.stat_of(asker.pid)
    if me is None or me.starttime != asker.starttime:
        return False, "the asking process is gone", None
    chain = {(st.pid, st.starttime) for st in [me, *scan.ancestors(asker.pid)]}
    where = cgroup_dir(asker.pid, v2_mount())
    others: list[str] = []
    for rec in records:
        label = f"{rec.cls} lease {rec.lease} ({rec.label!r}, holder pid {rec.holder_pid})"
        holder = (rec.holder_pid, rec.holder_start)
        if rec.cls != cls:
            if holder in chain:
                others.append(label)
            continue
        if holder in chain:
            return True, f"inside {label}", rec
        if any(r in chain for r in rec.roots):
            return True, f"inside {label} (its adopted job)", rec
        for leaf in rec.leaves:
            if where is not None and within(where, leaf):
                return True, f"inside {label} (by its cgroup)", rec
    if others:
        return False, f"no {cls} lease covers this process; only {', '.join(others)}", None
    return False, f"no {cls} lease covers this process", None
