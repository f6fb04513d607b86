"""Stopping whole trees, with and without a cgroup, and proving nothing is left.

The trees are real: tests/progs/nasty_tree.py has a main process and a child
that ignore SIGTERM, forkers that keep forking during the stop, and an escapee
that double-forked and called setsid (so it is in neither the group nor the
session, and its parent is gone) while holding a "device" file open and
listening on a TCP port. Afterwards the test looks for what is left with its
own eyes (its own /proc scan), not through the code under test.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import LOADED, PROGS, alive, as_user, exec_done, unpriv_python, wait_for

from hold_supervisor.environ import minimal_env
from hold_supervisor.proc.cgroup import Hierarchy, Leaf
from hold_supervisor.proc.identity import NoSuchProcess, ProcessId, read_stat
from hold_supervisor.proc.stop import StopReport, stop_tree
from hold_supervisor.proc.survivors import (
    Holder,
    Look,
    Nodes,
    Ports,
    SurvivorCheck,
    check_survivors,
)
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child, owned_pids, spawn


def _wait(child: Child, timeout: float = 10.0) -> int | None:
    """The child's status, waiting at most ``timeout``; None if it is still running."""
    if child.poll() is None:
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        poller.poll(timeout * 1000)
    return child.poll()


class Started:
    """One tree started for a test: its root, its Tree, and what it wrote."""

    def __init__(self, tmp_path: Path, mode: str, prog: str, args: list[str]) -> None:
        n = len(list(tmp_path.glob("tree*")))
        self.dir = tmp_path / f"tree{n}"
        self.dir.mkdir()
        self.device = self.dir / "device"
        self.device.write_bytes(b"not really a device")
        self.port_file = self.dir / "port"
        self.ready = self.dir / "ready"
        self.tree_id = f"t-{uuid.uuid4().hex[:12]}"
        self.hierarchy: Hierarchy | None = None
        self.leaf: Leaf | None = None
        if mode == "cgroup":
            self.hierarchy = Hierarchy.find()
            self.leaf = self.hierarchy.create(f"holdtest-{self.tree_id}")
        self.child = spawn(
            [
                sys.executable,
                str(PROGS / prog),
                str(self.device),
                str(self.port_file),
                str(self.ready),
                *args,
            ],
            env=minimal_env(os.environ, tree_id=self.tree_id),
            cgroup=self.leaf,
        )
        # As hold_supervisor.spawn.foreground builds it. In walk mode this process must
        # be a child subreaper, which conftest already made pytest.
        self.tree = Tree(
            tree_id=self.tree_id,
            root=self.child.ident,
            pgid=self.child.pid,
            sid=self.child.pid,
            leaf=self.leaf,
            adopts_orphans=self.leaf is None,
            owned=owned_pids(),
        )

    def lines(self) -> list[tuple[str, int]]:
        try:
            text = self.ready.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            what, _, pid = line.rpartition(" ")
            out.append((what, int(pid)))
        return out

    def wait_ready(
        self, expect: dict[str, int], *, port: bool = True
    ) -> dict[str, list[ProcessId]]:
        """Wait for the READY lines; each process's identity, by role."""

        def complete() -> bool:
            roles = [what for what, _ in self.lines()]
            return all(roles.count(r) >= n for r, n in expect.items()) and (
                not port or self.port_file.exists()
            )

        wait_for(complete, timeout=20, interval=0.02, what=f"READY lines {expect}")
        out: dict[str, list[ProcessId]] = {}
        for what, pid in self.lines():
            out.setdefault(what, []).append(ProcessId.of(pid))
        return out

    @property
    def port(self) -> int:
        return int(self.port_file.read_text())

    def stop(
        self, grace: float, sig: int = signal.SIGTERM, survivors: SurvivorCheck | None = None
    ) -> StopReport:
        # Children spawned since the Tree was built are not the tree's orphans.
        self.tree.owned = owned_pids()
        return stop_tree(self.tree, sig=sig, grace=grace, survivors=survivors)

    def cleanup(self) -> None:
        """Whatever the test did: leave nothing, and no leaf, behind.

        Done without the code under test (which may be what failed): freeze
        every process carrying the marker until no new one appears, then kill.
        """
        if self.leaf is not None:
            self.leaf.kill()
        frozen: set[int] = set()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            new = [pid for pid in _marked(self.tree_id) if pid not in frozen]
            if not new:
                break
            for pid in new:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
                frozen.add(pid)
        for pid in frozen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.child.poll() is None:
            try:
                self.child.send_signal(signal.SIGKILL)
            except NoSuchProcess:
                pass
            _wait(self.child)
        if self.leaf is not None and self.hierarchy is not None:
            self.leaf.wait_empty(5.0)
            self.leaf.remove(self.hierarchy.base)


@pytest.fixture
def start(cgroup_mode: str, tmp_path: Path) -> Iterator[Callable[..., Started]]:
    made: list[Started] = []

    def _start(prog: str = "nasty_tree.py", *args: str) -> Started:
        s = Started(tmp_path, cgroup_mode, prog, list(args))
        made.append(s)
        return s

    try:
        yield _start
    finally:
        for s in made:
            s.cleanup()


# --------------------------------------------------------------------------
# Independent checks: the test's own view of the machine.


def _holders(path: Path) -> list[int]:
    """Every process with ``path`` open (descriptor) or mapped, by device and inode."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                s = os.stat(f"/proc/{name}/fd/{fd}")
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == key:
                found.append(int(name))
                break
    return found


# The addresses the tests' own listeners use: the tree's (127.0.0.1) and the
# other user's (127.0.0.2). Listeners elsewhere (another suite's, on [::1] or
# 127.0.0.3) may share the port number, which the kernel hands out per
# address: not ours to count.
_OURS = {"0100007F": "127.0.0.1", "0200007F": "127.0.0.2"}


def _tcp_listeners(port: int) -> list[str]:
    """The addresses of ours listening on TCP ``port``, sorted."""
    out = []
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split()
            addr, hexport = parts[1].split(":")
            if int(hexport, 16) == port and parts[3] == "0A" and addr in _OURS:
                out.append(_OURS[addr])
    return sorted(out)


def _listening(port: int, *addrs: str) -> None:
    """Wait, bounded, until exactly ``addrs`` of ours listen on ``port``.

    Why not one look: /proc/net/tcp is read a page at a time, each read
    resuming where the last left off, so while other sockets come and go
    (other tests, other suites) one reading can skip or repeat a line. A
    state that holds is seen within a few looks."""
    seen: list[list[str]] = []

    def look() -> bool:
        seen.append(_tcp_listeners(port))
        return seen[-1] == sorted(addrs)

    try:
        wait_for(look, LOADED, 0.05, f"{sorted(addrs)} listening on tcp/{port}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen {seen[-1]}") from None


def _port_is_free(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a listener would refuse us
        return True
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return False
        raise
    finally:
        s.close()


def _marked(tree_id: str) -> list[int]:
    """Live processes carrying the tree's marker."""
    entry = f"HOLD_TREE={tree_id}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if entry in env and alive(int(name)):
            out.append(int(name))
    return out


def _assert_all_gone(s: Started, idents: dict[str, list[ProcessId]], port: int) -> None:
    for role, ids in idents.items():
        for ident in ids:
            assert not ident.is_running(), f"{role} {ident} still runs"
    assert _marked(s.tree_id) == []
    assert _holders(s.device) == []
    _listening(port)
    assert _port_is_free(port)
    if s.leaf is not None:
        assert not s.leaf.populated()


# --------------------------------------------------------------------------
# The nasty tree.


@pytest.mark.parametrize(("forkers", "sleepers"), [(1, 0), (3, 6)])
def test_nasty_tree_is_stopped_completely(
    start: Callable[..., Started], cgroup_mode: str, forkers: int, sleepers: int
) -> None:
    s = start("nasty_tree.py", "--forkers", str(forkers), "--sleepers", str(sleepers))
    ids = s.wait_ready(
        {"main": 1, "child": 1, "forker": forkers, "escapee": 1, "sleeper": sleepers}
    )
    port = s.port
    (escapee,) = ids["escapee"]
    assert ids["main"] == [s.child.ident]

    # The escape really happened: own session and group, parent gone, and it
    # holds the device and the port.
    est = read_stat(escapee.pid)
    assert est.session != s.child.pid and est.pgrp != s.child.pid
    assert est.session == est.pgrp and not alive(est.session)  # its session leader is gone
    assert est.ppid == os.getpid()  # re-parented to us, the subreaper
    assert _holders(s.device) == [escapee.pid]
    _listening(port, "127.0.0.1")
    assert not _port_is_free(port)

    report = s.stop(grace=0.3)

    _assert_all_gone(s, ids, port)
    assert report.ok and report.survivors == [], report.summary()
    assert report.outcome == "killed"
    assert report.method == cgroup_mode
    assert "survivor check empty" in report.summary()
    assert report.grace_used >= 0.3
    # Killed in one go: the survivor check found nothing to kill in a second
    # round. (Said by the report, not by the time it took: on a loaded machine
    # the kill and the check alone can take seconds.)
    assert report.escalated == [], report.summary()
    assert report.grace_used <= report.duration < report.grace_used + LOADED, report.summary()

    stopped = {m.pid: m for m in report.stopped}
    for role, idents in ids.items():
        for ident in idents:
            assert ident.pid in stopped, f"{role} {ident} not in the report: {report.summary()}"
            assert stopped[ident.pid].ident == ident
    found_by = set(stopped[escapee.pid].found_by)
    if cgroup_mode == "cgroup":
        # In a leaf, the leaf alone is the tree: no walk of /proc is needed.
        assert found_by == {"cgroup"}, found_by
        assert set(stopped[s.child.pid].found_by) <= {"cgroup", "root"}
    else:
        # Without one, the escapee left group and session: it is found as an
        # orphan re-parented to us (the subreaper) and by its marker.
        assert {"adopted", "marker"} <= found_by, found_by
        assert "group" not in found_by and "session" not in found_by, found_by
        # The main process and the child stayed in the group and the session.
        assert {"group", "session"} <= set(stopped[s.child.pid].found_by)
    # TERM-ignorers had to be killed, the escapee among them.
    killed = {m.pid for m in report.killed}
    assert {s.child.pid, escapee.pid} | {i.pid for i in ids["child"]} <= killed
    # What the tree held is named, so the survivor check could look for it.
    assert str(s.device) in report.held and f"tcp/{port}" in report.held

    # The root is collected by its owner, with the signal that ended it.
    assert _wait(s.child) == -signal.SIGKILL


def test_process_that_keeps_hopping_is_stopped(
    start: Callable[..., Started], cgroup_mode: str
) -> None:
    """A process that forks and lets its parent exit every few milliseconds:
    a kill aimed at the pids seen a moment ago always misses it. It must be
    frozen (or killed by cgroup) and the survivor check must come back empty."""
    s = start("hopper_tree.py")
    ids = s.wait_ready({"main": 1, "hopper": 1}, port=False)
    (first,) = ids["hopper"]
    wait_for(lambda: not first.is_running(), what="the hopper to hop")
    # main, and the hopper's current generation (a scan may miss it mid-hop)
    wait_for(lambda: len(_marked(s.tree_id)) == 2, what="the hopper in a scan")

    report = s.stop(grace=0.3)

    assert report.ok and report.survivors == [], report.summary()
    assert report.outcome == "killed"
    assert _marked(s.tree_id) == []
    assert _wait(s.child) == -signal.SIGKILL
    # Still nothing a moment later: no generation was left to hop on. A window
    # to watch, not a wait (no event marks a hop that does not happen): 0.2 s
    # is some 40 of the hopper's 5 ms hops.
    time.sleep(0.2)
    assert _marked(s.tree_id) == []


def test_root_gone_first_rest_still_found(start: Callable[..., Started], cgroup_mode: str) -> None:
    """The command exits (here: is killed alone) before the stop, leaving its
    descendants: they are found without it."""
    s = start("nasty_tree.py", "--forkers", "2")
    ids = s.wait_ready({"main": 1, "child": 1, "forker": 2, "escapee": 1})
    port = s.port
    s.child.send_signal(signal.SIGKILL)
    assert _wait(s.child) == -signal.SIGKILL
    rest = [i for role, idents in ids.items() if role != "main" for i in idents]
    assert all(i.is_running() for i in rest)

    report = s.stop(grace=0.3)

    _assert_all_gone(s, ids, port)
    assert report.ok, report.summary()
    assert report.outcome == "killed"
    assert {i.pid for i in rest} <= {m.pid for m in report.stopped}


def test_polite_tree_exits_within_the_grace(
    start: Callable[..., Started], cgroup_mode: str
) -> None:
    s = start("polite_tree.py")
    ids = s.wait_ready({"main": 1, "child": 1, "escapee": 1})
    port = s.port
    (escapee,) = ids["escapee"]

    report = s.stop(grace=60.0)

    _assert_all_gone(s, ids, port)
    assert report.ok, report.summary()
    assert report.outcome == "exited", report.summary()
    assert report.killed == []
    assert escapee.pid in {m.pid for m in report.stopped}
    # Woken when the last one left, not at the end of the grace (60 s).
    assert report.grace_used < LOADED, report.summary()
    # The escapee got the polite signal too, and shut down on its own.
    assert ("bye escapee", escapee.pid) in s.lines()
    assert _wait(s.child) == -signal.SIGTERM


def test_stop_signal_is_the_one_asked_for(start: Callable[..., Started]) -> None:
    # polite_tree's main keeps SIGINT's default too: it dies of exactly that.
    s = start("polite_tree.py")
    ids = s.wait_ready({"main": 1, "child": 1, "escapee": 1})
    report = s.stop(grace=0.5, sig=signal.SIGINT)
    assert report.signal == "SIGINT"
    # The child and escapee only handle TERM: SIGINT's default ends them.
    assert report.ok and report.outcome == "exited", report.summary()
    assert ("bye escapee", ids["escapee"][0].pid) not in s.lines()
    assert _wait(s.child) == -signal.SIGINT


def test_nothing_running_is_empty(start: Callable[..., Started]) -> None:
    s = start("polite_tree.py", "--exit-at-once")
    assert _wait(s.child) is not None
    report = s.stop(grace=5.0)
    assert report.ok and report.outcome == "empty", report.summary()
    assert report.stopped == [] and report.killed == []


# --------------------------------------------------------------------------
# The survivor check, and what it must leave alone.


def _spawn_until(
    argv: list[str], env: dict[str, str], what: str, cgroup: Leaf | None = None
) -> Child:
    """Spawn ``argv`` (its own session) and wait, with a deadline, for it to print "holding"."""
    r, w = os.pipe()
    child = spawn(argv, env=env, stdout=w, cgroup=cgroup)
    try:
        os.close(w)
        w = -1
        ready = select.select([r], [], [], 20)[0]
        line = os.read(r, 100) if ready else b""
        assert line == b"holding\n", f"{what} did not start: {line!r}"
    except BaseException:
        _kill(child)
        raise
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    return child


def _kill(child: Child) -> None:
    if child.poll() is None:
        with contextlib.suppress(NoSuchProcess):
            child.send_signal(signal.SIGKILL)
        _wait(child)


def test_survivor_check_reports_a_later_holder_of_the_trees_file(
    start: Callable[..., Started], cgroup_mode: str
) -> None:
    """A process outside every membership (own session, another tree's marker,
    not in the leaf, not adopted) that started after the tree and holds its
    file is found by the survivor check -- and reported, never signalled:
    holding the same file proves nothing about whose it is."""
    s = start("nasty_tree.py", "--forkers", "1")
    ids = s.wait_ready({"main": 1, "child": 1, "forker": 1, "escapee": 1})
    holder = _spawn_until(
        ["sh", "-c", 'exec 7<"$0"; echo holding; exec sleep 30', str(s.device)],
        minimal_env(os.environ, tree_id="unrelated-" + s.tree_id),
        "the holder",
    )
    try:
        s.tree.owned = owned_pids()
        assert holder.pid not in s.tree.members()
        assert holder.pid in _holders(s.device)

        report = s.stop(grace=0.3)

        assert holder.poll() is None and holder.ident.is_running(), report.summary()
        for role, idents in ids.items():
            for ident in idents:
                assert not ident.is_running(), f"{role} {ident} still runs"
        assert _marked(s.tree_id) == [] and _holders(s.device) == [holder.pid]
        assert report.ok and report.survivors == [] and report.escalated == [], report.summary()
        (h,) = [h for h in report.holders_after if h.pid == holder.pid]
        assert h.holds == f"holds {os.path.realpath(s.device)}" and h.user == "root", h
        assert h.uid == os.getuid() and "sleep 30" in h.command, h
        assert f"pid {holder.pid} (user root) holds " in report.summary()
    finally:
        _kill(holder)


# The other user's process: holds the file open and listens on the tree's
# port number (on 127.0.0.2, so both can listen at once) until killed.
_OTHER = (
    "import socket, sys, time\n"
    "f = open(sys.argv[1], 'rb')\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.2', int(sys.argv[2])))\n"
    "s.listen()\n"
    "print('holding', flush=True)\n"
    "time.sleep(600)\n"
)


def test_another_users_process_on_the_trees_file_and_port_is_left_alone(
    start: Callable[..., Started], cgroup_mode: str, unpriv_user: str, unpriv_runtime: Path
) -> None:
    """Issue 9: a root tree opened a regular file; a process of another user
    that opened the same file a moment later was SIGKILLed by the survivor
    check. It is not a member: it must be alive after the stop, and reported
    by pid, user and what it holds -- the tree's own processes all gone."""
    s = start("nasty_tree.py", "--forkers", "1")
    ids = s.wait_ready({"main": 1, "child": 1, "forker": 1, "escapee": 1})
    port = s.port
    for p in [s.dir, *s.dir.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)
    os.chmod(s.device, 0o644)
    argv = as_user(
        unpriv_user, [unpriv_python(), "-c", _OTHER, str(s.device), str(port)], unpriv_runtime, {}
    )
    other = _spawn_until(
        argv, minimal_env(os.environ, tree_id="other-" + s.tree_id), f"{unpriv_user}'s process"
    )
    try:
        assert other.ident.starttime > s.child.ident.starttime  # started after the tree
        s.tree.owned = owned_pids()
        assert other.pid not in s.tree.members()
        assert sorted(_holders(s.device)) == sorted([ids["escapee"][0].pid, other.pid])
        _listening(port, "127.0.0.1", "127.0.0.2")

        report = s.stop(grace=0.3)

        # The other user's process: untouched, and named.
        assert other.poll() is None and other.ident.is_running(), report.summary()
        mine = {h.holds: h for h in report.holders_after if h.pid == other.pid}
        assert set(mine) == {f"holds {os.path.realpath(s.device)}", f"listens on tcp/{port}"}, (
            report.summary()
        )
        for h in mine.values():
            assert h.user == unpriv_user and h.uid == pwd.getpwnam(unpriv_user).pw_uid, h
            assert "time.sleep(600)" in h.command, h
        assert f"pid {other.pid} (user {unpriv_user}) listens on tcp/{port}" in report.summary()
        assert report.escalated == [] and report.survivors == [] and report.ok, report.summary()
        # The tree: all gone, including the escapee that held both.
        for role, idents in ids.items():
            for ident in idents:
                assert not ident.is_running(), f"{role} {ident} still runs"
        assert _marked(s.tree_id) == []
        assert _holders(s.device) == [other.pid]
        _listening(port, "127.0.0.2")  # 127.0.0.1's is gone
        assert _port_is_free(port)
        if s.leaf is not None:
            assert not s.leaf.populated()
        assert _wait(s.child) == -signal.SIGKILL
    finally:
        _kill(other)


def test_a_member_found_only_by_the_survivor_check_is_still_killed(
    start: Callable[..., Started], cgroup_mode: str
) -> None:
    """A member that appears between the kill and the survivor check (here:
    started just before the check runs, holding the tree's file) is escalated
    as before: found by membership -- the marker without a leaf, the leaf with
    one -- not merely by what it holds. A non-member holding the same file
    at the same moment is not."""
    s = start("nasty_tree.py", "--forkers", "1")
    ids = s.wait_ready({"main": 1, "child": 1, "forker": 1, "escapee": 1})

    late: list[Child] = []
    hold_it = ["sh", "-c", 'exec 7<"$0"; echo holding; exec sleep 30', str(s.device)]

    def before_the_check(
        tree: Tree, nodes: Nodes, ports: Ports, settled: Look | None
    ) -> tuple[dict[ProcessId, str], list[Holder]]:
        # Through stop_tree's public seam (``survivors=``): the default check,
        # with two processes started just before its first look.
        if not late:
            # A member (marked; in the leaf if there is one) and a bystander.
            env = minimal_env(os.environ, tree_id=s.tree_id)
            late.append(_spawn_until(hold_it, env, "the late member", cgroup=s.leaf))
            env = minimal_env(os.environ, tree_id="unrelated-" + s.tree_id)
            late.append(_spawn_until(hold_it, env, "the bystander"))
            s.tree.owned = owned_pids()  # neither is an orphan of the tree
        return check_survivors(tree, nodes, ports, settled)

    try:
        report = s.stop(grace=0.3, survivors=before_the_check)
        assert len(late) == 2
        member, bystander = late
        assert member.pid not in {m.pid for m in report.stopped}  # not seen before the check
        assert _wait(member) == -signal.SIGKILL, report.summary()
        (e,) = report.escalated
        assert e.pid == member.pid, report.summary()
        assert e.found_by == ("cgroup" if cgroup_mode == "cgroup" else "marker"), e
        assert bystander.poll() is None, report.summary()
        assert [h.pid for h in report.holders_after] == [bystander.pid], report.summary()
        assert report.ok and report.survivors == [], report.summary()
        _assert_all_gone_but(s, ids, bystander.pid)
    finally:
        for c in late:
            _kill(c)


def _assert_all_gone_but(s: Started, idents: dict[str, list[ProcessId]], other: int) -> None:
    for role, ids in idents.items():
        for ident in ids:
            assert not ident.is_running(), f"{role} {ident} still runs"
    assert _marked(s.tree_id) == []
    assert _holders(s.device) == [other]
    if s.leaf is not None:
        assert not s.leaf.populated()


def test_unrelated_writer_of_the_same_log_is_left_alone(
    start: Callable[..., Started], cgroup_mode: str, tmp_path: Path
) -> None:
    """The tree's stdout is a log file that another, later, unrelated process
    also writes to. Sharing an inherited log does not make that process a
    holder of anything of the tree's: the stop must not kill it."""
    log = os.open(tmp_path / "build.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    hier: Hierarchy | None = None
    leaf: Leaf | None = None
    if cgroup_mode == "cgroup":
        hier = Hierarchy.find()
        leaf = hier.create(f"holdtest-{tree_id}")
    child = spawn(
        ["sh", "-c", "sleep 30 & echo started; wait $!"],
        env=minimal_env(os.environ, tree_id=tree_id),
        stdout=log,
        stderr=log,
        cgroup=leaf,
    )
    other: Child | None = None
    try:
        tree = Tree(
            tree_id=tree_id,
            root=child.ident,
            pgid=child.pid,
            sid=child.pid,
            leaf=leaf,
            adopts_orphans=leaf is None,
            owned=owned_pids(),
        )
        wait_for(lambda: (tmp_path / "build.log").read_text() == "started\n", what="the tree")
        other = spawn(
            ["sleep", "30"], env=minimal_env(os.environ, tree_id="other-" + tree_id), stdout=log
        )
        os.close(log)
        log = -1
        tree.owned = owned_pids()
        assert other.pid not in tree.members()

        report = stop_tree(tree, grace=2.0)

        assert report.ok and report.outcome == "exited", report.summary()
        assert other.poll() is None and other.ident.is_running(), report.summary()
        # Ended by the TERM: its own, or its sleep's, which the shell reports
        # when the sleep is signalled and reaped before the shell is (under load).
        assert _wait(child) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    finally:
        if log >= 0:
            os.close(log)
        if other is not None and other.poll() is None:
            other.send_signal(signal.SIGKILL)
            _wait(other)
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            _wait(child)
        if leaf is not None and hier is not None:
            leaf.kill()
            leaf.wait_empty(5.0)
            leaf.remove(hier.base)


# Run as an unprivileged user: starts a tree that listens on 127.0.0.1 (port
# printed), waits for a line on stdin, stops the tree, prints the report.
_STOPPER = """
import json, os, select, sys
from hold_supervisor.environ import minimal_env
from hold_supervisor.spawn.child import spawn
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Tree

LISTEN = (
    "import socket, time\\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\\n"
    "print(s.getsockname()[1], flush=True)\\n"
    "time.sleep(600)\\n"
)
r, w = os.pipe()
# The tree's id is the test's own (argv): the marker finds processes of this
# user started since, and the same test may run in another suite beside this one.
tree_id = sys.argv[1]
child = spawn([sys.executable, "-c", LISTEN], env=minimal_env(os.environ, tree_id=tree_id),
              stdout=w)
os.close(w)
try:
    assert select.select([r], [], [], 20)[0], "the tree did not start"
    port = int(os.read(r, 100))
    print(json.dumps({"port": port, "root": child.pid}), flush=True)
    sys.stdin.readline()
    tree = Tree(tree_id, child.ident, child.pid, child.pid)
    rep = stop_tree(tree, grace=5.0)
    print(json.dumps({
        "ok": rep.ok, "outcome": rep.outcome, "held": rep.held,
        "survivors": [s._asdict() for s in rep.survivors],
        "escalated": [s._asdict() for s in rep.escalated],
        "holders": [h._asdict() for h in rep.holders_after],
        "summary": rep.summary(),
    }), flush=True)
finally:
    if child.poll() is None:
        child.send_signal(9)
    child.collect(5.0)
"""


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready = select.select([proc.stdout], [], [], timeout)[0]
    return proc.stdout.readline() if ready else ""


def test_a_port_kept_by_an_owner_it_may_not_inspect_is_reported_not_failed(
    unpriv_user: str, other_user: str, unpriv_runtime: Path
) -> None:
    """The stopper (an unprivileged user) finds the tree's port still listening
    after the stop, held by a process of another user whose descriptors it may
    not read. A member would have been found by membership, which needs no
    look at descriptors; so this owner is not provably the tree's: reported
    (the port, no pid), and the stop is not a failure."""
    py = unpriv_python()
    stopper = subprocess.Popen(
        as_user(
            unpriv_user, [py, "-c", _STOPPER, f"t-{uuid.uuid4().hex[:12]}"], unpriv_runtime, {}
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    other: Child | None = None
    try:
        first = _line(stopper, 30)
        if not first:
            pytest.fail(f"the stopper did not start (exit {stopper.poll()})")
        started = json.loads(first)
        port, root = started["port"], started["root"]
        argv = as_user(other_user, [py, "-c", _OTHER, "/dev/null", str(port)], unpriv_runtime, {})
        other = _spawn_until(
            argv, minimal_env(os.environ, tree_id=f"other-{uuid.uuid4().hex[:12]}"), other_user
        )
        _listening(port, "127.0.0.1", "127.0.0.2")

        assert stopper.stdin is not None
        stopper.stdin.write("go\n")
        stopper.stdin.flush()
        report = json.loads(_line(stopper, 30) or "null")

        assert report is not None, "no report from the stopper"
        assert other.poll() is None and other.ident.is_running(), report["summary"]
        assert not alive(root), report["summary"]
        assert f"tcp/{port}" in report["held"], report
        assert report["holders"] == [
            {
                "pid": None,
                "uid": None,
                "user": "?",
                "holds": f"tcp/{port} still listening",
                "command": "?",
            }
        ], report["summary"]
        assert f"pid ? (user ?) tcp/{port} still listening" in report["summary"]
        assert report["ok"] and report["survivors"] == [] and report["escalated"] == [], report
        assert report["outcome"] == "exited", report["summary"]
        assert stopper.wait(timeout=20) == 0
    finally:
        if other is not None:
            _kill(other)
        if stopper.poll() is None:
            stopper.kill()
        stopper.wait(timeout=20)
        for f in (stopper.stdin, stopper.stdout):
            if f is not None:
                f.close()


# --------------------------------------------------------------------------
# Issue 10: a fork loop in walk mode; members that leave the leaf; a uid limit.


def _grows(path: Path, window: float = 0.3) -> bool:
    """Does ``path`` grow within ``window`` seconds? True at the first change seen."""
    size = path.stat().st_size
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        if path.stat().st_size != size:
            return True
        time.sleep(0.005)  # the poll interval inside the window being watched
    return False


@pytest.mark.parametrize("cgroup_mode", ["walk"], indirect=True)
def test_fork_loop_in_walk_mode_is_never_reported_empty_while_it_runs(
    start: Callable[..., Started], cgroup_mode: str
) -> None:
    """A tree that is nothing but a fork loop: the root exits at once, and each
    process of the loop lives about a millisecond. One walk of /proc misses it
    about half the time (the pid it lists is gone when it is read, the new one
    is not listed), and it was reported "0 stopped, survivor check empty"
    while it ran on. Several trees in a row: each is found, killed, and ends
    -- told by the file each generation appends to, not by a walk. With
    ``--setsid`` every generation leaves the group and session, so no
    ``kill(-pgid)`` stops it: each must be frozen where the walk finds it."""
    for opts in ([], ["--setsid"], [], ["--loops", "3", "--setsid"], ["--loops", "2"]):
        s = start("forkloop_tree.py", *opts)
        s.wait_ready({"main": 1, "loop": 1}, port=False)
        assert _wait(s.child) == 0  # the root is gone before the stop
        assert _grows(s.device), "the fork loop does not run"

        report = s.stop(grace=0.2)

        assert not _grows(s.device), f"the fork loop runs on after: {report.summary()}"
        assert report.ok and report.survivors == [], report.summary()
        assert report.stopped and report.outcome == "killed", report.summary()
        assert "survivor check empty" in report.summary()
        assert _marked(s.tree_id) == []


# One busy loop on CPU argv[1] until wall time argv[2]: a loaded machine.
_BUSY = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
until = float(sys.argv[2])
while time.time() < until:
    pass
"""


@pytest.mark.parametrize("cgroup_mode", ["walk"], indirect=True)
def test_every_look_at_a_fork_loop_in_walk_mode_finds_it_on_a_busy_machine(
    start: Callable[..., Started], cgroup_mode: str
) -> None:
    """Three fork loops, each generation in a session of its own, on a machine
    whose every CPU runs a busy loop, among a thousand more processes. A walk
    of /proc, however often topped up, can miss all three: without our
    children read, 1-3 looks in 25 found no member here, and the stop said
    "empty" while the loops ran on (1 run in 3; the suite, once in 30 runs
    beside two busy loops). But their orphans come to us, the subreaper, so
    every look also reads our own children, which a loop cannot outrun: each
    look finds a member, and the stop ends them."""
    s = start("forkloop_tree.py", "--loops", "3", "--setsid")
    s.wait_ready({"main": 1, "loop": 3}, port=False)
    assert _wait(s.child) == 0
    until = time.time() + 4.0
    env = minimal_env(os.environ, tree_id=f"busy-{s.tree_id}")
    # Spawned, so ours and never taken for the tree's orphans.
    busy = [
        spawn([sys.executable, "-c", _BUSY, str(cpu), str(until)], env=env)
        for cpu in sorted(os.sched_getaffinity(0))
    ]
    # A machine of many processes: each walk takes longer.
    crowd = spawn(["sh", "-c", "for i in $(seq 1000); do sleep 30 & done; wait"], env=env)
    busy.append(crowd)
    try:
        looks = empty = 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            looks += 1
            empty += not s.tree.look()[1]
        assert _grows(s.device), "the fork loops do not run"
        report = s.stop(grace=0.2)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(crowd.pid, signal.SIGKILL)
        for b in busy:
            with contextlib.suppress(NoSuchProcess):
                b.send_signal(signal.SIGKILL)
            _wait(b)
    assert empty == 0, f"{empty} of {looks} looks found no member"
    assert not _grows(s.device), f"the fork loops run on after: {report.summary()}"
    assert report.ok and report.outcome == "killed", report.summary()


def _ticks_now() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def test_a_child_of_ours_older_than_the_tree_is_never_adopted() -> None:
    """Where a tree's orphans come to us, a child of ours that no spawn made is
    the tree's only if it started with the tree or after: an older one was
    ours before the tree began (a look took it for an orphan of the tree,
    and the stop killed it)."""
    older = subprocess.Popen(["sleep", "60"])
    younger: subprocess.Popen[bytes] | None = None
    try:
        since = read_stat(older.pid).starttime + 1
        wait_for(lambda: _ticks_now() > since, 5, what="the next clock tick")
        younger = subprocess.Popen(["sleep", "60"])
        assert read_stat(younger.pid).starttime >= since
        tree = Tree("older-child", None, None, None, adopts_orphans=True, since=since)
        members = tree.look()[1]
        assert older.pid not in members, members[older.pid]
        assert younger.pid in members and members[younger.pid].found_by == ("adopted",)
        report = stop_tree(tree, grace=5)
        assert report.ok and [m.pid for m in report.stopped] == [younger.pid], report.summary()
        assert older.poll() is None, "the older child was stopped with the tree"
    finally:
        for p in (older, younger):
            if p is not None:
                p.kill()
                p.wait(timeout=10)


@pytest.mark.parametrize("cgroup_mode", ["cgroup"], indirect=True)
def test_members_that_move_to_another_cgroup_are_found_and_stopped(
    start: Callable[..., Started], cgroup_mode: str
) -> None:
    """Root may move a process to any cgroup: a member that writes its own pid
    into another cgroup's ``cgroup.procs`` left the leaf, and escaped every
    check (they read the leaf alone). At the stop the tree is also looked for
    by its session and marker: one that kept only the tree's session (marker
    cleared, parent gone) and one that kept only the marker (own session,
    parent gone) are both found, by that, and killed."""
    if os.geteuid() != 0:
        pytest.skip("moving a process to a cgroup outside the delegation needs root")
    hier = Hierarchy.find()
    away = Leaf(f"{hier.base}/holdtest-away-{uuid.uuid4().hex[:12]}")
    os.mkdir(away.path)
    try:
        s = start("leaver_tree.py", "--to", away.path)
        ids = s.wait_ready({"main": 1, "session-leaver": 1, "marker-leaver": 1}, port=False)
        (sl,), (ml,) = ids["session-leaver"], ids["marker-leaver"]
        assert s.leaf is not None
        # They really left: in the other cgroup, not the tree's leaf; and the
        # leaf alone (what every check read before) no longer knows them.
        assert sorted(away.pids()) == sorted([sl.pid, ml.pid])
        assert s.leaf.pids() == [s.child.pid]
        assert set(s.tree.members()) == {s.child.pid}
        # The session leaver writes its pid down before its exec of sleep.
        wait_for(lambda: exec_done(sl.pid), LOADED, 0.02, "the session leaver's exec of sleep")
        sst, mst = read_stat(sl.pid), read_stat(ml.pid)
        assert sst.session == s.child.pid and sst.ppid == os.getpid() and sst.comm == "sleep"
        assert mst.session != s.child.pid and not alive(mst.session)  # its own, leader gone
        assert mst.ppid == os.getpid()
        assert _marked(s.tree_id) == [s.child.pid, ml.pid]

        report = s.stop(grace=0.3)

        assert not sl.is_running() and not ml.is_running(), report.summary()
        assert away.pids() == [] and not s.leaf.populated()
        assert report.ok and report.survivors == [] and report.escalated == [], report.summary()
        assert report.outcome == "killed", report.summary()
        found = {m.pid: set(m.found_by) for m in report.stopped}
        assert "session" in found[sl.pid] and "cgroup" not in found[sl.pid], found
        assert found[ml.pid] == {"marker"}, found
        assert found[s.child.pid] <= {"cgroup", "root"}, found
        assert {s.child.pid, sl.pid, ml.pid} <= {m.pid for m in report.killed}
        assert _wait(s.child) == -signal.SIGKILL
    finally:
        away.kill()
        away.wait_empty(5.0)
        os.rmdir(away.path)


def test_a_tree_with_a_uid_limit_is_stopped_no_further_than_that_user_could(
    cgroup_mode: str, tmp_path: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    """The daemon, as root, stops a user's tree with ``Tree(uid=...)``: every
    process of the user's tree goes (the setsid escapee too), while a root
    process that carries the tree's marker -- and, with a cgroup, sits in its
    leaf -- is neither signalled nor counted: the user could not have."""
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)
    device, port_file, ready = work / "device", work / "port", work / "ready"
    device.write_bytes(b"")
    device.chmod(0o666)
    tree_id = f"t-{uuid.uuid4().hex[:12]}"
    uid = pwd.getpwnam(unpriv_user).pw_uid
    hier: Hierarchy | None = None
    leaf: Leaf | None = None
    if cgroup_mode == "cgroup":
        hier = Hierarchy.find()
        leaf = hier.create(f"holdtest-{tree_id}")
    env = minimal_env(os.environ, tree_id=tree_id)
    prog = str(unpriv_runtime / "progs" / "nasty_tree.py")
    cmd = [unpriv_python(), prog, str(device), str(port_file), str(ready), "--forkers", "1"]
    argv = as_user(unpriv_user, cmd, unpriv_runtime, {"HOLD_TREE": tree_id})

    def lines() -> list[tuple[str, int]]:
        text = ready.read_text() if ready.exists() else ""
        return [(w, int(p)) for w, _, p in (ln.rpartition(" ") for ln in text.splitlines())]

    child = spawn(argv, env=env, cgroup=leaf)
    roots: Child | None = None
    try:
        roots = spawn(["sleep", "60"], env=env, cgroup=leaf)  # root's, with the marker
        tree = Tree(
            tree_id=tree_id,
            root=child.ident,
            pgid=child.pid,
            sid=child.pid,
            leaf=leaf,
            adopts_orphans=leaf is None,
            owned=owned_pids(),
            uid=uid,
        )

        want = {"main", "child", "forker", "escapee"}
        wait_for(lambda: want <= {w for w, _ in lines()}, 20, 0.02, "the user's tree")
        users = [ProcessId.of(pid) for _, pid in lines()]
        assert all(os.stat(f"/proc/{i.pid}").st_uid == uid for i in users)
        assert roots.pid in _marked(tree_id)

        report = stop_tree(tree, grace=0.3)

        for ident in users:
            assert not ident.is_running(), f"{ident} still runs: {report.summary()}"
        assert roots.poll() is None and read_stat(roots.pid).state == "S", report.summary()
        touched = {m.pid for m in report.stopped} | {m.pid for m in report.killed}
        assert roots.pid not in touched and report.escalated == [], report.summary()
        assert report.ok and report.survivors == [], report.summary()
        assert report.outcome == "killed" and report.method == cgroup_mode, report.summary()
        assert {i.pid for i in users} <= touched, report.summary()
        assert _wait(child) == -signal.SIGKILL
    finally:
        for c in (roots, child):
            if c is not None:
                _kill(c)
        for _what, pid in lines():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if leaf is not None and hier is not None:
            leaf.kill()
            leaf.wait_empty(5.0)
            leaf.remove(hier.base)
