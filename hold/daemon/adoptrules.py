"""What may be adopted (``--adopt PID``), and the adopted tree as the daemon sees it.

Shared by the client (:mod:`hold.cli.adopt`, which says why before it asks) and
the daemon (:mod:`hold.daemon.ops`, which decides: who asks comes from the kernel).
A process is named by ``(pid, start time)``; every rule reads /proc again.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from hold.daemon.ledger import SessionRec, TreeRec
from hold.protocol import number_field
from hold_supervisor.proc import scan
from hold_supervisor.proc.cgroup import cgroup_dir, v2_mount, within
from hold_supervisor.proc.identity import ProcessId, read_cmdline, user_name
from hold_supervisor.proc.tree import Tree, signalable_by


def refusal(pid: int, start: int | None, uid: int, asker: int, daemon: int) -> str | None:
    """Why ``uid`` (asking from the process ``asker``) may not adopt ``pid``; None if it may.

    ``start``: the start time it was named by (None: whatever runs as ``pid`` now).
    ``daemon``: the ticket daemon's pid, whose tree a stop must never reach.
    """
    if pid == 1:
        return "pid 1 (init) is never adopted"
    st = scan.stat_of(pid)
    if st is None or st.is_dead or (start is not None and st.starttime != start):
        return f"no process {pid}" + (" (it has ended)" if start is not None else "")
    if pid == 2 or st.ppid == 2:
        return f"pid {pid} is a kernel thread"
    if pid == asker:
        return f"pid {pid} is this very process"
    if pid in {a.pid for a in scan.ancestors(asker)}:
        return f"pid {pid} is an ancestor of this process (pid {asker})"
    if pid == daemon or pid in {a.pid for a in scan.ancestors(daemon)}:
        what = "the ticket daemon" if pid == daemon else "an ancestor of the ticket daemon"
        return f"pid {pid} is {what} (pid {daemon})"
    if not signalable_by(pid, uid):
        owner_uid = scan.uid_of(pid)
        owner = "?" if owner_uid is None else user_name(owner_uid)
        return (
            f"pid {pid} ({_command(pid)}) belongs to user {owner}, not {user_name(uid)}; "
            "only its owner or root may adopt it"
        )
    return None


def adopt_into(
    tree: TreeRec,
    d: Any,
    uid: int,
    peer: int,
    sessions: Iterable[SessionRec],
    mine: SessionRec | None,
) -> str | None:
    """The daemon's side: ``tree`` made the adoption ``d`` (``{"pid", "start"}``) asked
    by ``uid`` from the process ``peer``; why not, or None.

    The process is no descendant of the client, so it is believed only where
    the client may signal it (its own, or root asks), and never init, the
    daemon, the client's ancestors, or what another lease or guarded tree has.
    """
    if not isinstance(d, dict):
        return "bad adoption"
    pid, start = number_field(d, "pid", int), number_field(d, "start", int)
    why = refusal(pid, start, uid, peer, os.getpid()) or claimed_by(pid, sessions, mine)
    st = scan.stat_of(pid)
    if why is not None or st is None:
        return why or f"no process {pid}"
    tree.since, tree.root_pid, tree.root_start = start, pid, start
    # Its group and session only where it leads them: not its shell's.
    tree.pgid = pid if st.pgrp == pid else None
    tree.sid = pid if st.session == pid else None
    return None


def claimed_by(pid: int, sessions: Iterable[SessionRec], mine: SessionRec | None) -> str | None:
    """The lease or guarded tree ``pid`` already runs under (other than ``mine``), or None:
    a descendant of another session's owner, or in the cgroup leaf of another's tree."""
    me = scan.stat_of(pid)
    chain = {(a.pid, a.starttime) for a in [*([me] if me else []), *scan.ancestors(pid)]}
    where = cgroup_dir(pid, v2_mount())
    for s in sessions:
        if s is mine or not s.persistent:
            continue
        what = (
            f"{s.lease.cls} lease {s.lease.lease_id}" if s.lease is not None else "a guarded tree"
        ) + f" of {s.user} (holder pid {s.owner_pid})"
        if (s.owner_pid, s.owner_start) in chain:
            return f"pid {pid} runs under {what} already"
        if where is not None and any(t.leaf and within(where, t.leaf) for t in s.trees.values()):
            return f"pid {pid} lives in the cgroup of {what}"
    return None


def adopted_tree(t: TreeRec, uid: int | None) -> Tree:
    """The tree of an adoption record (``root_pid`` set), as far as ``uid`` may reach."""
    assert t.root_pid is not None and t.root_start is not None
    return Tree(t.tree_id, ProcessId(t.root_pid, t.root_start), t.pgid, t.sid, uid=uid)


def without_tree(
    found: dict[int, list[dict[str, Any]]], t: TreeRec | None, uid: int
) -> dict[int, list[dict[str, Any]]]:
    """A grant's scan (device -> holders) less the adopted tree ``t``'s members: the job
    being adopted holds its device already, and that is no reason to wait.

    The tree is looked at after the scan, so a holder the look does not show
    is either no member or a member that has ended since (a job whose children
    each hold the device for a moment: under load, nearly every scan saw one
    that the look no longer did, and the grant waited past 20 s). Only one
    still running, as the process the scan saw, is kept.
    """
    if t is None or t.root_pid is None or not found:
        return found
    limit = None if uid in (0, os.geteuid()) else uid
    members = set(adopted_tree(t, limit).look()[1])
    out = {
        i: [h for h in hs if h.get("pid") not in members and _still_running(h)]
        for i, hs in found.items()
    }
    return {i: hs for i, hs in out.items() if hs}


def _still_running(holder: dict[str, Any]) -> bool:
    """Is the holder the scan described still there (same pid and start time)? One
    named without a process (a GPU context NVML reports, say) is kept."""
    pid, start = holder.get("pid"), holder.get("starttime")
    if not isinstance(pid, int) or start is None:
        return True
    st = scan.stat_of(pid)
    return st is not None and not st.is_dead and st.starttime == start


def descends_from(pid: int, root: ProcessId) -> bool:
    """Is ``pid`` the process ``root`` or below it (by pid and start time)?"""
    st = scan.stat_of(pid)
    if st is not None and (pid, st.starttime) == tuple(root):
        return True
    return (root.pid, root.starttime) in {(a.pid, a.starttime) for a in scan.ancestors(pid)}


def _command(pid: int) -> str:
    try:
        return read_cmdline(pid)[:60]
    except Exception:
        return "?"
