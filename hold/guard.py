"""``hold check``: is the caller inside a live ticket for a device class?

The answer comes from the arbiter that grants the leases, never from a file:
token files sit in a directory the caller may control, and anyone can write
one. ``hold check`` connects to the arbiter's socket (it never starts one: a
daemon that has just started holds no lease) and asks; the arbiter learns
who asks from the kernel (``SO_PEERCRED``) and answers by ancestry or by
cgroup leaf (:func:`hold.daemon.judge`). The arbiter itself must be the
machine's (root) or the caller's own: a daemon of another user could answer
anything.

Fails closed within :data:`TIMEOUT`: a daemon that does not accept the
connection, or does not answer, in that time is a "no" (exit 1, as any
other), with the daemon, its state directory and the time named.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from hold import waits
from hold.protocol import ProtocolError
from hold.records import LeaseRecord
from hold.statedir import StateDir
from supervisor import procscan
from supervisor.cgroup import cgroup_dir, v2_mount, within
from supervisor.identity import ProcessId
from supervisor.parse import BadValue

TIMEOUT = waits.CHECK  # connect, send, each answer (2 s; hold check fails closed after it)


def check(sd: StateDir, cls: str) -> tuple[bool, str]:
    """``(covered, one line saying why)`` for this process (and so for its parent)."""
    ok, why, _lease = check_lease(sd, cls, want_lease=False)
    return ok, why


def check_lease(
    sd: StateDir, cls: str, *, want_lease: bool = True
) -> tuple[bool, str, LeaseRecord | None]:
    """:func:`check`, and the lease that covers this process when it is covered.

    The daemon's verdict is the answer. Which lease it found is asked too
    (``leases``: the records it judged by) and found by the same rule
    (:func:`judge_lease`) for this same process; None if that does not agree.
    """
    from hold.client import Client, DaemonSilent, DaemonUnreachable

    no = f"no {cls} lease covers this process"
    try:
        client = Client.connect(sd, autostart=False, answer=TIMEOUT)
    except DaemonUnreachable as e:
        return False, f"{no}: {e}", None
    lease = None
    try:
        _pid, uid, _gid = struct.unpack(
            "3i",
            client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")),
        )
        if uid not in (0, os.geteuid()):
            return (
                False,
                (
                    f"{no}: the daemon at {sd.socket} runs as uid {uid}, neither "
                    "root nor you; its answer proves nothing"
                ),
                None,
            )
        ans = client.request({"op": "check", "cls": cls}, TIMEOUT)
        if want_lease and ans.get("covered") is True:
            lease = _covering(client.request({"op": "leases"}, TIMEOUT), cls)
    except DaemonSilent as e:
        return False, f"{no}: {e}", None
    except (DaemonUnreachable, OSError, ProtocolError, TimeoutError) as e:
        return False, f"{no}: no answer from the ticket daemon at {sd.socket}: {e}", None
    finally:
        client.close()
    if ans.get("ev") == "error":
        raise BadValue("--device", cls, str(ans.get("error")))
    return ans.get("covered") is True, str(ans.get("why")), lease


def _covering(ans: dict[str, Any], cls: str) -> LeaseRecord | None:
    """The lease of ``cls`` among the daemon's ``leases`` answer that covers this process."""
    given = ans.get("leases")
    records = []
    for raw in given if isinstance(given, list) else []:
        try:
            records.append(LeaseRecord.from_json(raw))
        except ValueError:
            continue
    return judge_lease(ProcessId.of(os.getpid()), cls, records)[2]


def check_document(ok: bool, why: str, cls: str, lease: LeaseRecord | None) -> dict[str, object]:
    """``hold check --json``: version 1."""
    doc: dict[str, object] = {"version": 1, "ok": ok, "device": cls, "why": why, "lease": None}
    if lease is not None:
        doc["lease"] = {
            "id": lease.lease,
            "class": lease.cls,
            "devices": list(lease.devices),
            "label": lease.label,
            "user": lease.user,
            "holder_pid": lease.holder_pid,
            "granted": lease.granted,
            "expires": lease.expires,
        }
    return doc


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
    me = procscan.stat_of(asker.pid)
    if me is None or me.starttime != asker.starttime:
        return False, "the asking process is gone", None
    chain = {(st.pid, st.starttime) for st in [me, *procscan.ancestors(asker.pid)]}
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
