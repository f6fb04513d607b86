"""A tree: every process that belongs to one spawned thing, found by every means.

Membership, strongest first:

* ``cgroup`` -- in the tree's cgroup leaf (cannot be escaped);
* ``group`` / ``session`` -- in the process group / session the root was
  given at spawn (``setsid`` escapes these);
* ``descendant`` -- the parent chain reaches a process already known to be a
  member (double-forking escapes this once the middle process exits, unless
  we are the subreaper that adopts the orphan);
* ``adopted`` -- an orphan re-parented to this process, which is a child
  subreaper (``PR_SET_CHILD_SUBREAPER``);
* ``marker`` -- carries ``HOLD_TREE=<id>`` in its environment (survives all of
  the above; only a program that execs with a cleaned environment loses it).

With a cgroup leaf (and no uid limit) the leaf alone is the tree for
:meth:`Tree.members`, as the design has it: membership cannot be escaped by
``setsid`` or forking, and ``populated 0`` proves it empty. Leaving the leaf
takes write access to a cgroup above it -- root's, or the delegating user's,
nothing a tree gains by forking -- but root has it: a process of a root tree
can write its own pid into another cgroup's ``cgroup.procs``. So a *stop*
looks with :meth:`Tree.look`, which also walks /proc for the marker, the
group, the session and descent from a member, and finds such a process --
except for a tree **born in its leaf** (``born_in_leaf``: ``hold run``'s
command, spawned into the leaf before its first instruction): its looks read
the leaf and the root only, never every process of the machine, so that a
run costs the same on a busy machine (issue 21). Such a tree gives up only
a member that moved itself out of the leaf on purpose (what root can do, it
can also do by ``systemd-run`` or ``nsenter``, which no walk follows).

The marker is used to *find* processes, never to authorise anything: a
process can put any text it likes in its environment, so the most a forged
marker can do is get its own process stopped along with a tree of the same
user, which it could have done to itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

from hold_supervisor.environ import MARKER
from hold_supervisor.proc import scan, spawned
from hold_supervisor.proc.cache import ProcCache, listing
from hold_supervisor.proc.cgroup import Leaf, cgroup_dir, v2_mount, within
from hold_supervisor.proc.identity import (
    AccessDenied,
    NoSuchProcess,
    ProcessId,
    Stat,
    read_cmdline,
)
from hold_supervisor.proc.reaper import reap_orphan

# One look: the processes read, and the members among them.
Look = tuple[dict[int, Stat], dict[int, "Member"]]

# How often a look reads the pids that appeared while it walked /proc.
_TOP_UPS = 4
# How often a look reads our children again after reaping an orphan (see Tree.orphans).
_ORPHAN_READS = 20


class Member(NamedTuple):
    ident: ProcessId
    comm: str
    found_by: tuple[str, ...]

    @property
    def pid(self) -> int:
        return self.ident.pid


class Tree:
    """The processes of one spawned thing. ``root`` is the process that was spawned.

    ``root`` may still be unknown (None) for a tree registered before its
    spawn; then ``since`` (a start time in clock ticks) bounds the search:
    nothing that started earlier can belong to the tree. ``pgid``/``sid`` are
    None where unknown, or (``sid``) when the root kept the caller's session
    (interactive). ``uid``: only processes that this user could signal count
    as members (a daemon running as root stops a user's tree no further than
    that user could have). ``spare``: pids that are never members, nor is
    anything below them (the audit spares covered holders this way).
    ``adopts_orphans``: this process is a subreaper and this is the only tree
    whose orphans it adopts, so its unowned children belong to the tree;
    ``owned`` are children of ours that others reap (never "adopted").
    ``ids_reused``: a look found the root's pid taken by another process, so
    nobody is a member by the group or session of that number any more.
    ``seen`` remembers every member ever found, to find their descendants
    after the process between them has exited. ``cache``: looks may skip the
    processes it proves older than the root (:mod:`hold_supervisor.proc.cache`).
    ``born_in_leaf``: the root was spawned into ``leaf``, where it has one (before its first
    instruction), so the leaf and the root are the whole tree and no look
    walks /proc (see :attr:`leaf_only`).
    ``subtree_of``: a child subreaper that spawned the tree (this process, for
    ``hold run``; the holder, for the daemon): every member lives below it,
    so a tree without a leaf is looked for there, from that process down, not
    in a listing of /proc (see :meth:`look`).
    """

    __slots__ = (
        "_inos",
        "_inside",
        "adopts_orphans",
        "born_in_leaf",
        "cache",
        "escaped",
        "ids_reused",
        "leaf",
        "owned",
        "pgid",
        "root",
        "seen",
        "sid",
        "since",
        "spare",
        "subtree_of",
        "tree_id",
        "uid",
    )

    def __init__(
        self,
        tree_id: str,
        root: ProcessId | None,
        pgid: int | None,
        sid: int | None,
        leaf: Leaf | None = None,
        adopts_orphans: bool = False,
        owned: frozenset[int] = frozenset(),
        since: int | None = None,
        uid: int | None = None,
        spare: frozenset[int] = frozenset(),
        cache: ProcCache | None = None,
        born_in_leaf: bool = False,
        subtree_of: ProcessId | None = None,
    ) -> None:
        if root is not None:
            since = root.starttime
        elif since is None:
            raise ValueError("a tree without a root needs 'since'")
        self.tree_id = tree_id
        self.root = root
        self.since: int = since
        self.uid = uid
        self.spare = spare
        self.pgid = pgid
        self.sid = sid
        # The root's pid (its group's and session's number) was seen taken by
        # another process: the group and session of that number are not ours.
        self.ids_reused = False
        self.leaf = leaf
        self.adopts_orphans = adopts_orphans
        self.owned = owned
        self.seen: set[ProcessId] = set()
        self.cache = cache
        self.born_in_leaf = born_in_leaf
        self.subtree_of = subtree_of
        # Members found outside the leaf that had been in it (how found): the
        # leaf is no longer the whole tree, and "nobody" is no longer provable.
        self.escaped: dict[ProcessId, Member] = {}
        self._inside: set[ProcessId] = set()  # members seen in the leaf
        # /proc as the last walk listed it (inode numbers by name): a
        # confirming look reads only what is new since, or a reused pid.
        self._inos: dict[str, int] = {}

    def spawned_here(self, pid: int) -> bool:
        """Whether our child ``pid`` was made by a spawn (its :class:`Child` reaps
        it; never "adopted"): in ``owned``, or in :mod:`hold_supervisor.proc.spawned`
        now -- a spawn still in flight is waited for, not taken for an orphan."""
        return pid in self.owned or spawned.is_spawned(pid)

    @property
    def marker(self) -> bytes:
        return f"{MARKER}={self.tree_id}".encode()

    @property
    def contained(self) -> bool:
        """True when the cgroup leaf alone says who the members are."""
        return self.leaf is not None and self.uid is None and not self.spare

    @property
    def method(self) -> str:
        """How it is found and killed, as a stop reports it: ``cgroup`` (it has a
        leaf) or ``walk``."""
        return "walk" if self.leaf is None else "cgroup"

    def kill_leaf(self) -> bool:
        """``cgroup.kill`` its leaf, where that may end it: it has one, and no uid
        limit (the kill could reach a process the user could not have signalled);
        whether it was sent."""
        if self.leaf is None or self.uid is not None:
            return False
        self.leaf.kill()
        return True

    def wait_leaf_empty(self, timeout: float) -> None:
        """Wait up to ``timeout`` for its leaf to empty (woken by the kernel); at
        once without a leaf."""
        if self.leaf is not None:
            self.leaf.wait_empty(timeout)

    def leaf_emptied(self) -> bool:
        """Its leaf holds nobody (or is gone): the tree is over. False without a
        leaf: only a look can say."""
        return self.leaf is not None and not self.leaf.populated()

    def remove_leaf(self) -> None:
        """Remove its (emptied) leaf, if it has one (``OSError``/``ValueError`` if it
        cannot be): for a guardian whose client did not live to remove it."""
        if self.leaf is not None:
            self.leaf.remove(os.path.dirname(self.leaf.path))

    @property
    def below_only(self) -> bool:
        """True when a look reads what lives below :attr:`subtree_of` alone (no leaf;
        see :meth:`look`)."""
        return self.leaf is None and self.subtree_of is not None

    @property
    def leaf_only(self) -> bool:
        """True when every look reads the leaf and the root alone (no walk of /proc):
        a contained tree born in its leaf."""
        return self.born_in_leaf and self.contained and not self.escaped

    def members(self, procs: dict[int, Stat] | None = None) -> dict[int, Member]:
        """Live (non-zombie) members now, each with how it was found.

        Never includes this process or its ancestors. For a contained tree
        (and no ``procs`` given) only the leaf and the root are read; see
        :meth:`look` for a stop's look, which walks /proc for it too. Without
        a leaf and without ``procs``, this is :meth:`look`.
        """
        if procs is None:
            if self.contained:
                return self._leaf_look()[1]
            return self.look()[1]
        marked = {st.pid for st in procs.values() if self._carries_marker(st)}
        return self._members(procs, marked, everywhere=False)

    def look(self, after: dict[int, Stat] | None = None) -> Look:
        """One look by every means: (the processes read, the members among them).

        For a stop and its survivor check. Unlike :meth:`members`, a
        contained tree is looked for outside its leaf too (marker, group,
        session, descent from a member): a member that moved itself to
        another cgroup (root can) is found. Members in the leaf keep
        ``cgroup`` (and ``root``) as how they were found.

        A walk of /proc is not atomic: a process that forks and exits every
        millisecond has often left the pid the listing named before it is
        read, and its new pid is not in the listing. So after the walk the
        pids that appeared meanwhile are read at once (stat, then marker),
        again until a listing shows nothing new (a bounded number of times):
        such a process is seen at its newest pid.

        ``after``: the processes of a look just taken that found no member.
        Then only what is new since is read (and the leaf): a process that
        was there and was no member then cannot have become one since -- a
        member is only ever made by a member's fork -- so this confirms that
        look for the price of a listing of /proc, not a read of every process.

        A pid of ``after`` that /proc now lists under another inode number
        is read again: it may be a new process that reused the pid (see
        :mod:`hold_supervisor.proc.cache`). So in walk mode too, a stop whose first
        look found nobody reads every process once, not twice.

        A tree whose orphans come to us (``adopts_orphans``) is also looked for
        among our own children, which a fork loop cannot outrun: see
        :meth:`orphans`.

        With a ``cache`` (and a root in a session of its own), what it proves
        older than the root is not read at all, nor returned: see
        :meth:`_cached_look`.

        A tree born in its leaf (:attr:`leaf_only`) is not walked for: the
        processes read are its members (see :meth:`_leaf_look`), and
        ``after`` changes nothing.

        A tree without a leaf below a subreaper of its own (``subtree_of``) is
        looked for below that process only (:meth:`_subtree`), by the same
        rules: whatever the tree started is there -- an orphan is re-parented
        to the nearest subreaper above it, never past it -- but what it asked
        another daemon to start (``at``, ``systemd-run``) and which only its
        marker names. That costs a read of each process below, not of every
        process on the machine; the marker's search over the whole machine is
        left to the ticket daemon, after the lease has changed hands
        (:mod:`hold.daemon.sessions`). Where that subreaper is gone, or the
        kernel lists no children, the whole of /proc is read as before.
        """
        if self.leaf_only:
            return self._leaf_look()
        if self.below_only:
            procs = self._subtree()
            if procs is not None:
                if self.adopts_orphans:
                    procs.update(self.orphans())
                marked = {pid for pid, st in procs.items() if self._carries_marker(st)}
                return procs, self._members(procs, marked, everywhere=True)
        if self.cache is not None:
            look = self._cached_look(self.cache, after)
            if look is not None:
                return look
        # Since 0: every process is read (or, after a look, what is new since).
        procs, marked = self._walk(after)
        if self.adopts_orphans:
            procs.update(self.orphans())
        return procs, self._members(procs, marked, everywhere=True)

    def _walk(self, after: dict[int, Stat] | None) -> tuple[dict[int, Stat], set[int]]:
        """The processes now, and those among them that carry the marker: every
        one read, or with ``after`` only those new since (or under a new inode
        number); then what appeared meanwhile, each read at once (stat, then
        marker), until a listing shows nothing new (at most ``_TOP_UPS`` times)."""
        procs: dict[int, Stat] = {} if after is None else dict(after)
        marked: set[int] = set()

        def read(pid: int) -> None:
            st = scan.stat_of(pid)
            if st is not None:
                procs[pid] = st
                if self._carries_marker(st):
                    marked.add(pid)

        listed = listing()
        known = self._inos if after is not None else {}
        for name, ino in listed.items():
            if name.isdigit() and (int(name) not in procs or known.get(name) != ino):
                read(int(name))
        self._inos = listed
        # The top-ups list by os.listdir, several times faster than a listing
        # with inode numbers: a fork loop's generation lives about as long.
        for _ in range(_TOP_UPS):
            new = [pid for pid in scan.pids() if pid not in procs]
            if not new:
                break
            for pid in new:
                read(pid)
        return procs, marked

    def _subtree(self) -> dict[int, Stat] | None:
        """Every process below :attr:`subtree_of` now (it excluded), read through
        ``/proc/PID/task/*/children``; None where that cannot answer (the
        subreaper is gone or was replaced, or the kernel lacks the file)."""
        top = self.subtree_of
        assert top is not None
        procs: dict[int, Stat] = {}
        todo = [top.pid]
        while todo:
            kids = scan.children_of(todo.pop())
            if kids is None:
                return None
            for pid in kids:
                if pid in procs:
                    continue
                st = scan.stat_of(pid)
                if st is not None:
                    procs[pid] = st
                    todo.append(pid)
        # Read after its children: had it exited meanwhile, they may have gone
        # to another subreaper before they were listed.
        return procs if top.matches() else None

    def _cached_look(self, cache: ProcCache, after: dict[int, Stat] | None) -> Look | None:
        """A look that reads only the processes ``cache`` cannot prove older than
        the root; None where it may not answer.

        It may where every member and every process of the tree's group must
        have started at or after the root (see :mod:`hold_supervisor.proc.cache`): the
        root has a session of its own and the group is the session's, nothing
        is spared (a spared process's descendants are found through it), and
        no member older than the root was ever found. Only the cgroup leaf (a
        process moved into it) and adoption (an older child of ours) can give
        such a member, and its descendants could be older too: then, and from
        then on, None, and the look reads everything.
        """
        if self.sid is None or self.pgid not in (None, self.sid) or self.spare:
            return None
        if any(i.starttime < self.since for i in self.seen):
            return None
        procs = cache.walk(self.since, _TOP_UPS, after)
        if self.adopts_orphans:
            procs.update(self.orphans())
        marked = {st.pid for st in procs.values() if self._carries_marker(st)}
        members = self._members(procs, marked, everywhere=True)
        if any(m.ident.starttime < self.since for m in members.values()):
            return None
        return procs, members

    def orphans(self) -> dict[int, Stat]:
        """Our children that no spawn of ours made, as they are now (zombies
        included): where the tree's orphans come to us (``adopts_orphans``),
        each live one started at or after ``since`` is a member.

        A walk of /proc can miss a fork loop whose processes live a
        millisecond each, every time (the pid it listed is gone when read,
        the new one was not listed). Our children list cannot: a process of
        the tree whose parent exits comes to us (we are its subreaper) before
        that parent becomes a zombie, and a zombie child of ours stays in the
        list until we reap it. So a listing whose every orphan was alive when
        read holds each live process of the tree or its living ancestor. An
        orphan found a zombie is reaped (nobody else waits for it), and the
        list read again -- its children came to us meanwhile -- until a
        listing holds no new zombie (at most ``_ORPHAN_READS`` times).
        """
        out: dict[int, Stat] = {}
        for _ in range(_ORPHAN_READS):
            reaped = False
            for pid in scan.children_of_self():
                if self.spawned_here(pid):
                    continue
                st = scan.stat_of(pid)
                if st is None:
                    continue
                out[pid] = st
                reaped = reap_orphan(pid, st) or reaped
            if not reaped:
                break
        return out

    def _adopted(self, st: Stat, me: int) -> bool:
        # An orphan of the tree: a child of ours that no spawn made, and no
        # older than the tree (an older one was ours before the tree began).
        return (
            self.adopts_orphans
            and st.ppid == me
            and st.starttime >= self.since
            and not self.spawned_here(st.pid)
        )

    def _carries_marker(self, st: Stat) -> bool:
        return (
            st.starttime >= self.since
            and not st.is_dead
            and bool(scan.environ_has(st.pid, self.marker))
        )

    def _members(
        self, procs: dict[int, Stat], marked: set[int], *, everywhere: bool
    ) -> dict[int, Member]:
        me = os.getpid()
        protected = self.protected(procs)
        reasons: dict[int, list[str]] = {}

        def add(pid: int, why: str) -> None:
            st = procs.get(pid)
            if st is None or st.is_dead or pid in protected:
                return
            reasons.setdefault(pid, []).append(why)

        in_leaf: set[int] = set()
        if self.leaf is not None:
            in_leaf = set(self.leaf.pids())
            for pid in in_leaf:
                if everywhere and pid not in procs:
                    # Started after the walk: read it now, or it would be missed.
                    st = scan.stat_of(pid)
                    if st is not None:
                        procs[pid] = st
                add(pid, "cgroup")
        known = {
            i.pid
            for i in self.seen
            if procs.get(i.pid) is not None and procs[i.pid].starttime == i.starttime
        }
        if self.root is not None and self.root.matches():
            known.add(self.root.pid)
            add(self.root.pid, "root")
        for pid in known:
            # Once a member, a member while it lives: one that left the leaf,
            # its session and its marker, whose parent then died, is found here.
            add(pid, "seen")
        self._note_reused_ids(procs)
        for st in procs.values():
            if self.pgid is not None and st.pgrp == self.pgid and self._plausible(st):
                add(st.pid, "group")
            if self.sid is not None and st.session == self.sid and self._plausible(st):
                add(st.pid, "session")
            if self._adopted(st, me):
                add(st.pid, "adopted")
        for pid in marked:
            add(pid, "marker")
        roots = known | set(reasons)
        for pid in scan.descendants(roots, procs):
            add(pid, "descendant")

        contained = everywhere and self.contained
        out: dict[int, Member] = {}
        for pid, why in reasons.items():
            if self.uid is not None and not signalable_by(pid, self.uid):
                continue
            if contained and pid in in_leaf:
                # The leaf says it: the other means only add noise to the report.
                why = [w for w in why if w in ("cgroup", "root")]
            st = procs[pid]
            ident = ProcessId(pid, st.starttime)
            self.seen.add(ident)
            out[pid] = Member(ident, st.comm, tuple(dict.fromkeys(why)))
        self._note_escapes(out, in_leaf, procs)
        return out

    def _note_escapes(
        self, members: dict[int, Member], in_leaf: set[int], procs: dict[int, Stat]
    ) -> None:
        """Members outside the leaf that had been in it (see :attr:`escaped`).

        Had been: seen in it by an earlier look; or born in it -- a child of a
        member seen in it (a child starts in its parent's cgroup), anyone of a
        tree born in its leaf, the root of ours in a cgroup that is neither the
        leaf nor ours (ours is where a root not yet in its leaf is). Not a
        process that was never in it: an adopted job's, before it was moved in.
        """
        if self.leaf is None:
            return
        me = os.getpid()
        for pid, m in members.items():
            if pid in in_leaf:
                self._inside.add(m.ident)
        for pid, m in members.items():
            if pid in in_leaf or m.ident in self.escaped:
                continue
            st = procs.get(pid)
            if st is not None and st.is_exiting:
                continue  # out of the leaf by its exit, not by a move
            parent = procs.get(st.ppid) if st is not None else None
            if not (
                m.ident in self._inside
                or self.born_in_leaf
                or (parent is not None and ProcessId(parent.pid, parent.starttime) in self._inside)
                or (
                    self.root is not None
                    and m.ident == self.root
                    and st is not None
                    and st.ppid == me
                    and self._root_elsewhere()
                )
            ):
                continue
            if not self._outside_now(m.ident):
                continue  # the look's reads were not atomic: gone, exiting, or in the leaf
            try:  # its command line now: it is killed before the report is written
                what = read_cmdline(pid)
            except (NoSuchProcess, AccessDenied):
                what = m.comm
            self.escaped[m.ident] = m._replace(comm=what)

    def _leaf_look(self) -> Look:
        """The leaf's live processes (below it too) and the root, until its stub
        has written it into the leaf: (their stats, them as members). Nobody
        only where ``cgroup.events`` agrees: reading ``cgroup.procs`` is not
        atomic against a fork, the kernel's ``populated`` count is."""
        assert self.leaf is not None
        look = self._leaf_members()
        for _ in range(_TOP_UPS):
            if look[1] or not self.leaf.populated():
                break
            look = self._leaf_members()
        return look

    def _leaf_members(self) -> Look:
        assert self.leaf is not None
        in_leaf = set(self.leaf.pids())
        found = {pid: ["cgroup"] for pid in in_leaf}
        if self.root is not None:
            # Until its stub has written it into the leaf, the root is outside.
            found.setdefault(self.root.pid, []).append("root")
        if self.adopts_orphans:
            # Orphans come to us (a subreaper) whatever cgroup they moved to.
            for pid, orphan in self.orphans().items():
                if not orphan.is_dead:
                    found.setdefault(pid, []).append("adopted")
        # A member's children outside the leaf left it (a child is born in its
        # parent's cgroup): one read per member, never every process.
        todo = list(found)
        while todo:
            for child in scan.children_of(todo.pop()) or ():
                if child not in found:
                    found[child] = ["descendant"]
                    todo.append(child)
        me = os.getpid()
        protected = {me} | {st.pid for st in scan.ancestors(me)}
        procs: dict[int, Stat] = {}
        out: dict[int, Member] = {}
        for pid, why in found.items():
            st = scan.stat_of(pid)
            if st is None or st.is_dead or pid in protected:
                continue
            if why == ["root"] and self.root is not None and st.starttime != self.root.starttime:
                continue  # the root is gone and its pid reused
            if st.starttime < self.since and "cgroup" not in why and "root" not in why:
                continue  # older than the tree: an adopted child of ours from before
            ident = ProcessId(pid, st.starttime)
            self.seen.add(ident)
            procs[pid] = st
            out[pid] = Member(ident, st.comm, tuple(why))
        self._note_escapes(out, in_leaf, procs)
        return procs, out

    def _outside_now(self, ident: ProcessId) -> bool:
        """Is ``ident`` alive, not in its exit, and in a cgroup outside the leaf, by its
        own ``/proc/PID/cgroup`` read now (a look's stat and the leaf's list are
        read at different moments: a member killed between them seemed outside)?"""
        assert self.leaf is not None
        st = scan.stat_of(ident.pid)
        if st is None or st.starttime != ident.starttime or st.is_dead or st.is_exiting:
            return False
        where = cgroup_dir(ident.pid, v2_mount())
        return where is not None and not within(where, os.path.normpath(self.leaf.path))

    def _root_elsewhere(self) -> bool:
        """Is the root in a cgroup that is neither its leaf nor ours?"""
        assert self.root is not None and self.leaf is not None

        mount = v2_mount()
        where = cgroup_dir(self.root.pid, mount)
        return where is not None and where not in (
            os.path.normpath(self.leaf.path),
            cgroup_dir("self", mount),
        )

    def protected(self, procs: dict[int, Stat]) -> set[int]:
        """Pids never to count as members: this process, its ancestors, and what is spared."""
        me = os.getpid()
        out = {me} | {st.pid for st in scan.ancestors(me)}
        if self.spare:
            out |= set(self.spare) | scan.descendants(self.spare, procs)
        return out

    def _plausible(self, st: Stat) -> bool:
        # A group or session id is the pid of the process that created it. Once
        # that process and every member are gone the number may be reused by an
        # unrelated group; a member that started before the root cannot be ours.
        return st.starttime >= self.since and not self.ids_reused

    def _note_reused_ids(self, procs: dict[int, Stat]) -> None:
        """Whether the root's pid, the number of its group and session, now names
        another process (see :attr:`ids_reused`).

        The kernel keeps a pid number taken while any process has it as its
        pid, group or session, so a new process gets the root's number only
        once the root and everyone in its group and session are gone; from
        then on, whoever has that group or session id is in a new one. (Seen
        beside suites that fork in a loop: a process spawned as the tree was
        stopped had the exited root's pid, led a session of that number, and
        was taken for a member by session.) Where nobody has the number now, a
        start time after the root's is all that can be asked (:meth:`_plausible`).
        """
        root = self.root
        if root is None or self.ids_reused or root.pid not in (self.pgid, self.sid):
            return
        st = procs.get(root.pid)
        if st is not None and st.starttime != root.starttime:
            self.ids_reused = True

    def forget_dead(self) -> None:
        self.seen = {i for i in self.seen if i.matches()}


def move_into(tree: Tree, leaf: Leaf, rounds: int = 8) -> list[int]:
    """Move the members of a tree that runs already (started elsewhere) into
    ``leaf``, until a look finds none outside it; the pids that could not be
    moved (another user's, or outside this user's delegation).

    A member forked while its parent was being moved may start outside the
    leaf: the next look finds it (by descent) and moves it too. Each pid is
    checked against its start time just before it is written.
    """
    failed: set[int] = set()
    for _ in range(rounds):
        inside = set(leaf.pids())
        out = [m for m in tree.look()[1].values() if m.pid not in inside | failed]
        if not out:
            break
        for m in out:
            if not m.ident.matches():
                continue
            try:
                leaf.move(m.pid)
            except ProcessLookupError:
                continue  # exited meanwhile
            except OSError:
                failed.add(m.pid)
    return sorted(failed)


def describe(members: Iterable[Member]) -> str:
    return ", ".join(f"{m.pid} ({m.comm}, {'+'.join(m.found_by)})" for m in members)


def signalable_by(pid: int, uid: int) -> bool:
    """Could a process running as ``uid`` signal ``pid``? (kill(2): the sender's
    uid must match the target's real or saved uid.)"""
    if uid == 0:
        return True
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    real, _eff, saved, _fs = (int(x) for x in line.split()[1:5])
                    return uid in (real, saved)
    except OSError:
        return False
    return False
