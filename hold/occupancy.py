"""Is a device empty? The holder scan (hold.holders), as the daemon uses it around every grant.

Nobody is handed a device that is not empty. Before a grant, the device's own
nodes are scanned (not the class's shared control nodes, which every user of
the class opens); a process holding one is outside any lease, since the device
is not leased, and the grant waits for it. At the end of a lease, a process
that started during the lease and still holds one of its device nodes used
the device without a ticket (or is a survivor of the lease that escaped its
tree): its tree is stopped before the next grant, whoever's it is (within
what the lease's user could signal), and the stop says who it was.

This is the one place where holding something makes a process a target.
``supervisor.stop`` never signals a non-member for holding a tree's regular
file or port (anyone may open a file the moment a tree has it open); a
*device node* of a lease is different, because using it without the lease
breaks "one holder at a time".

Both run in the daemon's worker threads: a scan of a large machine takes a
good fraction of a second and must not stall the event loop.
"""

from __future__ import annotations

import os
from typing import Any

from hold.devices import DeviceClass
from hold.holders import Holder, details, device_memory, scan, targets
from hold.scancache import ScanCache
from supervisor import procscan
from supervisor.identity import ProcessId, user_name
from supervisor.stop import StopReport, stop_tree
from supervisor.tree import Tree


def has_nodes(cls: DeviceClass) -> bool:
    """False for a class with only its logical device (nothing to scan)."""
    return bool(cls.device_nodes())


def holders_of(
    cls: DeviceClass, devices: list[int], cache: ScanCache | None = None
) -> dict[int, list[dict[str, Any]]]:
    """device index -> who holds one of its nodes now (pid, user, command, memory).

    ``cache``: the daemon's (see :mod:`hold.scancache`: processes read a moment
    ago holding nothing are not read again)."""
    tgts = {k: t for k, t in targets({cls.name: cls}, cls.name).items()
            if t.unit is not None and t.unit in devices}  # fmt: skip
    if not tgts:
        return {}
    found = [h for h in scan(tgts, cache=cache).holders if not cls.allows(h.pid, h.uid)]
    memory = device_memory(found)
    out: dict[int, list[dict[str, Any]]] = {}
    for h in found:
        assert h.unit is not None
        out.setdefault(h.unit, []).append(_describe(h, memory))
    return out


def _describe(h: Holder, memory: dict[tuple[int, str, int | None], int]) -> dict[str, Any]:
    user = user_name(h.uid)
    return {
        "pid": h.pid, "starttime": h.starttime, "uid": h.uid, "user": user,
        "command": details(h.pid).command[:200], "node": h.node,
        "memory_bytes": memory.get((h.pid, h.cls, h.unit)),
    }  # fmt: skip


class LeftoverStop(StopReport):
    """The stop of one device holder at a lease's end, and who that holder was.

    A :class:`StopReport` (so it logs and counts like any other) with
    ``holder``: the scan's description of the process it was started for --
    ``pid``, ``starttime``, ``uid``, ``user``, ``command``, ``node``,
    ``memory_bytes`` -- plus ``device`` (the index in its class) and
    ``class``. The daemon logs it: a process that used a leased device
    without the ticket was stopped, and this says whose it was.
    """

    __slots__ = ("holder",)

    def __init__(self, report: StopReport, holder: dict[str, Any]) -> None:
        super().__init__(report.tree_id, report.signal, report.method)
        for name in StopReport.__slots__:
            setattr(self, name, getattr(report, name))
        self.holder = holder


def stop_leftovers(
    cls: DeviceClass, devices: list[int], *, uid: int | None, grace: float, granted: float,
    cache: ScanCache | None = None,
) -> tuple[list[StopReport], dict[int, list[dict[str, Any]]]]:  # fmt: skip
    """Stop the trees of whoever still holds ``devices``; (reports, who still holds them).

    Only processes started after the lease was ``granted`` (wall clock) are
    its leftovers: an older one (granted past with ``busy_devices: warn``) was
    never the lease's to stop. ``uid``: stop only what that user could have
    stopped (a daemon running as root ending another user's lease).

    Each report is a :class:`LeftoverStop`, naming the holder (pid, user,
    command, node, device) it was made for.
    """
    since = procscan.ticks_at(granted) - 2  # ticks of slack for rounding
    reports: list[StopReport] = []
    found = holders_of(cls, devices, cache)
    for index, holders in found.items():
        for h in holders:
            st = procscan.stat_of(h["pid"])
            if st is None or st.starttime != h["starttime"] or st.is_dead or h["pid"] == 1:
                continue
            if st.starttime < since:
                continue
            if h["pid"] == os.getpid():
                continue
            tree = Tree(
                f"left{h['pid']}", ProcessId(h["pid"], st.starttime),
                st.pgrp if st.pgrp == h["pid"] else None,
                st.session if st.session == h["pid"] else None,
                uid=uid,
            )  # fmt: skip
            report = stop_tree(tree, grace=grace)
            reports.append(LeftoverStop(report, {**h, "class": cls.name, "device": index}))
    # Scanned again only if something was stopped: otherwise the first scan,
    # taken after the lease's trees were stopped, is the answer (and it
    # serves the next grant too: see the module docstring).
    return reports, holders_of(cls, devices, cache) if reports else found
