"""``clone3(CLONE_INTO_CGROUP)``: a child born in its leaf, and the stub where it
cannot be (another thread alive), both ending in the same place.

The spawn tests (tests/test_spawn.py) run every cgroup case through
:func:`hold_supervisor.spawn.child.spawn`; in this single-threaded test process that is
the clone3 path. Here: that it *is* taken, where it is not, and what the
child must never do between the clone and its exec (run one of our signal
handlers, keep a descriptor, outlive a failed exec).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import fresh_leaf, wait_for

from hold_supervisor.environ import minimal_env
from hold_supervisor.proc.cgroup import CgroupUnavailable, Leaf, v2_mount
from hold_supervisor.spawn import intoleaf
from hold_supervisor.spawn.child import SpawnError, spawn


@pytest.fixture
def leaf() -> Iterator[Leaf]:
    try:
        with fresh_leaf() as lf:
            yield lf
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")


def _single_threaded(check: Callable[[], str]) -> str:
    """``check()``'s answer, run where this process has one thread: here, or (beside
    another thread: pytest-xdist's, a plugin's) in a fork of this thread, which has
    only it. ``clone_into`` takes clone3 only single-threaded, on purpose."""
    if intoleaf._single_threaded():
        return check()
    intoleaf.preload()  # ctypes imported before the fork: no import lock in the child
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one thread; answers, and leaves without cleanup
        os.close(r)
        try:
            answer = check()
        except BaseException as e:
            answer = f"raised {e!r}"
        os.write(w, answer.encode())
        os._exit(0)
    os.close(w)
    try:
        answer = _read_all(r).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return answer


def _refused_skip() -> None:
    pytest.skip(f"the kernel refuses clone3(CLONE_INTO_CGROUP): errno {intoleaf._refused}")


def _env() -> dict[str, str]:
    return minimal_env(os.environ, tree_id=f"t-{uuid.uuid4().hex[:12]}")


def _read_all(fd: int, timeout: float = 10.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                return out
            out += chunk
    raise AssertionError(f"no end of output within {timeout}s: {out!r}")


def _reap(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"pid {pid} did not exit within {timeout}s")


def _rel(leaf: Leaf) -> str:
    mount = v2_mount()
    assert mount is not None
    return "/" + os.path.relpath(leaf.path, mount)


def _clone_cat(leaf: Leaf, argv: list[str]) -> tuple[int | None, bytes]:
    r, w = os.pipe()
    try:
        pid = intoleaf.clone_into(
            leaf.path,
            argv[0],
            argv,
            _env(),
            [(os.POSIX_SPAWN_DUP2, w, 1)],
            new_session=True,
            cwd=None,
        )
    finally:
        os.close(w)
    try:
        out = _read_all(r) if pid is not None else b""
    finally:
        os.close(r)
    if pid is not None:
        assert _reap(pid) == 0
    return pid, out


def test_a_single_threaded_caller_clones_straight_into_the_leaf(leaf: Leaf) -> None:
    def check() -> str:
        pid, out = _clone_cat(leaf, ["/bin/cat", "/proc/self/cgroup"])
        return "refused" if pid is None else out.decode()

    out = _single_threaded(check)
    if out == "refused":
        _refused_skip()
    assert f"0::{_rel(leaf)}" in out.splitlines(), out


def test_with_another_thread_alive_the_stub_is_used_and_the_child_still_lands_in_the_leaf(
    leaf: Leaf,
) -> None:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, args=(30,))
    other.start()
    try:
        pid, _ = _clone_cat(leaf, ["/bin/cat", "/proc/self/cgroup"])
        assert pid is None  # clone3 is never taken beside another thread
        r, w = os.pipe()
        child = spawn(["cat", "/proc/self/cgroup"], env=_env(), stdout=w, cgroup=leaf)
        os.close(w)
        out = _read_all(r)
        os.close(r)
        assert child.wait() == 0
    finally:
        stop.set()
        other.join()
    assert f"0::{_rel(leaf)}" in out.decode().splitlines()


def test_a_failed_exec_is_reported_and_leaves_no_child(leaf: Leaf, tmp_path: Path) -> None:
    script = tmp_path / "noexec"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(SpawnError) as e:
        spawn([str(script)], env=_env(), cgroup=leaf)
    assert e.value.exit_code == 126
    assert leaf.wait_empty(5.0)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # nobody left to reap: the failed child was collected


def test_a_working_directory_the_child_cannot_enter_is_an_error(leaf: Leaf, tmp_path: Path) -> None:
    # spawn() refuses a missing directory before anything runs; this is the
    # child's own chdir failing after the clone (a file: ENOTDIR for anyone).
    (tmp_path / "file").write_text("")

    def check() -> str:
        try:
            pid = intoleaf.clone_into(
                leaf.path,
                "/bin/true",
                ["true"],
                _env(),
                [],
                new_session=True,
                cwd=str(tmp_path / "file"),
            )
        except intoleaf.ChdirFailed:
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return "ChdirFailed, nobody left to reap"
            return "ChdirFailed, a child left to reap"
        return "refused" if pid is None else f"no error: pid {pid}"

    answer = _single_threaded(check)
    if answer == "refused":
        _refused_skip()
    assert answer == "ChdirFailed, nobody left to reap"
    assert leaf.wait_empty(5.0)


def test_a_signal_handler_of_ours_never_runs_in_the_child(leaf: Leaf) -> None:
    """Signals rain on the parent while it clones: a handler call in a child
    between its clone and its exec would run our code in the wrong process
    (here it would write the child's pid)."""
    log_r, log_w = os.pipe2(os.O_CLOEXEC)
    me = os.getpid()
    calls = [0]

    def handler(*_: object) -> None:
        if os.getpid() != me:
            os.write(log_w, f"{os.getpid()}\n".encode())
        else:
            calls[0] += 1

    old = signal.signal(signal.SIGUSR1, handler)
    rain = os.fork()
    if rain == 0:  # pragma: no cover -- the child only sends signals, for 1.5 s
        try:
            end = time.monotonic() + 1.5
            while time.monotonic() < end:  # a signal every ~0.1 ms: the spawns go on
                os.kill(me, signal.SIGUSR1)
                time.sleep(0.00005)
        finally:
            os._exit(0)
    spawned = 0
    try:
        while spawned < 500 and os.waitpid(rain, os.WNOHANG)[0] == 0:
            child = spawn(["true"], env=_env(), cgroup=leaf)
            assert child.wait() == 0
            spawned += 1
    finally:
        if spawned >= 500:
            _reap(rain, 60)
        signal.signal(signal.SIGUSR1, old)
        os.close(log_w)
    seen = _read_all(log_r).split()
    os.close(log_r)
    assert not seen, f"a handler ran in a child: {seen}"
    assert spawned >= 3 and calls[0] > 0  # it did rain, on spawns


def test_a_leaf_emptied_by_cgroup_kill_still_takes_a_new_child(leaf: Leaf) -> None:
    """Some kernels (6.18 here) SIGKILL a child cloned into a cgroup that
    cgroup.kill emptied before (a stopped unit's leaf, used again): the spawn
    notices the clone never ran and joins the leaf through the stub instead."""
    first = spawn(["sleep", "30"], env=_env(), cgroup=leaf)
    # Born in the leaf where clone3 is taken; through the stub (beside another
    # thread) it is in the leaf a moment after spawn returns.
    wait_for(lambda: first.pid in leaf.pids(), 10, 0.01, "the first child in the leaf")
    leaf.kill()
    assert first.collect(10) == -signal.SIGKILL
    r, w = os.pipe()
    child = spawn(
        ["sh", "-c", "echo holding; cat /proc/self/cgroup; exec sleep 30"],
        env=_env(),
        cgroup=leaf,
        stdout=w,
    )
    os.close(w)
    try:
        first_line = b""
        deadline = time.monotonic() + 10
        while b"\n0::" not in first_line and time.monotonic() < deadline:
            if select.select([r], [], [], 0.5)[0]:
                chunk = os.read(r, 4096)
                if not chunk:
                    break
                first_line += chunk
        assert first_line.startswith(b"holding\n"), first_line
        assert f"0::{_rel(leaf)}".encode() in first_line
        assert child.poll() is None
    finally:
        os.close(r)
        leaf.kill()
        child.collect(10)
