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

    def doc(self, unit: str, leaf: Leaf | None, tree: Tree | None) -> dict[str, Any] | None:
        """The unit's ``usage`` in ``hold ps --json`` (None: neither leaf nor tree yet)."""
        if leaf is not None:
            got = usage.of_leaf(leaf.path)
        elif tree is not None:
            look = Tree(
                tree.tree_id, tree.root, tree.pgid, tree.sid, since=tree.since, cache=self.cache
            )
            got = usage.of_pids(look.members())
        else:
            got = None
        if got is None:
            return None
        return got.doc(self.rates.percent(unit, got))
