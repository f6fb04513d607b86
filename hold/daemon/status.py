"""``hold status``, as the daemon answers it: every device, its holder and its line."""

from __future__ import annotations

import os
from typing import Any

from hold.daemon import devlock
from hold.daemon.grants import Grants
from hold.daemon.state import DaemonState, label_for
from hold.devices.classes import LAST_GPU_MINOR, NVIDIA_MAJOR
from hold_supervisor.proc.identity import user_name


def status(st: DaemonState, grants: Grants, viewer: int) -> dict[str, Any]:
    """Every device and its holder as ``viewer`` (a uid) may see it: labels of
    private leases only for their owner and root. Devices leased through
    another arbiter (another user's daemon) are shown from their lock's record."""
    locked = devlock.locked_inodes()
    classes = {}
    for cls in st.classes:
        devices = [
            {"index": i, "holder": _holder(st, grants, cls, i, viewer, locked)}
            for i in range(st.sizes[cls])
        ]
        for i, dev in enumerate(devices):
            minor = _nvidia_minor(st.keys[cls][i] if i < len(st.keys[cls]) else "")
            if minor is not None:
                dev["nvidia_minor"] = minor
        waiting = [
            {
                "label": r.label if viewer in (0, r.conn.uid) or not r.private else None,
                "pid": r.conn.peer.pid,
                "user": user_name(r.conn.uid),
                "count": r.count,
                "indices": r.indices,
            }
            for r in grants.queues[cls]
        ]
        classes[cls] = {"devices": devices, "queue": waiting}
    # Counters since the daemon started (hold metrics): grants, expiries, waits per class.
    counters = {
        cls: dict(
            st.usage.counters.get(
                cls, {"grants": 0, "expiries": 0, "waits": 0, "wait_seconds": 0.0}
            )
        )
        for cls in st.classes
    }
    return {
        "classes": classes,
        "arbiter": st.arbiter(),
        "counters": counters,
        "started": st.usage.started,
        "limits": st.limits_for(viewer, grants.queued_of(viewer)),
    }


def _holder(
    st: DaemonState,
    grants: Grants,
    cls: str,
    i: int,
    viewer: int,
    locked: set[tuple[int, int, int]],
) -> dict[str, Any] | None:
    """Who holds ``cls:i``: a lease of ours, one of another arbiter's, or nobody (None)."""
    sid = grants.held.get((cls, i))
    s = st.sessions.get(sid) if sid else None
    if s is not None and s.lease is not None:
        return {
            "lease": s.lease.lease_id,
            "label": label_for(s, viewer),
            "private": s.lease.private,
            "pid": s.owner_pid,
            "user": s.user,
            "uid": s.uid,
            "since": s.lease.granted,
            "expires": s.lease.expires,
            "state": s.lease.state,
            # What its trees use now (hold.daemon.figures); None: no tree, or unread.
            "usage": st.usage.figures.doc(s),
        }
    rec = st.locks.held_elsewhere(st.keys[cls][i], locked)
    if rec is None:
        return _not_grantable(st, grants, cls, i)
    return {
        "lease": rec.get("lease", "?"),
        "label": rec.get("label"),
        "pid": rec.get("pid"),
        "user": rec.get("user", "?"),
        "uid": rec.get("uid"),
        "since": rec.get("since"),
        "expires": rec.get("until"),
        "state": "elsewhere",
        "arbiter": rec.get("arbiter"),
        # the kernel's holder of the lock, whose file names no arbiter of it (devlock.owner_of)
        "foreign": bool(rec.get("foreign")),
        # who made that holder's record file instead of its user (devlock.owner_of)
        "record_by": rec.get("record_by"),
    }


def _nvidia_minor(key: str) -> int | None:
    """The GPU minor of a device whose key is an NVIDIA GPU node's (``c195-N``), else None.

    The GPU's own figures (``gpu``: utilisation, memory) are added by the
    client (:func:`hold.views.status.with_gpu`): NVML opens the GPU's node, and
    the daemon's own opens would count in the kernel's count of the node's
    opens that proves a device empty (:mod:`hold.daemon.occupancy`)."""
    kind, _, minor = key.partition("-")
    if kind != f"c{NVIDIA_MAJOR}" or not minor.isdigit() or int(minor) > LAST_GPU_MINOR:
        return None
    return int(minor)


def _not_grantable(st: DaemonState, grants: Grants, cls: str, i: int) -> dict[str, Any] | None:
    """A device no lease holds that is still not free: a process outside any lease
    holds it (the last check found it), or its lock file cannot be used. None
    where it is free. Shown as its "holder" with state ``blocked`` or
    ``unusable``, the reason as its label (it was shown "free", issue 25)."""
    blocked = grants.blocked.get((cls, i))
    if blocked:
        h = blocked[0]
        more = f" and {len(blocked) - 1} more" if len(blocked) > 1 else ""
        why = f"held outside any lease by pid {h.get('pid')} ({h.get('command')}){more}"
        return _reason("blocked", why, h.get("pid"), str(h.get("user", "?")), h.get("uid"))
    path = st.locks.path(st.keys[cls][i])
    err = grants.elsewhere.get((cls, i), {}).get("error") or devlock.unusable(path)
    if err:
        # Whoever owns the file is who made it unusable (or can mend it).
        try:
            uid: int | None = os.lstat(path).st_uid
        except OSError:
            uid = None
        user = user_name(uid) if uid is not None else "?"
        return _reason("unusable", f"its lock file cannot be used: {err}", None, user, uid)
    return None


def _reason(state: str, why: str, pid: object, user: str, uid: object) -> dict[str, Any]:
    return {
        "lease": "-",
        "label": why,
        "pid": pid,
        "user": user,
        "uid": uid,
        "since": None,
        "expires": None,
        "state": state,
        "why": why,
    }
