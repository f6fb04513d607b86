"""A stop's cost does not grow with the machine's processes (issue 21).

A tree born in its cgroup leaf (``hold run``'s command) is the leaf: its stop
and survivor check read ``cgroup.procs`` and ``cgroup.events``, never every
process of the machine -- shown by a process outside the leaf that a walk
would find (it carries the tree's marker) and that the stop leaves alone, and
by counting the listings of /proc. Holders of what the tree held are still
found (that look takes a walk, and only then). In walk mode, a stop of a tree
that had ended reads each process once, not once per look.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from conftest import alive, fresh_leaf, wait_for

from hold_supervisor.environ import minimal_env
from hold_supervisor.proc import cache as proccache
from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy, Leaf
from hold_supervisor.proc.identity import ProcessId, Stat
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child, owned_pids, spawn


@pytest.fixture
def leaf() -> Iterator[Leaf]:
    try:
        Hierarchy.find()
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    with fresh_leaf() as lf:
        yield lf


class _Walks:
    """Counts the listings of /proc and the stat reads, by pid.

    Not the stat that :func:`procscan.environ` reads of a process whose
    environment read empty (is an execve under way?): that is counted apart,
    in ``exec_checks``; it is no second read of the walk.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.listings = 0
        self.stats: collections.Counter[int] = collections.Counter()
        self.exec_checks: collections.Counter[int] = collections.Counter()
        self.born: dict[int, int] = {}  # pid -> start time (clock ticks), as first read
        pids, listing, stat_of = procscan.pids, proccache.listing, procscan.stat_of
        environ = procscan.environ
        in_environ = [False]

        def counted_pids() -> list[int]:
            self.listings += 1
            return pids()

        def counted_listing() -> dict[str, int]:
            self.listings += 1
            return listing()

        def counted_stat(pid: int) -> Stat | None:
            (self.exec_checks if in_environ[0] else self.stats)[pid] += 1
            st = stat_of(pid)
            if st is not None:
                self.born.setdefault(pid, st.starttime)
            return st

        def counted_environ(pid: int) -> bytes | None:
            in_environ[0] = True
            try:
                return environ(pid)
            finally:
                in_environ[0] = False

        monkeypatch.setattr(procscan, "pids", counted_pids)
        monkeypatch.setattr(proccache, "listing", counted_listing)
        monkeypatch.setattr("hold_supervisor.proc.tree.listing", counted_listing)
        monkeypatch.setattr(procscan, "stat_of", counted_stat)
        monkeypatch.setattr(procscan, "environ", counted_environ)


def _tree(tree_id: str, child: Child, leaf: Leaf | None, born_in_leaf: bool) -> Tree:
    return Tree(
        tree_id,
        child.ident,
        child.pid,
        child.pid,
        leaf=leaf,
        adopts_orphans=leaf is None,
        owned=owned_pids(),
        born_in_leaf=born_in_leaf,
    )


def _asleep(pid: int) -> bool:
    """Whether ``pid`` runs ``sleep`` and holds nothing but descriptors 0-2: a
    process that has just exec'd still holds the files its dynamic loader opens
    (``libc.so.6`` as descriptor 3) for a moment."""
    st = procscan.stat_of(pid)
    try:
        return (
            st is not None
            and st.comm == "sleep"
            and sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2"]
        )
    except FileNotFoundError:
        return False


def _kill(*children: Child) -> None:
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGKILL)
        c.collect()


@pytest.mark.parametrize("born_in_leaf", [True, False])
def test_a_tree_born_in_its_leaf_is_stopped_without_a_walk(
    leaf: Leaf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, born_in_leaf: bool
) -> None:
    """The tree: a shell in the leaf and a setsid'd sleep it started there. A
    decoy outside the leaf carries the tree's marker: a walk finds it (and the
    stop kills it, ``born_in_leaf=False``); the leaf's look neither reads it
    nor lists /proc, and it lives on. Everything in the leaf is stopped."""
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    env = minimal_env(os.environ, tree_id=tree_id)
    ready = tmp_path / "ready"
    script = f"setsid sleep 60 & echo $! > {ready}; exec sleep 60"
    child = spawn(["sh", "-c", script], env=env, cgroup=leaf)
    decoy = spawn(["sleep", "60"], env=env)  # outside the leaf, the marker in its environment
    try:
        escapee = wait_for(lambda: ready.exists() and ready.read_text().strip(), what="the escapee")
        esc = ProcessId.of(int(escapee))
        # The shell holds what it saved of its stdout (a descriptor above 2)
        # while its echo's redirection lasts: a stop then would rightly look
        # for other holders of that file, by a walk (1 run in 48 under load).
        # And each member, just after its exec, holds what its loader and locale
        # open (libc.so.6, locale.alias): the same walk (once in 10 runs beside
        # two more suites). So both are waited for until they hold only 0-2.
        for pid in (child.pid, esc.pid):
            wait_for(partial(_asleep, pid), what=f"pid {pid} to sleep, holding only 0-2")
        assert sorted(leaf.pids()) == sorted([child.pid, esc.pid])
        tree = _tree(tree_id, child, leaf, born_in_leaf)
        walks = _Walks(monkeypatch)

        report = stop_tree(tree, grace=2.0)

        assert report.ok, report.summary()
        assert not leaf.populated() and not esc.is_running()
        stopped = {m.pid: m.found_by for m in report.stopped}
        if born_in_leaf:
            assert stopped == {child.pid: ("cgroup", "root"), esc.pid: ("cgroup",)}, stopped
            assert walks.listings == 0, walks.listings
            assert walks.stats[decoy.pid] == 0
            assert decoy.poll() is None and alive(decoy.pid), "the decoy was stopped"
        else:  # the same tree, walked for: the decoy is found, by its marker
            assert walks.listings > 0
            assert stopped.get(decoy.pid) == ("marker",), report.summary()
            assert decoy.collect(5.0) == -signal.SIGTERM
    finally:
        _kill(child, decoy)


def test_an_ended_tree_in_its_leaf_costs_no_read_of_another_process(
    leaf: Leaf, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hold run -- true``: the command has exited before the stop. Nothing is
    listed, no process is read but ours (the look never counts this process
    and its ancestors), and the report says it was empty."""
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    child = spawn(["true"], env=minimal_env(os.environ, tree_id=tree_id), cgroup=leaf)
    assert child.wait() == 0
    tree = _tree(tree_id, child, leaf, born_in_leaf=True)
    walks = _Walks(monkeypatch)

    report = stop_tree(tree, grace=2.0)

    assert report.ok and report.outcome == "empty" and report.stopped == [], report.summary()
    assert walks.listings == 0
    ours = {os.getpid()} | {st.pid for st in procscan.ancestors(os.getpid())} | {child.pid}
    assert set(walks.stats) <= ours, set(walks.stats) - ours


def test_holders_of_what_a_leaf_tree_held_are_still_found(leaf: Leaf, tmp_path: Path) -> None:
    """The tree holds a file (descriptor 3); a process outside the leaf, started
    after the tree, opens the same file. Once the leaf is empty, only a look
    at every process can name it: it is reported (not signalled), as in walk
    mode."""
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    env = minimal_env(os.environ, tree_id=tree_id)
    held = tmp_path / "held"
    held.write_bytes(b"")
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    # sh holds the file and waits on a FIFO it also holds for writing (so no EOF
    # comes), with no exec after the open: a stop as ``exec sleep`` loaded its
    # libraries found the dynamic loader's libc.so.6 held too, and listed every
    # process on the machine loading it as a holder (1 soaked run in 70).
    script = f'exec 3<"{held}" 4<>"{fifo}"; read x <&4'
    child = spawn(["sh", "-c", script], env=env, cgroup=leaf)
    other = spawn(["sh", "-c", script], env=dict(env, HOLD_TREE="x"))
    try:
        for c in (child, other):
            wait_for(partial(holds, c.pid, held), what=f"pid {c.pid} to hold the file")
        tree = _tree(tree_id, child, leaf, born_in_leaf=True)

        report = stop_tree(tree, grace=2.0)

        assert report.ok and [m.pid for m in report.stopped] == [child.pid], report.summary()
        assert str(held) in report.held
        assert [(h.pid, h.holds) for h in report.holders_after] == [(other.pid, f"holds {held}")], (
            report.summary()
        )
        assert other.poll() is None  # reported, never signalled
    finally:
        _kill(child, other)


def holds(pid: int, path: Path) -> bool:
    st = os.stat(path)
    return (st.st_dev, st.st_ino) in procscan.holdings(pid).nodes


def test_walk_mode_reads_each_process_once_to_stop_an_ended_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No leaf: the first look reads every process, the one that confirms it
    (two must find nobody) reads only what is new since. Before, each look
    read every process: two reads of each."""
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    child = spawn(["true"], env=minimal_env(os.environ, tree_id=tree_id))
    assert child.wait() == 0
    # (Not adopting: the reaping of adopted zombies reads our children again.)
    tree = Tree(tree_id, child.ident, child.pid, child.pid, owned=owned_pids())
    # A process with no environment at all: whether an exec is under way is
    # asked of its stat, apart from the walk's read (procscan.environ).
    bare = subprocess.Popen(["sleep", "60"], env={})
    try:
        wait_for(lambda: procscan.environ(bare.pid) == b"", 20, what="sleep's exec done")
        walks = _Walks(monkeypatch)
        began = int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))
        report = stop_tree(tree, grace=2.0)
    finally:
        bare.kill()
        bare.wait()

    assert report.ok and report.outcome == "empty", report.summary()
    ours = {os.getpid(), child.pid} | {st.pid for st in procscan.ancestors(os.getpid())}
    others = {pid: n for pid, n in walks.stats.items() if pid not in ours}
    assert len(others) > 10  # the walk read the machine
    # Read twice: only a process born during the stop (another user's, on a
    # busy machine), which the first look met in its top-ups, after its
    # listing: the second cannot know it by its inode number, and reads it.
    twice = {pid: walks.born.get(pid) for pid, n in others.items() if n > 1}
    assert all(t is not None and t >= began - 1 for t in twice.values()), (began, twice)
    assert max(others.values()) <= 2, sorted(others.items(), key=lambda kv: -kv[1])[:5]
    assert others[bare.pid] == 1 and walks.exec_checks[bare.pid] >= 1, walks.exec_checks


def test_a_reused_pid_is_read_again_by_the_confirming_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The confirming look reads only what is new since the first -- by name
    and by the inode number /proc lists it under. A pid listed under another
    number is another process (procfs numbers each /proc/PID afresh; see
    hold_supervisor.proc.cache): it is read. Here the first look's answer is given
    a made-up number for a process that started after it, at a pid the look
    already knew: the confirming look must find it."""
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    env = minimal_env(os.environ, tree_id=tree_id)
    child = spawn(["true"], env=env)
    assert child.wait() == 0
    tree = Tree(tree_id, child.ident, child.pid, child.pid, owned=owned_pids())
    procs, members = tree.look()
    assert members == {}
    late = spawn(["sleep", "60"], env=env)  # a member, by its marker
    try:
        # As if the first look had read another process at ``late``'s pid.
        st = procscan.stat_of(late.pid)
        assert st is not None
        procs[late.pid] = st._replace(starttime=st.starttime - 1, comm="other")
        tree._inos[str(late.pid)] = -1
        _, again = tree.look(after=procs)
        assert set(again) == {late.pid} and again[late.pid].found_by == ("marker",)
    finally:
        _kill(late)
