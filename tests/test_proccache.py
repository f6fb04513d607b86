"""Looks that skip what is proven older than the tree (:mod:`hold_supervisor.proc.cache`).

What the cache rests on is checked on this kernel: a pid reused by a new
process is listed under a new inode number, so it is read, never taken for
the old one. Then the stops of test_stop.py's hardest trees, with a cached
tree: nothing missed, nothing left. And the one way an older process can be a
member (moved into the leaf, with an older child outside it): the look falls
back to reading everything, and the child is found and stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import alive, wait_for
from test_stop import Started, _assert_all_gone, _grows, _marked, _wait
from test_stop import start as start  # the fixture: test_stop's trees, to be cached here

from hold_supervisor.environ import minimal_env
from hold_supervisor.proc.cache import ProcCache, listing
from hold_supervisor.proc.cgroup import Hierarchy
from hold_supervisor.proc.identity import Stat, read_stat
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child, owned_pids, spawn

TOP_UPS = 4


def _spawn_at(pid: int, new_session: bool = False) -> subprocess.Popen[bytes] | None:
    """A new process at ``pid`` (free now), through ns_last_pid (root); None if
    other forks on the machine keep taking it first."""
    for _ in range(100):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"], start_new_session=new_session)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_a_reused_pid_is_read_again_not_taken_for_the_old_process() -> None:
    if os.geteuid() != 0:
        pytest.skip("placing a process at a chosen pid (ns_last_pid) needs root")
    cache = ProcCache()
    old = subprocess.Popen(["sleep", "60"])
    try:
        born = read_stat(old.pid).starttime
        time.sleep(0.05)  # a few clock ticks: what starts from now on is younger
        since = born + 1
        assert old.pid in cache.walk(since, TOP_UPS)  # not known yet: read
        assert old.pid not in cache.walk(since, TOP_UPS)  # proven older: skipped
        ino = listing()[str(old.pid)]
    finally:
        old.kill()
        old.wait()
    new = _spawn_at(old.pid)
    if new is None:
        pytest.skip(f"pid {old.pid} kept being taken by other forks")
    try:
        # The kernel's side of it: a new process, a new number for its directory.
        assert listing()[str(new.pid)] != ino
        procs = cache.walk(since, TOP_UPS)
        assert new.pid in procs, "a reused pid was taken for the older process"
        assert procs[new.pid].starttime == read_stat(new.pid).starttime >= since
    finally:
        new.kill()
        new.wait()


def test_what_started_at_or_after_since_is_read_on_every_walk() -> None:
    cache = ProcCache()
    cache.walk(0, TOP_UPS)
    p = subprocess.Popen(["sleep", "60"])
    try:
        # Asleep first: a state read while it still ran would differ from the walk's.
        wait_for(lambda: read_stat(p.pid).state == "S", what="sleep to sleep")
        st = read_stat(p.pid)
        for _ in range(3):
            procs = cache.walk(st.starttime, TOP_UPS)
            assert procs[p.pid] == st
        p.send_signal(signal.SIGSTOP)
        wait_for(lambda: read_stat(p.pid).state == "T", what="the stop to show")
        assert cache.walk(st.starttime, TOP_UPS)[p.pid].state == "T"  # read now, not kept
        assert p.pid not in cache.walk(st.starttime + 1, TOP_UPS)  # older than that: skipped
    finally:
        p.kill()
        p.wait()


# --------------------------------------------------------------------------
# Stops with a cached tree (test_stop.py's trees and checks).


@pytest.fixture
def cache() -> ProcCache:
    """A cache that knows everything there before the test's tree starts."""
    c = ProcCache()
    c.walk(0, TOP_UPS)
    return c


def _cache_answered(tree: Tree) -> None:
    """No member older than the root was found: the cached look answered every look."""
    assert not [i for i in tree.seen if i.starttime < tree.since]


def test_nasty_tree_is_stopped_completely_with_the_cache(
    start: Callable[..., Started], cache: ProcCache, cgroup_mode: str
) -> None:
    s = start("nasty_tree.py", "--forkers", "3", "--sleepers", "4")
    s.tree.cache = cache
    ids = s.wait_ready({"main": 1, "child": 1, "forker": 3, "escapee": 1, "sleeper": 4})
    port = s.port
    report = s.stop(grace=0.3)
    _assert_all_gone(s, ids, port)
    assert report.ok and report.outcome == "killed", report.summary()
    stopped = {m.pid for m in report.stopped}
    assert {i.pid for idents in ids.values() for i in idents} <= stopped, report.summary()
    assert str(s.device) in report.held and f"tcp/{port}" in report.held
    _cache_answered(s.tree)
    assert _wait(s.child) == -signal.SIGKILL


@pytest.mark.parametrize("cgroup_mode", ["walk"], indirect=True)
def test_fork_loops_are_never_reported_empty_with_the_cache(
    start: Callable[..., Started], cache: ProcCache, cgroup_mode: str
) -> None:
    """As test_stop's: each process of the loop lives about a millisecond, the
    root is gone before the stop; a look that skipped what it should read
    would report the tree empty while the loop runs on."""
    for opts in ([], ["--setsid"], ["--loops", "3", "--setsid"]):
        s = start("forkloop_tree.py", *opts)
        s.tree.cache = cache
        s.wait_ready({"main": 1, "loop": 1}, port=False)
        assert _wait(s.child) == 0
        assert _grows(s.device), "the fork loop does not run"
        report = s.stop(grace=0.2)
        assert not _grows(s.device), f"the fork loop runs on after: {report.summary()}"
        assert report.ok and report.stopped and report.outcome == "killed", report.summary()
        assert _marked(s.tree_id) == []
        _cache_answered(s.tree)


class _Injecting(ProcCache):
    """A cache that, once armed, calls ``inject`` right after its next walk."""

    def __init__(self) -> None:
        super().__init__()
        self.inject: Callable[[], None] | None = None
        self.walks = 0

    def walk(
        self, since: int, top_ups: int, after: dict[int, Stat] | None = None
    ) -> dict[int, Stat]:
        procs = super().walk(since, top_ups, after)
        self.walks += 1
        inject, self.inject = self.inject, None
        if inject is not None:
            inject()
        return procs


@pytest.mark.parametrize("cached", [False, True], ids=["walk", "cached"])
def test_a_session_of_the_exited_roots_reused_pid_is_not_the_trees(cached: bool) -> None:
    """The root has exited, and its group and session with it (the kernel keeps
    a pid's number taken while anyone is in its group or session); a new
    process gets the root's pid and leads a group and session of that number.
    It is nobody of the tree's: not found by group or session, not signalled.
    (A process spawned beside another suite's fork loop had the exited root's
    pid, and was stopped as a member by group and session.)"""
    if os.geteuid() != 0:
        pytest.skip("placing a process at a chosen pid (ns_last_pid) needs root")
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    root = spawn(["true"], env=minimal_env(os.environ, tree_id=tree_id))
    assert _wait(root) == 0
    # A few clock ticks: identity is (pid, start time in ticks), and a pid given
    # again within the root's tick (only ns_last_pid does that; a wrap of the
    # pids takes longer) would be the root's identity too.
    time.sleep(0.05)
    reuser = _spawn_at(root.pid, new_session=True)
    if reuser is None:
        pytest.skip(f"pid {root.pid} kept being taken by other forks")
    try:
        st = read_stat(reuser.pid)
        assert st.pgrp == st.session == root.pid and st.starttime > root.ident.starttime
        cache = ProcCache() if cached else None
        tree = Tree(tree_id, root.ident, root.pid, root.pid, owned=owned_pids(), cache=cache)

        report = stop_tree(tree, grace=2.0)

        assert tree.ids_reused
        assert report.stopped == [] and report.outcome == "empty", report.summary()
        assert report.ok and report.survivors == [], report.summary()
        assert reuser.poll() is None, "a process of a reused session number was signalled"
    finally:
        reuser.kill()
        reuser.wait()


def test_a_member_born_between_two_looks_is_found_by_the_second(
    cgroup_mode: str, tmp_path: Path
) -> None:
    """The root has exited; a process carrying the tree's marker (own session,
    outside any leaf) starts just after the first look listed /proc. That look
    found nobody, so the second (with a leaf: the confirming one, which reads
    only what is new) must read it: found by its marker, and stopped."""
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    hier = Hierarchy.find() if cgroup_mode == "cgroup" else None
    leaf = hier.create(f"holdtest-{tree_id}") if hier is not None else None
    env = minimal_env(os.environ, tree_id=tree_id)
    root = spawn(["true"], env=env, cgroup=leaf)
    assert _wait(root) == 0
    late: list[Child] = []
    cache = _Injecting()
    cache.walk(0, TOP_UPS)  # everything there now is known
    cache.walks = 0
    cache.inject = lambda: late.append(spawn(["sleep", "60"], env=env))
    try:
        tree = Tree(
            tree_id, root.ident, root.pid, root.pid, leaf=leaf, owned=owned_pids(), cache=cache
        )
        report = stop_tree(tree, grace=2.0)
        assert len(late) == 1 and cache.walks >= 2
        (member,) = late
        found = {m.pid: m.found_by for m in report.stopped}
        assert found == {member.pid: ("marker",)}, report.summary()
        assert _wait(member) == -signal.SIGTERM, report.summary()  # the polite signal
        assert report.ok, report.summary()
    finally:
        for c in late:
            if c.poll() is None:
                c.send_signal(signal.SIGKILL)
                _wait(c)
        root.collect()
        if leaf is not None and hier is not None:
            leaf.remove(hier.base)


@pytest.mark.parametrize("cgroup_mode", ["cgroup"], indirect=True)
def test_an_older_process_moved_into_the_leaf_brings_its_older_child(
    cgroup_mode: str, tmp_path: Path
) -> None:
    """Root may move any process into the tree's leaf: it is then a member
    (cgroup), and so is its child outside the leaf (descent), though both
    started before the root, which the cached look skips. The look must fall
    back to reading everything: the child gets the stop signal and ends."""
    if os.geteuid() != 0:
        pytest.skip("moving another process into the leaf needs root here")
    ready = tmp_path / "ready"
    older = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "if os.fork() == 0:\n    open(sys.argv[1], 'w').write(str(os.getpid()))\n"
            "time.sleep(60)\n",
            str(ready),
        ],
        start_new_session=True,
    )
    hier = Hierarchy.find()
    leaf = hier.create(f"holdtest-older-{uuid.uuid4().hex[:12]}")
    child = None
    try:
        pid = wait_for(lambda: ready.exists() and ready.read_text(), what="the older child")
        older_child = int(pid)
        cache = ProcCache()
        cache.walk(0, TOP_UPS)
        time.sleep(0.05)  # the root starts some ticks later
        tree_id = f"t-{uuid.uuid4().hex[:12]}"
        child = spawn(["sleep", "60"], env=minimal_env(os.environ, tree_id=tree_id), cgroup=leaf)
        leaf.move(older.pid)
        tree = Tree(
            tree_id, child.ident, child.pid, child.pid, leaf=leaf, owned=owned_pids(), cache=cache
        )
        assert read_stat(older_child).starttime < tree.since
        report = stop_tree(tree, grace=2.0)
        assert report.ok, report.summary()
        found = {m.pid: m.found_by for m in report.stopped}
        assert "cgroup" in found.get(older.pid, ()), report.summary()
        assert "descendant" in found.get(older_child, ()), report.summary()
        wait_for(lambda: not alive(older_child), what="the older child to end")
        assert older.wait(5) == -signal.SIGTERM
    finally:
        for p in (older.pid, *([child.pid] if child else [])):
            try:
                os.killpg(p, signal.SIGKILL)
            except OSError:
                pass
        older.wait()
        if child is not None:
            _wait(child)
        leaf.wait_empty(5.0)
        leaf.remove(hier.base)
