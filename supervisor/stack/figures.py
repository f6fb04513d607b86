"""What each unit of a running stack uses now, for ``hold ps`` (:class:`UnitFigures`).

A unit with a cgroup leaf is read from it (its calls' leaves, below it,
included); one without is looked for as its stop would look (marker,
group, session, descent: :class:`~hold_supervisor.proc.tree.Tree`, through a
:class:`~hold_supervisor.proc.cache.ProcCache`) and read through psutil
(:mod:`hold_supervisor.proc.usage`). Asked from the control connection's
thread: the unit's own :class:`Tree` belongs to the main thread, so the look
is a tree of its own with the same identity.
"""

from __future__ import annotations

from typing import Any

from hold_supervisor.proc import usage
from hold_supervisor.proc.cache import ProcCache
from hold_supervisor.proc.cgroup import Leaf
from hold_supervisor.proc.tree import Tree


class UnitFigures:
    """The last reading of each unit (for its CPU per cent at the next ``ps``)."""

    def __init__(self) -> None:
        self.rates = usage.Rates()
        self.cache = ProcCache()

    def doc(
        self, unit: str, leaf: Leaf | None, tree: Tree | None, tree_id: str, since: int
    ) -> dict[str, Any] | None:
        """The unit's ``usage`` in ``hold ps --json``: from its ``leaf``, else the
        members of its current ``tree`` -- or, for a unit without one (a task
        unit, whose calls carry its marker ``tree_id``; a service not started),
        the processes with its marker that started after ``since`` (clock
        ticks). None where the leaf is gone."""
        if leaf is not None:
            got = usage.of_leaf(leaf.path)
        else:
            if tree is not None:
                root, pgid, sid, since = tree.root, tree.pgid, tree.sid, tree.since
            else:
                root = pgid = sid = None
            look = Tree(tree_id, root, pgid, sid, since=since, cache=self.cache)
            got = usage.of_pids(look.members())
        if got is None:
            return None
        return got.doc(self.rates.percent(unit, got))
