"""``hold report``'s document: the history (:mod:`hold.daemon.history`) summed per user and
per device.

Answered by the daemon (op ``report``) for anyone who asks, since a system
daemon's history is root's alone (0600) and every user must still see the
totals; read from the file by the client itself only where no daemon serves
(a per-user daemon that left when idle: the file is that user's own).

Leased and held times are device-seconds (a lease of two devices for an hour
is two hours), clipped to the report's start, so the users' totals and the
devices' totals agree. A wait is the time from a request's arrival to its
grant (unknown for a lease granted before a daemon restart). CPU time
(``cpu_s``: the lease's processes' CPU seconds, a lease of two devices
counted half on each device) and peak memory (``peak_bytes``: the most any
one lease's processes held) are None where no lease had them (a history line
written before they were recorded, a lease without a tree, or one too short
to be read: :mod:`hold.daemon.figures`); ``cpu_unmeasured`` counts the leases
without. Labels: a
viewer sees all of their own (and root all); other users' only where the
configuration says ``report: {labels: true}``, and never a private one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hold.daemon import history
from hold.daemon.state import report_settings
from hold.protocol import number_field

if TYPE_CHECKING:
    from hold.daemon.state import DaemonState

STRAYS_SHOWN = 50  # the latest stray sightings listed


class _Acc:
    """The sums of one user or one device."""

    def __init__(self) -> None:
        self.leases = 0
        self.leased = 0.0
        self.held = 0.0
        self.unmeasured = 0.0  # leased time of leases whose held time is unknown
        self.waits: list[float] = []
        self.ends: dict[str, int] = {}
        self.strays = 0
        self.cpu: float | None = None
        self.peak: int | None = None
        self.cpu_unmeasured = 0

    def figures(self, cpu: float | None, peak: int | None) -> None:
        """One lease's CPU seconds and peak memory (each None where unknown)."""
        if cpu is None:
            self.cpu_unmeasured += 1
        else:
            self.cpu = (self.cpu or 0.0) + cpu
        if peak is not None:
            self.peak = max(self.peak or 0, peak)

    def add(self, leased: float, held: float | None, wait: float | None, end: str) -> None:
        self.leases += 1
        self.leased += leased
        if held is None:
            self.unmeasured += leased
        else:
            self.held += min(held, leased)
        if wait is not None:
            self.waits.append(wait)
        self.ends[end] = self.ends.get(end, 0) + 1

    def doc(self) -> dict[str, Any]:
        return {
            "leases": self.leases,
            "leased_s": round(self.leased, 3),
            "held_s": round(self.held, 3),
            "unmeasured_s": round(self.unmeasured, 3),
            "waits": len(self.waits),
            "wait_median_s": round(_median(self.waits), 3) if self.waits else None,
            "wait_max_s": round(max(self.waits), 3) if self.waits else None,
            "expiries": self.ends.get("expired", 0),
            "releases": self.ends.get("released", 0),
            "ends": dict(sorted(self.ends.items())),
            "strays": self.strays,
            "cpu_s": None if self.cpu is None else round(self.cpu, 3),
            "cpu_unmeasured": self.cpu_unmeasured,
            "peak_bytes": self.peak,
        }


def build(
    entries: list[dict[str, Any]],
    viewer: int,
    *,
    show_labels: bool,
    since: float,
    now: float | None = None,
) -> dict[str, Any]:
    """The report of ``entries`` as ``viewer`` (a uid) may see it (version 1)."""
    now = time.time() if now is None else now
    users: dict[int, _Acc] = {}
    names: dict[int, str] = {}
    labels: dict[int, dict[str, float]] = {}
    devices: dict[str, _Acc] = {}
    strays: list[dict[str, Any]] = []
    for e in entries:
        try:
            if e["kind"] == "lease":
                _lease(e, since, users, names, labels, devices, viewer, show_labels)
            else:
                strays.append(_stray(e, users, names, devices, viewer))
        except (KeyError, TypeError, ValueError):
            continue  # not an entry this version wrote
    out_users = []
    for uid, acc in sorted(users.items(), key=lambda kv: (-kv[1].leased, kv[0])):
        mine = viewer in (0, uid)
        shown = labels.get(uid, {}) if mine or show_labels else None
        top = None if shown is None else dict(sorted(shown.items(), key=lambda kv: -kv[1])[:10])
        out_users.append(
            {
                "user": names.get(uid, str(uid)),
                "uid": uid,
                **acc.doc(),
                "labels": None if top is None else {k: round(v, 3) for k, v in top.items()},
            }
        )
    return {
        "version": 1,
        "since": since or None,
        "now": now,
        "users": out_users,
        "devices": [{"device": d, **acc.doc()} for d, acc in sorted(devices.items())],
        "strays": sorted(strays, key=lambda s: s["seen"])[-STRAYS_SHOWN:],
    }


def _lease(
    e: dict[str, Any],
    since: float,
    users: dict[int, _Acc],
    names: dict[int, str],
    labels: dict[int, dict[str, float]],
    devices: dict[str, _Acc],
    viewer: int,
    show_labels: bool,
) -> None:
    uid, granted, ended = int(e["uid"]), float(e["granted"]), float(e["ended"])
    span = max(0.0, ended - max(granted, since))
    count = len(e["devices"])
    held = None if e.get("held") is None else float(e["held"]) * span / max(ended - granted, 1e-9)
    requested = e.get("requested")
    wait = granted - float(requested) if requested is not None and granted >= since else None
    end = str(e["end"])
    names[uid] = str(e["user"])
    # CPU time clipped to the report's start as the leased time is; absent in old lines.
    cpu = None if e.get("cpu_s") is None else float(e["cpu_s"]) * span / max(ended - granted, 1e-9)
    peak = None if e.get("peak_bytes") is None else int(e["peak_bytes"])
    user = users.setdefault(uid, _Acc())
    user.add(span * count, None if held is None else held * count, wait, end)
    user.figures(cpu, peak)
    for i in e["devices"]:
        device = devices.setdefault(f"{e['cls']}:{i}", _Acc())
        device.add(span, held, wait, end)
        device.figures(None if cpu is None else cpu / max(count, 1), peak)
    private = bool(e.get("private"))
    if viewer in (0, uid) or (show_labels and not private):
        mine = labels.setdefault(uid, {})
        mine[str(e["label"])] = mine.get(str(e["label"]), 0.0) + span * count


def _stray(
    e: dict[str, Any],
    users: dict[int, _Acc],
    names: dict[int, str],
    devices: dict[str, _Acc],
    viewer: int,
) -> dict[str, Any]:
    uid = e.get("uid")
    device = f"{e['cls']}:{int(e['device'])}"
    devices.setdefault(device, _Acc()).strays += 1
    if isinstance(uid, int):
        users.setdefault(uid, _Acc()).strays += 1
        names.setdefault(uid, str(e.get("user") or uid))
    # A command line can say what someone works on: its owner's and root's to read.
    command = e.get("command") if viewer == 0 or viewer == uid else None
    return {
        "device": device,
        "pid": int(e["pid"]),
        "uid": uid,
        "user": e.get("user"),
        "seen": float(e["seen"]),
        "memory_bytes": e.get("memory_bytes"),
        "command": command,
        "lease": e.get("lease"),
    }


def answer(st: DaemonState, viewer: int, msg: dict[str, Any]) -> dict[str, Any]:
    """The daemon's answer to ``{"op": "report", "since": EPOCH_SECONDS}`` (since optional)."""
    since = number_field(msg, "since", float, 0.0)
    now = time.time()
    entries = history.read(st.sd.path, since) + live_entries(st, now)
    return build(
        entries, viewer, show_labels=report_settings(st.config_path)[0], since=since, now=now
    )


def live_entries(st: DaemonState, now: float) -> list[dict[str, Any]]:
    """The live leases as history entries that end ``now`` (``end``: ``active``)."""
    out = []
    for s in st.sessions.values():
        lease = s.lease
        if lease is None:
            continue
        cpu, peak = st.usage.figures.most(lease.lease_id)
        out.append(
            {
                "kind": "lease",
                "lease": lease.lease_id,
                "user": s.user,
                "uid": s.uid,
                "cls": lease.cls,
                "devices": list(lease.devices),
                "label": lease.label,
                "private": lease.private,
                "granted": lease.granted,
                "requested": st.usage.requested.get(lease.lease_id),
                "ended": now,
                "end": "active",
                "by": None,
                "held": st.usage.held(lease.lease_id),
                "cpu_s": cpu,
                "peak_bytes": peak,
            }
        )
    return out


def _median(values: list[float]) -> float:
    """The median (``statistics`` would bring ``decimal`` and ``random`` into the daemon)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
