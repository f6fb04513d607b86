"""Looking at /proc without reading what cannot matter: :class:`ProcCache`.

Every look of a stop (:meth:`hold_supervisor.proc.tree.Tree.look`) reads
``/proc/PID/stat`` of every process on the machine, and a stop looks at least
twice (two looks must agree): on a shared machine with a thousand processes,
about 10 ms a look, for a tree that often had one process. Yet most of those
processes started before the tree's root, and for a tree whose root has a
session of its own, such a process can never be a member: group and session
(a session is joined only by birth in it, and a group only from inside its
session; the numbers stay taken while either is in use), the marker (counted
only from the root's start on), descent (a parent, even one that adopted an
orphan, always started before its child) all need a start at or after the
root's. Membership by cgroup or adoption does not: :meth:`Tree.look` uses
this cache only where those cannot give an older member, or falls back to
reading everything when one turns up.

So a process needs to be read only if it is not *proven* older than the tree.
The proof costs nothing beyond the listing itself: ``getdents`` on /proc gives
each entry's inode number, and procfs numbers each ``/proc/PID`` directory
afresh when it makes it (``get_next_ino``) and lets it go when the process
dies (its dentry fails revalidation against the dead ``struct pid``). A pid
listed with the inode number it had when its stat was read is that same
process, with the start time read then; a pid reused by a new process is
listed under a new number, and read. (A number may also change for the same
process -- its dentry dropped under memory pressure and made again -- which
only costs a read.) ``tests/test_proccache.py`` checks that a reused pid gets
a new number on the kernel at hand.

What is never skipped: a pid not listed before, one listed under another
number, one that started at or after ``since``, one that could not be read.
Every look still lists /proc and reads again what appeared while it read, as
a full look does (:data:`hold_supervisor.proc.tree._TOP_UPS`).
"""

from __future__ import annotations

import os
import threading

from hold_supervisor.proc.identity import Stat
from hold_supervisor.proc.scan import stat_of


def listing() -> dict[str, int]:
    """Every entry of /proc now (pids, and a few names that are not), with its
    inode number (from getdents: no call per entry)."""
    with os.scandir("/proc") as it:
        return {e.name: e.inode() for e in it}


class ProcCache:
    """What was read of each process before: by pid (as /proc names it), the
    inode number of its /proc directory at the listing before that read, and
    its start time. Shared by threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inos: dict[str, int] = {}  # every name read, or known not to be a pid
        self._starts: dict[str, int] = {}  # the processes among them

    def walk(
        self, since: int, top_ups: int, after: dict[int, Stat] | None = None
    ) -> dict[int, Stat]:
        """Every process now that is not proven to have started before ``since``
        (clock ticks), each read now; then what appeared meanwhile, listing again
        until a listing shows nothing new (at most ``top_ups`` times).

        ``after``: a walk's answer a moment ago, to confirm (see
        :meth:`hold_supervisor.proc.tree.Tree.look`): what it read is not read again,
        only what is new since, and the first listing is already a top-up.
        """
        with self._lock:
            inos, starts = self._inos, self._starts
            listed = listing()
            for name in inos.keys() - listed.keys():
                del inos[name]  # gone: its number may be anyone's next
                starts.pop(name, None)
            procs: dict[int, Stat] = dict(after or {})
            unread: list[str] = []
            todo: list[str] = []
            if after is None:
                # Listed as read before: proven older than ``since`` unless it started later.
                todo = [n for n, t in starts.items() if t >= since and n in listed]
            for turn in range(after is not None, top_ups + 1):
                # New names, and names whose number changed (C speed: most are neither).
                todo += [name for name, _ in listed.items() - inos.items()]
                if turn and not todo:
                    break
                for name in dict.fromkeys(todo):
                    inos[name] = listed[name]
                    st = stat_of(int(name)) if name.isdigit() else None
                    if st is None:  # not a pid, gone, or not ours to read
                        starts.pop(name, None)
                        unread.append(name)
                        continue
                    starts[name] = st.starttime
                    procs[st.pid] = st
                todo = []
                if turn < top_ups:
                    listed = listing()
            for name in unread:
                if name.isdigit() and name not in starts:
                    inos.pop(name, None)  # tried again by the next walk
            return procs

    def __len__(self) -> int:
        return len(self._starts)
