"""``hold status``, as the daemon answers it: every device, its holder and its line."""

from __future__ import annotations

import os
from typing import Any

from hold.daemon import devlock
from hold.daemon.grants import Grants
from hold.daemon.occupancy import unreadable_why
from hold.daemon.state import DaemonState, label_for
from hold.devices.classes import LAST_GPU_MINOR, NVIDIA_MAJOR
from hold_supervisor.proc.identity import user_name
from hold_supervisor.proc.origin import words


def status(st: DaemonState, grants: Grants, viewer: int) -> dict[str, Any]:
    """Every device and its holder as ``viewer`` (a uid) may see it: labels of
    private leases only for their owner and root. Devices leased through
    another arbiter (another user's daemon) are shown from their lock's record."""
    locked = devlock.locked_inodes()
    classes = {}
    unknown: dict[str, list[int]] = {}
    # What the counts say of every device, read once (a look at the mount
    # namespaces and the kernel's queue), not once per device.
    known = st.occupancy.states([k for c in st.classes if st.scanned[c] for k in st.keys[c]])
    for cls in st.classes:
        devices = [_device(st, grants, cls, i, viewer, locked, known) for i in range(st.sizes[cls])]
        unknown[cls] = [
            d["index"]
            for d in devices
            if d.get("known") == "unknown" or (d["holder"] or {}).get("state") == "in use"
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
    # Naming needs a scan: one starts now (in a worker; this answer stays quick).
    if any(unknown.values()) and grants.look_unknown({c: i for c, i in unknown.items() if i}):
        for cls, indices in unknown.items():
            for dev in classes[cls]["devices"]:
                if dev["index"] not in indices:
                    continue
                if dev["holder"] is not None:
                    dev["holder"]["label"] = dev["holder"]["why"] = (
                        f"{dev['holder']['why']} (a scan is running: ask again)"
                    )
                else:
                    dev["proof"] += " (a scan is running: ask again)"
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


def _device(
    st: DaemonState,
    grants: Grants,
    cls: str,
    i: int,
    viewer: int,
    locked: set[tuple[int, int, int]],
    counts: dict[str, tuple[str, str]],
) -> dict[str, Any]:
    """``cls:i``: its holder (None where nobody holds it, see :func:`_holder`), and
    what is known of a device nobody holds: ``known`` -- ``free``, ``unknown``
    (no scan has started its count yet, or it was opened since), ``unproven``
    (this daemon cannot prove it free at all) -- and ``proof``: how that is
    known, or why no more is."""
    holder = _holder(st, grants, cls, i, viewer, locked)
    dev: dict[str, Any] = {"index": i, "holder": holder}
    if holder is not None:
        return dev
    if not st.scanned[cls]:
        dev["known"], dev["proof"] = "free", "a logical device (no node to hold)"
        return dev
    key = st.keys[cls][i]
    known, proof = counts[key]
    if known == "in use":
        dev["holder"] = _reason("in use", proof, None, "?", None)
        return dev
    unproven = _unproven(st, cls, key)
    if unproven is not None:
        known, proof = "unproven", unproven
    dev["known"], dev["proof"] = known, proof
    return dev


def _unproven(st: DaemonState, cls: str, key: str) -> str | None:
    """Why this daemon can never prove ``key`` free (see
    :meth:`hold.daemon.occupancy.Look.why_unproven`), or None. A daemon that
    is not root may not read root's processes (pid 1 is one), so its scans
    are never whole; only NVML can speak for what they miss, and only for
    NVIDIA GPUs."""
    if st.unreadable != "refuse" or os.geteuid() == 0 or _nvidia_minor(key) is not None:
        return None
    return unreadable_why()


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
        whose = words(h.get("origin"))
        whose = f"{whose}: " if whose else ""
        why = f"held outside any lease by pid {h.get('pid')} ({whose}{h.get('command')}){more}"
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
