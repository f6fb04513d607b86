"""Stop a whole tree, then prove it: ``stop_tree`` and its :class:`StopReport`.

1. **Look** at the tree: its members, the files and device nodes they hold,
   the ports they listen on (needed later to find anyone who still holds them).
2. **Polite**: the stop signal, then SIGCONT (a stopped process cannot act on
   TERM), to every member found (not only the process group: escapees too).
   Wait up to ``grace`` for the tree to empty -- woken by the kernel
   (``cgroup.events`` or pidfds), not by polling.
3. **Kill**: with a cgroup, ``cgroup.kill`` (atomic; forks racing it die too).
   Without one -- and for members found outside the leaf -- freeze-and-walk:
   SIGSTOP every member found and walk again until two walks in a row find
   nobody new (a frozen process cannot fork), then SIGKILL.
4. **Survivor check**: look again by every means -- membership as in
   :mod:`hold_supervisor.proc.tree`, plus any process that started after the tree and
   still holds one of its nodes or listens on one of its ports. Members
   found are frozen and killed again; those that still live make the report
   a failure.

Every look is by every means (:meth:`Tree.look`): with a cgroup leaf, /proc
is walked too, for the marker, the group, the session and descent, so a
member that moved itself out of the leaf (root can) is found and stopped.
And a walk can miss a process that forks and exits while it reads /proc, so
"nobody" is never the answer of one look: the tree counts as empty only when
two consecutive looks found nobody, and the survivor check answers only when
two consecutive looks agree (at most ``LOOKS`` looks; if they never agree,
the last one that found anyone is the answer -- seen and then not seen is
not proven gone). The second of two looks that find nobody reads only what
is new since the first: a tree that has ended costs one walk.

A tree born in its leaf (``hold run``'s command: :attr:`Tree.leaf_only`) is
not walked for at all: its members are the leaf's ``cgroup.procs`` (and the
root, until it is in), "nobody" is ``populated 0``, and the stop of a tree
that held no file and no port reads nothing outside the leaf, however many
processes the machine runs. Only the holders of what it held take a walk
(see :func:`~hold_supervisor.proc.survivors.check_survivors`).

The survivor check signals only **members** (cgroup leaf, root, group or
session, descent, adoption, the marker). A process found *only* because it
holds one of the tree's files or nodes, or listens on one of its ports, is
not provably the tree's: anyone may open the same regular file or bind the
port the moment the tree let go of it. Such a process is reported
(``holders_after``: pid, user, what it holds, command) and never signalled,
and it does not make the stop fail. Deciding that a holder of a *device*
must go (it used a leased device without a ticket) is the ticket daemon's
business, not this module's: see ``hold.daemon.occupancy.stop_leftovers``.

"Stopped" means the survivor check found no member alive. The check itself
and the report (:class:`StopReport`, :class:`Survivor`, :class:`Holder`) are
:mod:`hold_supervisor.proc.survivors`.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterable

from hold_supervisor.proc import scan
from hold_supervisor.proc.identity import AccessDenied, Handle, NoSuchProcess, ProcessId, Stat
from hold_supervisor.proc.reaper import reap_adopted
from hold_supervisor.proc.survivors import (
    Holder,
    Nodes,
    Ports,
    StopReport,
    Survivor,
    SurvivorCheck,
    check_survivors,
    command_of,
    look_again,
)
from hold_supervisor.proc.tree import Look, Member, Tree

_KILL_WAIT = 2.0  # seconds to wait for SIGKILLed processes to disappear
_WALK_ROUNDS = 50  # freeze-and-walk gives up looking for new members after this
_FREEZE_WAIT = 2.0  # seconds the freeze of the orphans that come to us may take
_FREEZE_PAUSE = 0.0005  # seconds it waits for processes sent SIGSTOP to stop

# The default survivor check, looked up here at each stop: bench/run.py wraps
# it under this name (as it does _wait_tree_empty) to time the phase.
_survivors: SurvivorCheck = check_survivors


def _signal(ident: ProcessId, *sigs: int) -> bool:
    """Send ``sigs`` in order through one pidfd; False if the process is gone or not ours."""
    try:
        with ident.open() as h:
            for sig in sigs:
                h.send_signal(sig)
        return True
    except (NoSuchProcess, AccessDenied):
        return False


def _wait_gone(idents: Iterable[ProcessId], timeout: float) -> None:
    """Wait until each process has exited (zombie or reaped), woken by its pidfd."""
    handles: list[Handle] = []
    for ident in idents:
        try:
            handles.append(Handle.open(ident))
        except (NoSuchProcess, AccessDenied):
            continue
    try:
        deadline = time.monotonic() + timeout
        poller = select.poll()
        for h in handles:
            poller.register(h.fd, select.POLLIN)
        pending = len(handles)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for _fd, _ in poller.poll(left * 1000):
                poller.unregister(_fd)
                pending -= 1
    finally:
        for h in handles:
            h.close()


def _wait_tree_empty(tree: Tree, timeout: float) -> Look:
    """Wait up to ``timeout`` for every member to exit; the last look (members still alive)."""
    deadline = time.monotonic() + timeout
    while True:
        tree.wait_leaf_empty(max(0.0, deadline - time.monotonic()))
        look = _look(tree)
        members = look[1]
        left = deadline - time.monotonic()
        if not members or left <= 0:
            return look
        # Known members gone -> walk again, since they may have forked meanwhile.
        _wait_gone((m.ident for m in members.values()), left)


def _look(tree: Tree) -> Look:
    """The members now; "none" only when two looks in a row found none."""
    look = tree.look()
    return look if look[1] else look_again(tree, look)


def _freeze_and_walk(tree: Tree) -> dict[int, Member]:
    """SIGSTOP every member, walking again until two walks find nobody new.

    A walk is not atomic: a process that forks and lets its parent exit
    every few milliseconds can be gone from its old pid before the walk
    reads it and not yet listed at its new one, so "nobody new" once could
    leave it running: it takes two walks in a row. And the tree's own
    process group is first stopped as a whole: ``kill(-pgid)`` also reaches
    a child being forked at that moment, and the walks after it see the
    group standing still.
    """
    frozen: dict[int, Member] = {}
    group_stopped = False
    quiet = 0
    for _ in range(_WALK_ROUNDS):
        procs, members = tree.look()
        pgid = None if group_stopped else _own_group(tree, procs, members)
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGSTOP)
            except OSError:
                pass
            group_stopped = True
            continue
        new = {
            pid: m
            for pid, m in members.items()
            if pid not in frozen or frozen[pid].ident != m.ident
        }
        if not new:
            quiet += 1
            if quiet == 2:
                break
            continue
        quiet = 0
        for pid, m in new.items():
            _signal(m.ident, signal.SIGSTOP)
            frozen[pid] = m
        _freeze_adopted(tree, frozen, new)
    return frozen


def _freeze_adopted(tree: Tree, frozen: dict[int, Member], stopped: dict[int, Member]) -> None:
    """Freeze the tree downwards from our own children, reading only children
    lists (no walk of /proc): SIGSTOP each orphan that comes to us and each
    child of a process already stopped, until two rounds in a row find every
    process stopped and nobody new (or ``_FREEZE_WAIT`` has passed).

    A chain whose processes each fork and exit within a millisecond outruns a
    walk (tens of milliseconds on a busy machine). But where this process
    adopts for this one tree (:attr:`Tree.adopts_orphans`), every live
    process of the tree is our child or the child of a live process of it
    (see :meth:`Tree.orphans`), so the children lists, read from the top,
    reach each one.

    A list counts as final only once its process **is** stopped, by its
    state, not once it was sent SIGSTOP: the signal is acted on when the
    process next leaves the kernel, and a fork under way completes first, so
    a list read in between lacks the child that runs on. On a busy machine
    the stopped state can be milliseconds away. A stopped process forks no
    more: its list is final, but for exits. A process that never stops (one
    held in the kernel: a ``vfork`` parent whose child we stopped) keeps the
    freeze going until ``_FREEZE_WAIT``; what it found is killed then.

    Never a process we spawned, nor one older than the tree.
    """
    if not tree.adopts_orphans:
        return
    deadline = time.monotonic() + _FREEZE_WAIT
    # Those sent SIGSTOP: their children are read each round.
    watch: dict[int, ProcessId] = {pid: m.ident for pid, m in stopped.items()}
    calm = 0
    while calm < 2 and time.monotonic() < deadline:
        moved = False  # someone was frozen, or is not yet stopped
        todo = [pid for pid, st in tree.orphans().items() if not st.is_dead]
        for pid, ident in list(watch.items()):
            st = scan.stat_of(pid)
            if st is None or st.starttime != ident.starttime or st.is_dead:
                del watch[pid]  # gone before it stopped: its children came to us
                moved = True
                continue
            todo += scan.children_of(pid) or ()
            if not st.is_stopped:
                moved = True  # may still be forking: its list is not final
        for pid in todo:
            st = scan.stat_of(pid)
            if st is None or st.is_dead or st.starttime < tree.since:
                continue
            known = frozen.get(pid)
            if known is not None and known.ident.starttime == st.starttime:
                if pid not in watch and not st.is_stopped:
                    watch[pid] = known.ident
                    moved = True
                continue
            ident = ProcessId(pid, st.starttime)
            if _signal(ident, signal.SIGSTOP):
                frozen[pid] = Member(ident, st.comm, ("adopted",))
                watch[pid] = ident
                moved = True
        if moved:
            calm = 0
            # Let the processes just signalled run to their stop (this loop
            # would otherwise take their CPU on a busy machine).
            time.sleep(_FREEZE_PAUSE)
        else:
            calm += 1


def _own_group(tree: Tree, procs: dict[int, Stat], members: dict[int, Member]) -> int | None:
    """The tree's process group, if it may be signalled as a whole.

    Only while every live process in it is a member (none spared, none of
    ours, none another user's where the tree has a uid limit); a live member
    also keeps the number from being reused by another group meanwhile.
    """
    if tree.pgid is None or tree.leaf_only or tree.ids_reused:
        # (A leaf's look read no one outside it: the group's other processes
        # are unknown.)
        return None
    in_group = {st.pid for st in procs.values() if st.pgrp == tree.pgid and not st.is_dead}
    if in_group and in_group <= members.keys():
        return tree.pgid
    return None


def stop_tree(
    tree: Tree,
    *,
    sig: int = signal.SIGTERM,
    grace: float = 10.0,
    watch: Iterable[scan.Node] = (),
    survivors: SurvivorCheck | None = None,
) -> StopReport:
    """Stop every process of ``tree`` and check that nothing survived.

    ``watch`` names nodes (e.g. device nodes the tree was given) that the
    survivor check looks for, in addition to those its members are seen
    holding at the start of the stop: a member still holding one is a
    survivor (found by membership anyway); anyone else started after the
    tree who holds one is listed in ``holders_after`` and left alone, as for
    every other file and port (see the module's docstring).

    ``survivors``: the survivor check to run (default
    :func:`~hold_supervisor.proc.survivors.check_survivors`). A caller may wrap the
    default, e.g. a test that starts a process just before the check.
    """
    t0 = time.monotonic()
    report = StopReport(tree.tree_id, signal.Signals(sig).name, method=tree.method)
    # "Settled": two looks in a row found nobody, and nothing was signalled
    # since -- the survivor check's own answer, already had.
    look = _look(tree)
    members = look[1]
    settled = None if members else look
    report.stopped = list(members.values())

    # 1. What they hold, so the survivor check can ask who still holds it.
    nodes, ports = _held(members, watch)
    report.held = [n.path for n in nodes.values()] + [f"{p}/{n}" for p, n in sorted(ports)]

    # 2. Polite signal to every member, and wait for them. Not only to the
    # group: an escapee that left it deserves the same chance to shut down
    # cleanly as its siblings (systemd's KillMode=control-group does the same).
    if members:
        for m in members.values():
            _signal(m.ident, sig, signal.SIGCONT)
        look = _wait_tree_empty(tree, grace)
        members = look[1]
        settled = None if members else look
        report.grace_used = time.monotonic() - t0
        report.outcome = "exited"

    # 3. Kill what is left -- in a leaf, also what its look could not name
    # (cgroup.procs lists a zombie leader whose threads still run).
    if members or (tree.leaf_only and not tree.leaf_emptied()):
        report.outcome = "killed"
        report.killed = _kill(tree, members)
        settled = None

    # 4. Survivor check, escalated once, and only ever at members.
    check = survivors if survivors is not None else _survivors
    _check(tree, nodes, ports, settled, report, check)
    if tree.adopts_orphans:
        reap_adopted(tree.owned)
    report.escaped = [Survivor(m.pid, m.comm, "+".join(m.found_by)) for m in tree.escaped.values()]
    report.duration = time.monotonic() - t0
    return report


def _held(members: dict[int, Member], watch: Iterable[scan.Node]) -> tuple[Nodes, Ports]:
    """The nodes (``watch`` and what members hold) and the ports they listen on."""
    nodes: Nodes = {n.key: n for n in watch}
    sockets: set[int] = set()
    for pid in members:
        # 0-2 are what we gave the root (a terminal, our pipes, a log), and
        # what its descendants inherited from it: a log file that unrelated
        # processes also write to (two commands appending to one build log)
        # is not the tree's, and must not make them "holders" in the report.
        # Descriptors only, not mappings: reading every member's maps is most
        # of a large tree's stop, and a device kept only as a mapping is what
        # ``watch`` (the nodes a tree was given) and the daemon's device scan
        # at the end of a lease are for.
        h = scan.holdings(pid, skip_fds=(0, 1, 2), with_maps=False)
        nodes.update(h.nodes)
        sockets |= h.sockets
    ports: Ports = set()
    if sockets:
        listening = scan.listeners()
        ports = {(listening[i].proto, listening[i].port) for i in sockets if i in listening}
    return nodes, ports


def _kill(tree: Tree, members: dict[int, Member]) -> list[Member]:
    """Kill the members left after the grace; those killed."""
    if not tree.kill_leaf():
        # (With a uid limit, cgroup.kill could reach a process the user
        # could not have signalled: such trees are frozen and walked.)
        frozen = _freeze_and_walk(tree)
        dead = [m for m in frozen.values() if _signal(m.ident, signal.SIGKILL)]
        _wait_gone((m.ident for m in frozen.values()), _KILL_WAIT)
        return dead
    # Members outside the leaf (found by marker, session or descent: started
    # before the leaf existed, or moved out of it) are frozen and walked for,
    # as without a leaf, then killed one by one.
    outside = {m.ident: m for m in members.values() if "cgroup" not in m.found_by}
    if outside:
        for m in _freeze_and_walk(tree).values():
            if "cgroup" not in m.found_by:
                outside[m.ident] = m
    refused = {i for i in outside if not _signal(i, signal.SIGKILL)}
    tree.wait_leaf_empty(_KILL_WAIT)
    _wait_gone(outside, _KILL_WAIT)
    killed = {m.ident: m for m in members.values()} | outside
    return [m for i, m in killed.items() if i not in refused]


def _check(
    tree: Tree,
    nodes: Nodes,
    ports: Ports,
    settled: Look | None,
    report: StopReport,
    check: SurvivorCheck,
) -> None:
    """The survivor check, escalated once at the members it finds. What the
    escalation killed is in the report too (``escalated``): the tree did not
    stop as it should have."""
    found, report.holders_after = check(tree, nodes, ports, settled)
    if found:
        tree.kill_leaf()
        # Frozen first: a survivor may be a fork loop that a kill aimed at
        # the pids just seen would miss.
        for m in _freeze_and_walk(tree).values():
            found.setdefault(m.ident, "+".join(m.found_by))
        for ident, why in found.items():
            if _signal(ident, signal.SIGKILL):
                report.escalated.append(Survivor(ident.pid, command_of(ident.pid), why))
        _wait_gone(found, _KILL_WAIT)
        # The last look is the one reported (holders too: one may have closed
        # the file meanwhile, or a killed member's file is now someone else's).
        found, report.holders_after = check(tree, nodes, ports, None)
    report.survivors = [Survivor(i.pid, command_of(i.pid), why) for i, why in found.items()]


__all__ = [
    "Holder",
    "StopReport",
    "Survivor",
    "SurvivorCheck",
    "check_survivors",
    "stop_tree",
]
