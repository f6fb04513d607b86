"""Child subreaper: orphans of our trees are re-parented to us, not to init.

Without a cgroup, this is what keeps a double-forked grandchild findable: when
its parent exits, the kernel hands it to the nearest ancestor that declared
itself a subreaper. The price is that we must reap those orphans ourselves,
one pid at a time (:func:`reap_orphan`, :func:`reap_adopted`).
"""

from __future__ import annotations

import ctypes
import os

from hold_supervisor.proc import scan, spawned
from hold_supervisor.proc.identity import Stat

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def become_subreaper(on: bool = True) -> None:
    """Declare this process a child subreaper (``on=False``: stop being one)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def is_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    flag = ctypes.c_int(0)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_GET_CHILD_SUBREAPER): {os.strerror(err)}")
    return bool(flag.value)


def reap_orphan(pid: int, st: Stat) -> bool:
    """Reap our child ``pid`` if ``st``, read now, shows a zombie that no spawn
    made: an orphan we adopted, that nobody else waits for. True if reaped.

    Never ``waitpid(-1)``, which would steal the exit status of a child that
    its :class:`~hold_supervisor.spawn.child.Child` waits for. Whether a spawn
    made it is asked after the zombie is seen: a spawn that made it has
    written it down by then (:mod:`hold_supervisor.proc.spawned`); a snapshot
    of the spawned pids taken earlier may predate it.
    """
    if not st.is_dead or spawned.is_spawned(pid):
        return False
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False


def reap_adopted(owned: frozenset[int]) -> None:
    """Reap the zombie orphans among our children (never one in ``owned``: a
    :class:`~hold_supervisor.spawn.child.Child` reaps it)."""
    for pid in scan.children_of_self():
        if pid in owned:
            continue
        st = scan.stat_of(pid)
        if st is not None:
            reap_orphan(pid, st)
