"""Containment: where a spawned tree lives -- the one place that chooses between a
cgroup leaf and the /proc walk, for ``hold run``, a stack's units and task calls.

With cgroups, each tree gets a fresh leaf under one :class:`~hold_supervisor.proc.cgroup.Hierarchy`
(joined before the program's first instruction, see :mod:`hold_supervisor.spawn.child`),
and the leaf *is* the tree, as long as nobody leaves it. Without, a tree is what
the walk of /proc finds (:class:`~hold_supervisor.proc.tree.Tree`). Either way
this process becomes a child subreaper, so the orphans of its trees come to it
(to be found -- also one that left its leaf -- and reaped).
Either way a user asks for a home (:meth:`Containment.home`), spawns into it,
and gives it back (:meth:`Containment.release`); nothing else asks which it is.
"""

from __future__ import annotations

from hold_supervisor.proc.cgroup import Hierarchy, Leaf


class Containment:
    """Homes for trees: leaves under ``hierarchy``, or (None) the /proc walk."""

    def __init__(self, hierarchy: Hierarchy | None) -> None:
        self.hierarchy = hierarchy

    @property
    def contained(self) -> bool:
        """Whether trees get cgroup leaves (else they are found by walking /proc)."""
        return self.hierarchy is not None

    def home(self, name: str) -> Leaf | None:
        """A fresh leaf named ``name`` for a tree; without cgroups, None.
        :class:`CgroupUnavailable` if the leaf cannot be made.

        Either way this process is a child subreaper from now on: without a
        leaf, the walk finds orphans through it; with one, a process that moved
        itself out of the leaf (root can), called ``setsid`` and cleared its
        environment is still found when its parent in the tree dies -- the
        orphan comes to us, whatever cgroup it is in (issue 24)."""
        from hold_supervisor.proc.reaper import become_subreaper

        become_subreaper()
        if self.hierarchy is not None:
            return self.hierarchy.create(name)
        return None

    def release(self, leaf: Leaf | None, *, only_if_empty: bool = False) -> None:
        """Give a home back: its leaf removed (raises ``OSError`` if it cannot be).
        ``only_if_empty``: a leaf with a process left stays, so the tree above it
        still finds that process there."""
        if leaf is None or self.hierarchy is None:
            return
        if only_if_empty and leaf.pids():
            return
        leaf.remove(self.hierarchy.base)

    def reap_orphans(self, owned: frozenset[int]) -> None:
        """On SIGCHLD: reap the orphans this subreaper adopted (never a child in
        ``owned``, whose reaper is its :class:`~hold_supervisor.spawn.child.Child`)."""
        from hold_supervisor.proc.stop import reap_adopted

        reap_adopted(owned)

    @classmethod
    def inside(cls, leaf: Leaf | None) -> Containment:
        """Homes nested in ``leaf`` (a task unit's calls, each in a leaf inside the
        unit's); the walk when the unit has none."""
        return cls(Hierarchy(leaf.path) if leaf is not None else None)
