"""``hold check``: is this process inside a live ticket for a device class?

Proven by ancestry, never by text: an ancestor of the caller, matched by pid
*and* start time, must be the holder recorded in a live token of that class,
or the caller must live in the cgroup leaf of that lease's tree (which also
covers a descendant that daemonised and lost its ancestry). Command lines and
environment variables are never consulted: anyone can write ``npu-hold`` or a
lease id into those.
"""

from __future__ import annotations

import glob
import os

from hold.statedir import StateDir
from hold.tokens import read_record
from supervisor import procscan
from supervisor.cgroup import own_cgroup, v2_mount
from supervisor.identity import ProcessId


def check(sd: StateDir, cls: str, pid: int | None = None) -> tuple[bool, str]:
    """``(covered, one line saying why)`` for ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    # The caller itself counts too: `npu-hold -- hold check` asks about its
    # parent, which is the holder.
    me = procscan.stat_of(pid)
    chain = {(st.pid, st.starttime) for st in [*([me] if me else []), *procscan.ancestors(pid)]}
    mount = v2_mount()
    mine = own_cgroup(pid)
    where = os.path.normpath(mount + mine) if mount and mine else None
    others: list[str] = []
    stale = 0
    for path in sorted(glob.glob(os.path.join(sd.path, "*-*.token"))):
        rec = read_record(path)
        if rec is None:
            continue
        holder = ProcessId(int(rec["holder_pid"]), int(rec["holder_start"]))
        if not holder.is_running():
            stale += 1
            continue
        label = f"{rec['cls']} lease {rec['lease']} ({rec['label']!r}, holder pid {holder.pid})"
        if rec["cls"] != cls:
            if (holder.pid, holder.starttime) in chain:
                others.append(label)
            continue
        if (holder.pid, holder.starttime) in chain:
            return True, f"inside {label}"
        for leaf in rec.get("leaves") or []:
            if where is not None and (where == leaf or where.startswith(leaf + "/")):
                return True, f"inside {label} (by its cgroup)"
    if others:
        return False, f"no {cls} lease covers this process; only {', '.join(others)}"
    if stale:
        return False, f"no live {cls} lease covers this process ({stale} stale token(s))"
    return False, f"no {cls} lease covers this process"
