"""``hold audit``: every process that holds a device node, and whether a ticket covers it.

The holders are found by the scan in :mod:`hold.devices.holders` (shared with the
daemon's occupancy checks); this module is the command's own work:
attributing each holder to a lease, the report (table or ``--json``), and
``--kill``.

Covered means: the holder descends (matched by pid *and* start time) from a
live lease's holder, or lives in the cgroup leaf of a tree registered for that
lease. Anything else is STRAY, with the reason.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from hold.client.connection import Client, DaemonSilent, DaemonUnreachable
from hold.devices.classes import DeviceClass
from hold.devices.holders import Holder, details, device_memory, scan, targets
from hold.errors import HoldError
from hold.leases import LeaseRecord
from hold.protocol import Op, ProtocolError
from hold.statedir import StateDir
from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.cgroup import cgroup_dir, v2_mount, within
from hold_supervisor.proc.identity import ProcessId, Stat, user_name
from hold_supervisor.proc.origin import origin

if TYPE_CHECKING:
    from hold.devices.nvml import Prefetch
    from hold.documents import EndedLease

# ---------------------------------------------------------------- attribution


class LeasesUnknown(HoldError):
    """The arbiter is there but did not say which leases live: nothing is
    attributed and nothing is stopped (exit 125)."""


class LeaseView(NamedTuple):
    lease: str
    cls: str
    devices: tuple[int, ...]
    label: str
    holder_pid: int
    holder_start: int
    leaves: tuple[str, ...]
    alive: bool  # the holder still runs
    roots: tuple[tuple[int, int], ...] = ()  # adopted jobs' roots (pid, start time)


def live_leases(sd: StateDir) -> list[LeaseView]:
    """The live leases, as the arbiter serving ``sd`` tells them (one view per lease).

    Asked over its socket, never read from token files: a token in a directory
    the caller controls would make a stray look covered. No daemon serving
    there means no live lease (none is started for an audit). A daemon that
    is there but does not answer (stopped, stalled) raises
    :class:`LeasesUnknown`: its leases' holders would all look stray, and
    ``--kill`` would stop them.
    """
    if not os.path.exists(sd.socket):
        return []  # what connecting would find, without importing the client (~8 ms, issue 13)

    try:
        client = Client.connect(sd, autostart=False)
    except DaemonSilent as e:
        raise LeasesUnknown(f"cannot tell which holders a lease covers: {e}") from None
    except DaemonUnreachable:
        return []
    try:
        ans = client.request({"op": Op.LEASES})
    except (DaemonUnreachable, OSError, ProtocolError, TimeoutError) as e:
        raise LeasesUnknown(f"cannot tell which holders a lease covers: {e}") from None
    finally:
        client.close()
    out: list[LeaseView] = []
    if not ans.get("leases"):
        return out

    for raw in ans["leases"]:
        try:
            rec = LeaseRecord.from_json(raw)
        except ValueError:
            continue
        st = procscan.stat_of(rec.holder_pid)
        alive = st is not None and not st.is_dead and st.starttime == rec.holder_start
        out.append(
            LeaseView(
                rec.lease,
                rec.cls,
                rec.devices,
                rec.label or "(private)",
                rec.holder_pid,
                rec.holder_start,
                rec.leaves,
                alive,
                rec.roots,
            )
        )
    return out


class Verdict(NamedTuple):
    covered: bool
    lease: str | None
    label: str | None
    why: str


def attribute(
    h: Holder,
    leases: list[LeaseView],
    procs: Mapping[int, Stat],
    ended: list[EndedLease] | None = None,
) -> Verdict:
    """Which lease covers ``h``, and how; or why it is stray.

    ``ended``: leases that ended (the daemon's ``ended.json``), to name the
    lease a stray outlived. That match may use the ``HOLD_TREE`` marker: it
    only explains a stray, it never covers anything.
    """
    chain = {(a.pid, a.starttime) for a in procscan.ancestors(h.pid, procs)}
    chain.add((h.pid, h.starttime))
    where = _cgroup_dir(h.pid)
    related: list[tuple[LeaseView, str]] = []
    for lv in leases:
        by = None
        if (lv.holder_pid, lv.holder_start) in chain:
            by = f"descends from holder pid {lv.holder_pid}"
        elif any(r in chain for r in lv.roots):
            by = "in the lease's adopted job"
        elif where is not None and any(within(where, lf) for lf in lv.leaves):
            by = "in the lease's cgroup"
        if by is None:
            continue
        if lv.cls == h.cls and lv.alive and (h.unit is None or h.unit in lv.devices):
            return Verdict(True, lv.lease, lv.label, by)
        related.append((lv, by))
    for lv, _by in related:
        if not lv.alive:
            return Verdict(False, lv.lease, lv.label, f"the holder of lease {lv.lease} is gone")
        if lv.cls == h.cls:
            devs = ",".join(map(str, lv.devices))
            why = f"lease {lv.lease} is for {lv.cls}:{devs}, not {h.cls}:{h.unit}"
            return Verdict(False, lv.lease, lv.label, why)
        return Verdict(False, lv.lease, lv.label, f"lease {lv.lease} is for {lv.cls}, not {h.cls}")
    past = _outlived(h, where, ended or [])
    if past is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(past.ended))
        why = f"lease {past.record.lease} ended at {when}; this process outlived it"
        return Verdict(False, past.record.lease, past.record.label, why)
    dev = h.cls if h.unit is None else f"{h.cls}:{h.unit}"
    on_it = [
        lv
        for lv in leases
        if lv.cls == h.cls and lv.alive and (h.unit is None or h.unit in lv.devices)
    ]
    if not on_it:
        return Verdict(False, None, None, f"no live lease on {dev}")
    names = ", ".join(f"{lv.lease} (holder pid {lv.holder_pid})" for lv in on_it)
    return Verdict(False, None, None, f"not in the tree of {dev}'s lease {names}")


def _outlived(h: Holder, where: str | None, ended: list[EndedLease]) -> EndedLease | None:
    """The ended lease whose tree ``h`` belonged to (by marker or leaf), if any."""
    if not ended:
        return None
    environ = procscan.read_raw(h.pid, "environ")
    marker = None
    for entry in environ.split(b"\0"):
        if entry.startswith(b"HOLD_TREE="):
            marker = entry[10:].decode(errors="replace")
    for past in reversed(ended):
        if marker is not None and marker in past.record.trees:
            return past
        if where is not None and any(within(where, lf) for lf in past.record.leaves):
            return past
    return None


def ended_leases(sd: StateDir) -> list[EndedLease]:
    """The daemon's record of recently ended leases (empty if none, or not one)."""
    path = os.path.join(sd.path, "ended.json")
    if not os.path.lexists(path):
        return []
    # Only now: the table needs no JSON where no lease ended (2.5 ms, issue 13).
    from hold.documents import EndedLeases

    try:
        # Never through a planted link, never hanging on a FIFO.
        return list(EndedLeases.read(path, owned=False).leases)
    except (OSError, ValueError):  # UnsafePath and BadDocument among them
        return []


_MOUNT = v2_mount()


def _cgroup_dir(pid: int) -> str | None:
    return cgroup_dir(pid, _MOUNT)


# ---------------------------------------------------------------- the report


class Only(NamedTuple):
    """What an audit looks at: a class (None: all), its devices (None: all, with
    its shared nodes), the holders of one uid (None: everyone's)."""

    cls: str | None = None
    units: tuple[int, ...] | None = None
    uid: int | None = None


def build_report(
    sd: StateDir,
    classes: dict[str, DeviceClass],
    only: Only | str | None,
    nvml: Prefetch | None = None,
) -> dict[str, Any]:
    """Scan and attribute; the ``--json`` document (schema version 1).

    One row per process and device, as ``nvidia-smi`` shows it: a process's
    shared nodes of a class (``/dev/nvidiactl``) go with its device rows
    (``shared_nodes``); only a process that holds no device node of its own
    gets a row for the class's shared nodes (``index`` None). ``nvml``: NVML's
    figures, asked for early (:func:`hold.cli.audit.run_audit`).
    """
    if not isinstance(only, Only):
        only = Only(only)
    tgts = targets(classes, only.cls, only.units)
    result = scan(tgts, forks=True)
    holders = [h for h in result.holders if only.uid is None or h.uid == only.uid]
    # Not inspected: with --user, only that user's (or whose owner cannot be told).
    mine = (None, only.uid)
    unread = [p for p in result.unread if only.uid is None or procscan.uid_of(p) in mine]
    # The holders' ancestors only, read as asked: a snapshot of every process
    # would be a second walk of /proc, as long as the scan's listing.
    procs = procscan.Stats()
    leases = live_leases(sd)
    ended = ended_leases(sd)
    mem = device_memory(holders, nvml.result if nvml is not None else None)
    users: dict[int, str] = {}  # each uid looked up once (NSS reads /etc/passwd per call)
    rows = []
    for h, shared in sorted(
        one_row_per_device(holders),
        key=lambda r: (r[0].cls, -1 if r[0].unit is None else r[0].unit, r[0].pid),
    ):
        if classes[h.cls].allows(h.pid, h.uid):
            v = Verdict(True, None, None, "an allowed holder of the class (configuration)")
        else:
            v = attribute(h, leases, procs, ended)
        d = details(h.pid)
        if h.uid not in users:
            users[h.uid] = user_name(h.uid)
        rows.append(
            {
                "device": h.cls if h.unit is None else f"{h.cls}:{h.unit}",
                "cls": h.cls,
                "index": h.unit,
                "node": h.node,
                "how": h.how,
                "shared_nodes": shared,
                "pid": h.pid,
                "starttime": h.starttime,
                "uid": h.uid,
                "user": users[h.uid],
                "command": d.command,
                "origin": origin(h.pid).doc(),
                "age_s": None if d.age_s is None else round(d.age_s, 1),
                "rss_bytes": d.rss_bytes,
                "device_memory_bytes": mem.get(
                    (h.pid, h.cls, h.unit), mem.get((h.pid, h.cls, None))
                ),
                "covered": v.covered,
                "lease": v.lease,
                "label": v.label,
                "why": v.why,
            }
        )
    return {
        "version": 1,
        "holders": rows,
        "stray": sum(1 for r in rows if not r["covered"]),
        "not_inspected": len(unread),
        "processes": result.processes,
        "scan_seconds": round(result.seconds, 4),
    }


def one_row_per_device(holders: list[Holder]) -> list[tuple[Holder, list[str]]]:
    """Each device a process holds, with the shared nodes of its class it holds too;
    a process's shared nodes alone (the first of them) where it holds no device."""
    own: dict[tuple[int, str], list[Holder]] = {}
    shared: dict[tuple[int, str], list[Holder]] = {}
    for h in holders:
        (own if h.unit is not None else shared).setdefault((h.pid, h.cls), []).append(h)
    out: list[tuple[Holder, list[str]]] = []
    for key, hs in own.items():
        nodes = sorted(x.node for x in shared.get(key, []))
        out += [(h, nodes) for h in hs]
    for key, hs in shared.items():
        if key not in own:
            hs.sort(key=lambda x: x.node)
            out.append((hs[0], [x.node for x in hs]))
    return out


def stray_lines(doc: dict[str, Any]) -> list[str]:
    """``--log``'s lines: one JSON object per stray row, with what ``--kill`` did to
    it (``stopped``, ``outcome``, ``survivors``: absent without ``--kill``), when,
    on which host, and in a Slurm job's epilog which job (``SLURM_JOB_ID``)."""
    # lazy: socket only for --log; off plain hold audit
    import socket

    killed = {k["pid"]: k for k in doc.get("killed", [])}
    now = round(time.time(), 3)
    host = socket.gethostname()
    job = os.environ.get("SLURM_JOB_ID")
    keep = ("device", "node", "pid", "uid", "user", "command", "age_s", "lease", "why")
    out = []
    for r in doc["holders"]:
        if r["covered"]:
            continue
        line: dict[str, Any] = {"time": now, "host": host, **{k: r[k] for k in keep}}
        if job is not None:
            line["slurm_job_id"] = job
        k = killed.get(r["pid"])
        if k is not None:
            line["stopped"] = k["stopped"]
            for key in ("outcome", "why", "survivors"):
                if key in k:
                    line[f"kill_{key}"] = k[key]
        out.append(json.dumps(line, sort_keys=True) + "\n")
    return out


# ------------------------------------------------------------------- --kill


# pid -> (its start time, or None where only the pid is known; the stray
# whose tree's stop ended it; what that stop did to it)
Ended = dict[int, tuple[int | None, int, str]]


def kill_strays(doc: dict[str, Any], sd: StateDir, grace: float) -> list[dict[str, Any]]:
    """Stop the tree of every stray holder; what each stop did.

    Never touched: pid 1, the daemon, this process and its ancestors, and
    every covered holder with everything below it. A stray that is one of
    these is reported as not stopped (it still holds the device), never
    passed to ``stop_tree``, which would find an empty tree and call that a
    success. "Stopped" means the stop's survivor check came back empty *and*
    the stray itself (by pid and start time) is gone.

    A stray that an earlier stray's stop ended (a member of that tree: its
    descendant, say, or killed by that stop's survivor check) is reported as
    such -- what was done to it, and with whose tree -- not as "already gone".
    """
    pid = sd.daemon_pid()
    daemon = {pid} if pid is not None else set()
    me = os.getpid()
    callers = {me} | {a.pid for a in procscan.ancestors(me)}
    covered = frozenset(r["pid"] for r in doc["holders"] if r["covered"])
    results: list[dict[str, Any]] = []
    done: set[int] = set()
    ended: Ended = {}
    for r in doc["holders"]:
        pid = r["pid"]
        if r["covered"] or pid in done:
            continue
        done.add(pid)
        why = _never_stopped(pid, daemon, callers, covered)
        if why is not None:
            results.append({"pid": pid, "stopped": False, "why": f"never stopped: {why}"})
            continue
        st = procscan.stat_of(pid)
        if st is None or st.is_dead or st.starttime != r["starttime"]:
            results.append(_gone(pid, r["starttime"], ended))
            continue
        results.append(_stop_stray(r, st, covered | frozenset(daemon), grace, ended))
    return results


def _never_stopped(
    pid: int, daemon: set[int], callers: set[int], covered: frozenset[int]
) -> str | None:
    """Why the stray ``pid`` must never be stopped; None if it may be."""
    if pid == 1 or pid in daemon:
        return "init or the daemon"
    if pid in callers:
        return "this audit or one of its ancestors"
    above = {a.pid for a in procscan.ancestors(pid)} | {pid}
    if above & covered:
        return f"a covered holder (pid {min(above & covered)}) or below one"
    return None


def _gone(pid: int, starttime: int, ended: Ended) -> dict[str, Any]:
    """The result for a stray that is gone already: by an earlier stray's stop, or by itself."""
    by = ended.get(pid)
    if by is not None and by[0] in (None, starttime):
        return {
            "pid": pid,
            "stopped": True,
            "with": by[1],
            "outcome": by[2],
            "why": f"{by[2]} with the tree of stray pid {by[1]}",
        }
    return {"pid": pid, "stopped": True, "why": "already gone"}


def _stop_stray(
    r: dict[str, Any], st: Stat, spare: frozenset[int], grace: float, ended: Ended
) -> dict[str, Any]:
    """Stop the tree of the live stray ``r``; note in ``ended`` whom the stop ended."""
    # lazy: proc.stop and proc.tree only for --kill; off plain hold audit
    from hold_supervisor.proc.stop import stop_tree
    from hold_supervisor.proc.tree import Tree

    pid = r["pid"]
    # Its own group and session only if it leads them: a stray started from
    # someone's shell must not take the shell's session with it. Spared
    # (with everything below them): covered holders and the daemon. Not
    # pid 1, everything is below it; it cannot be a member anyway.
    ident = ProcessId(pid, st.starttime)
    tree = Tree(
        f"audit{pid}",
        ident,
        st.pgrp if st.pgrp == pid else None,
        st.session if st.session == pid else None,
        spare=spare,
    )
    report = stop_tree(tree, grace=grace)
    for m in report.stopped:
        ended[m.pid] = (m.ident.starttime, pid, f"ended on {report.signal}")
    for m in report.killed:
        ended[m.pid] = (m.ident.starttime, pid, "killed")
    for sv in report.escalated:
        ended[sv.pid] = (None, pid, "killed by the survivor check")
    for sv in report.survivors:  # still alive: not ended by anyone
        ended.pop(sv.pid, None)
    gone = not ident.is_running()  # a zombie holds nothing
    survivors = [s._asdict() for s in report.survivors]
    if not gone and pid not in {s["pid"] for s in survivors}:
        survivors.append({"pid": pid, "command": r["command"], "found_by": "the stray itself"})
    return {
        "pid": pid,
        "stopped": report.ok and gone,
        "outcome": report.outcome,
        "members": [m.pid for m in report.stopped],
        "survivors": survivors,
    }
