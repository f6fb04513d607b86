"""``hold check``: is the caller inside a live ticket for a device class?

The answer comes from the arbiter that grants the leases, never from a file:
token files sit in a directory the caller may control, and anyone can write
one. ``hold check`` connects to the arbiter's socket (it never starts one: a
daemon that has just started holds no lease) and asks; the arbiter learns
who asks from the kernel (``SO_PEERCRED``) and answers by ancestry or by
cgroup leaf (:func:`hold.leases.judge`). The arbiter itself must be the
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

from hold.client import waits
from hold.client.connection import Client, DaemonSilent, DaemonUnreachable
from hold.leases import LeaseRecord, judge_lease
from hold.protocol import Ev, Op, ProtocolError
from hold.statedir import StateDir
from hold_supervisor.parse import BadValue
from hold_supervisor.proc.identity import ProcessId

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
    (:func:`hold.leases.judge_lease`) for this same process; None if that does not agree.
    """
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
        ans = client.request({"op": Op.CHECK, "cls": cls}, TIMEOUT)
        if want_lease and ans.get("covered") is True:
            lease = _covering(client.request({"op": Op.LEASES}, TIMEOUT), cls)
    except DaemonSilent as e:
        return False, f"{no}: {e}", None
    except (DaemonUnreachable, OSError, ProtocolError, TimeoutError) as e:
        return False, f"{no}: no answer from the ticket daemon at {sd.socket}: {e}", None
    finally:
        client.close()
    if ans.get("ev") == Ev.ERROR:
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
