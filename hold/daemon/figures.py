"""What each live lease's processes use: CPU, memory, process count, summed over its trees.

A lease's processes are its registered trees (:class:`hold.daemon.ledger.TreeRec`):
a tree with a cgroup leaf is read from the leaf's files, one without is
found as a stop would find it (:meth:`hold_supervisor.proc.tree.Tree.members`,
through a :class:`~hold_supervisor.proc.cache.ProcCache`: only processes
younger than the tree's start are read) and its members read through
psutil (:mod:`hold_supervisor.proc.usage`). A lease without a tree (a
holder that runs nothing under hold) has no figures (None).

Read when someone asks (``status``: the CPU per cent is over the interval
since the previous reading, at least half a second old, whoever asked) and
by the usage sampler (:mod:`hold.daemon.usage`) every few seconds; each
reading keeps the most CPU time and memory seen, which the history line
of the lease's end records (``hold report``): with a cgroup leaf that
outlives the reading, ``memory.peak`` where the kernel has it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from hold.daemon.ledger import SessionRec, TreeRec
from hold_supervisor.proc import usage
from hold_supervisor.proc.cache import ProcCache
from hold_supervisor.proc.identity import ProcessId
from hold_supervisor.proc.tree import Tree
from hold_supervisor.proc.usage import TreeUsage


class Figures:
    """The readings of the live leases of one daemon. Shared by the event loop and
    the sampler thread."""

    def __init__(self) -> None:
        self.rates = usage.Rates()
        self.cache = ProcCache()
        self._lock = threading.Lock()
        self._most: dict[str, tuple[float, int]] = {}  # lease id -> (CPU s, memory bytes)

    def read(self, s: SessionRec, *, leaves_only: bool = False) -> TreeUsage | None:
        """The figures of ``s``'s trees now (None: no tree, or none could be read).
        ``leaves_only``: only trees with a cgroup leaf (a few files each), never a
        walk of /proc -- for the path that ends a lease, which runs per grant."""
        if s.lease is None:
            return None
        trees = [t for t in s.trees.values() if t.leaf or not leaves_only]
        if not trees:
            return None
        try:
            got = usage.total(self._tree(s, t) for t in trees)
        except (OSError, ValueError):  # a figure that cannot be read never fails a status or an end
            return None
        if got is not None:
            lid = s.lease.lease_id
            peak = max(got.rss_bytes, got.peak_bytes or 0)
            with self._lock:
                cpu, mem = self._most.get(lid, (0.0, 0))
                self._most[lid] = (max(cpu, got.cpu_seconds), max(mem, peak))
        return got

    def doc(self, s: SessionRec) -> dict[str, Any] | None:
        """The holder's ``usage`` in the status document (None: unknown)."""
        got = self.read(s)
        if got is None or s.lease is None:
            return None
        return got.doc(self.rates.percent(s.lease.lease_id, got))

    def most(self, lid: str) -> tuple[float | None, int | None]:
        """(CPU seconds, peak memory bytes) of lease ``lid`` so far; (None, None) unread."""
        with self._lock:
            got = self._most.get(lid)
        return (None, None) if got is None else (round(got[0], 3), got[1])

    def forget(self, lid: str) -> tuple[float | None, int | None]:
        """:meth:`most` of an ended lease, and its readings dropped."""
        got = self.most(lid)
        with self._lock:
            self._most.pop(lid, None)
        self.rates.forget(k for k in list(self._most))
        return got

    def _tree(self, s: SessionRec, t: TreeRec) -> TreeUsage | None:
        if t.leaf:
            return usage.of_leaf(t.leaf)
        root = ProcessId(t.root_pid, t.root_start) if t.root_pid and t.root_start else None
        # Only what the lease's user could signal, as a stop would (a root daemon).
        uid = None if s.uid in (0, os.geteuid()) else s.uid
        # A tree its holder spawned lives below the holder: read there, not in
        # every process of the machine (Tree.below_only), while the holder lives.
        holder = ProcessId(s.owner_pid, s.owner_start) if t.below else None
        tree = Tree(
            t.tree_id,
            root,
            t.pgid,
            t.sid,
            since=t.since,
            uid=uid,
            cache=self.cache,
            subtree_of=holder,
        )
        return usage.of_pids(tree.members())
