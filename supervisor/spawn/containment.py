"""Containment: where a spawned tree lives -- two strategies, and the one place
that chooses between them (:func:`choose`), for ``hold run``, ``hold up``'s
units, task calls and ``--adopt``.

:class:`LeafContainment`: each tree gets a fresh cgroup leaf under one
:class:`~hold_supervisor.proc.cgroup.Hierarchy` (joined before the program's
first instruction, see :mod:`hold_supervisor.spawn.child`), and the leaf *is*
the tree, as long as nobody leaves it: a stop kills it with ``cgroup.kill``.
:class:`WalkContainment`: a tree is what the walk of /proc finds
(:class:`~hold_supervisor.proc.tree.Tree`), and a keeper above the launcher
ends it if the launcher is SIGKILLed (:mod:`hold_supervisor.spawn.keeper`).
Either way this process becomes a child subreaper, so the orphans of its trees
come to it (to be found -- also one that left its leaf -- and reaped).

The choice is made once, where the process decides (:func:`choose`; a task
unit's calls follow their unit's with :func:`within`); from then on a caller
asks the chosen object -- a home for a tree (:meth:`Containment.home`), given
back (:meth:`Containment.release`), a keeper if one is needed
(:meth:`Containment.keep`) -- and never which one it is. A stop asks the
:class:`~hold_supervisor.proc.tree.Tree` (whose leaf the home was).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy, Leaf
from hold_supervisor.proc.reaper import become_subreaper, reap_adopted
from hold_supervisor.proc.tree import Tree, move_into

# How often an adopted job's walked tree is looked at while it runs (seconds).
WALK_LOOK = 2.0


class Containment(ABC):
    """How this process holds its trees; made by :func:`choose` (or :func:`within`)."""

    method: ClassVar[str]  # "cgroup" or "walk": how a tree is found and killed
    where: ClassVar[str]  # where a tree is, in words (``--adopt`` says it)
    # Seconds between looks at a running tree that the strategy needs to keep
    # its members known (the walk: one whose parent exits is found only if seen);
    # None where the leaf keeps them.
    look_every: ClassVar[float | None]
    # A spawn joins its tree's leaf before exec (clone3 into it: its ctypes worth
    # loading early; a parked stub saves a task call the move, hold_supervisor.task.parked).
    joins_leaf: ClassVar[bool]

    def __init__(self) -> None:
        self._reaping = False

    def home(self, name: str) -> Leaf | None:
        """A home for a new tree: a fresh leaf named ``name`` (:class:`LeafContainment`;
        :class:`CgroupUnavailable` if it cannot be made), or None (the walk).

        Either way this process is a child subreaper from now on: without a
        leaf, the walk finds orphans through it; with one, a process that moved
        itself out of the leaf (root can), called ``setsid`` and cleared its
        environment is still found when its parent in the tree dies -- the
        orphan comes to us, whatever cgroup it is in (issue 24)."""
        if not self._reaping:
            become_subreaper()
            self._reaping = True
        return self._make(name)

    @abstractmethod
    def _make(self, name: str) -> Leaf | None: ...

    @abstractmethod
    def release(self, leaf: Leaf | None, *, only_if_empty: bool = False) -> None:
        """Give a home back: its leaf removed (raises ``OSError`` if it cannot be).
        ``only_if_empty``: a leaf with a process left stays, so the tree above it
        still finds that process there."""

    @abstractmethod
    def take_in(self, tree: Tree, name: str) -> tuple[Leaf | None, list[int]]:
        """Contain a tree that runs already (an adopted job, started elsewhere):
        (its new home, the pids that could not be moved into it). No home where
        its root could not be moved, or nothing could (the walk then finds it);
        :class:`CgroupUnavailable` if the leaf cannot be made."""

    @abstractmethod
    def keep(self, grace: float, spare: Callable[[], set[int]] = set) -> bool:
        """Make sure the trees end if this process is SIGKILLed, before its first
        spawn and thread: the walk splits off a keeper above it
        (:func:`~hold_supervisor.spawn.keeper.split`; this process goes on as the
        launcher); a leaf needs none. False where a keeper was needed and could
        not be had (threads are running)."""

    @abstractmethod
    def limit(self, mode: str = "auto") -> str | None:
        """What to tell a user of the limit of how its tree is held (``hold run -v``
        says it once); None with a leaf. ``mode``: the configured ``cgroups:``
        (``off`` is a choice, not a lack)."""

    def reap_orphans(self, owned: frozenset[int]) -> None:
        """On SIGCHLD: reap the orphans this subreaper adopted (never a child in
        ``owned``, whose reaper is its :class:`~hold_supervisor.spawn.child.Child`)."""
        reap_adopted(owned)


class LeafContainment(Containment):
    """Each tree in a fresh cgroup leaf under ``hierarchy``."""

    method = "cgroup"
    where = "in its cgroup leaf"
    look_every = None
    joins_leaf = True

    def __init__(self, hierarchy: Hierarchy) -> None:
        super().__init__()
        self.hierarchy = hierarchy

    def __repr__(self) -> str:
        return f"LeafContainment({self.hierarchy.base!r})"

    def _make(self, name: str) -> Leaf:
        return self.hierarchy.create(name)

    def release(self, leaf: Leaf | None, *, only_if_empty: bool = False) -> None:
        if leaf is None or (only_if_empty and leaf.pids()):
            return
        leaf.remove(self.hierarchy.base)

    def take_in(self, tree: Tree, name: str) -> tuple[Leaf | None, list[int]]:
        leaf = self.hierarchy.create(name)
        failed = move_into(tree, leaf)
        if (tree.root is not None and tree.root.pid in failed) or not leaf.pids():
            leaf.remove(self.hierarchy.base)
            return None, failed
        tree.leaf = leaf
        return leaf, failed

    def keep(self, grace: float, spare: Callable[[], set[int]] = set) -> bool:
        return True  # the leaf outlives us, and its guardian stops it

    def limit(self, mode: str = "auto") -> str | None:
        return None


class WalkContainment(Containment):
    """Each tree found by walking /proc (no cgroup leaf), this process its subreaper."""

    method = "walk"
    where = "found by walking /proc"
    look_every = WALK_LOOK
    joins_leaf = False

    def __repr__(self) -> str:
        return "WalkContainment()"

    def _make(self, name: str) -> None:
        return None

    def release(self, leaf: Leaf | None, *, only_if_empty: bool = False) -> None:
        return None

    def take_in(self, tree: Tree, name: str) -> tuple[Leaf | None, list[int]]:
        return None, []

    def keep(self, grace: float, spare: Callable[[], set[int]] = set) -> bool:
        # lazy: the keeper only where there is no cgroup; off a leaf's run
        from hold_supervisor.spawn.keeper import split

        return split(grace=grace, spare=spare)

    def limit(self, mode: str = "auto") -> str | None:
        if mode == "off":
            why = "cgroups: off"
        else:
            try:
                Hierarchy.find()
                why = "no cgroup leaf could be made"
            except CgroupUnavailable as e:
                why = str(e)
        return (
            f"no cgroup for this command ({why}): its tree is found by walking /proc; a "
            "descendant that leaves the session and clears HOLD_TREE is found through the "
            "subreapers it is re-parented to -- this process, and a keeper above it that ends "
            "the tree if this process is killed (see 'How a tree is stopped' in the README)"
        )


def choose(mode: str, *, of_process: int | None = None) -> Containment:
    """The containment under a ``cgroups:`` mode -- the one place that decides.

    ``off``: the walk. ``auto``: leaves if this process may make them, else the
    walk. ``required``: leaves, or :class:`CgroupUnavailable` saying why not.
    ``of_process``: leaves in that running process's own cgroup rather than
    where this process may make them (``--adopt``: its job's tree is moved in).
    """
    if mode == "off":
        return WalkContainment()
    try:
        found = Hierarchy.find() if of_process is None else Hierarchy.of_process(of_process)
    except CgroupUnavailable:
        if mode == "required":
            raise
        return WalkContainment()
    return LeafContainment(found)


def first_home(containment: Containment, name: str, mode: str) -> tuple[Containment, Leaf | None]:
    """(the containment from now on, the first tree's home): under ``auto``, a
    hierarchy that was writable yet makes no leaf (:class:`CgroupUnavailable`)
    gives way to the walk, for this tree and the next; under ``required`` it raises."""
    try:
        return containment, containment.home(name)
    except CgroupUnavailable:
        if mode == "required":
            raise
        walk = WalkContainment()
        return walk, walk.home(name)


def within(leaf: Leaf | None) -> Containment:
    """Homes nested in a tree's ``leaf`` (a task unit's calls, each in a leaf inside
    the unit's): the unit's choice followed; the walk when the unit has no leaf."""
    return WalkContainment() if leaf is None else LeafContainment(Hierarchy(leaf.path))


def leaf_path(leaf: Leaf | None) -> str | None:
    """A home as a registration tells the daemon (its ``"leaf"``): None for a walked tree."""
    return None if leaf is None else leaf.path
